// Files on behalf of users: the daemon touches a job's files only as the job's owner.
//
// A UserWorker is a thread whose file-system identity is a user's: its fsuid, fsgid and
// supplementary groups are set with the raw per-thread system calls (glibc's setgroups
// would change every thread of the daemon), so the kernel checks each open, mkdir and
// rename it makes against that user's permissions, and what it creates belongs to the
// user. Threads it starts (the trainer's optimizer and checkpoint writers, OpenMP teams)
// inherit that identity. The daemon's other threads keep theirs.
//
// Switching needs root (CAP_SETUID/CAP_SETGID). A daemon not run as root acts only for
// its own uid, and refuses other users' jobs rather than run them as itself.
//
// On top of the kernel's check, paths must lie inside configured roots (after symlinks
// are resolved, as the user), and never inside the daemon's state folder except a job's
// own folder there.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "server/identity.h"

namespace megatrain::server {

// OK when this daemon can act for `who`; PERMISSION_DENIED saying why otherwise.
absl::Status CanActFor(const Caller& who);

class UserWorker {
 public:
  // Starts the thread and switches its identity to `who`'s.
  static absl::StatusOr<std::unique_ptr<UserWorker>> Start(const Caller& who);
  ~UserWorker();  // finishes the task running, then stops the thread
  UserWorker(const UserWorker&) = delete;
  UserWorker& operator=(const UserWorker&) = delete;

  // Runs `task` on the worker thread and waits for it. Not reentrant.
  void Do(const std::function<void()>& task);

 private:
  UserWorker() = default;
  void Loop(const Caller& who);

  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void()>* task_ = nullptr;  // guarded by mu_
  bool done_ = false;                            // guarded by mu_: task_ finished
  bool stop_ = false;                            // guarded by mu_
  bool started_ = false;                         // guarded by mu_
  absl::Status start_status_;                    // guarded by mu_
  std::thread thread_;
};

// Runs `fn` once on a fresh UserWorker of `who`.
absl::Status RunAs(const Caller& who, const std::function<void()>& fn);

// Where job files may be. Paths are checked after resolving symlinks.
struct FileRoots {
  std::vector<std::string> roots;  // absolute folders; {"/"} allows every path
  std::string state_dir;           // refused, except state_dir/jobs/<id>/ of the job
};

// Checks `path` (named `field` in the error) is inside `own_dir` (the job's folder in the
// state folder: always allowed), or inside one of the roots and not in the state folder. Call on the user's worker: resolving the path
// walks folders as the user. `path` need not exist yet (a checkpoint folder).
absl::Status CheckPathAllowed(const std::string& field, const std::string& path,
                              const FileRoots& roots, const std::string& own_dir);

// Creates state_dir/jobs/<id>/ for a job of `who`, owned by them (mode 0700), with
// state_dir and state_dir/jobs traversable (0711) so they can reach it; a folder an older
// daemon left root's becomes theirs, with what is in it. Returns its path.
absl::StatusOr<std::string> MakeJobFolder(const std::string& state_dir, int64_t id,
                                          const Caller& who);

// Creates `dir` (and its parents) if needed and checks a file can be created in it.
// Call on the user's worker.
absl::Status CheckWritableFolder(const std::string& field, const std::string& dir);

}  // namespace megatrain::server
