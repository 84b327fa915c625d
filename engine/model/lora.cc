#include "engine/model/lora.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/common/check.h"
#include "engine/common/status.h"
#include "engine/model/freeze.h"

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
      const TensorSlot* base = unit.Find(LoraTargetRole(target));
      if (base == nullptr) continue;
      const int64_t out = base->shape[0], in = base->shape[1];
      if (lora.rank > std::min(in, out)) {
        return absl::InvalidArgumentError(
            absl::StrCat("lora.rank ", lora.rank, " is larger than ", base->name,
                         "'s smaller side (", std::min(in, out), ")"));
      }
      const std::string module = base->name.substr(0, base->name.size() - strlen(".weight"));
      add(TensorRole::kLoraA, base->role, module + ".lora_A.weight", {lora.rank, in});
      add(TensorRole::kLoraB, base->role, module + ".lora_B.weight", {out, lora.rank});
    }
    unit.num_elements = cursor;
    unit.lora_rank = lora.rank;
    unit.lora_scale = lora.Scale();
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelLayout> TrainingLayout(const ModelConfig& config, const LoraConfig& lora,
                                           const std::vector<std::string>& freeze) {
  ModelLayout layout = BuildLayout(config);
  if (lora.rank > 0) RETURN_IF_ERROR(AddLoraAdapters(lora, config, &layout));
  RETURN_IF_ERROR(FreezeTensors(freeze, &layout));
  return layout;
}

}  // namespace megatrain
