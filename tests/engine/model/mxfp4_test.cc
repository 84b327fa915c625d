// MXFP4 dequantization against hand-computed values, against transformers' own output
// (data/mxfp4_transformers.safetensors, written by tests/hf/make_mxfp4_reference.py with
// transformers 5.17's convert_moe_packed_tensors), and the errors a malformed pair gets.
#include "engine/model/mxfp4.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/common/dtype.h"
#include "engine/model/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/model/test_files.h"

namespace megatrain {
namespace {

using ::testing::HasSubstr;

std::string DataDir() {
  const std::string file = __FILE__;
  return file.substr(0, file.rfind('/')) + "/data";
}

// One expert, one row (R = 1), one group: code k of the row is nibble k (low first), and
// the (K, R) output is a column.
TEST(Mxfp4Test, DecodesLowNibbleFirstTimesTheScaleAndTransposes) {
  std::vector<uint8_t> blocks(16, 0);
  blocks[0] = 0x21;  // codes 1 (+0.5), 2 (+1.0)
  blocks[1] = 0xf7;  // codes 7 (+6.0), 15 (-6.0)
  blocks[2] = 0x08;  // codes 8 (-0.0), 0
  const uint8_t scale = 127 + 3;  // x 8
  std::vector<float> out(32);
  DequantizeMxfp4(blocks.data(), &scale, 1, 1, 1, out.data());
  EXPECT_EQ(out[0], 4.0f);
  EXPECT_EQ(out[1], 8.0f);
  EXPECT_EQ(out[2], 48.0f);
  EXPECT_EQ(out[3], -48.0f);
  EXPECT_EQ(out[4], 0.0f);
  EXPECT_TRUE(std::signbit(out[4]));
  EXPECT_EQ(out[31], 0.0f);

  // Two rows, two groups: element (k, r) of the (K, R) output is row r's code k.
  std::vector<uint8_t> two(2 * 2 * 16, 0);
  const uint8_t scales[4] = {127, 126, 128, 127};  // row 0: groups x1, x0.5; row 1: x2, x1
  two[0] = 0x02;           // row 0, code 0: +1.0
  two[16] = 0x04;          // row 0, group 1, code 32: +2.0 x 0.5
  two[32] = 0x0a;          // row 1, code 0: -1.0 x 2
  two[48 + 15] = 0x70;     // row 1, group 1, code 63: +6.0
  std::vector<float> grid(64 * 2);
  DequantizeMxfp4(two.data(), scales, 1, 2, 2, grid.data());
  EXPECT_EQ(grid[0 * 2 + 0], 1.0f);
  EXPECT_EQ(grid[32 * 2 + 0], 1.0f);
  EXPECT_EQ(grid[0 * 2 + 1], -2.0f);
  EXPECT_EQ(grid[63 * 2 + 1], 6.0f);
}

// transformers' output for blocks of random codes under every one of the 256 scales: the
// same bits, edge exponents included.
TEST(Mxfp4Test, MatchesTransformersBitForBitUnderEveryScale) {
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(DataDir());
  ASSERT_TRUE(reader.ok()) << reader.status();
  const TensorInfo* want = reader->Find("expected");
  ASSERT_NE(want, nullptr);
  ASSERT_EQ(want->dtype, DType::kBF16);
  ASSERT_EQ(want->shape.size(), 3u);
  const int64_t E = want->shape[0], K = want->shape[1], R = want->shape[2];
  std::vector<float> got(E * K * R);
  ASSERT_TRUE(ReadMxfp4AsFloat(*reader, "w", {E, K, R}, got.data()).ok());
  std::vector<uint16_t> expected(E * K * R);
  ASSERT_TRUE(reader->ReadRaw("expected", {E, K, R}, DType::kBF16, expected.data()).ok());
  int64_t mismatches = 0;
  for (int64_t i = 0; i < E * K * R; ++i) {
    const uint16_t bits = FloatToBf16(got[i]);
    if (bits != expected[i] && mismatches++ < 10) {
      ADD_FAILURE() << "element " << i << ": ours 0x" << std::hex << bits << ", transformers 0x"
                    << expected[i];
    }
  }
  EXPECT_EQ(mismatches, 0);
}

class Mxfp4ErrorsTest : public ::testing::Test {
 protected:
  // A folder with w_blocks of `blocks_shape` and w_scales of `scales_shape` / `scales_dtype`.
  absl::StatusOr<ModelTensorReader> Folder(std::vector<int64_t> blocks_shape,
                                           std::vector<int64_t> scales_shape,
                                           DType scales_dtype = DType::kU8,
                                           bool with_scales = true) {
    dir_ = testing_files::MakeTempDir();
    bytes_.assign(static_cast<size_t>(Count(blocks_shape) + 4 * Count(scales_shape)), 0);
    std::vector<TensorToWrite> tensors = {{"w_blocks", DType::kU8, blocks_shape, bytes_.data()}};
    if (with_scales) tensors.push_back({"w_scales", scales_dtype, scales_shape, bytes_.data()});
    absl::Status s = WriteSafetensors(dir_ + "/model.safetensors", tensors, {});
    if (!s.ok()) return s;
    return ModelTensorReader::OpenFolder(dir_);
  }

  // ReadMxfp4AsFloat of "w" as `shape` from `r`, into a buffer of that size.
  static absl::Status ReadW(const ModelTensorReader& r, const std::vector<int64_t>& shape) {
    std::vector<float> out(Count(shape));
    return ReadMxfp4AsFloat(r, "w", shape, out.data());
  }

  // ReadW(`shape`) from a Folder(blocks_shape, scales_shape, scales_dtype, with_scales).
  absl::Status ReadWFromFolder(std::vector<int64_t> blocks_shape, std::vector<int64_t> scales_shape,
                               std::vector<int64_t> shape, DType scales_dtype = DType::kU8,
                               bool with_scales = true) {
    absl::StatusOr<ModelTensorReader> r =
        Folder(std::move(blocks_shape), std::move(scales_shape), scales_dtype, with_scales);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? ReadW(*r, shape) : r.status();
  }

  static int64_t Count(const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }

  std::string dir_;
  std::vector<uint8_t> bytes_;
};

TEST_F(Mxfp4ErrorsTest, ScalesOfTheWrongShapeNameTheTensorAndBothShapes) {
  absl::StatusOr<ModelTensorReader> r = Folder({2, 8, 2, 16}, {2, 8, 3});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(HasMxfp4(*r, "w"));
  absl::Status s = ReadW(*r, {2, 64, 8});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("'w_scales'"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("[2, 8, 3]"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("[2, 8, 2]"));
}

TEST_F(Mxfp4ErrorsTest, BlocksOfTheWrongShapeOrScalesOfTheWrongDtypeAreRefused) {
  absl::Status s = ReadWFromFolder({2, 8, 2, 8}, {2, 8, 2}, {2, 64, 8});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("'w_blocks'"));

  s = ReadWFromFolder({2, 8, 2, 16}, {2, 8, 2}, {2, 64, 8}, DType::kF32);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("'w_scales' in"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("is F32"));
}

TEST_F(Mxfp4ErrorsTest, MissingScalesAreNotFoundNamingThem) {
  const absl::Status s =
      ReadWFromFolder({2, 8, 2, 16}, {2, 8, 2}, {2, 64, 8}, DType::kU8, /*with_scales=*/false);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()), HasSubstr("'w_scales'"));
}

TEST_F(Mxfp4ErrorsTest, ASecondDimensionNotAMultipleOf32IsRefused) {
  const absl::Status s = ReadWFromFolder({2, 8, 2, 16}, {2, 8, 2}, {2, 60, 8});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("multiple of 32"));
}

}  // namespace
}  // namespace megatrain
