// The metrics registry's exposition text and the HTTP endpoint that serves it.
#include "server/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "gtest/gtest.h"
#include "server/metrics_http.h"

namespace megatrain::server {
namespace {

using T = MetricsRegistry::Type;

// GET http://127.0.0.1:port/path with a plain socket; the whole response.
std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string request = "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  (void)!write(fd, request.data(), request.size());
  std::string response;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) response.append(buf, n);
  close(fd);
  return response;
}

TEST(Metrics, ExpositionTextFollowsTheFormat) {
  MetricsRegistry r;
  r.Declare("a_total", T::kCounter, "Things\\counted.\nTwice.");
  r.Declare("b_bytes", T::kGauge, "A gauge.");
  r.Declare("c_seconds", T::kHistogram, "A histogram.", {0.1, 1});
  r.Declare("d_unused", T::kGauge, "No series: not written.");
  r.Add("a_total", {{"job", "1"}, {"user", "a\"b\\c\nd"}}, 2);
  r.Add("a_total", {{"job", "1"}, {"user", "a\"b\\c\nd"}}, 3);
  r.Set("b_bytes", {}, 1.5e12);
  r.Observe("c_seconds", {{"job", "1"}}, 0.05);
  r.Observe("c_seconds", {{"job", "1"}}, 0.5);
  r.Observe("c_seconds", {{"job", "1"}}, 7);
  EXPECT_EQ(r.Serialize(),
            "# HELP a_total Things\\\\counted.\\nTwice.\n"
            "# TYPE a_total counter\n"
            "a_total{job=\"1\",user=\"a\\\"b\\\\c\\nd\"} 5\n"
            "# HELP b_bytes A gauge.\n"
            "# TYPE b_bytes gauge\n"
            "b_bytes 1500000000000\n"
            "# HELP c_seconds A histogram.\n"
            "# TYPE c_seconds histogram\n"
            "c_seconds_count{job=\"1\"} 3\n"
            "c_seconds_sum{job=\"1\"} 7.55\n"
            "c_seconds_bucket{job=\"1\",le=\"0.1\"} 1\n"
            "c_seconds_bucket{job=\"1\",le=\"1\"} 2\n"
            "c_seconds_bucket{job=\"1\",le=\"+Inf\"} 3\n");
}

TEST(Metrics, RemoveSeriesDropsAFinishedJobEverywhere) {
  MetricsRegistry r;
  r.Declare("x_total", T::kCounter, "x");
  r.Declare("y", T::kGauge, "y");
  r.Add("x_total", {{"job", "1"}}, 1);
  r.Add("x_total", {{"job", "2"}}, 1);
  r.Set("y", {{"job", "1"}, {"stream", "h2d"}}, 1);
  r.RemoveSeries("job", "1");
  const std::string text = r.Serialize();
  EXPECT_EQ(text.find("job=\"1\""), std::string::npos) << text;
  EXPECT_NE(text.find("x_total{job=\"2\"} 1"), std::string::npos) << text;
  EXPECT_EQ(text.find("# TYPE y"), std::string::npos) << "a family without series is left out";
}

TEST(Metrics, ProcessCollectorReportsThisProcess) {
  MetricsRegistry r;
  AddProcessCollector(&r);
  const std::string text = r.Serialize();
  for (const char* name : {"process_cpu_seconds_total ", "process_resident_memory_bytes ",
                           "process_virtual_memory_bytes ", "process_open_fds ",
                           "process_max_fds ", "process_start_time_seconds "}) {
    EXPECT_NE(text.find(std::string("\n") + name), std::string::npos) << name << "\n" << text;
  }
}

// Names are checked where they are declared or first used, not left for Prometheus to
// refuse the whole scrape.
TEST(MetricsDeathTest, AnInvalidMetricOrLabelNameIsABug) {
  MetricsRegistry r;
  EXPECT_DEATH(r.Declare("bad-name", T::kGauge, "h"), "bad-name is not a valid metric name");
  EXPECT_DEATH(r.Declare("9lives", T::kGauge, "h"), "is not a valid metric name");
  r.Declare("ok", T::kGauge, "h");
  EXPECT_DEATH(r.Set("ok", {{"bad label", "x"}}, 1), "bad label is not a valid label name");
  EXPECT_DEATH(r.Set("ok", {{"__reserved", "x"}}, 1), "is not a valid label name");
  r.Declare("h_seconds", T::kHistogram, "h", {1});
  EXPECT_DEATH(r.Observe("h_seconds", {{"le", "1"}}, 1), "le is not a valid label name");
}

TEST(MetricsHttp, ServesTheRegistryAtSlashMetrics) {
  MetricsRegistry r;
  r.Declare("up_total", T::kCounter, "u");
  r.Add("up_total", {}, 1);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> s = MetricsHttpServer::Start("127.0.0.1:0", &r);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_GT((*s)->port(), 0);
  const std::string response = HttpGet((*s)->port(), "/metrics");
  EXPECT_NE(response.find("200 OK"), std::string::npos) << response;
  EXPECT_NE(response.find("text/plain; version=0.0.4"), std::string::npos) << response;
  EXPECT_NE(response.find("\nup_total 1\n"), std::string::npos) << response;
  EXPECT_NE(HttpGet((*s)->port(), "/other").find("404"), std::string::npos);
}

TEST(MetricsHttp, ABusyAddressIsAClearError) {
  MetricsRegistry r;
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> a = MetricsHttpServer::Start("127.0.0.1:0", &r);
  ASSERT_TRUE(a.ok()) << a.status();
  const std::string taken = "127.0.0.1:" + std::to_string((*a)->port());
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> b = MetricsHttpServer::Start(taken, &r);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find(taken), std::string::npos) << b.status();
}

}  // namespace
}  // namespace megatrain::server
