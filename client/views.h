// Table-mode text for the API's messages: what `list`, `status`, `watch`, `submit` and
// `node` print. Pure functions over the messages (plus "now" and a time zone), built on
// format.h; --output json bypasses them (protobuf's JSON encoder escapes controls). Every
// string from the daemon is shown through TerminalText(), or TerminalLines() for the spec:
// a job's name or error cannot move the cursor or forge a line.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "megatrain/v1/jobs.pb.h"
#include "megatrain/v1/node.pb.h"

namespace megatrain::client {

// `list`: columns ID, NAME, OWNER, STATE, STEP, LOSS, TOK/S, AGE (since creation).
std::string FormatJobTable(const std::vector<v1::Job>& jobs, int64_t now_unix_ms);

// `status`: "key: value" lines, then the spec the daemon runs, indented.
std::string FormatJobStatus(const v1::Job& job, int64_t now_unix_ms, absl::TimeZone tz);

// Whether `job` is an eval job (Job.kind), whose progress carries an accuracy.
bool ScoresAnswers(const v1::Job& job);

// One line for a job's state: "job 12 (demo): running on cuda:0". Never the error: the
// caller prints that where it belongs (stderr).
std::string FormatJobState(const v1::Job& job);

// `submit`: "submitted job 12 (demo), queued".
std::string FormatSubmitted(const v1::Job& job);

// "job 12 (demo)", or "job 12" when it has no name.
std::string JobLabel(const v1::Job& job);

// `node`: host summary, then a GPU table and a NUMA table.
std::string FormatNode(const v1::Node& node);

}  // namespace megatrain::client
