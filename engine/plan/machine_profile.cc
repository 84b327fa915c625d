#include "engine/plan/machine_profile.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/backend/devices.h"
#include "engine/backend/factory.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"
#include "engine/optim/adamw.h"
#include "engine/plan/measure.h"
#include "engine/store/host_store.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

constexpr double kGB = 1e9;

template <typename F>
double TimeOnHost(int reps, F&& work) {
  work();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) work();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
}

// a += s * b over two arrays, all threads: 3 x 4 bytes per element (read a and b, write
// a). In place, as AdamW updates its arrays, so no write-allocate traffic goes uncounted.
double HostBandwidthGbps(int64_t n, int reps) {
  std::vector<float> a(n, 1.0f), b(n, 2.0f);
  float* pa = a.data();
  const float* pb = b.data();
  const double seconds = TimeOnHost(reps, [&] {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) pa[i] += 1e-3f * pb[i];
  });
  return 3.0 * 4 * n / seconds / kGB;
}

double AdamWParamsPerSecond(int64_t n, int reps) {
  std::vector<float> master(n, 0.5f), m(n, 0.0f), v(n, 0.0f), grad(n, 1e-3f);
  std::vector<uint16_t> out(n);
  int64_t step = 1;
  const double seconds = TimeOnHost(reps, [&] {
    AdamWUpdate(master.data(), m.data(), v.data(), out.data(), grad.data(), n, step++, 1e-4,
                0.01, 1.0f, AdamWHyper{});
  });
  return n / seconds;
}

// The same over bf16 or int8 moments (AdamWUpdateQuantized, one unit of n elements).
double QuantizedAdamWParamsPerSecond(MomentDType dtype, int64_t n, int reps) {
  const int64_t blocks = (n + kMomentBlock - 1) / kMomentBlock;
  const int64_t size = dtype == MomentDType::kBF16 ? 2 : 1;
  std::vector<float> master(n, 0.5f), grad(n, 1e-3f), m_scales(blocks, 0.0f), v_scales(blocks, 0.0f);
  std::vector<char> m(n * size, 0), v(n * size, 0);
  std::vector<uint16_t> out(n);
  UnitMoments moments{dtype, m.data(), v.data(), m_scales.data(), v_scales.data()};
  const std::vector<ElementRange> tensors = {ElementRange{0, n, true}};
  int64_t step = 1;
  const double seconds = TimeOnHost(reps, [&] {
    AdamWUpdateQuantized(master.data(), moments, out.data(), grad.data(), 0, n, n, tensors, step,
                         1e-4, 0.01, 1.0f, AdamWHyper{}, MomentRoundingKey(0, step));
    ++step;
  });
  return n / seconds;
}

double Lerp(double x0, double y0, double x1, double y1, double x) {
  if (x1 == x0) return y0;
  const double t = (x - x0) / (x1 - x0);
  return y0 + t * (y1 - y0);
}

// Interpolates (log rows) between samples sorted by rows; below the smallest, the rate
// falls in proportion (small matmuls are latency bound); above the largest, it holds.
double InterpolateRows(const std::vector<std::pair<int64_t, double>>& by_rows, int64_t rows) {
  if (by_rows.empty()) return 0;
  if (rows <= by_rows.front().first) {
    return by_rows.front().second * static_cast<double>(rows) / by_rows.front().first;
  }
  for (size_t i = 1; i < by_rows.size(); ++i) {
    if (rows <= by_rows[i].first) {
      return Lerp(std::log(by_rows[i - 1].first), by_rows[i - 1].second,
                  std::log(by_rows[i].first), by_rows[i].second, std::log(rows));
    }
  }
  return by_rows.back().second;
}

std::string NowRfc3339() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

int64_t HostMemoryBytes() {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
}

int CpuThreads() {
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

int64_t DeviceMemoryBytes(Backend* backend) {
  if (backend->kind() == BackendKind::kCpu) return 0;
  for (const GpuInfo& g : ListGpus()) return g.memory_bytes;  // the backend uses device 0
  return 0;
}

}  // namespace

void FillRandom(Backend* be, void* dst, int64_t n, DType dtype, uint64_t seed) {
  const int64_t esize = DTypeSize(dtype);
  const int64_t pattern_n = std::min<int64_t>(n, (4 << 20) / esize);
  std::vector<char> host(pattern_n * esize);
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int64_t i = 0; i < pattern_n; ++i) {
    const float f = u(gen);
    char* p = host.data() + i * esize;
    if (dtype == DType::kBF16) {
      const uint16_t h = FloatToBf16(f);
      std::memcpy(p, &h, 2);
    } else if (dtype == DType::kF64) {
      const double d = f;
      std::memcpy(p, &d, 8);
    } else {
      std::memcpy(p, &f, 4);
    }
  }
  for (int64_t done = 0; done < n; done += pattern_n) {
    const int64_t count = std::min(pattern_n, n - done);
    be->CopyToDevice(static_cast<char*>(dst) + done * esize, host.data(), count * esize,
                     StreamId::kH2D);
    be->SyncAll();  // `host` is reused
  }
}


double MachineProfile::GemmTflops(int64_t rows, int64_t in_features, int64_t out_features,
                                  bool backward) const {
  if (gemm.empty()) return 0;
  double best = 1e300;
  int64_t ic = 0, oc = 0;
  for (const GemmSample& g : gemm) {
    const double d = std::fabs(std::log(double(g.in_features) / in_features)) +
                     std::fabs(std::log(double(g.out_features) / out_features));
    if (d < best) {
      best = d;
      ic = g.in_features;
      oc = g.out_features;
    }
  }
  std::vector<std::pair<int64_t, double>> by_rows;
  for (const GemmSample& g : gemm) {
    if (g.in_features == ic && g.out_features == oc) {
      by_rows.emplace_back(g.rows, backward ? g.backward_tflops : g.forward_tflops);
    }
  }
  std::sort(by_rows.begin(), by_rows.end());
  return InterpolateRows(by_rows, rows);
}

double MachineProfile::GroupedGemmTflops(int64_t rows_per_expert, int64_t in_features,
                                         int64_t out_features, bool backward) const {
  const double kNear = std::log(1.5);  // each dimension within 1.5x
  double best = 1e300;
  const GroupedGemmSample* nearest = nullptr;
  for (const GroupedGemmSample& g : grouped_gemm) {
    const double di = std::fabs(std::log(double(g.in_features) / in_features));
    const double d_o = std::fabs(std::log(double(g.out_features) / out_features));
    if (di <= kNear && d_o <= kNear && di + d_o < best) {
      best = di + d_o;
      nearest = &g;
    }
  }
  if (nearest == nullptr) return GemmTflops(rows_per_expert, in_features, out_features, backward);
  std::vector<std::pair<int64_t, double>> by_rows;
  for (const GroupedGemmSample& g : grouped_gemm) {
    if (g.in_features == nearest->in_features && g.out_features == nearest->out_features) {
      by_rows.emplace_back(g.rows_per_expert, backward ? g.backward_tflops : g.forward_tflops);
    }
  }
  std::sort(by_rows.begin(), by_rows.end());
  const int64_t fewest = by_rows.front().first;
  if (rows_per_expert < fewest) {
    // Fewer rows than measured: InterpolateRows would scale the rate down with the rows
    // (the dense grid's rule below its smallest sample, a few thousand rows), which at one
    // sample of 16K rows (Mixtral's) makes 2K rows 8x slower. The dense rate at these rows
    // instead, times grouped over dense at the fewest rows measured.
    const double dense_there = GemmTflops(fewest, in_features, out_features, backward);
    const double ratio = dense_there > 0 ? by_rows.front().second / dense_there : 1.0;
    return ratio * GemmTflops(rows_per_expert, in_features, out_features, backward);
  }
  return InterpolateRows(by_rows, rows_per_expert);
}

void MachineProfile::AddAttentionSamples(const std::vector<AttentionSample>& samples) {
  for (const AttentionSample& a : samples) {
    auto same = std::find_if(attention.begin(), attention.end(), [&](const AttentionSample& b) {
      return b.seq_len == a.seq_len && b.head_dim == a.head_dim;
    });
    if (same != attention.end()) {
      *same = a;
    } else {
      attention.push_back(a);
    }
  }
  std::sort(attention.begin(), attention.end(),
            [](const AttentionSample& x, const AttentionSample& y) {
              return std::pair(x.head_dim, x.seq_len) < std::pair(y.head_dim, y.seq_len);
            });
}

double MachineProfile::AttentionTflops(int64_t seq_len, bool backward, int64_t head_dim) const {
  // The measured head_dim nearest in ratio (of two as near, the first listed).
  int64_t nearest = 0;
  double best = std::numeric_limits<double>::infinity();
  for (const AttentionSample& a : attention) {
    const double off = std::abs(std::log(static_cast<double>(std::max<int64_t>(1, a.head_dim)) /
                                         static_cast<double>(std::max<int64_t>(1, head_dim))));
    if (off < best - 1e-12) {
      best = off;
      nearest = a.head_dim;
    }
  }
  std::vector<std::pair<int64_t, double>> by_len;
  for (const AttentionSample& a : attention) {
    if (a.head_dim != nearest) continue;
    by_len.emplace_back(a.seq_len, backward ? a.backward_tflops : a.forward_tflops);
  }
  std::sort(by_len.begin(), by_len.end());
  return InterpolateRows(by_len, seq_len);
}

std::string ProfileToJson(const MachineProfile& p) {
  nlohmann::json gemm = nlohmann::json::array(), attention = nlohmann::json::array();
  nlohmann::json grouped = nlohmann::json::array();
  for (const GemmSample& g : p.gemm) {
    gemm.push_back({{"rows", g.rows}, {"in_features", g.in_features},
                    {"out_features", g.out_features}, {"forward_tflops", g.forward_tflops},
                    {"backward_tflops", g.backward_tflops}});
  }
  for (const GroupedGemmSample& g : p.grouped_gemm) {
    grouped.push_back({{"experts", g.experts}, {"rows_per_expert", g.rows_per_expert},
                       {"in_features", g.in_features}, {"out_features", g.out_features},
                       {"forward_tflops", g.forward_tflops},
                       {"backward_tflops", g.backward_tflops}});
  }
  for (const AttentionSample& a : p.attention) {
    attention.push_back({{"seq_len", a.seq_len}, {"head_dim", a.head_dim},
                         {"forward_tflops", a.forward_tflops},
                         {"backward_tflops", a.backward_tflops}});
  }
  nlohmann::json j = {{"version", p.version},
                      {"key", p.key},
                      {"backend", p.backend},
                      {"measured_at", p.measured_at},
                      {"measure_seconds", p.measure_seconds},
                      {"h2d_gbps", p.h2d_gbps},
                      {"d2h_gbps", p.d2h_gbps},
                      {"duplex_gbps", p.duplex_gbps},
                      {"device_gbps", p.device_gbps},
                      {"gemm_peak_tflops", p.gemm_peak_tflops},
                      {"held_seconds", p.held_seconds},
                      {"gemm", gemm},
                      {"grouped_gemm", grouped},
                      {"attention", attention},
                      {"adamw_params_per_second", p.adamw_params_per_second},
                      {"adamw_bf16_params_per_second", p.adamw_bf16_params_per_second},
                      {"adamw_int8_params_per_second", p.adamw_int8_params_per_second},
                      {"adamw_in_step_fraction", p.adamw_in_step_fraction},
                      {"nvme_gbps", p.nvme_gbps},
                      {"host_gbps", p.host_gbps},
                      {"device_memory_bytes", p.device_memory_bytes},
                      {"host_memory_bytes", p.host_memory_bytes},
                      {"cpu_threads", p.cpu_threads}};
  return j.dump(2);
}

absl::StatusOr<MachineProfile> ProfileFromJson(const std::string& text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("machine profile: not a JSON object");
  }
  MachineProfile p;
  try {
    p.version = j.at("version").get<int>();
    if (p.version != MachineProfile::kVersion) {
      return absl::FailedPreconditionError(absl::StrCat(
          "machine profile: format version ", p.version, ", this build writes ",
          MachineProfile::kVersion));
    }
    p.key = j.at("key").get<std::string>();
    p.backend = j.at("backend").get<std::string>();
    p.measured_at = j.at("measured_at").get<std::string>();
    p.measure_seconds = j.at("measure_seconds").get<double>();
    p.h2d_gbps = j.at("h2d_gbps").get<double>();
    p.d2h_gbps = j.at("d2h_gbps").get<double>();
    p.duplex_gbps = j.at("duplex_gbps").get<double>();
    p.device_gbps = j.at("device_gbps").get<double>();
    p.gemm_peak_tflops = j.at("gemm_peak_tflops").get<double>();
    p.held_seconds = j.value("held_seconds", 0.0);  // earlier profiles: bursts
    for (const nlohmann::json& g : j.at("gemm")) {
      p.gemm.push_back(GemmSample{g.at("rows").get<int64_t>(), g.at("in_features").get<int64_t>(),
                                  g.at("out_features").get<int64_t>(),
                                  g.at("forward_tflops").get<double>(),
                                  g.at("backward_tflops").get<double>()});
    }
    // Profiles saved before the grouped samples existed, or measured without machine_bench,
    // have none.
    for (const nlohmann::json& g : j.value("grouped_gemm", nlohmann::json::array())) {
      p.grouped_gemm.push_back(GroupedGemmSample{
          g.at("experts").get<int64_t>(), g.at("rows_per_expert").get<int64_t>(),
          g.at("in_features").get<int64_t>(), g.at("out_features").get<int64_t>(),
          g.at("forward_tflops").get<double>(), g.at("backward_tflops").get<double>()});
    }
    for (const nlohmann::json& a : j.at("attention")) {
      // Profiles saved before the head size was recorded measured head_dim 128.
      p.attention.push_back(AttentionSample{
          a.at("seq_len").get<int64_t>(), a.at("forward_tflops").get<double>(),
          a.at("backward_tflops").get<double>(), a.value("head_dim", int64_t{128})});
    }
    p.adamw_params_per_second = j.at("adamw_params_per_second").get<double>();
    // Profiles measured before the quantized moments existed have neither.
    p.adamw_bf16_params_per_second = j.value("adamw_bf16_params_per_second", 0.0);
    p.adamw_int8_params_per_second = j.value("adamw_int8_params_per_second", 0.0);
    p.adamw_in_step_fraction =
        j.value("adamw_in_step_fraction", MachineProfile::kDefaultAdamWInStepFraction);
    p.nvme_gbps = j.value("nvme_gbps", 0.0);
    p.host_gbps = j.at("host_gbps").get<double>();
    p.device_memory_bytes = j.at("device_memory_bytes").get<int64_t>();
    p.host_memory_bytes = j.at("host_memory_bytes").get<int64_t>();
    p.cpu_threads = j.at("cpu_threads").get<int>();
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("machine profile: ", Printable(e.what())));
  }
  if (p.gemm.empty() || p.attention.empty() || !(p.h2d_gbps > 0) || !(p.d2h_gbps > 0) ||
      !(p.adamw_params_per_second > 0)) {
    return absl::InvalidArgumentError("machine profile: a rate is missing or not positive");
  }
  if (!(p.adamw_in_step_fraction > 0 && p.adamw_in_step_fraction <= 2)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "machine profile: adamw_in_step_fraction must be in (0, 2], got ",
        p.adamw_in_step_fraction));
  }
  return p;
}

std::string ProfileKey(Backend* backend) {
  std::string device = backend->name();
  if (device != "cpu") {
    for (const GpuInfo& g : ListGpus()) {
      device = absl::StrCat(g.name, " ", g.memory_bytes, " B ", g.pci_bus_id);
      break;
    }
  }
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return absl::StrCat(backend->name(), " | ", device, " | ", CpuThreads(), " threads | ",
                      HostMemoryBytes(), " B host | ", host);
}

double HoldSeconds(const Backend* backend, const ProfileOptions& options) {
  if (options.hold_seconds >= 0) return options.hold_seconds;
  return options.quick || backend->kind() == BackendKind::kCpu
             ? 0
             : ProfileOptions::kDefaultHoldSeconds;
}

namespace {

// How a measurement is taken: on the CPU, or quickly, fewer and smaller samples; held, each
// rate timed over at least sample_seconds after `hold` seconds of keeping the device busy.
struct Measuring {
  bool cpu = false;
  bool quick = false;
  int reps = 4;
  double hold = 0;
  double sample_seconds = 0;
};

// PCIe (or memcpy on the CPU): pinned host <-> device, each way and both at once.
absl::Status MeasurePcie(Backend* be, const Measuring& m, MachineProfile* p) {
  const size_t bytes = m.cpu ? (32u << 20) : (512u << 20);
  ASSIGN_OR_RETURN(HostArena up, HostArena::Map(bytes, "PCIe probe (to the device)"));
  ASSIGN_OR_RETURN(HostArena down, HostArena::Map(bytes, "PCIe probe (from the device)"));
  std::memset(up.data(), 1, bytes);
  std::memset(down.data(), 1, bytes);
  RETURN_IF_ERROR(be->PinHostRange(up.data(), bytes));
  RETURN_IF_ERROR(be->PinHostRange(down.data(), bytes));
  absl::StatusOr<DeviceBuffer> a = DeviceBuffer::Allocate(be, bytes);
  absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(be, bytes);
  absl::Status status = a.ok() ? b.status() : a.status();
  if (status.ok()) {
    const double h2d = TimeOnStream(be, StreamId::kH2D, m.reps, [&] {
      be->CopyToDevice(a->get(), up.data(), bytes, StreamId::kH2D);
    });
    const double d2h = TimeOnStream(be, StreamId::kD2H, m.reps, [&] {
      be->CopyToHost(down.data(), b->get(), bytes, StreamId::kD2H);
    });
    const double both = TimeOnHost(m.reps, [&] {
      be->CopyToDevice(a->get(), up.data(), bytes, StreamId::kH2D);
      be->CopyToHost(down.data(), b->get(), bytes, StreamId::kD2H);
      be->SyncAll();
    });
    p->h2d_gbps = bytes / h2d / kGB;
    p->d2h_gbps = bytes / d2h / kGB;
    p->duplex_gbps = 2.0 * bytes / both / kGB;
    p->device_gbps = 2.0 * bytes /
                     TimeOnStream(be, StreamId::kCompute, m.reps, [&] {
                       be->CopyOnDevice(b->get(), a->get(), bytes, StreamId::kCompute);
                     }) /
                     kGB;
  }
  be->SyncAll();
  be->UnpinHostRange(up.data());
  be->UnpinHostRange(down.data());
  return Annotate(status, "machine profile: PCIe buffers");
}

// Matmuls at a grid of layer shapes: (in, out) of the 1.5B, 7B and 8B classes.
absl::Status MeasureMatmuls(Backend* be, const ProfileOptions& options, const Measuring& m,
                            MachineProfile* p) {
  const DType act = be->act_dtype(), wt = be->weight_dtype();
  std::vector<int64_t> rows = m.quick ? std::vector<int64_t>{64, 256}
                                      : std::vector<int64_t>{2048, 8192, 32768};
  std::vector<std::pair<int64_t, int64_t>> shapes =
      m.cpu ? std::vector<std::pair<int64_t, int64_t>>{{256, 256}, {256, 1024}, {1024, 256}}
            : std::vector<std::pair<int64_t, int64_t>>{
                  {1536, 1536}, {1536, 8960}, {8960, 1536},  {3584, 3584},  {3584, 18944},
                  {18944, 3584}, {4096, 4096}, {4096, 14336}, {14336, 4096}};
  if (options.quick && !m.cpu) {
    rows = {2048, 8192};
    shapes = {{1536, 1536}, {4096, 14336}};
  }
  int64_t max_in = 0, max_w = 0, max_out = 0, max_rows = rows.back();
  for (const auto& [ic, oc] : shapes) {
    max_in = std::max(max_in, ic);
    max_out = std::max(max_out, oc);
    max_w = std::max(max_w, ic * oc);
  }
  const int64_t gsize = DTypeSize(be->grad_dtype());
  const int64_t asize = DTypeSize(act);
  ASSIGN_OR_RETURN(DeviceBuffer in, DeviceBuffer::Allocate(be, max_rows * max_in * asize));
  ASSIGN_OR_RETURN(DeviceBuffer din, DeviceBuffer::Allocate(be, max_rows * max_in * asize));
  ASSIGN_OR_RETURN(DeviceBuffer out, DeviceBuffer::Allocate(be, max_rows * max_out * asize));
  ASSIGN_OR_RETURN(DeviceBuffer w, DeviceBuffer::Allocate(be, max_w * DTypeSize(wt)));
  ASSIGN_OR_RETURN(DeviceBuffer dw, DeviceBuffer::Allocate(be, max_w * gsize));
  FillRandom(be, in.get(), max_rows * max_in, act, 1);
  FillRandom(be, out.get(), max_rows * max_out, act, 2);
  FillRandom(be, w.get(), max_w, wt, 3);
  be->Zero(dw.get(), max_w * gsize, StreamId::kCompute);
  const StreamId s = StreamId::kCompute;
  // Held: the largest shape's forward back to back first, then each rate over at least
  // kHeldSampleSeconds, the grid keeping the device at the clock a step holds it at.
  const auto [big_ic, big_oc] =
      *std::max_element(shapes.begin(), shapes.end(), [](const auto& x, const auto& y) {
        return x.first * x.second < y.first * y.second;
      });
  HoldBusy(be, s, m.hold, [&] {
    be->Linear(out.get(), in.get(), w.get(), nullptr, max_rows, big_ic, big_oc, false, s);
  });
  p->held_seconds = m.hold;
  for (const auto& [ic, oc] : shapes) {
    for (int64_t n : rows) {
      const double flops = 2.0 * n * ic * oc;
      const double fwd = TimeOnStreamFor(be, s, m.reps, m.sample_seconds, [&] {
        be->Linear(out.get(), in.get(), w.get(), nullptr, n, ic, oc, false, s);
      });
      const double bwd = TimeOnStreamFor(be, s, m.reps, m.sample_seconds, [&] {
        be->LinearBackward(din.get(), false, dw.get(), nullptr, out.get(), in.get(), w.get(),
                           n, ic, oc, s);
      });
      p->gemm.push_back(GemmSample{n, ic, oc, flops / fwd / 1e12, 2 * flops / bwd / 1e12});
      p->gemm_peak_tflops = std::max(p->gemm_peak_tflops, p->gemm.back().forward_tflops);
    }
  }
  return absl::OkStatus();
}

// Causal attention, documents of seq_len tokens.
absl::Status MeasureAttention(Backend* be, const Measuring& m, MachineProfile* p) {
  const DType act = be->act_dtype();
  const int64_t H = m.cpu ? 4 : 32, KV = m.cpu ? 2 : 8, D = m.cpu ? 64 : 128;
  const int64_t n = m.quick ? (m.cpu ? 512 : 8192) : 16384;
  const std::vector<int64_t> lens = m.quick ? std::vector<int64_t>{128, 512}
                                            : std::vector<int64_t>{1024, 4096, 16384};
  const int64_t a = DTypeSize(act), st = DTypeSize(be->stat_dtype());
  ASSIGN_OR_RETURN(DeviceBuffer q, DeviceBuffer::Allocate(be, n * H * D * a));
  ASSIGN_OR_RETURN(DeviceBuffer k, DeviceBuffer::Allocate(be, n * KV * D * a));
  ASSIGN_OR_RETURN(DeviceBuffer v, DeviceBuffer::Allocate(be, n * KV * D * a));
  ASSIGN_OR_RETURN(DeviceBuffer o, DeviceBuffer::Allocate(be, n * H * D * a));
  ASSIGN_OR_RETURN(DeviceBuffer dout, DeviceBuffer::Allocate(be, n * H * D * a));
  ASSIGN_OR_RETURN(DeviceBuffer dq, DeviceBuffer::Allocate(be, n * H * D * a));
  ASSIGN_OR_RETURN(DeviceBuffer dk, DeviceBuffer::Allocate(be, n * KV * D * a));
  ASSIGN_OR_RETURN(DeviceBuffer dv, DeviceBuffer::Allocate(be, n * KV * D * a));
  ASSIGN_OR_RETURN(DeviceBuffer lse, DeviceBuffer::Allocate(be, n * H * st));
  ASSIGN_OR_RETURN(DeviceBuffer doc, DeviceBuffer::Allocate(be, n * 4));
  FillRandom(be, q.get(), n * H * D, act, 4);
  FillRandom(be, k.get(), n * KV * D, act, 5);
  FillRandom(be, v.get(), n * KV * D, act, 6);
  FillRandom(be, dout.get(), n * H * D, act, 7);
  std::vector<int32_t> starts(n);
  const StreamId s = StreamId::kCompute;
  for (int64_t len : lens) {
    if (len > n) continue;
    for (int64_t i = 0; i < n; ++i) starts[i] = static_cast<int32_t>(i / len * len);
    be->CopyToDevice(doc.get(), starts.data(), n * 4, StreamId::kH2D);
    be->SyncAll();
    const int32_t* ds = static_cast<const int32_t*>(doc.get());
    const double flops = 2.0 * n * len * H * D;
    // Right after the matmul grid: the device is still held (when asked).
    const double fwd = TimeOnStreamFor(be, s, m.reps, m.sample_seconds, [&] {
      be->Attention(o.get(), lse.get(), q.get(), k.get(), v.get(), ds, nullptr, 0, n, H, KV, D,
                    s);
    });
    const double bwd = TimeOnStreamFor(be, s, m.reps, m.sample_seconds, [&] {
      be->AttentionBackward(dq.get(), dk.get(), dv.get(), nullptr, dout.get(), q.get(), k.get(),
                            v.get(), o.get(), lse.get(), ds, nullptr, 0, n, H, KV, D, s);
    });
    p->attention.push_back(AttentionSample{len, flops / fwd / 1e12, 2.5 * flops / bwd / 1e12});
  }
  return absl::OkStatus();
}

// The host: our AdamW (fp32, bf16 and int8 moments), and memory bandwidth.
void MeasureHost(const Measuring& m, MachineProfile* p) {
  p->adamw_params_per_second = AdamWParamsPerSecond(m.quick ? (8 << 20) : (64 << 20), m.reps);
  p->adamw_bf16_params_per_second =
      QuantizedAdamWParamsPerSecond(MomentDType::kBF16, m.quick ? (8 << 20) : (64 << 20), m.reps);
  p->adamw_int8_params_per_second =
      QuantizedAdamWParamsPerSecond(MomentDType::kInt8, m.quick ? (8 << 20) : (64 << 20), m.reps);
  p->host_gbps = HostBandwidthGbps(m.quick ? (16 << 20) : (256 << 20), m.reps);
}

}  // namespace

// The machine, stage by stage: PCIe, the matmul grid, attention, then the host.
absl::StatusOr<MachineProfile> MeasureMachineProfile(Backend* be, const ProfileOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  Measuring m;
  m.cpu = be->kind() == BackendKind::kCpu;
  m.quick = options.quick || m.cpu;
  m.reps = m.quick ? 2 : 4;
  m.hold = HoldSeconds(be, options);
  // Held: each matmul and attention rate timed over at least this long.
  m.sample_seconds = m.hold > 0 ? MachineProfile::kHeldSampleSeconds : 0;
  MachineProfile p;
  p.key = ProfileKey(be);
  p.backend = be->name();
  p.measured_at = NowRfc3339();
  p.device_memory_bytes = DeviceMemoryBytes(be);
  p.host_memory_bytes = HostMemoryBytes();
  p.cpu_threads = CpuThreads();
  RETURN_IF_ERROR(MeasurePcie(be, m, &p));
  RETURN_IF_ERROR(MeasureMatmuls(be, options, m, &p));
  RETURN_IF_ERROR(MeasureAttention(be, m, &p));
  MeasureHost(m, &p);
  p.measure_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return p;
}

double MachineProfile::AdamWParamsPerSecond(MomentDType moments) const {
  const double rate = moments == MomentDType::kBF16   ? adamw_bf16_params_per_second
                      : moments == MomentDType::kInt8 ? adamw_int8_params_per_second
                                                      : adamw_params_per_second;
  return rate > 0 ? rate : adamw_params_per_second;
}

double MachineProfile::AdamWParamsPerSecond(MomentDType moments, bool bf16_copy) const {
  return AdamWParamsPerSecond(moments) * AdamWBytesPerParameter(moments, /*bf16_copy=*/true) /
         AdamWBytesPerParameter(moments, bf16_copy);
}

double MachineProfile::AdamWInStepFraction(int64_t params, double busy_seconds,
                                           MomentDType moments, bool bf16_copy) const {
  const double alone = AdamWParamsPerSecond(moments, bf16_copy);
  if (busy_seconds <= 0 || alone <= 0) return 0;
  return static_cast<double>(params) / busy_seconds / alone;
}

double StoreBytesPerParameter(MomentDType moments, bool bf16_copy) {
  return (bf16_copy ? 2.0 : 0.0) + 4.0 + MomentBytesPerParameter(moments);
}

double AdamWBytesPerParameter(MomentDType moments, bool bf16_copy) {
  // grad 4, master 4 + 4, the moments read and written, bf16 2.
  return 4.0 + 8.0 + 2.0 * MomentBytesPerParameter(moments) + (bf16_copy ? 2.0 : 0.0);
}

std::string DefaultProfilePath(const ProfileLocations& where) {
  if (!where.profile.empty()) return where.profile;
  std::string base;
  if (!where.cache_home.empty()) {
    base = where.cache_home;
  } else if (!where.home.empty()) {
    base = absl::StrCat(where.home, "/.cache");
  } else {
    base = "/tmp";
  }
  return absl::StrCat(base, "/megatrain/machine-profile.json");
}

absl::StatusOr<MachineProfile> ReadProfile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("no machine profile at ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ProfileFromJson(ss.str());
}

absl::Status WriteProfile(const MachineProfile& profile, const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  std::ofstream out(tmp, std::ios::trunc);
  out << ProfileToJson(profile) << "\n";
  out.close();
  if (!out || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return absl::UnavailableError(
        absl::StrCat("cannot write the machine profile at ", path, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

// The profile cached at `path` when it was measured for `backend` (its source set);
// else nullopt, and *why says so.
namespace {

std::optional<MachineProfile> ReadCachedProfile(Backend* backend, const std::string& path,
                                                double hold_seconds, std::string* why) {
  absl::StatusOr<MachineProfile> cached = ReadProfile(path);
  if (!cached.ok()) {
    *why = absl::IsNotFound(cached.status()) ? "none cached"
                                              : std::string(cached.status().message());
    return std::nullopt;
  }
  if (cached->key != ProfileKey(backend)) {
    *why = "measured on another machine or device";
    return std::nullopt;
  }
  if (cached->held_seconds < hold_seconds) {
    *why = cached->held_seconds > 0
               ? absl::StrFormat("its rates were held %g s, not %g", cached->held_seconds,
                                 hold_seconds)
               : "its rates were measured in bursts, not held at the device's power limit";
    return std::nullopt;
  }
  cached->source = path;
  return *std::move(cached);
}

}  // namespace

absl::StatusOr<MachineProfile> LoadOrMeasureProfile(Backend* backend, const std::string& path,
                                                    std::string* note,
                                                    const ProfileOptions& options) {
  std::string why;
  if (std::optional<MachineProfile> cached =
          ReadCachedProfile(backend, path, HoldSeconds(backend, options), &why)) {
    if (note != nullptr) *note = absl::StrCat("machine profile from ", path);
    return *cached;
  }
  ASSIGN_OR_RETURN(MachineProfile p, MeasureMachineProfile(backend, options));
  if (!WriteProfile(p, path).ok()) {
    if (note != nullptr) {
      *note = absl::StrCat("machine profile measured (", why, "); could not cache it at ", path);
    }
    return p;
  }
  p.source = path;
  if (note != nullptr) {
    *note = absl::StrFormat("machine profile measured in %.1f s (%s), cached at %s",
                            p.measure_seconds, why, path);
  }
  return p;
}

std::vector<std::string> DaemonProfilePaths(const ProfileLocations& where) {
  std::vector<std::string> paths = {"/var/lib/megatrain/machine-profile.json"};
  if (!where.home.empty()) {
    paths.push_back(absl::StrCat(where.home, "/.local/state/megatrain/machine-profile.json"));
  }
  return paths;
}

absl::StatusOr<MachineProfile> LoadMachineProfile(Backend* backend, std::string* note) {
  return LoadMachineProfile(backend, GetEngineSettings().profiles, note);
}

absl::StatusOr<MachineProfile> LoadMachineProfile(Backend* backend,
                                                  const ProfileLocations& where,
                                                  std::string* note) {
  if (where.profile.empty()) {
    for (const std::string& path : DaemonProfilePaths(where)) {
      std::string why;
      std::optional<MachineProfile> shared =
          ReadCachedProfile(backend, path, HoldSeconds(backend, {}), &why);
      if (!shared.has_value()) continue;
      if (note != nullptr) *note = absl::StrCat("machine profile from ", path, " (megatraind's)");
      return *shared;
    }
  }
  return LoadOrMeasureProfile(backend, DefaultProfilePath(where), note);
}

}  // namespace megatrain
