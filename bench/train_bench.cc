// Training-step throughput of the streaming pipeline on one backend, with a CUDA-event
// timeline: how busy each stream is and how much of the transfers hide behind compute.
// Prints one JSON object. Not a test.
//
//   train_bench [--backend cuda] [--hidden 4096] [--intermediate 11008] [--layers 8]
//               [--heads 32] [--kv-heads 8] [--vocab 32000] [--seq 1024] [--rows 4]
//               [--micro-batches 4] [--steps 4] [--k 1] [--peak-tflops 700]
#include <algorithm>
#include <array>
#include <cstdio>
#include <map>
#include <random>

#include "CLI/CLI.hpp"
#include "engine/backend/factory.h"
#include "engine/optim/schedule.h"
#include "engine/pipeline/host_optimizer.h"
#include "engine/pipeline/pipeline.h"
#include "engine/store/model_io.h"
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

// Length of (union of a) intersected with (union of b).
double OverlapMs(const std::vector<std::pair<double, double>>& a,
                 const std::vector<std::pair<double, double>>& b) {
  std::vector<std::pair<double, double>> both = a;
  both.insert(both.end(), b.begin(), b.end());
  return UnionLength(a) + UnionLength(b) - UnionLength(both);
}

}  // namespace
}  // namespace megatrain

int main(int argc, char** argv) {
  using namespace megatrain;
  CLI::App app{"train_bench: streaming-pipeline step throughput and stream timeline"};
  std::string backend = "cuda";
  int64_t hidden = 4096, inter = 11008, layers = 8, heads = 32, kv = 8, vocab = 32000;
  int64_t seq = 1024, rows = 4, mbs = 4, steps = 4, k = 1;
  double peak = 700, max_grad_norm = 1.0;
  app.add_option("--backend", backend);
  app.add_option("--hidden", hidden);
  app.add_option("--intermediate", inter);
  app.add_option("--layers", layers);
  app.add_option("--heads", heads);
  app.add_option("--kv-heads", kv);
  app.add_option("--vocab", vocab);
  app.add_option("--seq", seq);
  app.add_option("--rows", rows);
  app.add_option("--micro-batches", mbs);
  app.add_option("--steps", steps);
  app.add_option("--k", k);
  app.add_option("--peak-tflops", peak, "the device's bf16 matmul rate, for MFU");
  app.add_option("--max-grad-norm", max_grad_norm);
  CLI11_PARSE(app, argc, argv);

  ModelConfig c;
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_layers = layers;
  c.num_heads = heads;
  c.num_kv_heads = kv;
  c.head_dim = hidden / heads;
  c.vocab_size = vocab;
  c.max_position_embeddings = std::max<int64_t>(seq, 4096);
  c.rope_theta = 500000;
  absl::StatusOr<std::unique_ptr<Backend>> be = CreateBackend(BackendRequest{backend});
  if (!be.ok()) {
    std::fprintf(stderr, "%s\n", be.status().ToString().c_str());
    return 1;
  }
  const ModelLayout layout = BuildLayout(c);
  std::unique_ptr<HostStore> store = std::move(*HostStore::Create(layout));
  RandomInitWeights(c, 1, store.get());
  int64_t max_unit = 0;
  for (const UnitLayout& u : layout.units) max_unit = std::max(max_unit, u.num_elements);
  const int64_t slabs = max_grad_norm > 0 ? static_cast<int64_t>(layout.units.size()) : 3;
  std::unique_ptr<GradSlabPool> pool = std::move(*GradSlabPool::Create(slabs, max_unit));
  if (!(*be)->PinHostRange(store->transfer_base(), store->transfer_bytes()).ok() ||
      !(*be)->PinHostRange(pool->base(), pool->bytes()).ok()) {
    std::fprintf(stderr, "cannot pin host memory\n");
    return 1;
  }
  PipelineOptions po;
  po.micro_batches = mbs;
  po.tokens_per_micro_batch = rows * seq;
  po.checkpoint_every = k;
  po.checkpoints_on_host = backend == "cuda";
  po.record_timeline = true;
  absl::StatusOr<std::unique_ptr<Pipeline>> p = Pipeline::Create(c, store.get(), pool.get(), be->get(), po);
  if (!p.ok()) {
    std::fprintf(stderr, "%s\n", p.status().ToString().c_str());
    return 1;
  }
  HostOptimizerOptions oo;
  oo.max_grad_norm = max_grad_norm;
  HostOptimizer opt(store.get(), pool.get(), be->get(), oo);
  std::vector<MicroBatch> batches;
  for (int64_t m = 0; m < mbs; ++m) batches.push_back(Batch(rows, seq, vocab, m));

  const int64_t params = NumParameters(c);
  const int64_t tokens = mbs * rows * seq;
  const double flops = 6.0 * params * tokens + 6.0 * layers * seq * heads * c.head_dim * tokens;
  nlohmann::json steps_json = nlohmann::json::array();
  StepResult last;
  double best = 1e30;
  // Steady state (every step after the first): wall time, per-stream busy time (CUDA
  // events), optimizer thread busy time and PCIe bytes, summed; what the daemon's
  // metrics report as rates.
  double steady_seconds = 0, steady_optimizer = 0;
  int64_t steady_h2d = 0, steady_d2h = 0;
  std::array<double, kNumStreams> steady_busy{};
  for (int64_t s = 0; s < steps; ++s) {
    const double optimizer_before = opt.busy_seconds();
    opt.BeginStep(1e-5, s + 1);
    absl::StatusOr<StepResult> r = (*p)->Step(batches, &opt);
    if (!r.ok()) {
      std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      return 1;
    }
    steps_json.push_back({{"seconds", r->seconds}, {"loss", r->loss}});
    if (s > 0) {
      steady_seconds += r->seconds;
      steady_optimizer += opt.busy_seconds() - optimizer_before;
      steady_h2d += r->h2d_bytes;
      steady_d2h += r->d2h_bytes;
      const std::array<double, kNumStreams> busy = StreamBusySeconds(r->timeline);
      for (int i = 0; i < kNumStreams; ++i) steady_busy[i] += busy[i];
    }
    if (s > 0) best = std::min(best, r->seconds);
    last = *r;
  }
  if (steps == 1) best = last.seconds;

  // The last step's timeline, per stream; "steady" = spans of layers 1 .. L-2.
  std::map<std::string, std::vector<std::pair<double, double>>> by;
  double gpu_end = 0;
  for (const TimelineSpan& t : last.timeline) {
    const char* name = t.stream == StreamId::kCompute ? "compute" : t.stream == StreamId::kH2D ? "h2d" : "d2h";
    by[name].push_back({t.start_ms, t.end_ms});
    gpu_end = std::max(gpu_end, t.end_ms);
  }
  nlohmann::json streams;
  for (auto& [name, v] : by) {
    streams[name] = {{"busy_ms", UnionLength(v)}, {"spans", v.size()}, {"busy_fraction", UnionLength(v) / gpu_end}};
  }
  const double h2d_overlap = by.count("h2d") ? OverlapMs(by["h2d"], by["compute"]) / std::max(1e-9, UnionLength(by["h2d"])) : 0;
  const double d2h_overlap = by.count("d2h") ? OverlapMs(by["d2h"], by["compute"]) / std::max(1e-9, UnionLength(by["d2h"])) : 0;
  nlohmann::json sample = nlohmann::json::array();
  for (const TimelineSpan& t : last.timeline) {
    if (t.label == "fwd 2" || t.label == "fwd 3" || t.label == "h2d w 3" || t.label == "h2d w 4" ||
        t.label == "bwd 3" || t.label == "bwd 2" || t.label == "d2h g 4" || t.label == "d2h g 3" ||
        t.label == "h2d w 1" || t.label == "d2h x 3") {
      sample.push_back({{"label", t.label}, {"start_ms", t.start_ms}, {"end_ms", t.end_ms}});
    }
  }
  nlohmann::json out = {
      {"benchmark", "train_bench"},
      {"backend", (*be)->name()},
      {"model", {{"params", params}, {"layers", layers}, {"hidden", hidden}, {"intermediate", inter},
                 {"heads", heads}, {"kv_heads", kv}, {"vocab", vocab}}},
      {"tokens_per_step", tokens},
      {"micro_batches", mbs},
      {"seq_len", seq},
      {"recompute_every", k},
      {"best_step_seconds", best},
      {"tokens_per_second", tokens / best},
      {"model_tflops", flops / best / 1e12},
      {"mfu", flops / best / 1e12 / peak},
      {"device_peak_gib", (*be)->device_bytes_peak() / double(1ll << 30)},
      {"host_store_gib", (store->transfer_bytes() + store->state_bytes()) / double(1ll << 30)},
      {"gpu_timeline_ms", gpu_end},
      {"streams", streams},
      {"h2d_time_overlapped_with_compute", h2d_overlap},
      {"d2h_time_overlapped_with_compute", d2h_overlap},
      {"timeline_sample", sample},
      {"steady_state",
       {{"steps", steps - 1},
        {"seconds", steady_seconds},
        {"busy_fraction_of_wall",
         {{"compute", steady_busy[0] / std::max(1e-9, steady_seconds)},
          {"h2d", steady_busy[1] / std::max(1e-9, steady_seconds)},
          {"d2h", steady_busy[2] / std::max(1e-9, steady_seconds)},
          {"optimizer", steady_optimizer / std::max(1e-9, steady_seconds)}}},
        {"pcie_bytes_per_second",
         {{"h2d", steady_h2d / std::max(1e-9, steady_seconds)},
          {"d2h", steady_d2h / std::max(1e-9, steady_seconds)}}},
        {"pcie_bytes_per_step", {{"h2d", steady_h2d / std::max<int64_t>(1, steps - 1)},
                                 {"d2h", steady_d2h / std::max<int64_t>(1, steps - 1)}}}}},
      {"steps", steps_json},
  };
  std::printf("%s\n", out.dump(2).c_str());
  (*p).reset();
  (*be)->UnpinHostRange(store->transfer_base());
  (*be)->UnpinHostRange(pool->base());
  return 0;
}
