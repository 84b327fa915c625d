#include "engine/layers/objective.h"

#include "engine/layers/cross_entropy_objective.h"

namespace megatrain {

std::unique_ptr<Objective> MakeObjective(ObjectiveKind kind, Backend* backend) {
  switch (kind) {
    case ObjectiveKind::kNextTokenCrossEntropy:
      return std::make_unique<NextTokenCrossEntropy>(backend);
  }
  return nullptr;
}

}  // namespace megatrain
