// LineReader: the lines of a dataset file, each bounded in length.
//
// A dataset is read a line at a time, and one line is one example held in memory whole.
// A giant file with no newline (a binary, a JSON array on one line) would otherwise be
// read into one string until memory runs out; a line longer than the bound is refused
// instead, naming the file, the line and the limit. The file is opened with
// OpenRegularFile, so a FIFO or a device is refused without blocking.
//
// Not thread-safe; move-only.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/common/durable_file.h"

namespace megatrain {

// The longest line a dataset may hold: one example's JSON.
inline constexpr int64_t kMaxLineBytes = int64_t{256} << 20;

class LineReader {
 public:
  // Opens `path`; `field` names it in errors ("data.path"). See OpenRegularFile.
  [[nodiscard]] static absl::StatusOr<LineReader> Open(const std::string& path,
                                                       absl::string_view field,
                                                       int64_t max_line_bytes = kMaxLineBytes);

  // The next line, without its '\n', into *line; false at the end of the file. Lines
  // split as std::getline splits them: a last line without '\n' is a line, an empty
  // remainder is not. InvalidArgument "data.path: <path>:<n>: line <n> is longer than
  // 256 MiB ..." for a line over the bound; DataLoss when a read fails.
  [[nodiscard]] absl::StatusOr<bool> Next(std::string* line);

  // 1-based number of the line Next returned last (0 before the first).
  int64_t line_number() const { return line_number_; }

 private:
  LineReader(ScopedFd fd, std::string path, std::string field, int64_t max_line_bytes)
      : fd_(std::move(fd)),
        path_(std::move(path)),
        field_(std::move(field)),
        max_line_bytes_(max_line_bytes) {}
  // Reads more into buffer_; false at the end of the file.
  absl::StatusOr<bool> Fill();

  ScopedFd fd_;
  std::string path_;
  std::string field_;
  int64_t max_line_bytes_;
  std::string buffer_;  // read but not yet returned: buffer_[begin_, end)
  size_t begin_ = 0;
  bool eof_ = false;
  int64_t line_number_ = 0;
};

}  // namespace megatrain
