// Serves a MetricsRegistry at GET /metrics over HTTP/1.1, for Prometheus to scrape.
//
// The metrics are prometheus-cpp's (metrics.h); this is only their transport. A
// deliberately small server: one thread, one request per connection (Connection: close),
// requests read with a deadline and a size cap.
//
// Not prometheus-cpp-pull's Exposer: it serves through Debian's civetweb, which starts its
// worker threads with a fixed 100 KiB stack, and glibc takes a thread's static TLS out of
// its stack. This process carries ~170 KiB of static TLS (cuBLASLt 92 KiB, OpenBLAS
// 60 KiB, cuBLAS 12 KiB, cudart 4 KiB: `readelf -lW <lib> | grep TLS`), so civetweb's
// threads cannot start: the Exposer throws "null context when constructing CivetServer"
// in a program linking those libraries and serves fine in one without cuBLAS (checked
// with prometheus-cpp 1.0.1 and civetweb 1.15, Debian 12). This server's thread gets
// the default 8 MiB stack.
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
