// ModelConfig: the architecture hyperparameters of a decoder-only model, parsed from a
// Hugging Face config.json.
//
// Only what the engine implements is accepted. An unknown architecture, an unsupported
// field value (rope_scaling other than "llama3" or "yarn", hidden_act other than "silu", an
// MLP bias, ...) is an InvalidArgument naming the field, never a silent guess.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace megatrain {

enum class Architecture {
  kLlama,    // LlamaForCausalLM: Llama 2 / 3 / 3.1 (rope_scaling "llama3")
  kMistral,  // MistralForCausalLM
  kQwen2,    // Qwen2ForCausalLM: Qwen2 / 2.5, QKV bias
  kQwen3,    // Qwen3ForCausalLM: QK-norm, explicit head_dim
  kQwen3Moe, // Qwen3MoeForCausalLM: Qwen3 attention, softmax top-k experts
  kMixtral,  // MixtralForCausalLM: Mistral attention, top-k renormalised experts
  kGptOss,   // GptOssForCausalLM: biased attention with sinks, alternating sliding windows,
             // YaRN, biased top-k-then-softmax experts with the clamped SwiGLU
};

// The experts of a mixture-of-experts model (num_experts == 0: a dense model).
struct MoeConfig {
  int64_t num_experts = 0;          // E: num_experts / num_local_experts
  int64_t experts_per_token = 0;    // k: num_experts_per_tok
  int64_t intermediate_size = 0;    // each expert's I (Qwen3-MoE moe_intermediate_size)
  bool norm_topk_prob = true;       // renormalise the k weights to sum 1 (Mixtral always)
  double router_aux_loss_coef = 0;  // the load-balancing loss's weight in the loss
  bool output_router_logits = false;  // transformers adds the aux loss only when true
  int64_t decoder_sparse_step = 1;  // Qwen3-MoE: layer l is MoE when (l+1) % step == 0
  std::vector<int64_t> mlp_only_layers;  // Qwen3-MoE: dense layers among MoE ones
  // GPT-OSS: the router and every expert's projections carry biases, and the experts keep
  // transformers' input-major layout (gate_up_proj (E, C, 2I) with gate/up interleaved,
  // down_proj (E, I, C)); the activation is the clamped SwiGLU
  //   out = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = min(gate, limit).
  // Its router takes the top k logits, then a softmax over those k: the same weights as a
  // softmax over all E renormalised over the top k, which is how it is computed here.
  bool gpt_oss_experts = false;
  double swiglu_alpha = 1.702;
  double swiglu_limit = 7.0;      // swiglu_limit

  // The load-balancing loss's weight in the trained loss: `requested` when >= 0 (the job's
  // train.router_aux_loss_coef), else router_aux_loss_coef when output_router_logits is
  // true, else 0 (as transformers trains it).
  double TrainedAuxLossCoef(double requested = -1) const {
    if (requested >= 0) return requested;
    return output_router_logits ? router_aux_loss_coef : 0.0;
  }
};

struct RopeScaling {
  // kLinear: positions interpolated (inv_freq / factor). kDynamic: dynamic NTK, the base
  // raised for a sequence longer than max_position_embeddings (transformers'
  // _compute_dynamic_ntk_parameters at seq_len = dynamic_seq_len).
  enum class Type { kNone, kLlama3, kYarn, kLinear, kDynamic };
  Type type = Type::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0;   // llama3
  double high_freq_factor = 4.0;  // llama3
  int64_t original_max_position_embeddings = 8192;
  // YaRN (transformers' _compute_yarn_parameters): the ramp between beta_fast and beta_slow
  // rotations, truncated to whole dimensions when `truncate`; cos and sin are scaled by
  // attention_factor (given, or 0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio).
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  bool truncate = true;
  double attention_factor = 1.0;  // resolved when parsed; 1 for the other types
  // kDynamic: the sequence length the frequencies are for: the job's seq_len (set by
  // ResolveModelConfig). transformers recomputes them at each forward from the batch's
  // largest position, growing; 0 (or anything up to max_position_embeddings) leaves them
  // as they are below max_position_embeddings, as transformers' first forward does.
  int64_t dynamic_seq_len = 0;
};

struct ModelConfig {
  Architecture architecture = Architecture::kLlama;
  int64_t hidden_size = 0;         // C
  int64_t num_layers = 0;          // L, num_hidden_layers
  int64_t num_heads = 0;           // H, num_attention_heads
  int64_t num_kv_heads = 0;        // KV, num_key_value_heads (defaults to H)
  int64_t head_dim = 0;            // D (defaults to C / H)
  int64_t intermediate_size = 0;   // I
  int64_t vocab_size = 0;          // V
  int64_t max_position_embeddings = 0;
  int64_t sliding_window = 0;      // 0 = none; see AttentionWindow
  // True where the layer attends over sliding_window (GPT-OSS's and Qwen's layer_types
  // "sliding_attention", Qwen's layers >= max_window_layers, every Mistral layer); empty
  // when no layer does.
  std::vector<bool> sliding_layers;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;           // Qwen2 always; GPT-OSS attention_bias
  bool o_bias = false;             // GPT-OSS attention_bias (refused for the others)
  bool attention_sinks = false;    // GPT-OSS: a learned logit per head in the softmax
  bool qk_norm = false;            // Qwen3
  double initializer_range = 0.02;
  int64_t bos_token_id = -1;       // -1 = absent
  int64_t eos_token_id = -1;
  MoeConfig moe;

  bool is_moe() const { return moe.num_experts > 0; }
  // Whether decoder layer `layer` has experts (else a dense MLP of intermediate_size).
  bool IsMoeLayer(int64_t layer) const;
  int64_t NumMoeLayers() const;
  // The attention window of decoder layer `layer` in tokens (a key j is visible to query i
  // when i - j < window), 0 for full causal attention.
  int64_t AttentionWindow(int64_t layer) const;
};

// Parses config.json text. `source` names the file in error messages.
[[nodiscard]] absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text,
                                                           absl::string_view source);

// Reads and parses `path` (a config.json).
[[nodiscard]] absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

// A config.json that Hugging Face transformers loads as this architecture
// (architectures, model_type, torch_dtype "bfloat16", and every field above).
std::string ModelConfigToJson(const ModelConfig& config);

// "LlamaForCausalLM", ... and "llama", ...
const char* ArchitectureClassName(Architecture a);
const char* ArchitectureModelType(Architecture a);

// Parameter count of the whole model (embeddings counted once when tied).
int64_t NumParameters(const ModelConfig& config);
// Parameters one token's forward multiplies by: all but an untied embedding table (the
// lm_head of a tied model is the embedding) and, in an MoE layer, the router and the k
// experts a token is routed to (active parameters). The N of "6 N T" model FLOPs.
int64_t MatmulParameters(const ModelConfig& config);

}  // namespace megatrain
