// Status helpers shared by the engine, the server and the client.
//
// Debian 12's Abseil (20220623) ships absl::Status but no status macros, so the two we
// use are defined here once. Codes follow absl, which map 1:1 onto gRPC status codes.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define MT_STATUS_CONCAT_INNER(a, b) a##b
#define MT_STATUS_CONCAT(a, b) MT_STATUS_CONCAT_INNER(a, b)

// Returns from the current function if `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                             \
  do {                                                    \
    ::absl::Status mt_status_ = (expr);                   \
    if (!mt_status_.ok()) return mt_status_;              \
  } while (0)

// `lhs = value of expr` (an absl::StatusOr<T>), or returns its error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL(MT_STATUS_CONCAT(mt_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()

namespace megatrain {

// Prefixes an error's message with context ("reading model.safetensors: ...").
inline absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace megatrain
