#include "server/config.h"

#include <unistd.h>

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"
#include "rpc/address.h"
#include "yaml-cpp/yaml.h"

namespace megatrain::server {

DaemonConfig DefaultDaemonConfig(const std::string& home) {
  DaemonConfig c;
  c.listen = DefaultAddress();
  if (geteuid() == 0) {
    c.state_dir = "/var/lib/megatrain";
  } else {
    c.state_dir = absl::StrCat(home.empty() ? "/tmp" : home, "/.local/state/megatrain");
  }
  return c;
}

namespace {

absl::Status ParseLimits(const std::string& path, const std::string& field, const YAML::Node& node,
                         UserLimits* limits) {
  if (!node.IsMap()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", field, " must be a mapping"));
  }
  for (const auto& kv : node) {
    const std::string key = kv.first.Scalar();
    const YAML::Node& v = kv.second;
    if (key == "max_running_jobs") {
      limits->max_running_jobs = v.as<int>();
    } else if (key == "max_queued_jobs") {
      limits->max_queued_jobs = v.as<int>();
    } else if (key == "max_host_memory_gib") {
      limits->max_host_bytes = static_cast<int64_t>(v.as<double>() * (1ll << 30));
    } else if (key == "max_priority") {
      limits->max_priority = v.as<int>();
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": ", field, ": unknown field '", key,
          "' (known: max_running_jobs, max_queued_jobs, max_host_memory_gib, max_priority)"));
    }
  }
  if (limits->max_running_jobs < 0 || limits->max_queued_jobs < 0 || limits->max_host_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", field, ": limits must be 0 (none) or positive"));
  }
  return absl::OkStatus();
}

}  // namespace

UserLimits DaemonConfig::LimitsFor(const std::string& user) const {
  auto it = user_limits.find(user);
  return it == user_limits.end() ? limits : it->second;
}

namespace {

absl::Status ParseWorkerLimits(const std::string& path, const YAML::Node& node,
                               WorkerLimits* limits) {
  if (!node.IsMap()) return absl::InvalidArgumentError(absl::StrCat(path, ": workers must be a mapping"));
  const std::map<std::string, double*> seconds_or_sizes = {
      {"memory_factor", &limits->memory_factor},
      {"memory_headroom_gib", &limits->memory_headroom_gib},
      {"silence_timeout_s", &limits->silence_timeout_s},
      {"stop_grace_s", &limits->stop_grace_s},
      {"check_timeout_s", &limits->check_timeout_s},
      {"check_memory_gib", &limits->check_memory_gib}};
  const std::map<std::string, int64_t*> counts = {{"open_files", &limits->open_files},
                                                  {"processes", &limits->processes}};
  for (const auto& kv : node) {
    const std::string key = kv.first.Scalar();
    if (auto it = seconds_or_sizes.find(key); it != seconds_or_sizes.end()) {
      *it->second = kv.second.as<double>();
      if (!(*it->second >= 0)) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": workers.", key, " must be >= 0"));
      }
    } else if (auto count = counts.find(key); count != counts.end()) {
      *count->second = kv.second.as<int64_t>();
      if (*count->second < 0) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": workers.", key, " must be >= 0"));
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": workers: unknown field '", key, "' (known: memory_factor, memory_headroom_gib, "
          "silence_timeout_s, stop_grace_s, check_timeout_s, check_memory_gib, open_files, "
          "processes)"));
    }
  }
  if (limits->silence_timeout_s <= 0 || limits->check_timeout_s <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": workers.silence_timeout_s and check_timeout_s must be positive"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LoadDaemonConfig(const std::string& path, DaemonConfig* config) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    return absl::NotFoundError(absl::StrCat("cannot read config file ", path));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid YAML: ", Printable(e.what())));
  }
  if (root.IsNull()) return absl::OkStatus();
  if (!root.IsMap()) return absl::InvalidArgumentError(absl::StrCat(path, ": must be a mapping"));
  const std::set<std::string> known = {
      "listen",       "state_dir",  "device",     "host_memory_fraction",
      "metrics_listen", "gpu_peak_tflops", "dcgm_job_mapping_dir", "admin_group",
      "file_roots",   "tcp_listen", "tls_cert",   "tls_key",
      "fair_share_half_life_hours", "preemption", "limits", "user_limits", "workers"};
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
    if (root["admin_group"]) config->admin_group = root["admin_group"].as<std::string>();
    if (root["file_roots"]) {
      config->file_roots = root["file_roots"].as<std::vector<std::string>>();
      for (const std::string& r : config->file_roots) {
        if (r.empty() || r[0] != '/') {
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": file_roots must be absolute folders, got '", r, "'"));
        }
      }
    }
    if (root["tcp_listen"]) config->tcp_listen = root["tcp_listen"].as<std::string>();
    if (root["tls_cert"]) config->tls_cert = root["tls_cert"].as<std::string>();
    if (root["tls_key"]) config->tls_key = root["tls_key"].as<std::string>();
    if (root["fair_share_half_life_hours"]) {
      config->fair_share_half_life_hours = root["fair_share_half_life_hours"].as<double>();
    }
    if (root["preemption"]) config->preemption = root["preemption"].as<bool>();
    if (root["limits"]) RETURN_IF_ERROR(ParseLimits(path, "limits", root["limits"], &config->limits));
    if (root["workers"]) RETURN_IF_ERROR(ParseWorkerLimits(path, root["workers"], &config->workers));
    if (root["user_limits"]) {
      if (!root["user_limits"].IsMap()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": user_limits must be a mapping"));
      }
      for (const auto& kv : root["user_limits"]) {
        const std::string user = kv.first.Scalar();
        UserLimits limits = config->limits;
        RETURN_IF_ERROR(ParseLimits(path, absl::StrCat("user_limits.", user), kv.second, &limits));
        config->user_limits[user] = limits;
      }
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", Printable(e.what())));
  }
  if (!(config->host_memory_fraction > 0 && config->host_memory_fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": host_memory_fraction must be in (0, 1]"));
  }
  if (!config->tcp_listen.empty() && (config->tls_cert.empty() || config->tls_key.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": tcp_listen needs tls_cert and tls_key: tokens never cross the network in "
        "the clear"));
  }
  if (!(config->fair_share_half_life_hours > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": fair_share_half_life_hours must be positive"));
  }
  return absl::OkStatus();
}

}  // namespace megatrain::server
