// Runs the layer templates directly, one stream, every activation kept, no streaming:
// the reference the pipeline must reproduce, and (on the f64 CPU backend) the function
// the finite-difference checks differentiate. MoE models: the loss is the LM loss plus
// the weighted load-balancing loss, transformers' definition.
#pragma once

#include <cstring>
#include <utility>
#include <vector>

#include "engine/common/backend.h"
#include "engine/common/check.h"
#include "engine/layers/head.h"
#include "engine/layers/layer_kind.h"
#include "engine/model/layout.h"
#include "tests/engine/pipeline/tiny_model.h"

namespace megatrain::testing {

class DirectModel {
 public:
  DirectModel(const ModelConfig& c, Backend* be, int64_t max_tokens)
      : DirectModel(c, be, max_tokens, BuildLayout(c)) {}
  // Over `layout` (BuildLayout's, with adapters or frozen tensors), the head computing
  // `objective` (a preference one reads the micro-batch's sequences).
  DirectModel(const ModelConfig& c, Backend* be, int64_t max_tokens, ModelLayout layout,
              const ObjectiveOptions& objective = {})
      : config_(c),
        layout_(std::move(layout)),
        be_(be),
        kinds_(MakeLayerKinds(c, layout_, be)),
        head_(c, layout_, be, /*chunk_tokens=*/5, MakeObjective(objective, be)),
        max_tokens_(max_tokens) {
    for (const UnitLayout& u : layout_.units) {
      weights_.push_back(Alloc(u.num_elements * DTypeSize(be->weight_dtype())));
      grads_.push_back(Alloc(u.num_elements * DTypeSize(be->grad_dtype())));
    }
    const int64_t row = c.hidden_size * DTypeSize(be->act_dtype());
    for (int64_t l = 0; l <= c.num_layers; ++l) x_.push_back(Alloc(max_tokens * row));
    dres_ = Alloc(max_tokens * row);
    scratch_ = Alloc(max_tokens * row);
    ws_ = Alloc(kinds_.MaxWorkspaceBytes(max_tokens));
    discard_ = Alloc(GradDiscardElements(layout_) * DTypeSize(be->grad_dtype()));
    if (c.is_moe()) stats_ = Alloc(64 + c.moe.num_experts * DTypeSize(be->stat_dtype()));
    head_ws_ = Alloc(head_.WorkspaceBytes(max_tokens));
    loss_ = Alloc(max_tokens * DTypeSize(be->stat_dtype()));
    ints_ = Alloc(5 * max_tokens * sizeof(int32_t));
    const std::vector<float> inv_freq = RopeInvFreqs(c);  // the pipeline's (YaRN too)
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

  // The loss's central difference in element i of unit u, step h (the weight restored).
  double CentralDifference(const MicroBatch& b, int64_t u, int64_t i, double h) {
    const double w = Get(u, i);
    Set(u, i, w + h);
    const double up = Run(b, nullptr);
    Set(u, i, w - h);
    const double down = Run(b, nullptr);
    Set(u, i, w);
    return (up - down) / (2 * h);
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
    if (!b.sequence.empty()) {  // a CPU backend's "device" memory is the host's
      db.sequence = b.sequence.data();
      db.sequence_info = b.sequence_info.data();
      db.num_sequences = static_cast<int64_t>(b.sequence_info.size()) / kPrefFields;
    }
    const double scale = 1.0 / b.num_targets();
    const float* inv_freq = static_cast<const float*>(inv_freq_.get());
    for (DeviceBuffer& g : grads_) be_->Zero(g.get(), g.bytes(), s);

    const int64_t L = config_.num_layers, eu = 0, hu = layout_.HeadUnit();
    const void* table = weights_[eu].get();  // the embedding is the unit's first tensor
    be_->Embedding(x_[0].get(), db.tokens, table, n, config_.hidden_size, s);
    RouterStats stats;
    if (config_.is_moe()) {
      be_->Zero(stats_.get(), stats_.bytes(), s);
      stats.counts = static_cast<int32_t*>(stats_.get());
      stats.prob_sum = static_cast<char*>(stats_.get()) + 64;
    }
    auto call = [&](int64_t l, void* grads) {
      LayerCall c;
      c.weights = weights_[1 + l].get();
      c.grads = grads;
      c.grad_discard = discard_.get();
      c.workspace = ws_.get();
      c.batch = &db;
      c.rope_inv_freq = inv_freq;
      c.stream = s;
      c.router_stats = config_.is_moe() ? &stats : nullptr;
      return c;
    };
    for (int64_t l = 0; l < L; ++l) {
      LayerCall c = call(l, nullptr);
      c.first_forward = true;
      kinds_.ForLayer(l).Forward(c, x_[l].get(), x_[l + 1].get());
    }
    const double aux_coef = config_.moe.TrainedAuxLossCoef();
    double aux = 0;
    if (config_.is_moe()) {
      be_->SyncAll();
      const int64_t E = config_.moe.num_experts;
      const double T = static_cast<double>(config_.NumMoeLayers()) * n;
      for (int64_t e = 0; e < E; ++e) {
        aux += stats.counts[e] / T * Read(stats.prob_sum, e, be_->stat_dtype()) / T;
      }
      aux *= E;
      stats.aux_scale = aux_coef * E / (T * T);
    }
    head_.ForwardBackward(head_.BindWeights(weights_[hu].get(), weights_[eu].get()),
                          head_.BindGrads(StateGrad(hu), StateGrad(eu), discard_.get()),
                          x_[L].get(),
                          dres_.get(), loss_.get(), head_ws_.get(), db, scale, s);
    for (int64_t l = L - 1; l >= 0; --l) {
      const LayerCall c = call(l, StateGrad(1 + l));
      kinds_.ForLayer(l).Forward(c, x_[l].get(), scratch_.get());
      kinds_.ForLayer(l).Backward(c, x_[l].get(), dres_.get());
    }
    be_->EmbeddingBackward(grads_[eu].get(), dres_.get(), db.tokens, db.token_order, n,
                           config_.hidden_size, s);
    be_->SyncAll();

    double sum = 0;
    last_values_.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      last_values_[i] = Read(loss_.get(), i, be_->stat_dtype());
      sum += last_values_[i];
    }
    if (grads != nullptr) {
      grads->assign(layout_.units.size(), {});
      for (size_t u = 0; u < layout_.units.size(); ++u) {
        for (int64_t i = 0; i < layout_.units[u].num_elements; ++i) {
          (*grads)[u].push_back(Read(grads_[u].get(), i, be_->grad_dtype()));
        }
      }
    }
    last_aux_loss_ = aux;
    return sum * scale + aux_coef * aux;
  }
  // The load-balancing loss of the last Run (MoE models), unweighted.
  double last_aux_loss() const { return last_aux_loss_; }
  // The head's per-token values of the last Run (-log p(target); 0 where none).
  const std::vector<double>& last_token_values() const { return last_values_; }

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
  LayerKinds kinds_;
  LossHead head_;
  int64_t max_tokens_;
  // Unit u's gradient where the kinds write it: its state range's, in place in grads_[u]
  // (every unit's elements, zero outside the range).
  void* StateGrad(int64_t u) const {
    return Offset(grads_[u].get(), layout_.units[u].StateRange().first, be_->grad_dtype());
  }

  std::vector<DeviceBuffer> weights_, grads_, x_;
  DeviceBuffer discard_;
  DeviceBuffer dres_, scratch_, ws_, head_ws_, loss_, ints_, inv_freq_, stats_;
  double last_aux_loss_ = 0;
  std::vector<double> last_values_;
};

}  // namespace megatrain::testing
