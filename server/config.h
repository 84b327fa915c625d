// megatraind's configuration: embedded defaults, overridden by an optional YAML file,
// overridden by flags. Parsed once in main; nothing below reads the environment.
//
//   listen: unix:/run/megatrain/megatrain.sock   # or host:port for TCP
//   state_dir: /var/lib/megatrain                # the job database and default checkpoints
//   device: auto                                 # auto | cpu | cuda:N
//   host_memory_fraction: 0.9                    # of MemTotal that jobs may be admitted with
//   metrics_listen: 127.0.0.1:9470               # Prometheus /metrics; "" turns it off
//   gpu_peak_tflops: 0                           # MFU's peak; 0 = measure a GEMM at start
//   dcgm_job_mapping_dir: ""                     # e.g. /var/lib/dcgm-exporter/job-mapping
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace megatrain::server {

struct DaemonConfig {
  std::string listen;     // default: DefaultAddress() (client/address.h)
  std::string state_dir;  // default: /var/lib/megatrain as root, else ~/.local/state/megatrain
  std::string device = "auto";
  double host_memory_fraction = 0.9;
  std::string metrics_listen = "127.0.0.1:9470";
  double gpu_peak_tflops = 0;
  std::string dcgm_job_mapping_dir;
};

DaemonConfig DefaultDaemonConfig();
// Applies the fields of a YAML config file onto `config`. Unknown fields are errors.
[[nodiscard]] absl::Status LoadDaemonConfig(const std::string& path, DaemonConfig* config);

}  // namespace megatrain::server
