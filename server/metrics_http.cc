#include "server/metrics_http.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace megatrain::server {
namespace {

constexpr size_t kMaxRequestBytes = 8192;
constexpr int kRequestTimeoutMs = 5000;

bool WriteAll(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t w = send(fd, data, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    data += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

void Respond(int fd, const std::string& status, const std::string& type, const std::string& body,
             bool head_only) {
  const std::string header = absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type,
                                          "\r\nContent-Length: ", body.size(),
                                          "\r\nConnection: close\r\n\r\n");
  if (WriteAll(fd, header.data(), header.size()) && !head_only) {
    WriteAll(fd, body.data(), body.size());
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, MetricsRegistry* registry) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_listen '", address, "' is not host:port (e.g. 127.0.0.1:9470)"));
  }
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found);
      rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_listen '", address, "': ", gai_strerror(rc)));
  }
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer);
  server->registry_ = registry;
  std::string error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 64) == 0) {
      server->listen_fd_ = fd;
      break;
    }
    error = std::strerror(errno);
    close(fd);
  }
  freeaddrinfo(found);
  if (server->listen_fd_ < 0) {
    return absl::UnavailableError(absl::StrCat("metrics_listen: cannot serve metrics on ",
                                               address, ": ", error,
                                               "; set another host:port, or \"\" for none"));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(server->listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  server->port_ = ntohs(bound.ss_family == AF_INET6
                            ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  if (pipe2(server->wake_fd_, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("metrics server: pipe: ", std::strerror(errno)));
  }
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (thread_.joinable()) {
    const char c = 0;
    (void)!write(wake_fd_[1], &c, 1);
    thread_.join();
  }
  for (int fd : {listen_fd_, wake_fd_[0], wake_fd_[1]}) {
    if (fd >= 0) close(fd);
  }
}

void MetricsHttpServer::Loop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_[0], POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Serve(fd);
    close(fd);
  }
}

void MetricsHttpServer::Serve(int fd) {
  // Read the request head, up to its blank line, within the deadline and the size cap.
  std::string request;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kRequestTimeoutMs);
  while (request.find("\r\n\r\n") == std::string::npos) {
    const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                          deadline - std::chrono::steady_clock::now()).count());
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || poll(&p, 1, left) <= 0) return;
    char buf[2048];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
    if (request.size() > kMaxRequestBytes) {
      Respond(fd, "431 Request Header Fields Too Large", "text/plain", "", false);
      return;
    }
  }
  const std::string line = request.substr(0, request.find("\r\n"));
  const bool get = absl::StartsWith(line, "GET ");
  const bool head = absl::StartsWith(line, "HEAD ");
  if (!get && !head) {
    Respond(fd, "405 Method Not Allowed", "text/plain", "only GET and HEAD\n", false);
    return;
  }
  const size_t path_start = line.find(' ') + 1;
  std::string path = line.substr(path_start, line.find(' ', path_start) - path_start);
  path = path.substr(0, path.find('?'));
  if (path != "/metrics") {
    Respond(fd, "404 Not Found", "text/plain", "metrics are at /metrics\n", head);
    return;
  }
  Respond(fd, "200 OK", "text/plain; version=0.0.4; charset=utf-8", registry_->Serialize(), head);
}

}  // namespace megatrain::server
