// The machine's rates, measured now (not from the cache): PCIe each way and both ways at
// once, device memory bandwidth, bf16 matmuls at the 1.5B/7B/8B layer shapes (forward,
// and input + weight gradient), causal attention forward and backward, RMSNorm forward
// and backward, our CPU AdamW and host memory bandwidth. What the planner plans with.
// Prints one JSON object. Not a test.
//
//   machine_bench [--backend cuda|cpu] [--save PATH]   (--save: also write the profile
//                                                      where the planner caches it)
#include <cstdio>
#include <fstream>

#include "CLI/CLI.hpp"
#include "engine/backend/factory.h"
#include "engine/plan/machine_profile.h"
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
  auto time = [&](auto&& f) {
    f();
    Event start(be), end(be);
    be->Record(start.get(), s);
    for (int i = 0; i < 10; ++i) f();
    be->Record(end.get(), s);
    be->EventSync(end.get());
    return be->ElapsedSeconds(start.get(), end.get()) / 10;
  };
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

}  // namespace
}  // namespace megatrain

int main(int argc, char** argv) {
  using namespace megatrain;
  CLI::App app{"machine_bench: the rates the planner plans with, measured now"};
  std::string backend = "auto", save;
  app.add_option("--backend", backend);
  app.add_option("--save", save, "also write the profile here (the planner's cache)");
  CLI11_PARSE(app, argc, argv);
  absl::StatusOr<std::unique_ptr<Backend>> be = CreateBackend(BackendRequest{backend});
  if (!be.ok()) {
    std::fprintf(stderr, "%s\n", be.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<MachineProfile> p = MeasureMachineProfile(be->get());
  if (!p.ok()) {
    std::fprintf(stderr, "%s\n", p.status().ToString().c_str());
    return 1;
  }
  if (!save.empty()) std::ofstream(save) << ProfileToJson(*p) << "\n";
  nlohmann::json out = nlohmann::json::parse(ProfileToJson(*p));
  out["benchmark"] = "machine_bench";
  const bool cpu = (*be)->kind() == BackendKind::kCpu;
  out["rmsnorm"] = nlohmann::json::array(
      {NormRates(be->get(), cpu ? 1024 : 16384, cpu ? 512 : 3584),
       NormRates(be->get(), cpu ? 1024 : 65536, cpu ? 1024 : 4096)});
  out["adamw_bytes_per_second"] = 30.0 * p->adamw_params_per_second;
  out["adamw_fraction_of_host_bandwidth"] = 30.0 * p->adamw_params_per_second / (1e9 * p->host_gbps);
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
