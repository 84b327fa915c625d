// The reduce-scatter rate between the devices of a data-parallel job (the planner's peer
// rate), measured per job with its own collectives. The machine's other rates, measured
// once per machine, are machine_profile.h.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/common/backend.h"
#include "engine/common/collective.h"

namespace megatrain {

// The rate of a reduce-scatter over `group` (of `backends`): GB/s each device moves to
// the others, (N-1)/N of a `bytes` buffer per call, timed over a few calls after a
// warm-up. The planner's peer rate (NVLink, or PCIe peer copies). Allocates `bytes` on
// every device for the while.
[[nodiscard]] absl::StatusOr<double> MeasureReduceScatterGbps(
    const std::vector<Backend*>& backends,
    const std::vector<std::unique_ptr<GradCollective>>& group, int64_t bytes = 256ll << 20);

}  // namespace megatrain
