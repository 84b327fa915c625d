// `megatrain whoami | token | audit | usage`. Every name, detail and outcome the daemon
// sends is printed through TerminalText(): a user name or an audit detail can hold ESC.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "client/commands.h"
#include "client/exit_codes.h"
#include "client/format.h"

namespace megatrain::client {
namespace {

std::string When(int64_t unix_ms) {
  if (unix_ms == 0) return "never";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMillis(unix_ms),
                          absl::LocalTimeZone());
}

std::string GiB(int64_t bytes) {
  return bytes == 0 ? "-" : absl::StrFormat("%.1f", bytes / double(1ll << 30));
}

std::string Limit(int64_t v) { return v == 0 ? "-" : std::to_string(v); }

}  // namespace

int WhoAmI(const Context& ctx) {
  auto call = NewCall(ctx, CallKind::kReply);
  v1::Identity me;
  const grpc::Status status = ctx.access->WhoAmI(call.get(), v1::WhoAmIRequest(), &me);
  if (!status.ok()) return ReportRpcError(ctx, status);
  if (ctx.output == Output::kJson) return PrintJson(me) ? kExitOk : kExitInternal;
  std::vector<std::string> groups;
  for (const std::string& group : me.groups()) groups.push_back(TerminalText(group));
  PrintLine(absl::StrCat(TerminalText(me.user()), " (uid ", me.uid(), ")",
                         me.admin() ? ", admin" : "", "\ngroups: ", absl::StrJoin(groups, " "),
                         "\nauthenticated by ", TerminalText(me.authenticated_by())));
  return kExitOk;
}

int Token(const Context& ctx, const TokenArgs& args) {
  auto call = NewCall(ctx, CallKind::kReply);
  if (args.action == "create") {
    v1::CreateTokenRequest request;
    request.set_user(args.user);
    request.set_name(args.name);
    v1::CreateTokenResponse created;
    const grpc::Status status = ctx.access->CreateToken(call.get(), request, &created);
    if (!status.ok()) return ReportRpcError(ctx, status);
    if (ctx.output == Output::kJson) return PrintJson(created) ? kExitOk : kExitInternal;
    PrintLine(TerminalText(created.secret()));
    std::fprintf(stderr,
                 "token %lld for %s: shown once, store it now (e.g. in ~/.config/megatrain/token, "
                 "mode 600)\n",
                 static_cast<long long>(created.token().id()),
                 TerminalText(created.token().user()).c_str());
    return kExitOk;
  }
  if (args.action == "list") {
    v1::ListTokensRequest request;
    request.set_user(args.user);
    v1::ListTokensResponse tokens;
    const grpc::Status status = ctx.access->ListTokens(call.get(), request, &tokens);
    if (!status.ok()) return ReportRpcError(ctx, status);
    if (ctx.output == Output::kJson) return PrintJson(tokens) ? kExitOk : kExitInternal;
    std::string out = absl::StrFormat("%-5s %-12s %-16s %-20s %s\n", "ID", "USER", "NAME",
                                      "CREATED", "LAST USED");
    for (const v1::Token& t : tokens.tokens()) {
      absl::StrAppendFormat(&out, "%-5d %-12s %-16s %-20s %s\n", t.id(), TerminalText(t.user()),
                            TerminalText(t.name()), When(t.created_unix_ms()),
                            When(t.last_used_unix_ms()));
    }
    std::fputs(out.c_str(), stdout);
    return kExitOk;
  }
  v1::RevokeTokenRequest request;
  request.set_id(args.id);
  v1::RevokeTokenResponse revoked;
  const grpc::Status status = ctx.access->RevokeToken(call.get(), request, &revoked);
  if (!status.ok()) return ReportRpcError(ctx, status);
  if (ctx.output == Output::kJson) return PrintJson(revoked) ? kExitOk : kExitInternal;
  PrintLine(absl::StrCat("revoked token ", args.id));
  return kExitOk;
}

int Audit(const Context& ctx, const AuditArgs& args) {
  auto call = NewCall(ctx, CallKind::kReply);
  v1::ListAuditRequest request;
  request.set_limit(args.limit);
  request.set_user(args.user);
  request.set_job_id(args.job_id);
  v1::ListAuditResponse log;
  const grpc::Status status = ctx.access->ListAudit(call.get(), request, &log);
  if (!status.ok()) return ReportRpcError(ctx, status);
  if (ctx.output == Output::kJson) {
    for (const v1::AuditEntry& e : log.entries()) {
      if (!PrintJson(e)) return kExitInternal;
    }
    return kExitOk;
  }
  std::string out = absl::StrFormat("%-20s %-12s %-13s %-5s %-30s %s\n", "TIME", "USER", "ACTION",
                                    "JOB", "DETAIL", "OUTCOME");
  for (const v1::AuditEntry& e : log.entries()) {
    absl::StrAppendFormat(&out, "%-20s %-12s %-13s %-5s %-30s %s\n", When(e.unix_ms()),
                          TerminalText(e.user()), TerminalText(e.action()),
                          e.job_id() == 0 ? "-" : std::to_string(e.job_id()),
                          TerminalText(e.detail()), TerminalText(e.outcome()));
  }
  std::fputs(out.c_str(), stdout);
  return kExitOk;
}

int Usage(const Context& ctx) {
  auto call = NewCall(ctx, CallKind::kReply);
  v1::GetUsageResponse usage;
  const grpc::Status status = ctx.access->GetUsage(call.get(), v1::GetUsageRequest(), &usage);
  if (!status.ok()) return ReportRpcError(ctx, status);
  if (ctx.output == Output::kJson) return PrintJson(usage) ? kExitOk : kExitInternal;
  std::string out = absl::StrFormat(
      "fair share: least recent device time first (half-life %g h)\n%-12s %10s %8s %7s %9s  "
      "%s\n",
      usage.half_life_hours(), "USER", "GPU-HOURS", "RUNNING", "QUEUED", "HOST GiB",
      "LIMITS (running/queued/host GiB/priority)");
  for (const v1::UserUsage& u : usage.users()) {
    absl::StrAppendFormat(&out, "%-12s %10.3f %8d %7d %9s  %s/%s/%s/%d\n", TerminalText(u.user()),
                          u.gpu_hours(), u.running_jobs(), u.queued_jobs(),
                          GiB(u.running_host_bytes()), Limit(u.max_running_jobs()),
                          Limit(u.max_queued_jobs()), GiB(u.max_host_bytes()), u.max_priority());
  }
  std::fputs(out.c_str(), stdout);
  return kExitOk;
}

}  // namespace megatrain::client
