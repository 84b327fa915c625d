// RoPE's inverse frequencies under linear and dynamic-NTK scaling, as transformers 5.17's
// _compute_linear_scaling_rope_parameters and _compute_dynamic_ntk_parameters compute them.
#include <cmath>
#include <vector>

#include "engine/layers/layer_kind.h"
#include "gtest/gtest.h"

namespace megatrain {
namespace {

ModelConfig RopeConfig(RopeScaling::Type type, double factor, int64_t head_dim) {
  ModelConfig c;
  c.hidden_size = head_dim * 4;
  c.num_heads = 4;
  c.num_kv_heads = 4;
  c.head_dim = head_dim;
  c.max_position_embeddings = 2048;
  c.rope_theta = 10000.0;
  c.rope_scaling.type = type;
  c.rope_scaling.factor = factor;
  return c;
}

// Linear: the plain frequencies divided by the factor (positions interpolated).
TEST(RopeScalingTest, LinearDividesThePlainFrequenciesByTheFactor) {
  const std::vector<float> plain = RopeInvFreqs(RopeConfig(RopeScaling::Type::kNone, 1, 8));
  const std::vector<float> linear = RopeInvFreqs(RopeConfig(RopeScaling::Type::kLinear, 4, 8));
  ASSERT_EQ(linear.size(), 4u);
  const float expected[] = {0.25f, 0.025f, 0.0025f, 0.00025f};
  for (int j = 0; j < 4; ++j) {
    EXPECT_EQ(linear[j], plain[j] / 4.0f) << j;  // in float32, as inv_freq /= factor
    EXPECT_FLOAT_EQ(linear[j], expected[j]) << j;
  }
}

// Dynamic NTK: up to max_position_embeddings nothing changes (transformers' frequencies
// until a longer sequence comes); at 8192 of 2048 positions with factor 2 the base becomes
// 10000 * (2 * 8192 / 2048 - 1)^(64 / 62) = 74534.83 (worked out in double, as Python does).
TEST(RopeScalingTest, DynamicRaisesTheBaseOnlyPastMaxPositionEmbeddings) {
  const std::vector<float> plain = RopeInvFreqs(RopeConfig(RopeScaling::Type::kNone, 1, 64));
  ModelConfig dynamic = RopeConfig(RopeScaling::Type::kDynamic, 2, 64);
  for (int64_t seq : {0, 512, 2048}) {
    dynamic.rope_scaling.dynamic_seq_len = seq;
    EXPECT_EQ(RopeInvFreqs(dynamic), plain) << seq;
  }
  dynamic.rope_scaling.dynamic_seq_len = 8192;
  const std::vector<float> scaled = RopeInvFreqs(dynamic);
  const struct {
    int j;
    double expected;  // 74534.83031811893^(-j / 32)
  } cases[] = {{0, 1.0},
               {1, 0.7042693252165533},
               {16, 0.0036628603951234535},
               {31, 1.905030617376177e-05}};
  for (const auto& c : cases) {
    EXPECT_NEAR(scaled[c.j], c.expected, 2e-6 * c.expected) << "j = " << c.j;
  }
}

}  // namespace
}  // namespace megatrain
