// Tests for the host store and what fills it: the unit layout (fused q/k/v and gate/up,
// 64-element groups, Hugging Face names), the 4 KiB-aligned arenas, bf16 rounding, the
// gradient slab pool's blocking, random init and loading safetensors weights.
#include <numa.h>
#include <numaif.h>
#include <omp.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/common/dtype.h"
#include "engine/model/config.h"
#include "engine/model/layout.h"
#include "engine/model/mxfp4.h"
#include "engine/model/safetensors.h"
#include "engine/store/grad_slab_pool.h"
#include "engine/store/host_store.h"
#include "engine/store/model_io.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace megatrain {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uintptr_t kPage = 4096;

using ::megatrain::testing::TempDir;

// Tiny llama: C=32, I=64, L=2, H=4, KV=2 (D=8), V=300.
ModelConfig TinyLlama(bool tied = false) {
  ModelConfig c;
  c.architecture = Architecture::kLlama;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.vocab_size = 300;
  c.tie_word_embeddings = tied;
  return c;
}

// Qwen2: q/k/v biases. Odd sizes so no tensor ends on a 64-element boundary by luck.
ModelConfig TinyQwen2() {
  ModelConfig c = TinyLlama(/*tied=*/true);
  c.architecture = Architecture::kQwen2;
  c.hidden_size = 36;
  c.num_heads = 6;
  c.num_kv_heads = 2;
  c.head_dim = 6;
  c.intermediate_size = 70;
  c.vocab_size = 301;
  c.qkv_bias = true;
  return c;
}

// Qwen3: QK-norm and a head_dim that is not C / H.
ModelConfig TinyQwen3() {
  ModelConfig c = TinyLlama(/*tied=*/false);
  c.architecture = Architecture::kQwen3;
  c.head_dim = 16;
  c.qk_norm = true;
  return c;
}

// Qwen3-MoE with 3 experts, top-2, expert I=8; layer 1 dense (mlp_only_layers).
ModelConfig TinyQwen3Moe() {
  ModelConfig c = TinyQwen3();
  c.architecture = Architecture::kQwen3Moe;
  c.moe.num_experts = 3;
  c.moe.experts_per_token = 2;
  c.moe.intermediate_size = 8;
  c.moe.mlp_only_layers = {1};
  return c;
}

std::unique_ptr<HostStore> MakeStore(const ModelConfig& config) {
  absl::StatusOr<std::unique_ptr<HostStore>> store = HostStore::Create(BuildLayout(config));
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? std::move(*store) : nullptr;
}

std::vector<std::string> NamesOf(const UnitLayout& unit) {
  std::vector<std::string> names;
  for (const TensorSlot& t : unit.tensors) names.push_back(t.name);
  return names;
}

bool IsNormRole(TensorRole r) {
  return r == TensorRole::kInputNorm || r == TensorRole::kPostNorm || r == TensorRole::kQNorm ||
         r == TensorRole::kKNorm || r == TensorRole::kFinalNorm;
}

bool IsBiasRole(TensorRole r) {
  return r == TensorRole::kQBias || r == TensorRole::kKBias || r == TensorRole::kVBias;
}

// ---------------------------------------------------------------------------------------
// BuildLayout

TEST(LayoutTest, UnitsAreEmbeddingThenOnePerLayerThenHead) {
  const ModelLayout layout = BuildLayout(TinyLlama());
  ASSERT_EQ(layout.units.size(), 4u);
  EXPECT_EQ(layout.num_layers, 2);
  EXPECT_EQ(layout.units[ModelLayout::EmbeddingUnit()].kind, UnitKind::kEmbedding);
  EXPECT_EQ(layout.units[layout.DecoderUnit(0)].kind, UnitKind::kDecoder);
  EXPECT_EQ(layout.units[layout.DecoderUnit(1)].layer, 1);
  EXPECT_EQ(layout.units[layout.DecoderUnit(1)].name, "layer.1");
  EXPECT_EQ(layout.units[layout.HeadUnit()].kind, UnitKind::kHead);
  int64_t total = 0;
  for (const UnitLayout& u : layout.units) total += u.num_elements;
  EXPECT_EQ(layout.TotalElements(), total);
  EXPECT_EQ(layout.MaxDecoderElements(), layout.units[1].num_elements);
}

TEST(LayoutTest, DecoderTensorsHaveTransformersNamesAndShapes) {
  const ModelConfig c = TinyLlama();
  const ModelLayout layout = BuildLayout(c);
  const UnitLayout& l1 = layout.units[layout.DecoderUnit(1)];
  EXPECT_THAT(NamesOf(l1), ElementsAre("model.layers.1.input_layernorm.weight",
                                       "model.layers.1.self_attn.q_proj.weight",
                                       "model.layers.1.self_attn.k_proj.weight",
                                       "model.layers.1.self_attn.v_proj.weight",
                                       "model.layers.1.self_attn.o_proj.weight",
                                       "model.layers.1.post_attention_layernorm.weight",
                                       "model.layers.1.mlp.gate_proj.weight",
                                       "model.layers.1.mlp.up_proj.weight",
                                       "model.layers.1.mlp.down_proj.weight"));
  using Shape = std::vector<int64_t>;
  EXPECT_EQ(l1.Find(TensorRole::kInputNorm)->shape, Shape({32}));
  EXPECT_EQ(l1.Find(TensorRole::kQ)->shape, Shape({32, 32}));
  EXPECT_EQ(l1.Find(TensorRole::kK)->shape, Shape({16, 32}));
  EXPECT_EQ(l1.Find(TensorRole::kV)->shape, Shape({16, 32}));
  EXPECT_EQ(l1.Find(TensorRole::kOProj)->shape, Shape({32, 32}));
  EXPECT_EQ(l1.Find(TensorRole::kGate)->shape, Shape({64, 32}));
  EXPECT_EQ(l1.Find(TensorRole::kUp)->shape, Shape({64, 32}));
  EXPECT_EQ(l1.Find(TensorRole::kDown)->shape, Shape({32, 64}));
  EXPECT_THAT(NamesOf(layout.units[0]), ElementsAre("model.embed_tokens.weight"));
  EXPECT_EQ(layout.units[0].tensors[0].shape, Shape({300, 32}));
}

TEST(LayoutTest, MoeLayersHaveARouterAndPerExpertTensorsUnderTransformersNames) {
  const ModelConfig c = TinyQwen3Moe();
  const ModelLayout layout = BuildLayout(c);
  const UnitLayout& l0 = layout.units[layout.DecoderUnit(0)];
  std::vector<std::string> names = NamesOf(l0);
  names.erase(names.begin(), names.begin() + 8);  // norm, q, k, v, q/k norm, o, post norm
  EXPECT_THAT(names, ElementsAre("model.layers.0.mlp.gate.weight",
                                 "model.layers.0.mlp.experts.0.gate_proj.weight",
                                 "model.layers.0.mlp.experts.0.up_proj.weight",
                                 "model.layers.0.mlp.experts.1.gate_proj.weight",
                                 "model.layers.0.mlp.experts.1.up_proj.weight",
                                 "model.layers.0.mlp.experts.2.gate_proj.weight",
                                 "model.layers.0.mlp.experts.2.up_proj.weight",
                                 "model.layers.0.mlp.experts.0.down_proj.weight",
                                 "model.layers.0.mlp.experts.1.down_proj.weight",
                                 "model.layers.0.mlp.experts.2.down_proj.weight"));
  using Shape = std::vector<int64_t>;
  EXPECT_EQ(l0.Find(TensorRole::kRouter)->shape, Shape({3, 32}));
  // One (E, 2I, C) and one (E, C, I) tensor: each expert's [gate; up] and down back to back.
  const int64_t gate_up = l0.OffsetOf(TensorRole::kExpertGate);
  const int64_t down = l0.OffsetOf(TensorRole::kExpertDown);
  for (const TensorSlot& t : l0.tensors) {
    int64_t want = t.offset;
    if (t.role == TensorRole::kExpertGate) want = gate_up + t.expert * 2 * 8 * 32;
    if (t.role == TensorRole::kExpertUp) want = gate_up + (t.expert * 2 + 1) * 8 * 32;
    if (t.role == TensorRole::kExpertDown) want = down + t.expert * 32 * 8;
    EXPECT_EQ(t.offset, want) << t.name;
    EXPECT_TRUE(t.weight_decay || (t.expert < 0 && t.role != TensorRole::kRouter)) << t.name;
  }
  // The dense layer among them has the dense MLP; the two kinds differ in structure.
  const UnitLayout& l1 = layout.units[layout.DecoderUnit(1)];
  EXPECT_NE(l1.Find(TensorRole::kGate), nullptr);
  EXPECT_EQ(l1.Find(TensorRole::kRouter), nullptr);
  EXPECT_FALSE(l0.SameStructure(l1));
  EXPECT_GE(layout.TotalElements(), NumParameters(c));

  ModelConfig mixtral = TinyLlama();
  mixtral.architecture = Architecture::kMixtral;
  mixtral.moe = c.moe;
  mixtral.moe.mlp_only_layers.clear();
  const ModelLayout ml = BuildLayout(mixtral);
  const std::vector<std::string> m = NamesOf(ml.units[ml.DecoderUnit(1)]);
  EXPECT_THAT(m, ::testing::Contains("model.layers.1.block_sparse_moe.gate.weight"));
  EXPECT_THAT(m, ::testing::Contains("model.layers.1.block_sparse_moe.experts.2.w1.weight"));
  EXPECT_THAT(m, ::testing::Contains("model.layers.1.block_sparse_moe.experts.2.w3.weight"));
  EXPECT_THAT(m, ::testing::Contains("model.layers.1.block_sparse_moe.experts.0.w2.weight"));
}

// GPT-OSS keeps transformers' own names and shapes: biases on every projection, the sinks,
// the router's bias, and the experts as (E, C, 2I) / (E, I, C) tensors with their biases.
TEST(LayoutTest, GptOssLayersHoldTransformersTensorsAsTheyAre) {
  ModelConfig c = TinyLlama();
  c.architecture = Architecture::kGptOss;
  c.qkv_bias = c.o_bias = c.attention_sinks = true;
  c.moe.num_experts = 3;
  c.moe.experts_per_token = 2;
  c.moe.intermediate_size = 8;
  c.moe.gpt_oss_experts = true;
  const ModelLayout layout = BuildLayout(c);
  const UnitLayout& l0 = layout.units[layout.DecoderUnit(0)];
  using Shape = std::vector<int64_t>;
  const struct {
    TensorRole role;
    const char* name;
    Shape shape;
    bool decay;
  } want[] = {
      {TensorRole::kOBias, "model.layers.0.self_attn.o_proj.bias", {32}, false},
      {TensorRole::kSinks, "model.layers.0.self_attn.sinks", {4}, true},
      {TensorRole::kRouter, "model.layers.0.mlp.router.weight", {3, 32}, true},
      {TensorRole::kRouterBias, "model.layers.0.mlp.router.bias", {3}, false},
      {TensorRole::kExpertGateUpT, "model.layers.0.mlp.experts.gate_up_proj", {3, 32, 16}, true},
      {TensorRole::kExpertGateUpBias, "model.layers.0.mlp.experts.gate_up_proj_bias", {3, 16},
       false},
      {TensorRole::kExpertDownT, "model.layers.0.mlp.experts.down_proj", {3, 8, 32}, true},
      {TensorRole::kExpertDownBias, "model.layers.0.mlp.experts.down_proj_bias", {3, 32}, false},
  };
  for (const auto& w : want) {
    const TensorSlot* t = l0.Find(w.role);
    ASSERT_NE(t, nullptr) << w.name;
    EXPECT_EQ(t->name, w.name);
    EXPECT_EQ(t->shape, w.shape) << w.name;
    EXPECT_EQ(t->weight_decay, w.decay) << w.name;
    EXPECT_EQ(t->expert, -1) << w.name;
  }
  EXPECT_EQ(l0.Find(TensorRole::kExpertGate), nullptr);
  EXPECT_EQ(l0.Find(TensorRole::kGate), nullptr);
  EXPECT_GE(layout.TotalElements(), NumParameters(c));
  EXPECT_TRUE(l0.SameStructure(layout.units[layout.DecoderUnit(1)]));
}

TEST(LayoutTest, HeadDimOtherThanHiddenOverHeadsShapesAttention) {
  const ModelLayout layout = BuildLayout(TinyQwen3());  // C=32, H=4, KV=2, D=16
  const UnitLayout& l0 = layout.units[layout.DecoderUnit(0)];
  using Shape = std::vector<int64_t>;
  EXPECT_EQ(l0.Find(TensorRole::kQ)->shape, Shape({64, 32}));
  EXPECT_EQ(l0.Find(TensorRole::kK)->shape, Shape({32, 32}));
  EXPECT_EQ(l0.Find(TensorRole::kOProj)->shape, Shape({32, 64}));
  EXPECT_EQ(l0.Find(TensorRole::kQNorm)->shape, Shape({16}));
  EXPECT_EQ(l0.Find(TensorRole::kKNorm)->shape, Shape({16}));
}

TEST(LayoutTest, QkvAreAdjacentAsOneFusedMatrix) {
  for (const ModelConfig& c : {TinyLlama(), TinyQwen2(), TinyQwen3()}) {
    const ModelLayout layout = BuildLayout(c);
    const int64_t H = c.num_heads, KV = c.num_kv_heads, D = c.head_dim, C = c.hidden_size;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const UnitLayout& u = layout.units[layout.DecoderUnit(l)];
      const int64_t q = u.OffsetOf(TensorRole::kQ);
      EXPECT_EQ(u.OffsetOf(TensorRole::kK), q + H * D * C) << u.name;
      EXPECT_EQ(u.OffsetOf(TensorRole::kV), q + (H + KV) * D * C) << u.name;
      const int64_t gate = u.OffsetOf(TensorRole::kGate);
      EXPECT_EQ(u.OffsetOf(TensorRole::kUp), gate + c.intermediate_size * C) << u.name;
    }
  }
}

TEST(LayoutTest, GroupsStartOn64ElementBoundariesAndTensorsDoNotOverlap) {
  for (const ModelConfig& c : {TinyLlama(), TinyQwen2(), TinyQwen3()}) {
    const ModelLayout layout = BuildLayout(c);
    for (const UnitLayout& u : layout.units) {
      EXPECT_EQ(u.num_elements % 64, 0) << u.name;
      int64_t end = 0;
      for (const TensorSlot& t : u.tensors) {
        EXPECT_GE(t.offset, end) << t.name << " overlaps the tensor before it";
        int64_t n = 1;
        for (int64_t d : t.shape) n *= d;
        EXPECT_EQ(t.num_elements, n) << t.name;
        end = t.offset + t.num_elements;
        // Group heads: everything but the second and third of q/k/v, its biases, and up.
        const bool follows_in_group = t.role == TensorRole::kK || t.role == TensorRole::kV ||
                                      t.role == TensorRole::kKBias ||
                                      t.role == TensorRole::kVBias || t.role == TensorRole::kUp;
        if (!follows_in_group) {
          EXPECT_EQ(t.offset % 64, 0) << t.name;
        }
      }
      EXPECT_LE(end, u.num_elements) << u.name;
    }
  }
}

TEST(LayoutTest, QkvBiasOnlyWithQkvBiasAndAdjacent) {
  const ModelLayout plain = BuildLayout(TinyLlama());
  for (const UnitLayout& u : plain.units) {
    for (const TensorSlot& t : u.tensors) EXPECT_FALSE(IsBiasRole(t.role)) << t.name;
  }
  const ModelConfig c = TinyQwen2();
  const ModelLayout layout = BuildLayout(c);
  const UnitLayout& u = layout.units[layout.DecoderUnit(1)];
  const TensorSlot* q = u.Find(TensorRole::kQBias);
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->name, "model.layers.1.self_attn.q_proj.bias");
  EXPECT_EQ(q->shape, std::vector<int64_t>({c.num_heads * c.head_dim}));
  EXPECT_EQ(u.Find(TensorRole::kKBias)->name, "model.layers.1.self_attn.k_proj.bias");
  EXPECT_EQ(u.Find(TensorRole::kVBias)->name, "model.layers.1.self_attn.v_proj.bias");
  EXPECT_EQ(u.OffsetOf(TensorRole::kKBias), q->offset + c.num_heads * c.head_dim);
  EXPECT_EQ(u.OffsetOf(TensorRole::kVBias),
            q->offset + (c.num_heads + c.num_kv_heads) * c.head_dim);
}

TEST(LayoutTest, QkNormOnlyWithQkNorm) {
  for (const ModelConfig& c : {TinyLlama(), TinyQwen2()}) {
    const ModelLayout layout = BuildLayout(c);
    EXPECT_EQ(layout.units[1].Find(TensorRole::kQNorm), nullptr);
    EXPECT_EQ(layout.units[1].Find(TensorRole::kKNorm), nullptr);
  }
  const ModelLayout layout = BuildLayout(TinyQwen3());
  const UnitLayout& u = layout.units[layout.DecoderUnit(0)];
  ASSERT_NE(u.Find(TensorRole::kQNorm), nullptr);
  ASSERT_NE(u.Find(TensorRole::kKNorm), nullptr);
  EXPECT_EQ(u.Find(TensorRole::kQNorm)->name, "model.layers.0.self_attn.q_norm.weight");
  EXPECT_EQ(u.Find(TensorRole::kKNorm)->name, "model.layers.0.self_attn.k_norm.weight");
}

TEST(LayoutTest, LmHeadOnlyWhenEmbeddingsAreUntied) {
  const ModelLayout untied = BuildLayout(TinyLlama(/*tied=*/false));
  const UnitLayout& head = untied.units[untied.HeadUnit()];
  EXPECT_THAT(NamesOf(head), ElementsAre("model.norm.weight", "lm_head.weight"));
  EXPECT_EQ(head.Find(TensorRole::kLmHead)->shape, std::vector<int64_t>({300, 32}));
  const ModelLayout tied = BuildLayout(TinyLlama(/*tied=*/true));
  EXPECT_THAT(NamesOf(tied.units[tied.HeadUnit()]), ElementsAre("model.norm.weight"));
}

TEST(LayoutTest, WeightDecayOnMatricesAndEmbeddingNotOnNormsOrBiases) {
  for (const ModelConfig& c : {TinyLlama(), TinyQwen2(), TinyQwen3()}) {
    const ModelLayout layout = BuildLayout(c);
    for (const UnitLayout& u : layout.units) {
      for (const TensorSlot& t : u.tensors) {
        const bool no_decay = IsNormRole(t.role) || IsBiasRole(t.role);
        EXPECT_EQ(t.weight_decay, !no_decay) << t.name;
        EXPECT_EQ(t.shape.size(), no_decay ? 1u : 2u) << t.name;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// HostStore

// Frozen tensors: a frozen layer has no state and keeps bf16 weights even when the master
// streams; a layer frozen in part keeps state for the range of its trainable tensors, its
// master loaded there and its bf16 weights everywhere; the arena is what the planner counts.
TEST(HostStoreTest, FrozenTensorsKeepBf16AloneAndStateCoversTheTrainableRange) {
  const ModelConfig c = TinyLlama();
  ModelLayout layout = BuildLayout(c);
  for (const TensorSlot& t : layout.units[layout.DecoderUnit(0)].tensors) {
    ASSERT_TRUE(layout.SetTrainable(t.name, false).ok());
  }
  const UnitLayout& layer1 = layout.units[layout.DecoderUnit(1)];
  for (const TensorSlot& t : layer1.tensors) {
    if (t.role == TensorRole::kGate || t.role == TensorRole::kUp || t.role == TensorRole::kDown) {
      ASSERT_TRUE(layout.SetTrainable(t.name, false).ok());
    }
  }
  StoreOptions o;
  o.bf16_copy = false;
  absl::StatusOr<std::unique_ptr<HostStore>> store = HostStore::Create(layout, -1, o);
  ASSERT_TRUE(store.ok()) << store.status();
  HostStore& s = **store;
  EXPECT_EQ(HostStore::TransferArenaBytes(layout, false), s.transfer_bytes());
  const int64_t u0 = layout.DecoderUnit(0), u1 = layout.DecoderUnit(1);
  const int64_t gate = layer1.Find(TensorRole::kGate)->offset;
  EXPECT_EQ(s.state_elements(u0), 0);
  EXPECT_TRUE(s.has_bf16(u0));
  EXPECT_EQ(s.state_begin(u1), 0);
  EXPECT_LE(s.state_elements(u1), gate);
  EXPECT_TRUE(s.has_bf16(u1));
  EXPECT_FALSE(s.has_bf16(ModelLayout::EmbeddingUnit()));  // all trainable: its master streams
  RandomInitWeights(c, 7, &s);
  // The master holds the trainable range; the bf16 weights are it rounded, and the frozen
  // tensors' own draw.
  for (int64_t i = 0; i < s.state_elements(u1); ++i) {
    ASSERT_EQ(s.weights(u1)[i], FloatToBf16(s.master(u1)[i])) << i;
  }
  const TensorSlot& up = *layer1.Find(TensorRole::kUp);
  int nonzero = 0;
  for (int64_t i = up.offset; i < up.offset + up.num_elements; ++i) nonzero += s.weights(u1)[i] != 0;
  EXPECT_GT(nonzero, up.num_elements / 2);
  // State: the embedding's and head's whole units, layer 1's range, nothing of layer 0.
  StoreOptions all_options;
  all_options.bf16_copy = false;
  absl::StatusOr<std::unique_ptr<HostStore>> all = HostStore::Create(BuildLayout(c), -1, all_options);
  ASSERT_TRUE(all.ok());
  EXPECT_LT(s.state_bytes() + s.transfer_bytes(), (*all)->state_bytes() + (*all)->transfer_bytes());
}

// What a planner counts for a store's transfer arena is what Create maps, with the bf16
// copy, without it, and for a store of the weights alone.
TEST(HostStoreTest, TransferArenaBytesIsWhatCreateMaps) {
  for (const ModelConfig& c : {TinyLlama(), TinyQwen2()}) {
    const ModelLayout layout = BuildLayout(c);
    for (const bool copy : {true, false}) {
      StoreOptions o;
      o.bf16_copy = copy;
      absl::StatusOr<std::unique_ptr<HostStore>> store = HostStore::Create(layout, -1, o);
      ASSERT_TRUE(store.ok()) << store.status();
      EXPECT_EQ(HostStore::TransferArenaBytes(layout, copy), (*store)->transfer_bytes()) << copy;
    }
    StoreOptions weights;
    weights.weights_only = true;
    absl::StatusOr<std::unique_ptr<HostStore>> store = HostStore::Create(layout, -1, weights);
    ASSERT_TRUE(store.ok()) << store.status();
    EXPECT_EQ(HostStore::TransferArenaBytes(layout, true), (*store)->transfer_bytes());
    EXPECT_EQ((*store)->state_bytes(), 0u);
  }
}

TEST(HostStoreTest, UnitRegionsAre4KiBAlignedDisjointAndInsideTheArenas) {
  for (const ModelConfig& c : {TinyLlama(), TinyQwen2()}) {
    std::unique_ptr<HostStore> store = MakeStore(c);
    ASSERT_NE(store, nullptr);
    const uintptr_t t_begin = reinterpret_cast<uintptr_t>(store->transfer_base());
    const uintptr_t t_end = t_begin + store->transfer_bytes();
    const uintptr_t s_begin = reinterpret_cast<uintptr_t>(store->master(0));  // arena start
    const uintptr_t s_end = s_begin + store->state_bytes();
    std::vector<std::pair<uintptr_t, uintptr_t>> regions;  // [begin, end) bytes
    for (int64_t u = 0; u < store->num_units(); ++u) {
      const uintptr_t n = static_cast<uintptr_t>(store->unit_elements(u));
      const uintptr_t w = reinterpret_cast<uintptr_t>(store->weights(u));
      EXPECT_EQ(w % kPage, 0u) << "weights of unit " << u;
      EXPECT_GE(w, t_begin);
      EXPECT_LE(w + 2 * n, t_end) << "weights of unit " << u;
      regions.emplace_back(w, w + 2 * n);
      for (float* p : {store->master(u), store->exp_avg(u), store->exp_avg_sq(u)}) {
        const uintptr_t a = reinterpret_cast<uintptr_t>(p);
        EXPECT_EQ(a % kPage, 0u) << "state of unit " << u;
        EXPECT_GE(a, s_begin);
        EXPECT_LE(a + 4 * n, s_end) << "state of unit " << u;
        regions.emplace_back(a, a + 4 * n);
      }
    }
    std::sort(regions.begin(), regions.end());
    for (size_t i = 1; i < regions.size(); ++i) {
      EXPECT_LE(regions[i - 1].second, regions[i].first) << "regions " << i - 1 << " and " << i;
    }
  }
}

TEST(HostStoreTest, TransferArenaCoversEveryUnitsBf16AndStateCoversThreeF32Copies) {
  std::unique_ptr<HostStore> store = MakeStore(TinyQwen2());
  ASSERT_NE(store, nullptr);
  size_t bf16_bytes = 0;
  for (int64_t u = 0; u < store->num_units(); ++u) bf16_bytes += 2 * store->unit_elements(u);
  EXPECT_GE(store->transfer_bytes(), bf16_bytes);
  EXPECT_EQ(store->transfer_bytes() % kPage, 0u);
  EXPECT_GE(store->state_bytes(), 6 * bf16_bytes);  // 3 f32 copies = 6x the bf16 bytes
  // The last unit's weights end inside the arena, so one registration pins all of them.
  const int64_t last = store->num_units() - 1;
  EXPECT_LE(reinterpret_cast<char*>(store->weights(last) + store->unit_elements(last)),
            static_cast<char*>(store->transfer_base()) + store->transfer_bytes());
}

TEST(HostStoreTest, FreshStoreIsZeroed) {
  std::unique_ptr<HostStore> store = MakeStore(TinyLlama());
  ASSERT_NE(store, nullptr);
  for (int64_t u = 0; u < store->num_units(); ++u) {
    for (int64_t i = 0; i < store->unit_elements(u); ++i) {
      ASSERT_EQ(store->weights(u)[i], 0);
      ASSERT_EQ(store->master(u)[i], 0.0f);
      ASSERT_EQ(store->exp_avg(u)[i], 0.0f);
      ASSERT_EQ(store->exp_avg_sq(u)[i], 0.0f);
    }
  }
}

// Data parallelism over GPUs on several NUMA nodes: the store spreads over the distinct
// known nodes of the devices; nodes this machine lacks are left out, so a set of one known
// node binds to it (what this one-node machine can check: its memory policy).
TEST(HostArenaTest, NodeSetsBindOrInterleaveAndIgnoreNodesThatAreNotThere) {
  EXPECT_EQ(StoreNodes({}), std::vector<int>{});
  EXPECT_EQ(StoreNodes({-1, -1}), std::vector<int>{});
  EXPECT_EQ(StoreNodes({1, 0, 1, -1, 0}), (std::vector<int>{1, 0}));
  if (numa_available() < 0) GTEST_SKIP() << "no NUMA support";
  const int missing = numa_max_node() + 1;
  absl::StatusOr<HostArena> arena = HostArena::Map(1 << 20, "test", std::vector<int>{0, missing});
  ASSERT_TRUE(arena.ok()) << arena.status();
  int mode = -1;
  ASSERT_EQ(get_mempolicy(&mode, nullptr, 0, arena->data(), MPOL_F_ADDR), 0);
  EXPECT_EQ(mode, numa_max_node() == 0 ? MPOL_BIND : MPOL_INTERLEAVE);
  std::memset(arena->data(), 1, arena->bytes());  // usable
  absl::StatusOr<HostArena> none = HostArena::Map(1 << 20, "test", std::vector<int>{missing});
  ASSERT_TRUE(none.ok()) << none.status();
  ASSERT_EQ(get_mempolicy(&mode, nullptr, 0, none->data(), MPOL_F_ADDR), 0);
  EXPECT_EQ(mode, MPOL_DEFAULT);
}

TEST(HostArenaTest, MapOfZeroBytesIsEmptyAndImpossibleSizeIsResourceExhausted) {
  absl::StatusOr<HostArena> empty = HostArena::Map(0, "nothing");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->data(), nullptr);
  EXPECT_EQ(empty->bytes(), 0u);

  absl::StatusOr<HostArena> huge = HostArena::Map(size_t{1} << 60, "test tensors");
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(huge.status().message()), HasSubstr("test tensors"));
}

TEST(HostArenaTest, SizeIsRoundedUpToWholePagesAndMoveTransfersOwnership) {
  absl::StatusOr<HostArena> arena = HostArena::Map(5000, "test");
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_EQ(arena->bytes(), 2 * kPage);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(arena->data()) % kPage, 0u);
  char* data = arena->data();
  data[arena->bytes() - 1] = 1;  // the rounded-up tail is usable
  HostArena moved = std::move(*arena);
  EXPECT_EQ(moved.data(), data);
  EXPECT_EQ(arena->data(), nullptr);  // NOLINT(bugprone-use-after-move): checks the move
}

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

TEST(HostStoreTest, RefreshWeightsFromMasterRoundsToNearestEven) {
  std::unique_ptr<HostStore> store = MakeStore(TinyLlama());
  ASSERT_NE(store, nullptr);
  const int64_t unit = store->layout().DecoderUnit(1);
  // (fp32 bits, expected bf16 bits)
  const std::vector<std::pair<uint32_t, uint16_t>> cases = {
      {0x3f800000u, 0x3f80},  // 1.0: exact
      {0x3f808000u, 0x3f80},  // 1 + 2^-8: tie, lower neighbour even -> down
      {0x3f818000u, 0x3f82},  // 1 + 3*2^-8: tie, upper neighbour even -> up
      {0x3f808001u, 0x3f81},  // just above the tie -> up
      {0x3f807fffu, 0x3f80},  // just below the tie -> down
      {0xbf808000u, 0xbf80},  // negative tie -> magnitude down
      {0xbf818000u, 0xbf82},  // negative tie -> magnitude up
      {0x7f7fffffu, 0x7f80},  // FLT_MAX rounds to +inf, as PyTorch does
      {0x7f800000u, 0x7f80},  // +inf
      {0xff800000u, 0xff80},  // -inf
      {0x00000001u, 0x0000},  // smallest subnormal -> +0
      {0x80000000u, 0x8000},  // -0 keeps its sign
  };
  for (size_t i = 0; i < cases.size(); ++i) store->master(unit)[i] = FromBits(cases[i].first);
  store->master(unit)[cases.size()] = FromBits(0x7fc00001u);  // NaN
  store->RefreshWeightsFromMaster(unit);
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(store->weights(unit)[i], cases[i].second) << std::hex << cases[i].first;
  }
  EXPECT_TRUE(std::isnan(Bf16ToFloat(store->weights(unit)[cases.size()])));
  // Other units are not touched.
  EXPECT_EQ(store->weights(store->layout().DecoderUnit(0))[1], 0);
}

// ---------------------------------------------------------------------------------------
// GradSlabPool

TEST(GradSlabPoolTest, AcquireReturnsDistinctAlignedSlabsInsideThePool) {
  absl::StatusOr<std::unique_ptr<GradSlabPool>> pool = GradSlabPool::Create(3, 1000);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->num_slabs(), 3);
  EXPECT_EQ((*pool)->slab_elements(), 1000);
  const uintptr_t begin = reinterpret_cast<uintptr_t>((*pool)->base());
  const uintptr_t end = begin + (*pool)->bytes();
  std::vector<float*> slabs;
  for (int i = 0; i < 3; ++i) slabs.push_back((*pool)->Acquire());
  std::vector<float*> sorted = slabs;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(sorted[i]);
    EXPECT_EQ(a % kPage, 0u);
    EXPECT_GE(a, begin);
    EXPECT_LE(a + 1000 * sizeof(float), end);
    if (i > 0) {
      EXPECT_GE(a, reinterpret_cast<uintptr_t>(sorted[i - 1] + 1000));
    }
  }
  // Every element of every slab is writable.
  for (float* s : slabs) std::fill(s, s + 1000, 1.0f);
  for (float* s : slabs) (*pool)->Release(s);
}

TEST(GradSlabPoolTest, AcquireWhenAllSlabsLentBlocksUntilAnotherThreadReleases) {
  absl::StatusOr<std::unique_ptr<GradSlabPool>> pool = GradSlabPool::Create(2, 64);
  ASSERT_TRUE(pool.ok()) << pool.status();
  GradSlabPool* p = pool->get();
  float* a = p->Acquire();
  float* b = p->Acquire();
  std::atomic<bool> acquired{false};
  std::atomic<float*> got{nullptr};
  std::thread waiter([&] {
    got = p->Acquire();
    acquired = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(acquired.load()) << "Acquire returned while every slab was lent";
  p->Release(b);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!acquired && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const bool woke = acquired.load();
  if (!woke) p->Release(a);  // unblock the waiter so join() cannot hang
  waiter.join();
  ASSERT_TRUE(woke) << "Acquire stayed blocked after a Release";
  EXPECT_EQ(got.load(), b);
  p->Release(got.load());
  p->Release(a);
}

TEST(GradSlabPoolTest, ConcurrentAcquireReleaseNeverLendsASlabTwice) {
  absl::StatusOr<std::unique_ptr<GradSlabPool>> pool = GradSlabPool::Create(2, 16);
  ASSERT_TRUE(pool.ok()) << pool.status();
  GradSlabPool* p = pool->get();
  std::map<float*, int> index;
  for (int i = 0; i < 2; ++i) {
    float* s = p->Acquire();
    index[s] = i;
  }
  for (auto& kv : index) p->Release(kv.first);
  std::atomic<int> holders[2] = {{0}, {0}};
  std::atomic<int> double_lends{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        float* s = p->Acquire();
        const int k = index.at(s);
        if (holders[k].fetch_add(1) != 0) ++double_lends;
        holders[k].fetch_sub(1);
        p->Release(s);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(double_lends.load(), 0);
}

TEST(GradSlabPoolDeathTest, ReleasingAPointerNotFromThePoolAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  absl::StatusOr<std::unique_ptr<GradSlabPool>> pool = GradSlabPool::Create(1, 16);
  ASSERT_TRUE(pool.ok()) << pool.status();
  float foreign[16];
  EXPECT_DEATH((*pool)->Release(foreign), "check failed");
}

// ---------------------------------------------------------------------------------------
// RandomInitWeights

// Expects every unit of `a` and `b` to hold the same master bits (padding included).
void ExpectSameMaster(const HostStore& a, const HostStore& b) {
  for (int64_t u = 0; u < a.num_units(); ++u) {
    EXPECT_EQ(std::memcmp(a.master(u), b.master(u), a.unit_elements(u) * sizeof(float)), 0)
        << a.layout().units[u].name;
  }
}

TEST(RandomInitTest, SameSeedGivesIdenticalWeights) {
  const ModelConfig c = TinyQwen2();
  std::unique_ptr<HostStore> a = MakeStore(c), b = MakeStore(c);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  RandomInitWeights(c, 17, a.get());
  RandomInitWeights(c, 17, b.get());
  ExpectSameMaster(*a, *b);
}

TEST(RandomInitTest, AnotherSeedGivesDifferentMatrices) {
  const ModelConfig c = TinyLlama();
  std::unique_ptr<HostStore> a = MakeStore(c), b = MakeStore(c);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  RandomInitWeights(c, 17, a.get());
  RandomInitWeights(c, 18, b.get());
  for (int64_t u = 0; u < a->num_units(); ++u) {
    for (const TensorSlot& t : a->layout().units[u].tensors) {
      if (t.shape.size() != 2) continue;
      int64_t same = 0;
      for (int64_t i = 0; i < t.num_elements; ++i) {
        same += a->master(u)[t.offset + i] == b->master(u)[t.offset + i];
      }
      EXPECT_LT(same, t.num_elements / 100 + 1) << t.name;
    }
  }
}

TEST(RandomInitTest, DifferentTensorsGetDifferentValues) {
  const ModelConfig c = TinyLlama();
  std::unique_ptr<HostStore> s = MakeStore(c);
  ASSERT_NE(s, nullptr);
  RandomInitWeights(c, 3, s.get());
  const ModelLayout& layout = s->layout();
  // Same shape, different names: q_proj of layer 0 and layer 1, gate and up.
  const float* q0 = s->master(layout.DecoderUnit(0)) + layout.units[1].OffsetOf(TensorRole::kQ);
  const float* q1 = s->master(layout.DecoderUnit(1)) + layout.units[2].OffsetOf(TensorRole::kQ);
  EXPECT_NE(std::memcmp(q0, q1, 32 * 32 * sizeof(float)), 0);
  const UnitLayout& l0 = layout.units[1];
  EXPECT_NE(std::memcmp(s->master(1) + l0.OffsetOf(TensorRole::kGate),
                        s->master(1) + l0.OffsetOf(TensorRole::kUp), 64 * 32 * sizeof(float)),
            0);
}

TEST(RandomInitTest, NormsAreOneBiasesZeroAndPaddingZero) {
  for (const ModelConfig& c : {TinyQwen2(), TinyQwen3()}) {
    std::unique_ptr<HostStore> s = MakeStore(c);
    ASSERT_NE(s, nullptr);
    RandomInitWeights(c, 5, s.get());
    for (int64_t u = 0; u < s->num_units(); ++u) {
      std::vector<bool> covered(s->unit_elements(u), false);
      for (const TensorSlot& t : s->layout().units[u].tensors) {
        for (int64_t i = 0; i < t.num_elements; ++i) {
          covered[t.offset + i] = true;
          const float v = s->master(u)[t.offset + i];
          if (IsNormRole(t.role)) {
            ASSERT_EQ(v, 1.0f) << t.name << "[" << i << "]";
          } else if (IsBiasRole(t.role)) {
            ASSERT_EQ(v, 0.0f) << t.name << "[" << i << "]";
          }
        }
      }
      for (int64_t i = 0; i < s->unit_elements(u); ++i) {
        if (!covered[i]) {
          ASSERT_EQ(s->master(u)[i], 0.0f) << "padding " << i << " of unit " << u;
        }
      }
    }
  }
}

TEST(RandomInitTest, MatrixStdIsInitializerRangeAndMeanIsZero) {
  ModelConfig c = TinyLlama();
  c.initializer_range = 0.05;  // not the 0.02 default, so a hard-coded value would fail
  std::unique_ptr<HostStore> s = MakeStore(c);
  ASSERT_NE(s, nullptr);
  RandomInitWeights(c, 11, s.get());
  int checked = 0;
  for (int64_t u = 0; u < s->num_units(); ++u) {
    for (const TensorSlot& t : s->layout().units[u].tensors) {
      if (t.shape.size() != 2 || t.num_elements < 2048) continue;
      double sum = 0, sum_sq = 0;
      for (int64_t i = 0; i < t.num_elements; ++i) {
        const double v = s->master(u)[t.offset + i];
        sum += v;
        sum_sq += v * v;
      }
      const double mean = sum / t.num_elements;
      const double std = std::sqrt(sum_sq / t.num_elements - mean * mean);
      EXPECT_NEAR(std, 0.05, 0.005) << t.name << " (" << t.num_elements << " elements)";
      EXPECT_NEAR(mean, 0.0, 4 * 0.05 / std::sqrt(double(t.num_elements))) << t.name;
      ++checked;
    }
  }
  EXPECT_GE(checked, 6);  // embedding, lm_head, gate/up/down of each layer
}

TEST(RandomInitTest, ResetsMomentsAndDerivesBf16WeightsFromMaster) {
  const ModelConfig c = TinyLlama();
  std::unique_ptr<HostStore> s = MakeStore(c);
  ASSERT_NE(s, nullptr);
  for (int64_t u = 0; u < s->num_units(); ++u) {
    std::fill(s->exp_avg(u), s->exp_avg(u) + s->unit_elements(u), 7.0f);
    std::fill(s->exp_avg_sq(u), s->exp_avg_sq(u) + s->unit_elements(u), 7.0f);
  }
  RandomInitWeights(c, 1, s.get());
  for (int64_t u = 0; u < s->num_units(); ++u) {
    for (int64_t i = 0; i < s->unit_elements(u); ++i) {
      ASSERT_EQ(s->exp_avg(u)[i], 0.0f);
      ASSERT_EQ(s->exp_avg_sq(u)[i], 0.0f);
      ASSERT_EQ(s->weights(u)[i], FloatToBf16(s->master(u)[i]));
    }
  }
}

TEST(RandomInitTest, IndependentOfOmpThreadCount) {
  const ModelConfig c = TinyQwen3();
  std::unique_ptr<HostStore> one = MakeStore(c), two = MakeStore(c);
  ASSERT_NE(one, nullptr);
  ASSERT_NE(two, nullptr);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  RandomInitWeights(c, 21, one.get());
  omp_set_num_threads(2);
  RandomInitWeights(c, 21, two.get());
  omp_set_num_threads(saved);
  ExpectSameMaster(*one, *two);
  for (int64_t u = 0; u < one->num_units(); ++u) {
    EXPECT_EQ(std::memcmp(one->weights(u), two->weights(u), one->unit_elements(u) * 2), 0);
  }
}

TEST(RandomInitTest, TensorValuesDoNotDependOnTheRestOfTheModel) {
  // Each tensor has its own generator: layer 0 of a 2-layer and a 3-layer model agree.
  ModelConfig small = TinyLlama(), big = TinyLlama();
  big.num_layers = 3;
  std::unique_ptr<HostStore> a = MakeStore(small), b = MakeStore(big);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  RandomInitWeights(small, 9, a.get());
  RandomInitWeights(big, 9, b.get());
  EXPECT_EQ(std::memcmp(a->master(1), b->master(1), a->unit_elements(1) * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(a->master(0), b->master(0), a->unit_elements(0) * sizeof(float)), 0);
}

// ---------------------------------------------------------------------------------------
// LoadWeights

// The tensors of a model folder written by a test: bytes kept alive for the write, and
// the fp32 values a loader must produce.
class FakeModel {
 public:
  // Seeded values for every tensor of `layout`, stored in a rotating dtype: f32, bf16, f16.
  FakeModel(const ModelLayout& layout, uint64_t seed) {
    std::mt19937_64 gen(seed);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    int k = 0;
    for (const UnitLayout& u : layout.units) {
      for (const TensorSlot& t : u.tensors) {
        Tensor& out = tensors_[t.name];
        out.shape = t.shape;
        const DType kinds[3] = {DType::kF32, DType::kBF16, DType::kF16};
        out.dtype = kinds[k++ % 3];
        for (int64_t i = 0; i < t.num_elements; ++i) {
          float v = dist(gen);
          if (out.dtype == DType::kF32) {
            Append(&out.bytes, &v, 4);
          } else if (out.dtype == DType::kBF16) {
            const uint16_t h = FloatToBf16(v);
            Append(&out.bytes, &h, 2);
            v = Bf16ToFloat(h);
          } else {  // f16: sign, exponent 1..29, random mantissa
            const uint16_t h = static_cast<uint16_t>(((gen() & 1) << 15) |
                                                     ((1 + gen() % 29) << 10) | (gen() & 0x3ff));
            Append(&out.bytes, &h, 2);
            v = F16ToFloat(h);
          }
          out.values.push_back(v);
        }
      }
    }
  }

  std::map<std::string, std::vector<float>> Expected() const {
    std::map<std::string, std::vector<float>> out;
    for (const auto& [name, t] : tensors_) out[name] = t.values;
    return out;
  }
  void Remove(const std::string& name) { tensors_.erase(name); }
  void SetShape(const std::string& name, std::vector<int64_t> shape) {
    tensors_.at(name).shape = std::move(shape);
  }
  void AddF32(const std::string& name, std::vector<int64_t> shape, float value) {
    Tensor& t = tensors_[name];
    t.shape = std::move(shape);
    t.dtype = DType::kF32;
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    for (int64_t i = 0; i < n; ++i) Append(&t.bytes, &value, 4);
  }

  // Replaces tensor `name` (transformers' (E, K, R)) with MXFP4 `name`_blocks and
  // `name`_scales of random codes and scales near 2^0 (scales_rows: the scales' R, to make
  // them malformed); the expected values become their dequantization.
  void ToMxfp4(const std::string& name, uint64_t seed, int64_t scales_rows = -1) {
    const Tensor t = tensors_.at(name);
    tensors_.erase(name);
    const int64_t E = t.shape[0], K = t.shape[1], R = t.shape[2], G = K / 32;
    std::mt19937_64 gen(seed);
    Tensor& blocks = tensors_[name + "_blocks"];
    blocks.dtype = DType::kU8;
    blocks.shape = {E, R, G, 16};
    for (int64_t i = 0; i < E * R * G * 16; ++i) blocks.bytes.push_back(static_cast<char>(gen()));
    Tensor& scales = tensors_[name + "_scales"];
    scales.dtype = DType::kU8;
    scales.shape = {E, scales_rows < 0 ? R : scales_rows, G};
    for (int64_t i = 0; i < E * scales.shape[1] * G; ++i) {
      scales.bytes.push_back(static_cast<char>(120 + gen() % 12));
    }
    std::vector<float> values(E * K * R);
    if (scales_rows < 0) {
      DequantizeMxfp4(reinterpret_cast<const uint8_t*>(blocks.bytes.data()),
                      reinterpret_cast<const uint8_t*>(scales.bytes.data()), E, R, G,
                      values.data());
    }
    dequantized_[name] = values;
  }

  std::map<std::string, std::vector<float>> ExpectedWithMxfp4() const {
    std::map<std::string, std::vector<float>> out = Expected();
    for (const auto& [name, v] : dequantized_) out[name] = v;
    return out;
  }

  std::vector<TensorToWrite> ToWrite() const {
    std::vector<TensorToWrite> out;
    for (const auto& [name, t] : tensors_) {
      out.push_back(TensorToWrite{name, t.dtype, t.shape, t.bytes.data()});
    }
    return out;
  }

 private:
  struct Tensor {
    DType dtype = DType::kF32;
    std::vector<int64_t> shape;
    std::string bytes;
    std::vector<float> values;
  };
  static void Append(std::string* bytes, const void* p, size_t n) {
    bytes->append(static_cast<const char*>(p), n);
  }
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, std::vector<float>> dequantized_;
};

// Writes `model` to `dir`/model.safetensors and loads it into `store`.
absl::Status WriteAndLoad(const FakeModel& model, const std::string& dir, HostStore* store) {
  absl::Status w = WriteSafetensors(dir + "/model.safetensors", model.ToWrite(), {});
  if (!w.ok()) return w;
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(dir);
  if (!reader.ok()) return reader.status();
  return LoadWeights(*reader, store);
}

// Expects the store's master to hold `expected` exactly, moments zero, bf16 derived.
void ExpectLoaded(const HostStore& store, const std::map<std::string, std::vector<float>>& expected) {
  for (int64_t u = 0; u < store.num_units(); ++u) {
    for (const TensorSlot& t : store.layout().units[u].tensors) {
      const std::vector<float>& want = expected.at(t.name);
      for (int64_t i = 0; i < t.num_elements; ++i) {
        ASSERT_EQ(store.master(u)[t.offset + i], want[i]) << t.name << "[" << i << "]";
        ASSERT_EQ(store.weights(u)[t.offset + i], FloatToBf16(want[i])) << t.name;
        ASSERT_EQ(store.exp_avg(u)[t.offset + i], 0.0f) << t.name;
        ASSERT_EQ(store.exp_avg_sq(u)[t.offset + i], 0.0f) << t.name;
      }
    }
  }
}

void FillMoments(HostStore* store, float value) {
  for (int64_t u = 0; u < store->num_units(); ++u) {
    std::fill(store->exp_avg(u), store->exp_avg(u) + store->unit_elements(u), value);
    std::fill(store->exp_avg_sq(u), store->exp_avg_sq(u) + store->unit_elements(u), value);
  }
}

TEST(LoadWeightsTest, MixedF32Bf16F16TensorsLoadExactlyAndResetMoments) {
  for (const ModelConfig& c : {TinyLlama(), TinyQwen2(), TinyQwen3()}) {
    TempDir dir;
    std::unique_ptr<HostStore> store = MakeStore(c);
    ASSERT_NE(store, nullptr);
    FillMoments(store.get(), 3.0f);
    const FakeModel model(store->layout(), /*seed=*/77);
    const absl::Status s = WriteAndLoad(model, dir.path(), store.get());
    ASSERT_TRUE(s.ok()) << s;
    ExpectLoaded(*store, model.Expected());
  }
}

// A forward-only model (generation) keeps its bf16 weights alone: the same bits a full
// store derives from its master, loaded or drawn, in no state memory at all.
TEST(LoadWeightsTest, WeightsOnlyStoreHoldsTheFullStoresBf16WeightsAndNothingElse) {
  const ModelConfig c = TinyQwen3Moe();
  TempDir dir;
  std::unique_ptr<HostStore> full = MakeStore(c);
  StoreOptions options;
  options.weights_only = true;
  absl::StatusOr<std::unique_ptr<HostStore>> lean = HostStore::Create(full->layout(), -1, options);
  ASSERT_TRUE(lean.ok()) << lean.status();
  EXPECT_EQ((*lean)->state_bytes(), 0u);
  EXPECT_EQ((*lean)->transfer_bytes(), full->transfer_bytes());
  auto same_weights = [&]() {
    for (int64_t u = 0; u < full->num_units(); ++u) {
      ASSERT_EQ(std::memcmp(full->weights(u), (*lean)->weights(u), 2 * full->unit_elements(u)), 0)
          << "unit " << u;
    }
  };
  RandomInitWeights(c, 9, full.get());
  RandomInitWeights(c, 9, lean->get());
  same_weights();
  const FakeModel model(full->layout(), /*seed=*/79);
  ASSERT_TRUE(WriteAndLoad(model, dir.path(), full.get()).ok());
  ASSERT_TRUE(WriteAndLoad(model, dir.path(), lean->get()).ok());
  same_weights();
}

// The process's resident bytes (VmRSS) and, when `peak`, its high-water mark (VmHWM).
int64_t ResidentBytes(bool peak) {
  std::ifstream status("/proc/self/status");
  const std::string key = peak ? "VmHWM:" : "VmRSS:";
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(key.size())) * 1024;  // kB
  }
  return -1;
}

// Drawing a model whose units keep bf16 alone (a generation job's, a LoRA job's frozen base)
// holds no fp32 copy of a unit beside the store: a layer of GPT-OSS-120B is 13 GB of fp32,
// and every thread drawing one at once ran a 125 GiB box out of memory.
TEST(RandomInitWeightsTest, WeightsOnlyStoreNeedsNoFp32CopyOfAUnit) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a sanitizer's shadow memory and quarantine are resident too";
#endif
  ModelConfig c = TinyLlama();
  c.hidden_size = 512;
  c.num_heads = c.num_kv_heads = 4;
  c.head_dim = 128;
  c.intermediate_size = 5120;  // a layer: 9.4M elements, 38 MB of fp32
  StoreOptions options;
  options.weights_only = true;
  absl::StatusOr<std::unique_ptr<HostStore>> store =
      HostStore::Create(BuildLayout(c), -1, options);
  ASSERT_TRUE(store.ok()) << store.status();
  std::ofstream reset("/proc/self/clear_refs");
  reset << "5";  // the high-water mark restarts from what is resident now
  reset.close();
  if (!reset || ResidentBytes(true) > ResidentBytes(false) + (int64_t{4} << 20)) {
    GTEST_SKIP() << "this kernel does not let a process reset its peak resident memory";
  }
  const int64_t before = ResidentBytes(false);
  RandomInitWeights(c, 9, store->get());
  const int64_t grown = ResidentBytes(true) - before;
  EXPECT_LE(grown, static_cast<int64_t>((*store)->transfer_bytes()) + (int64_t{8} << 20))
      << "the store's bf16 weights are " << (*store)->transfer_bytes() << " bytes";
}

ModelConfig TinyGptOss() {
  ModelConfig c = TinyLlama();
  c.architecture = Architecture::kGptOss;
  c.qkv_bias = c.o_bias = c.attention_sinks = true;
  c.moe.num_experts = 3;
  c.moe.experts_per_token = 2;
  c.moe.intermediate_size = 64;  // MXFP4 packs 32 values per scale: C and I multiples of 32
  c.moe.gpt_oss_experts = true;
  return c;
}

// GPT-OSS's released checkpoints keep the experts in MXFP4: they load as transformers
// dequantizes them (mxfp4_test checks that against transformers bit for bit), everything
// else as usual.
TEST(LoadWeightsTest, GptOssMxfp4ExpertsLoadDequantized) {
  const ModelConfig c = TinyGptOss();
  TempDir dir;
  std::unique_ptr<HostStore> store = MakeStore(c);
  ASSERT_NE(store, nullptr);
  FakeModel model(store->layout(), /*seed=*/78);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".mlp.experts.";
    model.ToMxfp4(p + "gate_up_proj", 10 + l);
    model.ToMxfp4(p + "down_proj", 20 + l);
  }
  const absl::Status s = WriteAndLoad(model, dir.path(), store.get());
  ASSERT_TRUE(s.ok()) << s;
  ExpectLoaded(*store, model.ExpectedWithMxfp4());
}

TEST(LoadWeightsTest, GptOssMxfp4ScalesOfTheWrongShapeNameTheTensor) {
  const ModelConfig c = TinyGptOss();
  TempDir dir;
  std::unique_ptr<HostStore> store = MakeStore(c);
  ASSERT_NE(store, nullptr);
  FakeModel model(store->layout(), /*seed=*/79);
  model.ToMxfp4("model.layers.1.mlp.experts.down_proj", 30, /*scales_rows=*/31);
  const absl::Status s = WriteAndLoad(model, dir.path(), store.get());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              ::testing::HasSubstr("'model.layers.1.mlp.experts.down_proj_scales'"));
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("[3, 31, 2]"));
}

// What a submission checks: the headers alone give LoadWeights' errors, naming the tensor.
TEST(CheckModelTensorsTest, HeadersAloneFindMissingAndMisshapenTensors) {
  const ModelConfig c = TinyGptOss();
  std::unique_ptr<HostStore> store = MakeStore(c);
  ASSERT_NE(store, nullptr);
  auto check = [&](const FakeModel& model) {
    TempDir dir;
    EXPECT_TRUE(WriteSafetensors(dir.path() + "/model.safetensors", model.ToWrite(), {}).ok());
    absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(dir.path());
    EXPECT_TRUE(reader.ok()) << reader.status();
    return reader.ok() ? CheckModelTensors(*reader, store->layout()) : reader.status();
  };
  FakeModel good(store->layout(), 80);
  good.ToMxfp4("model.layers.0.mlp.experts.gate_up_proj", 1);
  EXPECT_TRUE(check(good).ok()) << check(good);

  FakeModel missing(store->layout(), 81);
  missing.Remove("model.layers.1.mlp.experts.down_proj_bias");
  absl::Status s = check(missing);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()),
              ::testing::HasSubstr("'model.layers.1.mlp.experts.down_proj_bias' not found"));

  FakeModel misshapen(store->layout(), 82);
  misshapen.SetShape("model.layers.0.mlp.router.weight", {32, 3});  // (E, C) transposed
  s = check(misshapen);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("[32, 3]"));

  FakeModel bad_scales(store->layout(), 83);
  bad_scales.ToMxfp4("model.layers.1.mlp.experts.gate_up_proj", 2, /*scales_rows=*/127);
  s = check(bad_scales);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              ::testing::HasSubstr("'model.layers.1.mlp.experts.gate_up_proj_scales'"));
}

TEST(LoadWeightsTest, ShardedFolderLoadsLikeASingleFile) {
  TempDir dir;
  const ModelConfig c = TinyLlama();
  std::unique_ptr<HostStore> store = MakeStore(c);
  ASSERT_NE(store, nullptr);
  const FakeModel model(store->layout(), /*seed=*/78);
  ASSERT_TRUE(WriteShardedSafetensors(dir.path(), "model", model.ToWrite(), 16 << 10, {}).ok());
  ASSERT_TRUE(fs::exists(dir.Join("model.safetensors.index.json")));
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(dir.path());
  ASSERT_TRUE(reader.ok()) << reader.status();
  ASSERT_TRUE(LoadWeights(*reader, store.get()).ok());
  ExpectLoaded(*store, model.Expected());
}

TEST(LoadWeightsTest, LmHeadInFileIsIgnoredWhenEmbeddingsAreTied) {
  TempDir dir;
  const ModelConfig c = TinyLlama(/*tied=*/true);
  std::unique_ptr<HostStore> store = MakeStore(c);
  ASSERT_NE(store, nullptr);
  FakeModel model(store->layout(), /*seed=*/79);
  model.AddF32("lm_head.weight", {300, 32}, 9.0f);
  model.AddF32("model.rotary_emb.inv_freq", {4}, 9.0f);  // extra tensors are not an error
  const absl::Status s = WriteAndLoad(model, dir.path(), store.get());
  ASSERT_TRUE(s.ok()) << s;
  ExpectLoaded(*store, model.Expected());
}

TEST(LoadWeightsTest, MissingTensorIsNotFoundNamingTheTensor) {
  TempDir dir;
  std::unique_ptr<HostStore> store = MakeStore(TinyLlama());
  ASSERT_NE(store, nullptr);
  FakeModel model(store->layout(), /*seed=*/80);
  model.Remove("model.layers.1.mlp.up_proj.weight");
  const absl::Status s = WriteAndLoad(model, dir.path(), store.get());
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("model.layers.1.mlp.up_proj.weight"));
}

TEST(LoadWeightsTest, MoeModelLoadsAndAMissingExpertTensorIsNotFoundNamingIt) {
  TempDir dir;
  std::unique_ptr<HostStore> store = MakeStore(TinyQwen3Moe());
  ASSERT_NE(store, nullptr);
  FakeModel model(store->layout(), /*seed=*/83);
  ASSERT_TRUE(WriteAndLoad(model, dir.path(), store.get()).ok());
  ExpectLoaded(*store, model.Expected());
  TempDir other;
  model.Remove("model.layers.0.mlp.experts.1.up_proj.weight");
  const absl::Status s = WriteAndLoad(model, other.path(), store.get());
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("model.layers.0.mlp.experts.1.up_proj.weight"));
}

TEST(LoadWeightsTest, UntiedModelWithoutLmHeadIsNotFound) {
  TempDir dir;
  std::unique_ptr<HostStore> store = MakeStore(TinyLlama(/*tied=*/false));
  ASSERT_NE(store, nullptr);
  FakeModel model(store->layout(), /*seed=*/81);
  model.Remove("lm_head.weight");
  const absl::Status s = WriteAndLoad(model, dir.path(), store.get());
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("lm_head.weight"));
}

TEST(LoadWeightsTest, WrongShapeIsInvalidArgumentNamingTensorAndFile) {
  TempDir dir;
  std::unique_ptr<HostStore> store = MakeStore(TinyLlama());
  ASSERT_NE(store, nullptr);
  FakeModel model(store->layout(), /*seed=*/82);
  // Same element count, transposed: only a shape check catches it.
  model.SetShape("model.layers.0.mlp.down_proj.weight", {64, 32});
  const absl::Status s = WriteAndLoad(model, dir.path(), store.get());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("model.layers.0.mlp.down_proj.weight"));
  EXPECT_THAT(std::string(s.message()), HasSubstr(dir.Join("model.safetensors")));
}

}  // namespace
}  // namespace megatrain
