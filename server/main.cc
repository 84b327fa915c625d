// megatraind: the long-running training daemon. Owns the job database, the device and
// its queue, and serves megatrain.v1 over gRPC (a Unix socket by default).
//
//   megatraind [--config FILE] [--listen ADDR] [--state-dir DIR] [--device cpu]
//
// SIGTERM / SIGINT stop it gracefully: the running job checkpoints and is requeued, so
// the next start resumes it. After a crash, jobs that were running resume from their
// last checkpoint; queued jobs stay queued.
#include <signal.h>
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <memory>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "client/address.h"
#include "engine/backend/factory.h"
#include "server/config.h"
#include "server/daemon_metrics.h"
#include "server/event_hub.h"
#include "server/job_runner.h"
#include "server/job_service.h"
#include "server/node_planner.h"
#include "server/job_store.h"
#include "server/metrics_http.h"
#include "server/node_service.h"

namespace megatrain::server {
namespace {

int Run(const DaemonConfig& config) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(config.state_dir, ec);
  if (ec) {
    std::fprintf(stderr, "megatraind: cannot create state_dir %s: %s\n", config.state_dir.c_str(),
                 ec.message().c_str());
    return 1;
  }
  const std::string db_path = (fs::path(config.state_dir) / "megatrain.db").string();
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(db_path);
  if (!store.ok()) {
    std::fprintf(stderr, "megatraind: %s\n", store.status().ToString().c_str());
    return 1;
  }
  EventHub hub;
  std::string device = config.device;
  if (device == "auto") device = CudaAvailable() ? "cuda:0" : "cpu";
  if (device != "cpu" && device != "cuda:0" && device != "cuda") {
    std::fprintf(stderr, "megatraind: device must be auto, cpu or cuda:0, got '%s'\n",
                 device.c_str());
    return 2;
  }
  if (device != "cpu" && !CudaAvailable()) {
    std::fprintf(stderr, "megatraind: device %s requested, but no CUDA device is usable\n",
                 device.c_str());
    return 2;
  }
  if (device == "cuda") device = "cuda:0";
  MetricsRegistry registry;
  DaemonMetricsOptions metrics_options;
  metrics_options.gpu = device == "cpu" ? "cpu" : device.substr(device.find(':') + 1);
  metrics_options.dcgm_job_mapping_dir = config.dcgm_job_mapping_dir;
  if (device != "cpu") {
    for (const GpuInfo& g : ListGpus()) {
      if (std::to_string(g.index) == metrics_options.gpu) metrics_options.device_name = g.name;
    }
  } else {
    metrics_options.device_name = "cpu";
  }
  // The machine profile (the planner's rates: PCIe, matmuls, attention, CPU AdamW), read
  // from the state folder or measured now; MFU's denominator is its measured GEMM peak
  // unless configured.
  const HostMemory mem = ReadHostMemory();
  const int64_t admissible = static_cast<int64_t>(mem.total_bytes * config.host_memory_fraction);
  absl::StatusOr<std::unique_ptr<NodePlanner>> planner =
      NodePlanner::Create(device, config.state_dir, admissible);
  if (!planner.ok()) {
    std::fprintf(stderr, "megatraind: measuring the machine: %s\n",
                 std::string(planner.status().message()).c_str());
    return 1;
  }
  std::printf("megatraind: %s\n", (*planner)->note().c_str());
  metrics_options.peak_tflops = config.gpu_peak_tflops;
  if (metrics_options.peak_tflops <= 0) {
    metrics_options.peak_tflops = (*planner)->profile().gemm_peak_tflops;
    if (metrics_options.peak_tflops <= 0) {
      metrics_options.peak_tflops = KnownBf16PeakTflops(metrics_options.device_name);
    }
  }
  DaemonMetrics metrics(&registry, store->get(), metrics_options);
  std::unique_ptr<MetricsHttpServer> metrics_server;
  if (!config.metrics_listen.empty()) {
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> started =
        MetricsHttpServer::Start(config.metrics_listen, &registry);
    if (!started.ok()) {
      std::fprintf(stderr, "megatraind: %s\n", std::string(started.status().message()).c_str());
      return 1;
    }
    metrics_server = std::move(*started);
  }
  JobRunnerOptions runner_options{device, config.state_dir};
  runner_options.metrics = &metrics;
  runner_options.profile = &(*planner)->profile();
  JobRunner runner(store->get(), &hub, runner_options);

  // Jobs that were running when the last daemon died resume from their checkpoints.
  absl::StatusOr<std::vector<v1::Job>> running = (*store)->ListInState(v1::JOB_STATE_RUNNING);
  if (running.ok()) {
    for (v1::Job job : *running) {
      (void)runner.SetState(&job, v1::JOB_STATE_QUEUED,
                            "daemon restarted: requeued, resumes from its last checkpoint");
    }
  }

  JobServiceImpl jobs(store->get(), &hub, &runner,
                      JobServiceOptions{config.state_dir, admissible, planner->get()});
  NodeServiceImpl node(store->get(), device == "cpu" ? "cpu" : "cuda", admissible);

  const std::string socket = UnixSocketPath(config.listen).value_or("");
  if (!socket.empty()) {
    fs::create_directories(fs::path(socket).parent_path(), ec);
    fs::remove(socket, ec);  // a stale socket from a crashed daemon
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(config.listen, grpc::InsecureServerCredentials());
  builder.RegisterService(&jobs);
  builder.RegisterService(&node);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    std::fprintf(stderr, "megatraind: cannot listen on %s\n", config.listen.c_str());
    return 1;
  }
  if (!socket.empty()) chmod(socket.c_str(), 0666);  // every lab member may connect
  runner.Start();
  std::printf("megatraind: listening on %s, state in %s, device %s (GEMM peak %.3g TFLOP/s), "
              "metrics %s\n",
              config.listen.c_str(), config.state_dir.c_str(), device.c_str(),
              metrics_options.peak_tflops,
              metrics_server ? absl::StrCat("http://", config.metrics_listen.substr(0, config.metrics_listen.rfind(':')), ":", metrics_server->port(), "/metrics").c_str() : "off");
  std::fflush(stdout);

  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  int sig = 0;
  sigwait(&signals, &sig);
  std::printf("megatraind: %s: checkpointing the running job and stopping\n",
              sig == SIGTERM ? "SIGTERM" : "SIGINT");
  std::fflush(stdout);
  runner.Shutdown();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (!socket.empty()) fs::remove(socket, ec);
  return 0;
}

}  // namespace
}  // namespace megatrain::server

int main(int argc, char** argv) {
  // Block the stop signals in every thread; main waits for them with sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  megatrain::server::DaemonConfig config = megatrain::server::DefaultDaemonConfig();
  CLI::App app{"megatraind: the megatrain training daemon"};
  std::string config_path, listen, state_dir, device, metrics_listen = "unset";
  app.add_option("--config", config_path, "YAML config file (optional)");
  app.add_option("--listen", listen, "address: unix:/path or host:port (default " + config.listen + ")");
  app.add_option("--state-dir", state_dir, "job database and checkpoints (default " + config.state_dir + ")");
  app.add_option("--device", device, "auto | cpu");
  app.add_option("--metrics-listen", metrics_listen,
                 "Prometheus /metrics host:port, \"\" for none (default " + config.metrics_listen + ")");
  CLI11_PARSE(app, argc, argv);
  if (!config_path.empty()) {
    absl::Status s = megatrain::server::LoadDaemonConfig(config_path, &config);
    if (!s.ok()) {
      std::fprintf(stderr, "megatraind: %s\n", s.ToString().c_str());
      return 2;
    }
  }
  if (!listen.empty()) config.listen = listen;
  if (!state_dir.empty()) config.state_dir = state_dir;
  if (!device.empty()) config.device = device;
  if (metrics_listen != "unset") config.metrics_listen = metrics_listen;
  return megatrain::server::Run(config);
}
