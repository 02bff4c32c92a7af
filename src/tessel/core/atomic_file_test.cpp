// The atomic writer respects what is at its destination: a symlink stays a link (its file is
// written), a device or a pipe is written through and stays what it was, a directory is an error.
#include "tessel/core/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "tessel/core/error.h"
#include "tessel/testing/testing.h"

namespace tessel {
namespace {

namespace fs = std::filesystem;
using tessel::testing::TempDir;

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

TEST(AtomicFileWriter, ARegularFileIsReplacedWhole) {
  TempDir dir;
  std::ofstream(dir / "out") << "old contents";
  write_file_atomically((dir / "out").string(), "new");
  EXPECT_EQ(read_all(dir / "out"), "new");
  // Nothing left beside it.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
}

TEST(AtomicFileWriter, ASymlinkStaysALinkAndItsFileIsWritten) {
  TempDir dir;
  fs::create_directories(dir / "real");
  std::ofstream(dir / "real" / "data") << "old";
  fs::create_symlink("real/data", dir / "link");
  write_file_atomically((dir / "link").string(), "new");
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(dir / "link")));
  EXPECT_EQ(read_all(dir / "real" / "data"), "new");
  // A link to nothing yet: its file is created where it points, the link is kept.
  fs::create_symlink("real/later", dir / "dangling");
  write_file_atomically((dir / "dangling").string(), "born");
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(dir / "dangling")));
  EXPECT_EQ(read_all(dir / "real" / "later"), "born");
}

TEST(AtomicFileWriter, APipeIsWrittenThroughAndStaysAPipe) {
  TempDir dir;
  const auto fifo = dir / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // The reading end opened first and non-blocking: a writer that never opens the pipe (renames
  // over it instead) makes this fail, not hang.
  const int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(reader, 0);
  {
    AtomicFileWriter out(fifo.string());
    out.write("xxxx-body", 9);
    out.write_at(0, "head", 4);  // a header filled in afterwards still comes first
    out.commit();
  }
  char buf[64] = {};
  const ssize_t n = ::read(reader, buf, sizeof buf);
  ::close(reader);
  const std::string got(buf, size_t(std::max<ssize_t>(n, 0)));
  EXPECT_EQ(got, "head-body");
  EXPECT_TRUE(fs::is_fifo(fs::symlink_status(fifo)));
  // Nobody reads it now: an error naming that, not a wait without end.
  const auto what =
      tessel::testing::error_of<IoError>([&] { write_file_atomically(fifo.string(), "lost"); });
  EXPECT_NE(what.find("no process reads it"), std::string::npos) << what;
}

TEST(AtomicFileWriter, ADeviceIsWrittenThroughAndStaysADevice) {
  TempDir dir;
  const auto null = dir / "null";
  // The same device as /dev/null (1, 3), made here: creating device nodes needs root.
  if (::mknod(null.c_str(), S_IFCHR | 0666, makedev(1, 3)) != 0)
    GTEST_SKIP() << "cannot create a device node here (needs root): " << std::strerror(errno);
  write_file_atomically(null.string(), "discarded");
  EXPECT_TRUE(fs::is_character_file(fs::symlink_status(null)));
  // Through a symlink to it too.
  fs::create_symlink(null, dir / "to-null");
  write_file_atomically((dir / "to-null").string(), "discarded");
  EXPECT_TRUE(fs::is_character_file(fs::symlink_status(null)));
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(dir / "to-null")));
}

TEST(AtomicFileWriter, ADirectoryIsAnErrorNamingIt) {
  TempDir dir;
  fs::create_directories(dir / "sub");
  const auto what = tessel::testing::error_of<IoError>(
      [&] { write_file_atomically((dir / "sub").string(), "x"); });
  EXPECT_NE(what.find("is a directory"), std::string::npos) << what;
  EXPECT_TRUE(fs::is_directory(dir / "sub"));
}

}  // namespace
}  // namespace tessel
