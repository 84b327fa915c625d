// The model shapes the benchmarks run: the layer sizes of well-known models (weights are
// random; only the shapes matter for speed).
#pragma once

#include <string>

#include "engine/model/config.h"

namespace megatrain {

// Sets the depth; a GPT-OSS shape's layers alternate sliding (even) and full (odd).
inline void SetNumLayers(int64_t layers, ModelConfig* c) {
  c->num_layers = layers;
  c->sliding_layers.clear();
  if (c->architecture != Architecture::kGptOss) return;
  for (int64_t l = 0; l < layers; ++l) c->sliding_layers.push_back(l % 2 == 0);
}

// Qwen3-MoE's shared shape: QK-norm, 128 experts top-8 renormalised, the 151936-token
// vocabulary, RoPE base 1e6.
inline void Qwen3MoeShape(int64_t hidden, int64_t intermediate, int64_t layers, int64_t heads,
                          int64_t expert_intermediate, ModelConfig* c) {
  c->architecture = Architecture::kQwen3Moe;
  c->hidden_size = hidden, c->intermediate_size = intermediate, c->num_layers = layers;
  c->num_heads = heads, c->num_kv_heads = 4, c->vocab_size = 151936;
  c->qk_norm = true, c->rope_theta = 1e6;
  c->moe.num_experts = 128, c->moe.experts_per_token = 8;
  c->moe.intermediate_size = expert_intermediate;
  c->moe.norm_topk_prob = true, c->moe.router_aux_loss_coef = 0.001;
}

// qwen2.5-1.5b | qwen2.5-7b | llama-3.1-8b | llama-3.1-405b | qwen3-30b-a3b | qwen3-235b-a22b | mixtral-8x7b |
// gpt-oss-120b | gpt-oss-20b | tiny-moe | tiny; false for any other name. Cut a shape's depth with
// SetNumLayers (GPT-OSS's windows follow the layers).
inline bool NamedShape(const std::string& name, ModelConfig* c) {
  *c = ModelConfig{};
  c->head_dim = 128;
  c->rms_norm_eps = 1e-6;
  if (name == "qwen2.5-1.5b") {
    c->architecture = Architecture::kQwen2;
    c->hidden_size = 1536, c->intermediate_size = 8960, c->num_layers = 28;
    c->num_heads = 12, c->num_kv_heads = 2, c->vocab_size = 151936;
    c->tie_word_embeddings = true, c->qkv_bias = true, c->rope_theta = 1e6;
  } else if (name == "qwen2.5-7b") {
    c->architecture = Architecture::kQwen2;
    c->hidden_size = 3584, c->intermediate_size = 18944, c->num_layers = 28;
    c->num_heads = 28, c->num_kv_heads = 4, c->vocab_size = 152064;
    c->qkv_bias = true, c->rope_theta = 1e6;
  } else if (name == "llama-3.1-8b") {
    c->architecture = Architecture::kLlama;
    c->hidden_size = 4096, c->intermediate_size = 14336, c->num_layers = 32;
    c->num_heads = 32, c->num_kv_heads = 8, c->vocab_size = 128256;
    c->rope_theta = 500000, c->rms_norm_eps = 1e-5;
  } else if (name == "llama-3.1-405b") {
    c->architecture = Architecture::kLlama;
    c->hidden_size = 16384, c->intermediate_size = 53248, c->num_layers = 126;
    c->num_heads = 128, c->num_kv_heads = 8, c->vocab_size = 128256;
    c->rope_theta = 500000, c->rms_norm_eps = 1e-5;
  } else if (name == "qwen3-30b-a3b") {
    Qwen3MoeShape(2048, 6144, 48, 32, 768, c);
  } else if (name == "qwen3-235b-a22b") {
    Qwen3MoeShape(4096, 12288, 94, 64, 1536, c);
  } else if (name == "mixtral-8x7b") {  // 8 experts, top-2
    c->architecture = Architecture::kMixtral;
    c->hidden_size = 4096, c->intermediate_size = 14336, c->num_layers = 32;
    c->num_heads = 32, c->num_kv_heads = 8, c->vocab_size = 32000;
    c->rope_theta = 1e6, c->rms_norm_eps = 1e-5;
    c->moe.num_experts = 8, c->moe.experts_per_token = 2, c->moe.intermediate_size = 14336;
    c->moe.norm_topk_prob = true, c->moe.router_aux_loss_coef = 0.02;
  } else if (name == "gpt-oss-120b" || name == "gpt-oss-20b") {  // openai's config.json
    const bool big = name == "gpt-oss-120b";
    c->architecture = Architecture::kGptOss;
    c->hidden_size = 2880, c->intermediate_size = 2880, c->num_layers = big ? 36 : 24;
    c->num_heads = 64, c->num_kv_heads = 8, c->head_dim = 64, c->vocab_size = 201088;
    c->qkv_bias = c->o_bias = c->attention_sinks = true;
    c->sliding_window = 128, c->rope_theta = 150000, c->rms_norm_eps = 1e-5;
    c->rope_scaling.type = RopeScaling::Type::kYarn;
    c->rope_scaling.factor = 32, c->rope_scaling.original_max_position_embeddings = 4096;
    c->rope_scaling.truncate = false;
    c->rope_scaling.attention_factor = 0.1 * 3.4657359027997265 + 1;  // 0.1 ln 32 + 1
    c->moe.num_experts = big ? 128 : 32, c->moe.experts_per_token = 4;
    c->moe.intermediate_size = 2880, c->moe.norm_topk_prob = true;
    c->moe.gpt_oss_experts = true, c->moe.router_aux_loss_coef = 0.9;
  } else if (name == "tiny-moe") {  // for a smoke run on a CPU
    c->architecture = Architecture::kQwen3Moe;
    c->hidden_size = 256, c->intermediate_size = 704, c->num_layers = 4;
    c->num_heads = 4, c->num_kv_heads = 2, c->head_dim = 64, c->vocab_size = 32000;
    c->qk_norm = true, c->rope_theta = 10000;
    c->moe.num_experts = 16, c->moe.experts_per_token = 4, c->moe.intermediate_size = 128;
    c->moe.norm_topk_prob = true;
  } else if (name == "tiny") {  // for a smoke run on a CPU
    c->architecture = Architecture::kLlama;
    c->hidden_size = 256, c->intermediate_size = 704, c->num_layers = 4;
    c->num_heads = 4, c->num_kv_heads = 2, c->head_dim = 64, c->vocab_size = 32000;
    c->rope_theta = 10000, c->rms_norm_eps = 1e-5;
  } else {
    return false;
  }
  c->max_position_embeddings = 131072;
  SetNumLayers(c->num_layers, c);
  return true;
}

}  // namespace megatrain
