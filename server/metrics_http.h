// Serves a MetricsRegistry at GET /metrics over HTTP/1.1, for Prometheus to scrape.
//
// A deliberately small server: one thread, one request per connection (Connection:
// close), requests read with a deadline and a size cap. Hand-written because the packaged
// embeddable servers start their worker threads with a fixed 100 KiB stack, smaller than
// the static TLS that cuBLASLt and OpenBLAS put in every thread of this process, so
// their threads fail to start here.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "server/metrics.h"

namespace megatrain::server {

class MetricsHttpServer {
 public:
  // `address` is host:port ("127.0.0.1:9470", "0.0.0.0:9470", "[::1]:9470"; port 0 = any
  // free port). Unavailable naming the address when it cannot listen there.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, MetricsRegistry* registry);
  ~MetricsHttpServer();  // stops accepting and joins the thread

  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  void Loop();
  void Serve(int fd);

  MetricsRegistry* registry_ = nullptr;
  int listen_fd_ = -1;
  int wake_fd_[2] = {-1, -1};  // a pipe: written to stop the loop
  int port_ = 0;
  std::thread thread_;
};

}  // namespace megatrain::server
