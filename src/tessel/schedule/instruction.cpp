#include "tessel/schedule/instruction.h"

#include <fmt/format.h>

#include <array>
#include <charconv>
#include <sstream>
#include <utility>

#include "tessel/core/check.h"

namespace tessel::schedule {
namespace {

// Longer codes first so that "Bi" is not read as "B" followed by garbage.
constexpr std::array<std::pair<std::string_view, Op>, 10> kCodes = {{
    {"sendA", Op::send_activation},
    {"recvA", Op::recv_activation},
    {"sendG", Op::send_grad},
    {"recvG", Op::recv_grad},
    {"step", Op::optimizer_step},
    {"Bi", Op::backward_input},
    {"Bw", Op::backward_weight},
    {"F", Op::forward},
    {"B", Op::backward},
    {"R", Op::recompute},
}};

// Reads a non-negative integer at the front of `s` and drops it; false if there is none.
bool take_int(std::string_view& s, int& out) {
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  if (ec != std::errc() || out < 0) return false;
  s.remove_prefix(size_t(end - s.data()));
  return true;
}

bool take_char(std::string_view& s, char c) {
  if (s.empty() || s.front() != c) return false;
  s.remove_prefix(1);
  return true;
}

bool parse_token(std::string_view s, Instruction& out) {
  for (auto [code, op] : kCodes) {
    if (!s.starts_with(code)) continue;
    s.remove_prefix(code.size());
    out = Instruction{op};
    if (op == Op::optimizer_step) return s.empty();
    if (!take_int(s, out.micro_batch) || !take_char(s, '.') || !take_int(s, out.chunk))
      return false;
    if (is_send(op) && !(take_char(s, '>') && take_int(s, out.peer))) return false;
    if (is_recv(op) && !(take_char(s, '<') && take_int(s, out.peer))) return false;
    return s.empty();
  }
  return false;
}

// Reads "key=<int>" from a header word.
int header_int(const std::string& word, std::string_view key, int line) {
  std::string_view s = word;
  int value = 0;
  bool ok = s.starts_with(key);
  if (ok) s.remove_prefix(key.size());
  if (!ok || !take_char(s, '=') || !take_int(s, value) || !s.empty())
    TESSEL_THROW(InvalidArgumentError, "schedule text line {}: expected {}=<int>, got '{}'", line,
                 key, word);
  return value;
}

}  // namespace

bool is_compute(Op op) {
  return op == Op::forward || op == Op::backward || op == Op::backward_input ||
         op == Op::backward_weight || op == Op::recompute;
}
bool is_send(Op op) {
  return op == Op::send_activation || op == Op::send_grad;
}
bool is_recv(Op op) {
  return op == Op::recv_activation || op == Op::recv_grad;
}

std::string_view op_code(Op op) {
  for (auto [code, o] : kCodes)
    if (o == op) return code;
  return "?";
}

std::string to_string(const Instruction& in) {
  if (in.op == Op::optimizer_step) return "step";
  std::string s = fmt::format("{}{}.{}", op_code(in.op), in.micro_batch, in.chunk);
  if (is_send(in.op)) s += fmt::format(">{}", in.peer);
  if (is_recv(in.op)) s += fmt::format("<{}", in.peer);
  return s;
}

std::string to_string(const Schedule& schedule) {
  std::string s = fmt::format("schedule {} stages={} micro_batches={} chunks={}{}\n", schedule.name,
                              schedule.stages, schedule.micro_batches, schedule.chunks,
                              schedule.placement == Placement::v_shape ? " placement=v" : "");
  for (size_t stage = 0; stage < schedule.per_stage.size(); ++stage) {
    s += fmt::format("stage {}:", stage);
    for (const Instruction& in : schedule.per_stage[stage]) s += " " + to_string(in);
    s += "\n";
  }
  return s;
}

Schedule parse_schedule(std::string_view text) {
  std::istringstream lines{std::string(text)};
  std::string line;
  int line_no = 0;
  Schedule schedule;
  bool have_header = false;
  while (std::getline(lines, line)) {
    ++line_no;
    std::istringstream words(line);
    std::string word;
    if (!(words >> word)) continue;  // blank line
    if (!have_header) {
      std::string stages, micro_batches, chunks, placement, extra;
      if (words >> schedule.name >> stages >> micro_batches >> chunks && (words >> placement)) {
        if (placement == "placement=v")
          schedule.placement = Placement::v_shape;
        else if (placement != "placement=interleaved")
          extra = placement;
      }
      if (word != "schedule" || chunks.empty() || !extra.empty() || (words >> extra))
        TESSEL_THROW(InvalidArgumentError,
                     "schedule text line {}: expected 'schedule <name> stages=<p> "
                     "micro_batches=<m> chunks=<v> [placement=v]', got '{}'",
                     line_no, line);
      schedule.stages = header_int(stages, "stages", line_no);
      schedule.micro_batches = header_int(micro_batches, "micro_batches", line_no);
      schedule.chunks = header_int(chunks, "chunks", line_no);
      have_header = true;
      continue;
    }
    std::string expected = fmt::format("{}:", schedule.per_stage.size());
    std::string label;
    if (word != "stage" || !(words >> label) || label != expected)
      TESSEL_THROW(InvalidArgumentError, "schedule text line {}: expected 'stage {}', got '{}'",
                   line_no, expected, line);
    std::vector<Instruction>& list = schedule.per_stage.emplace_back();
    while (words >> word) {
      if (!parse_token(word, list.emplace_back()))
        TESSEL_THROW(InvalidArgumentError,
                     "schedule text line {}: bad instruction '{}' (expected e.g. F3.0, Bi3.0, "
                     "sendA3.0>1, recvG3.0<1 or step)",
                     line_no, word);
    }
  }
  TESSEL_CHECK(have_header, InvalidArgumentError, "schedule text has no 'schedule' header line");
  return schedule;
}

}  // namespace tessel::schedule
