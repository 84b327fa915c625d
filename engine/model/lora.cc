#include "engine/model/lora.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "engine/common/check.h"
#include "engine/common/status.h"
#include "engine/common/durable_file.h"
#include "engine/model/freeze.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

constexpr int kNumTargets = sizeof(kLoraTargets) / sizeof(kLoraTargets[0]);
constexpr int64_t kAlign = 64;  // as BuildLayout aligns groups

int TargetIndex(const std::string& name) {
  for (int i = 0; i < kNumTargets; ++i) {
    if (name == kLoraTargets[i]) return i;
  }
  return -1;
}

constexpr int kNumExpertTargets = 2;

struct Chosen {
  std::vector<bool> dense;                 // by kLoraTargets
  bool experts[kNumExpertTargets] = {};    // by kLoraExpertTargets
};

int ExpertTargetIndex(const std::string& name) {
  for (int i = 0; i < kNumExpertTargets; ++i) {
    if (name == kLoraExpertTargets[i]) return i;
  }
  return -1;
}

// Which projections `lora` adapts; errors name lora.target_modules[i].
absl::StatusOr<Chosen> ChosenTargets(const LoraConfig& lora, const ModelConfig& config) {
  Chosen chosen;
  chosen.dense.assign(kNumTargets, lora.target_modules.empty());
  bool moe = false, dense_mlp = false;
  for (int64_t l = 0; l < config.num_layers; ++l) {
    moe = moe || config.IsMoeLayer(l);
    dense_mlp = dense_mlp || !config.IsMoeLayer(l);
  }
  const char* model_type = ArchitectureModelType(config.architecture);
  for (size_t i = 0; i < lora.target_modules.size(); ++i) {
    const std::string& name = lora.target_modules[i];
    const std::string field = absl::StrCat("lora.target_modules[", i, "] '", name, "'");
    if (name == "all-linear") {
      chosen.dense.assign(kNumTargets, true);
      continue;
    }
    if (const int e = ExpertTargetIndex(name); e >= 0) {
      if (!moe) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ": ", model_type, " has no experts"));
      }
      chosen.experts[e] = true;
      continue;
    }
    const int t = TargetIndex(name);
    if (t < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " is not a projection; choose from ", absl::StrJoin(kLoraTargets, ", "), ", ",
          absl::StrJoin(kLoraExpertTargets, ", "), " (or all-linear)"));
    }
    if (t >= TargetIndex("gate_proj") && !dense_mlp) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": the MLPs of ", model_type,
          " are experts; adapt them as experts.gate_up_proj and experts.down_proj"));
    }
    chosen.dense[t] = true;
  }
  return chosen;
}

// The name PEFT gives an experts' adapter: ParamWrapper wraps the experts module once per
// adapted parameter, in the order they are registered (gate_up_proj first), each wrapper
// around the one before; so gate_up_proj's sits one base_layer down when down_proj is
// adapted too.
std::string ExpertAdapterName(int64_t layer, int target, bool both, const char* which) {
  return absl::StrCat("model.layers.", layer, ".mlp.experts",
                      target == 0 && both ? ".base_layer" : "", ".", which, ".weight");
}

}  // namespace

double LoraConfig::Scale() const {
  return rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

TensorRole LoraTargetRole(int target) {
  static constexpr TensorRole kRoles[] = {TensorRole::kQ,     TensorRole::kK,  TensorRole::kV,
                                          TensorRole::kOProj, TensorRole::kGate, TensorRole::kUp,
                                          TensorRole::kDown};
  MT_CHECK(target >= 0 && target < kNumTargets);
  return kRoles[target];
}

bool ParseLoraInit(const std::string& name, LoraInit* out) {
  if (name == "default" || name == "true") {
    *out = LoraInit::kDefault;
    return true;
  }
  if (name == "gaussian") {
    *out = LoraInit::kGaussian;
    return true;
  }
  return false;
}

const char* LoraInitName(LoraInit init) {
  return init == LoraInit::kGaussian ? "gaussian" : "default";
}

TensorRole LoraExpertRole(const UnitLayout& unit, int target) {
  MT_CHECK(target >= 0 && target < kNumExpertTargets);
  const bool in_major = unit.Find(TensorRole::kExpertGateUpT) != nullptr;
  if (!in_major && unit.Find(TensorRole::kExpertGate) == nullptr) return TensorRole::kEmbedding;
  if (target == 0) return in_major ? TensorRole::kExpertGateUpT : TensorRole::kExpertGate;
  return in_major ? TensorRole::kExpertDownT : TensorRole::kExpertDown;
}

namespace {

// Appends adapters to a decoder unit, each on an aligned offset.
class AdapterAppender {
 public:
  explicit AdapterAppender(UnitLayout* unit) : unit_(unit), cursor_(unit->num_elements) {}
  void Add(TensorRole role, TensorRole base, std::string name, std::vector<int64_t> shape) {
    // Matrices decay (the HF Trainer's rule, as for any).
    TensorSlot t = MakeSlot(role, std::move(name), std::move(shape), cursor_, true);
    t.base_role = base;
    cursor_ = (cursor_ + t.num_elements + kAlign - 1) / kAlign * kAlign;
    unit_->tensors.push_back(std::move(t));
  }
  void Finish() { unit_->num_elements = cursor_; }

 private:
  UnitLayout* unit_;
  int64_t cursor_;
};

absl::Status CheckRank(const LoraConfig& lora, const std::string& name, int64_t in,
                       int64_t out) {
  if (lora.rank <= std::min(in, out)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("lora.rank ", lora.rank, " is larger than ",
                                                 name, "'s smaller side (", std::min(in, out),
                                                 ")"));
}

// The experts' adapters of an MoE unit: A (E, r, in), B (E, out, r) per chosen target.
absl::Status AddExpertAdapters(const LoraConfig& lora, const ModelConfig& config,
                               const Chosen& chosen, UnitLayout* unit, AdapterAppender* add) {
  const int64_t E = config.moe.num_experts, C = config.hidden_size;
  const int64_t I = config.moe.intermediate_size;
  const bool both = chosen.experts[0] && chosen.experts[1];
  for (int target = 0; target < kNumExpertTargets; ++target) {
    const TensorRole base = LoraExpertRole(*unit, target);
    if (!chosen.experts[target] || base == TensorRole::kEmbedding) continue;
    const int64_t in = target == 0 ? C : I, out = target == 0 ? 2 * I : C;
    RETURN_IF_ERROR(CheckRank(lora, absl::StrCat("layer ", unit->layer, "'s ",
                                                 kLoraExpertTargets[target]),
                              in, out));
    add->Add(TensorRole::kLoraA, base, ExpertAdapterName(unit->layer, target, both, "lora_A"),
             {E, lora.rank, in});
    add->Add(TensorRole::kLoraB, base, ExpertAdapterName(unit->layer, target, both, "lora_B"),
             {E, out, lora.rank});
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AddLoraAdapters(const LoraConfig& lora, const ModelConfig& config,
                             ModelLayout* layout) {
  MT_CHECK(lora.rank > 0);
  ASSIGN_OR_RETURN(const Chosen chosen, ChosenTargets(lora, config));
  for (UnitLayout& unit : layout->units) {
    for (TensorSlot& t : unit.tensors) t.trainable = false;  // the base
    if (unit.kind != UnitKind::kDecoder) continue;
    AdapterAppender add(&unit);
    for (int target = 0; target < kNumTargets; ++target) {
      if (!chosen.dense[target]) continue;
      const TensorSlot* found = unit.Find(LoraTargetRole(target));
      if (found == nullptr) continue;
      const TensorSlot base = *found;  // a copy: adding tensors moves the unit's
      const int64_t out = base.shape[0], in = base.shape[1];
      RETURN_IF_ERROR(CheckRank(lora, base.name, in, out));
      const std::string module = base.name.substr(0, base.name.size() - strlen(".weight"));
      add.Add(TensorRole::kLoraA, base.role, module + ".lora_A.weight", {lora.rank, in});
      add.Add(TensorRole::kLoraB, base.role, module + ".lora_B.weight", {out, lora.rank});
    }
    RETURN_IF_ERROR(AddExpertAdapters(lora, config, chosen, &unit, &add));
    add.Finish();
    unit.lora_rank = lora.rank;
    unit.lora_scale = lora.Scale();
  }
  return absl::OkStatus();
}

int64_t LoraRank(const TensorSlot& t) {
  MT_CHECK(IsLora(t));
  return t.role == TensorRole::kLoraA ? t.shape[t.shape.size() - 2] : t.shape.back();
}

std::vector<int64_t> PeftShape(const TensorSlot& t) {
  const int64_t E = LoraExperts(t);
  if (E == 0) return t.shape;
  if (t.role == TensorRole::kLoraA) return {E * t.shape[1], t.shape[2]};
  return {t.shape[1], t.shape[2] * E};
}

int64_t LoraLayoutIndex(const TensorSlot& t, int64_t f) {
  const int64_t E = LoraExperts(t);
  if (E == 0 || t.role == TensorRole::kLoraA) return f;  // the same order
  const int64_t out = t.shape[1], r = t.shape[2];
  const int64_t o = f / (r * E), j = f / E % r, e = f % E;  // file (out, r, E)
  return (e * out + o) * r + j;                              // layout (E, out, r)
}

std::vector<float> LoraToPeftOrder(const TensorSlot& t, const float* values) {
  std::vector<float> file(t.num_elements);
  for (int64_t f = 0; f < t.num_elements; ++f) file[f] = values[LoraLayoutIndex(t, f)];
  return file;
}

void LoraFromPeftOrder(const TensorSlot& t, const float* file, float* values) {
  for (int64_t f = 0; f < t.num_elements; ++f) values[LoraLayoutIndex(t, f)] = file[f];
}

bool HasLora(const ModelLayout& layout) {
  for (const UnitLayout& unit : layout.units) {
    if (unit.lora_rank > 0) return true;
  }
  return false;
}

absl::StatusOr<ModelLayout> TrainingLayout(const ModelConfig& config, const LoraConfig& lora,
                                           const std::vector<std::string>& freeze) {
  ModelLayout layout = BuildLayout(config);
  if (lora.rank > 0) RETURN_IF_ERROR(AddLoraAdapters(lora, config, &layout));
  RETURN_IF_ERROR(FreezeTensors(freeze, &layout));
  for (const UnitLayout& unit : layout.units) {  // the adapters are what a LoRA job trains
    for (const TensorSlot& t : unit.tensors) {
      if (!IsLora(t) || t.trainable) continue;
      for (size_t i = 0; i < freeze.size(); ++i) {
        if (!FreezePatternMatches(freeze[i], t)) continue;
        return absl::InvalidArgumentError(absl::StrCat(
            "train.freeze[", i, "] '", freeze[i], "' freezes the LoRA adapter ", t.name,
            "; with lora the base is frozen already: leave the adapters out, or name the layers "
            "to adapt in lora.target_modules"));
      }
    }
  }
  return layout;
}

absl::Status CheckAdapterHoldsOnlyLayouts(const ModelLayout& layout,
                                         const ModelTensorReader& adapter,
                                         const std::string& what, const std::string& folder) {
  std::set<std::string> adapted;
  for (const UnitLayout& unit : layout.units) {
    for (const TensorSlot& t : unit.tensors) {
      if (IsLora(t)) adapted.insert(kPeftPrefix + t.name);
    }
  }
  for (const std::string& name : adapter.names()) {
    if (adapted.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " ", folder, " holds ", name,
          ", which is not an adapter of this model and lora.target_modules"));
    }
  }
  return absl::OkStatus();
}

std::string PeftAdapterConfigJson(const ModelLayout& layout, const LoraConfig& lora,
                                  const std::string& base_model) {
  std::vector<std::string> targets;
  for (int target = 0; target < kNumTargets; ++target) {
    for (const UnitLayout& unit : layout.units) {
      if (unit.FindLora(LoraTargetRole(target), TensorRole::kLoraA) == nullptr) continue;
      targets.push_back(kLoraTargets[target]);
      break;
    }
  }
  std::vector<std::string> parameters;  // the experts', as PEFT's target_parameters
  for (int target = 0; target < kNumExpertTargets; ++target) {
    for (const UnitLayout& unit : layout.units) {
      if (unit.FindLora(LoraExpertRole(unit, target), TensorRole::kLoraA) == nullptr) continue;
      parameters.push_back(std::string("mlp.") + kLoraExpertTargets[target]);
      break;
    }
  }
  nlohmann::json js = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", base_model},
      {"r", lora.rank},
      {"lora_alpha", lora.alpha},
      {"lora_dropout", 0.0},
      {"use_rslora", lora.rslora},
      // An empty list, not null, with experts alone: null asks PEFT for its defaults.
      {"target_modules", targets},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", lora.init == LoraInit::kGaussian ? nlohmann::json("gaussian")
                                                             : nlohmann::json(true)},
      {"modules_to_save", nullptr},
      {"layers_to_transform", nullptr},
      {"layers_pattern", nullptr},
      {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()},
      {"use_dora", false},
  };
  if (!parameters.empty()) js["target_parameters"] = parameters;
  return js.dump(2) + "\n";
}

absl::StatusOr<LoraConfig> ReadPeftAdapterConfig(const std::string& folder) {
  const std::string path = folder + "/adapter_config.json";
  ASSIGN_OR_RETURN(const std::string text, ReadWholeFile(path));
  const nlohmann::json js = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
  };
  if (js.is_discarded() || !js.is_object()) return bad("not a JSON object");
  if (js.value("peft_type", std::string()) != "LORA") return bad("peft_type is not LORA");
  LoraConfig lora;
  if (!js.contains("r") || !js["r"].is_number_integer() || js["r"].get<int64_t>() <= 0) {
    return bad("r must be a positive integer");
  }
  lora.rank = js["r"].get<int64_t>();
  const nlohmann::json alpha = js.value("lora_alpha", nlohmann::json(8));
  if (!alpha.is_number() || alpha.get<double>() <= 0) return bad("lora_alpha must be positive");
  lora.alpha = alpha.get<double>();
  const nlohmann::json rs = js.value("use_rslora", nlohmann::json(false));
  if (!rs.is_boolean()) return bad("use_rslora must be true or false");
  lora.rslora = rs.get<bool>();
  const nlohmann::json targets = js.value("target_modules", nlohmann::json());
  const nlohmann::json parameters = js.value("target_parameters", nlohmann::json());
  if (targets.is_string()) {
    lora.target_modules.push_back(targets.get<std::string>());
  } else if (targets.is_array()) {
    for (const nlohmann::json& t : targets) {
      if (!t.is_string()) return bad("target_modules holds a non-string");
      lora.target_modules.push_back(t.get<std::string>());
    }
  } else if (!targets.is_null() || !parameters.is_array()) {
    return bad("target_modules must be a list of module names");
  }
  if (!parameters.is_null() && !parameters.is_array()) {
    return bad("target_parameters must be a list of parameter names");
  }
  for (size_t i = 0; i < parameters.size(); ++i) {  // "mlp.experts.down_proj" and the like
    const std::string name = parameters[i].is_string() ? parameters[i].get<std::string>() : "";
    int found = -1;
    for (int t = 0; t < kNumExpertTargets; ++t) {
      const std::string want = kLoraExpertTargets[t];
      if (name == want || absl::EndsWith(name, "." + want)) found = t;
    }
    if (found < 0) {
      return bad(absl::StrCat("target_parameters[", i, "] '", name,
                              "' is not an experts' gate_up_proj or down_proj"));
    }
    lora.target_modules.push_back(kLoraExpertTargets[found]);
  }
  const nlohmann::json init = js.value("init_lora_weights", nlohmann::json(true));
  if (init.is_string() && init.get<std::string>() == "gaussian") lora.init = LoraInit::kGaussian;
  return lora;
}

}  // namespace megatrain
