// Who is calling megatraind, as the kernel or a token says, never as the caller claims.
//
// - Unix socket: UnixListener accepts connections itself, reads each peer's uid with
//   SO_PEERCRED, and hands the connected socket to gRPC (AddInsecureChannelFromFd). gRPC
//   names such a connection's peer "fd:N", so a call is mapped back to the uid recorded
//   for socket N when it was accepted. (A socket number is reused only after gRPC closed
//   the connection that had it, and with it every call on that connection.)
// - TCP (TLS): the caller presents "authorization: Bearer <token>". Tokens are 32 random
//   bytes; the store keeps only their SHA-256, so a stolen database grants nothing.
//
// A Caller is a local account: name, uid, primary gid and every group it belongs to
// (getgrouplist), which is what file permissions are checked against (server/run_as.h).
// Admins are uid 0 and the members of the configured admin group.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/common/mutex.h"
#include "grpcpp/grpcpp.h"
#include "server/job_store.h"

namespace megatrain::server {

struct Caller {
  std::string user;  // login name
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // every group, the primary one first
  bool admin = false;
  std::string via;  // "unix socket peer credentials" | "token N"
};

// The local account with uid `uid` (NOT_FOUND if there is none).
[[nodiscard]] absl::StatusOr<Caller> LookupUid(uid_t uid);
// The local account named `user` (NOT_FOUND if there is none).
[[nodiscard]] absl::StatusOr<Caller> LookupUser(const std::string& user);

// A fresh token: "mt_" and 64 hex digits from the kernel's random source.
std::string NewToken();
// The hex SHA-256 of `token`: what the store keeps.
std::string TokenHash(const std::string& token);

class Authenticator {
 public:
  // admin_group: "" for none (then only root is an admin).
  Authenticator(JobStore* store, std::string admin_group);

  // UnixListener records each accepted connection's peer uid here.
  void AddPeer(int fd, uid_t uid);

  // The caller of `ctx`: UNAUTHENTICATED, with the reason, when it cannot be known.
  [[nodiscard]] absl::StatusOr<Caller> Identify(const grpc::ServerContext& ctx);

  // Sets caller->admin from uid 0 and the admin group.
  void SetAdmin(Caller* caller) const;
  const std::string& admin_group() const { return admin_group_; }

 private:
  JobStore* store_;
  const std::string admin_group_;
  Mutex mu_;
  std::unordered_map<int, uid_t> peers_ ABSL_GUARDED_BY(mu_);
};

// The first statement of an RPC handler (one returning grpc::Status): binds `caller`, a
// const Caller&, to who calls `ctx` as `authenticator` (an Authenticator*) identifies
// them, or ends the call with the UNAUTHENTICATED error, through ToGrpc
// (server/job_service.h, which the expanding file includes).
//
//   MT_IDENTIFY(who, auth_, ctx);
//   if (!who.admin) ...
#define MT_IDENTIFY(caller, authenticator, ctx)                                         \
  ::absl::StatusOr<::megatrain::server::Caller> caller##_or =                           \
      (authenticator)->Identify(*(ctx));                                                \
  if (!caller##_or.ok()) return ::megatrain::server::ToGrpc(caller##_or.status());      \
  [[maybe_unused]] const ::megatrain::server::Caller& caller = *caller##_or

// Listens on a Unix socket and feeds accepted connections to `server`, recording each
// peer's uid with `auth`. The socket is created 0666 (anyone may connect; what they may
// do is decided per call), replacing a stale one.
class UnixListener {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<UnixListener>> Start(
      const std::string& path, grpc::Server* server, Authenticator* auth);
  ~UnixListener();  // stops accepting and removes the socket file
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;

 private:
  UnixListener(std::string path, int fd, grpc::Server* server, Authenticator* auth);
  void Loop();

  const std::string path_;
  const int fd_;
  int wake_[2] = {-1, -1};  // a pipe: writing to it stops Loop
  grpc::Server* server_;
  Authenticator* auth_;
  std::thread thread_;
};

}  // namespace megatrain::server
