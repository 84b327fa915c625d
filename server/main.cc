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

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/strings/ascii.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "engine/common/device_name.h"  // CudaDeviceIndexOf
#include "engine/common/engine_settings.h"
#include "engine/engine.h"
#include "rpc/address.h"
#include "server/access_service.h"
#include "server/config.h"
#include "server/identity.h"
#include "server/daemon_metrics.h"
#include "server/event_hub.h"
#include "server/job_runner.h"
#include "server/job_service.h"
#include "server/job_store.h"
#include "server/metrics_http.h"
#include "server/node_service.h"
#include "server/worker.h"
#include "server/worker_process.h"

namespace megatrain::server {
namespace {

// The lanes of `spec`: "auto" (every GPU, else the CPU), or a comma-separated list of
// "cpu" (may repeat: several CPU lanes), "cuda" (= cuda:0) and "cuda:N".
absl::StatusOr<std::vector<std::string>> ResolveDevices(const std::string& spec) {
  std::vector<std::string> devices;
  const int gpus = CudaAvailable() ? static_cast<int>(ListGpus().size()) : 0;
  if (spec == "auto") {
    for (int i = 0; i < gpus; ++i) devices.push_back(absl::StrCat("cuda:", i));
    if (devices.empty()) devices.push_back("cpu");
    return devices;
  }
  std::set<std::string> seen;
  for (absl::string_view part : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
    std::string d(absl::StripAsciiWhitespace(part));
    if (d == "cuda") d = "cuda:0";
    if (d != "cpu") {
      const int index = CudaDeviceIndexOf(d);
      if (d.rfind("cuda:", 0) != 0 || index < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "device must be auto, or a comma-separated list of cpu and cuda:N, got '", d, "'"));
      }
      if (index >= gpus) {
        return absl::InvalidArgumentError(absl::StrCat("device ", d, " requested, but ", gpus,
                                                       " CUDA device(s) are usable"));
      }
      if (!seen.insert(d).second) {
        return absl::InvalidArgumentError(absl::StrCat("device ", d, " is listed twice"));
      }
      if (!devices.empty() && devices.front() == "cpu") {
        return absl::InvalidArgumentError("device: mix no cpu lanes with GPUs");
      }
    } else if (!devices.empty() && devices.front() != "cpu") {
      return absl::InvalidArgumentError("device: mix no cpu lanes with GPUs");
    }
    devices.push_back(d);
  }
  if (devices.empty()) return absl::InvalidArgumentError("device is empty");
  return devices;
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// What stopping does, in words: "no job running; stopping", or "checkpointing job 4
// and requeueing it; stopping" (each running job once, though a gang runs on several lanes).
std::string StoppingMessage(std::vector<int64_t> running) {
  std::sort(running.begin(), running.end());
  running.erase(std::unique(running.begin(), running.end()), running.end());
  running.erase(std::remove(running.begin(), running.end(), 0), running.end());
  if (running.empty()) return "no job running; stopping";
  return absl::StrCat("checkpointing job", running.size() > 1 ? "s " : " ",
                      absl::StrJoin(running, ", "), " and requeueing ",
                      running.size() > 1 ? "them" : "it", "; stopping");
}

// Prints a stage's failure and returns the daemon's exit status for it.
int Fail(int exit_status, absl::string_view message) {
  std::fprintf(stderr, "megatraind: %.*s\n", static_cast<int>(message.size()), message.data());
  return exit_status;
}

// The Unix socket megatraind listens on: `listen` must be one (the kernel names local
// callers there); remote callers come over tcp_listen. InvalidArgument otherwise.
absl::StatusOr<std::string> ListenSocket(const DaemonConfig& config) {
  std::optional<std::string> socket = UnixSocketPath(config.listen);
  if (!socket.has_value() || socket->empty()) {
    return absl::InvalidArgumentError(
        "listen must be a unix: address (the kernel names local callers there); for remote "
        "callers set tcp_listen with tls_cert and tls_key");
  }
  return *socket;
}

// The job database in the state folder (made if missing), readable by the daemon alone:
// it holds every user's specs and the token hashes.
absl::StatusOr<std::unique_ptr<JobStore>> OpenJobStore(const std::string& state_dir) {
  namespace fs = std::filesystem;
  const mode_t old_umask = umask(077);
  const std::string db_path = (fs::path(state_dir) / "megatrain.db").string();
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(db_path);
  umask(old_umask);
  if (!store.ok()) return absl::UnknownError(store.status().ToString());
  chmod(db_path.c_str(), 0600);
  return store;
}

// What the daemon's metrics say of `device` (the first lane, standing for all: the GPUs of
// one box are alike), before the GEMM peak is known.
DaemonMetricsOptions MetricsOptionsFor(const DaemonConfig& config, const std::string& device) {
  DaemonMetricsOptions options;
  options.gpu = device == "cpu" ? "cpu" : device.substr(device.find(':') + 1);
  options.dcgm_job_mapping_dir = config.dcgm_job_mapping_dir;
  options.fair_share_half_life_hours = config.fair_share_half_life_hours;
  if (device != "cpu") {
    for (const GpuInfo& g : ListGpus()) {
      if (std::to_string(g.index) == options.gpu) options.device_name = g.name;
    }
  } else {
    options.device_name = "cpu";
  }
  return options;
}

// MFU's denominator: the configured peak, else the machine profile's measured GEMM peak,
// else the device's datasheet figure.
double PeakTflops(const DaemonConfig& config, const Planner& planner,
                  const std::string& device_name) {
  if (config.gpu_peak_tflops > 0) return config.gpu_peak_tflops;
  if (planner.gemm_peak_tflops() > 0) return planner.gemm_peak_tflops();
  return KnownBf16PeakTflops(device_name);
}

// The Prometheus endpoint on metrics_listen; null when that is "" (off).
absl::StatusOr<std::unique_ptr<MetricsHttpServer>> StartMetricsServer(
    const DaemonConfig& config, MetricsRegistry* registry) {
  if (config.metrics_listen.empty()) return std::unique_ptr<MetricsHttpServer>();
  return MetricsHttpServer::Start(config.metrics_listen, registry);
}

// Jobs that were running when the last daemon died go back to the queue: they resume
// from their checkpoints.
void RequeueInterruptedJobs(JobStore* store, JobRunner* runner) {
  absl::StatusOr<std::vector<v1::Job>> running = store->ListInState(v1::JOB_STATE_RUNNING);
  if (!running.ok()) return;
  for (v1::Job job : *running) {
    const absl::Status requeued = runner->SetState(
        &job, v1::JOB_STATE_QUEUED, "daemon restarted: requeued, resumes from its last checkpoint");
    if (!requeued.ok()) ReportWriteFailure(job.id(), "requeueing it at startup", requeued);
  }
}

// The gRPC server with `services`, started: on tcp_listen with TLS when configured (the
// Unix socket is UnixListener's: peer credentials). *tcp_port: the port bound (tcp_listen
// may ask for port 0, any free one). InvalidArgument "tls: ..." when the key or
// certificate cannot be read; Unavailable when it cannot listen.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const DaemonConfig& config, const std::vector<grpc::Service*>& services, int* tcp_port) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  *tcp_port = 0;
  if (!config.tcp_listen.empty()) {
    grpc::SslServerCredentialsOptions tls;
    grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
    absl::StatusOr<std::string> key = ReadSmallFile(config.tls_key);
    absl::StatusOr<std::string> cert = ReadSmallFile(config.tls_cert);
    if (!key.ok() || !cert.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tls: ", (key.ok() ? cert.status() : key.status()).message()));
    }
    pair.private_key = *key;
    pair.cert_chain = *cert;
    tls.pem_key_cert_pairs.push_back(pair);
    builder.AddListeningPort(config.tcp_listen, grpc::SslServerCredentials(tls), tcp_port);
  }
  for (grpc::Service* service : services) builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || (!config.tcp_listen.empty() && *tcp_port == 0)) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", config.tcp_listen));
  }
  return server;
}

// The line that says the daemon is up: where it listens (the bound port, not the asked
// one: with port 0 this line is how callers find it), its state, lanes and metrics.
void PrintListening(const DaemonConfig& config, int tcp_port,
                    const std::vector<std::string>& devices, double peak_tflops,
                    const MetricsHttpServer* metrics_server) {
  auto host = [](const std::string& host_port) {
    return host_port.substr(0, host_port.rfind(':'));
  };
  const std::string tcp_shown =
      config.tcp_listen.empty()
          ? ""
          : absl::StrCat(" and ", host(config.tcp_listen), ":", tcp_port, " (TLS)");
  const std::string metrics_shown =
      metrics_server != nullptr
          ? absl::StrCat("http://", host(config.metrics_listen), ":", metrics_server->port(),
                         "/metrics")
          : "off";
  std::printf("megatraind: listening on %s%s, state in %s, %s %s (GEMM peak %.3g TFLOP/s), "
              "metrics %s\n",
              config.listen.c_str(), tcp_shown.c_str(), config.state_dir.c_str(),
              devices.size() > 1 ? "lanes" : "device", absl::StrJoin(devices, ", ").c_str(),
              peak_tflops, metrics_shown.c_str());
  std::fflush(stdout);
}

// Blocks until SIGTERM or SIGINT (main blocked both in every thread), then says what
// stopping does.
void WaitForStopSignal(const JobRunner& runner) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  int sig = 0;
  sigwait(&signals, &sig);
  std::printf("megatraind: %s: %s\n", sig == SIGTERM ? "SIGTERM" : "SIGINT",
              StoppingMessage(runner.running_jobs()).c_str());
  std::fflush(stdout);
}

// The daemon, stage by stage: its state and database, its lanes, the machine's profile and
// the planner, metrics, the job runner and the services, then serving until a stop signal.
int Run(const DaemonConfig& config) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(config.state_dir, ec);
  if (ec) {
    return Fail(1, absl::StrCat("cannot create state_dir ", config.state_dir, ": ", ec.message()));
  }
  absl::StatusOr<std::string> socket = ListenSocket(config);
  if (!socket.ok()) return Fail(2, socket.status().message());
  absl::StatusOr<std::unique_ptr<JobStore>> store = OpenJobStore(config.state_dir);
  if (!store.ok()) return Fail(1, store.status().message());
  EventHub hub;
  absl::StatusOr<std::vector<std::string>> devices = ResolveDevices(config.device);
  if (!devices.ok()) return Fail(2, devices.status().message());
  const std::string device = devices->front();
  MetricsRegistry registry;
  DaemonMetricsOptions metrics_options = MetricsOptionsFor(config, device);
  // The machine profile (the planner's rates: PCIe, matmuls, attention, CPU AdamW), read
  // from the state folder or measured now.
  const int64_t admissible =
      static_cast<int64_t>(ReadHostMemory().total_bytes * config.host_memory_fraction);
  absl::StatusOr<std::unique_ptr<Planner>> planner = Planner::Create(
      device, (fs::path(config.state_dir) / "machine-profile.json").string(), admissible);
  if (!planner.ok()) {
    return Fail(1, absl::StrCat("measuring the machine: ", planner.status().message()));
  }
  std::printf("megatraind: %s\n", (*planner)->note().c_str());
  metrics_options.peak_tflops = PeakTflops(config, **planner, metrics_options.device_name);
  DaemonMetrics metrics(&registry, store->get(), metrics_options);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> metrics_server =
      StartMetricsServer(config, &registry);
  if (!metrics_server.ok()) return Fail(1, metrics_server.status().message());
  // Jobs and submission checks run in worker processes of this very executable.
  absl::StatusOr<int> exe_fd = OpenOwnExecutable();
  if (!exe_fd.ok()) return Fail(1, exe_fd.status().message());
  const std::string profile_json = (*planner)->profile_json();
  JobRunnerOptions runner_options;
  runner_options.exe_fd = *exe_fd;
  runner_options.profile_json = profile_json;
  runner_options.devices = *devices;
  runner_options.state_dir = config.state_dir;
  runner_options.host_memory_bytes = admissible;
  runner_options.config = &config;
  runner_options.metrics = &metrics;
  JobRunner runner(store->get(), &hub, runner_options);
  RequeueInterruptedJobs(store->get(), &runner);

  Authenticator auth(store->get(), config.admin_group);
  JobServiceOptions job_options;
  job_options.state_dir = config.state_dir;
  job_options.host_memory_bytes = admissible;
  job_options.planner = planner->get();
  job_options.auth = &auth;
  job_options.config = &config;
  job_options.exe_fd = *exe_fd;
  job_options.profile_json = profile_json;
  JobServiceImpl jobs(store->get(), &hub, &runner, job_options);
  NodeServiceImpl node(store->get(), device == "cpu" ? "cpu" : "cuda", admissible, &auth);
  AccessServiceImpl access(store->get(), &auth, &config);

  fs::create_directories(fs::path(*socket).parent_path(), ec);
  int tcp_port = 0;
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      StartGrpcServer(config, {&jobs, &node, &access}, &tcp_port);
  if (!server.ok()) {
    return Fail(absl::IsInvalidArgument(server.status()) ? 2 : 1, server.status().message());
  }
  absl::StatusOr<std::unique_ptr<UnixListener>> unix_listener =
      UnixListener::Start(*socket, server->get(), &auth);
  if (!unix_listener.ok()) return Fail(1, unix_listener.status().message());
  runner.Start();
  PrintListening(config, tcp_port, *devices, metrics_options.peak_tflops, metrics_server->get());

  WaitForStopSignal(runner);
  runner.Shutdown();
  unix_listener->reset();  // no new connections
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return 0;
}

}  // namespace
}  // namespace megatrain::server

int main(int argc, char** argv) {
  // The engine's settings from the environment (engine/common/engine_settings.h); a
  // worker inherits the daemon's environment, so both read the same.
  megatrain::SetEngineSettings(megatrain::EngineSettingsFromEnvironment(
      [](const char* name) { return std::getenv(name); }));
  megatrain::SetCollectiveDefaults();  // before any thread
  // A job's or a submission's worker process, started by a daemon (server/worker.h): its
  // channel to the daemon is fd 3.
  if (argc == 2 && std::string(argv[1]) == "worker") return megatrain::server::RunWorker(3);
  // Block the stop signals in every thread; main waits for them with sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  const char* home = std::getenv("HOME");
  megatrain::server::DaemonConfig config =
      megatrain::server::DefaultDaemonConfig(home != nullptr ? home : "");
  CLI::App app{"megatraind: the megatrain training daemon"};
  std::string config_path, listen, state_dir, device, metrics_listen = "unset";
  std::string tcp_listen, tls_cert, tls_key;
  app.add_option("--config", config_path, "YAML config file (optional)");
  app.add_option("--listen", listen, "Unix socket: unix:/path (default " + config.listen + ")");
  app.add_option("--state-dir", state_dir, "job database and checkpoints (default " + config.state_dir + ")");
  app.add_option("--device", device, "auto (every GPU, else the CPU) | cpu | cuda:N[,cuda:M...]");
  app.add_option("--metrics-listen", metrics_listen,
                 "Prometheus /metrics host:port, \"\" for none (default " + config.metrics_listen + ")");
  app.add_option("--tcp-listen", tcp_listen, "also listen on host:port, TLS and tokens only");
  app.add_option("--tls-cert", tls_cert, "PEM certificate chain for --tcp-listen");
  app.add_option("--tls-key", tls_key, "PEM private key for --tcp-listen");
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
  if (!tcp_listen.empty()) config.tcp_listen = tcp_listen;
  if (!tls_cert.empty()) config.tls_cert = tls_cert;
  if (!tls_key.empty()) config.tls_key = tls_key;
  if (!config.tcp_listen.empty() && (config.tls_cert.empty() || config.tls_key.empty())) {
    std::fprintf(stderr, "megatraind: --tcp-listen needs --tls-cert and --tls-key: tokens never "
                         "cross the network in the clear\n");
    return 2;
  }
  return megatrain::server::Run(config);
}
