#include "server/node_service.h"

#include <numa.h>
#include <sqlite3.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "google/protobuf/stubs/common.h"
#include "engine/engine.h"
#include "grpcpp/grpcpp.h"

namespace megatrain::server {

HostMemory ReadHostMemory() {
  HostMemory m;
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemTotal:") m.total_bytes = kib * 1024;
    if (key == "MemAvailable:") m.available_bytes = kib * 1024;
  }
  return m;
}

namespace {

// "32.0 GT/s PCIe x16" from sysfs, "" when unknown.
std::string PcieLink(std::string bus_id) {
  for (char& c : bus_id) c = static_cast<char>(std::tolower(c));
  const std::string dir = "/sys/bus/pci/devices/" + bus_id + "/";
  std::ifstream speed(dir + "current_link_speed"), width(dir + "current_link_width");
  std::string s, w;
  if (!std::getline(speed, s) || !std::getline(width, w)) return "";
  return s + " x" + w;
}

}  // namespace

NodeServiceImpl::NodeServiceImpl(JobStore* store, std::string backend, int64_t admissible_bytes,
                                 Authenticator* auth)
    : store_(store), backend_(std::move(backend)), admissible_bytes_(admissible_bytes), auth_(auth) {}

grpc::Status NodeServiceImpl::GetNode(grpc::ServerContext* ctx, const v1::GetNodeRequest*,
                                      v1::Node* resp) {
  if (absl::StatusOr<Caller> who = auth_->Identify(*ctx); !who.ok()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(who.status().message()));
  }
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  resp->set_hostname(host);
  resp->set_cpu_count(static_cast<int32_t>(sysconf(_SC_NPROCESSORS_ONLN)));
  const HostMemory mem = ReadHostMemory();
  resp->set_host_memory_total_bytes(mem.total_bytes);
  int64_t reserved = 0, nvme = 0;
  std::map<std::string, int64_t> running_on;  // device -> the job running there
  for (v1::JobState s : {v1::JOB_STATE_RUNNING, v1::JOB_STATE_QUEUED}) {
    absl::StatusOr<std::vector<v1::Job>> jobs = store_->ListInState(s);
    if (!jobs.ok()) continue;
    for (const v1::Job& j : *jobs) {
      reserved += j.host_bytes_estimate();
      nvme += j.plan().nvme_bytes();
      if (s == v1::JOB_STATE_RUNNING) running_on[j.device()] = j.id();
    }
  }
  resp->set_host_memory_reserved_bytes(reserved);
  resp->set_host_memory_free_bytes(std::max<int64_t>(0, admissible_bytes_ - reserved));
  resp->set_nvme_reserved_bytes(nvme);
  resp->set_backend(backend_);
  resp->set_version("0.1.0");
  (*resp->mutable_versions())["grpc"] = grpc::Version();
  (*resp->mutable_versions())["protobuf"] =
      google::protobuf::internal::VersionString(GOOGLE_PROTOBUF_VERSION);
  (*resp->mutable_versions())["sqlite"] = sqlite3_libversion();
  for (const GpuInfo& g : ListGpus()) {
    v1::Gpu* gpu = resp->add_gpus();
    if (auto it = running_on.find(absl::StrCat("cuda:", g.index)); it != running_on.end()) {
      gpu->set_running_job(it->second);
    }
    gpu->set_index(g.index);
    gpu->set_name(g.name);
    gpu->set_memory_bytes(g.memory_bytes);
    gpu->set_numa_node(g.numa_node);
    gpu->set_pci_bus_id(g.pci_bus_id);
    gpu->set_pcie_link(PcieLink(g.pci_bus_id));
  }
  if (numa_available() >= 0) {
    for (int node = 0; node <= numa_max_node(); ++node) {
      long long free_bytes = 0;
      const long long size = numa_node_size64(node, &free_bytes);
      if (size <= 0) continue;
      v1::NumaNode* n = resp->add_numa_nodes();
      n->set_id(node);
      n->set_memory_total_bytes(size);
      n->set_memory_free_bytes(free_bytes);
      struct bitmask* cpus = numa_allocate_cpumask();
      if (numa_node_to_cpus(node, cpus) == 0) {
        for (unsigned i = 0; i < cpus->size; ++i) {
          if (numa_bitmask_isbitset(cpus, i)) n->add_cpus(static_cast<int32_t>(i));
        }
      }
      numa_free_cpumask(cpus);
    }
  }
  return grpc::Status::OK;
}

}  // namespace megatrain::server
