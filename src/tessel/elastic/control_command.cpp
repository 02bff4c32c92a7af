#include "tessel/elastic/control_command.h"

#include <fmt/format.h>

#include <vector>

#include "tessel/core/error.h"
#include "tessel/core/parse_number.h"

namespace tessel::elastic {
namespace {

bool blank(char c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

std::vector<std::string_view> words_of(std::string_view line) {
  std::vector<std::string_view> words;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && blank(line[i])) ++i;
    const size_t start = i;
    while (i < line.size() && !blank(line[i])) ++i;
    if (i > start) words.push_back(line.substr(start, i - start));
  }
  return words;
}

ControlCommand refused(std::string why) {
  ControlCommand c;
  c.refusal = "refused: " + std::move(why);
  return c;
}

// A word as it may appear in a reply: printable ASCII only, at most 32 characters.
std::string shown(std::string_view word) {
  std::string out;
  for (char c : word.substr(0, 32)) out += c >= 0x20 && c < 0x7f ? c : '?';
  return out;
}

}  // namespace

ControlCommand parse_control_command(std::string_view line) {
  if (line.size() > 256) return refused("a command is one short line (scale N, status, stop)");
  const auto words = words_of(line);
  const std::string_view cmd = words.empty() ? std::string_view() : words[0];
  if ((cmd == "status" || cmd == "stop") && words.size() == 1) {
    ControlCommand c;
    c.kind = cmd == "status" ? ControlCommand::Kind::status : ControlCommand::Kind::stop;
    return c;
  }
  if (cmd != "scale")
    return refused(fmt::format("unknown command '{}'; try: scale N, status, stop", shown(cmd)));
  // Exactly one whole number: "scale 2.5", "scale 2abc" and "scale 1 2" are refused, not read as
  // 2, 2 and 1.
  if (words.size() != 2) return refused("scale takes one worker count (scale N)");
  try {
    ControlCommand c;
    c.kind = ControlCommand::Kind::scale;
    c.workers =
        int(parse_integer(std::string(words[1]), "the worker count of `scale N`", 1, 1 << 20));
    return c;
  } catch (const ConfigError& e) {
    return refused(e.what());
  }
}

int count_host_slots(std::string_view text) {
  int slots = 0;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    const auto line = text.substr(at, end - at);
    const size_t first = line.find_first_not_of(" \t\r");
    if (first != std::string_view::npos && line[first] != '#') ++slots;
    at = end + 1;
  }
  return slots;
}

}  // namespace tessel::elastic
