// ExpectSameConfig: two ModelConfigs field by field, for the tests of what survives a trip
// through config.json (config_test's ToJson and Parse, checkpoint_test's saved folder).
#pragma once

#include "engine/model/config.h"
#include "gtest/gtest.h"

namespace megatrain::testing_configs {

inline void ExpectSameConfig(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.architecture, b.architecture);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.sliding_window, b.sliding_window);
  EXPECT_EQ(a.sliding_layers, b.sliding_layers);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.rope_scaling.type, b.rope_scaling.type);
  EXPECT_EQ(a.rope_scaling.factor, b.rope_scaling.factor);
  EXPECT_EQ(a.rope_scaling.low_freq_factor, b.rope_scaling.low_freq_factor);
  EXPECT_EQ(a.rope_scaling.high_freq_factor, b.rope_scaling.high_freq_factor);
  EXPECT_EQ(a.rope_scaling.original_max_position_embeddings,
            b.rope_scaling.original_max_position_embeddings);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.qkv_bias, b.qkv_bias);
  EXPECT_EQ(a.qk_norm, b.qk_norm);
  EXPECT_EQ(a.initializer_range, b.initializer_range);
  EXPECT_EQ(a.bos_token_id, b.bos_token_id);
  EXPECT_EQ(a.eos_token_id, b.eos_token_id);
  EXPECT_EQ(a.moe.num_experts, b.moe.num_experts);
  EXPECT_EQ(a.moe.experts_per_token, b.moe.experts_per_token);
  EXPECT_EQ(a.moe.intermediate_size, b.moe.intermediate_size);
  EXPECT_EQ(a.moe.norm_topk_prob, b.moe.norm_topk_prob);
  EXPECT_EQ(a.moe.router_aux_loss_coef, b.moe.router_aux_loss_coef);
  EXPECT_EQ(a.moe.output_router_logits, b.moe.output_router_logits);
  EXPECT_EQ(a.moe.decoder_sparse_step, b.moe.decoder_sparse_step);
  EXPECT_EQ(a.moe.mlp_only_layers, b.moe.mlp_only_layers);
  EXPECT_EQ(a.o_bias, b.o_bias);
  EXPECT_EQ(a.attention_sinks, b.attention_sinks);
  EXPECT_EQ(a.rope_scaling.beta_fast, b.rope_scaling.beta_fast);
  EXPECT_EQ(a.rope_scaling.beta_slow, b.rope_scaling.beta_slow);
  EXPECT_EQ(a.rope_scaling.truncate, b.rope_scaling.truncate);
  EXPECT_EQ(a.rope_scaling.attention_factor, b.rope_scaling.attention_factor);
  EXPECT_EQ(a.moe.gpt_oss_experts, b.moe.gpt_oss_experts);
  EXPECT_EQ(a.moe.swiglu_limit, b.moe.swiglu_limit);
}

}  // namespace megatrain::testing_configs
