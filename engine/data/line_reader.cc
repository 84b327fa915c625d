#include "engine/data/line_reader.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "engine/common/status.h"

namespace megatrain {
namespace {

constexpr size_t kReadBytes = size_t{1} << 20;

std::string Size(int64_t bytes) {
  if (bytes >= (int64_t{1} << 20) && bytes % (int64_t{1} << 20) == 0) {
    return absl::StrCat(bytes >> 20, " MiB");
  }
  return absl::StrCat(bytes, " bytes");
}

}  // namespace

absl::StatusOr<LineReader> LineReader::Open(const std::string& path, absl::string_view field,
                                            int64_t max_line_bytes) {
  ASSIGN_OR_RETURN(ScopedFd fd, OpenRegularFile(path, field));
  return LineReader(std::move(fd), path, std::string(field), max_line_bytes);
}

absl::StatusOr<bool> LineReader::Fill() {
  if (eof_) return false;
  // Drop what was returned before growing the buffer.
  if (begin_ > 0) {
    buffer_.erase(0, begin_);
    begin_ = 0;
  }
  const size_t old = buffer_.size();
  buffer_.resize(old + kReadBytes);
  for (;;) {
    const ssize_t got = ::read(fd_.get(), buffer_.data() + old, kReadBytes);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int err = errno;
      buffer_.resize(old);
      return absl::DataLossError(absl::StrCat(field_.empty() ? "" : absl::StrCat(field_, ": "),
                                              "reading ", path_, " failed after line ",
                                              line_number_, ": ", std::strerror(err)));
    }
    buffer_.resize(old + static_cast<size_t>(got));
    if (got == 0) eof_ = true;
    return got > 0;
  }
}

absl::StatusOr<bool> LineReader::Next(std::string* line) {
  size_t searched = begin_;  // no '\n' in buffer_[begin_, searched)
  for (;;) {
    const size_t newline = buffer_.find('\n', searched);
    const size_t end = newline == std::string::npos ? buffer_.size() : newline;
    if (static_cast<int64_t>(end - begin_) > max_line_bytes_) {
      return absl::InvalidArgumentError(absl::StrCat(
          field_.empty() ? "" : absl::StrCat(field_, ": "), path_, ":", line_number_ + 1,
          ": line ", line_number_ + 1, " is longer than ", Size(max_line_bytes_),
          ", the most one example may take; is this a JSONL file (one JSON object a line)?"));
    }
    if (newline != std::string::npos) {
      line->assign(buffer_, begin_, newline - begin_);
      begin_ = newline + 1;
      ++line_number_;
      return true;
    }
    searched = buffer_.size() - begin_;  // Fill moves the unread part to the front
    ASSIGN_OR_RETURN(const bool more, Fill());
    if (!more) break;
  }
  if (begin_ >= buffer_.size()) return false;
  line->assign(buffer_, begin_, std::string::npos);
  begin_ = buffer_.size();
  ++line_number_;
  return true;
}

}  // namespace megatrain
