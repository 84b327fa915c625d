// POSIX file helpers: full-length pread/write loops, durable writes, and errno turned
// into absl::Status. A durable write goes to "<path>.tmp", is fsynced, renamed onto its
// name and its folder fsynced: a crash leaves the old file or the new one, never half of
// one. Model files (model/), checkpoints (checkpoint/) and their callers write this way.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace megatrain {

// An owned file descriptor; closes on destruction. Move-only.
class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ScopedFd(ScopedFd&& other) noexcept : fd_(other.Release()) {}
  ScopedFd& operator=(ScopedFd&& other) noexcept;
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd();

  int get() const { return fd_; }
  int Release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // Closes now, reporting the error close() can return after a failed delayed write.
  [[nodiscard]] absl::Status Close(absl::string_view path);

 private:
  int fd_ = -1;
};

// "<context>: <strerror(err)>", with the absl code errno maps to (ENOENT -> NotFound,
// ENOSPC -> ResourceExhausted, ...).
[[nodiscard]] absl::Status ErrnoError(int err, absl::string_view context);

// Reads exactly `num_bytes` at `offset`, in chunks, retrying EINTR and short reads. A read
// that hits end of file is DataLoss. Thread-safe (pread has no shared file position).
[[nodiscard]] absl::Status PreadAll(int fd, uint64_t offset, uint64_t num_bytes, void* out,
                                    absl::string_view context);

// Writes all `num_bytes`, in chunks, retrying EINTR and short writes.
[[nodiscard]] absl::Status WriteAll(int fd, const void* data, uint64_t num_bytes,
                                    absl::string_view context);

// Writes all `num_bytes` at `offset`, in chunks, retrying EINTR and short writes.
// Thread-safe for disjoint ranges (pwrite has no shared file position).
[[nodiscard]] absl::Status PwriteAll(int fd, uint64_t offset, const void* data,
                                     uint64_t num_bytes, absl::string_view context);

// Gives the file its final length `num_bytes` and, where the file system can, allocates
// its blocks now, so a full disk fails here rather than halfway through the writes.
[[nodiscard]] absl::Status ReserveFile(int fd, uint64_t num_bytes, absl::string_view context);

// fsyncs a file or folder by name (a folder: making the renames inside it durable).
[[nodiscard]] absl::Status FsyncPath(const std::string& path);

// Writes `contents` to `path` and fsyncs it (no rename: for files inside a folder that is
// itself renamed into place when whole, as a checkpoint is).
[[nodiscard]] absl::Status WriteFileSynced(const std::string& path, absl::string_view contents);

// Writes `contents` to "<path>.tmp", fsyncs it, renames it onto `path`, fsyncs the folder.
[[nodiscard]] absl::Status WriteFileDurably(const std::string& path, absl::string_view contents);
// The same, the file's bytes written by `write` (to `fd`; `context` names the file for
// its errors). On any failure the temporary file is removed and the old file stands.
[[nodiscard]] absl::Status WriteFileDurably(
    const std::string& path,
    const std::function<absl::Status(int fd, const std::string& context)>& write);

// Opens `path` (symlinks followed) for reading when it is a regular file, and never
// blocks: a FIFO without a writer would hang a plain open(), so the path is stat'ed first,
// opened O_NONBLOCK, fstat'ed again (it may have been swapped) and only then made
// blocking. `field` names the path in errors (the spec field, "data.path"; may be empty):
//   InvalidArgument  "data.path /tmp/f is not a regular file (a FIFO)" (a directory, a
//                    device, a socket are refused the same way)
//   InvalidArgument  "data.path: /tmp/f: a loop of symbolic links (...)"
//   NotFound, PermissionDenied, ...  from stat or open, with strerror ("data.path: /tmp/f:
//                    No such file or directory")
[[nodiscard]] absl::StatusOr<ScopedFd> OpenRegularFile(const std::string& path,
                                                       absl::string_view field);

// What a file of mode `st_mode` is, for messages: "a regular file", "a FIFO", "a
// character device", "a directory", ...
const char* FileKindName(unsigned int st_mode);

// The most ReadWholeFile reads: it is meant for configs and indexes.
inline constexpr int64_t kMaxWholeFileBytes = int64_t{1} << 30;

// The whole file (meant for small files: indexes, configs), opened by OpenRegularFile.
// InvalidArgument for a file over kMaxWholeFileBytes.
[[nodiscard]] absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

bool FileExists(const std::string& path);
std::string JoinPath(absl::string_view dir, absl::string_view name);
std::string DirName(absl::string_view path);

}  // namespace megatrain
