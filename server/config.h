// megatraind's configuration: embedded defaults, overridden by an optional YAML file,
// overridden by flags. Parsed once in main; nothing below reads the environment.
//
//   listen: unix:/run/megatrain/megatrain.sock   # or host:port for TCP
//   state_dir: /var/lib/megatrain                # the job database and default checkpoints
//   device: auto                                 # auto | cpu | cuda:N[,cuda:M...]: a lane each
//   host_memory_fraction: 0.9                    # of MemTotal that jobs may be admitted with
//   metrics_listen: 127.0.0.1:9470               # Prometheus /metrics; "" turns it off
//   gpu_peak_tflops: 0                           # MFU's peak; 0 = measure a GEMM at start
//   dcgm_job_mapping_dir: ""                     # e.g. /var/lib/dcgm-exporter/job-mapping
//   admin_group: megatrain-admin                 # its members (and root) are admins
//   file_roots: [/]                              # job files must lie inside these folders
//   tcp_listen: ""                               # host:port for remote callers (TLS + tokens)
//   tls_cert: "", tls_key: ""                    # PEM files; required with tcp_listen
//   fair_share_half_life_hours: 168              # how fast past GPU use is forgotten
//   preemption: true                             # higher priority checkpoints and requeues lower
//   limits: {max_running_jobs: 0, max_queued_jobs: 100, max_host_memory_gib: 0, max_priority: 10}
//   user_limits: {alice: {max_queued_jobs: 200}} # per user, over `limits`
//   workers: {memory_factor: 1.25, memory_headroom_gib: 8, silence_timeout_s: 120,
//             stop_grace_s: 30, check_timeout_s: 30, check_memory_gib: 8,
//             open_files: 65536, processes: 16384}  # server/worker_process.h
// Limits of 0 mean none; admins are not limited.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <cstdint>

#include "absl/status/statusor.h"

namespace megatrain::server {

// What one user may have at once.
struct UserLimits {
  int max_running_jobs = 0;    // 0: no limit
  int max_queued_jobs = 100;   // queued and held
  int64_t max_host_bytes = 0;  // summed over the user's running jobs; 0: the node's
  int max_priority = 10;       // the highest priority the user may ask for
};

// How jobs' worker processes are limited and watched (server/worker_process.h).
struct WorkerLimits {
  // A job's worker may hold its admitted plan's host bytes times memory_factor, plus
  // memory_headroom_gib (the runtime, the tokenizer, the CUDA driver's own).
  double memory_factor = 1.25;
  double memory_headroom_gib = 8;
  double silence_timeout_s = 120;  // no heartbeat for this long: hung, stopped
  double stop_grace_s = 30;        // cancel: SIGTERM, then SIGKILL after this
  double check_timeout_s = 30;     // a submission's check (files, tokenizer, plan)
  double check_memory_gib = 8;
  int64_t open_files = 65536;
  int64_t processes = 16384;       // RLIMIT_NPROC of the user, counted over all their processes
};

struct DaemonConfig {
  std::string listen;     // default: DefaultAddress() (rpc/address.h)
  std::string state_dir;  // default: /var/lib/megatrain as root, else ~/.local/state/megatrain
  std::string device = "auto";
  double host_memory_fraction = 0.9;
  std::string metrics_listen = "127.0.0.1:9470";
  double gpu_peak_tflops = 0;
  std::string dcgm_job_mapping_dir;
  std::string admin_group = "megatrain-admin";
  std::vector<std::string> file_roots = {"/"};
  std::string tcp_listen;
  std::string tls_cert;
  std::string tls_key;
  double fair_share_half_life_hours = 168;
  bool preemption = true;
  UserLimits limits;
  std::map<std::string, UserLimits> user_limits;
  WorkerLimits workers;

  // `limits`, overridden by user_limits[user].
  UserLimits LimitsFor(const std::string& user) const;
};

// The defaults, for this process's effective uid; `home` is $HOME as main read it ("" when
// unset: a user's state then goes under /tmp).
DaemonConfig DefaultDaemonConfig(const std::string& home);
// Applies the fields of a YAML config file onto `config`. Unknown fields are errors.
[[nodiscard]] absl::Status LoadDaemonConfig(const std::string& path, DaemonConfig* config);

}  // namespace megatrain::server
