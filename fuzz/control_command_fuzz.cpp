// parse_control_command and count_host_slots (elastic/control_command.h): a line on a job's
// control socket (`tessel ctl`) and the hosts file the coordinator watches. Neither may throw:
// a bad command is a refusal sent back, a bad hosts file a count.
#include "fuzz_util.h"
#include "tessel/elastic/control_command.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessel::elastic;
  const auto text = tessel::fuzz::as_text(data, size);
  const auto c = parse_control_command(text);
  if (c.kind == ControlCommand::Kind::scale && (c.workers < 1 || c.workers > (1 << 20)))
    __builtin_trap();
  if (c.kind == ControlCommand::Kind::refused && c.refusal.rfind("refused: ", 0) != 0)
    __builtin_trap();
  for (char ch : c.refusal)
    if (ch == '\n') __builtin_trap();  // one reply line
  if (count_host_slots(text) < 0) __builtin_trap();
  return 0;
}
