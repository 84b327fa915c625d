// DPO's objective (objective.h, layers/preference_loss.h): the head's per-token values are
// -log p(target) as cross-entropy's; a training pass is two sweeps over the micro-batch's
// chunks, the values first, then Coefficients() (Backend::PreferenceRowScale: each
// sequence's sum, its pair's loss terms, one coefficient per token on the device) and the
// cross-entropy gradient of each row times its coefficient. The micro-batch carries each
// token's sequence and each sequence's reference log-probability and weights
// (DeviceBatch::sequence, sequence_info); the step's scale is unused (the weights hold the
// step's mean).
#pragma once

#include "engine/common/backend.h"
#include "engine/layers/objective.h"

namespace megatrain {

class PreferenceObjective final : public Objective {
 public:
  PreferenceObjective(Backend* backend, const ObjectiveOptions& options)
      : backend_(backend), options_(options) {}

  ObjectiveKind kind() const override { return ObjectiveKind::kPreference; }
  void Chunk(const LogitsChunk& chunk, HeadPass pass) const override;
  bool SequenceLevel() const override { return true; }
  void Coefficients(void* row_scale, const void* values, const DeviceBatch& batch,
                    StreamId s) const override;

 private:
  Backend* backend_;
  ObjectiveOptions options_;
};

}  // namespace megatrain
