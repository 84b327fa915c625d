// Reading a user's file: only regular files are read, and refusing anything else never
// blocks (a FIFO with no writer would hang a plain open()).
#include "engine/common/durable_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "gtest/gtest.h"
#include "tests/util/deadline.h"
#include "tests/util/temp_dir.h"

namespace megatrain {
namespace {

using testing::RunWithin;
using testing::TempDir;
using testing::WriteFile;

bool Contains(const absl::Status& s, const std::string& what) {
  return s.message().find(what) != absl::string_view::npos;
}

TEST(ReadWholeFile, ReadsARegularFileThroughASymlink) {
  TempDir dir;
  WriteFile(dir.Join("a.json"), "{}");
  ASSERT_EQ(::symlink("a.json", dir.Join("link.json").c_str()), 0);
  absl::StatusOr<std::string> text = ReadWholeFile(dir.Join("link.json"));
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "{}");
}

TEST(ReadWholeFile, FifoIsRefusedWithoutBlocking) {
  TempDir dir;
  const std::string fifo = dir.Join("config.json");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::optional<absl::Status> s = RunWithin(5, [&] { return ReadWholeFile(fifo).status(); });
  ASSERT_TRUE(s.has_value()) << "reading a FIFO blocked";
  EXPECT_EQ(s->code(), absl::StatusCode::kInvalidArgument) << *s;
  EXPECT_TRUE(Contains(*s, fifo + " is not a regular file (a FIFO)")) << *s;
}

TEST(ReadWholeFile, CharacterDeviceIsRefused) {
  const absl::Status s = ReadWholeFile("/dev/zero").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "/dev/zero is not a regular file (a character device)")) << s;
}

TEST(ReadWholeFile, SymlinkLoopIsInvalidArgumentNotACrash) {
  TempDir dir;
  const std::string loop = dir.Join("config.json");
  ASSERT_EQ(::symlink("config.json", loop.c_str()), 0);
  const absl::Status s = ReadWholeFile(loop).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "a loop of symbolic links")) << s;
}

TEST(OpenRegularFile, ErrorsNameTheField) {
  TempDir dir;
  const absl::StatusOr<ScopedFd> folder = OpenRegularFile(dir.path(), "data.path");
  EXPECT_EQ(folder.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(folder.status(), "data.path " + dir.path() +
                                            " is not a regular file (a directory)"))
      << folder.status();
  const absl::StatusOr<ScopedFd> missing = OpenRegularFile(dir.Join("none"), "data.path");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(missing.status(), "data.path: " + dir.Join("none"))) << missing.status();
}

TEST(OpenRegularFile, ReturnsABlockingDescriptor) {
  TempDir dir;
  WriteFile(dir.Join("d.jsonl"), "x");
  absl::StatusOr<ScopedFd> fd = OpenRegularFile(dir.Join("d.jsonl"), "data.path");
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_EQ(::fcntl(fd->get(), F_GETFL) & O_NONBLOCK, 0);
  char c = 0;
  EXPECT_EQ(::read(fd->get(), &c, 1), 1);
  EXPECT_EQ(c, 'x');
}

}  // namespace
}  // namespace megatrain
