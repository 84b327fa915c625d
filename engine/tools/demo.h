// The embedded demo job: a small Llama-style model initialised at random and a short
// English text, so `megatrain-train --demo` trains something real with no files at all.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace megatrain {

// Writes demo.yaml, data.jsonl into `dir` and returns the spec's path. The job
// checkpoints into dir/checkpoints.
[[nodiscard]] absl::StatusOr<std::string> WriteDemoJob(const std::string& dir, int64_t steps);

}  // namespace megatrain
