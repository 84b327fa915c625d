// megatrain-train: runs one job spec locally, in this process, to the end.
//
//   megatrain-train job.yaml        train; resumes when checkpoint.dir has a checkpoint
//   megatrain-train --demo          write and run the embedded demo job (--demo-dir)
//   megatrain-train --demo --write-only   only write it (for `megatrain submit`)
//
// Exit codes: 0 done, 1 training failed, 2 bad command line or job spec.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "CLI/CLI.hpp"
#include "engine/common/engine_settings.h"
#include "engine/common/printable.h"
#include "engine/engine.h"
#include "engine/tools/demo.h"

namespace {

// A step's line (every `log_every` steps, the first and the last) and its evaluations.
void PrintReport(const megatrain::StepReport& r, int64_t log_every) {
  for (const megatrain::EvalReport& e : r.evals) {
    if (e.has_preference) {  // a DPO job's eval pairs
      std::printf("eval  %5lld/%lld  loss %.4f  rewards/accuracies %.3f  rewards/margins %.4f  "
                  "(%lld pairs, %.3f s)\n",
                  static_cast<long long>(e.step), static_cast<long long>(r.total_steps), e.loss,
                  e.preference.rewards_accuracies, e.preference.rewards_margins,
                  static_cast<long long>(e.preference.pairs), e.seconds);
      continue;
    }
    std::printf("eval  %5lld/%lld  loss %.4f  perplexity %.3f  (%lld targets, %.3f s, %.0f tok/s)\n",
                static_cast<long long>(e.step), static_cast<long long>(r.total_steps), e.loss,
                e.perplexity, static_cast<long long>(e.targets), e.seconds, e.tokens_per_second);
  }
  if (r.step % log_every == 0 || r.step == 1 || r.step == r.total_steps) {
    std::string aux = r.has_aux_loss ? "  aux_loss " + std::to_string(r.aux_loss) : std::string();
    if (r.has_preference) {  // a DPO job: TRL's step metrics
      char dpo[160];
      std::snprintf(dpo, sizeof(dpo), "  rewards/accuracies %.3f  rewards/margins %.4f",
                    r.preference.rewards_accuracies, r.preference.rewards_margins);
      aux += dpo;
    }
    std::printf("step %5lld/%lld  loss %.4f%s  lr %.3e  grad_norm %.3f  %.0f tok/s  %.3f TFLOP/s\n",
                static_cast<long long>(r.step), static_cast<long long>(r.total_steps), r.loss,
                aux.c_str(), r.lr, r.grad_norm, r.tokens_per_second, r.model_tflops);
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  // The engine's settings from the environment (engine/common/engine_settings.h).
  megatrain::SetEngineSettings(megatrain::EngineSettingsFromEnvironment(
      [](const char* name) { return std::getenv(name); }));
  megatrain::SetCollectiveDefaults();  // before any thread
  CLI::App app{"megatrain-train: run one megatrain job locally"};
  std::string spec_path;
  std::string demo_dir = "megatrain-demo";
  bool demo = false;
  bool write_only = false;
  int64_t demo_steps = 200;
  int64_t max_steps = 0;
  int64_t log_every = 10;
  app.add_option("spec", spec_path, "job spec (YAML)");
  app.add_flag("--demo", demo, "write the embedded demo job into --demo-dir and run it");
  app.add_option("--demo-dir", demo_dir, "folder for the demo job")->capture_default_str();
  app.add_option("--demo-steps", demo_steps, "steps of the demo job")->capture_default_str();
  app.add_flag("--write-only", write_only, "with --demo: write the demo job's files and exit");
  app.add_option("--max-steps", max_steps, "stop after this many steps in this run (0 = all)");
  app.add_option("--log-every", log_every, "print every this many steps (and the first, the last)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  if (demo) {
    std::error_code ec;  // the demo always starts fresh
    std::filesystem::remove_all(std::filesystem::path(demo_dir) / "checkpoints", ec);
    absl::StatusOr<std::string> p = megatrain::WriteDemoJob(demo_dir, demo_steps);
    if (!p.ok()) {
      std::fprintf(stderr, "error: %s\n", std::string(p.status().message()).c_str());
      return 1;
    }
    spec_path = *p;
    if (write_only) {
      std::printf("%s\n", spec_path.c_str());
      return 0;
    }
  }
  if (spec_path.empty()) {
    std::fprintf(stderr, "error: give a job spec, or --demo\n%s", app.help().c_str());
    return 2;
  }
  absl::StatusOr<megatrain::JobSpec> spec = megatrain::LoadJobSpec(spec_path);
  if (!spec.ok()) {
    std::fprintf(stderr, "error: %s\n", megatrain::Printable(spec.status().ToString()).c_str());
    return 2;
  }
  absl::StatusOr<std::unique_ptr<megatrain::TrainingJob>> job =
      megatrain::TrainingJob::Create(*spec, megatrain::RunOptions{});
  if (!job.ok()) {
    std::fprintf(stderr, "error: %s\n", megatrain::Printable(job.status().ToString()).c_str());
    return 2;
  }
  megatrain::TrainingJob& t = **job;
  const megatrain::JobDescription d = t.Describe();
  std::printf("job %s: %s, %.2fM parameters, %s backend, %lld tokens/step, %lld steps%s\n",
              spec->name.c_str(), d.architecture.c_str(), d.num_parameters / 1e6,
              d.backend_name.c_str(), static_cast<long long>(d.tokens_per_step),
              static_cast<long long>(spec->steps),
              d.resumed_from_step > 0
                  ? (", resumed at step " + std::to_string(d.resumed_from_step)).c_str()
                  : "");
  std::printf("%s\n", d.dataset_summary.c_str());
  if (!d.eval_summary.empty()) std::printf("%s\n", d.eval_summary.c_str());
  std::printf("%s", d.plan_text.c_str());
  int64_t ran = 0;
  while (!t.done() && (max_steps == 0 || ran < max_steps)) {
    absl::StatusOr<megatrain::StepReport> r = t.Step();
    if (!r.ok()) {
      std::fprintf(stderr, "error at step %lld: %s\n", static_cast<long long>(t.step() + 1),
                   megatrain::Printable(r.status().ToString()).c_str());
      return 1;
    }
    if (!r->checkpoint_error.empty()) std::fprintf(stderr, "%s\n", r->checkpoint_error.c_str());
    ++ran;
    PrintReport(*r, log_every);
  }
  if (!t.done() && !spec->checkpoint_dir.empty()) {
    absl::StatusOr<std::string> path = t.SaveCheckpoint();
    if (!path.ok()) {
      std::fprintf(stderr, "error: %s\n", megatrain::Printable(path.status().ToString()).c_str());
      return 1;
    }
    std::printf("stopped at step %lld, checkpoint %s\n", static_cast<long long>(t.step()),
                path->c_str());
  } else if (!spec->checkpoint_dir.empty()) {
    std::printf("done; checkpoints in %s\n", spec->checkpoint_dir.c_str());
  }
  return 0;
}
