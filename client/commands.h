// One function per `megatrain` subcommand. Each takes the shared Context plus its own
// parsed arguments, prints its result (table or JSON per ctx.output) to stdout and errors
// to stderr, and returns the process exit code (exit_codes.h).
#pragma once

#include <cstdint>
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

int Logs(const Context& ctx, int64_t job_id, bool follow);

int Cancel(const Context& ctx, int64_t job_id);
int Checkpoint(const Context& ctx, int64_t job_id);
int Hold(const Context& ctx, int64_t job_id);
int Release(const Context& ctx, int64_t job_id);

int Node(const Context& ctx);

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
