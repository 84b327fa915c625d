// megatrain.v1.AccessService: who am I, access tokens, the audit log and fair-share usage.
//
// Tokens: a user creates their own over the Unix socket (where the kernel vouches for
// them) or over TCP with a token they already have; admins may create and revoke any
// user's. The secret is returned once; only its SHA-256 is stored. Creating and revoking
// are audited. The audit log is for admins only; usage is readable by everyone.
#pragma once

#include "megatrain/v1/access.grpc.pb.h"
#include "server/config.h"
#include "server/identity.h"
#include "server/job_store.h"

namespace megatrain::server {

class AccessServiceImpl final : public v1::AccessService::Service {
 public:
  AccessServiceImpl(JobStore* store, Authenticator* auth, const DaemonConfig* config);

  [[nodiscard]] grpc::Status WhoAmI(grpc::ServerContext* ctx, const v1::WhoAmIRequest* req,
                                    v1::Identity* resp) override;
  [[nodiscard]] grpc::Status CreateToken(grpc::ServerContext* ctx,
                                         const v1::CreateTokenRequest* req,
                                         v1::CreateTokenResponse* resp) override;
  [[nodiscard]] grpc::Status ListTokens(grpc::ServerContext* ctx, const v1::ListTokensRequest* req,
                                        v1::ListTokensResponse* resp) override;
  [[nodiscard]] grpc::Status RevokeToken(grpc::ServerContext* ctx,
                                         const v1::RevokeTokenRequest* req,
                                         v1::RevokeTokenResponse* resp) override;
  [[nodiscard]] grpc::Status ListAudit(grpc::ServerContext* ctx, const v1::ListAuditRequest* req,
                                       v1::ListAuditResponse* resp) override;
  [[nodiscard]] grpc::Status GetUsage(grpc::ServerContext* ctx, const v1::GetUsageRequest* req,
                                      v1::GetUsageResponse* resp) override;

 private:
  // Records `action` by `who` with the outcome `result`, and returns `result` (as
  // JobServiceImpl::Audited does).
  [[nodiscard]] grpc::Status Audited(const Caller& who, const std::string& action,
                                     const std::string& detail, grpc::Status result);

  JobStore* store_;
  Authenticator* auth_;
  const DaemonConfig* config_;
};

}  // namespace megatrain::server
