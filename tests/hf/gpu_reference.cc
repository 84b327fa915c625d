// The engine's side of the GPU comparisons with Hugging Face (compare_gpu_with_transformers.py,
// and with peft: compare_lora_with_peft.py): loads a Hugging Face model folder, then on the
// chosen backend
//   0. with LoRA adapters: draws them (or reads --lora-adapter) and writes them, before any
//      step, as a PEFT adapter folder OUT/adapter-0 (adapter_config.json and
//      adapter_model.safetensors, f32 master values), so that peft starts from our A and B;
//   1. one step on batch 0: writes OUT/step.json (loss) and OUT/grads.safetensors (f32):
//      the tensors with a gradient, the adapters under PEFT's names (base_model.model.<name>),
//      every other one under its Hugging Face name (all of them without LoRA or --freeze);
//   2. `steps` AdamW steps over the batches in order: writes OUT/curve.json (losses);
//   3. saves the trained model as a checkpoint (OUT/checkpoint-<steps>; with LoRA a PEFT
//      adapter folder);
//   4. forward of batch 0 with the trained weights: writes OUT/logits.safetensors (f32).
// Usage: gpu_reference MODEL_DIR BATCHES.json OUT [--steps N] [--backend cuda|cpu]
//          [--lora-rank R [--lora-alpha A] [--lora-targets q_proj,v_proj,..] [--rslora]
//           [--lora-adapter PEFT_DIR]] [--freeze PATTERN,PATTERN,..]
//   --lora-alpha defaults to 2R; --lora-targets to every projection the family adapts;
//   --freeze takes train.freeze patterns (model/freeze.h).
// BATCHES.json: {"rows": [[[ids of row 0], [ids of row 1]], ...], "lr": .., "warmup": ..,
//                "weight_decay": .., "max_grad_norm": ..}
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "engine/backend/factory.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/common/engine_settings.h"
#include "engine/kernels/reference/rope.h"
#include "engine/model/lora.h"
#include "engine/model/safetensors.h"
#include "engine/optim/schedule.h"
#include "engine/optim/host_optimizer.h"
#include "engine/pipeline/pipeline.h"
#include "engine/store/grad_slab_pool.h"
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

struct Options {
  std::string model_dir, batches, out;
  int steps = 50;
  std::string backend = "cuda";
  LoraConfig lora;                  // rank 0: no adapters
  std::string lora_adapter;         // a PEFT folder to start from ("": drawn, seed 1234)
  std::vector<std::string> freeze;  // train.freeze patterns
};

constexpr char kUsage[] =
    "usage: gpu_reference MODEL_DIR BATCHES.json OUT [--steps N] [--backend cuda|cpu]\n"
    "         [--lora-rank R [--lora-alpha A] [--lora-targets q_proj,v_proj,..] [--rslora]\n"
    "          [--lora-adapter PEFT_DIR]] [--freeze PATTERN,PATTERN,..]\n";

std::vector<std::string> CommaList(const char* text) {
  return absl::StrSplit(text, ',', absl::SkipEmpty());
}

// False (after printing why) on a malformed command line.
bool ParseOptions(int argc, char** argv, Options* o) {
  if (argc < 4) return false;
  o->model_dir = argv[1];
  o->batches = argv[2];
  o->out = argv[3];
  double alpha = 0;
  for (int i = 4; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--rslora") {
      o->lora.rslora = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", flag.c_str());
      return false;
    }
    const char* value = argv[++i];
    if (flag == "--steps") {
      o->steps = std::atoi(value);
    } else if (flag == "--backend") {
      o->backend = value;
    } else if (flag == "--lora-rank") {
      o->lora.rank = std::atoll(value);
    } else if (flag == "--lora-alpha") {
      alpha = std::atof(value);
    } else if (flag == "--lora-targets") {
      o->lora.target_modules = CommaList(value);
    } else if (flag == "--lora-adapter") {
      o->lora_adapter = value;
    } else if (flag == "--freeze") {
      o->freeze = CommaList(value);
    } else {
      std::fprintf(stderr, "unknown option %s\n", flag.c_str());
      return false;
    }
  }
  o->lora.alpha = alpha > 0 ? alpha : 2.0 * static_cast<double>(o->lora.rank);
  return true;
}

// The store's adapters as PEFT saves them: `dir`/adapter_config.json and
// adapter_model.safetensors (base_model.model.<name>, f32 from the master; an adapter that
// --freeze left without one, from its bf16 weights).
absl::Status WriteAdapterFolder(const std::string& dir, const HostStore& store,
                                const LoraConfig& lora, const std::string& base_model) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/adapter_config.json")
      << PeftAdapterConfigJson(store.layout(), lora, base_model);
  std::vector<TensorToWrite> adapters;
  // f32 (t.num_elements) per adapter without state; a move keeps each one's buffer in place.
  std::vector<std::vector<float>> widened;
  for (int64_t u = 0; u < store.num_units(); ++u) {
    const UnitLayout& unit = store.layout().units[u];
    for (const TensorSlot& t : unit.tensors) {
      if (!IsLora(t)) continue;
      const float* values = nullptr;
      if (unit.HasState(t)) {
        values = store.master(u) + (t.offset - store.state_begin(u));
      } else {
        std::vector<uint16_t> bf16(t.num_elements);
        store.ReadWeightsBf16(u, t.offset, t.offset + t.num_elements, bf16.data());
        std::vector<float>& f = widened.emplace_back(t.num_elements);
        for (int64_t i = 0; i < t.num_elements; ++i) f[i] = Bf16ToFloat(bf16[i]);
        values = f.data();
      }
      if (LoraExperts(t) > 0) values = widened.emplace_back(LoraToPeftOrder(t, values)).data();
      adapters.push_back({kPeftPrefix + t.name, DType::kF32, PeftShape(t), values});
    }
  }
  return WriteSafetensors(dir + "/adapter_model.safetensors", adapters, {{"format", "pt"}});
}

int Main(int argc, char** argv) {
  Options o;
  if (!ParseOptions(argc, argv, &o)) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  const std::string& model_dir = o.model_dir;
  const std::string& out = o.out;
  const std::string& backend = o.backend;
  const int steps = o.steps;
  std::filesystem::create_directories(out);
  std::ifstream bin(o.batches);
  nlohmann::json spec = nlohmann::json::parse(bin);
  std::vector<MicroBatch> batches;
  for (const auto& rows : spec["rows"]) batches.push_back(RowsBatch(rows));

  absl::StatusOr<ModelConfig> c = LoadModelConfig(model_dir + "/config.json");
  if (!c.ok()) { std::fprintf(stderr, "%s\n", c.status().ToString().c_str()); return 1; }
  c->rope_scaling.dynamic_seq_len = batches[0].seq_len;  // as a job of that seq_len
  // BuildLayout, the adapters (rank > 0), then the frozen tensors: a job's layout.
  absl::StatusOr<ModelLayout> layout = TrainingLayout(*c, o.lora, o.freeze);
  if (!layout.ok()) { std::fprintf(stderr, "%s\n", layout.status().ToString().c_str()); return 1; }
  const bool lora = HasLora(*layout);
  std::unique_ptr<Backend> be = std::move(*CreateBackend(BackendRequest{backend}));
  std::unique_ptr<HostStore> store = std::move(*HostStore::Create(*layout));
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(model_dir);
  if (!reader.ok() || !LoadWeights(*reader, store.get()).ok()) { std::fprintf(stderr, "load failed\n"); return 1; }
  if (lora) {  // LoadWeights leaves the adapters zero
    if (o.lora_adapter.empty()) {
      InitLoraAdapters(LoraInit::kDefault, 1234, store.get());
    } else if (absl::Status s = LoadLoraAdapter(o.lora_adapter, o.lora, store.get()); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
    if (absl::Status s = WriteAdapterFolder(out + "/adapter-0", *store, o.lora, model_dir);
        !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
  }
  // Slabs as a job sizes them (clipping holds every piece): a LoRA layer drains its adapters.
  std::unique_ptr<GradSlabPool> pool = std::move(*GradSlabPool::Create(
      GradSlabsNeeded(store->layout(), /*clipping=*/true), GradSlabElements(store->layout())));
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
  // The trainable tensors alone: a frozen unit's gradient is empty, and a unit's ends at its
  // state range (zero below it).
  std::vector<TensorToWrite> grads;
  // The experts' adapters' gradients in PEFT's order (a move keeps each buffer in place).
  std::vector<std::vector<float>> reordered;
  for (int64_t u = 0; u < store->num_units(); ++u) {
    for (const TensorSlot& t : store->layout().units[u].tensors) {
      if (!t.trainable) continue;
      const int64_t have = static_cast<int64_t>(sink.grads[u].size());
      if (t.offset + t.num_elements > have) {
        std::fprintf(stderr, "no gradient for trainable %s (unit %lld has %lld elements)\n",
                     t.name.c_str(), static_cast<long long>(u), static_cast<long long>(have));
        return 1;
      }
      const float* values = sink.grads[u].data() + t.offset;
      if (LoraExperts(t) > 0) values = reordered.emplace_back(LoraToPeftOrder(t, values)).data();
      grads.push_back({IsLora(t) ? kPeftPrefix + t.name : t.name, DType::kF32,
                       IsLora(t) ? PeftShape(t) : t.shape, values});
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
  CheckpointOptions ck_options;
  if (lora) ck_options.adapter_config = PeftAdapterConfigJson(store->layout(), o.lora, model_dir);
  absl::StatusOr<std::string> ck = SaveCheckpoint(out, *c, *store, state, ck_options);
  std::vector<float> logits = Logits(*c, *store, be.get(), batches[0]);
  (void)WriteSafetensors(out + "/logits.safetensors",
                         {{"logits", DType::kF32, {static_cast<int64_t>(batches[0].tokens.size()), c->vocab_size}, logits.data()}},
                         {{"format", "pt"}});
  std::printf("%s: first loss %.6f, after %d steps %.6f, checkpoint %s\n", backend.c_str(),
              first.loss, steps, losses.empty() ? first.loss : losses.back(),
              ck.ok() ? ck->c_str() : ck.status().ToString().c_str());
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
