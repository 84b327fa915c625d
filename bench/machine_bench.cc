// The machine's rates, measured now (not from the cache): PCIe each way and both ways at
// once, device memory bandwidth, bf16 matmuls at the 1.5B/7B/8B layer shapes (forward,
// and input + weight gradient), the experts' grouped matmuls at MoE shapes against the dense
// rate, causal attention forward and backward, RMSNorm forward
// and backward, our CPU AdamW and host memory bandwidth. What the planner plans with.
// Prints one JSON object. Not a test.
//
//   machine_bench [--backend cuda|cpu] [--save PATH]   (--save: also write the profile
//                                                      where the planner caches it)
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <utility>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/algorithm/container.h"
#include "engine/backend/factory.h"
#include "engine/common/engine_settings.h"
#include "engine/kernels/moe_scratch.h"
#include "engine/plan/machine_profile.h"
#include "engine/store/moment_disk.h"
#if MEGATRAIN_BENCH_CUDA_OPS
#include "engine/kernels/cuda/ops.h"
#endif
#include "engine/plan/measure.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

// RMSNorm over (rows, C): forward and backward GB/s (bytes of its inputs and outputs).
nlohmann::json NormRates(Backend* be, int64_t rows, int64_t C) {
  const int64_t a = DTypeSize(be->act_dtype()), st = DTypeSize(be->stat_dtype());
  const int64_t w = DTypeSize(be->weight_dtype()), g = DTypeSize(be->grad_dtype());
  absl::StatusOr<DeviceBuffer> x = DeviceBuffer::Allocate(be, rows * C * a);
  absl::StatusOr<DeviceBuffer> y = DeviceBuffer::Allocate(be, rows * C * a);
  absl::StatusOr<DeviceBuffer> dx = DeviceBuffer::Allocate(be, rows * C * a);
  absl::StatusOr<DeviceBuffer> rstd = DeviceBuffer::Allocate(be, rows * st);
  absl::StatusOr<DeviceBuffer> wt = DeviceBuffer::Allocate(be, C * w);
  absl::StatusOr<DeviceBuffer> dw = DeviceBuffer::Allocate(be, C * g);
  if (!x.ok() || !y.ok() || !dx.ok() || !rstd.ok() || !wt.ok() || !dw.ok()) return nullptr;
  const StreamId s = StreamId::kCompute;
  be->Zero(x->get(), rows * C * a, s);
  be->Zero(y->get(), rows * C * a, s);
  be->Zero(wt->get(), C * w, s);
  be->Zero(dw->get(), C * g, s);
  auto time = [&](auto&& f) { return TimeOnStream(be, s, 10, f); };
  const double fwd = time([&] {
    be->RmsNorm(y->get(), rstd->get(), x->get(), wt->get(), rows, C, 1e-6, s);
  });
  const double bwd = time([&] {
    be->RmsNormBackward(dx->get(), dw->get(), y->get(), x->get(), wt->get(), rstd->get(), rows,
                        C, s);
  });
  return {{"rows", rows}, {"hidden", C},
          {"forward_gbps", 2.0 * rows * C * a / fwd / 1e9},
          {"backward_gbps", 4.0 * rows * C * a / bwd / 1e9},
          {"forward_us", fwd * 1e6}, {"backward_us", bwd * 1e6}};
}

// The experts' grouped matmul (GroupedLinear, forward and input + weight gradient) of E
// experts with `rows` rows each, (rows, IC) -> (rows, OC), against one Linear over the same
// E * rows rows: the MoE layer's GEMMs at its shapes and the dense rate they are held to.
// Timed with the offsets on the host (as the pipeline calls it), and reading them back in
// every call (a wait for the device: `read_back_*`). Inputs are random (FillRandom: matmuls
// run faster on zeros). in_major: the weights are input-major (GPT-OSS's experts).
constexpr double kGroupedHoldSeconds = 0.5;
nlohmann::json GroupedRates(Backend* be, int64_t E, int64_t rows, int64_t IC, int64_t OC,
                            bool in_major) {
  const int64_t R = E * rows, a = DTypeSize(be->act_dtype()), w = DTypeSize(be->weight_dtype());
  const int64_t g = DTypeSize(be->grad_dtype());
  absl::StatusOr<DeviceBuffer> in = DeviceBuffer::Allocate(be, R * IC * a);
  absl::StatusOr<DeviceBuffer> out = DeviceBuffer::Allocate(be, R * OC * a);
  absl::StatusOr<DeviceBuffer> din = DeviceBuffer::Allocate(be, R * IC * a);
  absl::StatusOr<DeviceBuffer> wt = DeviceBuffer::Allocate(be, E * OC * IC * w);
  absl::StatusOr<DeviceBuffer> dw = DeviceBuffer::Allocate(be, E * OC * IC * g);
  absl::StatusOr<DeviceBuffer> offsets = DeviceBuffer::Allocate(be, (E + 1) * 4);
  if (!in.ok() || !out.ok() || !din.ok() || !wt.ok() || !dw.ok() || !offsets.ok()) return nullptr;
  const StreamId s = StreamId::kCompute;
  FillRandom(be, in->get(), R * IC, be->act_dtype(), 1);
  FillRandom(be, out->get(), R * OC, be->act_dtype(), 2);
  FillRandom(be, wt->get(), E * OC * IC, be->weight_dtype(), 3);
  be->Zero(dw->get(), E * OC * IC * g, s);
  std::vector<int32_t> off(E + 1);
  for (int64_t e = 0; e <= E; ++e) off[e] = static_cast<int32_t>(e * rows);
  be->CopyToDevice(offsets->get(), off.data(), off.size() * 4, s);
  be->SyncAll();
  const int32_t* o = static_cast<const int32_t*>(offsets->get());
  // Held, as the profile's dense grid is (measure.h): after the dense forward back to back.
  HoldBusy(be, s, kGroupedHoldSeconds, [&] {
    be->Linear(out->get(), in->get(), wt->get(), nullptr, R, IC, OC, false, s);
  });
  auto time = [&](auto&& f) {
    return TimeOnStreamFor(be, s, 5, MachineProfile::kHeldSampleSeconds, f);
  };
  auto rates = [&](const ExpertOffsets& eo) {
    const double fwd = time([&] {
      be->GroupedLinear(out->get(), in->get(), wt->get(), nullptr, eo, E, IC, OC, in_major, s);
    });
    const double bwd = time([&] {
      be->GroupedLinearBackward(din->get(), dw->get(), nullptr, out->get(), in->get(), wt->get(),
                                eo, E, IC, OC, in_major, s);
    });
    return std::make_pair(fwd, bwd);
  };
  const auto [loop_fwd, loop_bwd] = rates(ExpertOffsets{o, off.data()});
  const auto [read_fwd, read_bwd] = rates(ExpertOffsets{o, nullptr});
  // The dense yardstick: one (R, IC) x (IC, OC) matmul, expert 0's weight for every row.
  const double dense_fwd =
      time([&] { be->Linear(out->get(), in->get(), wt->get(), nullptr, R, IC, OC, false, s); });
  const double dense_bwd = time([&] {
    be->LinearBackward(din->get(), false, dw->get(), nullptr, out->get(), in->get(), wt->get(), R,
                       IC, OC, s);
  });
  const double flops = 2.0 * R * IC * OC;
  return {
      {"experts", E}, {"rows_per_expert", rows}, {"in_features", IC}, {"out_features", OC},
      {"weights_input_major", in_major},
      {"grouped_forward_tflops", flops / loop_fwd / 1e12},
      {"grouped_backward_tflops", 2 * flops / loop_bwd / 1e12},
      {"read_back_forward_tflops", flops / read_fwd / 1e12},
      {"read_back_backward_tflops", 2 * flops / read_bwd / 1e12},
      {"dense_forward_tflops", flops / dense_fwd / 1e12},
      {"dense_backward_tflops", 2 * flops / dense_bwd / 1e12},
      {"grouped_over_dense_forward", dense_fwd / loop_fwd},
      {"grouped_over_dense_backward", dense_bwd / loop_bwd}};
}

// Device buffers that live as long as it does; ok() is false once an allocation failed
// (its pointer is null).
class Buffers {
 public:
  explicit Buffers(Backend* be) : be_(be) {}
  void* Alloc(int64_t bytes) {
    absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(be_, bytes);
    if (!b.ok()) {
      ok_ = false;
      return nullptr;
    }
    keep_.push_back(std::move(*b));
    return keep_.back().get();
  }
  bool ok() const { return ok_; }

 private:
  Backend* be_;
  std::vector<DeviceBuffer> keep_;
  bool ok_ = true;
};

// The MoE layer's kernels other than the expert GEMMs, over n tokens routed top-k of E
// (hidden C, expert width I), each timed alone with random logits (about uniform routing):
// microseconds per call, and the bytes of act rows each moves over the time (GB/s).
nlohmann::json RoutingKernelTimes(Backend* be, int64_t n, int64_t E, int64_t k, int64_t C,
                                  int64_t I) {
  const int64_t R = n * k, a = DTypeSize(be->act_dtype()), st = DTypeSize(be->stat_dtype());
  Buffers buffers(be);
  auto alloc = [&](int64_t bytes) { return buffers.Alloc(bytes); };
  void* logits = alloc(n * E * a);
  void* probs = alloc(n * E * st);
  auto* idx = static_cast<int32_t*>(alloc(R * 4));
  void* w = alloc(R * st);
  void* dw = alloc(R * st);
  auto* offsets = static_cast<int32_t*>(alloc((E + 1) * 4));
  auto* slot_of = static_cast<int32_t*>(alloc(R * 4));
  auto* row_token = static_cast<int32_t*>(alloc(R * 4));
  auto* scratch = static_cast<int32_t*>(alloc(MoeSortScratchInts(R, E) * 4));
  void* h = alloc(n * C * a);
  void* out = alloc(n * C * a);
  void* xe = alloc(R * C * a);
  void* ye = alloc(R * C * a);
  void* gu = alloc(R * 2 * I * a);
  void* act = alloc(R * I * a);
  void* dgu = alloc(R * 2 * I * a);
  void* dlogits = alloc(n * E * a);
  if (!buffers.ok()) return nullptr;
  const StreamId s = StreamId::kCompute;
  FillRandom(be, logits, n * E, be->act_dtype(), 4);
  FillRandom(be, h, n * C, be->act_dtype(), 5);
  FillRandom(be, ye, R * C, be->act_dtype(), 6);
  FillRandom(be, gu, R * 2 * I, be->act_dtype(), 7);
  FillRandom(be, out, n * C, be->act_dtype(), 8);
  be->MoeRoute(probs, idx, w, logits, n, E, k, true, s);
  be->MoeSort(offsets, slot_of, row_token, scratch, idx, n, E, k, s);
  be->Zero(dw, R * st, s);
  be->SyncAll();
  auto time = [&](auto&& f) { return TimeOnStream(be, s, 10, f); };
  nlohmann::json kernels = nlohmann::json::object();
  double total = 0;
  auto add = [&](const char* name, double seconds, double act_elements) {
    kernels[name] = {{"us", seconds * 1e6}, {"gbps", act_elements * a / seconds / 1e9}};
    total += seconds;
  };
  add("route", time([&] { be->MoeRoute(probs, idx, w, logits, n, E, k, true, s); }), n * E);
  add("sort", time([&] { be->MoeSort(offsets, slot_of, row_token, scratch, idx, n, E, k, s); }),
      R * 3.0 * 4 / a);
  add("gather", time([&] { be->Embedding(xe, row_token, h, R, C, s); }), 2.0 * R * C);
  add("swiglu", time([&] { be->SwiGlu(act, gu, R, I, s); }), 3.0 * R * I);
  add("combine", time([&] { be->MoeCombine(out, ye, slot_of, w, n, k, C, s); }),
      R * C + 2.0 * n * C);
  add("combine_backward",
      time([&] { be->MoeCombineBackward(xe, dw, out, ye, slot_of, w, n, k, C, s); }),
      2.0 * R * C + n * C);
  add("swiglu_backward", time([&] { be->SwiGluBackward(dgu, act, gu, R, I, s); }), 5.0 * R * I);
  add("gather_backward", time([&] { be->MoeGatherBackward(out, xe, slot_of, n, k, C, s); }),
      R * C + 1.0 * n * C);
  add("route_backward", time([&] {
        be->MoeRouteBackward(dlogits, probs, idx, w, dw, nullptr, 0.0, n, E, k, true, s);
      }),
      2.0 * n * E);
  return {{"tokens", n}, {"experts", E}, {"top_k", k}, {"hidden", C}, {"expert_intermediate", I},
          {"kernels", kernels}, {"total_us", total * 1e6}};
}

// Causal attention over documents of `len` tokens, n tokens in all (H query heads, KV kv
// heads, head_dim D), forward and backward, on whichever kernels the backend picks (the
// caller sets EngineSettings::attention to choose: hopper or mma). FLOPs as the issue counts them:
// 2 * 2 * len^2 * D * H / 2 per document forward, 2.5x that backward. Twice: a few calls
// as they come (forward_tflops, as kernels' rates are published), then held (held_*: after
// kHoldSeconds of the same calls back to back, over at least kHeldSampleSeconds, at the
// clock a training step holds the device at; the profile's samples).
constexpr double kHoldSeconds = 1.0;
nlohmann::json AttentionRates(Backend* be, int64_t n, int64_t len, int64_t H, int64_t KV,
                              int64_t D) {
  const int64_t a = DTypeSize(be->act_dtype()), st = DTypeSize(be->stat_dtype());
  Buffers buffers(be);
  auto alloc = [&](int64_t bytes) { return buffers.Alloc(bytes); };
  void* q = alloc(n * H * D * a);
  void* k = alloc(n * KV * D * a);
  void* v = alloc(n * KV * D * a);
  void* o = alloc(n * H * D * a);
  void* dout = alloc(n * H * D * a);
  void* dq = alloc(n * H * D * a);
  void* dk = alloc(n * KV * D * a);
  void* dv = alloc(n * KV * D * a);
  void* lse = alloc(n * H * st);
  auto* doc = static_cast<int32_t*>(alloc(n * 4));
  if (!buffers.ok()) return nullptr;
  const StreamId s = StreamId::kCompute;
  FillRandom(be, q, n * H * D, be->act_dtype(), 4);
  FillRandom(be, k, n * KV * D, be->act_dtype(), 5);
  FillRandom(be, v, n * KV * D, be->act_dtype(), 6);
  FillRandom(be, dout, n * H * D, be->act_dtype(), 7);
  std::vector<int32_t> starts(n);
  for (int64_t i = 0; i < n; ++i) starts[i] = static_cast<int32_t>(i / len * len);
  be->CopyToDevice(doc, starts.data(), n * 4, s);
  be->SyncAll();
  const int reps = len >= 65536 ? 3 : 10;
  auto forward = [&] { be->Attention(o, lse, q, k, v, doc, nullptr, 0, n, H, KV, D, s); };
  auto backward = [&] {
    be->AttentionBackward(dq, dk, dv, nullptr, dout, q, k, v, o, lse, doc, nullptr, 0, n, H, KV,
                          D, s);
  };
  const double fwd = TimeOnStream(be, s, reps, forward);
  const double bwd = TimeOnStream(be, s, reps, backward);
  HoldBusy(be, s, kHoldSeconds, forward);
  const double held_fwd =
      TimeOnStreamFor(be, s, 3, MachineProfile::kHeldSampleSeconds, forward);
  HoldBusy(be, s, kHoldSeconds, backward);
  const double held_bwd =
      TimeOnStreamFor(be, s, 3, MachineProfile::kHeldSampleSeconds, backward);
  const double flops = 2.0 * n * len * H * D;
  return {{"tokens", n},
          {"seq_len", len},
          {"heads", H},
          {"kv_heads", KV},
          {"head_dim", D},
          {"forward_ms", fwd * 1e3},
          {"backward_ms", bwd * 1e3},
          {"forward_tflops", flops / fwd / 1e12},
          {"backward_tflops", 2.5 * flops / bwd / 1e12},
          {"held_seconds", kHoldSeconds},
          {"held_forward_tflops", flops / held_fwd / 1e12},
          {"held_backward_tflops", 2.5 * flops / held_bwd / 1e12}};
}

// Attention kernels at 4K, 8K, 32K and 128K, head_dim 128 (Llama/Qwen: 32 heads, 8 kv) and 64
// (GPT-OSS: 64 heads, 8 kv), 128K tokens each: the Hopper kernels where the device has them,
// and attention.cu's mma kernels (the engine's settings pick: Hopper's by default on sm_90,
// MEGATRAIN_ATTENTION=mma declines them). `profile_samples`, unless null, gets the rates of
// the kernels this environment trains with, so that long sequences and head_dim 64
// (GPT-OSS) plan at theirs.
struct AttentionChoice {  // which of the rates to measure (all by default)
  std::vector<std::string> kernels = {"hopper", "mma"};
  std::vector<int64_t> lengths = {4096, 8192, 32768, 131072};
  std::vector<int64_t> head_dims = {128, 64};
};

// Each kernel choice is set in the engine's settings while it is measured (one thread
// launches every kernel here), and main's settings are put back after.
nlohmann::json AttentionKernelRates(Backend* be, const AttentionChoice& choice,
                                    std::vector<AttentionSample>* profile_samples) {
  nlohmann::json attention = nlohmann::json::array();
  const EngineSettings saved = GetEngineSettings();
  EngineSettings trying = saved;
  trying.attention = AttentionKernels{};  // the Hopper kernels where they apply
  SetEngineSettings(trying);
#if MEGATRAIN_BENCH_CUDA_OPS
  const bool hopper = cuda::HopperAttentionApplies(128);
#else
  const bool hopper = false;
#endif
  const bool trains_on_hopper = saved.attention.hopper && hopper;
  for (const std::string& kernels : choice.kernels) {
    // hopper-fused: the Hopper kernels with the one-pass backward (opt-in, ops.h).
    const bool fused = kernels == "hopper-fused";
    if ((kernels == "hopper" || fused) && !hopper) continue;
    trying.attention.hopper = kernels != "mma";
    trying.attention.fused_backward_kv_heads = fused ? 0 : -1;
    SetEngineSettings(trying);
    for (const auto& [H, KV, D] :
         {std::array<int64_t, 3>{32, 8, 128}, std::array<int64_t, 3>{64, 8, 64}}) {
      if (absl::c_find(choice.head_dims, D) == choice.head_dims.end()) continue;
      for (int64_t len : choice.lengths) {
        nlohmann::json r = AttentionRates(be, 131072, len, H, KV, D);
        if (r.is_null()) continue;
        r["kernels"] = kernels;
        attention.push_back(r);
        if (profile_samples != nullptr && !fused && (kernels == "hopper") == trains_on_hopper) {
          profile_samples->push_back(AttentionSample{len, r["held_forward_tflops"].get<double>(),
                                                     r["held_backward_tflops"].get<double>(),
                                                     D});
        }
      }
    }
  }
  SetEngineSettings(saved);
  return attention;
}

constexpr const char* kAttentionFlops =
    "forward 2 * 2 * seq_len^2 * head_dim * heads / 2 per sequence (causal); backward 2.5x the "
    "forward";

// The NVMe tier's rate in `dir`: `units` blocks of 256 MiB cycled as the optimizer cycles
// them (prefetch the next, acquire, write back), twice; GB/s each way, reads and writes
// running together.
nlohmann::json DiskRates(const std::string& dir, int units) {
  constexpr int64_t kBlock = int64_t{256} << 20;
  std::vector<int64_t> ids(units);
  for (int i = 0; i < units; ++i) ids[i] = i;
  absl::StatusOr<std::unique_ptr<MomentDisk>> disk =
      MomentDisk::Create(dir, ids, std::vector<int64_t>(units, kBlock), 3);
  if (!disk.ok()) return {{"error", std::string(disk.status().message())}};
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0; round < 2; ++round) {
    for (int u = units - 1; u >= 0; --u) {
      if (u > 0) (*disk)->Prefetch(u - 1);
      absl::StatusOr<char*> block = (*disk)->Acquire(u);
      if (!block.ok()) return {{"error", std::string(block.status().message())}};
      (*disk)->Updated(u, 1, 1);
    }
  }
  if (absl::Status s = (*disk)->Flush(); !s.ok()) return {{"error", std::string(s.message())}};
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double read = static_cast<double>((*disk)->bytes_read());
  const double written = static_cast<double>((*disk)->bytes_written());
  return {{"dir", dir}, {"bytes_read", read}, {"bytes_written", written}, {"seconds", seconds},
          {"gbps_each_way", std::min(read, written) / seconds / 1e9},
          {"read_gbps", read / seconds / 1e9}, {"write_gbps", written / seconds / 1e9}};
}

}  // namespace
}  // namespace megatrain

int main(int argc, char** argv) {
  using namespace megatrain;
  SetEngineSettings(
      EngineSettingsFromEnvironment([](const char* name) { return std::getenv(name); }));
  CLI::App app{"machine_bench: the rates the planner plans with, measured now"};
  std::string backend = "auto", save, nvme_dir;
  app.add_option("--backend", backend);
  app.add_option("--nvme-dir", nvme_dir,
                 "also measure the NVMe tier's disk here (4 GiB of scratch, removed after)");
  app.add_option("--save", save, "also write the profile here (the planner's cache)");
  bool attention_only = false;
  app.add_flag("--attention-only", attention_only,
               "only the attention kernels' rates (a quick check of a kernel change)");
  AttentionChoice attention_choice;
  app.add_option("--attention-kernels", attention_choice.kernels,
                 "hopper, mma (default both), hopper-fused (the one-pass backward)")
      ->check(CLI::IsMember({"hopper", "mma", "hopper-fused"}));
  app.add_option("--attention-lengths", attention_choice.lengths,
                 "sequence lengths (default 4096 8192 32768 131072)");
  app.add_option("--attention-head-dims", attention_choice.head_dims, "128, 64 (default both)")
      ->check(CLI::IsMember({128, 64}));
  CLI11_PARSE(app, argc, argv);
  absl::StatusOr<std::unique_ptr<Backend>> be = CreateBackend(BackendRequest{backend});
  if (!be.ok()) {
    std::fprintf(stderr, "%s\n", be.status().ToString().c_str());
    return 1;
  }
  if (attention_only) {
    if ((*be)->kind() == BackendKind::kCpu) {
      std::fprintf(stderr, "machine_bench: --attention-only measures a GPU's kernels\n");
      return 1;
    }
    const nlohmann::json out = {
        {"benchmark", "machine_bench"},
        {"attention_kernels", AttentionKernelRates(be->get(), attention_choice, nullptr)},
        {"attention_flops", kAttentionFlops}};
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  absl::StatusOr<MachineProfile> p = MeasureMachineProfile(be->get());
  if (!p.ok()) {
    std::fprintf(stderr, "%s\n", p.status().ToString().c_str());
    return 1;
  }
  nlohmann::json disk = nullptr;
  if (!nvme_dir.empty()) {
    disk = DiskRates(nvme_dir, 8);
    if (disk.contains("gbps_each_way")) p->nvme_gbps = disk["gbps_each_way"].get<double>();
  }
  nlohmann::json out = nlohmann::json::parse(ProfileToJson(*p));
  out["benchmark"] = "machine_bench";
  if (!disk.is_null()) out["nvme"] = disk;
  const bool cpu = (*be)->kind() == BackendKind::kCpu;
  out["rmsnorm"] = nlohmann::json::array(
      {NormRates(be->get(), cpu ? 1024 : 16384, cpu ? 512 : 3584),
       NormRates(be->get(), cpu ? 1024 : 65536, cpu ? 1024 : 4096)});
  if (!cpu) {
    // MoE shapes: Qwen3-30B-A3B's experts (128, top-8, C 2048, I 768) at 16K, 64K and 256K
    // tokens per micro-batch, Mixtral-8x7B's (8, top-2, C 4096, I 14336) at 8K (a micro-batch
    // of 2 sequences of 4K) and 64K, GPT-OSS-120B's (128, top-4, C 2880, I 2880, input-major)
    // at 64K and 256K: gate|up, then down.
    nlohmann::json grouped = nlohmann::json::array();
    for (const auto& [E, rows, C, I, in_major] :
         {std::array<int64_t, 5>{128, 1024, 2048, 768, 0},
          std::array<int64_t, 5>{128, 4096, 2048, 768, 0},
          std::array<int64_t, 5>{128, 16384, 2048, 768, 0},
          std::array<int64_t, 5>{8, 2048, 4096, 14336, 0},
          std::array<int64_t, 5>{8, 16384, 4096, 14336, 0},
          std::array<int64_t, 5>{128, 2048, 2880, 2880, 1},
          std::array<int64_t, 5>{128, 8192, 2880, 2880, 1}}) {
      for (const auto& [in, out_features] : {std::pair{C, 2 * I}, std::pair{I, C}}) {
        nlohmann::json g = GroupedRates(be->get(), E, rows, in, out_features, in_major != 0);
        if (!g.is_null()) {  // also into the profile: the planner's rates for experts' GEMMs
          p->grouped_gemm.push_back(GroupedGemmSample{
              E, rows, in, out_features, g["grouped_forward_tflops"].get<double>(),
              g["grouped_backward_tflops"].get<double>()});
        }
        grouped.push_back(g);
      }
    }
    out["grouped_gemm"] = grouped;
    // The routing kernels at Qwen3-30B-A3B's, GPT-OSS-120B's and Mixtral-8x7B's shapes over
    // a 64K-token micro-batch.
    out["moe_routing"] = nlohmann::json::array(
        {RoutingKernelTimes(be->get(), 65536, 128, 8, 2048, 768),
         RoutingKernelTimes(be->get(), 65536, 128, 4, 2880, 2880),
         RoutingKernelTimes(be->get(), 65536, 8, 2, 4096, 14336)});
  }
  if (!cpu) {
    std::vector<AttentionSample> profile_samples;
    out["attention_kernels"] =
        AttentionKernelRates(be->get(), AttentionChoice{}, &profile_samples);
    p->AddAttentionSamples(profile_samples);
    out["attention_flops"] = kAttentionFlops;
  }
  out["adamw_bytes_per_second"] = 30.0 * p->adamw_params_per_second;
  out["adamw_fraction_of_host_bandwidth"] = 30.0 * p->adamw_params_per_second / (1e9 * p->host_gbps);
  if (!save.empty()) std::ofstream(save) << ProfileToJson(*p) << "\n";
  out["grouped_gemm_samples_in_profile"] = p->grouped_gemm.size();
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
