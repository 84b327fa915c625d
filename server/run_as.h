// Files on behalf of users: a job's files are touched only by processes running as the job's
// owner (server/worker_process.h), so the kernel checks each open, mkdir and rename
// against that user's permissions, and what they create belongs to the user. This file
// holds what those processes and the daemon check on top.
//
// Starting work as another user needs root (CAP_SETUID/CAP_SETGID). A daemon not run as
// root acts only for its own uid, and refuses other users' jobs rather than run them as
// itself (CanActFor).
//
// Paths must lie inside configured roots (after symlinks are resolved, as the user), and
// never inside the daemon's state folder except a job's own folder there.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/identity.h"

namespace megatrain::server {

// OK when this daemon can act for `who`; PERMISSION_DENIED saying why otherwise.
absl::Status CanActFor(const Caller& who);

// Where job files may be. Paths are checked after resolving symlinks.
struct FileRoots {
  std::vector<std::string> roots;  // absolute folders; {"/"} allows every path
  std::string state_dir;           // refused, except state_dir/jobs/<id>/ of the job
};

// Checks `path` (named `field` in the error) is inside `own_dir` (the job's folder in the
// state folder: always allowed), or inside one of the roots and not in the state folder.
// Call as the user (in their worker process): resolving the path
// walks folders as the user. `path` need not exist yet (a checkpoint folder).
absl::Status CheckPathAllowed(const std::string& field, const std::string& path,
                              const FileRoots& roots, const std::string& own_dir);

// Creates state_dir/jobs/<id>/ for a job of `who`, owned by them (mode 0700), with
// state_dir and state_dir/jobs traversable (0711) so they can reach it; a folder an older
// daemon left root's becomes theirs, with what is in it. Returns its path.
absl::StatusOr<std::string> MakeJobFolder(const std::string& state_dir, int64_t id,
                                          const Caller& who);

// Creates `dir` (and its parents) if needed and checks a file can be created in it.
// Call as the user (in their worker process).
absl::Status CheckWritableFolder(const std::string& field, const std::string& dir);

}  // namespace megatrain::server
