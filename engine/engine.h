// The engine's public header: what server/ and the tools include.
//
//   absl::StatusOr<JobSpec> spec = LoadJobSpec("job.yaml");
//   absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(*spec);
//   while (!(*t)->done()) { absl::StatusOr<StepReport> r = (*t)->Step(); ... }
#pragma once

#include "engine/job/inputs.h"   // IWYU pragma: export
#include "engine/job/spec.h"     // IWYU pragma: export
#include "engine/job/trainer.h"  // IWYU pragma: export
