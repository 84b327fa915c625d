// Job specs at the API edge: a SubmitJobRequest's spec (YAML text, or the structured
// message) becomes the engine's validated JobSpec, through the one parser the local
// runner uses, so both name fields the same way in their errors.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "megatrain/v1/jobs.pb.h"

namespace megatrain::server {

// The structured spec as YAML (only the fields that are set).
std::string SpecMessageToYaml(const v1::JobSpec& spec);

// Parses and validates the request's spec; relative paths resolve against base_dir.
absl::StatusOr<JobSpec> SpecFromRequest(const v1::SubmitJobRequest& request);

// Checks what a spec refers to exists and is readable, before it is queued:
// NOT_FOUND / INVALID_ARGUMENT naming the field ("data.path: cannot read ...").
absl::Status CheckSpecInputs(const JobSpec& spec);

}  // namespace megatrain::server
