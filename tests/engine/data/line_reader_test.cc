// LineReader: lines as std::getline splits them, a bound on one line's length, and only
// regular files, refused without blocking.
#include "engine/data/line_reader.h"

#include <sys/stat.h>

#include <optional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/util/deadline.h"
#include "tests/util/temp_dir.h"

namespace megatrain {
namespace {

using testing::TempDir;
using testing::WriteFile;

absl::StatusOr<std::vector<std::string>> Lines(const std::string& path, int64_t max_bytes) {
  absl::StatusOr<LineReader> reader = LineReader::Open(path, "data.path", max_bytes);
  if (!reader.ok()) return reader.status();
  std::vector<std::string> lines;
  std::string line;
  for (;;) {
    absl::StatusOr<bool> more = reader->Next(&line);
    if (!more.ok()) return more.status();
    if (!*more) return lines;
    lines.push_back(line);
  }
}

TEST(LineReader, SplitsAsGetlineDoes) {
  TempDir dir;
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"", {}},
      {"a", {"a"}},
      {"a\n", {"a"}},
      {"a\nb", {"a", "b"}},
      {"\n\nx\n", {"", "", "x"}},
      {"a\r\n", {"a\r"}},
  };
  for (const auto& [text, want] : cases) {
    WriteFile(dir.Join("d.jsonl"), text);
    absl::StatusOr<std::vector<std::string>> got = Lines(dir.Join("d.jsonl"), 1 << 20);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, want) << "text '" << text << "'";
  }
}

TEST(LineReader, LinesAcrossManyReadsAreWhole) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 3000; ++i) text += std::string(1000 + i % 7, 'a' + i % 26) + "\n";
  WriteFile(dir.Join("d.jsonl"), text);  // ~3 MB: several reads, lines cut across them
  absl::StatusOr<std::vector<std::string>> got = Lines(dir.Join("d.jsonl"), 1 << 20);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 3000u);
  for (int i = 0; i < 3000; ++i) {
    ASSERT_EQ((*got)[i], std::string(1000 + i % 7, 'a' + i % 26)) << i;
  }
}

TEST(LineReader, ALineOverTheBoundIsRefusedNamingFileLineAndLimit) {
  TempDir dir;
  WriteFile(dir.Join("d.jsonl"), "short\n" + std::string(5000, 'x') + "\nafter\n");
  absl::StatusOr<std::vector<std::string>> got = Lines(dir.Join("d.jsonl"), 4096);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(got.status().message().find("data.path: " + dir.Join("d.jsonl") +
                                        ":2: line 2 is longer than 4096 bytes"),
            std::string::npos)
      << got.status();
  // A file with no newline at all is refused once the bound is passed, not read whole.
  WriteFile(dir.Join("blob"), std::string(3 << 20, 'z'));
  got = Lines(dir.Join("blob"), 1 << 20);
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find(":1: line 1 is longer than 1 MiB"), std::string::npos)
      << got.status();
  // Exactly at the bound is fine.
  WriteFile(dir.Join("edge"), std::string(4096, 'y'));
  EXPECT_TRUE(Lines(dir.Join("edge"), 4096).ok());
}

TEST(LineReader, FifoAndDeviceAreRefusedWithoutBlocking) {
  TempDir dir;
  const std::string fifo = dir.Join("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::optional<absl::Status> s =
      testing::RunWithin(5, [&] { return LineReader::Open(fifo, "data.path").status(); });
  ASSERT_TRUE(s.has_value()) << "opening a FIFO blocked";
  EXPECT_EQ(s->code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s->message().find("data.path " + fifo + " is not a regular file (a FIFO)"),
            std::string::npos) << *s;
  const absl::Status zero = LineReader::Open("/dev/zero", "data.path").status();
  EXPECT_NE(zero.message().find("data.path /dev/zero is not a regular file (a character device)"),
            std::string::npos) << zero;
}

}  // namespace
}  // namespace megatrain
