// Tests that config.json values the engine does not implement are refused with an
// InvalidArgument naming the file and the field, never guessed around.
#include <string>

#include "engine/model/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/model/sample_configs.h"

namespace megatrain {
namespace {

using ::testing::HasSubstr;
using namespace testing_configs;  // NOLINT: the samples

constexpr char kSource[] = "/models/x/config.json";

// Parsing must fail with InvalidArgument and a message naming the source and `field`.
void ExpectRefused(const std::string& text, const std::string& field) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(text, kSource);
  ASSERT_FALSE(c.ok()) << "accepted; expected an error naming " << field;
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr(kSource));
  EXPECT_THAT(c.status().message(), HasSubstr("'" + field + "'")) << c.status();
}

TEST(ModelConfigRefusalTest, MissingRequiredFieldNamesIt) {
  for (const char* field : {"hidden_size", "num_hidden_layers", "num_attention_heads",
                            "intermediate_size", "vocab_size"}) {
    SCOPED_TRACE(field);
    ExpectRefused(Without(kLlama31, field), field);
  }
}

// Found by fuzz_model_config: sizes whose products overflow int64 in the layout.
TEST(ModelConfigRefusalTest, DimensionsBeyondTheSupportedRangeNameTheField) {
  ExpectRefused(Patched(kLlama31, {{"hidden_size", int64_t{5666666666664}}}), "hidden_size");
  ExpectRefused(Patched(kLlama31, {{"vocab_size", int64_t{1} << 30}}), "vocab_size");
  ExpectRefused(Patched(kLlama31, {{"intermediate_size", int64_t{1} << 40}}), "intermediate_size");
  ExpectRefused(Patched(kLlama31, {{"num_hidden_layers", 100000}}), "num_hidden_layers");
  ExpectRefused(Patched(kQwen3, {{"head_dim", 1 << 14}}), "head_dim");
}

TEST(ModelConfigRefusalTest, RequiredFieldOfWrongTypeNamesIt) {
  ExpectRefused(Patched(kLlama31, {{"hidden_size", "4096"}}), "hidden_size");
  ExpectRefused(Patched(kLlama31, {{"vocab_size", 128256.5}}), "vocab_size");
  ExpectRefused(Patched(kLlama31, {{"num_hidden_layers", nullptr}}), "num_hidden_layers");
}

TEST(ModelConfigRefusalTest, NonPositiveRequiredFieldNamesIt) {
  ExpectRefused(Patched(kLlama31, {{"intermediate_size", 0}}), "intermediate_size");
  ExpectRefused(Patched(kLlama31, {{"num_attention_heads", -32}}), "num_attention_heads");
}

TEST(ModelConfigRefusalTest, ErrorMessageSaysFieldAndValue) {
  absl::StatusOr<ModelConfig> c =
      ParseModelConfig(Without(kLlama31, "hidden_size"), "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("config.json: field 'hidden_size'"));
}

TEST(ModelConfigRefusalTest, UnknownArchitectureIsRefused) {
  ExpectRefused(Patched(kLlama31, {{"architectures", {"GPT2LMHeadModel"}},
                                   {"model_type", "gpt2"}}),
                "architectures");
  ExpectRefused(Patched(Without(kLlama31, "architectures"), {{"model_type", "gemma"}}),
                "model_type");
}

TEST(ModelConfigRefusalTest, ModelTypeDisagreeingWithArchitecturesIsRefused) {
  ExpectRefused(Patched(kLlama31, {{"model_type", "qwen2"}}), "model_type");
}

TEST(ModelConfigRefusalTest, HiddenActOtherThanSiluIsRefused) {
  ExpectRefused(Patched(kLlama31, {{"hidden_act", "gelu"}}), "hidden_act");
}

TEST(ModelConfigRefusalTest, MlpBiasIsRefused) {
  ExpectRefused(Patched(kLlama31, {{"mlp_bias", true}}), "mlp_bias");
}

TEST(ModelConfigRefusalTest, AttentionBiasIsRefusedForLlamaMistralAndQwen3) {
  ExpectRefused(Patched(kLlama31, {{"attention_bias", true}}), "attention_bias");
  ExpectRefused(Patched(kMistral, {{"attention_bias", true}}), "attention_bias");
  ExpectRefused(Patched(kQwen3, {{"attention_bias", true}}), "attention_bias");
}

TEST(ModelConfigRefusalTest, RopeScalingOtherThanLinearDynamicLlama3OrYarnIsRefused) {
  for (const char* type : {"longrope", "proportional", "su"}) {
    SCOPED_TRACE(type);
    ExpectRefused(Patched(kLlama2, {{"rope_scaling", {{"rope_type", type}, {"factor", 2.0}}}}),
                  "rope_scaling.rope_type");
  }
  // Old configs spell it "type"; the message names the field that is there.
  ExpectRefused(Patched(kLlama2, {{"rope_scaling", {{"type", "longrope"}, {"factor", 2.0}}}}),
                "rope_scaling.type");
}

TEST(ModelConfigRefusalTest, YarnWithoutItsRequiredFieldsIsRefused) {
  ExpectRefused(Patched(kLlama2, {{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 2.0}}}}),
                "rope_scaling.original_max_position_embeddings");
  ExpectRefused(Patched(kLlama2, {{"rope_scaling", {{"rope_type", "yarn"},
                                                    {"original_max_position_embeddings", 4096}}}}),
                "rope_scaling.factor");
}

TEST(ModelConfigRefusalTest, Llama3RopeScalingWithoutFactorIsRefused) {
  Json rope = Json::parse(kLlama31)["rope_scaling"];
  rope.erase("factor");
  ExpectRefused(Patched(kLlama31, {{"rope_scaling", rope}}), "rope_scaling.factor");
}

TEST(ModelConfigRefusalTest, Llama3RopeScalingWithHighFreqNotAboveLowFreqIsRefused) {
  Json rope = Json::parse(kLlama31)["rope_scaling"];
  rope["high_freq_factor"] = 1.0;
  ExpectRefused(Patched(kLlama31, {{"rope_scaling", rope}}), "rope_scaling.high_freq_factor");
}

TEST(ModelConfigRefusalTest, RopeScalingThatIsNotAnObjectIsRefused) {
  ExpectRefused(Patched(kLlama31, {{"rope_scaling", "llama3"}}), "rope_scaling");
}

TEST(ModelConfigRefusalTest, HeadsNotDivisibleByKvHeadsIsRefused) {
  ExpectRefused(Patched(kLlama31, {{"num_key_value_heads", 5}}), "num_key_value_heads");
}

TEST(ModelConfigRefusalTest, HiddenNotDivisibleByHeadsWithoutHeadDimIsRefused) {
  ExpectRefused(Patched(kLlama31, {{"num_attention_heads", 48}, {"num_key_value_heads", 8}}),
                "hidden_size");
}

TEST(ModelConfigRefusalTest, OddHeadDimIsRefused) {
  ExpectRefused(Patched(kQwen3, {{"head_dim", 127}}), "head_dim");
}

TEST(ModelConfigRefusalTest, NonBooleanTieWordEmbeddingsIsRefused) {
  ExpectRefused(Patched(kQwen3, {{"tie_word_embeddings", "yes"}}), "tie_word_embeddings");
}

TEST(ModelConfigRefusalTest, NonNumericRopeThetaIsRefused) {
  ExpectRefused(Patched(kQwen3, {{"rope_theta", "1e6"}}), "rope_theta");
}

TEST(ModelConfigRefusalTest, TextThatIsNotJsonIsRefusedNamingTheFile) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig("{\"hidden_size\": 4096,", kSource);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr(kSource));
  EXPECT_THAT(c.status().message(), HasSubstr("not valid JSON"));
}

TEST(ModelConfigRefusalTest, JsonThatIsNotAnObjectIsRefused) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig("[1, 2]", kSource);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(kSource));
}

TEST(ModelConfigRefusalTest, MissingFileIsNotFound) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig("/nonexistent/megatrain/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr("/nonexistent/megatrain/config.json"));
}

}  // namespace
}  // namespace megatrain
