// Generation throughput (engine/generate/) against its floors measured in the same run:
// the decode step against the HBM floor (the weights and the KV cache read once, at the
// device-to-device copy rate measured here) when the weights are resident, or the PCIe
// floor (every layer's weights over H2D, at the upload rate measured here) when they stream;
// the prefill against the bf16 GEMM rate measured here on the model's own widest matmul.
// Prints one JSON object. Not a test.
//
//   generate_bench --shape qwen2.5-7b --prompts 64 --prompt-len 512 --new 512
//                  [--layers N] [--stream] [--max-sequences B] [--backend cuda|cpu]
//
// The decode step is timed around Generator::Decode with greedy picks made on the device
// (and, reported beside it, with the whole logits brought to the host for sampling there);
// tokens/s end to end goes through Generate() with greedy sampling.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "CLI/CLI.hpp"
#include "bench/shapes.h"
#include "engine/backend/factory.h"
#include "engine/common/engine_settings.h"
#include "engine/generate/generation.h"
#include "engine/plan/measure.h"
#include "engine/plan/planner.h"
#include "engine/store/model_io.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

double Seconds(std::chrono::steady_clock::time_point from) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - from).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Bytes a second of a device-to-device copy of 2 GiB, read plus written: the HBM rate.
double HbmBytesPerSecond(Backend* be) {
  const int64_t bytes = int64_t{1} << 31;
  DeviceBuffer a = std::move(*DeviceBuffer::Allocate(be, bytes));
  DeviceBuffer b = std::move(*DeviceBuffer::Allocate(be, bytes));
  const double s = TimeOnStream(be, StreamId::kCompute, 10, [&] {
    be->CopyOnDevice(b.get(), a.get(), bytes, StreamId::kCompute);
  });
  return 2.0 * bytes / s;
}

// FLOP/s of the model's widest matmul (n tokens through C -> I) on random bf16 values.
double GemmFlops(Backend* be, int64_t n, int64_t in, int64_t out) {
  const DType act = be->act_dtype();
  DeviceBuffer x = std::move(*DeviceBuffer::Allocate(be, n * in * DTypeSize(act)));
  DeviceBuffer w = std::move(*DeviceBuffer::Allocate(be, in * out * DTypeSize(act)));
  DeviceBuffer y = std::move(*DeviceBuffer::Allocate(be, n * out * DTypeSize(act)));
  FillRandom(be, x.get(), n * in, act, 1);
  FillRandom(be, w.get(), in * out, act, 2);
  const double s = TimeOnStreamFor(be, StreamId::kCompute, 5, 1.0, [&] {
    be->Linear(y.get(), x.get(), w.get(), nullptr, n, in, out, false, StreamId::kCompute);
  });
  return 2.0 * n * in * out / s;
}

// Bytes a second of uploading decoder layer 0's pinned bf16 weights: the PCIe H2D rate.
double H2dBytesPerSecond(Backend* be, const HostStore& store) {
  const int64_t unit = store.layout().DecoderUnit(0), n = store.unit_elements(unit);
  DeviceBuffer slot = std::move(*DeviceBuffer::Allocate(be, n * DTypeSize(be->weight_dtype())));
  const double s = TimeOnStream(be, StreamId::kH2D, 10, [&] {
    be->UploadWeights(slot.get(), store.weights(unit), n, StreamId::kH2D);
  });
  return 2.0 * n / s;
}

}  // namespace
}  // namespace megatrain

int main(int argc, char** argv) {
  using namespace megatrain;
  SetEngineSettings(
      EngineSettingsFromEnvironment([](const char* name) { return std::getenv(name); }));
  CLI::App app{"generate_bench: prefill and decode against their floors"};
  std::string backend = "cuda", shape = "qwen2.5-7b";
  int64_t layers = 0, prompts = 64, prompt_len = 512, new_tokens = 512, max_sequences = 0;
  bool stream = false;
  app.add_option("--backend", backend);
  app.add_option("--shape", shape);
  app.add_option("--layers", layers, "override the shape's depth");
  app.add_option("--prompts", prompts);
  app.add_option("--prompt-len", prompt_len);
  app.add_option("--new", new_tokens, "new tokens per prompt");
  app.add_option("--max-sequences", max_sequences, "0 = as many as fit (up to --prompts)");
  app.add_flag("--stream", stream, "stream the layers through two slots");
  CLI11_PARSE(app, argc, argv);

  ModelConfig c;
  if (!NamedShape(shape, &c)) {
    std::fprintf(stderr, "unknown --shape %s\n", shape.c_str());
    return 2;
  }
  if (layers > 0) SetNumLayers(layers, &c);
  absl::StatusOr<std::unique_ptr<Backend>> be = CreateBackend(BackendRequest{backend});
  if (!be.ok()) {
    std::fprintf(stderr, "%s\n", be.status().ToString().c_str());
    return 1;
  }
  StoreOptions so;
  so.weights_only = true;
  std::unique_ptr<HostStore> store = std::move(*HostStore::Create(BuildLayout(c), -1, so));
  RandomInitWeights(c, 1, store.get());
  if (!(*be)->PinHostRange(store->transfer_base(), store->transfer_bytes()).ok()) {
    std::fprintf(stderr, "cannot pin host memory\n");
    return 1;
  }
  const int64_t max_len = prompt_len + new_tokens + 1;
  const int64_t budget = (*be)->device_memory_budget() > 0
                             ? PlannableDeviceBytes((*be)->device_memory_budget()) - (int64_t{5} << 30)
                             : int64_t{1} << 40;
  absl::StatusOr<GeneratorOptions> o =
      PlanGenerator(c, store->layout(), be->get(), budget,
                    max_sequences > 0 ? max_sequences : prompts, max_len, prompts * prompt_len);
  if (!o.ok()) {
    std::fprintf(stderr, "%s\n", o.status().ToString().c_str());
    return 1;
  }
  if (stream) o->weight_slots = 2;
  o->prefill_tokens = std::min(o->prefill_tokens, o->max_sequences * prompt_len);
  absl::StatusOr<std::unique_ptr<Generator>> g = Generator::Create(c, store.get(), be->get(), *o);
  if (!g.ok()) {
    std::fprintf(stderr, "%s\n", g.status().ToString().c_str());
    return 1;
  }
  const int64_t B = o->max_sequences;
  std::mt19937_64 gen(3);
  std::vector<std::vector<int32_t>> batch(B, std::vector<int32_t>(prompt_len));
  for (auto& p : batch) for (int32_t& t : p) t = static_cast<int32_t>(gen() % c.vocab_size);
  std::vector<int32_t> slots(B);
  for (int64_t i = 0; i < B; ++i) slots[i] = static_cast<int32_t>(i);

  // Prefill, then decode steps, timed on the host (each returns with its logits on it).
  std::vector<float> logits;
  (void)(*g)->Prefill(batch, slots, &logits);  // warm-up: uploads the weights once
  auto t0 = std::chrono::steady_clock::now();
  if (!(*g)->Prefill(batch, slots, &logits).ok()) return 1;
  const double prefill_s = Seconds(t0);
  // Greedy decode steps (the device picks: what Generate() runs at temperature 0), and
  // steps that bring the whole logits to the host (what sampling there costs).
  std::vector<double> step_s, logits_step_s;
  std::vector<int32_t> next(B, 1);
  std::vector<SampledToken> picks;
  const int64_t h2d_before = (*g)->h2d_bytes();
  const int64_t timed_steps = std::min<int64_t>(new_tokens, 48);
  for (int64_t s = 0; s < timed_steps; ++s) {
    t0 = std::chrono::steady_clock::now();
    const bool to_host = s % 3 == 2;
    const Generator::Output out = to_host ? Generator::Output{&logits, nullptr}
                                          : Generator::Output{nullptr, &picks};
    if (!(*g)->Decode(next, slots, out).ok()) return 1;
    (to_host ? logits_step_s : step_s).push_back(Seconds(t0));
  }
  const double step = Median(step_s);
  const int64_t h2d_per_step = ((*g)->h2d_bytes() - h2d_before) / std::max<int64_t>(1, timed_steps);

  // End to end: every prompt to new_tokens, greedy.
  std::vector<std::vector<int32_t>> all(prompts, std::vector<int32_t>(prompt_len));
  for (auto& p : all) for (int32_t& t : p) t = static_cast<int32_t>(gen() % c.vocab_size);
  SamplingOptions sampling;
  sampling.max_new_tokens = new_tokens;
  t0 = std::chrono::steady_clock::now();
  absl::StatusOr<std::vector<Completion>> done = Generate(g->get(), nullptr, all, sampling);
  const double generate_s = Seconds(t0);
  if (!done.ok()) {
    std::fprintf(stderr, "%s\n", done.status().ToString().c_str());
    return 1;
  }

  const double hbm = HbmBytesPerSecond(be->get());
  const int64_t widest = std::max(c.intermediate_size, c.moe.intermediate_size);
  const double gemm = GemmFlops(be->get(), 8192, c.hidden_size, 2 * widest);
  const double h2d = H2dBytesPerSecond(be->get(), *store);
  const double weight_bytes = static_cast<double>(store->transfer_bytes());  // bf16, all units
  double layer_bytes = 0;  // what streams: the decoder layers (embedding and head stay)
  for (int64_t l = 0; l < c.num_layers; ++l) {
    layer_bytes += 2.0 * store->unit_elements(store->layout().DecoderUnit(l));
  }
  const double kv_bytes = 2.0 * c.num_layers * B * (prompt_len + 32) * c.num_kv_heads *
                          c.head_dim * 2;  // k and v, bf16, at the timed steps' mean length
  const bool resident = o->weight_slots >= c.num_layers;
  const double decode_floor = resident ? (weight_bytes + kv_bytes) / hbm : layer_bytes / h2d;
  const double prefill_flops = 2.0 * MatmulParameters(c) * B * prompt_len;
  int64_t generated = 0;
  for (const Completion& x : *done) generated += static_cast<int64_t>(x.ids.size());
  const nlohmann::json out = {
      {"benchmark", "generate_bench"},
      {"backend", (*be)->name()},
      {"shape", shape},
      {"layers", c.num_layers},
      {"params", NumParameters(c)},
      {"weights", resident ? "resident" : "streamed"},
      {"sequences_at_once", B},
      {"prompts", prompts},
      {"prompt_len", prompt_len},
      {"new_tokens", new_tokens},
      {"device_bytes", (*g)->device_bytes()},
      {"hbm_bytes_per_second", hbm},
      {"h2d_bytes_per_second", h2d},
      {"gemm_tflops", gemm / 1e12},
      {"prefill_seconds", prefill_s},
      {"prefill_tflops", prefill_flops / prefill_s / 1e12},
      {"prefill_over_gemm_rate", prefill_flops / prefill_s / gemm},
      {"decode_step_seconds", step},
      {"decode_step_with_logits_to_host_seconds", Median(logits_step_s)},
      {"decode_floor_seconds", decode_floor},
      {"decode_h2d_bytes_per_step", h2d_per_step},
      {"decode_floor_formula", resident ? "(bf16 weights + the KV cache) / HBM copy rate"
                                        : "the layers' bf16 weights / PCIe H2D rate measured here"},
      {"decode_step_over_floor", step / decode_floor},
      {"decode_tokens_per_second", B / step},
      {"generate_seconds", generate_s},
      {"generate_tokens_per_second", generated / generate_s},
  };
  std::printf("%s\n", out.dump(2).c_str());
  g->reset();
  (*be)->UnpinHostRange(store->transfer_base());
  return 0;
}
