// Shared by the fuzz targets (fuzz/README.md): the rule every target checks, and a scratch
// directory for the parsers that read files.
#pragma once

#include <spdlog/spdlog.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>

#include "tessel/core/error.h"

namespace tessel::fuzz {

// A parser of untrusted bytes returns or throws a tessel::Error; any other exception escapes the
// target and is a finding (libFuzzer and the replay both stop on it).
template <typename F>
void expect_only_tessel_errors(F&& parse) {
  try {
    parse();
  } catch (const Error&) {
  }
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// A directory of this process, removed at exit, under $TESSEL_FUZZ_SCRATCH (scripts/fuzz: a crash
// skips the removal, so it gives one it cleans up), else /dev/shm, so that millions of inputs
// written for path-only parsers never reach a disk, else the temporary directory.
class ScratchDir {
 public:
  static const ScratchDir& get() {
    static const ScratchDir dir;
    return dir;
  }
  const std::string& path() const { return path_; }

  // Writes `bytes` to path()/name and returns the file's path.
  std::string write(const std::string& name, std::string_view bytes) const {
    const std::string file = path_ + "/" + name;
    FILE* f = std::fopen(file.c_str(), "wb");
    if (f == nullptr || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) {
      // The harness cannot work without its scratch files; failing loudly beats fuzzing nothing.
      std::perror(file.c_str());
      std::abort();
    }
    std::fclose(f);
    return file;
  }

  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

 private:
  ScratchDir() {
    // Messages are part of what the targets exercise; printing each one only slows fuzzing.
    spdlog::set_level(spdlog::level::off);
    std::string base;
    if (const char* env = std::getenv("TESSEL_FUZZ_SCRATCH"); env != nullptr && *env != '\0')
      base = env;
    else if (std::filesystem::is_directory("/dev/shm"))
      base = "/dev/shm";
    else
      base = std::filesystem::temp_directory_path().string();
    std::string templ = base + "/tessel-fuzz-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) {
      std::perror("mkdtemp");
      std::abort();
    }
    path_ = templ;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }

  std::string path_;
};

}  // namespace tessel::fuzz
