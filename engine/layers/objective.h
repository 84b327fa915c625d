// The objective seam: what the loss head does with its logits. The head (head.h) owns the
// final norm, the lm_head and the chunking over tokens, so the (n, V) logits never exist
// at once; an objective sees one chunk of rows at a time and turns it into a value per
// token and, in a training pass, into dL/dlogits written over the logits, which the head
// carries back through the lm_head and the norm. An objective is a kind beside the layer
// kinds (layer_kind.h): stateless code the head calls, chosen once per job.
//
// A pass through the head is one of two (HeadPass):
//   kTrain        per-token loss and dlogits; the head then runs the lm_head's and the
//                 norm's backward (dx, and the head's weight gradients)
//   kForwardOnly  the per-token values alone: no dlogits, no backward, nothing written but
//                 the values (evaluation; a reference model's log-probabilities)
//
// The objectives:
//   - next-token cross-entropy (cross_entropy_objective.h): SFT, continued pretraining.
//   - preference losses (DPO; preference_objective.h): per-sequence sums of log p(y_t)
//     over completion tokens. A kForwardOnly pass gives -log p(y_t) per token (the
//     reference model's, once, before training). In the policy's kTrain pass the head
//     sweeps a micro-batch's chunks twice (SequenceLevel()): the values first (both
//     completions of a pair are in one micro-batch), then Coefficients() turns the sums
//     into one coefficient per sequence on the device, and the second sweep recomputes each
//     chunk's logits and writes the dlogits, each row scaled by its coefficient: an
//     lm_head forward more, not a whole forward.
// Where the next fits: policy-gradient losses (GRPO), loss = sum_t c_t * -log p(y_t) with a
// coefficient per token: cross-entropy with the row_scale read from the micro-batch.
//
// Thread-compatible; Chunk() enqueues on chunk.stream and returns.
#pragma once

#include <cstdint>
#include <memory>

#include "engine/common/backend.h"
#include "engine/common/preference_math.h"
#include "engine/layers/batch.h"

namespace megatrain {

// The objectives the head can run. A job's is fixed for its life.
enum class ObjectiveKind {
  kNextTokenCrossEntropy,  // SFT, continued pretraining: mean -log p(target) over targets
  kPreference,             // DPO and its variants over pairs of completions
};

// An objective and its parameters.
struct ObjectiveOptions {
  ObjectiveKind kind = ObjectiveKind::kNextTokenCrossEntropy;
  // kPreference (layers/preference_loss.h): the pair loss, its beta and label smoothing.
  PreferenceLoss preference_loss = PreferenceLoss::kSigmoid;
  double beta = 0.1;
  double label_smoothing = 0;
};

enum class HeadPass {
  kTrain,        // values, and dlogits over the logits
  kForwardOnly,  // values only
};

// One chunk of rows of one micro-batch's logits.
struct LogitsChunk {
  void* logits = nullptr;  // act (rows, V): hf_r Wlm^T; kTrain: dlogits written over them
  void* values = nullptr;  // stat (rows): the objective's value per token, written
  const DeviceBatch* batch = nullptr;  // the micro-batch (targets (n), -100 = no loss)
  int64_t first_row = 0;   // the chunk's first row in the micro-batch
  int64_t rows = 0;
  int64_t vocab = 0;       // V
  // d(step loss) / d(a token's loss term): 1 / the step's targets for a mean over the
  // step (kTrain only).
  double scale = 0;
  // kTrain of a SequenceLevel() objective: the chunk's rows' coefficients stat (rows), what
  // Coefficients() wrote; else null.
  const void* row_scale = nullptr;
  StreamId stream = StreamId::kCompute;
};

class Objective {
 public:
  virtual ~Objective() = default;
  virtual ObjectiveKind kind() const = 0;
  // Writes chunk.values and, for kTrain, dlogits over chunk.logits.
  // REQUIRES: chunk.logits hold this chunk's logits (the head's lm_head forward).
  virtual void Chunk(const LogitsChunk& chunk, HeadPass pass) const = 0;
  // Whether a training pass needs the whole micro-batch's values before any dlogits (a loss
  // over sequences): the head then runs the chunks twice, Coefficients() between.
  virtual bool SequenceLevel() const { return false; }
  // Between the sweeps: row_scale stat (n) from values stat (n), the micro-batch's
  // per-token values of the first sweep. Enqueues on s.
  virtual void Coefficients(void* row_scale, const void* values, const DeviceBatch& batch,
                            StreamId s) const {
    (void)row_scale, (void)values, (void)batch, (void)s;
  }
};

// The objective `options` name, running its ops on `backend` (which outlives it).
std::unique_ptr<Objective> MakeObjective(const ObjectiveOptions& options, Backend* backend);
// The same with the kind's default parameters.
std::unique_ptr<Objective> MakeObjective(ObjectiveKind kind, Backend* backend);

}  // namespace megatrain
