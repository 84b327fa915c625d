// train.freeze's patterns against each family's tensor names: names, layer ranges, "*",
// the routers of every MoE family, and the errors a pattern that names nothing gets.
#include "engine/model/freeze.h"

#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/pipeline/tiny_model.h"

namespace megatrain::testing {
namespace {

using ::testing::HasSubstr;

// The frozen tensors' names after FreezeTensors(patterns).
std::set<std::string> Frozen(Variant v, const std::vector<std::string>& patterns) {
  ModelLayout layout = BuildLayout(TinyConfig(v));
  const absl::Status s = FreezeTensors(patterns, &layout);
  EXPECT_TRUE(s.ok()) << s;
  std::set<std::string> out;
  for (const UnitLayout& u : layout.units) {
    for (const TensorSlot& t : u.tensors) {
      if (!t.trainable) out.insert(t.name);
    }
  }
  return out;
}

TEST(FreezeTensors, NamesRangesAndStarsMatchWholeComponents) {
  const std::set<std::string> head = Frozen(Variant::kQwen2UntiedBias, {"lm_head", "embeddings"});
  EXPECT_EQ(head, (std::set<std::string>{"lm_head.weight", "model.embed_tokens.weight"}));
  const std::set<std::string> layer0 = Frozen(Variant::kQwen2UntiedBias, {"layers.0-0"});
  EXPECT_FALSE(layer0.empty());
  for (const std::string& name : layer0) EXPECT_THAT(name, HasSubstr("model.layers.0.")) << name;
  EXPECT_EQ(Frozen(Variant::kQwen2UntiedBias, {"layers.0"}), layer0);
  // "layers.*.self_attn": every attention tensor, and nothing of the MLPs or norms.
  const std::set<std::string> attention = Frozen(Variant::kQwen2UntiedBias, {"layers.*.self_attn"});
  EXPECT_TRUE(attention.count("model.layers.1.self_attn.q_proj.bias"));
  for (const std::string& name : attention) EXPECT_THAT(name, HasSubstr(".self_attn.")) << name;
  // "mlp.gate" is not "mlp.gate_proj": components match whole.
  ModelLayout dense = BuildLayout(TinyConfig(Variant::kQwen2UntiedBias));
  EXPECT_FALSE(FreezeTensors({"mlp.gate"}, &dense).ok());
  EXPECT_TRUE(Frozen(Variant::kQwen2UntiedBias, {"gate_proj"}).count("model.layers.0.mlp.gate_proj.weight"));
}

TEST(FreezeTensors, RouterNamesEveryFamilysRouterAndExpertsTheirExperts) {
  for (Variant v : {Variant::kQwen3MoeMixedLayers, Variant::kMixtralRenormalised,
                    Variant::kGptOssSinksWindow}) {
    const std::set<std::string> routers = Frozen(v, {"router"});
    ASSERT_FALSE(routers.empty()) << static_cast<int>(v);
    for (const std::string& name : routers) {
      EXPECT_TRUE(name.find(".gate.") != std::string::npos ||
                  name.find(".router.") != std::string::npos)
          << name;
    }
    const std::set<std::string> experts = Frozen(v, {"experts"});
    ASSERT_FALSE(experts.empty()) << static_cast<int>(v);
    for (const std::string& name : experts) EXPECT_THAT(name, HasSubstr(".experts")) << name;
  }
}

TEST(FreezeTensors, APatternThatNamesNothingOrEverythingIsRefusedNamingIt) {
  ModelLayout tied = BuildLayout(TinyConfig(Variant::kLlamaTiedGqa));
  absl::Status s = FreezeTensors({"embed_tokens", "lm_head"}, &tied);
  EXPECT_THAT(s.message(), HasSubstr("train.freeze[1] 'lm_head'"));
  EXPECT_THAT(s.message(), HasSubstr("tied"));
  for (const std::string bad : {"layers.9", "layers.3-1", "layers..mlp", "", "attention"}) {
    ModelLayout layout = BuildLayout(TinyConfig(Variant::kQwen3QkNorm));
    s = FreezeTensors({"model.norm", bad}, &layout);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << bad;
    EXPECT_THAT(s.message(), HasSubstr("train.freeze[1] '" + bad + "'")) << s;
  }
  ModelLayout all = BuildLayout(TinyConfig(Variant::kQwen2UntiedBias));
  s = FreezeTensors({"model", "lm_head"}, &all);
  EXPECT_THAT(s.message(), HasSubstr("nothing is left to train"));
}

}  // namespace
}  // namespace megatrain::testing
