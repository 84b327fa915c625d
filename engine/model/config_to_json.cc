// ModelConfigToJson: the config.json a saved checkpoint carries.
//
// Written for transformers 4.x and 5.x alike: both dtype spellings, and rope in both the
// 4.x fields (rope_theta, rope_scaling) and the 5.x rope_parameters. Every value is one
// ParseModelConfig reads back to the same ModelConfig.
#include <string>

#include "engine/model/config.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

// transformers' layer_types: one entry a decoder layer.
nlohmann::json LayerTypes(const ModelConfig& c) {
  nlohmann::json types = nlohmann::json::array();
  for (int64_t l = 0; l < c.num_layers; ++l) {
    types.push_back(c.AttentionWindow(l) > 0 ? "sliding_attention" : "full_attention");
  }
  return types;
}

}  // namespace

using Json = nlohmann::json;

std::string ModelConfigToJson(const ModelConfig& c) {
  Json j = Json::object();
  j["architectures"] = Json::array({ArchitectureClassName(c.architecture)});
  j["model_type"] = ArchitectureModelType(c.architecture);
  // transformers 5 reads "dtype", 4.x "torch_dtype"; both accept either.
  j["torch_dtype"] = "bfloat16";
  j["dtype"] = "bfloat16";
  j["hidden_act"] = "silu";
  j["hidden_size"] = c.hidden_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["intermediate_size"] = c.intermediate_size;
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["initializer_range"] = c.initializer_range;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["attention_bias"] = c.o_bias;  // Qwen2's q/k/v bias is implied by its class
  j["attention_dropout"] = 0.0;
  j["mlp_bias"] = false;
  j["use_cache"] = true;

  // Rope in both spellings: rope_theta + rope_scaling (transformers 4.x, still read by
  // 5.x) and rope_parameters (5.x). They always agree.
  j["rope_theta"] = c.rope_theta;
  const RopeScaling& r = c.rope_scaling;
  Json scaling = nullptr;  // null: no scaling
  if (r.type == RopeScaling::Type::kLlama3) {
    scaling = {{"rope_type", "llama3"},
               {"factor", r.factor},
               {"low_freq_factor", r.low_freq_factor},
               {"high_freq_factor", r.high_freq_factor},
               {"original_max_position_embeddings", r.original_max_position_embeddings}};
  } else if (r.type == RopeScaling::Type::kLinear || r.type == RopeScaling::Type::kDynamic) {
    scaling = {{"rope_type", r.type == RopeScaling::Type::kLinear ? "linear" : "dynamic"},
               {"factor", r.factor}};
  } else if (r.type == RopeScaling::Type::kYarn) {
    scaling = {{"rope_type", "yarn"},
               {"factor", r.factor},
               {"beta_fast", r.beta_fast},
               {"beta_slow", r.beta_slow},
               {"truncate", r.truncate},
               {"attention_factor", r.attention_factor},
               {"original_max_position_embeddings", r.original_max_position_embeddings}};
  }
  j["rope_scaling"] = scaling;
  Json params = scaling.is_null() ? Json{{"rope_type", "default"}} : scaling;
  params["rope_theta"] = c.rope_theta;
  j["rope_parameters"] = params;

  const Json window = c.sliding_window > 0 ? Json(c.sliding_window) : Json(nullptr);
  switch (c.architecture) {
    case Architecture::kLlama: break;
    case Architecture::kMistral:
    case Architecture::kMixtral: j["sliding_window"] = window; break;
    case Architecture::kQwen2:
    case Architecture::kQwen3:
    case Architecture::kQwen3Moe: {
      // layer_types says which layers slide; max_window_layers too where they are the top
      // ones (what transformers derives layer_types from when it is absent).
      j["use_sliding_window"] = c.sliding_window > 0;
      j["sliding_window"] = window;
      int64_t first = c.num_layers;
      while (first > 0 && c.AttentionWindow(first - 1) > 0) --first;
      bool suffix = true;
      for (int64_t l = 0; l < first; ++l) suffix = suffix && c.AttentionWindow(l) == 0;
      j["max_window_layers"] = suffix ? first : c.num_layers;
      if (c.sliding_window > 0) j["layer_types"] = LayerTypes(c);
      break;
    }
    case Architecture::kGptOss:
      j["sliding_window"] = window;
      j["layer_types"] = LayerTypes(c);
      break;
  }
  if (c.is_moe()) {
    const MoeConfig& m = c.moe;
    j["num_experts_per_tok"] = m.experts_per_token;
    j["router_aux_loss_coef"] = m.router_aux_loss_coef;
    j["output_router_logits"] = m.output_router_logits;
    if (c.architecture == Architecture::kQwen3Moe) {
      j["num_experts"] = m.num_experts;
      j["moe_intermediate_size"] = m.intermediate_size;
      j["norm_topk_prob"] = m.norm_topk_prob;
      j["decoder_sparse_step"] = m.decoder_sparse_step;
      j["mlp_only_layers"] = m.mlp_only_layers;
    } else if (c.architecture == Architecture::kGptOss) {
      j["num_local_experts"] = m.num_experts;
      j["swiglu_limit"] = m.swiglu_limit;
    } else {
      j["num_local_experts"] = m.num_experts;
      j["router_jitter_noise"] = 0.0;
    }
  }
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_id >= 0) j["eos_token_id"] = c.eos_token_id;
  return j.dump(2) + "\n";
}

}  // namespace megatrain
