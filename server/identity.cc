#include "server/identity.h"

#include <fcntl.h>
#include <grp.h>
#include <openssl/evp.h>
#include <poll.h>
#include <pwd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "grpcpp/server_posix.h"

namespace megatrain::server {
namespace {

absl::StatusOr<Caller> FromPasswd(const passwd& pw) {
  Caller caller;
  caller.user = pw.pw_name;
  caller.uid = pw.pw_uid;
  caller.gid = pw.pw_gid;
  int num_groups = 32;
  std::vector<gid_t> groups(num_groups);
  while (getgrouplist(pw.pw_name, pw.pw_gid, groups.data(), &num_groups) < 0) {
    groups.resize(num_groups);
  }
  groups.resize(num_groups);
  caller.groups.push_back(pw.pw_gid);
  for (gid_t gid : groups) {
    if (gid != pw.pw_gid) caller.groups.push_back(gid);
  }
  return caller;
}

}  // namespace

absl::StatusOr<Caller> LookupUid(uid_t uid) {
  passwd pw, *found = nullptr;
  std::vector<char> buf(16384);
  if (getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
    return absl::NotFoundError(absl::StrCat("uid ", uid, " has no account on this machine"));
  }
  return FromPasswd(pw);
}

absl::StatusOr<Caller> LookupUser(const std::string& user) {
  passwd pw, *found = nullptr;
  std::vector<char> buf(16384);
  if (getpwnam_r(user.c_str(), &pw, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
    return absl::NotFoundError(absl::StrCat("user '", user, "' has no account on this machine"));
  }
  return FromPasswd(pw);
}

std::string NewToken() {
  unsigned char bytes[32];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t filled = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (filled > 0) got += filled;
  }
  return absl::StrCat("mt_", absl::BytesToHexString(absl::string_view(
                                 reinterpret_cast<const char*>(bytes), sizeof(bytes))));
}

std::string TokenHash(const std::string& token) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_Digest(token.data(), token.size(), digest, &size, EVP_sha256(), nullptr);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), size));
}

Authenticator::Authenticator(JobStore* store, std::string admin_group)
    : store_(store), admin_group_(std::move(admin_group)) {}

void Authenticator::AddPeer(int fd, uid_t uid) {
  MutexLock lock(&mu_);
  peers_[fd] = uid;
}

void Authenticator::SetAdmin(Caller* caller) const {
  caller->admin = caller->uid == 0;
  if (caller->admin || admin_group_.empty()) return;
  group admins, *found = nullptr;
  std::vector<char> buffer(16384);
  if (getgrnam_r(admin_group_.c_str(), &admins, buffer.data(), buffer.size(), &found) != 0 ||
      found == nullptr) {
    return;
  }
  for (gid_t gid : caller->groups) {
    if (gid == admins.gr_gid) caller->admin = true;
  }
}

absl::StatusOr<Caller> Authenticator::Identify(const grpc::ServerContext& ctx) {
  const std::string peer = ctx.peer();
  absl::string_view fd_text = peer;
  if (absl::ConsumePrefix(&fd_text, "fd:")) {
    int fd = -1;
    uid_t uid = 0;
    bool known = false;
    if (absl::SimpleAtoi(fd_text, &fd)) {
      MutexLock lock(&mu_);
      auto it = peers_.find(fd);
      if (it != peers_.end()) {
        uid = it->second;
        known = true;
      }
    }
    if (!known) {
      return absl::UnauthenticatedError(absl::StrCat("unknown connection ", peer));
    }
    absl::StatusOr<Caller> caller = LookupUid(uid);
    if (!caller.ok()) return absl::UnauthenticatedError(caller.status().message());
    caller->via = "unix socket peer credentials";
    SetAdmin(&*caller);
    return caller;
  }
  // TCP: a bearer token.
  auto it = ctx.client_metadata().find("authorization");
  if (it == ctx.client_metadata().end()) {
    return absl::UnauthenticatedError(
        "over TCP every call needs a token (megatrain --token-file, or MEGATRAIN_TOKEN); create "
        "one on the machine with `megatrain token create`");
  }
  absl::string_view value(it->second.data(), it->second.size());
  if (!absl::ConsumePrefix(&value, "Bearer ")) {
    return absl::UnauthenticatedError("the authorization metadata must be 'Bearer <token>'");
  }
  absl::StatusOr<TokenRecord> token = store_->UseToken(TokenHash(std::string(value)));
  if (!token.ok()) {
    if (token.status().code() == absl::StatusCode::kNotFound) {
      return absl::UnauthenticatedError("the token is not valid (revoked, or never issued)");
    }
    return token.status();
  }
  absl::StatusOr<Caller> caller = LookupUser(token->user);
  if (!caller.ok()) {
    return absl::UnauthenticatedError(absl::StrCat("token ", token->id, " stands for user '",
                                                   token->user, "', who no longer exists"));
  }
  caller->via = absl::StrCat("token ", token->id);
  SetAdmin(&*caller);
  return caller;
}

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Start(const std::string& path,
                                                                  grpc::Server* server,
                                                                  Authenticator* auth) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path ", path, " is too long (at most ",
                                                   sizeof(addr.sun_path) - 1, " bytes)"));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  ::unlink(path.c_str());  // a stale socket from a crashed daemon
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 128) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", path, ": ", std::strerror(err)));
  }
  chmod(path.c_str(), 0666);  // every lab member may connect; each call is checked
  std::unique_ptr<UnixListener> listener(new UnixListener(path, fd, server, auth));
  if (pipe2(listener->wake_, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  listener->thread_ = std::thread([started = listener.get()] { started->Loop(); });
  return listener;
}

UnixListener::UnixListener(std::string path, int fd, grpc::Server* server, Authenticator* auth)
    : path_(std::move(path)), fd_(fd), server_(server), auth_(auth) {}

UnixListener::~UnixListener() {
  if (thread_.joinable()) {
    const char stop = 1;
    (void)!write(wake_[1], &stop, 1);
    thread_.join();
  }
  for (int pipe_fd : wake_) {
    if (pipe_fd >= 0) ::close(pipe_fd);
  }
  ::close(fd_);
  ::unlink(path_.c_str());
}

void UnixListener::Loop() {
  for (;;) {
    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int conn = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (conn < 0) continue;  // the peer gave up, or out of descriptors: try again
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      ::close(conn);
      continue;
    }
    auth_->AddPeer(conn, cred.uid);
    grpc::AddInsecureChannelFromFd(server_, conn);
  }
}

}  // namespace megatrain::server
