// The loss head: final RMSNorm, lm_head and cross-entropy, fused and chunked over tokens
// so the (n, V) logits never exist at once; forward and backward in one pass.
//
//   hf = RMSNorm(x) * w_final                         (n, C)
//   for each chunk of rows r:  logits = hf_r Wlm^T     (rows, V)
//     loss_r = logsumexp(logits) - logits[target]      (rows)
//     dlogits = scale * (softmax - onehot)             (in place of logits)
//     dhf_r = dlogits Wlm;  dWlm += dlogits^T hf_r
//   dx = RMSNorm backward of dhf
//
// `scale` is 1 / (unmasked tokens in the whole step), so micro-batches sum to the mean
// over the step, not a mean of means. Tied embeddings: Wlm is the embedding table and
// its gradient accumulates into the embedding's gradient buffer.
#pragma once

#include <cstdint>

#include "engine/common/backend.h"
#include "engine/layers/batch.h"
#include "engine/model/config.h"
#include "engine/model/layout.h"

namespace megatrain {

struct HeadTensors {
  void* final_norm = nullptr;  // (C)
  void* lm_head = nullptr;     // (V, C): lm_head.weight, or the embedding when tied
};

class LossHead {
 public:
  // chunk_tokens: rows of logits materialised at once.
  LossHead(const ModelConfig& config, const ModelLayout& layout, Backend* backend,
           int64_t chunk_tokens);

  HeadTensors BindWeights(void* head_slot, void* embedding_slot) const;
  HeadTensors BindGrads(void* head_grads, void* embedding_grads) const;

  int64_t WorkspaceBytes(int64_t n) const;

  // x act (n,C) -> loss stat (n) per token (0 where ignored); dx act (n,C) written;
  // weight gradients accumulate into g.
  void ForwardBackward(const HeadTensors& w, const HeadTensors& g, const void* x, void* dx,
                       void* loss, void* workspace, const DeviceBatch& batch, double scale,
                       StreamId s) const;

 private:
  HeadTensors Bind(void* head, void* embedding, DType dtype) const;

  ModelConfig config_;
  int64_t final_norm_offset_;
  int64_t lm_head_offset_;  // in the head unit, or -1 when tied
  int64_t embedding_offset_;
  Backend* backend_;
  int64_t chunk_tokens_;
};

}  // namespace megatrain
