#include "server/run_as.h"

#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace megatrain::server {
namespace {

// Gives the calling thread (only) `who`'s file-system identity.
absl::Status SwitchThread(const Caller& who) {
  if (syscall(SYS_setgroups, who.groups.size(), who.groups.data()) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot take the groups of ", who.user, ": ", std::strerror(errno)));
  }
  syscall(SYS_setfsgid, who.gid);
  syscall(SYS_setfsuid, who.uid);
  // Both calls return the previous value; an invalid id (-1) changes nothing, so it
  // reads the current one back.
  if (static_cast<gid_t>(syscall(SYS_setfsgid, -1)) != who.gid ||
      static_cast<uid_t>(syscall(SYS_setfsuid, -1)) != who.uid) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot act as ", who.user, " (uid ", who.uid, ") on files"));
  }
  return absl::OkStatus();
}

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

absl::StatusOr<std::unique_ptr<UserWorker>> UserWorker::Start(const Caller& who) {
  if (absl::Status can = CanActFor(who); !can.ok()) return can;
  std::unique_ptr<UserWorker> w(new UserWorker());
  w->thread_ = std::thread([p = w.get(), who] { p->Loop(who); });
  std::unique_lock<std::mutex> lock(w->mu_);
  w->cv_.wait(lock, [&] { return w->started_; });
  absl::Status status = w->start_status_;
  lock.unlock();
  if (!status.ok()) return status;  // the destructor joins the thread
  return w;
}

UserWorker::~UserWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void UserWorker::Loop(const Caller& who) {
  absl::Status status;
  if (geteuid() == 0 && who.uid != 0) status = SwitchThread(who);
  {
    std::lock_guard<std::mutex> lock(mu_);
    started_ = true;
    start_status_ = status;
  }
  cv_.notify_all();
  if (!status.ok()) return;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || (task_ != nullptr && !done_); });
    if (task_ != nullptr && !done_) {
      const std::function<void()>* task = task_;
      lock.unlock();
      (*task)();
      lock.lock();
      done_ = true;
      cv_.notify_all();
      continue;
    }
    if (stop_) return;
  }
}

void UserWorker::Do(const std::function<void()>& task) {
  std::unique_lock<std::mutex> lock(mu_);
  task_ = &task;
  done_ = false;
  cv_.notify_all();
  cv_.wait(lock, [&] { return done_; });
  task_ = nullptr;
}

absl::Status RunAs(const Caller& who, const std::function<void()>& fn) {
  absl::StatusOr<std::unique_ptr<UserWorker>> worker = UserWorker::Start(who);
  if (!worker.ok()) return worker.status();
  (*worker)->Do(fn);
  return absl::OkStatus();
}

absl::Status CheckPathAllowed(const std::string& field, const std::string& path,
                              const FileRoots& roots, const std::string& own_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path real = fs::weakly_canonical(fs::absolute(path), ec);
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
