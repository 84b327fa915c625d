// config.json parsing for the decoder-only architectures the engine trains.
//
// The reader is strict where a wrong guess would train a different model (architecture,
// activation, biases, rope scaling, head geometry) and lenient elsewhere: Hugging Face
// configs carry dozens of fields we do not use, and those are ignored. Defaults follow
// transformers' config classes, so a field left out means what it means to transformers.
#include "engine/model/config.h"

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"
#include "engine/common/durable_file.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

using Json = nlohmann::json;

constexpr Architecture kAllArchitectures[] = {Architecture::kLlama,    Architecture::kMistral,
                                              Architecture::kQwen2,    Architecture::kQwen3,
                                              Architecture::kQwen3Moe, Architecture::kMixtral,
                                              Architecture::kGptOss};

// A short rendering of a JSON value for error messages.
std::string Describe(const Json& v) {
  std::string text = v.dump();
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return absl::StrCat(text, " (", v.type_name(), ")");
}

// Typed access to the fields of one JSON object. Every error names the source file and
// the field, with `prefix` for nested objects ("rope_scaling.").
class FieldReader {
 public:
  FieldReader(const Json& object, absl::string_view source, absl::string_view prefix = "")
      : object_(object), source_(source), prefix_(prefix) {}

  // The field, or nullptr when it is missing or JSON null.
  const Json* Get(absl::string_view name) const {
    auto it = object_.find(std::string(name));
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  absl::Status Error(absl::string_view name, absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(source_, ": field '", prefix_, name, "' ", what));
  }

  // An integer >= `min_value` (1 unless said otherwise).
  absl::StatusOr<int64_t> Int(absl::string_view name, const int64_t* default_value,
                              int64_t min_value = 1) const {
    const char* kind = min_value == 1 ? "a positive integer" : "a non-negative integer";
    const Json* v = Get(name);
    if (v == nullptr) {
      if (default_value != nullptr) return *default_value;
      return Error(name, absl::StrCat("is missing; it must be ", kind));
    }
    const bool too_big = v->is_number_unsigned() &&
                         v->get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()};
    if (!v->is_number_integer() || too_big || v->get<int64_t>() < min_value) {
      return Error(name, absl::StrCat("must be ", kind, ", got ", Describe(*v)));
    }
    return v->get<int64_t>();
  }
  absl::StatusOr<int64_t> RequiredPositiveInt(absl::string_view name) const {
    return Int(name, nullptr);
  }
  absl::StatusOr<int64_t> OptionalPositiveInt(absl::string_view name, int64_t default_value) const {
    return Int(name, &default_value);
  }

  // A number > 0 (or >= 0 when `allow_zero`).
  absl::StatusOr<double> Number(absl::string_view name, const double* default_value,
                                bool allow_zero = false) const {
    const Json* v = Get(name);
    if (v == nullptr) {
      if (default_value != nullptr) return *default_value;
      return Error(name, "is missing; it must be a positive number");
    }
    if (!v->is_number() || v->get<double>() < 0 || (!allow_zero && v->get<double>() == 0)) {
      return Error(name, absl::StrCat("must be a ", allow_zero ? "non-negative" : "positive",
                                      " number, got ", Describe(*v)));
    }
    return v->get<double>();
  }
  absl::StatusOr<double> OptionalNumber(absl::string_view name, double default_value,
                                        bool allow_zero = false) const {
    return Number(name, &default_value, allow_zero);
  }
  absl::StatusOr<double> RequiredNumber(absl::string_view name) const {
    return Number(name, nullptr);
  }

  absl::StatusOr<bool> OptionalBool(absl::string_view name, bool default_value) const {
    const Json* v = Get(name);
    if (v == nullptr) return default_value;
    if (!v->is_boolean()) {
      return Error(name, absl::StrCat("must be true or false, got ", Describe(*v)));
    }
    return v->get<bool>();
  }

  absl::StatusOr<std::string> OptionalString(absl::string_view name,
                                             absl::string_view default_value) const {
    const Json* v = Get(name);
    if (v == nullptr) return std::string(default_value);
    if (!v->is_string()) {
      return Error(name, absl::StrCat("must be a string, got ", Describe(*v)));
    }
    return v->get<std::string>();
  }

  // bos/eos ids: an int, a list of ints (the first is taken) or null; -1 when absent.
  absl::StatusOr<int64_t> TokenId(absl::string_view name) const {
    const Json* v = Get(name);
    if (v != nullptr && v->is_array()) v = v->empty() ? nullptr : &(*v)[0];
    if (v == nullptr || v->is_null()) return int64_t{-1};
    if (!v->is_number_integer()) {
      return Error(name, absl::StrCat("must be an integer, a list of integers or null, got ",
                                      Describe(*v)));
    }
    if (v->is_number_unsigned() || v->get<int64_t>() >= 0) return v->get<int64_t>();
    return int64_t{-1};  // some configs use -1 for "none"
  }

 private:
  const Json& object_;
  std::string source_;
  std::string prefix_;
};

absl::StatusOr<Architecture> ParseArchitecture(const FieldReader& f, absl::string_view source) {
  std::string name;
  if (const Json* archs = f.Get("architectures")) {
    if (!archs->is_array() || archs->empty() || !(*archs)[0].is_string()) {
      return f.Error("architectures",
                     absl::StrCat("must be a non-empty list of class names, got ",
                                  Describe(*archs)));
    }
    name = (*archs)[0].get<std::string>();
  }
  ASSIGN_OR_RETURN(std::string model_type, f.OptionalString("model_type", ""));
  if (name.empty() && model_type.empty()) {
    return f.Error("architectures",
                   "and field 'model_type' are both missing; add \"architectures\": "
                   "[\"LlamaForCausalLM\"] (or the model's class)");
  }
  for (Architecture a : kAllArchitectures) {
    const bool match = name.empty() ? model_type == ArchitectureModelType(a)
                                    : name == ArchitectureClassName(a);
    if (!match) continue;
    if (!model_type.empty() && model_type != ArchitectureModelType(a)) {
      return f.Error("model_type",
                     absl::StrCat("is '", model_type, "' but architectures[0] is '", name,
                                  "' (model_type '", ArchitectureModelType(a),
                                  "'); make the two agree"));
    }
    return a;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      source, ": field '", name.empty() ? "model_type" : "architectures", "' names '",
      name.empty() ? model_type : name,
      "', which megatrain does not implement; supported: LlamaForCausalLM (llama), "
      "MistralForCausalLM (mistral), Qwen2ForCausalLM (qwen2), Qwen3ForCausalLM (qwen3), "
      "Qwen3MoeForCausalLM (qwen3_moe), MixtralForCausalLM (mixtral), GptOssForCausalLM "
      "(gpt_oss)"));
}

// YaRN, as transformers' _compute_yarn_parameters reads it (factor and
// original_max_position_embeddings required; beta_fast 32, beta_slow 1, truncate true).
absl::Status ParseYarn(const FieldReader& f, ModelConfig& c) {
  RopeScaling& r = c.rope_scaling;
  r.type = RopeScaling::Type::kYarn;
  ASSIGN_OR_RETURN(r.factor, f.RequiredNumber("factor"));
  ASSIGN_OR_RETURN(r.original_max_position_embeddings,
                   f.RequiredPositiveInt("original_max_position_embeddings"));
  // transformers takes `x or default`: a 0 means the default too.
  ASSIGN_OR_RETURN(r.beta_fast, f.OptionalNumber("beta_fast", 32.0, /*allow_zero=*/true));
  ASSIGN_OR_RETURN(r.beta_slow, f.OptionalNumber("beta_slow", 1.0, /*allow_zero=*/true));
  if (r.beta_fast == 0) r.beta_fast = 32.0;
  if (r.beta_slow == 0) r.beta_slow = 1.0;
  ASSIGN_OR_RETURN(r.truncate, f.OptionalBool("truncate", true));
  auto mscale = [](double scale, double m) {
    return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
  };
  if (f.Get("attention_factor") != nullptr) {
    ASSIGN_OR_RETURN(r.attention_factor, f.RequiredNumber("attention_factor"));
  } else {
    ASSIGN_OR_RETURN(double m, f.OptionalNumber("mscale", 0.0, /*allow_zero=*/true));
    ASSIGN_OR_RETURN(double m_all, f.OptionalNumber("mscale_all_dim", 0.0, /*allow_zero=*/true));
    r.attention_factor = m != 0 && m_all != 0 ? mscale(r.factor, m) / mscale(r.factor, m_all)
                                              : mscale(r.factor, 1.0);
  }
  return absl::OkStatus();
}

// rope_scaling (transformers 4.x) or rope_parameters (transformers 5.x). As in
// transformers 5, a non-null rope_scaling wins, and a rope_theta inside the object wins
// over the top-level one.
absl::Status ParseRope(const FieldReader& top, absl::string_view source, ModelConfig& c) {
  const char* key = top.Get("rope_scaling") != nullptr ? "rope_scaling" : "rope_parameters";
  const Json* rope = top.Get(key);
  ASSIGN_OR_RETURN(c.rope_theta, top.OptionalNumber("rope_theta", 10000.0));
  c.rope_scaling = RopeScaling{};
  if (rope == nullptr) return absl::OkStatus();
  if (!rope->is_object()) {
    return top.Error(key, absl::StrCat("must be an object or null, got ", Describe(*rope)));
  }
  FieldReader f(*rope, source, absl::StrCat(key, "."));
  ASSIGN_OR_RETURN(c.rope_theta, f.OptionalNumber("rope_theta", c.rope_theta));
  const char* type_key = f.Get("rope_type") != nullptr ? "rope_type" : "type";
  ASSIGN_OR_RETURN(std::string type, f.OptionalString(type_key, ""));
  if (type.empty()) {
    return f.Error("rope_type",
                   "is missing; megatrain supports \"linear\", \"dynamic\", \"llama3\", "
                   "\"yarn\" or no scaling");
  }
  if (type == "default") return absl::OkStatus();
  if (type == "yarn") return ParseYarn(f, c);
  if (type == "linear" || type == "dynamic") {
    RopeScaling& r = c.rope_scaling;
    r.type = type == "linear" ? RopeScaling::Type::kLinear : RopeScaling::Type::kDynamic;
    ASSIGN_OR_RETURN(r.factor, f.RequiredNumber("factor"));
    if (r.factor < 1) {  // as transformers validates them
      return f.Error("factor", absl::StrFormat("(%g) must be at least 1", r.factor));
    }
    return absl::OkStatus();
  }
  if (type != "llama3") {
    return f.Error(type_key, absl::StrCat("is \"", type,
                                          "\"; megatrain implements \"linear\", \"dynamic\", "
                                          "\"llama3\" and \"yarn\" rope scaling (or none: null "
                                          "/ \"default\")"));
  }
  RopeScaling& r = c.rope_scaling;
  r.type = RopeScaling::Type::kLlama3;
  ASSIGN_OR_RETURN(r.factor, f.RequiredNumber("factor"));
  ASSIGN_OR_RETURN(r.low_freq_factor, f.RequiredNumber("low_freq_factor"));
  ASSIGN_OR_RETURN(r.high_freq_factor, f.RequiredNumber("high_freq_factor"));
  ASSIGN_OR_RETURN(r.original_max_position_embeddings,
                   f.RequiredPositiveInt("original_max_position_embeddings"));
  if (r.high_freq_factor <= r.low_freq_factor) {
    return f.Error("high_freq_factor",
                   absl::StrFormat("(%g) must be greater than low_freq_factor (%g)",
                                   r.high_freq_factor, r.low_freq_factor));
  }
  return absl::OkStatus();
}

// `layer_types` ("sliding_attention" / "full_attention" per layer) into c.sliding_layers, if
// config.json has it: false when it does not.
absl::StatusOr<bool> ReadLayerTypes(const FieldReader& f, ModelConfig& c) {
  const Json* types = f.Get("layer_types");
  if (types == nullptr) return false;
  if (!types->is_array() || static_cast<int64_t>(types->size()) != c.num_layers) {
    return f.Error("layer_types", absl::StrCat("must be a list of num_hidden_layers (",
                                               c.num_layers, ") layer types, got ",
                                               Describe(*types)));
  }
  c.sliding_layers.assign(c.num_layers, false);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const Json& t = (*types)[l];
    const std::string name = t.is_string() ? t.get<std::string>() : "";
    if (name != "sliding_attention" && name != "full_attention") {
      return f.Error("layer_types",
                     absl::StrCat("[", l, "] is ", Describe(t),
                                  "; each must be \"sliding_attention\" or \"full_attention\""));
    }
    c.sliding_layers[l] = name == "sliding_attention";
  }
  return true;
}

// The window of the layers c.sliding_layers marks: `width()` (read only when some layer
// slides); none, and no layer marked, when none slides or the width is 0.
absl::StatusOr<int64_t> WindowOfSlidingLayers(
    ModelConfig& c, const std::function<absl::StatusOr<int64_t>()>& width) {
  int64_t w = 0;
  if (std::find(c.sliding_layers.begin(), c.sliding_layers.end(), true) !=
      c.sliding_layers.end()) {
    ASSIGN_OR_RETURN(w, width());
  }
  if (w == 0) c.sliding_layers.clear();
  return w;
}

// Which layers attend over a sliding window, and its width, as transformers 5.17 reads
// config.json:
// - GPT-OSS: sliding_window (default 128) on the layers layer_types marks
//   "sliding_attention" (default: the even ones).
// - Mistral: every layer; sliding_window defaults to 4096 when the field is absent, null
//   is none. Mixtral: the same, but no window by default.
// - Qwen2/3 (and Qwen3-MoE): only when use_sliding_window is true; the layers layer_types
//   marks, else those at or above max_window_layers (default 28).
// - Llama: none.
absl::StatusOr<int64_t> ParseSlidingWindow(const FieldReader& f, ModelConfig& c,
                                           const Json& root) {
  c.sliding_layers.clear();
  if (c.architecture == Architecture::kLlama) return int64_t{0};
  auto window = [&](int64_t fallback) -> absl::StatusOr<int64_t> {
    if (root.contains("sliding_window") && root["sliding_window"].is_null()) return int64_t{0};
    return f.OptionalPositiveInt("sliding_window", fallback);
  };
  if (c.architecture == Architecture::kGptOss) {
    ASSIGN_OR_RETURN(bool listed, ReadLayerTypes(f, c));
    if (!listed) {
      c.sliding_layers.assign(c.num_layers, false);
      for (int64_t l = 0; l < c.num_layers; ++l) c.sliding_layers[l] = l % 2 == 0;
    }
    return WindowOfSlidingLayers(c, [&] { return f.OptionalPositiveInt("sliding_window", 128); });
  }
  if (c.architecture == Architecture::kMistral || c.architecture == Architecture::kMixtral) {
    // MixtralConfig's default is no window.
    if (c.architecture == Architecture::kMixtral && f.Get("sliding_window") == nullptr) {
      return int64_t{0};
    }
    c.sliding_layers.assign(c.num_layers, true);
    return WindowOfSlidingLayers(c, [&] { return window(4096); });
  }
  ASSIGN_OR_RETURN(bool use, f.OptionalBool("use_sliding_window", false));
  if (!use) return int64_t{0};
  ASSIGN_OR_RETURN(bool listed, ReadLayerTypes(f, c));
  if (!listed) {
    const int64_t default_max_window_layers = 28;  // transformers' Qwen2Config / Qwen3Config
    ASSIGN_OR_RETURN(int64_t max_window_layers,
                     f.Int("max_window_layers", &default_max_window_layers, /*min_value=*/0));
    c.sliding_layers.assign(c.num_layers, false);
    for (int64_t l = max_window_layers; l < c.num_layers; ++l) c.sliding_layers[l] = true;
  }
  return WindowOfSlidingLayers(c, [&] { return window(4096); });
}

absl::Status ParseBiasesAndActivation(const FieldReader& f, ModelConfig& c) {
  ASSIGN_OR_RETURN(std::string act, f.OptionalString("hidden_act", "silu"));
  if (act != "silu") {
    return f.Error("hidden_act", absl::StrCat("is \"", act,
                                              "\"; megatrain implements only \"silu\" (SwiGLU)"));
  }
  ASSIGN_OR_RETURN(bool mlp_bias, f.OptionalBool("mlp_bias", false));
  if (mlp_bias) return f.Error("mlp_bias", "is true; MLP biases are not supported");
  ASSIGN_OR_RETURN(bool attention_bias,
                   f.OptionalBool("attention_bias", c.architecture == Architecture::kGptOss));
  switch (c.architecture) {
    case Architecture::kGptOss:  // attention_bias: q/k/v and o; sinks always
      c.qkv_bias = c.o_bias = attention_bias;
      c.attention_sinks = true;
      break;
    case Architecture::kQwen2:  // q/k/v always carry a bias; attention_bias is not read
      c.qkv_bias = true;
      break;
    case Architecture::kQwen3:
    case Architecture::kQwen3Moe:
    case Architecture::kLlama:
    case Architecture::kMistral:
    case Architecture::kMixtral:
      if (attention_bias) {
        return f.Error("attention_bias",
                       "is true; that adds a bias to o_proj as well as q/k/v, which megatrain "
                       "does not support");
      }
      c.qkv_bias = false;
      break;
  }
  c.qk_norm = c.architecture == Architecture::kQwen3 || c.architecture == Architecture::kQwen3Moe;
  return absl::OkStatus();
}

int64_t DefaultMaxPositions(Architecture a) {
  switch (a) {
    case Architecture::kLlama: return 2048;
    case Architecture::kMistral:
    case Architecture::kMixtral: return 4096 * 32;
    case Architecture::kQwen2:
    case Architecture::kQwen3:
    case Architecture::kQwen3Moe: return 32768;
    case Architecture::kGptOss: return 131072;
  }
  return 2048;
}

// The experts: Qwen3-MoE (num_experts or num_local_experts, moe_intermediate_size,
// norm_topk_prob, decoder_sparse_step, mlp_only_layers) and Mixtral (num_local_experts,
// every layer, always renormalised, intermediate_size per expert). Defaults are
// transformers' Qwen3MoeConfig / MixtralConfig.
absl::Status ParseExperts(const FieldReader& f, ModelConfig& c) {
  MoeConfig& m = c.moe;
  const bool qwen = c.architecture == Architecture::kQwen3Moe;
  const bool gpt_oss = c.architecture == Architecture::kGptOss;
  const char* experts_key = f.Get("num_experts") != nullptr ? "num_experts" : "num_local_experts";
  ASSIGN_OR_RETURN(m.num_experts,
                   f.OptionalPositiveInt(experts_key, qwen || gpt_oss ? 128 : 8));
  ASSIGN_OR_RETURN(m.experts_per_token,
                   f.OptionalPositiveInt("num_experts_per_tok", qwen ? 8 : gpt_oss ? 4 : 2));
  if (gpt_oss) {
    m.intermediate_size = c.intermediate_size;
    m.norm_topk_prob = true;  // top-k then softmax over the k: renormalised weights
    m.gpt_oss_experts = true;
    // transformers' GptOssExperts hard-codes limit 7.0 and alpha 1.702 (the released
    // configs say swiglu_limit 7.0); another value would train a model transformers
    // does not run.
    ASSIGN_OR_RETURN(m.swiglu_limit, f.OptionalNumber("swiglu_limit", 7.0));
    if (m.swiglu_limit != 7.0) {
      return f.Error("swiglu_limit",
                     absl::StrFormat("is %g; transformers' GPT-OSS experts clamp at 7.0",
                                     m.swiglu_limit));
    }
  } else if (qwen) {
    ASSIGN_OR_RETURN(m.intermediate_size, f.OptionalPositiveInt("moe_intermediate_size", 768));
    ASSIGN_OR_RETURN(m.norm_topk_prob, f.OptionalBool("norm_topk_prob", false));
    ASSIGN_OR_RETURN(m.decoder_sparse_step, f.OptionalPositiveInt("decoder_sparse_step", 1));
    if (const Json* dense = f.Get("mlp_only_layers")) {
      if (!dense->is_array()) {
        return f.Error("mlp_only_layers",
                       absl::StrCat("must be a list of layer indices, got ", Describe(*dense)));
      }
      for (const Json& l : *dense) {
        if (!l.is_number_integer() || l.get<int64_t>() < 0 || l.get<int64_t>() >= c.num_layers) {
          return f.Error("mlp_only_layers",
                         absl::StrCat("holds ", Describe(l), "; each must be a layer index in [0, ",
                                      c.num_layers, ")"));
        }
        m.mlp_only_layers.push_back(l.get<int64_t>());
      }
    }
  } else {
    m.intermediate_size = c.intermediate_size;
    m.norm_topk_prob = true;
    ASSIGN_OR_RETURN(double jitter,
                     f.OptionalNumber("router_jitter_noise", 0.0, /*allow_zero=*/true));
    if (jitter != 0) {
      return f.Error("router_jitter_noise",
                     absl::StrFormat("is %g; megatrain trains without router jitter (set 0)",
                                     jitter));
    }
  }
  if (m.num_experts > 256) {
    return f.Error(experts_key, absl::StrFormat("(%d) is larger than megatrain supports (256)",
                                                m.num_experts));
  }
  if (m.experts_per_token > m.num_experts || m.experts_per_token > 8) {
    return f.Error("num_experts_per_tok",
                   absl::StrFormat("(%d) must be at most %s (%d)", m.experts_per_token,
                                   m.experts_per_token > m.num_experts ? experts_key : "8",
                                   std::min<int64_t>(m.num_experts, 8)));
  }
  if (m.intermediate_size > (1 << 22)) {
    return f.Error("moe_intermediate_size", "is larger than megatrain supports (4194304)");
  }
  ASSIGN_OR_RETURN(m.router_aux_loss_coef,
                   f.OptionalNumber("router_aux_loss_coef", 0.001, /*allow_zero=*/true));
  ASSIGN_OR_RETURN(m.output_router_logits, f.OptionalBool("output_router_logits", false));
  if (c.NumMoeLayers() == 0) {
    return f.Error("mlp_only_layers", "leaves no layer with experts; use Qwen3ForCausalLM");
  }
  return absl::OkStatus();
}

// quantization_config: only GPT-OSS's MXFP4 experts, which the loader dequantizes to bf16
// as transformers does (Mxfp4Config(dequantize=True)); checkpoints are written in bf16.
absl::Status ParseQuantization(const FieldReader& f, const ModelConfig& c) {
  const Json* q = f.Get("quantization_config");
  if (q == nullptr) return absl::OkStatus();
  const Json* method = q->is_object() && q->contains("quant_method") ? &(*q)["quant_method"]
                                                                     : nullptr;
  if (method != nullptr && method->is_string() && method->get<std::string>() == "mxfp4" &&
      c.architecture == Architecture::kGptOss) {
    return absl::OkStatus();
  }
  return f.Error("quantization_config",
                 absl::StrCat("is ", Describe(*q),
                              "; megatrain trains full-precision weights and loads only "
                              "GPT-OSS's mxfp4 experts (dequantized); use the unquantized "
                              "checkpoint"));
}

absl::StatusOr<ModelConfig> ParseObject(const Json& root, absl::string_view source) {
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": expected a JSON object, got ", root.type_name()));
  }
  FieldReader f(root, source);
  ModelConfig c;
  ASSIGN_OR_RETURN(c.architecture, ParseArchitecture(f, source));
  ASSIGN_OR_RETURN(c.hidden_size, f.RequiredPositiveInt("hidden_size"));
  ASSIGN_OR_RETURN(c.num_layers, f.RequiredPositiveInt("num_hidden_layers"));
  ASSIGN_OR_RETURN(c.num_heads, f.RequiredPositiveInt("num_attention_heads"));
  ASSIGN_OR_RETURN(c.intermediate_size, f.RequiredPositiveInt("intermediate_size"));
  ASSIGN_OR_RETURN(c.vocab_size, f.RequiredPositiveInt("vocab_size"));
  ASSIGN_OR_RETURN(c.num_kv_heads, f.OptionalPositiveInt("num_key_value_heads", c.num_heads));
  if (f.Get("head_dim") == nullptr && c.hidden_size % c.num_heads != 0) {
    return f.Error("hidden_size",
                   absl::StrFormat("(%d) is not divisible by num_attention_heads (%d) and "
                                   "there is no head_dim; add \"head_dim\"",
                                   c.hidden_size, c.num_heads));
  }
  ASSIGN_OR_RETURN(c.head_dim, f.OptionalPositiveInt("head_dim", c.hidden_size / c.num_heads));
  if (c.num_heads % c.num_kv_heads != 0) {
    return f.Error("num_key_value_heads",
                   absl::StrFormat("(%d) must divide num_attention_heads (%d)", c.num_kv_heads,
                                   c.num_heads));
  }
  if (c.head_dim % 2 != 0) {
    return f.Error("head_dim", absl::StrFormat("(%d) must be even for rotary embeddings",
                                               c.head_dim));
  }
  // Bounds far above any model we train, low enough that every tensor's and the whole
  // model's element counts fit in int64 without overflow.
  const struct {
    const char* name;
    int64_t value, max;
  } limits[] = {{"hidden_size", c.hidden_size, 1 << 20},
                {"intermediate_size", c.intermediate_size, 1 << 22},
                {"vocab_size", c.vocab_size, 1 << 24},
                {"num_hidden_layers", c.num_layers, 1 << 12},
                {"num_attention_heads", c.num_heads, 1 << 12},
                {"head_dim", c.head_dim, 1 << 12}};
  for (const auto& l : limits) {
    if (l.value > l.max) {
      return f.Error(l.name, absl::StrFormat("(%d) is larger than megatrain supports (%d)",
                                             l.value, l.max));
    }
  }
  if (c.num_heads * c.head_dim > (1 << 20)) {
    return f.Error("head_dim", absl::StrFormat(
        "times num_attention_heads (%d x %d) is larger than megatrain supports (%d)",
        c.head_dim, c.num_heads, 1 << 20));
  }
  ASSIGN_OR_RETURN(c.max_position_embeddings,
                   f.OptionalPositiveInt("max_position_embeddings",
                                         DefaultMaxPositions(c.architecture)));
  ASSIGN_OR_RETURN(c.rms_norm_eps,
                   f.OptionalNumber("rms_norm_eps",
                                    c.architecture == Architecture::kGptOss ? 1e-5 : 1e-6));
  ASSIGN_OR_RETURN(c.initializer_range,
                   f.OptionalNumber("initializer_range", 0.02, /*allow_zero=*/true));
  ASSIGN_OR_RETURN(c.tie_word_embeddings, f.OptionalBool("tie_word_embeddings", false));
  RETURN_IF_ERROR(ParseBiasesAndActivation(f, c));
  RETURN_IF_ERROR(ParseRope(f, source, c));
  ASSIGN_OR_RETURN(c.sliding_window, ParseSlidingWindow(f, c, root));
  ASSIGN_OR_RETURN(c.bos_token_id, f.TokenId("bos_token_id"));
  ASSIGN_OR_RETURN(c.eos_token_id, f.TokenId("eos_token_id"));
  if (c.architecture == Architecture::kQwen3Moe || c.architecture == Architecture::kMixtral ||
      c.architecture == Architecture::kGptOss) {
    RETURN_IF_ERROR(ParseExperts(f, c));
  }
  RETURN_IF_ERROR(ParseQuantization(f, c));
  return c;
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text,
                                             absl::string_view source) {
  // nlohmann-json reports through exceptions; none may leave this function.
  try {
    Json root = Json::parse(json_text.begin(), json_text.end());
    return ParseObject(root, source);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not valid JSON (", Printable(e.what()), "); fix or re-download the file"));
  }
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path));
  return ParseModelConfig(text, path);
}

const char* ArchitectureClassName(Architecture a) {
  switch (a) {
    case Architecture::kLlama: return "LlamaForCausalLM";
    case Architecture::kMistral: return "MistralForCausalLM";
    case Architecture::kQwen2: return "Qwen2ForCausalLM";
    case Architecture::kQwen3: return "Qwen3ForCausalLM";
    case Architecture::kQwen3Moe: return "Qwen3MoeForCausalLM";
    case Architecture::kMixtral: return "MixtralForCausalLM";
    case Architecture::kGptOss: return "GptOssForCausalLM";
  }
  return "?";
}

const char* ArchitectureModelType(Architecture a) {
  switch (a) {
    case Architecture::kLlama: return "llama";
    case Architecture::kMistral: return "mistral";
    case Architecture::kQwen2: return "qwen2";
    case Architecture::kQwen3: return "qwen3";
    case Architecture::kQwen3Moe: return "qwen3_moe";
    case Architecture::kMixtral: return "mixtral";
    case Architecture::kGptOss: return "gpt_oss";
  }
  return "?";
}

bool ModelConfig::IsMoeLayer(int64_t layer) const {
  if (!is_moe() || (layer + 1) % moe.decoder_sparse_step != 0) return false;
  for (int64_t dense : moe.mlp_only_layers) {
    if (dense == layer) return false;
  }
  return true;
}

int64_t ModelConfig::AttentionWindow(int64_t layer) const {
  if (layer < 0 || layer >= static_cast<int64_t>(sliding_layers.size())) return 0;
  return sliding_layers[layer] ? sliding_window : 0;
}

int64_t ModelConfig::NumMoeLayers() const {
  int64_t count = 0;
  for (int64_t l = 0; l < num_layers; ++l) count += IsMoeLayer(l) ? 1 : 0;
  return count;
}

namespace {

// Parameters of one decoder layer; `active`: an MoE layer's router and k experts only.
int64_t LayerParameters(const ModelConfig& c, int64_t layer, bool active) {
  const int64_t C = c.hidden_size, H = c.num_heads, KV = c.num_kv_heads, D = c.head_dim;
  int64_t n = 2 * C;                               // input + post-attention RMSNorm
  n += C * H * D + 2 * C * KV * D;                 // q, k, v
  n += H * D * C;                                  // o
  if (c.qkv_bias) n += H * D + 2 * KV * D;
  if (c.o_bias) n += C;
  if (c.attention_sinks) n += H;
  if (c.qk_norm) n += 2 * D;                       // q_norm, k_norm
  if (!c.IsMoeLayer(layer)) return n + 3 * C * c.intermediate_size;  // gate, up, down
  const int64_t experts = active ? c.moe.experts_per_token : c.moe.num_experts;
  const int64_t I = c.moe.intermediate_size;
  const int64_t biases = c.moe.gpt_oss_experts ? 1 : 0;  // router (E), each expert 2I + C
  return n + c.moe.num_experts * (C + biases) + experts * (3 * C * I + biases * (2 * I + C));
}

int64_t ModelParameters(const ModelConfig& c, bool active) {
  int64_t total = c.vocab_size * c.hidden_size + c.hidden_size;
  for (int64_t l = 0; l < c.num_layers; ++l) total += LayerParameters(c, l, active);
  if (!c.tie_word_embeddings) total += c.vocab_size * c.hidden_size;
  return total;
}

}  // namespace

int64_t NumParameters(const ModelConfig& c) { return ModelParameters(c, /*active=*/false); }

int64_t MatmulParameters(const ModelConfig& c) {
  return ModelParameters(c, /*active=*/true) -
         (c.tie_word_embeddings ? 0 : c.vocab_size * c.hidden_size);
}

}  // namespace megatrain
