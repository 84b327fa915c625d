#include "server/run_as.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace megatrain::server {
namespace {

bool Within(const std::filesystem::path& path, const std::filesystem::path& root) {
  auto p = path.begin();
  for (auto r = root.begin(); r != root.end(); ++r, ++p) {
    if (r->empty()) continue;  // a trailing "/"
    if (p == path.end() || *p != *r) return false;
  }
  return true;
}

}  // namespace

absl::Status CanActFor(const Caller& who) {
  const uid_t self = geteuid();
  if (self == 0 || self == who.uid) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "this megatraind runs as uid ", self, ", not as root, so it can only run jobs of that "
      "user; ", who.user, " (uid ", who.uid, ") may read the queue but not submit. Run the "
      "daemon as root (deploy/megatraind.service) to share it"));
}

absl::Status CheckPathAllowed(const std::string& field, const std::string& path,
                              const FileRoots& roots, const std::string& own_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path real = fs::weakly_canonical(fs::absolute(path, ec), ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat(field, ": cannot resolve ", path, ": ", ec.message()));
  }
  // The job's own folder in the state folder is always allowed, whatever the roots.
  if (!own_dir.empty()) {
    const fs::path own = fs::weakly_canonical(own_dir, ec);
    if (!ec && Within(real, own)) return absl::OkStatus();
  }
  bool inside = roots.roots.empty();
  for (const std::string& root : roots.roots) {
    if (Within(real, fs::path(root))) inside = true;
  }
  if (!inside) {
    return absl::PermissionDeniedError(absl::StrCat(
        field, ": ", path, (real.string() == path ? "" : absl::StrCat(" (", real.string(), ")")),
        " is outside the folders this daemon works in (",
        absl::StrJoin(roots.roots, ", "), ")"));
  }
  if (!roots.state_dir.empty()) {
    const fs::path state = fs::weakly_canonical(roots.state_dir, ec);
    if (!ec && Within(real, state)) {
      return absl::PermissionDeniedError(absl::StrCat(
          field, ": ", path, " is inside the daemon's state folder ", roots.state_dir));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> MakeJobFolder(const std::string& state_dir, int64_t id,
                                          const Caller& who) {
  namespace fs = std::filesystem;
  const fs::path jobs = fs::path(state_dir) / "jobs";
  const fs::path dir = jobs / std::to_string(id);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot create ", dir.string(), ": ", ec.message()));
  }
  if (geteuid() == 0 && who.uid != 0) {
    for (const fs::path& p : {fs::path(state_dir), jobs}) {
      struct stat st {};
      if (::stat(p.c_str(), &st) == 0 && (st.st_mode & S_IXOTH) == 0) {
        ::chmod(p.c_str(), (st.st_mode & 07777) | S_IXUSR | S_IXGRP | S_IXOTH);
      }
    }
    struct stat st {};
    if (::stat(dir.c_str(), &st) == 0 && st.st_uid != who.uid) {
      // Created by a daemon before jobs ran as their users (or just now): the job's
      // files become the user's. Links are changed, never followed.
      for (auto it = fs::recursive_directory_iterator(dir, ec);
           !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
        (void)::lchown(it->path().c_str(), who.uid, who.gid);
      }
    }
    if (::chown(dir.c_str(), who.uid, who.gid) != 0) {
      return absl::InternalError(absl::StrCat("cannot give ", dir.string(), " to ", who.user, ": ",
                                              std::strerror(errno)));
    }
  }
  ::chmod(dir.c_str(), 0700);
  return dir.string();
}

absl::Status CheckWritableFolder(const std::string& field, const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat(field, ": cannot create ", dir, ": ", ec.message()));
  }
  std::string probe = (fs::path(dir) / ".megatrain-write-test-XXXXXX").string();
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) {
    return absl::PermissionDeniedError(
        absl::StrCat(field, ": cannot write in ", dir, ": ", std::strerror(errno)));
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return absl::OkStatus();
}

}  // namespace megatrain::server
