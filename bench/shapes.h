// The model shapes the benchmarks run: the layer sizes of well-known models (weights are
// random; only the shapes matter for speed).
#pragma once

#include <string>

#include "engine/model/config.h"

namespace megatrain {

// qwen2.5-1.5b | qwen2.5-7b | llama-3.1-8b | tiny; false for any other name.
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
