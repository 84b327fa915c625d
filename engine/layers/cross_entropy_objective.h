// Next-token cross-entropy, the objective of SFT and continued pretraining (objective.h):
//
//   value_t  = logsumexp(logits_t) - logits_t[target_t]   = -log p(target_t)   (0: no target)
//   dlogits_t = scale * (softmax(logits_t) - onehot(target_t))                  (kTrain)
//
// One fused op (Backend::CrossEntropy) per chunk, dlogits in place of the logits; a
// kForwardOnly pass runs the same op without dlogits, so its values are the training
// pass's bit for bit. `scale` is 1 / (unmasked tokens in the whole step): micro-batches
// sum to the mean over the step, not a mean of means.
#pragma once

#include "engine/common/backend.h"
#include "engine/layers/objective.h"

namespace megatrain {

class NextTokenCrossEntropy final : public Objective {
 public:
  explicit NextTokenCrossEntropy(Backend* backend) : backend_(backend) {}

  ObjectiveKind kind() const override { return ObjectiveKind::kNextTokenCrossEntropy; }
  void Chunk(const LogitsChunk& chunk, HeadPass pass) const override;

 private:
  Backend* backend_;
};

}  // namespace megatrain
