// Job specs at the API edge: a SubmitJobRequest's spec (YAML text, or the structured
// message) becomes the engine's validated JobSpec, through the one parser the local
// runner uses, so both name fields the same way in their errors.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "megatrain/v1/jobs.pb.h"
#include "server/run_as.h"

namespace megatrain::server {

// The structured spec as YAML (only the fields that are set).
std::string SpecMessageToYaml(const v1::JobSpec& spec);

// Parses and validates the request's spec; relative paths resolve against base_dir.
absl::StatusOr<JobSpec> SpecFromRequest(const v1::SubmitJobRequest& request);

// Everything a job touches, checked on the user's worker (server/run_as.h): every path
// inside `roots` and out of the state folder except `own_dir`; the checkpoint and data
// cache folders writable (created if missing); then the engine's ValidateJobInputs.
absl::Status CheckJobFiles(const JobSpec& spec, const FileRoots& roots, const std::string& own_dir);

}  // namespace megatrain::server
