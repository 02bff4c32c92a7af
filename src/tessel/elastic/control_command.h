// What users send to a running job: one line on its control socket (`tessel ctl`), and the hosts
// file the coordinator watches. Both are read from bytes anyone with access may write, so both
// are pure functions here -- tested and fuzzed (fuzz/) without a coordinator.
#pragma once

#include <string>
#include <string_view>

namespace tessel::elastic {

struct ControlCommand {
  enum class Kind { scale, status, stop, refused };
  Kind kind = Kind::refused;
  int workers = 0;      // scale N: N (1..2^20)
  std::string refusal;  // Kind::refused: the reply, "refused: ..."
};

// "scale N", "status" or "stop", words separated by blanks. Anything else -- an unknown word,
// "scale 2.5", "scale 2abc", "scale 1 2", a count out of range, a line over 256 bytes -- is
// refused with a reply naming the problem; never an exception.
ControlCommand parse_control_command(std::string_view line);

// The worker slots a hosts file lists (elastic.hosts_file): one per line that is neither blank
// nor a comment (first non-blank character '#'). Lines end with LF (a CR before it is blank).
int count_host_slots(std::string_view text);

}  // namespace tessel::elastic
