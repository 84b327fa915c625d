// Tests that bad safetensors files and model folders fail when opened, with messages
// naming the file and the tensor at fault.
#include <unistd.h>

#include <string>
#include <vector>

#include "engine/model/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/engine/model/test_files.h"

namespace megatrain {
namespace {

using ::testing::HasSubstr;
using namespace testing_files;  // NOLINT: test helpers
using Json = nlohmann::json;

const std::map<std::string, std::string> kPt = {{"format", "pt"}};

// A file with `header` and `data_bytes` zero bytes of data; returns its path.
std::string WriteRaw(const Json& header, size_t data_bytes) {
  const std::string path = MakeTempDir() + "/model.safetensors";
  WriteFile(path, RawSafetensors(header.dump(), std::string(data_bytes, '\0')));
  return path;
}

Json Entry(const char* dtype, std::vector<int64_t> shape, uint64_t begin, uint64_t end) {
  return {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {begin, end}}};
}

// Open must fail with InvalidArgument naming `path` and, when given, `tensor`.
void ExpectOpenFails(const std::string& path, const std::string& tensor,
                     const std::string& also = "") {
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_FALSE(file.ok()) << "opened " << path;
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
  EXPECT_THAT(file.status().message(), HasSubstr(path));
  if (!tensor.empty()) {
    EXPECT_THAT(file.status().message(), HasSubstr("'" + tensor + "'"));
  }
  if (!also.empty()) {
    EXPECT_THAT(file.status().message(), HasSubstr(also));
  }
}

TEST(SafetensorsErrorsTest, FileShorterThan8BytesIsRefused) {
  const std::string path = MakeTempDir() + "/short.safetensors";
  WriteFile(path, "abc");
  ExpectOpenFails(path, "", "3 bytes");
}

TEST(SafetensorsErrorsTest, HeaderLengthBeyondFileIsRefused) {
  const std::string path = MakeTempDir() + "/len.safetensors";
  std::string bytes = RawSafetensors("{}", "");
  bytes[0] = 100;  // claims 100 header bytes; there are 2
  WriteFile(path, bytes);
  ExpectOpenFails(path, "", "header length 100");
}

TEST(SafetensorsErrorsTest, HeaderThatIsNotJsonIsRefused) {
  const std::string path = MakeTempDir() + "/json.safetensors";
  WriteFile(path, RawSafetensors("{\"w\": {\"dtype\": ", ""));
  ExpectOpenFails(path, "", "not valid JSON");
}

// The parser's message quotes the bytes it last read: escaped, never raw binary.
TEST(SafetensorsErrorsTest, HeaderThatIsNotUtf8IsQuotedEscaped) {
  const std::string path = MakeTempDir() + "/binary.safetensors";
  WriteFile(path, RawSafetensors("\xff\xfe\x01{", ""));
  ExpectOpenFails(path, "", "not valid JSON");
  const std::string message(SafetensorsFile::Open(path).status().message());
  EXPECT_THAT(message, HasSubstr("\\xff")) << message;
  for (const char c : message) {
    const auto byte = static_cast<unsigned char>(c);
    EXPECT_TRUE(byte >= 0x20 && byte < 0x7f) << "byte " << static_cast<int>(byte) << " in "
                                             << message;
  }
}

TEST(SafetensorsErrorsTest, HeaderThatIsNotAnObjectIsRefused) {
  ExpectOpenFails(WriteRaw(Json::array({1, 2}), 0), "", "not an object");
}

TEST(SafetensorsErrorsTest, OffsetsPastTheDataBufferAreRefusedAsTruncated) {
  const std::string path = WriteRaw({{"model.norm.weight", Entry("F32", {8}, 0, 32)}}, 20);
  ExpectOpenFails(path, "model.norm.weight", "truncated");
}

TEST(SafetensorsErrorsTest, TruncatedDownloadIsRefusedNamingTheLastTensor) {
  const std::string path = MakeTempDir() + "/model.safetensors";
  std::vector<float> a(64, 1.0f), b(64, 2.0f);
  ASSERT_TRUE(WriteSafetensors(path, {{"first", DType::kF32, {64}, a.data()},
                                      {"second", DType::kF32, {64}, b.data()}}, kPt)
                  .ok());
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(ReadFile(path).size() - 10)), 0);
  ExpectOpenFails(path, "second", "truncated");
}

TEST(SafetensorsErrorsTest, OverlappingTensorsAreRefusedNamingBoth) {
  const std::string path = WriteRaw({{"a", Entry("F32", {4}, 0, 16)},
                                     {"b", Entry("F32", {4}, 12, 28)}},
                                    28);
  ExpectOpenFails(path, "b", "'a'");
}

TEST(SafetensorsErrorsTest, TensorInsideAnotherIsRefusedAsOverlap) {
  const std::string path = WriteRaw({{"big", Entry("F32", {8}, 0, 32)},
                                     {"small", Entry("F32", {1}, 8, 12)}},
                                    32);
  ExpectOpenFails(path, "small", "overlap");
}

TEST(SafetensorsErrorsTest, ShapeDisagreeingWithByteCountIsRefused) {
  const std::string path = WriteRaw({{"model.embed_tokens.weight", Entry("BF16", {4, 4}, 0, 16)}}, 16);
  ExpectOpenFails(path, "model.embed_tokens.weight", "[4, 4]");
}

TEST(SafetensorsErrorsTest, UnknownDtypeIsRefused) {
  ExpectOpenFails(WriteRaw({{"w", Entry("Q4_K", {4}, 0, 8)}}, 8), "w", "Q4_K");
}

TEST(SafetensorsErrorsTest, SpecDtypeMegatrainDoesNotReadIsRefused) {
  ExpectOpenFails(WriteRaw({{"position_ids", Entry("I64", {4}, 0, 32)}}, 32), "position_ids",
                  "I64");
}

TEST(SafetensorsErrorsTest, BeginAfterEndIsRefused) {
  ExpectOpenFails(WriteRaw({{"w", Entry("F32", {0}, 8, 4)}}, 8), "w", "begin > end");
}

TEST(SafetensorsErrorsTest, MissingDataOffsetsIsRefused) {
  ExpectOpenFails(WriteRaw({{"w", {{"dtype", "F32"}, {"shape", {1}}}}}, 4), "w", "data_offsets");
}

TEST(SafetensorsErrorsTest, NegativeShapeIsRefused) {
  ExpectOpenFails(WriteRaw({{"w", Entry("F32", {-1}, 0, 4)}}, 4), "w", "shape");
}

TEST(SafetensorsErrorsTest, NonStringMetadataIsRefused) {
  ExpectOpenFails(WriteRaw({{"__metadata__", {{"format", 1}}}}, 0), "", "__metadata__");
}

TEST(SafetensorsErrorsTest, MissingFileIsNotFound) {
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open("/nonexistent/x.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().message(), HasSubstr("/nonexistent/x.safetensors"));
}

TEST(SafetensorsErrorsTest, ReadAsFloatOfIntegerTensorIsRefusedNamingIt) {
  const std::string path = WriteRaw({{"ids", Entry("I32", {2}, 0, 8)}}, 8);
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  float out[2];
  absl::Status s = file->ReadAsFloat(file->tensors()[0], out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'ids'"));
  EXPECT_THAT(s.message(), HasSubstr(path));
}

TEST(SafetensorsErrorsTest, FileTruncatedAfterOpenFailsTheReadNotTheProcess) {
  const std::string path = MakeTempDir() + "/model.safetensors";
  std::vector<float> a(64, 1.0f);
  ASSERT_TRUE(WriteSafetensors(path, {{"w", DType::kF32, {64}, a.data()}}, kPt).ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(::truncate(path.c_str(), 100), 0);
  std::vector<float> out(64);
  absl::Status s = file->ReadAsFloat(file->tensors()[0], out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("'w'"));
}

// A folder holding `file` with one tensor "w" (fp32 [2, 3]); returns the folder.
std::string FolderWithOneTensor(const std::string& file = "model-00001-of-00002.safetensors") {
  const std::string dir = MakeTempDir();
  std::vector<float> w(6, 0.5f);
  EXPECT_TRUE(WriteSafetensors(dir + "/" + file, {{"w", DType::kF32, {2, 3}, w.data()}}, kPt).ok());
  return dir;
}

// Reads `name` as `shape` through a ModelTensorReader of a folder whose model.safetensors
// holds only "w" (fp32 [2, 3]); *dir is the folder.
absl::Status ReadFromOneTensorFolder(const std::string& name, const std::vector<int64_t>& shape,
                                     std::string* dir) {
  *dir = FolderWithOneTensor("model.safetensors");
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(*dir);
  EXPECT_TRUE(reader.ok()) << reader.status();
  if (!reader.ok()) return reader.status();
  std::vector<float> out(6);
  return reader->ReadAsFloat(name, shape, out.data());
}

TEST(ModelTensorReaderErrorsTest, MissingTensorIsNotFoundNamingTensorAndFolder) {
  std::string dir;
  absl::Status s = ReadFromOneTensorFolder("model.layers.3.mlp.up_proj.weight", {2, 3}, &dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(),
              HasSubstr("tensor 'model.layers.3.mlp.up_proj.weight' not found in " + dir));
}

TEST(ModelTensorReaderErrorsTest, ShapeDisagreeingWithConfigNamesTensorFileAndBothShapes) {
  std::string dir;
  absl::Status s = ReadFromOneTensorFolder("w", {3, 2}, &dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'w'"));
  EXPECT_THAT(s.message(), HasSubstr(dir + "/model.safetensors"));
  EXPECT_THAT(s.message(), HasSubstr("[2, 3]"));
  EXPECT_THAT(s.message(), HasSubstr("config.json implies [3, 2]"));
}

TEST(ModelTensorReaderErrorsTest, IndexNamingMissingShardNamesShardAndTensor) {
  const std::string dir = FolderWithOneTensor();
  WriteFile(dir + "/model.safetensors.index.json",
            Json{{"metadata", {{"total_size", 48}}},
                 {"weight_map", {{"w", "model-00001-of-00002.safetensors"},
                                 {"lm_head.weight", "model-00002-of-00002.safetensors"}}}}
                .dump());
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(dir);
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(reader.status().message(), HasSubstr("model-00002-of-00002.safetensors"));
  EXPECT_THAT(reader.status().message(), HasSubstr("'lm_head.weight'"));
  EXPECT_THAT(reader.status().message(), HasSubstr("model.safetensors.index.json"));
}

TEST(ModelTensorReaderErrorsTest, IndexNamingTensorTheShardLacksNamesBoth) {
  const std::string dir = FolderWithOneTensor();
  WriteFile(dir + "/model.safetensors.index.json",
            Json{{"weight_map", {{"w", "model-00001-of-00002.safetensors"},
                                 {"model.norm.weight", "model-00001-of-00002.safetensors"}}}}
                .dump());
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(dir);
  ASSERT_FALSE(reader.ok());
  EXPECT_THAT(reader.status().message(), HasSubstr("'model.norm.weight'"));
  EXPECT_THAT(reader.status().message(), HasSubstr("model-00001-of-00002.safetensors"));
}

TEST(ModelTensorReaderErrorsTest, IndexThatIsNotJsonIsRefused) {
  const std::string dir = FolderWithOneTensor();
  WriteFile(dir + "/model.safetensors.index.json", "{\"weight_map\": ");
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(dir);
  ASSERT_FALSE(reader.ok());
  EXPECT_THAT(reader.status().message(), HasSubstr("model.safetensors.index.json"));
}

TEST(ModelTensorReaderErrorsTest, FolderWithoutSafetensorsIsNotFound) {
  const std::string dir = MakeTempDir();
  WriteFile(dir + "/pytorch_model.bin", "not ours");
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(dir);
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(reader.status().message(), HasSubstr("no *.safetensors in " + dir));
}

TEST(ModelTensorReaderErrorsTest, MissingFolderIsNotFound) {
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder("/nonexistent/model");
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(reader.status().message(), HasSubstr("/nonexistent/model"));
}

TEST(ModelTensorReaderErrorsTest, SameTensorInTwoFilesWithoutIndexIsRefused) {
  const std::string dir = MakeTempDir();
  const float v = 1.0f;
  ASSERT_TRUE(WriteSafetensors(dir + "/a.safetensors", {{"w", DType::kF32, {1}, &v}}, kPt).ok());
  ASSERT_TRUE(WriteSafetensors(dir + "/b.safetensors", {{"w", DType::kF32, {1}, &v}}, kPt).ok());
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(dir);
  ASSERT_FALSE(reader.ok());
  EXPECT_THAT(reader.status().message(), HasSubstr("'w'"));
  EXPECT_THAT(reader.status().message(), HasSubstr(dir + "/a.safetensors"));
  EXPECT_THAT(reader.status().message(), HasSubstr(dir + "/b.safetensors"));
}

TEST(ModelTensorReaderErrorsTest, CorruptShardFailsOpenFolderNamingTheShard) {
  const std::string dir = MakeTempDir();
  WriteFile(dir + "/model.safetensors", "xy");
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(dir);
  ASSERT_FALSE(reader.ok());
  EXPECT_THAT(reader.status().message(), HasSubstr(dir + "/model.safetensors"));
}

}  // namespace
}  // namespace megatrain
