// Tests for safetensors round trips, sharded folders and ModelTensorReader. Bad inputs
// are in safetensors_errors_test.cc.
#include "engine/model/safetensors.h"

#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "engine/common/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/engine/model/test_files.h"

namespace megatrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using namespace testing_files;  // NOLINT: test helpers
using Json = nlohmann::json;

const std::map<std::string, std::string> kPt = {{"format", "pt"}};

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// Three tensors of 1024 fp32 each (4 KiB), values seeded by `seed`.
struct ThreeTensors {
  explicit ThreeTensors(float seed) {
    for (int t = 0; t < 3; ++t) {
      data[t].resize(1024);
      for (int i = 0; i < 1024; ++i) data[t][i] = seed + t * 1000.0f + i * 0.5f;
    }
  }
  std::vector<TensorToWrite> ToWrite() const {
    return {{"model.embed_tokens.weight", DType::kF32, {32, 32}, data[0].data()},
            {"model.layers.0.mlp.up_proj.weight", DType::kF32, {16, 64}, data[1].data()},
            {"lm_head.weight", DType::kF32, {1024}, data[2].data()}};
  }
  std::vector<float> data[3];
};

TEST(SafetensorsTest, RoundTripsBf16F16AndF32Values) {
  const std::string path = MakeTempDir() + "/model.safetensors";
  const std::vector<float> bf16_values = {1.0f, -2.5f, 0.15625f, 3.0e38f, -0.0f, 1.0e-20f};
  std::vector<uint16_t> bf16;
  for (float v : bf16_values) bf16.push_back(FloatToBf16(v));
  // 0.5, -1.25, 65504 (largest f16), 2^-24 (smallest subnormal), -inf, 1.0
  const std::vector<uint16_t> f16 = {0x3800, 0xBD00, 0x7BFF, 0x0001, 0xFC00, 0x3C00};
  const std::vector<float> f32 = {3.14159f, -1e-30f, 7.0f, 123456.789f};
  ASSERT_TRUE(WriteSafetensors(path,
                               {{"a.bf16", DType::kBF16, {2, 3}, bf16.data()},
                                {"b.f16", DType::kF16, {6}, f16.data()},
                                {"c.f32", DType::kF32, {2, 2}, f32.data()}},
                               kPt)
                  .ok());

  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata(), kPt);
  ASSERT_EQ(file->tensors().size(), 3u);
  EXPECT_EQ(file->tensors()[0].name, "a.bf16");  // ordered by offset = write order
  EXPECT_EQ(file->tensors()[2].name, "c.f32");

  const TensorInfo* a = file->Find("a.bf16");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::kBF16);
  EXPECT_THAT(a->shape, ElementsAre(2, 3));
  EXPECT_EQ(a->num_elements(), 6);
  EXPECT_EQ(a->num_bytes, 12u);
  EXPECT_EQ(a->offset % 8, 0u);  // header padded to a multiple of 8
  std::vector<float> out(6);
  ASSERT_TRUE(file->ReadAsFloat(*a, out.data()).ok());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], Bf16ToFloat(bf16[i])) << i;
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.5f);
  EXPECT_TRUE(std::signbit(out[4]));

  ASSERT_TRUE(file->ReadAsFloat(*file->Find("b.f16"), out.data()).ok());
  EXPECT_THAT(out, ElementsAre(0.5f, -1.25f, 65504.0f, std::ldexp(1.0f, -24),
                               -std::numeric_limits<float>::infinity(), 1.0f));

  std::vector<float> out32(4);
  ASSERT_TRUE(file->ReadAsFloat(*file->Find("c.f32"), out32.data()).ok());
  EXPECT_EQ(out32, f32);

  std::vector<uint16_t> raw(6);
  ASSERT_TRUE(file->ReadRaw(*a, raw.data()).ok());
  EXPECT_EQ(raw, bf16);
  EXPECT_EQ(file->Find("missing"), nullptr);
}

TEST(SafetensorsTest, HeaderIsPaddedWithSpacesToAMultipleOf8) {
  const std::string path = MakeTempDir() + "/x.safetensors";
  const float v = 1.0f;
  ASSERT_TRUE(WriteSafetensors(path, {{"odd_name_x", DType::kF32, {1}, &v}}, {}).ok());
  const std::string bytes = ReadFile(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  const std::string header = bytes.substr(8, n);
  EXPECT_FALSE(Json::parse(header).contains("__metadata__"));  // omitted when empty
  EXPECT_EQ(bytes.size(), 8 + n + 4);
  EXPECT_FALSE(Exists(path + ".tmp"));
}

TEST(SafetensorsTest, LargeBf16TensorConvertsInPlaceCorrectly) {
  const std::string path = MakeTempDir() + "/big.safetensors";
  const int64_t n = 1 << 20;
  std::vector<uint16_t> bf16(n);
  for (int64_t i = 0; i < n; ++i) bf16[i] = FloatToBf16(static_cast<float>(i % 4099) - 2049.0f);
  ASSERT_TRUE(WriteSafetensors(path, {{"w", DType::kBF16, {1024, 1024}, bf16.data()}}, kPt).ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<float> out(n);
  ASSERT_TRUE(file->ReadAsFloat(file->tensors()[0], out.data()).ok());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], Bf16ToFloat(bf16[i])) << i;
}

TEST(SafetensorsTest, ScalarAndEmptyTensorsRoundTrip) {
  const std::string path = MakeTempDir() + "/s.safetensors";
  const float scalar = 42.0f;
  ASSERT_TRUE(WriteSafetensors(path, {{"empty", DType::kF32, {0, 8}, nullptr},
                                      {"scalar", DType::kF32, {}, &scalar}}, kPt)
                  .ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->Find("empty")->num_bytes, 0u);
  float out = 0;
  ASSERT_TRUE(file->ReadAsFloat(*file->Find("scalar"), &out).ok());
  EXPECT_EQ(out, 42.0f);
}

TEST(SafetensorsTest, DuplicateTensorNamesAreRefusedOnWrite) {
  const float v = 1.0f;
  absl::Status s = WriteSafetensors(MakeTempDir() + "/d.safetensors",
                                    {{"w", DType::kF32, {1}, &v}, {"w", DType::kF32, {1}, &v}},
                                    kPt);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'w'"));
}

TEST(SafetensorsTest, WriteIntoMissingFolderReportsErrno) {
  const float v = 1.0f;
  absl::Status s =
      WriteSafetensors("/nonexistent/megatrain/x.safetensors", {{"w", DType::kF32, {1}, &v}}, kPt);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("/nonexistent/megatrain/x.safetensors"));
  EXPECT_THAT(s.message(), HasSubstr("No such file"));
}

TEST(SafetensorsTest, ShardedWriteWritesShardsAndIndexAndReaderReadsAcrossShards) {
  const std::string dir = MakeTempDir();
  ThreeTensors t(1.0f);
  ASSERT_TRUE(WriteShardedSafetensors(dir, "model", t.ToWrite(), 5000, kPt).ok());
  for (const char* shard : {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                            "model-00003-of-00003.safetensors"}) {
    EXPECT_TRUE(Exists(dir + "/" + shard)) << shard;
  }
  EXPECT_FALSE(Exists(dir + "/model.safetensors"));
  Json index = Json::parse(ReadFile(dir + "/model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], 3 * 4096);
  EXPECT_EQ(index["weight_map"]["lm_head.weight"], "model-00003-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["model.embed_tokens.weight"], "model-00001-of-00003.safetensors");

  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_THAT(reader->names(), ElementsAre("lm_head.weight", "model.embed_tokens.weight",
                                           "model.layers.0.mlp.up_proj.weight"));
  EXPECT_TRUE(reader->Has("lm_head.weight"));
  EXPECT_FALSE(reader->Has("model.norm.weight"));
  EXPECT_THAT(reader->FileOf("lm_head.weight"), HasSubstr("model-00003-of-00003"));
  std::vector<float> out(1024);
  ASSERT_TRUE(reader->ReadAsFloat("model.layers.0.mlp.up_proj.weight", {16, 64}, out.data()).ok());
  EXPECT_EQ(out, t.data[1]);
  ASSERT_TRUE(reader->ReadAsFloat("lm_head.weight", {1024}, out.data()).ok());
  EXPECT_EQ(out, t.data[2]);
  ASSERT_TRUE(SafetensorsFile::Open(dir + "/model-00002-of-00003.safetensors").ok());
  EXPECT_EQ(SafetensorsFile::Open(dir + "/model-00002-of-00003.safetensors")->metadata(), kPt);
}

TEST(SafetensorsTest, ShardedWriteThatFitsOneShardWritesModelSafetensorsAndRemovesStaleIndex) {
  const std::string dir = MakeTempDir();
  ThreeTensors t(2.0f);
  ASSERT_TRUE(WriteShardedSafetensors(dir, "model", t.ToWrite(), 5000, kPt).ok());
  ASSERT_TRUE(Exists(dir + "/model.safetensors.index.json"));
  ASSERT_TRUE(WriteShardedSafetensors(dir, "model", t.ToWrite(), 1 << 20, kPt).ok());
  EXPECT_TRUE(Exists(dir + "/model.safetensors"));
  EXPECT_FALSE(Exists(dir + "/model.safetensors.index.json"));
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_THAT(reader->FileOf("lm_head.weight"), HasSubstr("/model.safetensors"));
}

TEST(SafetensorsTest, TensorLargerThanMaxShardGetsAShardOfItsOwn) {
  const std::string dir = MakeTempDir();
  ThreeTensors t(3.0f);
  ASSERT_TRUE(WriteShardedSafetensors(dir, "model", t.ToWrite(), 100, kPt).ok());
  EXPECT_TRUE(Exists(dir + "/model-00003-of-00003.safetensors"));
  ASSERT_TRUE(ModelTensorReader::OpenFolder(dir).ok());
}

// One file of a folder without an index: a single fp32 scalar `tensor` = `value`.
struct ScalarFile {
  std::string file, tensor;
  float value;
};

// Writes `files` into a fresh folder and reads `tensor` ([1]) through its ModelTensorReader.
absl::StatusOr<float> ReadScalarFromFolder(const std::vector<ScalarFile>& files,
                                           const std::string& tensor) {
  const std::string dir = MakeTempDir();
  for (const ScalarFile& f : files) {
    const absl::Status written =
        WriteSafetensors(dir + "/" + f.file, {{f.tensor, DType::kF32, {1}, &f.value}}, kPt);
    if (!written.ok()) return written;
  }
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(dir);
  if (!reader.ok()) return reader.status();
  float out = 0;
  const absl::Status read = reader->ReadAsFloat(tensor, {1}, &out);
  if (!read.ok()) return read;
  return out;
}

TEST(SafetensorsTest, FolderWithoutIndexOrModelSafetensorsReadsEveryFile) {
  absl::StatusOr<float> b = ReadScalarFromFolder(
      {{"part-a.safetensors", "a", 1.0f}, {"part-b.safetensors", "b", 2.0f}}, "b");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*b, 2.0f);
}

TEST(SafetensorsTest, ModelSafetensorsWinsOverOtherFilesWithoutIndex) {
  absl::StatusOr<float> w = ReadScalarFromFolder(
      {{"model.safetensors", "w", 1.0f}, {"consolidated.safetensors", "w", 2.0f}}, "w");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, 1.0f);
}

TEST(SafetensorsTest, ConcurrentReadsOfDifferentTensorsAgree) {
  const std::string dir = MakeTempDir();
  constexpr int kTensors = 16;
  std::vector<std::vector<uint16_t>> data(kTensors, std::vector<uint16_t>(4096));
  std::vector<TensorToWrite> tensors;
  for (int t = 0; t < kTensors; ++t) {
    for (int i = 0; i < 4096; ++i) data[t][i] = FloatToBf16(static_cast<float>(t * 10000 + i));
    tensors.push_back({"t" + std::to_string(t), DType::kBF16, {64, 64}, data[t].data()});
  }
  ASSERT_TRUE(WriteShardedSafetensors(dir, "model", tensors, 3 * 8192, kPt).ok());
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::vector<int> bad(kTensors, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kTensors; ++t) {
    threads.emplace_back([&, t] {
      std::vector<float> out(4096);
      for (int rep = 0; rep < 20; ++rep) {
        if (!reader->ReadAsFloat("t" + std::to_string(t), {64, 64}, out.data()).ok()) ++bad[t];
        for (int i = 0; i < 4096; ++i) bad[t] += out[i] != Bf16ToFloat(data[t][i]);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_THAT(bad, ::testing::Each(0));
}

}  // namespace
}  // namespace megatrain
