// The NVMe tier's file: blocks round-trip through prefetch, acquire and write-back with fewer
// buffers than units; a file cut short and a disk without room fail with the file named.
#include "engine/store/moment_disk.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace megatrain {
namespace {

using ::megatrain::testing::TempDir;
using ::testing::HasSubstr;

constexpr int64_t kBlock = 3 * 4096;

std::vector<char> Pattern(int64_t unit, int step) {
  std::vector<char> v(kBlock);
  for (int64_t i = 0; i < kBlock; ++i) v[i] = static_cast<char>((i * 7 + unit * 13 + step) & 0xff);
  return v;
}

// A scratch file in `dir` for `units` (a block each) through `buffers` buffers, every block
// written with Pattern(u, 0).
std::unique_ptr<MomentDisk> DiskOfPatterns(const TempDir& dir, const std::vector<int64_t>& units,
                                           int buffers) {
  absl::StatusOr<std::unique_ptr<MomentDisk>> disk = MomentDisk::Create(
      dir.path(), units, std::vector<int64_t>(units.size(), kBlock), buffers);
  EXPECT_TRUE(disk.ok()) << disk.status();
  if (!disk.ok()) return nullptr;
  for (int64_t u : units) {
    const std::vector<char> p = Pattern(u, 0);
    EXPECT_TRUE((*disk)->Write(u, 0, kBlock, p.data()).ok()) << u;
  }
  return std::move(*disk);
}

// Five units through two buffers, three rounds of read-modify-write in the optimizer's
// order (top unit first), then every block read back as the last round left it.
TEST(MomentDisk, BlocksSurviveRoundsOfUpdatesThroughFewerBuffers) {
  TempDir dir;
  const std::vector<int64_t> units = {2, 3, 4, 5, 6};
  std::unique_ptr<MomentDisk> disk = DiskOfPatterns(dir, units, 2);
  ASSERT_NE(disk, nullptr);
  EXPECT_EQ(disk->file_bytes(), 5 * kBlock);
  for (int step = 1; step <= 3; ++step) {
    for (auto it = units.rbegin(); it != units.rend(); ++it) {
      if (it + 1 != units.rend()) disk->Prefetch(*(it + 1));
      absl::StatusOr<char*> block = disk->Acquire(*it);
      ASSERT_TRUE(block.ok()) << block.status();
      EXPECT_EQ(std::memcmp(*block, Pattern(*it, step - 1).data(), kBlock), 0)
          << "unit " << *it << " before step " << step;
      const std::vector<char> next = Pattern(*it, step);
      std::memcpy(*block, next.data(), kBlock);
      disk->Updated(*it, 600, 1000);  // two pieces of a 1000-element unit
      disk->Updated(*it, 400, 1000);
    }
  }
  ASSERT_TRUE(disk->Flush().ok());
  for (int64_t u : units) {
    std::vector<char> got(100);
    ASSERT_TRUE(disk->Read(u, 5000, 100, got.data()).ok());  // unaligned: through a bounce
    EXPECT_EQ(std::memcmp(got.data(), Pattern(u, 3).data() + 5000, 100), 0) << u;
  }
  EXPECT_GE(disk->bytes_read(), 15 * kBlock);
  EXPECT_GE(disk->bytes_written(), 20 * kBlock);
  const std::string path = disk->path();
  EXPECT_TRUE(std::filesystem::exists(path));
  disk.reset();
  EXPECT_FALSE(std::filesystem::exists(path)) << "the scratch file outlived its job";
}

// With clipping the gradients land top layer first (and are prefetched in that order) but
// the updates run bottom first: Acquire of a unit while every buffer holds a prefetched,
// untouched block must take one of those buffers back instead of waiting for ever.
TEST(MomentDisk, AcquireTakesBackAPrefetchedBufferWhenNoneIsFree) {
  TempDir dir;
  const std::vector<int64_t> units = {1, 2, 3, 4, 5};
  std::unique_ptr<MomentDisk> disk = DiskOfPatterns(dir, units, 2);
  ASSERT_NE(disk, nullptr);
  disk->Prefetch(5);
  disk->Prefetch(4);  // both buffers now hold blocks the next updates do not want first
  for (int64_t u : units) {  // forward order
    absl::StatusOr<char*> block = disk->Acquire(u);
    ASSERT_TRUE(block.ok()) << block.status();
    EXPECT_EQ(std::memcmp(*block, Pattern(u, 0).data(), kBlock), 0) << u;
    const std::vector<char> next = Pattern(u, 1);
    std::memcpy(*block, next.data(), kBlock);
    disk->Updated(u, 1, 1);
  }
  ASSERT_TRUE(disk->Flush().ok());
  for (int64_t u : units) {
    std::vector<char> got(kBlock);
    ASSERT_TRUE(disk->Read(u, 0, kBlock, got.data()).ok());
    EXPECT_EQ(std::memcmp(got.data(), Pattern(u, 1).data(), kBlock), 0) << u;
  }
}

TEST(MomentDisk, AFileCutShortFailsTheReadNamingIt) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<MomentDisk>> disk = MomentDisk::Create(dir.path(), {1}, {kBlock}, 1);
  ASSERT_TRUE(disk.ok()) << disk.status();
  ASSERT_EQ(truncate((*disk)->path().c_str(), 0), 0);
  absl::StatusOr<char*> block = (*disk)->Acquire(1);
  ASSERT_FALSE(block.ok());
  EXPECT_THAT(std::string(block.status().message()), HasSubstr((*disk)->path()));
  EXPECT_THAT(std::string(block.status().message()), HasSubstr("cut short"));
  EXPECT_FALSE((*disk)->Flush().ok());  // and it stays failed
}

TEST(MomentDisk, ADiskWithoutRoomIsRefusedAtTheStart) {
  TempDir dir;
  // A petabyte: more than any test machine's disk.
  absl::StatusOr<std::unique_ptr<MomentDisk>> disk =
      MomentDisk::Create(dir.path(), {1}, {int64_t{1} << 50}, 1);
  ASSERT_FALSE(disk.ok());
  EXPECT_EQ(disk.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(disk.status().message()), HasSubstr("optimizer.nvme_dir: no room for"));
  EXPECT_THAT(std::string(disk.status().message()), HasSubstr(dir.path()));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "a refused file was left behind";
}

}  // namespace
}  // namespace megatrain
