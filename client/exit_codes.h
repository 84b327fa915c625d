// The exit codes of `megatrain`, the mapping from gRPC status codes onto them, and the
// text that documents them in `megatrain --help`. Kept together so that they agree.
#pragma once

#include <grpcpp/support/status.h>

namespace megatrain::client {

enum ExitCode : int {
  kExitOk = 0,
  kExitInternal = 1,            // internal or unknown error
  kExitUsage = 2,               // bad usage, INVALID_ARGUMENT, unreadable file
  kExitNotFound = 3,            // NOT_FOUND
  kExitUnreachable = 4,         // UNAVAILABLE, or DEADLINE_EXCEEDED while connecting
  kExitPermissionDenied = 5,    // PERMISSION_DENIED, UNAUTHENTICATED
  kExitResourceExhausted = 6,   // RESOURCE_EXHAUSTED
  kExitFailedPrecondition = 7,  // FAILED_PRECONDITION
  kExitJobFailed = 10,          // `watch`, `generate`, `eval`: the job failed
  kExitJobCancelled = 11,       // `watch`, `generate`, `eval`: the job was cancelled
};

// The exit code for an RPC that ended with `code`. DEADLINE_EXCEEDED maps to
// kExitInternal here: only the caller knows whether the channel ever connected.
int ExitCodeFor(grpc::StatusCode code);

// The "Exit codes:" section of the top-level --help.
extern const char kExitCodesHelp[];

}  // namespace megatrain::client
