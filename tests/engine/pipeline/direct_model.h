// Runs the layer templates directly, one stream, every activation kept, no streaming:
// the reference the pipeline must reproduce, and (on the f64 CPU backend) the function
// the finite-difference checks differentiate.
#pragma once

#include <cstring>
#include <vector>

#include "engine/common/backend.h"
#include "engine/common/check.h"
#include "engine/kernels/reference/rope.h"
#include "engine/layers/decoder.h"
#include "engine/layers/head.h"
#include "engine/model/layout.h"
#include "tests/engine/pipeline/tiny_model.h"

namespace megatrain::testing {

class DirectModel {
 public:
  DirectModel(const ModelConfig& c, Backend* be, int64_t max_tokens)
      : config_(c),
        layout_(BuildLayout(c)),
        be_(be),
        decoder_(c, layout_.units[1], be),
        head_(c, layout_, be, /*chunk_tokens=*/5),
        max_tokens_(max_tokens) {
    for (const UnitLayout& u : layout_.units) {
      weights_.push_back(Alloc(u.num_elements * DTypeSize(be->weight_dtype())));
      grads_.push_back(Alloc(u.num_elements * DTypeSize(be->grad_dtype())));
    }
    const int64_t row = c.hidden_size * DTypeSize(be->act_dtype());
    for (int64_t l = 0; l <= c.num_layers; ++l) x_.push_back(Alloc(max_tokens * row));
    dres_ = Alloc(max_tokens * row);
    scratch_ = Alloc(max_tokens * row);
    ws_ = Alloc(decoder_.WorkspaceBytes(max_tokens));
    head_ws_ = Alloc(head_.WorkspaceBytes(max_tokens));
    loss_ = Alloc(max_tokens * DTypeSize(be->stat_dtype()));
    ints_ = Alloc(5 * max_tokens * sizeof(int32_t));
    std::vector<float> inv_freq(c.head_dim / 2);
    const RopeScaling& rs = c.rope_scaling;
    ref::RopeInvFreq(inv_freq.data(), c.head_dim, c.rope_theta,
                     rs.type == RopeScaling::Type::kLlama3, rs.factor, rs.low_freq_factor,
                     rs.high_freq_factor, rs.original_max_position_embeddings);
    inv_freq_ = Alloc(inv_freq.size() * sizeof(float));
    std::memcpy(inv_freq_.get(), inv_freq.data(), inv_freq.size() * sizeof(float));
  }

  const ModelLayout& layout() const { return layout_; }

  // Element i of unit u's weights, read and written as double (CPU backends only).
  double Get(int64_t u, int64_t i) const { return Read(weights_[u].get(), i, be_->weight_dtype()); }
  void Set(int64_t u, int64_t i, double v) {
    if (be_->weight_dtype() == DType::kF64) {
      static_cast<double*>(weights_[u].get())[i] = v;
    } else {
      static_cast<float*>(weights_[u].get())[i] = static_cast<float>(v);
    }
  }

  // Mean loss over the batch's targets; the gradients, per unit, when `grads` is set.
  double Run(const MicroBatch& b, std::vector<std::vector<double>>* grads) {
    const int64_t n = static_cast<int64_t>(b.tokens.size());
    MT_CHECK(n <= max_tokens_);
    const StreamId s = StreamId::kCompute;
    int32_t* ints = static_cast<int32_t*>(ints_.get());
    std::memcpy(ints, b.tokens.data(), n * 4);
    std::memcpy(ints + n, b.targets.data(), n * 4);
    std::memcpy(ints + 2 * n, b.doc_start.data(), n * 4);
    std::memcpy(ints + 3 * n, b.positions.data(), n * 4);
    TokenOrder(b.tokens.data(), n, ints + 4 * n);
    DeviceBatch db{n, ints, ints + n, ints + 2 * n, ints + 3 * n, ints + 4 * n};
    const double scale = 1.0 / b.num_targets();
    const float* inv_freq = static_cast<const float*>(inv_freq_.get());
    for (DeviceBuffer& g : grads_) be_->Zero(g.get(), g.bytes(), s);

    const int64_t L = config_.num_layers, eu = 0, hu = layout_.HeadUnit();
    const void* table = weights_[eu].get();  // the embedding is the unit's first tensor
    be_->Embedding(x_[0].get(), db.tokens, table, n, config_.hidden_size, s);
    for (int64_t l = 0; l < L; ++l) {
      decoder_.Forward(decoder_.BindWeights(weights_[1 + l].get()), x_[l].get(),
                       x_[l + 1].get(), decoder_.CarveWorkspace(ws_.get(), n), db, inv_freq, s);
    }
    head_.ForwardBackward(head_.BindWeights(weights_[hu].get(), weights_[eu].get()),
                          head_.BindGrads(grads_[hu].get(), grads_[eu].get()), x_[L].get(),
                          dres_.get(), loss_.get(), head_ws_.get(), db, scale, s);
    for (int64_t l = L - 1; l >= 0; --l) {
      DecoderSaved ws = decoder_.CarveWorkspace(ws_.get(), n);
      DecoderTensors w = decoder_.BindWeights(weights_[1 + l].get());
      decoder_.Forward(w, x_[l].get(), scratch_.get(), ws, db, inv_freq, s);
      decoder_.Backward(w, decoder_.BindGrads(grads_[1 + l].get()), x_[l].get(), dres_.get(),
                        ws, db, inv_freq, s);
    }
    be_->EmbeddingBackward(grads_[eu].get(), dres_.get(), db.tokens, db.token_order, n,
                           config_.hidden_size, s);
    be_->SyncAll();

    double sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += Read(loss_.get(), i, be_->stat_dtype());
    if (grads != nullptr) {
      grads->assign(layout_.units.size(), {});
      for (size_t u = 0; u < layout_.units.size(); ++u) {
        for (int64_t i = 0; i < layout_.units[u].num_elements; ++i) {
          (*grads)[u].push_back(Read(grads_[u].get(), i, be_->grad_dtype()));
        }
      }
    }
    return sum * scale;
  }

 private:
  static double Read(const void* p, int64_t i, DType t) {
    return t == DType::kF64 ? static_cast<const double*>(p)[i] : static_cast<const float*>(p)[i];
  }
  DeviceBuffer Alloc(int64_t bytes) {
    absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(be_, bytes);
    MT_CHECK(b.ok());
    return std::move(*b);
  }

  ModelConfig config_;
  ModelLayout layout_;
  Backend* be_;
  DecoderLayer decoder_;
  LossHead head_;
  int64_t max_tokens_;
  std::vector<DeviceBuffer> weights_, grads_, x_;
  DeviceBuffer dres_, scratch_, ws_, head_ws_, loss_, ints_, inv_freq_;
};

}  // namespace megatrain::testing
