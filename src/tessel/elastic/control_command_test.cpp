#include "tessel/elastic/control_command.h"

#include <gtest/gtest.h>

#include <string>

namespace tessel::elastic {
namespace {

using Kind = ControlCommand::Kind;

TEST(ControlCommand, ScaleStatusAndStopAndEverythingElseRefused) {
  EXPECT_EQ(parse_control_command("status").kind, Kind::status);
  EXPECT_EQ(parse_control_command("  stop \r\n").kind, Kind::stop);
  const auto s = parse_control_command("scale\t3");
  EXPECT_EQ(s.kind, Kind::scale);
  EXPECT_EQ(s.workers, 3);
  for (const char* bad : {"scale 2.5", "scale 2abc", "scale 1 2", "scale", "scale 0",
                          "scale 1048577", "scale -1", "status now", "stop 1", "", "SCALE 2"}) {
    const auto c = parse_control_command(bad);
    EXPECT_EQ(c.kind, Kind::refused) << bad;
    EXPECT_EQ(c.refusal.rfind("refused: ", 0), 0u) << bad << ": " << c.refusal;
  }
  // A long or binary line: refused, and the reply shows no control bytes.
  EXPECT_EQ(parse_control_command(std::string(300, 'x')).kind, Kind::refused);
  const auto binary = parse_control_command(std::string("\x01\x1b[2Jboom", 9));
  EXPECT_EQ(binary.kind, Kind::refused);
  for (char c : binary.refusal) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << int(c);
}

TEST(ControlCommand, HostSlotsAreTheLinesThatAreNeitherBlankNorComments) {
  EXPECT_EQ(count_host_slots(""), 0);
  EXPECT_EQ(count_host_slots("a\nb\n"), 2);
  EXPECT_EQ(count_host_slots("a\nb"), 2);  // no final newline
  EXPECT_EQ(count_host_slots("# hosts\n\n  \t\r\nnode1 # slot\r\n  # off\nnode2\n"), 2);
  EXPECT_EQ(count_host_slots(std::string("x\0y\n", 4)), 1);
}

}  // namespace
}  // namespace tessel::elastic
