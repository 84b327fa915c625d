// gRPC status code -> exit code. The codes the daemon documents (jobs.proto) each get
// their own exit code so scripts can branch on them; the rest are "internal".
#include "client/exit_codes.h"

namespace megatrain::client {

int ExitCodeFor(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return kExitOk;
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::OUT_OF_RANGE:
      return kExitUsage;
    case grpc::StatusCode::NOT_FOUND:
      return kExitNotFound;
    case grpc::StatusCode::UNAVAILABLE:
      return kExitUnreachable;
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::UNAUTHENTICATED:
      return kExitPermissionDenied;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return kExitResourceExhausted;
    case grpc::StatusCode::FAILED_PRECONDITION:
      return kExitFailedPrecondition;
    default:
      return kExitInternal;
  }
}

const char kExitCodesHelp[] =
    "Exit codes:\n"
    "  0   success\n"
    "  1   internal or unknown error\n"
    "  2   bad usage or invalid argument (e.g. an invalid or unreadable job spec)\n"
    "  3   not found (e.g. no such job)\n"
    "  4   megatraind unreachable (is it running? set --addr or MEGATRAIN_ADDR)\n"
    "  5   permission denied (e.g. acting on another user's job)\n"
    "  6   resource exhausted (e.g. the job does not fit in host memory)\n"
    "  7   failed precondition (e.g. releasing a job that is not held)\n"
    "  10  watch, generate, eval: the job failed\n"
    "  11  watch, generate, eval: the job was cancelled\n";

}  // namespace megatrain::client
