// The tessel error hierarchy. Library code reports every expected failure by throwing one of
// these (never exit/abort); process boundaries (the CLI, worker mains) catch them and turn them
// into one clear message and a non-zero exit code.
#pragma once

#include <stdexcept>
#include <string>

namespace tessel {

// Base of every error tessel throws on purpose.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
  // Short category name shown before the message, e.g. "config error".
  virtual const char* kind() const noexcept { return "error"; }
};

// A config value, option or argument is missing, unknown, malformed or inconsistent.
class ConfigError : public Error {
 public:
  using Error::Error;
  const char* kind() const noexcept override { return "config error"; }
};

// A file or socket could not be opened, read or written.
class IoError : public Error {
 public:
  using Error::Error;
  const char* kind() const noexcept override { return "I/O error"; }
};

// Stored data is truncated, fails a checksum, or does not match what its header promises.
class CorruptDataError : public Error {
 public:
  using Error::Error;
  const char* kind() const noexcept override { return "corrupt data"; }
};

// A function was called with arguments that break its contract (shapes, ranges, dtypes).
class InvalidArgumentError : public Error {
 public:
  using Error::Error;
  const char* kind() const noexcept override { return "invalid argument"; }
};

// A peer process disappeared (connection closed or reset, process exited).
class PeerLostError : public Error {
 public:
  using Error::Error;
  const char* kind() const noexcept override { return "peer lost"; }
};

// A blocking call did not complete within its timeout.
class TimeoutError : public Error {
 public:
  using Error::Error;
  const char* kind() const noexcept override { return "timeout"; }
};

// A process could not prove it belongs to the job: a control-store value, or a peer's answer in
// the pair handshake, was made without the job's shared secret (another job's process, or one
// started without the token file).
class MembershipError : public Error {
 public:
  using Error::Error;
  const char* kind() const noexcept override { return "membership"; }
};

// The requested operation is not supported (by a backend, a dtype, a build).
class UnsupportedError : public Error {
 public:
  using Error::Error;
  const char* kind() const noexcept override { return "unsupported"; }
};

}  // namespace tessel
