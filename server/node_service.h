// megatrain.v1.NodeService: what this box has (GPUs, NUMA nodes, host memory) and what
// jobs have reserved of it.
#pragma once

#include <string>

#include "megatrain/v1/node.grpc.pb.h"
#include "server/identity.h"
#include "server/job_store.h"

namespace megatrain::server {

// Host memory from /proc/meminfo: MemTotal and MemAvailable, in bytes.
struct HostMemory {
  int64_t total_bytes = 0;
  int64_t available_bytes = 0;
};
HostMemory ReadHostMemory();

class NodeServiceImpl final : public v1::NodeService::Service {
 public:
  // Callers must be known to `auth` (anyone on the machine, or a token holder).
  NodeServiceImpl(JobStore* store, std::string backend, int64_t admissible_bytes,
                  Authenticator* auth);
  grpc::Status GetNode(grpc::ServerContext* ctx, const v1::GetNodeRequest* req,
                       v1::Node* resp) override;

 private:
  JobStore* store_;
  std::string backend_;
  int64_t admissible_bytes_;
  Authenticator* auth_;
};

}  // namespace megatrain::server
