// POSIX file helpers and durable writes; see durable_file.h.
#include "engine/common/durable_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "engine/common/status.h"

namespace megatrain {
namespace {

// Linux moves at most ~2 GiB per read/write call; stay well below it.
constexpr uint64_t kIoChunkBytes = uint64_t{64} << 20;

}  // namespace

ScopedFd& ScopedFd::operator=(ScopedFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.Release();
  }
  return *this;
}

ScopedFd::~ScopedFd() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status ScopedFd::Close(absl::string_view path) {
  const int fd = Release();
  if (fd >= 0 && ::close(fd) != 0) return ErrnoError(errno, absl::StrCat("closing ", path));
  return absl::OkStatus();
}

absl::Status ErrnoError(int err, absl::string_view context) {
  return absl::ErrnoToStatus(err, context);
}

absl::Status PreadAll(int fd, uint64_t offset, uint64_t num_bytes, void* out,
                      absl::string_view context) {
  char* dst = static_cast<char*>(out);
  while (num_bytes > 0) {
    const size_t want = static_cast<size_t>(std::min(num_bytes, kIoChunkBytes));
    const ssize_t got = ::pread(fd, dst, want, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, context);
    }
    if (got == 0) {
      return absl::DataLossError(absl::StrCat(
          context, ": unexpected end of file at byte ", offset,
          "; the file was truncated or replaced while open"));
    }
    dst += got;
    offset += static_cast<uint64_t>(got);
    num_bytes -= static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, const void* data, uint64_t num_bytes, absl::string_view context) {
  const char* src = static_cast<const char*>(data);
  while (num_bytes > 0) {
    const size_t want = static_cast<size_t>(std::min(num_bytes, kIoChunkBytes));
    const ssize_t put = ::write(fd, src, want);
    if (put < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, context);
    }
    src += put;
    num_bytes -= static_cast<uint64_t>(put);
  }
  return absl::OkStatus();
}

absl::Status PwriteAll(int fd, uint64_t offset, const void* data, uint64_t num_bytes,
                       absl::string_view context) {
  const char* src = static_cast<const char*>(data);
  while (num_bytes > 0) {
    const size_t want = static_cast<size_t>(std::min(num_bytes, kIoChunkBytes));
    const ssize_t put = ::pwrite(fd, src, want, static_cast<off_t>(offset));
    if (put < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, context);
    }
    src += put;
    offset += static_cast<uint64_t>(put);
    num_bytes -= static_cast<uint64_t>(put);
  }
  return absl::OkStatus();
}

absl::Status ReserveFile(int fd, uint64_t num_bytes, absl::string_view context) {
  if (num_bytes == 0) return absl::OkStatus();
  // fallocate(2), not posix_fallocate(3): where the file system cannot allocate, glibc's
  // fallback writes every block, which is the cost this avoids.
  if (::fallocate(fd, 0, 0, static_cast<off_t>(num_bytes)) == 0) return absl::OkStatus();
  if (errno != EOPNOTSUPP && errno != ENOSYS) return ErrnoError(errno, context);
  if (::ftruncate(fd, static_cast<off_t>(num_bytes)) != 0) return ErrnoError(errno, context);
  return absl::OkStatus();
}

absl::Status FsyncPath(const std::string& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoError(errno, absl::StrCat("opening ", path));
  if (::fsync(fd.get()) != 0) return ErrnoError(errno, absl::StrCat("fsync of ", path));
  return fd.Close(path);
}

absl::Status WriteFileSynced(const std::string& path, absl::string_view contents) {
  ScopedFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return ErrnoError(errno, absl::StrCat("creating ", path));
  RETURN_IF_ERROR(WriteAll(fd.get(), contents.data(), contents.size(),
                           absl::StrCat("writing ", path)));
  if (::fsync(fd.get()) != 0) return ErrnoError(errno, absl::StrCat("fsync of ", path));
  return fd.Close(path);
}

absl::Status WriteFileDurably(const std::string& path,
                              const std::function<absl::Status(int fd, const std::string& context)>&
                                  write) {
  const std::string tmp = path + ".tmp";
  ScopedFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return ErrnoError(errno, absl::StrCat("creating ", tmp));
  absl::Status status = write(fd.get(), absl::StrCat("writing ", tmp));
  if (status.ok() && ::fsync(fd.get()) != 0) {
    status = ErrnoError(errno, absl::StrCat("fsync of ", tmp));
  }
  if (status.ok()) status = fd.Close(tmp);
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status = ErrnoError(errno, absl::StrCat("renaming ", tmp, " to ", path));
  }
  if (!status.ok()) {
    fd = ScopedFd();
    ::unlink(tmp.c_str());
    return status;
  }
  return FsyncPath(DirName(path));
}

absl::Status WriteFileDurably(const std::string& path, absl::string_view contents) {
  return WriteFileDurably(path, [&](int fd, const std::string& context) {
    return WriteAll(fd, contents.data(), contents.size(), context);
  });
}

const char* FileKindName(unsigned int st_mode) {
  if (S_ISREG(st_mode)) return "a regular file";
  if (S_ISDIR(st_mode)) return "a directory";
  if (S_ISFIFO(st_mode)) return "a FIFO";
  if (S_ISCHR(st_mode)) return "a character device";
  if (S_ISBLK(st_mode)) return "a block device";
  if (S_ISSOCK(st_mode)) return "a socket";
  return "not a file";
}

absl::StatusOr<ScopedFd> OpenRegularFile(const std::string& path, absl::string_view field) {
  const std::string named = field.empty() ? path : absl::StrCat(field, " ", path);
  const std::string context = field.empty() ? path : absl::StrCat(field, ": ", path);
  auto not_regular = [&](const struct stat& st) {
    return absl::InvalidArgumentError(
        absl::StrCat(named, " is not a regular file (", FileKindName(st.st_mode), ")"));
  };
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ELOOP) {  // absl has no code for it; it is the user's to mend
      return absl::InvalidArgumentError(
          absl::StrCat(context, ": a loop of symbolic links (", std::strerror(ELOOP), ")"));
    }
    return ErrnoError(errno, context);
  }
  if (!S_ISREG(st.st_mode)) return not_regular(st);
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
  if (fd.get() < 0) return ErrnoError(errno, absl::StrCat("opening ", context));
  if (::fstat(fd.get(), &st) != 0) return ErrnoError(errno, absl::StrCat("stat of ", context));
  if (!S_ISREG(st.st_mode)) return not_regular(st);
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return ErrnoError(errno, absl::StrCat("opening ", context));
  }
  return fd;
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  ASSIGN_OR_RETURN(ScopedFd fd, OpenRegularFile(path, ""));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoError(errno, absl::StrCat("stat of ", path));
  if (st.st_size > kMaxWholeFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, " is ", st.st_size, " bytes; a config or index file is at most ",
        kMaxWholeFileBytes, " bytes (1 GiB)"));
  }
  std::string contents(static_cast<size_t>(st.st_size), '\0');
  RETURN_IF_ERROR(PreadAll(fd.get(), 0, contents.size(), contents.data(),
                           absl::StrCat("reading ", path)));
  return contents;
}

bool FileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string JoinPath(absl::string_view dir, absl::string_view name) {
  if (dir.empty()) return std::string(name);
  if (dir.back() == '/') return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

std::string DirName(absl::string_view path) {
  const size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos) return ".";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

}  // namespace megatrain
