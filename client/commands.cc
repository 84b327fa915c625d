// The request/reply subcommands: submit, list, status, cancel, checkpoint, hold, release,
// node. (The streaming ones, watch and logs, are in watch.cc.) Each builds its request,
// makes one call (list: one per page), and prints the reply as table text or JSON.
#include "client/commands.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/exit_codes.h"
#include "client/format.h"
#include "client/views.h"

namespace megatrain::client {
namespace {

// gRPC's default limit on a received message; the daemon keeps it.
constexpr size_t kMaxSpecBytes = 4 << 20;

int64_t NowUnixMs() { return absl::ToUnixMillis(absl::Now()); }

// Reads all of `path` into `*text`. On failure prints why and returns false.
bool ReadSpecFile(const std::string& path, std::string* text) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f != nullptr) {
    char buf[1 << 16];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0 && text->size() <= kMaxSpecBytes) {
      text->append(buf, n);
    }
    const bool failed = std::ferror(f) != 0;
    const int err = errno;
    std::fclose(f);
    if (!failed && text->size() <= kMaxSpecBytes) return true;
    if (!failed) {
      std::fprintf(stderr,
                   "error: %s is larger than %zu MiB; is it the job spec? give the YAML file\n",
                   path.c_str(), kMaxSpecBytes >> 20);
      return false;
    }
    errno = err;
  }
  std::fprintf(stderr, "error: cannot read job spec %s: %s; give the path of a YAML job spec\n",
               path.c_str(), std::strerror(errno));
  return false;
}

// Prints a job as JSON, or as the line `format` makes of it.
int PrintJob(const Context& ctx, const v1::Job& job, std::string (*format)(const v1::Job&)) {
  if (ctx.output == Output::kJson) return PrintJson(job) ? kExitOk : kExitInternal;
  PrintLine(format(job));
  return kExitOk;
}

// One call that changes a job and returns it: `rpc(call, &job)` makes the call.
template <typename Rpc>
int ChangeJob(const Context& ctx, CallKind kind, Rpc rpc) {
  if (kind != CallKind::kReply && !WaitForConnection(ctx)) return kExitUnreachable;
  auto call = NewCall(ctx, kind);
  v1::Job job;
  const grpc::Status status = rpc(call.get(), &job);
  if (!status.ok()) return ReportRpcError(ctx, status);
  return PrintJob(ctx, job, FormatJobState);
}

}  // namespace

namespace {

// The request for a spec file: its text and the folder its relative paths resolve against.
bool SpecRequest(const std::string& path, v1::SubmitJobRequest* request) {
  if (!ReadSpecFile(path, request->mutable_spec_yaml())) return false;
  std::error_code ec;
  const std::filesystem::path spec = std::filesystem::absolute(path, ec);
  if (ec) {
    std::fprintf(stderr, "error: cannot resolve the folder of %s: %s\n", path.c_str(),
                 ec.message().c_str());
    return false;
  }
  request->set_base_dir(spec.lexically_normal().parent_path().string());
  return true;
}

}  // namespace

int Plan(const Context& ctx, const std::string& spec_path) {
  v1::SubmitJobRequest request;
  if (!SpecRequest(spec_path, &request)) return kExitUsage;
  auto call = NewCall(ctx, CallKind::kReply);
  v1::JobPlan plan;
  const grpc::Status status = ctx.jobs->PlanJob(call.get(), request, &plan);
  if (!status.ok()) return ReportRpcError(ctx, status);
  if (ctx.output == Output::kJson) return PrintJson(plan) ? kExitOk : kExitInternal;
  std::fputs(TerminalLines(plan.text()).c_str(), stdout);
  return kExitOk;
}

int Submit(const Context& ctx, const SubmitArgs& args) {
  v1::SubmitJobRequest request;
  if (!SpecRequest(args.spec_path, &request)) return kExitUsage;
  request.set_priority(args.priority);
  request.set_hold(args.hold);

  auto call = NewCall(ctx, CallKind::kReply);
  v1::Job job;
  const grpc::Status status = ctx.jobs->SubmitJob(call.get(), request, &job);
  if (!status.ok()) return ReportRpcError(ctx, status);
  for (const std::string& w : job.plan().warnings()) {
    std::fprintf(stderr, "warning: %s\n", TerminalText(w).c_str());
  }
  const int rc = PrintJob(ctx, job, FormatSubmitted);
  std::fflush(stdout);
  if (rc != kExitOk || !args.watch) return rc;
  return Watch(ctx, job.id());
}

int List(const Context& ctx, const ListArgs& args) {
  v1::ListJobsRequest request;
  for (const std::string& name : args.states) {
    v1::JobState state;
    if (!ParseStateName(name, &state)) {
      std::fprintf(stderr, "error: unknown state '%s'; use one of: %s\n", name.c_str(),
                   absl::StrJoin(StateNames(), ", ").c_str());
      return kExitUsage;
    }
    request.add_states(state);
  }
  request.set_owner(args.mine ? ctx.user : args.owner);
  request.set_page_size(args.limit);

  std::vector<v1::Job> jobs;
  v1::ListJobsResponse response;
  do {
    auto call = NewCall(ctx, CallKind::kReply);
    const grpc::Status status = ctx.jobs->ListJobs(call.get(), request, &response);
    if (!status.ok()) return ReportRpcError(ctx, status);
    if (ctx.output == Output::kJson) {
      if (!PrintJson(response)) return kExitInternal;
    } else {
      jobs.insert(jobs.end(), response.jobs().begin(), response.jobs().end());
    }
    if (!response.next_page_token().empty() && response.next_page_token() == request.page_token()) {
      std::fprintf(stderr, "error: megatraind returned the same page twice; stopping\n");
      return kExitInternal;
    }
    request.set_page_token(response.next_page_token());
  } while (args.all_pages && !response.next_page_token().empty());

  if (ctx.output == Output::kJson) return kExitOk;
  if (jobs.empty()) {
    PrintLine("no jobs");
    return kExitOk;
  }
  PrintLine(FormatJobTable(jobs, NowUnixMs()));
  if (!response.next_page_token().empty()) {
    // The daemon may send fewer than asked: a page stops short of its size limit.
    std::fprintf(stderr, "(the newest %zu shown; --all-pages lists every job)\n", jobs.size());
  }
  return kExitOk;
}

int Status(const Context& ctx, int64_t job_id) {
  v1::GetJobRequest request;
  request.set_id(job_id);
  auto call = NewCall(ctx, CallKind::kReply);
  v1::Job job;
  const grpc::Status status = ctx.jobs->GetJob(call.get(), request, &job);
  if (!status.ok()) return ReportRpcError(ctx, status);
  if (ctx.output == Output::kJson) return PrintJson(job) ? kExitOk : kExitInternal;
  PrintLine(FormatJobStatus(job, NowUnixMs(), absl::LocalTimeZone()));
  return kExitOk;
}

// Cancel, checkpoint and hold may wait for the running step to end (and a checkpoint to
// be written): no deadline unless --timeout is given.
int Cancel(const Context& ctx, int64_t job_id) {
  return ChangeJob(ctx, CallKind::kLong, [&](grpc::ClientContext* call, v1::Job* job) {
    v1::CancelJobRequest request;
    request.set_id(job_id);
    return ctx.jobs->CancelJob(call, request, job);
  });
}

int Hold(const Context& ctx, int64_t job_id) {
  return ChangeJob(ctx, CallKind::kLong, [&](grpc::ClientContext* call, v1::Job* job) {
    v1::HoldJobRequest request;
    request.set_id(job_id);
    return ctx.jobs->HoldJob(call, request, job);
  });
}

int Release(const Context& ctx, int64_t job_id) {
  return ChangeJob(ctx, CallKind::kReply, [&](grpc::ClientContext* call, v1::Job* job) {
    v1::ReleaseJobRequest request;
    request.set_id(job_id);
    return ctx.jobs->ReleaseJob(call, request, job);
  });
}

int Checkpoint(const Context& ctx, int64_t job_id) {
  if (!WaitForConnection(ctx)) return kExitUnreachable;
  v1::CheckpointJobRequest request;
  request.set_id(job_id);
  auto call = NewCall(ctx, CallKind::kLong);
  v1::CheckpointJobResponse response;
  const grpc::Status status = ctx.jobs->CheckpointJob(call.get(), request, &response);
  if (!status.ok()) return ReportRpcError(ctx, status);
  if (ctx.output == Output::kJson) return PrintJson(response) ? kExitOk : kExitInternal;
  PrintLine(TerminalText(response.path()));  // the path alone, for $(megatrain checkpoint 12)
  return kExitOk;
}

int Node(const Context& ctx) {
  auto call = NewCall(ctx, CallKind::kReply);
  v1::Node node;
  const grpc::Status status = ctx.node->GetNode(call.get(), v1::GetNodeRequest(), &node);
  if (!status.ok()) return ReportRpcError(ctx, status);
  if (ctx.output == Output::kJson) return PrintJson(node) ? kExitOk : kExitInternal;
  PrintLine(FormatNode(node));
  return kExitOk;
}

}  // namespace megatrain::client
