// Generate and eval jobs (engine.h's GenerationJob): their plan without weights or a device.
#pragma once

#include "absl/status/statusor.h"
#include "engine/common/backend.h"
#include "engine/engine.h"

namespace megatrain {

// How `spec` runs on `backend` (a device's or a PlanningBackend): the sequences at once,
// resident or streamed weights, device and host bytes. Reads the model's config, tokenizer
// and the prompts, not the weights. The errors GenerationJob::Create gives for them.
[[nodiscard]] absl::StatusOr<PlanSummary> PlanGeneration(const GenerateSpec& spec,
                                                         Backend* backend);

}  // namespace megatrain
