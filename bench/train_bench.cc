// Training-step throughput of the streaming pipeline, as the planner runs it, against the
// three floors of the same step measured in the same run: the GPU time of its kernels
// (compute-stream busy time), the PCIe time of its transfers (its bytes at the machine
// profile's rates), and the CPU optimizer's busy time. Prints one JSON object. Not a test.
//
//   train_bench --shape qwen2.5-7b --seq 4096 --tokens-per-step 65536
//               [--layers N] [--device-memory-gib 24] [--max-grad-norm 0]
//               [--micro-batch-rows R] [--k K] [--checkpoints auto|device|host]
//               [--kept-layers N] [--weight-slots S] [--mlp-tile T]
//               [--no-optimizer] [--eval] [--dpo] [--timeline PATH] [--steps 8] [--warmup 3]
//               [--profile PATH] [--backend cuda|cpu]
//
// Shapes are the published configs with random init. The plan (micro-batch, K, where
// checkpoints live, weight slots) is the planner's unless fixed by a flag; its predicted
// step is reported beside the measured one.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <map>
#include <thread>
#include <random>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "engine/backend/factory.h"
#include "engine/backend/planning_backend.h"
#include "engine/common/engine_settings.h"
#include "engine/common/status.h"
#include "engine/data/pair_packer.h"
#include "engine/optim/host_optimizer.h"
#include "engine/pipeline/pipeline.h"
#include "engine/plan/planner.h"
#include "bench/step_schedule.h"
#include "engine/store/model_io.h"
#include "bench/shapes.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

MicroBatch Batch(int64_t rows, int64_t seq, int64_t vocab, uint64_t seed) {
  std::mt19937_64 gen(seed);
  MicroBatch b;
  b.rows = rows;
  b.seq_len = seq;
  for (int64_t i = 0; i < rows * seq; ++i) {
    b.tokens.push_back(static_cast<int32_t>(gen() % vocab));
    b.targets.push_back(static_cast<int32_t>(gen() % vocab));
    b.doc_start.push_back(static_cast<int32_t>(i / seq * seq));
    b.positions.push_back(static_cast<int32_t>(i % seq));
  }
  return b;
}

// --dpo: micro-batches of preference pairs, one pair a row: a prompt of seq / 8 tokens and
// two completions filling the row's halves (PackPairs), with reference log-probabilities
// and the step's weights attached (AttachSequences, RPO off).
std::vector<MicroBatch> PairBatches(int64_t micro_batches, int64_t rows, int64_t seq,
                                    int64_t vocab) {
  std::mt19937_64 gen(7);
  std::vector<std::pair<PreferenceSequence, PreferenceSequence>> pairs;
  const int64_t half = seq / 2, prompt = seq / 8;
  for (int64_t k = 0; k < micro_batches * rows; ++k) {
    PreferenceSequence chosen, rejected;
    for (int64_t j = 0; j < half; ++j) {
      const bool completion = j >= prompt;
      chosen.ids.push_back(static_cast<int32_t>(gen() % vocab));
      rejected.ids.push_back(completion ? static_cast<int32_t>(gen() % vocab) : chosen.ids[j]);
      chosen.completion.push_back(completion);
      rejected.completion.push_back(completion);
    }
    pairs.emplace_back(std::move(chosen), std::move(rejected));
  }
  std::vector<MicroBatch> batches;
  int64_t first = 0;
  for (int64_t m = 0; m < micro_batches; ++m) {
    PairBatch b;
    first += PackPairs(pairs, first, rows, seq, 0, &b);
    std::vector<double> ref(2 * b.pairs(), -static_cast<double>(half - prompt) * 11.9);
    AttachSequences(ref, 1.0 / static_cast<double>(pairs.size()), 0.0, &b);
    batches.push_back(std::move(b.batch));
  }
  return batches;
}

// --no-optimizer: takes each gradient once it has landed and hands its slab back, updating
// nothing, so that the step shows the GPU and PCIe with no CPU optimizer beside them
// (where a CPU-bound step's kernels lose time to the optimizer's threads).
class DiscardingSink final : public GradSink {
 public:
  DiscardingSink(Backend* backend, GradSlabPool* pool)
      : backend_(backend), pool_(pool), worker_([this] { Loop(); }) {}
  ~DiscardingSink() override {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    worker_.join();
  }
  void Submit(int64_t, float* slab, void* ready, int64_t, int64_t) override {
    MutexLock lock(&mu_);
    queue_.push_back({slab, ready});
  }
  double Finish() override {
    MutexLock lock(&mu_);
    mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && idle_; });
    return 0;
  }

 private:
  void Loop() {
    for (;;) {
      std::pair<float*, void*> item;
      {
        MutexLock lock(&mu_);
        mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        item = queue_.front();
        queue_.pop_front();
        idle_ = false;
      }
      backend_->EventSync(item.second);
      pool_->Release(item.first);
      MutexLock lock(&mu_);
      idle_ = true;
    }
  }
  Backend* backend_;
  GradSlabPool* pool_;
  Mutex mu_;
  std::deque<std::pair<float*, void*>> queue_ ABSL_GUARDED_BY(mu_);
  bool idle_ ABSL_GUARDED_BY(mu_) = true;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Milliseconds(std::chrono::steady_clock::time_point from,
                    std::chrono::steady_clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

// The AdamW pieces taken from `since` on (the steady steps'): each one's rate (parameters a
// second, from its gradient's landing to its end), and the worker's waits for landings. A
// rate that varies across pieces is what the steps' DMA or other threads cost it.
nlohmann::json OptimizerPieces(const std::vector<OptimizerSpan>& spans,
                               std::chrono::steady_clock::time_point since) {
  std::vector<double> rates;
  double waited_ms = 0;
  for (const OptimizerSpan& o : spans) {
    if (!o.update || o.taken < since) continue;
    const double ms = Milliseconds(o.ready, o.end);
    if (ms > 0) rates.push_back(o.count / (ms / 1e3));
    waited_ms += Milliseconds(o.taken, o.ready);
  }
  std::sort(rates.begin(), rates.end());
  auto at = [&](double q) {
    return rates.empty() ? 0.0 : rates[static_cast<size_t>(q * (rates.size() - 1))];
  };
  return {{"pieces", rates.size()},
          {"params_per_second", {{"min", at(0)}, {"p10", at(0.1)}, {"median", at(0.5)},
                                 {"p90", at(0.9)}, {"max", at(1)}}},
          {"waited_for_landing_ms", waited_ms}};
}

// The optimizer's pieces that end after `step_start` (the last step's start on the host) as
// timeline spans on stream kNumStreams ("adamw U" / "squares U", ready_ms: when the piece's
// gradient had landed), in milliseconds from that start: the host's clock, which the
// streams' spans (from the H2D zero event the step records first) match only as far as
// H2D was idle when the step began.
void AddOptimizerSpans(const std::vector<OptimizerSpan>& spans,
                       std::chrono::steady_clock::time_point step_start, nlohmann::json* out) {
  for (const OptimizerSpan& o : spans) {
    if (o.end < step_start) continue;
    out->push_back({{"stream", kNumStreams},
                    {"label", absl::StrCat(o.update ? "adamw " : "squares ", o.unit)},
                    {"start_ms", Milliseconds(step_start, o.taken)},
                    {"ready_ms", Milliseconds(step_start, o.ready)},
                    {"end_ms", Milliseconds(step_start, o.end)},
                    {"params", o.count}});
  }
}

// --eval: the forward-only pass (Pipeline::Evaluate) over the step's own micro-batches,
// every update applied first, timed three times; then one more training step on the same
// weights, whose loss the evaluation's must equal bit for bit. `step_seconds`: the steady
// step's median, which the pass's time per token is reported over.
absl::StatusOr<nlohmann::json> EvalRun(Pipeline* pipeline, HostOptimizer* opt, GradSink* sink,
                                       const std::vector<MicroBatch>& batches, int64_t step,
                                       double step_seconds) {
  opt->Drain();
  std::vector<double> seconds;
  EvalResult eval;
  for (int i = 0; i < 3; ++i) {
    ASSIGN_OR_RETURN(eval, pipeline->Evaluate(batches));
    seconds.push_back(eval.seconds);
  }
  opt->BeginStep(1e-5, step);
  ASSIGN_OR_RETURN(const StepResult next, pipeline->Step(batches, sink));
  opt->Drain();
  const double median = Median(seconds);
  return nlohmann::json{
      {"micro_batches", eval.micro_batches},
      {"passes", eval.passes},
      {"eval_micro_batches_per_pass", pipeline->eval_micro_batches()},
      {"seconds", seconds},
      {"seconds_median", median},
      {"h2d_bytes", eval.h2d_bytes},
      {"loss", eval.loss()},
      {"next_step_loss", next.loss},
      {"loss_equals_next_step_bits", eval.loss() == next.loss},
      {"time_per_token_over_step", median / step_seconds},
      {"formula", "the pass over the step's tokens (forward only: layers and loss head) over "
                  "the steady training step's median on the same tokens"}};
}

// Parameters with optimizer state (every unit's state range): what the step trains.
int64_t TrainedParameters(const ModelLayout& layout) {
  int64_t n = 0;
  for (const UnitLayout& u : layout.units) n += u.StateElements();
  return n;
}

}  // namespace
}  // namespace megatrain

int main(int argc, char** argv) {
  using namespace megatrain;
  SetEngineSettings(
      EngineSettingsFromEnvironment([](const char* name) { return std::getenv(name); }));
  CLI::App app{"train_bench: planned training steps against their floors"};
  std::string backend = "cuda", shape = "qwen2.5-1.5b", checkpoints = "auto", profile_path;
  int64_t layers = 0, vocab = 0, seq = 4096, tokens = 65536, steps = 8, warmup = 3;
  int64_t micro_rows = 0, k = 0, kept = -1, slots = -1, mlp_tile = -1;
  double device_gib = 0, max_grad_norm = 0, host_gib = 0;
  bool plan_only = false, no_optimizer = false, calibrate = false, eval = false, dpo = false;
  std::string timeline_path, state_dtype = "fp32", bf16_copy = "auto", nvme_dir;
  std::string clip_store = "auto";
  int64_t nvme_layers = -1;
  LoraConfig lora;
  std::vector<std::string> freeze;
  app.add_option("--backend", backend);
  app.add_option("--state-dtype", state_dtype, "AdamW moments: fp32 | bf16 | int8");
  app.add_option("--nvme-dir", nvme_dir, "the NVMe tier: a folder for layers' moments");
  app.add_option("--nvme-layers", nvme_layers,
                 "layers whose moments go there (-1: as many as --host-memory-gib needs)");
  app.add_option("--bf16-copy", bf16_copy,
                 "keep the bf16 weights that cross PCIe: yes | no | auto (the planner)");
  app.add_option("--shape", shape,
                 "qwen2.5-1.5b | qwen2.5-7b | llama-3.1-8b | llama-3.1-405b | qwen3-30b-a3b | "
                 "mixtral-8x7b | gpt-oss-120b | gpt-oss-20b | qwen3-235b-a22b");
  app.add_option("--layers", layers, "override the shape's depth");
  app.add_option("--vocab", vocab,
                 "override the shape's vocabulary (so deep cuts of large-vocabulary shapes fit "
                 "the box's RAM; the head's cost shrinks with it)");
  app.add_option("--seq", seq);
  app.add_option("--tokens-per-step", tokens);
  app.add_option("--device-memory-gib", device_gib, "cap the device memory (0 = all free)");
  app.add_option("--host-memory-gib", host_gib,
                 "plan for this much host memory (0 = 90% of this box's); with --plan-only, a "
                 "projection for a bigger box");
  app.add_flag("--plan-only", plan_only,
               "print the plan's prediction as JSON and exit (no memory is allocated); on a "
               "machine without the --backend's device, plans for the box whose saved "
               "profile --profile names");
  app.add_flag("--calibrate", calibrate,
               "write AdamW's rate in these steps over the profile's (optimizer_in_step_fraction) "
               "into the profile as its adamw_in_step_fraction, for the planner's next plans");
  app.add_option("--timeline", timeline_path,
                 "write the last step's stream spans here (JSON: stream, label, start/end ms)");
  app.add_flag("--eval", eval,
               "also time the forward-only evaluation pass over the step's micro-batches");
  app.add_flag("--dpo", dpo,
               "DPO steps (sigmoid, beta 0.1): a pair a row, the head's two sweeps");
  app.add_flag("--no-optimizer", no_optimizer,
               "discard the gradients (no CPU AdamW): the step's GPU and PCIe alone");
  app.add_option("--max-grad-norm", max_grad_norm, "global-norm clipping (0 = off)");
  app.add_option("--clip-store", clip_store,
                 "clipping's waiting gradients: auto | fp32 | fp16 (optimizer.clip_store)");
  app.add_option("--lora-rank", lora.rank, "LoRA adapters of this rank, the base frozen (0: none)");
  app.add_option("--lora-alpha", lora.alpha, "LoRA's alpha (default: 2 x rank)");
  app.add_option("--lora-targets", lora.target_modules,
                 "comma-separated PEFT module names, experts.gate_up_proj and "
                 "experts.down_proj (default: every projection; the attention's for MoE)")
      ->delimiter(',');
  app.add_option("--freeze", freeze, "train.freeze patterns");
  app.add_option("--micro-batch-rows", micro_rows, "0 = the planner's choice");
  app.add_option("--k", k, "activation checkpoint interval; 0 = the planner's choice");
  app.add_option("--checkpoints", checkpoints, "auto | device | host");
  app.add_option("--kept-layers", kept, "layers keeping activations; -1 = the planner's choice");
  app.add_option("--weight-slots", slots, "device weight slots; -1 = the planner's choice");
  app.add_option("--mlp-tile", mlp_tile,
                 "tokens per MLP tile (sequence tiling); -1 = the planner's choice, 0 = none");
  app.add_option("--steps", steps, "steps in all, warm-up included");
  app.add_option("--warmup", warmup);
  app.add_option("--profile", profile_path, "machine profile cache (default: the user's)");
  CLI11_PARSE(app, argc, argv);

  ModelConfig c;
  if (!NamedShape(shape, &c)) {
    std::fprintf(stderr, "unknown --shape %s\n", shape.c_str());
    return 2;
  }
  if (layers > 0) SetNumLayers(layers, &c);
  if (vocab > 0) c.vocab_size = vocab;
  if (calibrate && (plan_only || no_optimizer || max_grad_norm > 0)) {
    std::fprintf(stderr, "--calibrate measures AdamW in steps that run it alone: not with "
                         "--plan-only, --no-optimizer or --max-grad-norm\n");
    return 2;
  }
  if (tokens % seq != 0) {
    std::fprintf(stderr, "--tokens-per-step must be a multiple of --seq\n");
    return 2;
  }
  const int64_t cap = static_cast<int64_t>(device_gib * (1ll << 30));
  const std::string profile_file =
      profile_path.empty() ? DefaultProfilePath(GetEngineSettings().profiles) : profile_path;
  absl::StatusOr<std::unique_ptr<Backend>> be = CreateBackend(BackendRequest{backend, cap});
  absl::StatusOr<MachineProfile> profile = absl::UnknownError("not loaded");
  std::string note;
  if (!be.ok() && plan_only && backend != "cpu") {
    // Planning for a GPU box from a machine without its GPU: its saved profile's rates and
    // device memory (or --device-memory-gib), the CUDA backend's types (PlanningBackend).
    profile = ReadProfile(profile_file);
    if (!profile.ok() || profile->backend.rfind("cuda", 0) != 0) {
      std::fprintf(stderr, "%s; --plan-only without the device needs a saved CUDA box's profile "
                   "(--profile): %s\n", be.status().ToString().c_str(),
                   profile.ok() ? ("its backend is " + profile->backend).c_str()
                                : profile.status().ToString().c_str());
      return 1;
    }
    be = std::unique_ptr<Backend>(std::make_unique<PlanningBackend>(
        profile->backend, cap > 0 ? cap : profile->device_memory_bytes));
    note = absl::StrCat("no ", backend, " device here: planning for the box of ", profile_file,
                        " (", profile->key, ", measured ", profile->measured_at, ")");
  } else if (!be.ok()) {
    std::fprintf(stderr, "%s\n", be.status().ToString().c_str());
    return 1;
  } else {
    profile = LoadOrMeasureProfile(be->get(), profile_file, &note);
  }
  if (!profile.ok()) {
    std::fprintf(stderr, "%s\n", profile.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "%s\n", note.c_str());

  PlanRequest request;
  MomentDType moments = MomentDType::kF32;
  if (!ParseMomentDType(state_dtype, &moments)) {
    std::fprintf(stderr, "--state-dtype must be fp32, bf16 or int8, got '%s'\n",
                 state_dtype.c_str());
    return 2;
  }
  request.moments = moments;
  const absl::StatusOr<Bf16Copy> copy = ParseSpecName<Bf16Copy>("--bf16-copy", bf16_copy);
  const absl::StatusOr<ActivationPlacement> placement =
      ParseSpecName<ActivationPlacement>("--checkpoints", checkpoints);
  const absl::StatusOr<ClipStore> held = ParseSpecName<ClipStore>("--clip-store", clip_store);
  for (const absl::Status& s : {copy.status(), placement.status(), held.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  request.bf16_copy = *copy;
  request.clip_store = *held;
  request.nvme_dir = nvme_dir;
  request.nvme_layers = nvme_dir.empty() ? 0 : nvme_layers;
  if (lora.rank > 0 && lora.alpha <= 0) lora.alpha = 2.0 * lora.rank;
  if (lora.rank > 0 && lora.target_modules.empty() && c.is_moe()) {
    lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
  }
  absl::StatusOr<ModelLayout> trained_layout = TrainingLayout(c, lora, freeze);
  if (!trained_layout.ok()) {
    std::fprintf(stderr, "%s\n", std::string(trained_layout.status().message()).c_str());
    return 2;
  }
  request.lora = lora;
  request.freeze = freeze;
  request.config = c;
  request.seq_len = seq;
  request.rows_per_step = tokens / seq;
  request.clipping = max_grad_norm > 0;
  request.micro_batch_rows = micro_rows;
  request.checkpoint_every = k;
  request.checkpoints = *placement;
  request.kept_layers = kept;
  request.mlp_tile_tokens = mlp_tile;
  request.weight_slots = slots;
  request.eval_rows = eval ? tokens / seq : 0;
  request.device_budget_bytes = PlannableDeviceBytes((*be)->device_memory_budget());
  request.host_budget_bytes = host_gib > 0 ? static_cast<int64_t>(host_gib * (1ll << 30))
                                           : profile->host_memory_bytes * 9 / 10;
  absl::StatusOr<Plan> plan = MakePlan(request, *profile, be->get());
  if (!plan.ok()) {
    std::fprintf(stderr, "%s\n", plan.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "%s", DescribePlan(*plan, request, *profile).c_str());
  const nlohmann::json plan_json = {
      {"micro_batch_rows", plan->micro_batch_rows},
      {"micro_batches", plan->micro_batches},
      {"checkpoint_every", plan->checkpoint_every},
      {"checkpoints_on_host", plan->checkpoints_on_host},
      {"weight_slots", plan->weight_slots},
      {"kept_layers", plan->kept_layers},
      {"mlp_tile_tokens", plan->mlp_tile_tokens},
      {"predicted_step_seconds", plan->step.seconds},
      {"predicted_bound", plan->step.bound},
      {"predicted_compute_seconds", plan->step.compute_seconds},
      {"predicted_head_seconds", plan->step.head_seconds},
      {"predicted_pcie_seconds", plan->step.pcie_seconds},
      {"predicted_optimizer_seconds", plan->step.optimizer_seconds},
      {"predicted_model_tflops", plan->step.model_flops / plan->step.seconds / 1e12},
      {"predicted_device_gib", plan->device_bytes / double(1ll << 30)},
      {"predicted_host_gib", plan->host_bytes / double(1ll << 30)},
      {"bf16_copy", plan->bf16_copy},
      {"clip_store", plan->compact_held ? "fp16" : max_grad_norm > 0 ? "fp32" : "none"},
      {"predicted_host_bytes_per_parameter",
       static_cast<double>(plan->host_bytes) / std::max<int64_t>(1, plan->num_parameters)},
      {"nvme_layers", plan->nvme_layers},
      {"predicted_disk_seconds", plan->step.disk_seconds}};
  if (plan_only) {
    std::printf("%s\n", nlohmann::json{{"benchmark", "train_bench --plan-only"},
                                       {"shape", shape},
                                       {"layers", c.num_layers},
                                       {"parameters", NumParameters(c)},
                                       {"active_matmul_parameters", MatmulParameters(c)},
                                       {"tokens_per_step", tokens},
                                       {"seq_len", seq},
                                       {"host_budget_gib",
                                        request.host_budget_bytes / double(1ll << 30)},
                                       {"plan", plan_json}}
                             .dump(2)
                             .c_str());
    return 0;
  }

  const ModelLayout& layout = *trained_layout;
  StoreOptions store_options;
  store_options.moments = moments;
  store_options.bf16_copy = plan->bf16_copy;
  store_options.nvme_dir = nvme_dir;
  for (int64_t l = c.num_layers - plan->nvme_layers; l < c.num_layers; ++l) {
    store_options.disk_units.push_back(layout.DecoderUnit(l));
  }
  absl::StatusOr<std::unique_ptr<HostStore>> store = HostStore::Create(layout, -1, store_options);
  if (!store.ok()) {
    std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
    return 1;
  }
  RandomInitWeights(c, 1, store->get());
  InitLoraAdapters(LoraInit::kDefault, 1, store->get());
  std::unique_ptr<GradSlabPool> pool = std::move(*GradSlabPool::Create(
      GradSlabsNeeded(layout, max_grad_norm > 0 && !plan->compact_held),
      GradSlabElements(layout)));
  if (!(*be)->PinHostRange((*store)->transfer_base(), (*store)->transfer_bytes()).ok() ||
      !(*be)->PinHostRange(pool->base(), pool->bytes()).ok()) {
    std::fprintf(stderr, "cannot pin host memory\n");
    return 1;
  }
  PipelineOptions po = PipelineOptionsOf(*plan, seq);
  po.record_timeline = true;
  if (dpo) po.objective.kind = ObjectiveKind::kPreference;
  absl::StatusOr<std::unique_ptr<Pipeline>> p =
      Pipeline::Create(c, store->get(), pool.get(), be->get(), po);
  if (!p.ok()) {
    std::fprintf(stderr, "%s\n", p.status().ToString().c_str());
    return 1;
  }
  HostOptimizerOptions oo;
  oo.max_grad_norm = max_grad_norm;
  oo.compact_held = plan->compact_held;
  oo.weight_decay = 0.01;
  oo.record_spans = true;  // the pieces' rates below, and the timeline's optimizer spans
  HostOptimizer opt(store->get(), pool.get(), be->get(), oo);
  DiscardingSink discard(be->get(), pool.get());
  GradSink* sink = no_optimizer ? static_cast<GradSink*>(&discard) : &opt;
  std::vector<MicroBatch> batches;
  for (int64_t m = 0; m < plan->micro_batches && !dpo; ++m) {
    batches.push_back(Batch(plan->micro_batch_rows, seq, c.vocab_size, m));
  }
  if (dpo) batches = PairBatches(plan->micro_batches, plan->micro_batch_rows, seq, c.vocab_size);

  const double model_flops = plan->step.model_flops, hardware_flops = plan->step.hardware_flops;
  nlohmann::json steps_json = nlohmann::json::array();
  std::vector<double> step_s, compute_s, optimizer_s, pcie_s, head_s, forward_s, backward_s;
  int64_t h2d = 0, d2h = 0;
  std::array<double, kNumStreams> busy_sum{};
  // The optimizer's pieces (host clock), every step's; the first steady step's and the last
  // step's starts on the host.
  std::vector<OptimizerSpan> optimizer_spans;
  std::chrono::steady_clock::time_point steady_start, last_start;
  nlohmann::json last_spans = nlohmann::json::array();  // the last step's stream spans
  for (int64_t s = 0; s < steps; ++s) {
    const auto host_start = std::chrono::steady_clock::now();
    if (s == warmup) steady_start = host_start;
    if (s + 1 == steps) last_start = host_start;
    const double optimizer_before = opt.busy_seconds();
    opt.BeginStep(1e-5, s + 1);
    absl::StatusOr<StepResult> r = (*p)->Step(batches, sink);
    if (!r.ok()) {
      std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      return 1;
    }
    const std::array<double, kNumStreams> busy = StreamBusySeconds(r->timeline);
    const double pcie = std::max({r->h2d_bytes / (1e9 * profile->h2d_gbps),
                                  r->d2h_bytes / (1e9 * profile->d2h_gbps),
                                  (r->h2d_bytes + r->d2h_bytes) / (1e9 * profile->duplex_gbps)});
    // Compute-stream seconds by stage ("fwd", "bwd", "recompute", "head", ...): where the
    // kernel time goes.
    std::map<std::string, double> stage_seconds;
    for (const TimelineSpan& t : r->timeline) {
      if (t.stream != StreamId::kCompute) continue;
      stage_seconds[t.label.substr(0, t.label.find(' '))] += (t.end_ms - t.start_ms) / 1e3;
    }
    steps_json.push_back({{"seconds", r->seconds}, {"loss", r->loss}, {"aux_loss", r->aux_loss},
                          {"compute_busy_seconds", busy[0]},
                          {"compute_seconds_by_stage", stage_seconds}});
    if (s + 1 == steps) {
      for (const TimelineSpan& t : r->timeline) {
        last_spans.push_back({{"stream", static_cast<int>(t.stream)}, {"label", t.label},
                              {"start_ms", t.start_ms}, {"end_ms", t.end_ms}});
      }
    }
    for (OptimizerSpan& o : opt.TakeSpans()) optimizer_spans.push_back(o);
    std::fprintf(stderr, "step %ld: %.3f s, loss %.4f\n", static_cast<long>(s + 1), r->seconds,
                 r->loss);
    if (s >= warmup) {
      step_s.push_back(r->seconds);
      compute_s.push_back(busy[0]);
      pcie_s.push_back(pcie);
      head_s.push_back(stage_seconds["head"]);
      forward_s.push_back(stage_seconds["fwd"]);
      backward_s.push_back(busy[0] - stage_seconds["fwd"] - stage_seconds["head"]);
      // The optimizer's work for this step may finish in the next one: its busy time
      // accrued during this step is what this step cost it.
      optimizer_s.push_back(opt.busy_seconds() - optimizer_before);
      h2d = r->h2d_bytes;
      d2h = r->d2h_bytes;
      for (int i = 0; i < kNumStreams; ++i) busy_sum[i] += busy[i];
    }
  }
  opt.Drain();
  for (OptimizerSpan& o : opt.TakeSpans()) optimizer_spans.push_back(o);
  const nlohmann::json optimizer_pieces = OptimizerPieces(optimizer_spans, steady_start);
  if (!timeline_path.empty()) {
    AddOptimizerSpans(optimizer_spans, last_start, &last_spans);
    std::ofstream(timeline_path) << last_spans.dump(1) << "\n";
  }
  const double step = Median(step_s);
  nlohmann::json eval_json;
  if (eval) {
    absl::StatusOr<nlohmann::json> e = EvalRun(p->get(), &opt, sink, batches, steps + 1, step);
    if (!e.ok()) {
      std::fprintf(stderr, "%s\n", e.status().ToString().c_str());
      return 1;
    }
    eval_json = *std::move(e);
  }
  const double floor_compute = Median(compute_s), floor_pcie = Median(pcie_s);
  const double floor_optimizer = Median(optimizer_s);
  const double floor = std::max({floor_compute, floor_pcie, floor_optimizer});
  const char* measured_bound = floor == floor_compute ? "GPU compute"
                               : floor == floor_pcie  ? "PCIe"
                                                      : "CPU optimizer";
  // The floor of the step's dependencies (exact AdamW on the CPU: one step's gradient of a
  // unit before the next step's forward of it): the ideal schedule of the stages measured
  // (bench/step_schedule.h). With few, large layers it exceeds the three floors: the next
  // forward waits for the bottom layers' updates, and the top layers' wait for the head.
  std::vector<int64_t> unit_elements;
  int64_t total_elements = 0;
  for (const UnitLayout& u : layout.units) {
    unit_elements.push_back(u.num_elements);
    total_elements += u.num_elements;
  }
  StackTimes stage_times;
  // The spans: "fwd" the layers' forward, "head", the rest ("bwd", "recompute") backward;
  // the embedding's gather has no span (a few ms at most).
  stage_times.layers_forward = Median(forward_s);
  stage_times.layers_backward = Median(backward_s);
  stage_times.head = Median(head_s);
  stage_times.optimizer_per_element =
      floor_optimizer / static_cast<double>(std::max<int64_t>(1, total_elements));
  stage_times.download_per_element = 4.0 / (1e9 * profile->d2h_gbps);
  stage_times.upload_per_element = (plan->bf16_copy ? 2.0 : 4.0) / (1e9 * profile->h2d_gbps);
  stage_times.slab_elements = pool->slab_elements();
  StepStages stages = StackStages(unit_elements, stage_times);
  stages.clipping = max_grad_norm > 0;
  stages.slabs = pool->num_slabs();
  stages.device_grad_buffers = Pipeline::kLayerGradBuffers;
  const double floor_schedule = std::max(floor, ScheduleStepSeconds(stages));
  // AdamW's rate in these steps over the profile's, as the planner scales it (its bytes a
  // parameter: the profile's rate moved the bf16 copy's 2 too).
  const double in_step_fraction =
      no_optimizer ? 0.0
                   : profile->AdamWInStepFraction(total_elements, floor_optimizer, moments,
                                                  plan->bf16_copy);
  if (calibrate && in_step_fraction > 0) {
    MachineProfile calibrated = *profile;
    calibrated.adamw_in_step_fraction = std::min(2.0, in_step_fraction);
    const absl::Status saved = WriteProfile(calibrated, profile_file);
    std::fprintf(stderr, "%s\n",
                 saved.ok() ? absl::StrCat("adamw_in_step_fraction ",
                                           calibrated.adamw_in_step_fraction, " written to ",
                                           profile_file).c_str()
                            : saved.ToString().c_str());
    if (!saved.ok()) return 1;
  }
  const int64_t host_bytes = static_cast<int64_t>((*store)->transfer_bytes() +
                                                  (*store)->state_bytes() + pool->bytes()) +
                             plan->host_checkpoint_bytes;
  const double n_steady = std::max<size_t>(1, step_s.size());
  nlohmann::json out = {
      {"benchmark", "train_bench"},
      {"backend", (*be)->name()},
      {"shape", shape},
      {"model", {{"params", NumParameters(c)}, {"matmul_params", MatmulParameters(c)},
                 {"layers", c.num_layers}, {"hidden", c.hidden_size},
                 {"intermediate", c.intermediate_size}, {"heads", c.num_heads},
                 {"kv_heads", c.num_kv_heads}, {"vocab", c.vocab_size},
                 {"experts", c.moe.num_experts}, {"experts_per_token", c.moe.experts_per_token},
                 {"expert_intermediate", c.moe.intermediate_size}}},
      // MoE: matmul_params counts active parameters (the router and the k experts of a
      // token), so model FLOPs are 6 * active * tokens + attention.
      {"model_flops_formula",
       "6 * matmul_params * tokens + 6 * sum over layers of span * heads * head_dim * tokens "
       "(span: seq, or 2 (W - W^2 / (2 seq)) on a layer with a sliding window W < seq)"
       " (matmul_params: active parameters of MoE layers)"},
      {"tokens_per_step", tokens},
      {"seq_len", seq},
      {"lora", {{"rank", lora.rank}, {"alpha", lora.alpha}, {"targets", lora.target_modules},
                {"trained_params", TrainedParameters(layout)}}},
      {"freeze", freeze},
      {"clipping", max_grad_norm > 0},
      {"optimizer", no_optimizer ? "none (gradients discarded)" : "CPU AdamW"},
      {"objective", dpo ? "DPO (sigmoid): a pair of 2 x seq/2 tokens a row" : "next-token"},
      {"optimizer_state_dtype", MomentDTypeName(moments)},
      {"bf16_copy", plan->bf16_copy},
      {"nvme", {{"layers", plan->nvme_layers},
                {"disk_gib", plan->disk_bytes / double(1ll << 30)},
                {"read_gib", (*store)->moment_disk() != nullptr
                                 ? (*store)->moment_disk()->bytes_read() / double(1ll << 30) : 0.0},
                {"written_gib", (*store)->moment_disk() != nullptr
                                    ? (*store)->moment_disk()->bytes_written() / double(1ll << 30)
                                    : 0.0}}},
      {"device_memory_cap_gib", device_gib},
      {"plan", plan_json},
      {"steady_steps", step_s.size()},
      {"step_seconds", step},
      {"tokens_per_second", tokens / step},
      {"model_tflops", model_flops / step / 1e12},
      {"hardware_tflops", hardware_flops / step / 1e12},
      {"gemm_peak_tflops", profile->gemm_peak_tflops},
      {"mfu", model_flops / step / 1e12 / profile->gemm_peak_tflops},
      {"floors_seconds", {{"gpu_kernels", floor_compute}, {"pcie", floor_pcie},
                          {"cpu_optimizer", floor_optimizer}}},
      {"measured_bound", measured_bound},
      // The profile's adamw_in_step_fraction, as this step measured it.
      {"optimizer_in_step_fraction", in_step_fraction},
      {"optimizer_pieces", optimizer_pieces},
      {"step_over_largest_floor", step / floor},
      {"schedule_floor_seconds", floor_schedule},
      {"schedule_floor_formula",
       "the ideal schedule of the measured stages (bench/step_schedule.h): GPU "
       "forward, head, backward (a layer's once the gradient two layers above it has crossed: "
       "two device buffers); each gradient over D2H in slab-sized pieces, each into a free "
       "slab of the step's pool; CPU AdamW lowest unit first at the step's measured rate, "
       "freeing a piece's slab; each update over H2D before the next forward of its unit"},
      {"step_over_schedule_floor", step / floor_schedule},
      {"prediction_error", plan->step.seconds / step - 1.0},
      {"pcie_bytes_per_step", {{"h2d", h2d}, {"d2h", d2h}}},
      {"busy_fraction", {{"compute", busy_sum[0] / n_steady / step},
                         {"h2d", busy_sum[1] / n_steady / step},
                         {"d2h", busy_sum[2] / n_steady / step},
                         {"optimizer", floor_optimizer / step}}},
      {"device_peak_gib", (*be)->device_bytes_peak() / double(1ll << 30)},
      {"host_gib", host_bytes / double(1ll << 30)},
      {"host_bytes_per_param", static_cast<double>(host_bytes) / NumParameters(c)},
      {"steps", steps_json},
  };
  if (eval) out["eval"] = eval_json;
  std::printf("%s\n", out.dump(2).c_str());
  (*p).reset();
  (*be)->UnpinHostRange((*store)->transfer_base());
  (*be)->UnpinHostRange(pool->base());
  return 0;
}
