// The engine's public header: all that server/, client/ and the tools include (with
// engine/common/*.h). What it offers, and where each lives:
//
//   a job spec       LoadJobSpec / ParseJobSpec, JobSpec             job/spec.h
//   its inputs       ValidateJobInputs (before a job is queued)     job/inputs.h
//   planning         JobPlanner: profile + PlanJob -> PlannedJob    job/job_planner.h
//   running          Trainer::Create, Step() until done(), SaveCheckpoint   job/trainer.h
//   the machine      ListGpus, CudaAvailable                         backend/devices.h,
//                    SetCollectiveDefaults (first thing in main)     backend/factory.h,
//                    MachineProfile, LoadMachineProfile              plan/machine_profile.h
//
//   absl::StatusOr<JobSpec> spec = LoadJobSpec("job.yaml");
//   absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(*spec);
//   while (!(*t)->done()) { absl::StatusOr<StepReport> r = (*t)->Step(); ... }
#pragma once

#include "engine/backend/devices.h"      // IWYU pragma: export
#include "engine/job/inputs.h"           // IWYU pragma: export
#include "engine/job/job_planner.h"      // IWYU pragma: export
#include "engine/job/spec.h"             // IWYU pragma: export
#include "engine/job/trainer.h"          // IWYU pragma: export
#include "engine/plan/machine_profile.h" // IWYU pragma: export
