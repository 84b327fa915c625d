// megatrain-generate: completions of prompts by a model folder or a job's checkpoint, on one
// device, without the daemon (engine.h's GenerationJob).
//
//   megatrain-generate MODEL_DIR --prompt "Once upon a time" [--prompt ...]
//   megatrain-generate MODEL_DIR --prompts prompts.jsonl --output completions.jsonl
//       [--max-new-tokens 256] [--temperature 0] [--top-k 0] [--top-p 1] [--seed 0]
//       [--stop STR]... [--stop-id ID]... [--ignore-eos] [--chat]
//       [--tokenizer auto|byte|model|PATH]
//       [--backend auto|cpu|cuda:N] [--max-sequences N] [--score [--answer-pattern RE]]
//
// A prompts file holds one JSON object a line: {"prompt": "text"}, {"input_ids": [ids]}, or
// with --chat {"messages": [{"role": "user", "content": "..."}]} (a "prompt" is then one
// user message). --chat renders the model's chat template with its generation prompt;
// without it a prompt is [bos] + its tokens. Generation stops at the tokenizer's
// end-of-sequence id unless --ignore-eos, as transformers' generate does. Each completion is
// a JSON line: index, prompt, completion, finish_reason ("stop" | "length"), ids and their
// log-probabilities. --score compares
// each completion's answer (its last number, or --answer-pattern's last match) with the
// line's "answer" (exact match, numbers as numbers), adds answer, extracted and correct to
// its line, and prints {"prompts", "correct", "accuracy"}. Exit codes: 0 done, 2 bad input,
// 1 a failure.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "CLI/CLI.hpp"
#include "engine/common/engine_settings.h"
#include "engine/common/printable.h"
#include "engine/engine.h"
#include "nlohmann/json.hpp"

namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "error: %s\n", megatrain::Printable(s.ToString()).c_str());
  return s.code() == absl::StatusCode::kInvalidArgument ||
                 s.code() == absl::StatusCode::kNotFound
             ? 2
             : 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace megatrain;
  SetEngineSettings(
      EngineSettingsFromEnvironment([](const char* name) { return std::getenv(name); }));
  GenerateSpec spec;
  CLI::App app{"megatrain-generate: completions of prompts by a model or checkpoint folder"};
  app.add_option("model", spec.model_path, "a Hugging Face model folder or a job's checkpoint")
      ->required();
  app.add_option("--prompt", spec.prompts, "a prompt (repeatable)");
  app.add_option("--prompts", spec.prompts_path,
                 "a JSONL file of {\"prompt\"}, {\"messages\"} or {\"input_ids\"}");
  app.add_option("--output", spec.output_path, "write completions as JSONL here (else print them)");
  app.add_option("--max-new-tokens", spec.max_new_tokens);
  app.add_option("--temperature", spec.temperature, "0 = greedy");
  app.add_option("--top-k", spec.top_k, "0 = off");
  app.add_option("--top-p", spec.top_p, "nucleus mass in (0, 1]");
  app.add_option("--seed", spec.seed, "the same seed gives the same text");
  app.add_option("--stop", spec.stop_strings, "a stop string (repeatable)");
  app.add_option("--stop-id", spec.stop_ids, "a stop token id (repeatable)");
  app.add_flag("--ignore-eos", spec.ignore_eos, "do not stop at the tokenizer's end-of-sequence id");
  app.add_flag("--chat", spec.chat, "apply the model's chat template");
  app.add_flag("--score", spec.score,
               "exact match against each line's \"answer\"; prints the accuracy as JSON");
  app.add_option("--answer-pattern", spec.answer_pattern,
                 "with --score: a regex whose last match (its first group) is a completion's "
                 "answer; default: its last number");
  app.add_option("--tokenizer", spec.tokenizer, "auto | byte | model | a tokenizer.json");
  app.add_option("--backend", spec.backend, "auto | cpu | cuda | cuda:N");
  app.add_option("--max-sequences", spec.max_sequences, "sequences at once; 0 = as many as fit");
  CLI11_PARSE(app, argc, argv);

  absl::StatusOr<std::unique_ptr<GenerationJob>> job = GenerationJob::Create(spec, RunOptions{});
  if (!job.ok()) return Fail(job.status());
  std::fprintf(stderr, "%s\n", (*job)->Describe().c_str());
  const bool print = spec.output_path.empty() && !spec.score;
  absl::StatusOr<GenerationSummary> summary = (*job)->Run([&](const CompletionReport& c) {
    if (print) std::printf("%s\n", c.text.c_str());
  });
  if (!summary.ok()) return Fail(summary.status());
  if (spec.score) {
    std::printf("%s\n", nlohmann::json{{"prompts", summary->prompts},
                                       {"correct", summary->correct},
                                       {"accuracy", summary->accuracy}}
                            .dump()
                            .c_str());
  }
  return 0;
}
