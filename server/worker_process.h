// A worker process, seen from megatraind: one user's job (or submission check) running in
// a process of its own, as that user, so that whatever it does — abort, crash, run out of
// memory, hang — is that job's failure and never the daemon's (Slurm's slurmstepd beside
// slurmd). The worker is the daemon's own executable run as `megatraind worker`
// (server/worker.h), started by fork and fexecve of a descriptor opened at the daemon's
// start, so it is the same build even when the file on disk is replaced.
//
// The child, before it runs anything of the user's: its own process group and session of
// signals; the user's real and effective uid, gid and groups (when the daemon is root);
// resource limits (data segment, open files, processes); SIGKILL should the daemon die;
// stdin from /dev/null, stdout and stderr into a pipe the daemon keeps the tail of.
//
// Call() sends a request and waits for its reply, watching meanwhile: the worker's
// heartbeats (silence past `silence_timeout` stops it), its resident memory (past
// `memory_bytes` stops it), the caller's interruption (cancel), its exit. Each way it
// ends has its own message, with the last lines of the worker's output.
//
// Thread-compatible: one thread drives a WorkerProcess; Signal() may come from any.
#pragma once

#include <sys/types.h>

#include <deque>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "megatrain/internal/worker.pb.h"
#include "server/identity.h"
#include "server/worker_channel.h"

namespace megatrain::server {

struct WorkerOptions {
  int exe_fd = -1;             // the daemon's executable (OpenOwnExecutable)
  std::string what;            // for messages: "job 12's worker"
  int64_t memory_bytes = 0;    // resident memory it may reach; 0: no limit
  std::string memory_rule;     // where that limit comes from, for the message
  int64_t open_files = 65536;  // RLIMIT_NOFILE (at most the daemon's own hard limit)
  int64_t processes = 0;       // RLIMIT_NPROC for a user other than root; 0: unchanged
  absl::Duration silence_timeout = absl::Seconds(60);  // no heartbeat for this long: hung
  absl::Duration heartbeat = absl::Seconds(1);
};

// Opens the running executable for starting workers (O_PATH-like, close-on-exec).
[[nodiscard]] absl::StatusOr<int> OpenOwnExecutable();

class WorkerProcess {
 public:
  // Starts a worker as `who`. Its first request carries the context (WorkerContext).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<WorkerProcess>> Spawn(
      const Caller& who, const WorkerOptions& options);
  ~WorkerProcess();  // kills its process group if it still runs, and reaps it
  WorkerProcess(const WorkerProcess&) = delete;
  WorkerProcess& operator=(const WorkerProcess&) = delete;

  pid_t pid() const { return pid_; }

  // Sends `request` and waits for its reply. The reply's own error (the request failed in
  // the worker) is returned as that status. Otherwise Aborted when the worker exited,
  // was killed, exceeded its memory or went silent (it is stopped then, and stays so);
  // Cancelled when `interrupted` (polled every 50 ms) returned true; DeadlineExceeded
  // past `deadline`.
  [[nodiscard]] absl::StatusOr<internal::WorkerReply> Call(
      const internal::WorkerRequest& request,
      const std::function<bool()>& interrupted = nullptr,
      absl::Time deadline = absl::InfiniteFuture());

  // Sends `signal` to its process group (no-op once it has exited).
  void Signal(int signal);
  // SIGTERM, then SIGKILL after `grace` if it has not exited; reaps it.
  void Stop(absl::Duration grace);
  // Asks it to exit (ExitRequest) and waits for its answer as Call() does (a checkpoint
  // being written finishes first), then up to `grace` for its exit; else as Stop.
  void Exit(absl::Duration grace);

  // How it ended ("" while it runs): "exited with status 1", "was killed by signal 9
  // (SIGKILL)", "exceeded its memory limit ...", "stopped reporting ...".
  const std::string& ended() const { return ended_; }
  // The last lines it wrote to stdout and stderr, oldest first.
  std::string OutputTail() const;

 private:
  WorkerProcess(pid_t pid, int channel_fd, int output_fd, const WorkerOptions& options);
  // Reads what the worker wrote to its output since the last call.
  void DrainOutput();
  // Resident bytes of the worker now (0 if unknown).
  int64_t ResidentBytes() const;
  // Waits for its exit up to `timeout` (reaping it); true once it has exited.
  bool Reap(absl::Duration timeout);
  // An Aborted status for its end (`ended_` set when not yet), with its output's tail.
  absl::Status Ended(const std::string& how);

  pid_t pid_;
  WorkerChannel channel_;
  int output_fd_;
  WorkerOptions options_;
  bool reaped_ = false;
  std::string ended_;
  std::string partial_line_;
  std::deque<std::string> tail_;  // the last kTailLines lines of output
};

}  // namespace megatrain::server
