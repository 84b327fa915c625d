// Built when CUDA is there but nccl.h is not: gradients are then added on the host.
#include "engine/backend/nccl.h"

namespace megatrain {

absl::StatusOr<std::string> NcclVersion() {
  return absl::UnavailableError("this build has no NCCL support (nccl.h was not found)");
}

absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> CreateNcclCollectives(
    const std::vector<NcclRank>&) {
  return NcclVersion().status();
}

}  // namespace megatrain
