#include "engine/layers/objective.h"

#include "engine/layers/cross_entropy_objective.h"
#include "engine/layers/preference_objective.h"

namespace megatrain {

std::unique_ptr<Objective> MakeObjective(const ObjectiveOptions& options, Backend* backend) {
  switch (options.kind) {
    case ObjectiveKind::kNextTokenCrossEntropy:
      return std::make_unique<NextTokenCrossEntropy>(backend);
    case ObjectiveKind::kPreference:
      return std::make_unique<PreferenceObjective>(backend, options);
  }
  return nullptr;
}

std::unique_ptr<Objective> MakeObjective(ObjectiveKind kind, Backend* backend) {
  ObjectiveOptions options;
  options.kind = kind;
  return MakeObjective(options, backend);
}

}  // namespace megatrain
