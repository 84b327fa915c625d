// The machine profile: measured with the backend's own ops, cached, re-measured when stale.
#include "engine/plan/machine_profile.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "engine/backend/cpu_backend.h"
#include "engine/plan/measure.h"

namespace megatrain {
namespace {
namespace fs = std::filesystem;

TEST(MachineProfile, MeasuresPositiveRatesOnTheCpuAndRoundTripsThroughJson) {
  std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
  absl::StatusOr<MachineProfile> p = MeasureMachineProfile(be.get(), ProfileOptions{true});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_GT(p->h2d_gbps, 0);
  EXPECT_GT(p->gemm_peak_tflops, 0);
  EXPECT_GT(p->adamw_params_per_second, 1e6);
  EXPECT_GT(p->host_gbps, 0);
  ASSERT_FALSE(p->attention.empty());
  EXPECT_GT(p->attention[0].backward_tflops, 0);
  absl::StatusOr<MachineProfile> back = ProfileFromJson(ProfileToJson(*p));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->key, p->key);
  EXPECT_EQ(back->gemm.size(), p->gemm.size());
  EXPECT_DOUBLE_EQ(back->adamw_params_per_second, p->adamw_params_per_second);
}

// AdamW's in-step fraction: the default (0.70) in a profile without it, as saved otherwise,
// and refused outside (0, 2].
TEST(MachineProfile, AdamWInStepFractionDefaultsRoundTripsAndIsChecked) {
  std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
  absl::StatusOr<MachineProfile> p = MeasureMachineProfile(be.get(), ProfileOptions{true});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_DOUBLE_EQ(p->adamw_in_step_fraction, 0.70);
  p->adamw_in_step_fraction = 0.55;
  std::string json = ProfileToJson(*p);
  absl::StatusOr<MachineProfile> back = ProfileFromJson(json);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_DOUBLE_EQ(back->adamw_in_step_fraction, 0.55);
  const std::string field = "\"adamw_in_step_fraction\": 0.55";
  const size_t at = json.find(field);
  ASSERT_NE(at, std::string::npos) << json;
  std::string without = json;
  without.erase(at, field.size() + 1);  // and its comma
  absl::StatusOr<MachineProfile> old = ProfileFromJson(without);
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_DOUBLE_EQ(old->adamw_in_step_fraction, MachineProfile::kDefaultAdamWInStepFraction);
  std::string bad = json;
  bad.replace(at, field.size(), "\"adamw_in_step_fraction\": 2.5");
  absl::StatusOr<MachineProfile> refused = ProfileFromJson(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(std::string(refused.status().message()).find("adamw_in_step_fraction"),
            std::string::npos);
}

// A step's measure of the fraction: its AdamW rate over the rate alone at the store's bytes
// (without the bf16 copy a parameter moves 28 bytes, not the measured 30); none without time.
TEST(MachineProfile, AdamWInStepFractionOfAStepIsItsRateOverTheRateAlone) {
  MachineProfile p;
  p.adamw_params_per_second = 3e9;
  EXPECT_DOUBLE_EQ(p.AdamWInStepFraction(3'000'000'000, 2.0, MomentDType::kF32, true), 0.5);
  EXPECT_DOUBLE_EQ(p.AdamWInStepFraction(3'000'000'000, 2.0, MomentDType::kF32, false),
                   0.5 * 28.0 / 30.0);
  EXPECT_EQ(p.AdamWInStepFraction(3'000'000'000, 0.0, MomentDType::kF32, true), 0.0);
  p.adamw_params_per_second = 0;
  EXPECT_EQ(p.AdamWInStepFraction(3'000'000'000, 2.0, MomentDType::kF32, true), 0.0);
}

// The experts' matmuls plan with the grouped samples of the nearest MoE shape (within 1.5x
// in each dimension), over rows per expert; any other shape, or no grouped samples, with the
// dense grid at rows_per_expert rows. The samples survive the profile's JSON.
TEST(MachineProfile, GroupedRateUsesTheNearestGroupedShapeElseTheDenseGrid) {
  MachineProfile p;
  p.gemm = {{1000, 2048, 1536, 500, 450}, {10000, 2048, 1536, 700, 650}};
  EXPECT_DOUBLE_EQ(p.GroupedGemmTflops(1000, 2048, 1536, false), 500);  // none measured
  p.grouped_gemm = {{128, 1000, 2048, 1536, 300, 250}, {128, 10000, 2048, 1536, 600, 550}};
  EXPECT_DOUBLE_EQ(p.GroupedGemmTflops(1000, 2048, 1536, false), 300);
  EXPECT_DOUBLE_EQ(p.GroupedGemmTflops(10000, 2000, 1600, true), 550);  // near enough
  EXPECT_NEAR(p.GroupedGemmTflops(3162, 2048, 1536, false), 450, 0.5);  // halfway in log rows
  EXPECT_DOUBLE_EQ(p.GroupedGemmTflops(1000, 4096, 1536, false), p.GemmTflops(1000, 4096, 1536,
                                                                               false));  // 2x in
  // Fewer rows than any grouped sample (Mixtral's one sample, at 16K rows an expert): the
  // dense rate there, times grouped over dense at the fewest rows measured, not the
  // grouped rate scaled down with the rows (60 at a tenth of the rows).
  MachineProfile one = p;
  one.grouped_gemm = {{8, 10000, 2048, 1536, 600, 550}};
  EXPECT_NEAR(one.GroupedGemmTflops(1000, 2048, 1536, false), 500.0 * 600 / 700, 1e-9);
  p.attention = {{1024, 100, 90}};
  p.h2d_gbps = p.d2h_gbps = 1;
  p.adamw_params_per_second = 1;
  absl::StatusOr<MachineProfile> back = ProfileFromJson(ProfileToJson(p));
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->grouped_gemm.size(), 2u);
  EXPECT_EQ(back->grouped_gemm[1].rows_per_expert, 10000);
  EXPECT_DOUBLE_EQ(back->grouped_gemm[1].backward_tflops, 550);
}

// machine_bench's longer sequences join the profile's attention samples: a length measured
// again replaces its sample, and a 512K sequence plans at the longest length's rate.
TEST(MachineProfile, LongerAttentionSamplesJoinInOrderAndReplaceTheirLength) {
  MachineProfile p;
  p.attention = {{1024, 300, 250}, {4096, 400, 330}, {16384, 420, 350}};
  p.AddAttentionSamples({{131072, 520, 410}, {4096, 410, 340}, {32768, 480, 380}});
  ASSERT_EQ(p.attention.size(), 5u);
  for (size_t i = 1; i < p.attention.size(); ++i) {
    EXPECT_LT(p.attention[i - 1].seq_len, p.attention[i].seq_len);
  }
  EXPECT_DOUBLE_EQ(p.AttentionTflops(4096, false), 410);
  EXPECT_DOUBLE_EQ(p.AttentionTflops(524288, true), 410);  // held past the longest
}

// Attention plans at the rates of its own head size (GPT-OSS's 64 runs slower than 128):
// the samples of the measured head_dim nearest in ratio, which survive the profile's JSON;
// a profile saved before head sizes were recorded holds head_dim 128.
TEST(MachineProfile, AttentionRateUsesTheSamplesOfTheNearestHeadDim) {
  MachineProfile p;
  p.attention = {{4096, 400, 300}, {32768, 480, 330}};
  EXPECT_DOUBLE_EQ(p.AttentionTflops(4096, false, 64), 400);  // only 128 measured
  p.AddAttentionSamples({{4096, 280, 200, 64}, {32768, 316, 214, 64}});
  ASSERT_EQ(p.attention.size(), 4u);
  EXPECT_EQ(p.attention[0].head_dim, 64);
  EXPECT_DOUBLE_EQ(p.AttentionTflops(4096, false, 64), 280);
  EXPECT_DOUBLE_EQ(p.AttentionTflops(32768, true, 64), 214);
  EXPECT_DOUBLE_EQ(p.AttentionTflops(4096, false, 128), 400);
  EXPECT_DOUBLE_EQ(p.AttentionTflops(4096, false), 400);
  EXPECT_DOUBLE_EQ(p.AttentionTflops(4096, false, 80), 280);   // nearer 64 than 128
  EXPECT_DOUBLE_EQ(p.AttentionTflops(4096, false, 256), 400);  // nearest 128
  p.AddAttentionSamples({{4096, 290, 205, 64}});  // measured again: replaces its own head_dim's
  EXPECT_DOUBLE_EQ(p.AttentionTflops(4096, false, 64), 290);
  EXPECT_DOUBLE_EQ(p.AttentionTflops(4096, false, 128), 400);
  p.gemm = {{1000, 1024, 1024, 100, 90}};
  p.h2d_gbps = p.d2h_gbps = 1;
  p.adamw_params_per_second = 1;
  absl::StatusOr<MachineProfile> back = ProfileFromJson(ProfileToJson(p));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_DOUBLE_EQ(back->AttentionTflops(32768, true, 64), 214);
  EXPECT_DOUBLE_EQ(back->AttentionTflops(32768, true, 128), 330);
  std::string old = ProfileToJson(p);
  for (size_t at; (at = old.find("\"head_dim\": 64,")) != std::string::npos;) {
    old.erase(at, std::string("\"head_dim\": 64,").size());
  }
  for (size_t at; (at = old.find("\"head_dim\": 128,")) != std::string::npos;) {
    old.erase(at, std::string("\"head_dim\": 128,").size());
  }
  ASSERT_EQ(old.find("head_dim"), std::string::npos);
  absl::StatusOr<MachineProfile> before = ProfileFromJson(old);
  ASSERT_TRUE(before.ok()) << before.status();
  for (const AttentionSample& a : before->attention) EXPECT_EQ(a.head_dim, 128);
}

TEST(MachineProfile, GemmRateInterpolatesOverRowsAndPicksTheNearestShape) {
  MachineProfile p;
  p.gemm = {{1000, 1024, 1024, 100, 90}, {10000, 1024, 1024, 200, 180},
            {1000, 4096, 16384, 300, 270}, {10000, 4096, 16384, 400, 360}};
  EXPECT_DOUBLE_EQ(p.GemmTflops(1000, 1024, 1024, false), 100);
  EXPECT_NEAR(p.GemmTflops(3162, 1024, 1024, false), 150, 0.5);  // halfway in log rows
  EXPECT_DOUBLE_EQ(p.GemmTflops(100000, 4000, 14000, false), 400);  // held past the grid
  EXPECT_DOUBLE_EQ(p.GemmTflops(500, 1024, 1024, true), 45);        // small: proportional
}

TEST(MachineProfile, CachedProfileIsReusedAndAStaleOrBrokenOneIsReplaced) {
  std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
  const fs::path dir = fs::path(::testing::TempDir()) / "megatrain_profile";
  fs::remove_all(dir);
  const std::string path = (dir / "sub" / "machine-profile.json").string();
  std::string note;
  absl::StatusOr<MachineProfile> first = LoadOrMeasureProfile(be.get(), path, &note, {true});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_NE(note.find("measured"), std::string::npos) << note;
  ASSERT_TRUE(fs::exists(path));
  absl::StatusOr<MachineProfile> second = LoadOrMeasureProfile(be.get(), path, &note, {true});
  ASSERT_TRUE(second.ok());
  EXPECT_NE(note.find("from"), std::string::npos) << note;
  EXPECT_EQ(second->measured_at, first->measured_at);

  // Another machine's profile (a different key) is measured again.
  MachineProfile other = *first;
  other.key = "cuda:0 | some other box";
  other.adamw_params_per_second = 1;
  { std::ofstream(path) << ProfileToJson(other); }
  absl::StatusOr<MachineProfile> third = LoadOrMeasureProfile(be.get(), path, &note, {true});
  ASSERT_TRUE(third.ok());
  EXPECT_NE(note.find("another machine"), std::string::npos) << note;
  EXPECT_GT(third->adamw_params_per_second, 1);

  // A broken file too.
  { std::ofstream(path) << "{\"version\": 2, \"key\": "; }
  absl::StatusOr<MachineProfile> fourth = LoadOrMeasureProfile(be.get(), path, &note, {true});
  ASSERT_TRUE(fourth.ok());
  EXPECT_NE(note.find("measured"), std::string::npos) << note;
  EXPECT_TRUE(ProfileFromJson("[1, 2]").status().code() == absl::StatusCode::kInvalidArgument);
}

// The rates the planner predicts steps with are held (measure.h): a cached profile whose rates
// were held for less time than asked, or measured in bursts (profiles saved before
// held_seconds, read as 0), is measured again; one held as long is reused.
TEST(MachineProfile, RatesMeasuredInBurstsAreMeasuredAgainHeld) {
  std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
  const fs::path dir = fs::path(::testing::TempDir()) / "megatrain_profile_held";
  fs::remove_all(dir);
  const std::string path = (dir / "machine-profile.json").string();
  EXPECT_EQ(HoldSeconds(be.get(), ProfileOptions{}), 0);  // the CPU is not held by default
  ProfileOptions held{true};
  held.hold_seconds = 0.05;
  EXPECT_EQ(HoldSeconds(be.get(), held), 0.05);
  std::string note;
  absl::StatusOr<MachineProfile> bursts = LoadOrMeasureProfile(be.get(), path, &note, {true});
  ASSERT_TRUE(bursts.ok()) << bursts.status();
  EXPECT_EQ(bursts->held_seconds, 0);
  absl::StatusOr<MachineProfile> again = LoadOrMeasureProfile(be.get(), path, &note, held);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(note.find("measured in bursts"), std::string::npos) << note;
  EXPECT_NE(again->measured_at + std::to_string(again->measure_seconds),
            bursts->measured_at + std::to_string(bursts->measure_seconds));
  EXPECT_DOUBLE_EQ(again->held_seconds, 0.05);
  absl::StatusOr<MachineProfile> reused = LoadOrMeasureProfile(be.get(), path, &note, held);
  ASSERT_TRUE(reused.ok());
  EXPECT_NE(note.find("from"), std::string::npos) << note;
  EXPECT_DOUBLE_EQ(reused->held_seconds, 0.05);
  held.hold_seconds = 0.1;  // asked to hold longer than the cache was
  absl::StatusOr<MachineProfile> longer = LoadOrMeasureProfile(be.get(), path, &note, held);
  ASSERT_TRUE(longer.ok());
  EXPECT_NE(note.find("held 0.05 s, not 0.1"), std::string::npos) << note;
  EXPECT_DOUBLE_EQ(longer->held_seconds, 0.1);

  // A profile saved without the field (by an older build) reads as bursts.
  std::string json = ProfileToJson(*longer);
  const size_t at = json.find("\"held_seconds\"");
  ASSERT_NE(at, std::string::npos) << json;
  json.erase(at, json.find('\n', at) - at + 1);
  absl::StatusOr<MachineProfile> old = ProfileFromJson(json);
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(old->held_seconds, 0);
}

// HoldBusy keeps the stream busy for the wall time asked (none for 0); TimeOnStreamFor times
// at least the calls and the device time asked, also when its first calls ran slower than the
// rest, and on a busy machine (CI saw one timing cover 0.0155 of 0.02 s; resized timings
// that each fell short, 0.0145).
TEST(Measure, HoldBusyAndTimeOnStreamForRunLongEnough) {
  std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
  const int64_t bytes = 1 << 20, slow_bytes = 32 << 20;
  absl::StatusOr<DeviceBuffer> a = DeviceBuffer::Allocate(be.get(), slow_bytes);
  absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(be.get(), slow_bytes);
  ASSERT_TRUE(a.ok() && b.ok());
  const StreamId s = StreamId::kCompute;
  int64_t calls = 0;
  int64_t slow_calls = 0;  // the first calls copy 32 times the bytes
  auto copy = [&] {
    ++calls;
    be->CopyOnDevice(b->get(), a->get(), calls <= slow_calls ? slow_bytes : bytes, s);
  };
  EXPECT_EQ(HoldBusy(be.get(), s, 0, copy), 0);
  EXPECT_EQ(calls, 0);
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t held = HoldBusy(be.get(), s, 0.05, copy);
  EXPECT_GE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.05);
  EXPECT_EQ(held, calls);
  EXPECT_GE(held, 4);

  for (const int64_t slow : {int64_t{0}, int64_t{3}}) {
    SCOPED_TRACE(slow);
    calls = 0;
    slow_calls = slow;
    TimedCalls timed;
    const double per_call = TimeOnStreamFor(be.get(), s, 2, 0.02, copy, &timed);
    EXPECT_EQ(timed.made, calls);
    EXPECT_GT(per_call, 0);
    EXPECT_GE(per_call * timed.timed, 0.02 * (1 - 1e-9));  // its timings covered 0.02 s
  }
  calls = 0;
  slow_calls = 0;
  TimedCalls timed;
  TimeOnStreamFor(be.get(), s, 3, 0, copy, &timed);
  EXPECT_EQ(timed.made, 4);  // a warm-up and the reps, nothing more
  EXPECT_EQ(timed.timed, 3);
}

// Where profiles are kept, from what main read of the environment: $MEGATRAIN_PROFILE's
// file, else the XDG cache, else ~/.cache, else /tmp; the daemon's under /var/lib and, for
// a user, ~/.local/state.
TEST(ProfileLocations, DefaultPathPrefersTheGivenFileThenTheCacheHomeThenHome) {
  ProfileLocations where;
  EXPECT_EQ(DefaultProfilePath(where), "/tmp/megatrain/machine-profile.json");
  where.home = "/home/alice";
  EXPECT_EQ(DefaultProfilePath(where), "/home/alice/.cache/megatrain/machine-profile.json");
  where.cache_home = "/scratch/cache";
  EXPECT_EQ(DefaultProfilePath(where), "/scratch/cache/megatrain/machine-profile.json");
  where.profile = "/srv/box.json";
  EXPECT_EQ(DefaultProfilePath(where), "/srv/box.json");
}

TEST(ProfileLocations, DaemonPathsAreTheSystemsThenTheUsers) {
  ProfileLocations where;
  EXPECT_EQ(DaemonProfilePaths(where),
            std::vector<std::string>{"/var/lib/megatrain/machine-profile.json"});
  where.home = "/home/alice";
  EXPECT_EQ(DaemonProfilePaths(where),
            (std::vector<std::string>{"/var/lib/megatrain/machine-profile.json",
                                      "/home/alice/.local/state/megatrain/machine-profile.json"}));
}

// A job run outside the daemon plans with the profile main was pointed at, without measuring.
TEST(ProfileLocations, LoadMachineProfileReadsTheGivenFile) {
  std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
  absl::StatusOr<MachineProfile> measured = MeasureMachineProfile(be.get(), ProfileOptions{true});
  ASSERT_TRUE(measured.ok()) << measured.status();
  measured->adamw_params_per_second = 12345;  // a value no measurement gives
  const fs::path dir = fs::path(::testing::TempDir()) / "megatrain_profile_given";
  fs::remove_all(dir);
  ProfileLocations where;
  where.profile = (dir / "given.json").string();
  where.home = (dir / "home").string();  // holds no daemon profile
  ASSERT_TRUE(WriteProfile(*measured, where.profile).ok());
  std::string note;
  absl::StatusOr<MachineProfile> loaded = LoadMachineProfile(be.get(), where, &note);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->adamw_params_per_second, 12345);
  EXPECT_EQ(loaded->source, where.profile);
  EXPECT_NE(note.find(where.profile), std::string::npos) << note;
}

}  // namespace
}  // namespace megatrain
