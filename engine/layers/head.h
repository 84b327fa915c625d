// The loss head: final RMSNorm, lm_head and the job's objective, fused and chunked over
// tokens so the (n, V) logits never exist at once; forward and backward in one pass.
//
//   hf = RMSNorm(x) * w_final                         (n, C)
//   for each chunk of rows r:  logits = hf_r Wlm^T     (rows, V)
//     values_r, dlogits = objective(logits)            (rows); dlogits in place of logits
//     dhf_r = dlogits Wlm;  dWlm += dlogits^T hf_r
//   dx = RMSNorm backward of dhf
//
// What the objective computes is its business (objective.h; next-token cross-entropy:
// loss_r = logsumexp(logits) - logits[target], dlogits = scale * (softmax - onehot)).
// An objective whose loss is over whole sequences (SequenceLevel(): DPO) gets two sweeps:
// every chunk's values first, then its Coefficients() (one per row), then the loop above
// with each row's dlogits scaled by its coefficient (the lm_head forward runs twice).
// Forward() is the same pass without the backward: values only. Tied embeddings: Wlm is
// the embedding table and its gradient accumulates into the embedding's gradient buffer.
#pragma once

#include <cstdint>
#include <memory>

#include "engine/common/backend.h"
#include "engine/layers/batch.h"
#include "engine/layers/objective.h"
#include "engine/model/config.h"
#include "engine/model/layout.h"

namespace megatrain {

struct HeadTensors {
  void* final_norm = nullptr;  // (C)
  void* lm_head = nullptr;     // (V, C): lm_head.weight, or the embedding when tied
};

// Owns its objective. Thread-compatible; every call enqueues on `s` and returns.
class LossHead {
 public:
  // chunk_tokens: rows of logits materialised at once. objective: what the head computes
  // from each chunk of logits (MakeObjective).
  LossHead(const ModelConfig& config, const ModelLayout& layout, Backend* backend,
           int64_t chunk_tokens, std::unique_ptr<const Objective> objective);

  HeadTensors BindWeights(void* head_slot, void* embedding_slot) const;
  // The head's and the embedding's gradient buffers (their state ranges) and the discard
  // scratch (GradViews, layer_kind.h): a frozen lm_head's view is null.
  HeadTensors BindGrads(void* head_grads, void* embedding_grads, void* discard) const;

  int64_t WorkspaceBytes(int64_t n) const;

  // The training pass: x act (n,C) -> loss stat (n), the objective's per token (0 where
  // ignored); dx act (n,C) written; weight gradients accumulate into g. `scale`: the
  // objective's (LogitsChunk::scale).
  void ForwardBackward(const HeadTensors& w, const HeadTensors& g, const void* x, void* dx,
                       void* loss, void* workspace, const DeviceBatch& batch, double scale,
                       StreamId s) const;
  // The forward-only pass: x act (n,C) -> values stat (n), the objective's per token,
  // equal bit for bit to ForwardBackward's loss; nothing else but the workspace written.
  void Forward(const HeadTensors& w, const void* x, void* values, void* workspace,
               const DeviceBatch& batch, StreamId s) const;

  const Objective& objective() const { return *objective_; }

 private:
  HeadTensors Bind(void* head, void* embedding, DType dtype) const;

  ModelConfig config_;
  int64_t final_norm_offset_;
  int64_t lm_head_offset_;  // in the head unit, or -1 when tied
  int64_t embedding_offset_;
  UnitLayout head_unit_, embedding_unit_;  // for their gradients' views
  Backend* backend_;
  int64_t chunk_tokens_;
  std::unique_ptr<const Objective> objective_;
};

}  // namespace megatrain
