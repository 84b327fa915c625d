// Tiny models and batches for the pipeline's numerical tests, and a direct driver that
// runs the layer templates without the streaming pipeline (the reference it must match).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/backend/cpu_backend.h"
#include "engine/data/packer.h"
#include "engine/layers/decoder.h"
#include "engine/layers/head.h"
#include "engine/model/config.h"
#include "engine/model/layout.h"

namespace megatrain::testing {

enum class Variant {
  kLlamaTiedGqa,
  kQwen2UntiedBias,
  kQwen3QkNorm,
  kLlama3RopeMha,
  kQwen3MoeMixedLayers,  // softmax top-2 of 4 experts, not renormalised; layer 1 dense
  kMixtralRenormalised,  // top-2 of 5 experts, renormalised, every layer
  kGptOssSinksWindow,    // biases, sinks, window 3 on layers 0 and 2, YaRN, clamped experts
};

// Test-name suffix of a variant, for INSTANTIATE_TEST_SUITE_P.
template <typename ParamInfo>
std::string VariantName(const ParamInfo& info) {
  switch (info.param) {
    case Variant::kLlamaTiedGqa: return "LlamaTiedGqa";
    case Variant::kQwen2UntiedBias: return "Qwen2UntiedQkvBias";
    case Variant::kQwen3QkNorm: return "Qwen3QkNorm";
    case Variant::kLlama3RopeMha: return "Llama3RopeScalingMha";
    case Variant::kQwen3MoeMixedLayers: return "Qwen3MoeMixedLayers";
    case Variant::kMixtralRenormalised: return "MixtralRenormalised";
    case Variant::kGptOssSinksWindow: return "GptOssSinksWindow";
  }
  return "unknown";
}

inline ModelConfig TinyConfig(Variant v) {
  ModelConfig c;
  c.architecture = Architecture::kLlama;
  c.hidden_size = 16;
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 4;
  c.intermediate_size = 24;
  c.vocab_size = 19;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000;
  c.tie_word_embeddings = true;
  switch (v) {
    case Variant::kLlamaTiedGqa:
      break;
    case Variant::kQwen2UntiedBias:
      c.architecture = Architecture::kQwen2;
      c.qkv_bias = true;
      c.tie_word_embeddings = false;
      break;
    case Variant::kQwen3QkNorm:
      c.architecture = Architecture::kQwen3;
      c.qk_norm = true;
      c.head_dim = 6;  // != hidden / heads, as Qwen3 allows
      break;
    case Variant::kLlama3RopeMha:
      c.num_kv_heads = 4;
      c.tie_word_embeddings = false;
      c.rope_theta = 500000;
      c.rope_scaling.type = RopeScaling::Type::kLlama3;
      c.rope_scaling.factor = 8;
      c.rope_scaling.original_max_position_embeddings = 8;
      break;
    case Variant::kQwen3MoeMixedLayers:
      c.architecture = Architecture::kQwen3Moe;
      c.qk_norm = true;
      c.tie_word_embeddings = false;
      c.moe.num_experts = 4;
      c.moe.experts_per_token = 2;
      c.moe.intermediate_size = 10;
      c.moe.norm_topk_prob = false;
      c.moe.mlp_only_layers = {1};
      c.moe.output_router_logits = true;
      c.moe.router_aux_loss_coef = 0.3;  // large enough that its gradient shows
      break;
    case Variant::kMixtralRenormalised:
      c.architecture = Architecture::kMixtral;
      c.tie_word_embeddings = false;
      c.moe.num_experts = 5;
      c.moe.experts_per_token = 2;
      c.moe.intermediate_size = 8;
      c.moe.norm_topk_prob = true;
      c.moe.output_router_logits = true;
      c.moe.router_aux_loss_coef = 0.2;
      break;
    case Variant::kGptOssSinksWindow:
      c.architecture = Architecture::kGptOss;
      c.tie_word_embeddings = false;
      c.qkv_bias = c.o_bias = c.attention_sinks = true;
      c.sliding_window = 3;  // shorter than the documents, so the mask matters
      c.sliding_layers = {true, false, true};
      c.rope_theta = 150000;
      c.rope_scaling.type = RopeScaling::Type::kYarn;
      c.rope_scaling.factor = 4;
      c.rope_scaling.original_max_position_embeddings = 8;
      c.rope_scaling.truncate = false;
      c.rope_scaling.attention_factor = 0.1 * 1.3862943611198906 + 1;  // 0.1 ln 4 + 1
      c.moe.num_experts = 4;
      c.moe.experts_per_token = 2;
      c.moe.intermediate_size = 6;
      c.moe.norm_topk_prob = true;
      c.moe.gpt_oss_experts = true;
      c.moe.output_router_logits = true;
      c.moe.router_aux_loss_coef = 0.25;
      c.moe.swiglu_limit = 1.0;  // low, so that the clamp is active on some rows
      break;
  }
  return c;
}

// `rows` rows of `seq_len` tokens, two documents per row, a few ignored targets.
inline MicroBatch RandomBatch(int64_t rows, int64_t seq_len, int64_t vocab, uint64_t seed) {
  std::mt19937_64 gen(seed);
  MicroBatch b;
  b.rows = rows;
  b.seq_len = seq_len;
  const int64_t n = rows * seq_len;
  b.tokens.resize(n);
  b.targets.resize(n);
  b.doc_start.resize(n);
  b.positions.resize(n);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t split = r * seq_len + seq_len / 3 + static_cast<int64_t>(gen() % 3);
    for (int64_t i = r * seq_len; i < (r + 1) * seq_len; ++i) {
      b.tokens[i] = static_cast<int32_t>(gen() % vocab);
      b.doc_start[i] = static_cast<int32_t>(i < split ? r * seq_len : split);
      b.positions[i] = static_cast<int32_t>(i - b.doc_start[i]);
      b.targets[i] = (gen() % 5 == 0) ? -100 : static_cast<int32_t>(gen() % vocab);
    }
  }
  return b;
}

// Concatenates micro-batches' rows into one batch (same tokens, one micro-batch).
inline MicroBatch Concat(const std::vector<MicroBatch>& parts) {
  MicroBatch out;
  out.seq_len = parts[0].seq_len;
  for (const MicroBatch& p : parts) {
    const int32_t base = static_cast<int32_t>(out.tokens.size());
    out.rows += p.rows;
    out.tokens.insert(out.tokens.end(), p.tokens.begin(), p.tokens.end());
    out.targets.insert(out.targets.end(), p.targets.begin(), p.targets.end());
    out.positions.insert(out.positions.end(), p.positions.begin(), p.positions.end());
    for (int32_t d : p.doc_start) out.doc_start.push_back(d + base);
  }
  return out;
}

}  // namespace megatrain::testing
