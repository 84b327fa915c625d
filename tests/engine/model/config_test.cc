// Tests for config.json parsing: one realistic config per architecture, the defaults,
// and ToJson -> Parse round trips. Refusals are in config_refusal_test.cc.
#include "engine/model/config.h"

#include <cmath>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/engine/model/same_config.h"
#include "tests/engine/model/sample_configs.h"

namespace megatrain {
namespace {

using ::testing::HasSubstr;
using namespace testing_configs;  // NOLINT: the samples

ModelConfig MustParse(const std::string& text) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(text, "config.json");
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig{};
}

TEST(ModelConfigTest, ParsesLlama31WithLlama3RopeScaling) {
  ModelConfig c = MustParse(kLlama31);
  EXPECT_EQ(c.architecture, Architecture::kLlama);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_layers, 32);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.intermediate_size, 14336);
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.bos_token_id, 128000);
  EXPECT_EQ(c.eos_token_id, 128001);
  EXPECT_EQ(NumParameters(c), 8030261248);  // the published Llama-3.1-8B count
}

TEST(ModelConfigTest, ParsesLlama2WithoutHeadDimOrRopeScaling) {
  ModelConfig c = MustParse(kLlama2);
  EXPECT_EQ(c.architecture, Architecture::kLlama);
  EXPECT_EQ(c.num_kv_heads, 32);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(NumParameters(c), 6738415616);  // Llama-2-7b
}

TEST(ModelConfigTest, ParsesMistralWithSlidingWindow) {
  ModelConfig c = MustParse(kMistral);
  EXPECT_EQ(c.architecture, Architecture::kMistral);
  EXPECT_EQ(c.sliding_window, 4096);
  for (int64_t l : {0, 31}) EXPECT_EQ(c.AttentionWindow(l), 4096) << l;  // every layer
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(NumParameters(c), 7241732096);  // Mistral-7B-v0.1
}

TEST(ModelConfigTest, MistralNullSlidingWindowMeansNone) {
  EXPECT_EQ(MustParse(Patched(kMistral, {{"sliding_window", nullptr}})).sliding_window, 0);
}

TEST(ModelConfigTest, MistralWithoutSlidingWindowFieldGetsTransformersDefault4096) {
  EXPECT_EQ(MustParse(Without(kMistral, "sliding_window")).sliding_window, 4096);
}

TEST(ModelConfigTest, ParsesQwen25AlwaysWithQkvBias) {
  ModelConfig c = MustParse(kQwen25);
  EXPECT_EQ(c.architecture, Architecture::kQwen2);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.sliding_window, 0);  // use_sliding_window is false
  EXPECT_EQ(NumParameters(c), 7615616512);  // Qwen2.5-7B
}

TEST(ModelConfigTest, Qwen2SlidingWindowOnlyWhenUseSlidingWindowAndSomeLayerSlides) {
  EXPECT_EQ(MustParse(Patched(kQwen25, {{"use_sliding_window", true},
                                        {"max_window_layers", 28}}))
                .sliding_window,
            0);  // layers >= 28 slide: none of 28
  const ModelConfig c = MustParse(Patched(kQwen25, {{"use_sliding_window", true},
                                                    {"max_window_layers", 21},
                                                    {"sliding_window", 32768}}));
  EXPECT_EQ(c.sliding_window, 32768);
  // transformers: layer i slides when i >= max_window_layers.
  EXPECT_EQ(c.AttentionWindow(20), 0);
  EXPECT_EQ(c.AttentionWindow(21), 32768);
  EXPECT_EQ(c.AttentionWindow(27), 32768);
  // Its layer_types, when config.json has them, decide instead.
  Json types = Json::array();
  for (int l = 0; l < 28; ++l) types.push_back(l % 3 == 0 ? "sliding_attention" : "full_attention");
  const ModelConfig listed = MustParse(Patched(
      kQwen25, {{"use_sliding_window", true}, {"sliding_window", 64}, {"layer_types", types}}));
  EXPECT_EQ(listed.AttentionWindow(0), 64);
  EXPECT_EQ(listed.AttentionWindow(1), 0);
  EXPECT_EQ(listed.AttentionWindow(27), 64);
  // use_sliding_window false: no window, whatever the layer types say.
  EXPECT_EQ(MustParse(Patched(kQwen25, {{"sliding_window", 64}, {"layer_types", types}}))
                .AttentionWindow(0),
            0);
}

TEST(ModelConfigTest, ParsesQwen3WithExplicitHeadDimAndTiedEmbeddings) {
  ModelConfig c = MustParse(kQwen3);
  EXPECT_EQ(c.architecture, Architecture::kQwen3);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_NE(c.head_dim, c.hidden_size / c.num_heads);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);  // an integer in the file
  EXPECT_EQ(c.sliding_window, 0);
  const int64_t C = 1024, D = 128, layer = 2 * C + C * 16 * D + 2 * C * 8 * D + 16 * D * C +
                                           2 * D + 3 * C * 3072;
  EXPECT_EQ(NumParameters(c), 151936 * C + 28 * layer + C);  // lm_head tied: counted once
}

TEST(ModelConfigTest, MinimalConfigGetsDefaults) {
  ModelConfig c = MustParse(kMinimal);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.initializer_range, 0.02);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_EQ(c.eos_token_id, -1);
}

TEST(ModelConfigTest, ArchitectureFallsBackToModelType) {
  ModelConfig c = MustParse(Without(kQwen25, "architectures"));
  EXPECT_EQ(c.architecture, Architecture::kQwen2);
}

TEST(ModelConfigTest, TokenIdsMayBeListsOrNull) {
  ModelConfig c = MustParse(Patched(kLlama31, {{"eos_token_id", {128001, 128008, 128009}},
                                               {"bos_token_id", nullptr}}));
  EXPECT_EQ(c.eos_token_id, 128001);
  EXPECT_EQ(c.bos_token_id, -1);
}

TEST(ModelConfigTest, Transformers5RopeParametersAreRead) {
  Json rope = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 32.0},
               {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
               {"original_max_position_embeddings", 8192}};
  ModelConfig c = MustParse(Patched(Without(Without(kLlama31, "rope_scaling"), "rope_theta"),
                                    {{"rope_parameters", rope}}));
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
}

// Linear and dynamic-NTK scaling, in either spelling of the type key; a factor below 1
// (transformers refuses it too), a missing factor and an unknown type are refused by name.
TEST(ModelConfigTest, LinearAndDynamicRopeScalingParseAndRoundTrip) {
  const struct {
    Json rope;
    RopeScaling::Type type;
    double factor;
  } cases[] = {{{{"rope_type", "linear"}, {"factor", 4.0}}, RopeScaling::Type::kLinear, 4.0},
               {{{"type", "dynamic"}, {"factor", 2.0}}, RopeScaling::Type::kDynamic, 2.0}};
  for (const auto& c : cases) {
    const ModelConfig parsed = MustParse(Patched(kLlama2, {{"rope_scaling", c.rope}}));
    EXPECT_EQ(parsed.rope_scaling.type, c.type) << c.rope.dump();
    EXPECT_EQ(parsed.rope_scaling.factor, c.factor);
    const ModelConfig back = MustParse(ModelConfigToJson(parsed));
    EXPECT_EQ(back.rope_scaling.type, c.type);
    EXPECT_EQ(back.rope_scaling.factor, c.factor);
  }
  const struct {
    Json rope;
    const char* message;
  } refused[] = {
      {{{"rope_type", "linear"}, {"factor", 0.5}}, "'rope_scaling.factor' (0.5) must be at least 1"},
      {{{"rope_type", "dynamic"}}, "'rope_scaling.factor' is missing"},
      {{{"rope_type", "longrope"}, {"factor", 2.0}}, "\"linear\", \"dynamic\", \"llama3\""},
  };
  for (const auto& r : refused) {
    absl::StatusOr<ModelConfig> c =
        ParseModelConfig(Patched(kLlama2, {{"rope_scaling", r.rope}}), "config.json");
    ASSERT_FALSE(c.ok()) << r.rope.dump();
    EXPECT_THAT(std::string(c.status().message()), HasSubstr(r.message)) << c.status();
  }
}

TEST(ModelConfigTest, UnknownExtraFieldsAreIgnored) {
  MustParse(Patched(kLlama31, {{"quirky_new_field", {{"a", 1}}}, {"pad_token_id", nullptr}}));
}

TEST(ModelConfigTest, ParsesQwen3MoeExpertsAndCountsActiveParameters) {
  const ModelConfig c = MustParse(kQwen3Moe);
  EXPECT_EQ(c.architecture, Architecture::kQwen3Moe);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.moe.num_experts, 128);
  EXPECT_EQ(c.moe.experts_per_token, 8);
  EXPECT_EQ(c.moe.intermediate_size, 768);
  EXPECT_TRUE(c.moe.norm_topk_prob);
  EXPECT_EQ(c.moe.router_aux_loss_coef, 0.001);
  EXPECT_FALSE(c.moe.output_router_logits);
  EXPECT_EQ(c.NumMoeLayers(), 48);
  // The published sizes: 30.5 B parameters, 3.3 B active (embeddings included).
  EXPECT_NEAR(NumParameters(c) / 1e9, 30.53, 0.01);
  EXPECT_NEAR((MatmulParameters(c) + c.vocab_size * c.hidden_size) / 1e9, 3.35, 0.01);
}

TEST(ModelConfigTest, Qwen3MoeDenseLayersFollowSparseStepAndMlpOnlyLayers) {
  const ModelConfig c = MustParse(Patched(kQwen3Moe, {{"num_hidden_layers", 6},
                                                     {"decoder_sparse_step", 2},
                                                     {"mlp_only_layers", {3}}}));
  std::vector<bool> moe;
  for (int64_t l = 0; l < c.num_layers; ++l) moe.push_back(c.IsMoeLayer(l));
  EXPECT_EQ(moe, std::vector<bool>({false, true, false, false, false, true}));
  // num_local_experts (transformers 5's spelling) is read when num_experts is absent.
  nlohmann::json j = nlohmann::json::parse(kQwen3Moe);
  j.erase("num_experts");
  j["num_local_experts"] = 64;
  EXPECT_EQ(MustParse(j.dump()).moe.num_experts, 64);
}

TEST(ModelConfigTest, ParsesMixtralAsRenormalisedTopTwoOfEightEveryLayer) {
  const ModelConfig c = MustParse(kMixtral);
  EXPECT_EQ(c.architecture, Architecture::kMixtral);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.moe.num_experts, 8);
  EXPECT_EQ(c.moe.experts_per_token, 2);
  EXPECT_EQ(c.moe.intermediate_size, 14336);
  EXPECT_TRUE(c.moe.norm_topk_prob);
  EXPECT_EQ(c.NumMoeLayers(), 32);
  EXPECT_NEAR(NumParameters(c) / 1e9, 46.70, 0.01);  // "46.7B total, 12.9B active"
  EXPECT_NEAR((MatmulParameters(c) + c.vocab_size * c.hidden_size) / 1e9, 12.88, 0.01);
}

TEST(ModelConfigTest, ParsesGptOss120bAsReleased) {
  const ModelConfig c = MustParse(kGptOss120b);
  EXPECT_EQ(c.architecture, Architecture::kGptOss);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_TRUE(c.o_bias);
  EXPECT_TRUE(c.attention_sinks);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.sliding_window, 128);
  ASSERT_EQ(c.sliding_layers.size(), 36u);
  EXPECT_EQ(c.AttentionWindow(0), 128);
  EXPECT_EQ(c.AttentionWindow(1), 0);
  EXPECT_EQ(c.AttentionWindow(34), 128);
  EXPECT_EQ(c.AttentionWindow(35), 0);
  EXPECT_EQ(c.rope_theta, 150000.0);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_FALSE(c.rope_scaling.truncate);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.rope_scaling.attention_factor, 0.1 * std::log(32.0) + 1.0);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.moe.num_experts, 128);
  EXPECT_EQ(c.moe.experts_per_token, 4);
  EXPECT_EQ(c.moe.intermediate_size, 2880);
  EXPECT_TRUE(c.moe.norm_topk_prob);
  EXPECT_TRUE(c.moe.gpt_oss_experts);
  EXPECT_EQ(c.moe.swiglu_limit, 7.0);
  EXPECT_EQ(c.moe.router_aux_loss_coef, 0.9);
  EXPECT_EQ(c.NumMoeLayers(), 36);
  // OpenAI's model card: 116.83 B parameters, 5.13 B active per token (with the unembedding).
  EXPECT_NEAR(NumParameters(c) / 1e9, 116.83, 0.01);
  EXPECT_NEAR(MatmulParameters(c) / 1e9, 5.13, 0.01);
}

TEST(ModelConfigTest, GptOssDefaultsFollowTransformersGptOssConfig) {
  nlohmann::json j = nlohmann::json::parse(kGptOss120b);
  for (const char* field : {"layer_types", "sliding_window", "rms_norm_eps", "attention_bias",
                            "num_experts_per_tok", "swiglu_limit"}) {
    j.erase(field);
  }
  const ModelConfig c = MustParse(j.dump());
  EXPECT_EQ(c.sliding_window, 128);
  EXPECT_EQ(c.AttentionWindow(0), 128);  // even layers slide
  EXPECT_EQ(c.AttentionWindow(1), 0);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_TRUE(c.o_bias);
  EXPECT_EQ(c.moe.experts_per_token, 4);
  // transformers 5's rope_parameters, with the default truncate (true).
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"rope_theta", 10000.0},
                          {"original_max_position_embeddings", 256}};
  const ModelConfig d = MustParse(j.dump());
  EXPECT_EQ(d.rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_TRUE(d.rope_scaling.truncate);
  EXPECT_EQ(d.rope_scaling.beta_fast, 32.0);
  EXPECT_EQ(d.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(d.rope_scaling.attention_factor, 0.1 * std::log(4.0) + 1.0);
}

TEST(ModelConfigTest, MalformedGptOssFieldsNameTheField) {
  struct Case {
    nlohmann::json patch;
    const char* field;
  };
  const Case cases[] = {
      {{{"layer_types", {"sliding_attention"}}}, "'layer_types' must be a list of num_hidden_layers (36)"},
      {{{"num_hidden_layers", 2}, {"layer_types", {"sliding_attention", "chunked_attention"}}},
       "'layer_types' [1] is \"chunked_attention\""},
      {{{"swiglu_limit", 5.0}}, "'swiglu_limit' is 5"},
      {{{"num_experts_per_tok", 129}}, "'num_experts_per_tok' (129) must be at most num_local_experts"},
      {{{"sliding_window", 0}}, "'sliding_window' must be a positive integer"},
      {{{"quantization_config", {{"quant_method", "gptq"}}}}, "'quantization_config' is"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<ModelConfig> parsed = ParseModelConfig(Patched(kGptOss120b, c.patch), "config.json");
    ASSERT_FALSE(parsed.ok()) << c.patch.dump();
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(parsed.status().message()), HasSubstr(c.field)) << parsed.status();
  }
  // A quantized checkpoint of another family is refused by name, not loaded as garbage.
  absl::StatusOr<ModelConfig> llama = ParseModelConfig(
      Patched(kLlama31, {{"quantization_config", {{"quant_method", "mxfp4"}}}}), "config.json");
  ASSERT_FALSE(llama.ok());
  EXPECT_THAT(std::string(llama.status().message()), HasSubstr("'quantization_config'"));
}

TEST(ModelConfigTest, MalformedExpertFieldsNameTheField) {
  struct Case {
    const char* base;
    nlohmann::json patch;
    const char* field;
  };
  const Case cases[] = {
      {kQwen3Moe, {{"num_experts_per_tok", 129}}, "'num_experts_per_tok' (129) must be at most num_experts"},
      {kMixtral, {{"num_experts_per_tok", 9}}, "'num_experts_per_tok' (9) must be at most num_local_experts (8)"},
      {kQwen3Moe, {{"num_experts_per_tok", 16}}, "'num_experts_per_tok' (16) must be at most 8"},
      {kQwen3Moe, {{"num_experts", 0}}, "'num_experts' must be a positive integer"},
      {kQwen3Moe, {{"num_experts", 512}}, "'num_experts' (512) is larger than megatrain supports"},
      {kQwen3Moe, {{"mlp_only_layers", {48}}}, "'mlp_only_layers' holds 48"},
      {kQwen3Moe, {{"mlp_only_layers", "none"}}, "'mlp_only_layers' must be a list"},
      {kQwen3Moe, {{"moe_intermediate_size", -1}}, "'moe_intermediate_size' must be a positive"},
      {kMixtral, {{"router_jitter_noise", 0.01}}, "'router_jitter_noise' is 0.01"},
      {kMixtral, {{"router_aux_loss_coef", -1}}, "'router_aux_loss_coef' must be a non-negative"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<ModelConfig> parsed = ParseModelConfig(Patched(c.base, c.patch), "config.json");
    ASSERT_FALSE(parsed.ok()) << c.patch.dump();
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(parsed.status().message()), HasSubstr(c.field)) << parsed.status();
  }
}

TEST(ModelConfigTest, ToJsonRoundTripsThroughParseForEveryArchitecture) {
  for (const char* sample :
       {kLlama31, kLlama2, kMistral, kQwen25, kQwen3, kMinimal, kQwen3Moe, kMixtral,
        kGptOss120b}) {
    ModelConfig c = MustParse(sample);
    ModelConfig back = MustParse(ModelConfigToJson(c));
    SCOPED_TRACE(ArchitectureClassName(c.architecture));
    ExpectSameConfig(c, back);
  }
}

TEST(ModelConfigTest, ToJsonRoundTripsSlidingWindows) {
  for (const std::string& sample :
       {std::string(kMistral),
        Patched(kQwen25, {{"use_sliding_window", true},
                          {"max_window_layers", 0},
                          {"sliding_window", 4096}}),
        Patched(kQwen25, {{"use_sliding_window", true},
                          {"max_window_layers", 21},
                          {"sliding_window", 4096}})}) {
    ModelConfig c = MustParse(sample);
    EXPECT_EQ(c.sliding_window, 4096);
    ExpectSameConfig(c, MustParse(ModelConfigToJson(c)));
    // Also without layer_types (as a transformers that reads only max_window_layers).
    Json j = Json::parse(ModelConfigToJson(c));
    j.erase("layer_types");
    ExpectSameConfig(c, MustParse(j.dump()));
  }
}

TEST(ModelConfigTest, ToJsonWritesWhatTransformersNeeds) {
  Json j = Json::parse(ModelConfigToJson(MustParse(kLlama31)));
  EXPECT_EQ(j["architectures"], Json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(j["model_type"], "llama");
  EXPECT_EQ(j["torch_dtype"], "bfloat16");
  EXPECT_EQ(j["hidden_act"], "silu");
  EXPECT_EQ(j["head_dim"], 128);
  EXPECT_EQ(j["num_key_value_heads"], 8);
  EXPECT_EQ(j["attention_bias"], false);
  EXPECT_EQ(j["mlp_bias"], false);
  EXPECT_EQ(j["use_cache"], true);
  EXPECT_EQ(j["tie_word_embeddings"], false);
  EXPECT_EQ(j["rope_scaling"]["rope_type"], "llama3");
  EXPECT_EQ(j["rope_scaling"]["original_max_position_embeddings"], 8192);
  EXPECT_EQ(j["rope_parameters"]["rope_theta"], 500000.0);
  EXPECT_EQ(j["bos_token_id"], 128000);
  EXPECT_EQ(j["eos_token_id"], 128001);
}

TEST(ModelConfigTest, ToJsonWritesNullRopeScalingAndOmitsAbsentTokenIds) {
  Json j = Json::parse(ModelConfigToJson(MustParse(kMinimal)));
  EXPECT_TRUE(j["rope_scaling"].is_null());
  EXPECT_EQ(j["rope_parameters"]["rope_type"], "default");
  EXPECT_FALSE(j.contains("bos_token_id"));
  EXPECT_FALSE(j.contains("eos_token_id"));
}

TEST(ModelConfigTest, ToJsonForQwen3KeepsHeadDimAndTying) {
  Json j = Json::parse(ModelConfigToJson(MustParse(kQwen3)));
  EXPECT_EQ(j["architectures"], Json::array({"Qwen3ForCausalLM"}));
  EXPECT_EQ(j["model_type"], "qwen3");
  EXPECT_EQ(j["head_dim"], 128);
  EXPECT_EQ(j["tie_word_embeddings"], true);
  EXPECT_EQ(j["use_sliding_window"], false);
}

}  // namespace
}  // namespace megatrain
