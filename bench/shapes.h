// The model shapes the benchmarks run: the layer sizes of well-known models (weights are
// random; only the shapes matter for speed).
#pragma once

#include <string>

#include "engine/model/config.h"

namespace megatrain {

// qwen2.5-1.5b | qwen2.5-7b | llama-3.1-8b | qwen3-30b-a3b | mixtral-8x7b | tiny-moe |
// tiny; false for any other name.
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
  } else if (name == "qwen3-30b-a3b") {  // 128 experts, top-8 (norm_topk_prob)
    c->architecture = Architecture::kQwen3Moe;
    c->hidden_size = 2048, c->intermediate_size = 6144, c->num_layers = 48;
    c->num_heads = 32, c->num_kv_heads = 4, c->vocab_size = 151936;
    c->qk_norm = true, c->rope_theta = 1e6;
    c->moe.num_experts = 128, c->moe.experts_per_token = 8, c->moe.intermediate_size = 768;
    c->moe.norm_topk_prob = true, c->moe.router_aux_loss_coef = 0.001;
  } else if (name == "mixtral-8x7b") {  // 8 experts, top-2
    c->architecture = Architecture::kMixtral;
    c->hidden_size = 4096, c->intermediate_size = 14336, c->num_layers = 32;
    c->num_heads = 32, c->num_kv_heads = 8, c->vocab_size = 32000;
    c->rope_theta = 1e6, c->rms_norm_eps = 1e-5;
    c->moe.num_experts = 8, c->moe.experts_per_token = 2, c->moe.intermediate_size = 14336;
    c->moe.norm_topk_prob = true, c->moe.router_aux_loss_coef = 0.02;
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
  return true;
}

}  // namespace megatrain
