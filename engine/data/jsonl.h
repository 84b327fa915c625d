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
//   NotFound         the file is missing, unreadable or a directory
//   InvalidArgument  a line is not valid JSON, not an object, lacks `field`, or has it
//                    with another type ("is a number, expected a string"); or the file
//                    holds no documents
//   DataLoss         reading failed part-way
[[nodiscard]] absl::StatusOr<std::vector<std::string>> ReadJsonlTexts(const std::string& path,
                                                        const std::string& field);

}  // namespace megatrain
