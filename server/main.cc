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
#include "server/event_hub.h"
#include "server/job_runner.h"
#include "server/job_service.h"
#include "server/job_store.h"
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
  JobRunner runner(store->get(), &hub, JobRunnerOptions{device, config.state_dir});

  // Jobs that were running when the last daemon died resume from their checkpoints.
  absl::StatusOr<std::vector<v1::Job>> running = (*store)->ListInState(v1::JOB_STATE_RUNNING);
  if (running.ok()) {
    for (v1::Job job : *running) {
      (void)runner.SetState(&job, v1::JOB_STATE_QUEUED,
                            "daemon restarted: requeued, resumes from its last checkpoint");
    }
  }

  const HostMemory mem = ReadHostMemory();
  const int64_t admissible = static_cast<int64_t>(mem.total_bytes * config.host_memory_fraction);
  JobServiceImpl jobs(store->get(), &hub, &runner, JobServiceOptions{config.state_dir, admissible});
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
  std::printf("megatraind: listening on %s, state in %s, device %s\n", config.listen.c_str(),
              config.state_dir.c_str(), device.c_str());
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
  std::string config_path, listen, state_dir, device;
  app.add_option("--config", config_path, "YAML config file (optional)");
  app.add_option("--listen", listen, "address: unix:/path or host:port (default " + config.listen + ")");
  app.add_option("--state-dir", state_dir, "job database and checkpoints (default " + config.state_dir + ")");
  app.add_option("--device", device, "auto | cpu");
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
  return megatrain::server::Run(config);
}
