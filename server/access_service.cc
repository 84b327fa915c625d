#include "server/access_service.h"

#include <grp.h>

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/job_service.h"
#include "server/reply_limits.h"

namespace megatrain::server {
namespace {

std::string GroupName(gid_t gid) {
  group entry, *found = nullptr;
  std::vector<char> buffer(16384);
  if (getgrgid_r(gid, &entry, buffer.data(), buffer.size(), &found) != 0 || found == nullptr) {
    return std::to_string(gid);
  }
  return entry.gr_name;
}

void ToProto(const TokenRecord& token, v1::Token* out) {
  out->set_id(token.id);
  out->set_user(token.user);
  out->set_name(token.name);
  out->set_created_unix_ms(token.created_ms);
  out->set_last_used_unix_ms(token.last_used_ms);
}

grpc::Status AdminOnly(const Caller& who, const Authenticator& auth, const std::string& what) {
  if (who.admin) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      absl::StrCat(what, " is for admins (root",
                                   auth.admin_group().empty()
                                       ? ""
                                       : absl::StrCat(" and group ", auth.admin_group()),
                                   "); ", who.user, " is not one"));
}

}  // namespace

AccessServiceImpl::AccessServiceImpl(JobStore* store, Authenticator* auth,
                                     const DaemonConfig* config)
    : store_(store), auth_(auth), config_(config) {}

grpc::Status AccessServiceImpl::Audited(const Caller& who, const std::string& action,
                                        const std::string& detail, grpc::Status result) {
  AuditEntry entry;
  entry.user = who.user;
  entry.action = action;
  entry.detail = detail;
  entry.outcome = Outcome(result);
  // The outcome is decided, and what the call changed committed: an entry that fails is
  // reported, not returned.
  if (absl::Status audited = store_->Audit(entry); !audited.ok()) {
    ReportWriteFailure(0, absl::StrCat("recording the audit entry of ", who.user, "'s ", action),
                       audited);
  }
  return result;
}

grpc::Status AccessServiceImpl::WhoAmI(grpc::ServerContext* ctx, const v1::WhoAmIRequest*,
                                       v1::Identity* resp) {
  MT_IDENTIFY(who, auth_, ctx);
  resp->set_user(who.user);
  resp->set_uid(who.uid);
  for (gid_t gid : who.groups) resp->add_groups(GroupName(gid));
  resp->set_admin(who.admin);
  resp->set_authenticated_by(who.via);
  return grpc::Status::OK;
}

grpc::Status AccessServiceImpl::CreateToken(grpc::ServerContext* ctx,
                                            const v1::CreateTokenRequest* req,
                                            v1::CreateTokenResponse* resp) {
  MT_IDENTIFY(who, auth_, ctx);
  const std::string user = req->user().empty() ? who.user : req->user();
  auto create = [&]() -> grpc::Status {
    // Only where the kernel vouches for the caller: a leaked token cannot mint more.
    if (who.via.rfind("token", 0) == 0) {
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                          "tokens are created on the machine itself, over the Unix socket, not "
                          "with another token");
    }
    if (user != who.user) {
      if (grpc::Status admin = AdminOnly(who, *auth_, "creating another user's token");
          !admin.ok()) {
        return admin;
      }
      absl::StatusOr<Caller> exists = LookupUser(user);
      if (!exists.ok()) return ToGrpc(exists.status());
    }
    const std::string secret = NewToken();
    absl::StatusOr<int64_t> id = store_->InsertToken(TokenHash(secret), user, req->name());
    if (!id.ok()) return ToGrpc(id.status());
    absl::StatusOr<TokenRecord> stored = store_->GetToken(*id);
    if (!stored.ok()) return ToGrpc(stored.status());
    ToProto(*stored, resp->mutable_token());
    resp->set_secret(secret);
    return grpc::Status::OK;
  };
  grpc::Status result = create();
  return Audited(
      who, "create-token",
      absl::StrCat("for ", user, result.ok() ? absl::StrCat(", token ", resp->token().id()) : "",
                   req->name().empty() ? "" : absl::StrCat(" (", req->name(), ")")),
      result);
}

grpc::Status AccessServiceImpl::ListTokens(grpc::ServerContext* ctx,
                                           const v1::ListTokensRequest* req,
                                           v1::ListTokensResponse* resp) {
  MT_IDENTIFY(who, auth_, ctx);
  std::string user = req->user().empty() ? who.user : req->user();
  if (user != who.user) {
    if (grpc::Status admin = AdminOnly(who, *auth_, "listing another user's tokens"); !admin.ok()) {
      return admin;
    }
  }
  if (user == "*") user = "";
  absl::StatusOr<std::vector<TokenRecord>> tokens = store_->ListTokens(user);
  if (!tokens.ok()) return ToGrpc(tokens.status());
  for (const TokenRecord& token : *tokens) ToProto(token, resp->add_tokens());
  return grpc::Status::OK;
}

grpc::Status AccessServiceImpl::RevokeToken(grpc::ServerContext* ctx,
                                            const v1::RevokeTokenRequest* req,
                                            v1::RevokeTokenResponse*) {
  MT_IDENTIFY(who, auth_, ctx);
  auto revoke = [&]() -> grpc::Status {
    absl::StatusOr<TokenRecord> token = store_->GetToken(req->id());
    if (!token.ok()) return ToGrpc(token.status());
    if (token->user != who.user) {
      if (grpc::Status admin = AdminOnly(who, *auth_, "revoking another user's token");
          !admin.ok()) {
        return admin;
      }
    }
    return ToGrpc(store_->DeleteToken(req->id()));
  };
  return Audited(who, "revoke-token", absl::StrCat("token ", req->id()), revoke());
}

grpc::Status AccessServiceImpl::ListAudit(grpc::ServerContext* ctx, const v1::ListAuditRequest* req,
                                          v1::ListAuditResponse* resp) {
  MT_IDENTIFY(who, auth_, ctx);
  if (grpc::Status admin = AdminOnly(who, *auth_, "the audit log"); !admin.ok()) return admin;
  const int limit = req->limit() <= 0 ? 100 : std::min(req->limit(), 10000);
  absl::StatusOr<std::vector<AuditEntry>> entries =
      store_->AuditLog(limit, req->user(), req->job_id());
  if (!entries.ok()) return ToGrpc(entries.status());
  // Each entry bounded; the reply stops short of the client's message limit (the oldest
  // entries asked for are left out: --limit or --user narrow it).
  ReplyBudget budget;
  for (const AuditEntry& entry : *entries) {
    v1::AuditEntry out;
    out.set_id(entry.id);
    out.set_unix_ms(entry.unix_ms);
    out.set_user(entry.user);
    out.set_action(entry.action);
    out.set_job_id(entry.job_id);
    out.set_detail(entry.detail);
    out.set_outcome(entry.outcome);
    BoundAuditEntryForReply(&out);
    if (!budget.Take(out)) break;
    *resp->add_entries() = std::move(out);
  }
  return grpc::Status::OK;
}

grpc::Status AccessServiceImpl::GetUsage(grpc::ServerContext* ctx, const v1::GetUsageRequest*,
                                         v1::GetUsageResponse* resp) {
  MT_IDENTIFY(who, auth_, ctx);
  const double half_life_s = config_->fair_share_half_life_hours * 3600;
  absl::StatusOr<std::map<std::string, double>> usage = store_->Usage(half_life_s);
  if (!usage.ok()) return ToGrpc(usage.status());
  std::map<std::string, v1::UserUsage> users;
  for (const auto& [user, seconds] : *usage) users[user].set_gpu_hours(seconds / 3600);
  absl::StatusOr<std::vector<v1::Job>> active = store_->List(
      {v1::JOB_STATE_RUNNING, v1::JOB_STATE_QUEUED, v1::JOB_STATE_HELD}, "", 0, 1000000);
  if (!active.ok()) return ToGrpc(active.status());
  for (const v1::Job& job : *active) {
    v1::UserUsage& of_owner = users[job.owner()];
    if (job.state() == v1::JOB_STATE_RUNNING) {
      of_owner.set_running_jobs(of_owner.running_jobs() + 1);
      of_owner.set_running_host_bytes(of_owner.running_host_bytes() + job.host_bytes_estimate());
    } else {
      of_owner.set_queued_jobs(of_owner.queued_jobs() + 1);
    }
  }
  std::vector<v1::UserUsage> ordered;
  for (auto& [user, of_user] : users) {
    const UserLimits limits = config_->LimitsFor(user);
    of_user.set_user(user);
    of_user.set_max_running_jobs(limits.max_running_jobs);
    of_user.set_max_queued_jobs(limits.max_queued_jobs);
    of_user.set_max_host_bytes(limits.max_host_bytes);
    of_user.set_max_priority(limits.max_priority);
    ordered.push_back(of_user);
  }
  std::stable_sort(ordered.begin(), ordered.end(),
                   [](const v1::UserUsage& lhs, const v1::UserUsage& rhs) {
                     return lhs.gpu_hours() < rhs.gpu_hours();
                   });
  for (v1::UserUsage& of_user : ordered) *resp->add_users() = std::move(of_user);
  resp->set_half_life_hours(config_->fair_share_half_life_hours);
  return grpc::Status::OK;
}

}  // namespace megatrain::server
