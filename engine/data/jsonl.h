// JSON Lines datasets: one JSON object per line, the document text in one string field.
//
// The whole file is read and validated up front, so a bad line fails the job at setup
// with its line number instead of hours into training.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace megatrain {

// The value of string field `field` from every non-blank line of the file at `path`,
// in file order. Blank lines (only whitespace) are skipped; line numbers are 1-based.
// Errors name "path:line" and the problem:
//   NotFound         the file is missing or a directory (PermissionDenied: unreadable)
//   InvalidArgument  a line is not valid JSON, not an object, lacks `field`, or has it
//                    with another type ("is a number, expected a string"); or the file
//                    holds no documents
//                    or a line is longer than kMaxLineBytes (line_reader.h), or the path
//                    is not a regular file (a FIFO, a device: refused without blocking)
//   DataLoss         reading failed part-way
[[nodiscard]] absl::StatusOr<std::vector<std::string>> ReadJsonlTexts(const std::string& path,
                                                        const std::string& field);

}  // namespace megatrain
