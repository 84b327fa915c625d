// The engine's side of the GPU comparison with Hugging Face (compare_gpu_with_transformers.py):
// loads a Hugging Face model folder, then on the chosen backend
//   1. one step on batch 0: writes OUT/step.json (loss) and OUT/grads.safetensors (f32);
//   2. `steps` AdamW steps over the batches in order: writes OUT/curve.json (losses);
//   3. saves the trained model as a checkpoint (OUT/checkpoint-<steps>);
//   4. forward of batch 0 with the trained weights: writes OUT/logits.safetensors (f32).
// Usage: gpu_reference MODEL_DIR BATCHES.json OUT [--steps N] [--backend cuda|cpu]
// BATCHES.json: {"rows": [[[ids of row 0], [ids of row 1]], ...], "lr": .., "warmup": ..,
//                "weight_decay": .., "max_grad_norm": ..}
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "engine/backend/factory.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/common/engine_settings.h"
#include "engine/kernels/reference/rope.h"
#include "engine/model/safetensors.h"
#include "engine/optim/schedule.h"
#include "engine/optim/host_optimizer.h"
#include "engine/pipeline/pipeline.h"
#include "engine/store/model_io.h"
#include "nlohmann/json.hpp"
#include "tests/engine/pipeline/recording_sink.h"
#include "tests/gpu/gpu_util.h"
#include "tests/util/forward_logits.h"

namespace megatrain::testing {
namespace {

MicroBatch RowsBatch(const nlohmann::json& rows) {
  MicroBatch b;
  b.rows = static_cast<int64_t>(rows.size());
  b.seq_len = static_cast<int64_t>(rows[0].size());
  for (int64_t r = 0; r < b.rows; ++r) {
    for (int64_t i = 0; i < b.seq_len; ++i) {
      b.tokens.push_back(rows[r][i].get<int32_t>());
      b.targets.push_back(i + 1 < b.seq_len ? rows[r][i + 1].get<int32_t>() : -100);
      b.doc_start.push_back(static_cast<int32_t>(r * b.seq_len));
      b.positions.push_back(static_cast<int32_t>(i));
    }
  }
  return b;
}

int Main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: gpu_reference MODEL_DIR BATCHES.json OUT [--steps N] [--backend B]\n");
    return 2;
  }
  const std::string model_dir = argv[1], out = argv[3];
  int steps = 50;
  std::string backend = "cuda";
  for (int i = 4; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--steps") steps = std::atoi(argv[i + 1]);
    if (std::string(argv[i]) == "--backend") backend = argv[i + 1];
  }
  std::filesystem::create_directories(out);
  std::ifstream bin(argv[2]);
  nlohmann::json spec = nlohmann::json::parse(bin);
  std::vector<MicroBatch> batches;
  for (const auto& rows : spec["rows"]) batches.push_back(RowsBatch(rows));

  absl::StatusOr<ModelConfig> c = LoadModelConfig(model_dir + "/config.json");
  if (!c.ok()) { std::fprintf(stderr, "%s\n", c.status().ToString().c_str()); return 1; }
  c->rope_scaling.dynamic_seq_len = batches[0].seq_len;  // as a job of that seq_len
  std::unique_ptr<Backend> be = std::move(*CreateBackend(BackendRequest{backend}));
  std::unique_ptr<HostStore> store = std::move(*HostStore::Create(BuildLayout(*c)));
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(model_dir);
  if (!reader.ok() || !LoadWeights(*reader, store.get()).ok()) { std::fprintf(stderr, "load failed\n"); return 1; }
  int64_t max_unit = 0;
  for (const UnitLayout& u : store->layout().units) max_unit = std::max(max_unit, u.num_elements);
  std::unique_ptr<GradSlabPool> pool = std::move(*GradSlabPool::Create(store->num_units(), max_unit));
  (void)be->PinHostRange(store->transfer_base(), store->transfer_bytes());
  (void)be->PinHostRange(pool->base(), pool->bytes());
  PipelineOptions po;
  po.tokens_per_micro_batch = static_cast<int64_t>(batches[0].tokens.size());
  po.checkpoint_every = 2;
  po.loss_chunk_tokens = 256;
  po.checkpoints_on_host = backend == "cuda";
  std::unique_ptr<Pipeline> p = std::move(*Pipeline::Create(*c, store.get(), pool.get(), be.get(), po));

  RecordingSink sink(be.get(), pool.get(), store->num_units());
  StepResult first = *p->Step({batches[0]}, &sink);
  std::vector<TensorToWrite> grads;
  for (int64_t u = 0; u < store->num_units(); ++u) {
    for (const TensorSlot& t : store->layout().units[u].tensors) {
      grads.push_back({t.name, DType::kF32, t.shape, sink.grads[u].data() + t.offset});
    }
  }
  (void)WriteSafetensors(out + "/grads.safetensors", grads, {{"format", "pt"}});
  // loss: the LM loss; total: what was differentiated (with MoE, + coef * aux_loss).
  const double first_total = first.loss + first.aux_loss_coef * first.aux_loss;
  std::ofstream(out + "/step.json") << nlohmann::json{{"loss", first.loss}, {"aux_loss", first.aux_loss},
                                                      {"total", first_total},
                                                      {"grad_norm", first.grad_norm}}.dump();

  HostOptimizerOptions oo;
  oo.weight_decay = spec["weight_decay"].get<double>();
  oo.max_grad_norm = spec["max_grad_norm"].get<double>();
  HostOptimizer opt(store.get(), pool.get(), be.get(), oo);
  ScheduleOptions sched{ScheduleType::kConstant, spec["lr"].get<double>(), spec["warmup"].get<int64_t>(), steps, 0};
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    opt.BeginStep(LearningRate(sched, step), step + 1);
    const StepResult r = *p->Step({batches[step % batches.size()]}, &opt);
    losses.push_back(r.loss + r.aux_loss_coef * r.aux_loss);
  }
  opt.Drain();
  std::ofstream(out + "/curve.json") << nlohmann::json{{"losses", losses}}.dump();
  TrainerState state;
  state.step = steps;
  absl::StatusOr<std::string> ck = SaveCheckpoint(out, *c, *store, state, CheckpointOptions{});
  std::vector<float> logits = Logits(*c, *store, be.get(), batches[0]);
  (void)WriteSafetensors(out + "/logits.safetensors",
                         {{"logits", DType::kF32, {static_cast<int64_t>(batches[0].tokens.size()), c->vocab_size}, logits.data()}},
                         {{"format", "pt"}});
  std::printf("%s: first loss %.6f, after %d steps %.6f, checkpoint %s\n", backend.c_str(),
              first.loss, steps, losses.empty() ? first.loss : losses.back(),
              ck.ok() ? ck->c_str() : "failed");
  be->UnpinHostRange(store->transfer_base());
  be->UnpinHostRange(pool->base());
  return 0;
}

}  // namespace
}  // namespace megatrain::testing

int main(int argc, char** argv) {
  megatrain::SetEngineSettings(megatrain::EngineSettingsFromEnvironment(
      [](const char* name) { return std::getenv(name); }));
  return megatrain::testing::Main(argc, argv);
}
