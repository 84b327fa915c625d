// NCCL, loaded when first needed (dlopen), so that the daemon and the trainer run on
// machines without it and a deployment need not ship its 200 MB: the library is the
// one named by EngineSettings::nccl_library (main reads $MEGATRAIN_NCCL_LIBRARY), else
// libnccl.so.2 on the loader's path (CUDA's lib64, or the copy PyTorch ships under
// site-packages/nvidia/nccl/lib). It is loaded once per process, when first needed.
//
// NcclCollectives builds a single-process group over CUDA devices (ncclCommInitAll), one
// communicator per device, for GradCollective's reduce-scatter in fp32.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/common/collective.h"

namespace megatrain {

// "NCCL 2.28.9 (libnccl.so.2)", or why it cannot be used.
[[nodiscard]] absl::StatusOr<std::string> NcclVersion();

// The CUDA side of a group: device index and the native stream (cudaStream_t) behind each
// StreamId, per rank.
struct NcclRank {
  int device = 0;
  void* streams[kNumStreams] = {};
};

[[nodiscard]] absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> CreateNcclCollectives(
    const std::vector<NcclRank>& ranks);

}  // namespace megatrain
