#include "engine/model/lora.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
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

// Which of kLoraTargets `lora` adapts; errors name lora.target_modules[i].
absl::StatusOr<std::vector<bool>> ChosenTargets(const LoraConfig& lora, const ModelConfig& config) {
  std::vector<bool> chosen(kNumTargets, lora.target_modules.empty());
  for (size_t i = 0; i < lora.target_modules.size(); ++i) {
    const std::string& name = lora.target_modules[i];
    if (name == "all-linear") {
      chosen.assign(kNumTargets, true);
      continue;
    }
    const int t = TargetIndex(name);
    if (t < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "lora.target_modules[", i, "] '", name, "' is not a projection; choose from ",
          absl::StrJoin(kLoraTargets, ", "), " (or all-linear)"));
    }
    chosen[t] = true;
  }
  bool moe = false;
  for (int64_t l = 0; l < config.num_layers; ++l) moe = moe || config.IsMoeLayer(l);
  for (size_t i = 0; i < lora.target_modules.size() && moe; ++i) {
    const int t = TargetIndex(lora.target_modules[i]);
    if (t >= TargetIndex("gate_proj")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "lora.target_modules[", i, "] '", lora.target_modules[i], "': the experts of ",
          ArchitectureModelType(config.architecture),
          " layers take no adapters; adapt the attention (q_proj, k_proj, v_proj, o_proj)"));
    }
  }
  if (moe) std::fill(chosen.begin() + TargetIndex("gate_proj"), chosen.end(), false);
  return chosen;
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

absl::Status AddLoraAdapters(const LoraConfig& lora, const ModelConfig& config,
                             ModelLayout* layout) {
  MT_CHECK(lora.rank > 0);
  ASSIGN_OR_RETURN(const std::vector<bool> chosen, ChosenTargets(lora, config));
  for (UnitLayout& unit : layout->units) {
    for (TensorSlot& t : unit.tensors) t.trainable = false;  // the base
    if (unit.kind != UnitKind::kDecoder) continue;
    int64_t cursor = unit.num_elements;
    auto add = [&](TensorRole role, TensorRole base, std::string name,
                   std::vector<int64_t> shape) {
      TensorSlot t;
      t.role = role;
      t.base_role = base;
      t.name = std::move(name);
      t.shape = std::move(shape);
      t.num_elements = t.shape[0] * t.shape[1];
      t.offset = cursor;
      t.weight_decay = true;  // matrices decay (the HF Trainer's rule, as for any)
      cursor = (cursor + t.num_elements + kAlign - 1) / kAlign * kAlign;
      unit.tensors.push_back(std::move(t));
    };
    for (int target = 0; target < kNumTargets; ++target) {
      if (!chosen[target]) continue;
      const TensorSlot* found = unit.Find(LoraTargetRole(target));
      if (found == nullptr) continue;
      const TensorSlot base = *found;  // a copy: adding tensors moves the unit's
      const int64_t out = base.shape[0], in = base.shape[1];
      if (lora.rank > std::min(in, out)) {
        return absl::InvalidArgumentError(
            absl::StrCat("lora.rank ", lora.rank, " is larger than ", base.name,
                         "'s smaller side (", std::min(in, out), ")"));
      }
      const std::string module = base.name.substr(0, base.name.size() - strlen(".weight"));
      add(TensorRole::kLoraA, base.role, module + ".lora_A.weight", {lora.rank, in});
      add(TensorRole::kLoraB, base.role, module + ".lora_B.weight", {out, lora.rank});
    }
    unit.num_elements = cursor;
    unit.lora_rank = lora.rank;
    unit.lora_scale = lora.Scale();
  }
  return absl::OkStatus();
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
  nlohmann::json js = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", base_model},
      {"r", lora.rank},
      {"lora_alpha", lora.alpha},
      {"lora_dropout", 0.0},
      {"use_rslora", lora.rslora},
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
  if (targets.is_string()) {
    lora.target_modules.push_back(targets.get<std::string>());
  } else if (targets.is_array()) {
    for (const nlohmann::json& t : targets) {
      if (!t.is_string()) return bad("target_modules holds a non-string");
      lora.target_modules.push_back(t.get<std::string>());
    }
  } else {
    return bad("target_modules must be a list of module names");
  }
  const nlohmann::json init = js.value("init_lora_weights", nlohmann::json(true));
  if (init.is_string() && init.get<std::string>() == "gaussian") lora.init = LoraInit::kGaussian;
  return lora;
}

}  // namespace megatrain
