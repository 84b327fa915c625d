// What a checkpoint written while training runs costs the job, through the real job path
// (Trainer: planner, pipeline, optimizer, checkpoint writer).
//
//   checkpoint_bench --dir /scratch/ckbench --shape qwen2.5-1.5b --tokens-per-step 65536
//
// A random-init model of the shape trains on random bytes. After --before steps it asks
// for a background checkpoint of the next step (as periodic ones are: begun before the
// step runs) and keeps training until it is committed, and --after steps more (twice:
// "first" and "second"). Then
// (--verify) another background checkpoint of a step S, and, once S has run, one of S
// taken with training stopped, while the background one is still being written; the two
// are compared byte for byte. Prints JSON: the step time before, during and after the
// background checkpoint, the rate drop while it was written, how long updates waited for
// it, its bytes and seconds, the stopped checkpoint's seconds, and the comparison.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "CLI/CLI.hpp"
#include "bench/shapes.h"
#include "engine/common/engine_settings.h"
#include "engine/job/trainer.h"
#include "engine/model/config.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {
namespace fs = std::filesystem;

double Mean(const std::vector<double>& v) {
  return v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / v.size();
}

// Compares every file under `a` with the one at the same place under `b`.
bool SameFiles(const fs::path& a, const fs::path& b, int64_t* files, int64_t* bytes) {
  bool same = true;
  std::vector<char> x(64 << 20), y(64 << 20);
  for (const auto& e : fs::recursive_directory_iterator(a)) {
    if (!e.is_regular_file()) continue;
    const fs::path other = b / fs::relative(e.path(), a);
    std::ifstream fa(e.path(), std::ios::binary), fb(other, std::ios::binary);
    if (!fb || fs::file_size(e.path()) != fs::file_size(other)) {
      std::fprintf(stderr, "differs: %s\n", other.c_str());
      same = false;
      continue;
    }
    while (fa) {
      fa.read(x.data(), x.size());
      fb.read(y.data(), y.size());
      const std::streamsize n = fa.gcount();
      if (n != fb.gcount() || std::memcmp(x.data(), y.data(), n) != 0) {
        std::fprintf(stderr, "differs: %s\n", other.c_str());
        same = false;
        break;
      }
      *bytes += n;
    }
    ++*files;
  }
  return same;
}

}  // namespace
}  // namespace megatrain

int main(int argc, char** argv) {
  using namespace megatrain;
  SetEngineSettings(
      EngineSettingsFromEnvironment([](const char* name) { return std::getenv(name); }));
  std::string dir, shape = "qwen2.5-1.5b", backend = "auto";
  int64_t seq = 4096, tokens = 65536, before = 4, after = 3;
  double max_grad_norm = 0.0;
  bool verify = true;
  std::vector<int> compare_threads;
  CLI::App app{"checkpoint_bench: a checkpoint written while training runs"};
  app.add_option("--dir", dir, "scratch folder (data, spec, checkpoints)")->required();
  app.add_option("--shape", shape, "qwen2.5-1.5b | qwen2.5-7b | llama-3.1-8b");
  app.add_option("--backend", backend, "auto | cuda | cpu");
  app.add_option("--seq", seq);
  app.add_option("--tokens-per-step", tokens);
  app.add_option("--before", before, "steps before the checkpoint (the first is warm-up)");
  app.add_option("--after", after, "steps after the checkpoint is committed");
  app.add_option("--max-grad-norm", max_grad_norm, "global-norm clipping (0 = off)");
  app.add_option("--verify", verify, "also take the stopped checkpoint and compare (1/0)");
  app.add_option("--compare-threads", compare_threads,
                 "after the second checkpoint, one more with each of these writer-thread counts");
  CLI11_PARSE(app, argc, argv);
  ModelConfig config;
  if (!NamedShape(shape, &config)) {
    std::fprintf(stderr, "unknown --shape %s\n", shape.c_str());
    return 2;
  }
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    // Random printable bytes (the byte tokenizer: one token each), enough for every step.
    std::ofstream data(fs::path(dir) / "data.jsonl");
    std::mt19937_64 gen(7);
    const int64_t lines = (before + after + 40) * tokens / 4000 + 1;
    for (int64_t i = 0; i < lines; ++i) {
      std::string text(4000, ' ');
      for (char& ch : text) ch = static_cast<char>('a' + gen() % 26);
      data << nlohmann::json{{"text", text}}.dump() << "\n";
    }
  }
  const std::string yaml =
      "name: checkpoint-bench\n"
      "model: {config: " + ModelConfigToJson(config) + ", init_seed: 1}\n"
      "data: {path: data.jsonl, seq_len: " + std::to_string(seq) + ", tokenizer: byte}\n"
      "train: {steps: 1000000, tokens_per_step: " + std::to_string(tokens) +
      ", lr: 1.0e-5, max_grad_norm: " + std::to_string(max_grad_norm) + "}\n"
      "checkpoint: {dir: ckpt, every_steps: 0, keep_last: 0}\n"
      "backend: " + backend + "\n";
  absl::StatusOr<JobSpec> spec = ParseJobSpec(yaml, dir);
  if (!spec.ok()) {
    std::fprintf(stderr, "spec: %s\n", spec.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<std::unique_ptr<Trainer>> created = Trainer::Create(*spec);
  if (!created.ok()) {
    std::fprintf(stderr, "%s\n", created.status().ToString().c_str());
    return 1;
  }
  Trainer& t = **created;
  std::fprintf(stderr, "%s", t.plan_text().c_str());
  auto step = [&]() -> StepReport {
    absl::StatusOr<StepReport> r = t.Step();
    if (!r.ok()) {
      std::fprintf(stderr, "step: %s\n", r.status().ToString().c_str());
      std::exit(1);
    }
    if (!r->checkpoint_error.empty()) std::fprintf(stderr, "%s\n", r->checkpoint_error.c_str());
    std::fprintf(stderr, "step %lld: %.3f s, waited %.3f s%s\n",
                 static_cast<long long>(r->step), r->seconds, r->checkpoint_wait_seconds,
                 r->checkpoint_paths.empty() ? "" : ", checkpoint committed");
    return *r;
  };

  nlohmann::json out = {{"bench", "checkpoint"}, {"shape", shape},
                        {"backend", t.backend_name()}, {"seq", seq},
                        {"tokens_per_step", tokens}, {"parameters", t.num_parameters()},
                        {"max_grad_norm", max_grad_norm}};
  // Runs steps until the background checkpoint asked for before the first is committed;
  // returns the step times and update waits, and its path.
  auto run_background = [&](std::vector<double>* seconds, std::vector<double>* waits,
                            bool stop_after_first) -> std::string {
    t.CheckpointNextStep();
    for (;;) {
      const StepReport r = step();
      seconds->push_back(r.seconds);
      waits->push_back(r.checkpoint_wait_seconds);
      if (!r.checkpoint_error.empty()) std::exit(1);
      if (!r.checkpoint_paths.empty()) return r.checkpoint_paths.back();
      if (stop_after_first && seconds->size() == 1) return std::string();
    }
  };

  // The cost: steps before, during and after a background checkpoint; twice, since the
  // first checkpoint of a process can be slower (on a fresh virtual machine the page cache
  // is memory the hypervisor has not backed yet).
  std::vector<double> base;
  for (int64_t i = 0; i < before; ++i) {
    const StepReport r = step();
    if (i > 0) base.push_back(r.seconds);
  }
  out["step_seconds_before"] = base;
  out["mean_step_seconds_before"] = Mean(base);
  std::vector<double> outside = base;  // steps with no checkpoint being written
  std::vector<std::string> runs = {"first", "second"};
  for (int n : compare_threads) runs.push_back("threads_" + std::to_string(n));
  for (const std::string& which : runs) {
    if (which.rfind("threads_", 0) == 0) t.set_checkpoint_writer_threads(std::stoi(which.substr(8)));
    std::vector<double> during, waits;
    const std::string live = run_background(&during, &waits, false);
    std::vector<double> later;
    for (int64_t i = 0; i < after; ++i) later.push_back(step().seconds);
    const double during_mean = Mean(during);
    nlohmann::json run;
    run["checkpoint_step"] = std::stoll(fs::path(live).filename().string().substr(11));
    run["step_seconds_during"] = during;
    run["step_seconds_after"] = later;
    run["update_wait_seconds_during"] = waits;
    run["mean_step_seconds_during"] = during_mean;
    run["mean_step_seconds_after"] = Mean(later);
    outside.insert(outside.end(), later.begin(), later.end());
    run["background_checkpoint_seconds"] = t.last_checkpoint_seconds();
    run["background_capture_seconds"] = t.last_checkpoint_capture_seconds();
    run["checkpoint_bytes"] = t.last_checkpoint_bytes();
    run["checkpoint_gb_per_s"] = t.last_checkpoint_bytes() / 1e9 / t.last_checkpoint_seconds();
    nlohmann::json units = nlohmann::json::array();
    for (const auto& u : t.last_checkpoint_unit_times()) units.push_back({u.ready, u.written});
    run["unit_ready_and_written_seconds"] = units;  // embedding, layers, head
    out[which] = run;
    fs::remove_all(live);  // the disk holds only so many of them
  }
  // The reference: every step with no checkpoint being written (before and after both,
  // since a step's time drifts over a run).
  const double reference = Mean(outside);
  out["reference_step_seconds"] = reference;
  for (const std::string& which : runs) {
    nlohmann::json& run = out[which];
    const std::vector<double> during = run["step_seconds_during"].get<std::vector<double>>();
    const double mean = Mean(during);
    // Steps per second while the checkpoint was written, against the reference; and the
    // training time it cost in all.
    run["step_rate_drop"] = mean > 0 ? 1.0 - reference / mean : 0.0;
    run["extra_seconds"] = (mean - reference) * during.size();
  }

  // Equality: a background checkpoint of step S against one taken with training stopped
  // after S (while the background one is still being written), byte for byte.
  t.set_checkpoint_writer_threads(0);
  if (verify) {
    std::vector<double> seconds, waits2;
    run_background(&seconds, &waits2, /*stop_after_first=*/true);
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<std::string> stopped = t.SaveCheckpointTo((fs::path(dir) / "stopped").string());
    if (!stopped.ok()) {
      std::fprintf(stderr, "stopped checkpoint: %s\n", stopped.status().ToString().c_str());
      return 1;
    }
    out["stopped_checkpoint_seconds"] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::string background;
    while (background.empty()) {
      const StepReport r = step();
      if (!r.checkpoint_error.empty()) return 1;
      if (!r.checkpoint_paths.empty()) background = r.checkpoint_paths.back();
    }
    int64_t files = 0, bytes = 0;
    out["verified_step"] = std::stoll(fs::path(*stopped).filename().string().substr(11));
    out["identical_to_stopped"] = SameFiles(*stopped, background, &files, &bytes);
    out["compared_files"] = files;
    out["compared_bytes"] = bytes;
  }
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
