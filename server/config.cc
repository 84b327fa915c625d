#include "server/config.h"

#include <unistd.h>

#include <cstdlib>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/address.h"
#include "yaml-cpp/yaml.h"

namespace megatrain::server {

DaemonConfig DefaultDaemonConfig() {
  DaemonConfig c;
  c.listen = DefaultAddress();
  if (geteuid() == 0) {
    c.state_dir = "/var/lib/megatrain";
  } else {
    const char* home = std::getenv("HOME");
    c.state_dir = absl::StrCat(home != nullptr ? home : "/tmp", "/.local/state/megatrain");
  }
  return c;
}

absl::Status LoadDaemonConfig(const std::string& path, DaemonConfig* config) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    return absl::NotFoundError(absl::StrCat("cannot read config file ", path));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid YAML: ", e.what()));
  }
  if (root.IsNull()) return absl::OkStatus();
  if (!root.IsMap()) return absl::InvalidArgumentError(absl::StrCat(path, ": must be a mapping"));
  const std::set<std::string> known = {"listen",         "state_dir",       "device",
                                       "host_memory_fraction", "metrics_listen",
                                       "gpu_peak_tflops", "dcgm_job_mapping_dir"};
  try {
    for (const auto& kv : root) {
      const std::string key = kv.first.Scalar();
      if (known.count(key) == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": unknown field '", key, "' (known: ", absl::StrJoin(known, ", "), ")"));
      }
    }
    if (root["listen"]) config->listen = root["listen"].as<std::string>();
    if (root["state_dir"]) config->state_dir = root["state_dir"].as<std::string>();
    if (root["device"]) config->device = root["device"].as<std::string>();
    if (root["metrics_listen"]) config->metrics_listen = root["metrics_listen"].as<std::string>();
    if (root["gpu_peak_tflops"]) config->gpu_peak_tflops = root["gpu_peak_tflops"].as<double>();
    if (root["dcgm_job_mapping_dir"]) {
      config->dcgm_job_mapping_dir = root["dcgm_job_mapping_dir"].as<std::string>();
    }
    if (root["host_memory_fraction"]) {
      config->host_memory_fraction = root["host_memory_fraction"].as<double>();
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
  if (!(config->host_memory_fraction > 0 && config->host_memory_fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": host_memory_fraction must be in (0, 1]"));
  }
  return absl::OkStatus();
}

}  // namespace megatrain::server
