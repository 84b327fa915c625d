// The logits of a micro-batch through the layer templates with every unit resident on
// the backend: the forward of a trained model, without the streaming pipeline. Used to
// compare with transformers' logits and to check that packing changes nothing.
#pragma once

#include <vector>

#include "engine/layers/layer_kind.h"
#include "engine/store/host_store.h"
#include "engine/data/packer.h"
#include "tests/gpu/gpu_util.h"

namespace megatrain::testing {

// Logits (n, V) of `b` with the store's bf16 weights, every unit resident.
inline std::vector<float> Logits(const ModelConfig& c, const HostStore& store, Backend* be,
                          const MicroBatch& b) {
  const ModelLayout& layout = store.layout();
  const int64_t n = static_cast<int64_t>(b.tokens.size()), C = c.hidden_size;
  std::vector<DeviceBuffer> w;
  for (int64_t u = 0; u < store.num_units(); ++u) {
    w.push_back(std::move(*DeviceBuffer::Allocate(be, store.unit_elements(u) * DTypeSize(be->weight_dtype()))));
    be->UploadWeights(w.back().get(), store.weights(u), store.unit_elements(u), StreamId::kCompute);
  }
  const LayerKinds kinds = MakeLayerKinds(c, layout, be);
  DeviceBuffer ws = std::move(*DeviceBuffer::Allocate(be, kinds.MaxWorkspaceBytes(n)));
  DeviceBuffer x0 = Upload(be, be->act_dtype(), std::vector<float>(n * C));
  DeviceBuffer x1 = Upload(be, be->act_dtype(), std::vector<float>(n * C));
  std::vector<int32_t> ints = b.tokens;
  ints.insert(ints.end(), b.doc_start.begin(), b.doc_start.end());
  ints.insert(ints.end(), b.positions.begin(), b.positions.end());
  DeviceBuffer di = UploadInts(be, ints);
  const int32_t* d = static_cast<const int32_t*>(di.get());
  DeviceBatch db{n, d, nullptr, d + n, d + 2 * n};
  const std::vector<float> inv = RopeInvFreqs(c);  // the pipeline's frequencies (YaRN too)
  DeviceBuffer inv_d = Upload(be, DType::kF32, inv);
  const StreamId s = StreamId::kCompute;
  be->Embedding(x0.get(), d, w[0].get(), n, C, s);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    LayerCall call;
    call.weights = w[1 + l].get();
    call.workspace = ws.get();
    call.batch = &db;
    call.rope_inv_freq = static_cast<const float*>(inv_d.get());
    call.stream = s;
    kinds.ForLayer(l).Forward(call, l % 2 ? x1.get() : x0.get(), l % 2 ? x0.get() : x1.get());
  }
  void* x = c.num_layers % 2 ? x1.get() : x0.get();
  DeviceBuffer h = Upload(be, be->act_dtype(), std::vector<float>(n * C));
  DeviceBuffer rstd = Upload(be, be->stat_dtype(), std::vector<float>(n));
  const UnitLayout& head = layout.units[layout.HeadUnit()];
  be->RmsNorm(h.get(), rstd.get(), x, Offset(w[layout.HeadUnit()].get(), head.OffsetOf(TensorRole::kFinalNorm), be->weight_dtype()),
              n, C, c.rms_norm_eps, s);
  const void* lm = c.tie_word_embeddings
                       ? w[0].get()
                       : Offset(w[layout.HeadUnit()].get(), head.OffsetOf(TensorRole::kLmHead), be->weight_dtype());
  DeviceBuffer logits = Upload(be, be->act_dtype(), std::vector<float>(n * c.vocab_size));
  be->Linear(logits.get(), h.get(), lm, nullptr, n, C, c.vocab_size, false, s);
  return Download(be, be->act_dtype(), logits, n * c.vocab_size);
}

// Logits (n, V) of `tokens` as one document (positions 0 .. n-1): what generation's prefill
// and decode steps must give, position by position.
inline std::vector<float> DocumentLogits(const ModelConfig& c, const HostStore& store,
                                         Backend* be, const std::vector<int32_t>& tokens) {
  MicroBatch b;
  b.rows = 1;
  b.seq_len = static_cast<int64_t>(tokens.size());
  b.tokens = tokens;
  for (size_t i = 0; i < tokens.size(); ++i) {
    b.doc_start.push_back(0);
    b.positions.push_back(static_cast<int32_t>(i));
  }
  return Logits(c, store, be, b);
}

}  // namespace megatrain::testing
