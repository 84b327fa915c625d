// One function per `megatrain` subcommand. Each takes the shared Context plus its own
// parsed arguments, prints its result (table or JSON per ctx.output) to stdout and errors
// to stderr, and returns the process exit code (exit_codes.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "client/context.h"

namespace megatrain::client {

struct SubmitArgs {
  std::string spec_path;  // the YAML job spec
  int32_t priority = 0;
  bool hold = false;
  bool watch = false;  // continue as `watch` on the new job
};
int Submit(const Context& ctx, const SubmitArgs& args);
// How the daemon would run a spec: batch split, memory, predicted step and its bound.
int Plan(const Context& ctx, const std::string& spec_path);

struct ListArgs {
  std::vector<std::string> states;  // StateName()s; empty: all
  std::string owner;                // empty: everyone's
  bool mine = false;                // owner = ctx.user
  int32_t limit = 100;              // jobs per page
  bool all_pages = false;
};
int List(const Context& ctx, const ListArgs& args);

int Status(const Context& ctx, int64_t job_id);

// Streams the job's events until it ends; the exit code is the job's outcome.
int Watch(const Context& ctx, int64_t job_id);

// The exit code of a finished job as `watch` gives it from `last`, the job's latest state
// (nullopt: none was received): 0 succeeded, 10 failed, 11 cancelled, 1 not finished.
// Prints why to stderr for all but success and cancellation.
int JobOutcome(const std::optional<v1::Job>& last, int64_t job_id);

int Logs(const Context& ctx, int64_t job_id, bool follow);

int Cancel(const Context& ctx, int64_t job_id);
int Checkpoint(const Context& ctx, int64_t job_id);
int Hold(const Context& ctx, int64_t job_id);
int Release(const Context& ctx, int64_t job_id);

int Node(const Context& ctx);

// Generate and eval jobs (generate_commands.cc): a job of kind generate or eval built from
// the command line and submitted with the caller's working folder as its base_dir (the
// daemon resolves relative paths against it); then, unless detached, its log is followed
// and each completion printed as it finishes.
struct GenerateArgs {
  std::string model;                 // the model or checkpoint folder, as given
  std::vector<std::string> prompts;  // --prompt, completed before the file's
  std::string prompts_path;          // --prompts: JSONL; eval: each line with an "answer"
  std::string output_path;           // completions JSONL; "" = <job folder>/completions.jsonl
  int64_t max_new_tokens = 0;        // 0 = the daemon's default (256)
  double temperature = 0;            // 0 = greedy
  int64_t top_k = 0;                 // 0 = off
  std::optional<double> top_p;       // unset = 1
  uint64_t seed = 0;                 // of the sampling
  std::vector<std::string> stop;     // stop strings
  std::vector<int32_t> stop_ids;     // stop token ids
  bool ignore_eos = false;           // keep going past the end-of-sequence token
  bool chat = false;                 // apply the model's chat template
  std::string tokenizer;             // auto | byte | model | a tokenizer.json; "" = auto
  int64_t max_sequences = 0;         // decoded at once; 0 = as many as fit
  std::string answer_pattern;        // eval: regex whose last match (group 1) is the answer
  std::string name;                  // "" = the kind ("generate", "eval")
  int32_t priority = 0;              // as submit's
  bool detach = false;               // print the submitted job and return
};
// Table output: each completion's text ("[index] " first when there may be several);
// JSON: each completion's JSON line as the daemon logged it. The exit code is the job's
// outcome, as `watch`'s.
int Generate(const Context& ctx, const GenerateArgs& args);
// Prints no completions in table mode (JSON: each one's line), then the accuracy:
// "accuracy: C/N = 0.xxxx", or {"prompts": N, "correct": C, "accuracy": X}.
int Eval(const Context& ctx, const GenerateArgs& args);

// Access (access_commands.cc): who the daemon takes you for, tokens for TCP, the audit
// log (admins) and fair-share usage.
int WhoAmI(const Context& ctx);
struct TokenArgs {
  std::string action;  // create | list | revoke
  std::string user;    // create/list: another user's (admins); list: "*" for all
  std::string name;    // create: a label
  int64_t id = 0;      // revoke
};
int Token(const Context& ctx, const TokenArgs& args);
struct AuditArgs {
  int32_t limit = 50;
  std::string user;
  int64_t job_id = 0;
};
int Audit(const Context& ctx, const AuditArgs& args);
int Usage(const Context& ctx);

}  // namespace megatrain::client
