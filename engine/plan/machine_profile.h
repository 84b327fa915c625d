// The rates of this machine that bound a training step, measured once and cached.
//
// The planner predicts a step from these: PCIe each way and both ways at once (pinned),
// the backend's matmul rate at a grid of shapes (forward, input gradient and weight
// gradient, as the layers call them), causal attention forward and backward at a few
// sequence lengths, device memory bandwidth (the elementwise kernels), the CPU AdamW rate
// of our optimizer, and host memory bandwidth. Inputs are random (zeros run faster on a
// GPU and would flatter every rate).
//
// The matmul and attention rates are measured with the device held at its power limit
// (measure.h: HoldBusy), as a training step holds it: the H200's bf16 GEMMs run about 15%
// slower held than in the short bursts measured before (profiles without held_seconds).
//
// Measuring takes a few seconds on an H200 (about ten on a 2-core CPU) and is done once
// per machine: LoadOrMeasureProfile() keeps the result as JSON keyed by what was measured
// (backend, device name and memory, CPU count, host memory), and measures again when the
// key or the format changes, or when the cached rates were held for less time than asked.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/common/backend.h"
#include "engine/common/engine_settings.h"
#include "engine/store/host_store.h"

namespace megatrain {

// One matmul shape: out (rows, out_features) = in (rows, in_features) . W^T.
struct GemmSample {
  int64_t rows = 0;
  int64_t in_features = 0;
  int64_t out_features = 0;
  double forward_tflops = 0;   // Linear
  double backward_tflops = 0;  // LinearBackward: input gradient + weight gradient
};

// The experts' grouped matmul (GroupedLinear and its backward), experts x rows_per_expert
// rows, at an MoE shape: what machine_bench measures (grouped_gemm) and saves with --save.
struct GroupedGemmSample {
  int64_t experts = 0;
  int64_t rows_per_expert = 0;
  int64_t in_features = 0;
  int64_t out_features = 0;
  double forward_tflops = 0;
  double backward_tflops = 0;
};

// Causal attention over documents of seq_len tokens, n tokens in all, of head_dim.
struct AttentionSample {
  int64_t seq_len = 0;
  double forward_tflops = 0;   // 2 * n * seq_len * H * D (causal: half of the square, x2 GEMMs)
  double backward_tflops = 0;  // 2.5x the forward's FLOPs (five matmuls to its two)
  int64_t head_dim = 128;
};

struct MachineProfile {
  static constexpr int kVersion = 3;
  int version = kVersion;
  std::string key;          // what the measurement is valid for (see header comment)
  std::string backend;      // Backend::name()
  std::string measured_at;  // RFC 3339, UTC
  double measure_seconds = 0;
  // Not stored: the file it was read from or cached at ("" : measured, not cached). The
  // plan names it, since the planner's choices (the micro-batch split among them, which
  // decides a step's bits) follow the measured rates.
  std::string source;

  double h2d_gbps = 0;      // pinned host -> device, 1e9 bytes/s
  double d2h_gbps = 0;
  double duplex_gbps = 0;   // both directions at once, total
  double device_gbps = 0;   // device memory, read + write of a copy
  double gemm_peak_tflops = 0;  // best forward rate of the grid
  // How long the device was held busy before the matmul grid (0: measured in bursts, as
  // older profiles were); each rate is then timed over at least
  // kHeldSampleSeconds.
  double held_seconds = 0;
  static constexpr double kHeldSampleSeconds = 0.05;
  std::vector<GemmSample> gemm;
  // Grouped matmuls at MoE shapes (empty: not measured; GroupedGemmTflops then uses gemm).
  std::vector<GroupedGemmSample> grouped_gemm;
  std::vector<AttentionSample> attention;
  double adamw_params_per_second = 0;  // AdamWUpdate, all threads, fp32 state + bf16 out
  // AdamWUpdateQuantized over bf16 and int8 moments (0: not measured; the fp32 rate).
  double adamw_bf16_params_per_second = 0;
  double adamw_int8_params_per_second = 0;
  // AdamW's rate inside a step over its rate alone (the rates above). Measured by train_bench
  // (optimizer_in_step_fraction), not by machine_bench, which runs AdamW alone: 0.65-0.77 on
  // H200 boxes over 14 MoE steps (one device's DMA under way, bf16 copy or not,
  // OpenMP threads one or two short of the cores, passive waits, huge pages: none explains
  // it). Profiles without it take that default; `train_bench --calibrate` measures this
  // box's into its cached profile (or set it in the JSON). In (0, 2]. Against the rates as
  // the planner scales them: a step without the bf16 copy moves 28 bytes a parameter, not
  // the rates' 30.
  static constexpr double kDefaultAdamWInStepFraction = 0.70;
  double adamw_in_step_fraction = kDefaultAdamWInStepFraction;
  // The NVMe tier's disk, read and write (GB/s; 0: not measured, 2 assumed).
  double nvme_gbps = 0;
  double host_gbps = 0;     // host memory, a += s * b in place, all threads
  int64_t device_memory_bytes = 0;  // what the backend may allocate (0 on the CPU)
  int64_t host_memory_bytes = 0;
  int cpu_threads = 0;

  // Matmul rate (TFLOP/s) for a shape, interpolated in log space over the grid's rows
  // and the nearest weight size; `backward` for LinearBackward.
  double GemmTflops(int64_t rows, int64_t in_features, int64_t out_features,
                    bool backward) const;
  // An expert matmul's rate in a grouped matmul of rows_per_expert rows an expert: the
  // grouped samples of the nearest shape when one is within 1.5x in each dimension
  // (interpolated over rows per expert as GemmTflops is over rows; below its fewest rows,
  // GemmTflops there times grouped over dense at the fewest), else GemmTflops at
  // rows_per_expert rows.
  double GroupedGemmTflops(int64_t rows_per_expert, int64_t in_features, int64_t out_features,
                           bool backward) const;
  // Takes more attention samples (machine_bench's longer sequences, other head sizes): each
  // replaces the sample of its seq_len and head_dim, if any; the samples stay in (head_dim,
  // seq_len) order.
  void AddAttentionSamples(const std::vector<AttentionSample>& samples);
  // Attention rate at seq_len (nearest measured lengths, interpolated) over the samples of the
  // measured head_dim nearest to head_dim (in ratio; of two as near, the first listed).
  double AttentionTflops(int64_t seq_len, bool backward, int64_t head_dim = 128) const;
  // The optimizer's rate with the moments kept in `moments`.
  double AdamWParamsPerSecond(MomentDType moments) const;
  // That rate for a store with or without the bf16 copy: machine_bench's rates wrote it
  // (AdamWBytesPerParameter with it), a store without it moves 2 bytes a parameter less.
  // Alone, not yet times adamw_in_step_fraction.
  double AdamWParamsPerSecond(MomentDType moments, bool bf16_copy) const;
  // AdamW's rate in a step that updated `params` in `busy_seconds` over that rate alone:
  // the step's measure of adamw_in_step_fraction (0 without busy seconds or a rate).
  double AdamWInStepFraction(int64_t params, double busy_seconds, MomentDType moments,
                             bool bf16_copy) const;
};

// Host bytes per parameter of the store (the bf16 copy if kept, fp32 master, the moments)
// and those AdamW moves per parameter (gradient in, master and moments read and written,
// the bf16 copy out).
double StoreBytesPerParameter(MomentDType moments, bool bf16_copy = true);
double AdamWBytesPerParameter(MomentDType moments, bool bf16_copy = true);

std::string ProfileToJson(const MachineProfile& profile);
// The profile saved at `path`, whatever it was measured for: NotFound without a file there,
// InvalidArgument for a file that is not a profile.
[[nodiscard]] absl::StatusOr<MachineProfile> ReadProfile(const std::string& path);
// Writes the profile's JSON at `path` (its folders made), whole or not at all (a temporary
// file renamed over it).
[[nodiscard]] absl::Status WriteProfile(const MachineProfile& profile, const std::string& path);
[[nodiscard]] absl::StatusOr<MachineProfile> ProfileFromJson(const std::string& json);

// The key of `backend` on this host (a profile with another key is stale).
std::string ProfileKey(Backend* backend);

struct ProfileOptions {
  bool quick = false;  // fewer shapes and repetitions (tests)
  // Seconds the device is held busy before the matmul grid (measure.h: HoldBusy); < 0: the
  // default, kDefaultHoldSeconds on a GPU when not quick, else 0.
  double hold_seconds = -1;
  static constexpr double kDefaultHoldSeconds = 2.0;
};

// The hold `options` asks of `backend` (ProfileOptions::hold_seconds resolved).
double HoldSeconds(const Backend* backend, const ProfileOptions& options);

// Measures the profile with `backend`'s own ops and copies, on its streams. Allocates
// device buffers of up to about 3 GiB on a GPU (100 MiB on the CPU) and frees them.
[[nodiscard]] absl::StatusOr<MachineProfile> MeasureMachineProfile(
    Backend* backend, const ProfileOptions& options = {});

// The cached profile at `path` when its key matches `backend`, else a fresh measurement,
// written to `path` (atomically; its folder is created). A cache that cannot be read or
// written is not an error: the measurement is returned (and `*note` says why).
[[nodiscard]] absl::StatusOr<MachineProfile> LoadOrMeasureProfile(
    Backend* backend, const std::string& path, std::string* note = nullptr,
    const ProfileOptions& options = {});

// The locations below are what main() read from the environment (ProfileLocations in
// engine/common/engine_settings.h: $MEGATRAIN_PROFILE, $XDG_CACHE_HOME, $HOME).

// Where a profile is cached by default: where.profile, else
// <where.cache_home>/megatrain/machine-profile.json, else <where.home>/.cache/megatrain/...,
// else /tmp/megatrain/...
std::string DefaultProfilePath(const ProfileLocations& where);

// The profiles megatraind keeps on this machine, in its default state folders: the
// system daemon's (/var/lib/megatrain) and this user's (<where.home>/.local/state/megatrain).
std::vector<std::string> DaemonProfilePaths(const ProfileLocations& where);

// The profile a job run outside the daemon plans with, so that one spec plans (and so
// computes) alike on one machine however it runs: where.profile when given; else the
// first daemon profile (DaemonProfilePaths) measured for `backend`; else the one cached
// at DefaultProfilePath(where), measured there on first use.
[[nodiscard]] absl::StatusOr<MachineProfile> LoadMachineProfile(Backend* backend,
                                                                const ProfileLocations& where,
                                                                std::string* note = nullptr);
// The same at the process's locations (GetEngineSettings().profiles, as main set them).
[[nodiscard]] absl::StatusOr<MachineProfile> LoadMachineProfile(Backend* backend,
                                                                std::string* note = nullptr);

}  // namespace megatrain
