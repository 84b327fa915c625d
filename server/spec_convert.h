// The API's messages and the engine's value types, converted at the edge: a
// SubmitJobRequest's spec (YAML text, through the parser the local runner uses, or the
// structured message, field by field) becomes the engine's JobSpec, validated by the one
// stage both share (ValidateJobSpec), so both name fields the same way in their errors; a
// plan's summary becomes the API's JobPlan, a DPO job's metrics its Preference.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "megatrain/v1/jobs.pb.h"
#include "server/run_as.h"

namespace megatrain::server {

// The structured spec as a validated JobSpec: the fields that are set (a zero number or an
// empty string is unset: the spec's default), names of choices parsed into their types,
// relative paths resolved against base_dir.
absl::StatusOr<JobSpec> SpecFromMessage(const v1::JobSpec& message, const std::string& base_dir);

// Parses and validates the request's spec; relative paths resolve against base_dir.
absl::StatusOr<JobSpec> SpecFromRequest(const v1::SubmitJobRequest& request);

// Everything a job touches, checked on the user's worker (server/run_as.h): every path
// inside `roots` and out of the state folder except `own_dir`; the engine's
// ValidateJobInputs (its folders, model, tokenizer, data); then the checkpoint and data
// cache folders writable (created if missing).
absl::Status CheckJobFiles(const JobSpec& spec, const FileRoots& roots, const std::string& own_dir);

// A plan's summary as the API's JobPlan message.
v1::JobPlan JobPlanMessage(const PlanSummary& plan);

// A DPO job's metrics, to the API's message and back.
void PreferenceToMessage(const PreferenceReport& report, v1::Preference* out);
PreferenceReport PreferenceFromMessage(const v1::Preference& message);

}  // namespace megatrain::server
