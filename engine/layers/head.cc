#include "engine/layers/head.h"

#include <algorithm>
#include <utility>

#include "engine/layers/layer_kind.h"

namespace megatrain {

LossHead::LossHead(const ModelConfig& config, const ModelLayout& layout, Backend* backend,
                   int64_t chunk_tokens, std::unique_ptr<const Objective> objective)
    : config_(config),
      final_norm_offset_(layout.units[layout.HeadUnit()].OffsetOf(TensorRole::kFinalNorm)),
      lm_head_offset_(layout.units[layout.HeadUnit()].OffsetOf(TensorRole::kLmHead)),
      embedding_offset_(layout.units[ModelLayout::EmbeddingUnit()].OffsetOf(TensorRole::kEmbedding)),
      head_unit_(layout.units[layout.HeadUnit()]),
      embedding_unit_(layout.units[ModelLayout::EmbeddingUnit()]),
      backend_(backend),
      chunk_tokens_(chunk_tokens),
      objective_(std::move(objective)) {}

HeadTensors LossHead::Bind(void* head, void* embedding, DType dtype) const {
  HeadTensors t;
  t.final_norm = Offset(head, final_norm_offset_, dtype);
  t.lm_head = lm_head_offset_ >= 0 ? Offset(head, lm_head_offset_, dtype)
                                   : Offset(embedding, embedding_offset_, dtype);
  return t;
}

HeadTensors LossHead::BindWeights(void* head_slot, void* embedding_slot) const {
  return Bind(head_slot, embedding_slot, backend_->weight_dtype());
}

HeadTensors LossHead::BindGrads(void* head_grads, void* embedding_grads, void* discard) const {
  const GradViews head(head_unit_, head_grads, discard, backend_->grad_dtype());
  const GradViews embedding(embedding_unit_, embedding_grads, discard, backend_->grad_dtype());
  HeadTensors t;
  t.final_norm = head.Vector(final_norm_offset_);
  t.lm_head = lm_head_offset_ >= 0
                  ? UnlessFrozen(head_unit_, head.Matrix(lm_head_offset_), {TensorRole::kLmHead})
                  : UnlessFrozen(embedding_unit_, embedding.Matrix(embedding_offset_),
                                 {TensorRole::kEmbedding});
  return t;
}

int64_t LossHead::WorkspaceBytes(int64_t n) const {
  Carver c(nullptr);
  const int64_t act = DTypeSize(backend_->act_dtype());
  c.Take(n * config_.hidden_size * act);                              // hf
  c.Take(n * config_.hidden_size * act);                              // dhf
  c.Take(n * DTypeSize(backend_->stat_dtype()));                      // rstd
  c.Take(std::min(n, chunk_tokens_) * config_.vocab_size * act);      // logits chunk
  if (objective_->SequenceLevel()) c.Take(n * DTypeSize(backend_->stat_dtype()));  // row_scale
  return c.used();
}

void LossHead::ForwardBackward(const HeadTensors& w, const HeadTensors& g, const void* x,
                               void* dx, void* loss, void* workspace, const DeviceBatch& b,
                               double scale, StreamId s) const {
  Backend& be = *backend_;
  const int64_t n = b.num_tokens, C = config_.hidden_size, V = config_.vocab_size;
  const DType act = be.act_dtype();
  Carver c(workspace);
  void* hf = c.Take(n * C * DTypeSize(act));
  void* dhf = c.Take(n * C * DTypeSize(act));
  void* rstd = c.Take(n * DTypeSize(be.stat_dtype()));
  void* logits = c.Take(std::min(n, chunk_tokens_) * V * DTypeSize(act));
  const bool two_sweeps = objective_->SequenceLevel();
  void* row_scale = two_sweeps ? c.Take(n * DTypeSize(be.stat_dtype())) : nullptr;

  be.RmsNorm(hf, rstd, x, w.final_norm, n, C, config_.rms_norm_eps, s);  // hf = norm(x)
  if (two_sweeps) {  // the values first, then each row's coefficient from them
    for (int64_t r = 0; r < n; r += chunk_tokens_) {
      const int64_t rows = std::min(chunk_tokens_, n - r);
      be.Linear(logits, Offset(hf, r * C, act), w.lm_head, nullptr, rows, C, V, false, s);
      objective_->Chunk(LogitsChunk{logits, Offset(loss, r, be.stat_dtype()), &b, r, rows, V,
                                    scale, nullptr, s},
                        HeadPass::kForwardOnly);
    }
    objective_->Coefficients(row_scale, loss, b, s);
  }
  for (int64_t r = 0; r < n; r += chunk_tokens_) {
    const int64_t rows = std::min(chunk_tokens_, n - r);
    const void* hf_r = Offset(hf, r * C, act);
    be.Linear(logits, hf_r, w.lm_head, nullptr, rows, C, V, false, s);  // logits = hf Wlm^T
    objective_->Chunk(LogitsChunk{logits, Offset(loss, r, be.stat_dtype()), &b, r, rows, V,
                                  scale, two_sweeps ? Offset(row_scale, r, be.stat_dtype())
                                                    : nullptr,
                                  s},
                      HeadPass::kTrain);                                // loss, dlogits in place
    be.LinearBackward(Offset(dhf, r * C, act), false, g.lm_head, nullptr, logits, hf_r,
                      w.lm_head, rows, C, V, s);                        // dhf, dWlm
  }
  be.Zero(dx, n * C * DTypeSize(act), s);
  be.RmsNormBackward(dx, g.final_norm, dhf, x, w.final_norm, rstd, n, C, s);
}

void LossHead::Forward(const HeadTensors& w, const void* x, void* values, void* workspace,
                       const DeviceBatch& b, StreamId s) const {
  Backend& be = *backend_;
  const int64_t n = b.num_tokens, C = config_.hidden_size, V = config_.vocab_size;
  const DType act = be.act_dtype();
  Carver c(workspace);  // ForwardBackward's carving, dhf left unused
  void* hf = c.Take(n * C * DTypeSize(act));
  c.Take(n * C * DTypeSize(act));
  void* rstd = c.Take(n * DTypeSize(be.stat_dtype()));
  void* logits = c.Take(std::min(n, chunk_tokens_) * V * DTypeSize(act));

  be.RmsNorm(hf, rstd, x, w.final_norm, n, C, config_.rms_norm_eps, s);  // hf = norm(x)
  for (int64_t r = 0; r < n; r += chunk_tokens_) {
    const int64_t rows = std::min(chunk_tokens_, n - r);
    be.Linear(logits, Offset(hf, r * C, act), w.lm_head, nullptr, rows, C, V, false,
              s);                                                       // logits = hf Wlm^T
    objective_->Chunk(LogitsChunk{logits, Offset(values, r, be.stat_dtype()), &b, r, rows, V,
                                  0.0, nullptr, s},
                      HeadPass::kForwardOnly);                          // values
  }
}

}  // namespace megatrain
