// Exports what the Hugging Face comparison (compare_with_transformers.py) checks, for
// each supported architecture variant, into OUT/<variant>/:
//   step0/                 checkpoint of the initial weights (HF folder + optimizer state)
//   step1/                 checkpoint after one AdamW step (clipping, weight decay)
//   batch.json             the rows, our loss, the optimizer settings
//   grads.safetensors      our f32 gradients of the mean loss, Hugging Face names
// Usage: export_reference OUT
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "engine/backend/cpu_backend.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/model/safetensors.h"
#include "engine/optim/host_optimizer.h"
#include "engine/pipeline/pipeline.h"
#include "engine/store/model_io.h"
#include "nlohmann/json.hpp"
#include "tests/engine/pipeline/recording_sink.h"
#include "tests/engine/pipeline/tiny_model.h"

namespace megatrain::testing {
namespace {

ModelConfig Widen(ModelConfig c) {
  c.hidden_size = 64;
  c.num_heads = 4;
  c.head_dim = c.qk_norm ? 24 : 16;
  c.intermediate_size = 128;
  c.num_layers = 2;
  c.vocab_size = 300;
  c.max_position_embeddings = 128;
  return c;
}

// Rows of one document each: HF's causal mask and label shift see the same thing.
MicroBatch Rows(int64_t rows, int64_t seq, int64_t vocab, uint64_t seed) {
  MicroBatch b = RandomBatch(rows, seq, vocab, seed);
  for (int64_t i = 0; i < rows * seq; ++i) {
    const int64_t r = i / seq;
    b.doc_start[i] = static_cast<int32_t>(r * seq);
    b.positions[i] = static_cast<int32_t>(i - r * seq);
    b.targets[i] = (i % seq == seq - 1) ? -100 : b.tokens[i + 1];
  }
  return b;
}

int Export(const std::string& out, const std::string& name, const ModelConfig& c) {
  namespace fs = std::filesystem;
  const std::string dir = (fs::path(out) / name).string();
  fs::create_directories(dir);
  std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
  std::unique_ptr<HostStore> store = std::move(*HostStore::Create(BuildLayout(c)));
  RandomInitWeights(c, 21, store.get());
  int64_t max_unit = 0;
  for (const UnitLayout& u : store->layout().units) max_unit = std::max(max_unit, u.num_elements);
  std::unique_ptr<GradSlabPool> pool = std::move(*GradSlabPool::Create(store->num_units(), max_unit));
  const int64_t rows = 3, seq = 16;
  PipelineOptions po;
  po.tokens_per_micro_batch = rows * seq;
  po.checkpoint_every = 1;
  po.loss_chunk_tokens = 20;
  std::unique_ptr<Pipeline> pipeline =
      std::move(*Pipeline::Create(c, store.get(), pool.get(), be.get(), po));
  const MicroBatch batch = Rows(rows, seq, c.vocab_size, 8);

  TrainerState state;
  CheckpointOptions co;
  if (!SaveCheckpoint(dir, c, *store, state, co).ok()) return 1;
  fs::rename(fs::path(dir) / "checkpoint-0", fs::path(dir) / "step0");

  RecordingSink sink(be.get(), pool.get(), store->num_units());
  absl::StatusOr<StepResult> r = pipeline->Step({batch}, &sink);
  if (!r.ok()) return 1;
  std::vector<TensorToWrite> grads;
  for (int64_t u = 0; u < store->num_units(); ++u) {
    for (const TensorSlot& t : store->layout().units[u].tensors) {
      grads.push_back({t.name, DType::kF32, t.shape, sink.grads[u].data() + t.offset});
    }
  }
  if (!WriteSafetensors(dir + "/grads.safetensors", grads, {{"format", "pt"}}).ok()) return 1;

  HostOptimizerOptions oo;
  oo.hyper = AdamWHyper{0.9, 0.95, 1e-8};
  oo.weight_decay = 0.1;
  oo.max_grad_norm = 0.5;
  const double lr = 1e-3;
  HostOptimizer opt(store.get(), pool.get(), be.get(), oo);
  opt.BeginStep(lr, 1);
  if (!pipeline->Step({batch}, &opt).ok()) return 1;
  opt.Drain();
  state.step = 1;
  if (!SaveCheckpoint(dir, c, *store, state, co).ok()) return 1;
  fs::rename(fs::path(dir) / "checkpoint-1", fs::path(dir) / "step1");

  std::vector<std::vector<int32_t>> token_rows;
  for (int64_t rr = 0; rr < rows; ++rr) {
    token_rows.emplace_back(batch.tokens.begin() + rr * seq, batch.tokens.begin() + (rr + 1) * seq);
  }
  nlohmann::json j = {{"rows", token_rows}, {"loss", r->loss}, {"grad_norm", r->grad_norm},
                      {"lr", lr}, {"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8},
                      {"weight_decay", 0.1}, {"max_grad_norm", 0.5}};
  std::ofstream(dir + "/batch.json") << j.dump(1);
  std::printf("%s: loss %.6f grad_norm %.6f\n", name.c_str(), r->loss, r->grad_norm);
  return 0;
}

}  // namespace
}  // namespace megatrain::testing

int main(int argc, char** argv) {
  using namespace megatrain::testing;
  if (argc != 2) {
    std::fprintf(stderr, "usage: export_reference OUT\n");
    return 2;
  }
  int rc = 0;
  rc |= Export(argv[1], "llama_tied_gqa", Widen(TinyConfig(Variant::kLlamaTiedGqa)));
  rc |= Export(argv[1], "qwen2_untied_bias", Widen(TinyConfig(Variant::kQwen2UntiedBias)));
  rc |= Export(argv[1], "qwen3_qk_norm", Widen(TinyConfig(Variant::kQwen3QkNorm)));
  rc |= Export(argv[1], "llama3_rope_mha", Widen(TinyConfig(Variant::kLlama3RopeMha)));
  return rc;
}
