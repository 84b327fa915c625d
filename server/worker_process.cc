#include "server/worker_process.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "engine/common/printable.h"
#include "engine/common/units.h"

extern char** environ;

namespace megatrain::server {
namespace {

constexpr size_t kTailLines = 20;
constexpr int kChannelFd = 3;  // where the worker finds its channel

std::string SignalName(int signal) {
  const char* abbrev = sigabbrev_np(signal);
  return abbrev != nullptr ? absl::StrCat("SIG", abbrev) : absl::StrCat("signal ", signal);
}

// Everything the child does between fork and exec: raw system calls only (the daemon has
// many threads; the child has one, and no lock another thread held may be taken).
[[noreturn]] void ChildExec(int exe_fd, int channel_fd, int output_fd, int null_fd,
                            const Caller& who, bool switch_user, const gid_t* groups,
                            size_t num_groups, const rlimit* data, const rlimit* files,
                            const rlimit* processes, pid_t parent, char* const* argv,
                            char* const* envp, int report_fd) {
  auto fail = [&](int step) {
    const int err[2] = {step, errno};
    (void)!write(report_fd, err, sizeof(err));
    _exit(127);
  };
  if (setpgid(0, 0) != 0) fail(1);
  // The daemon blocks its stop signals in every thread, and a mask survives exec.
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  // The channel at fd 3, output on 1 and 2, nothing on 0; everything else closed.
  if (dup2(channel_fd, kChannelFd) < 0 || dup2(null_fd, 0) < 0 || dup2(output_fd, 1) < 0 ||
      dup2(output_fd, 2) < 0) {
    fail(2);
  }
  for (int fd : {0, 1, 2, kChannelFd}) fcntl(fd, F_SETFD, 0);
  // Every other descriptor closed but the report pipe and the executable, which are
  // close-on-exec: the ranges below, between and above them.
  {
    const int low = std::min(report_fd, exe_fd), high = std::max(report_fd, exe_fd);
    if (low > kChannelFd + 1) syscall(SYS_close_range, kChannelFd + 1, low - 1, 0);
    if (high > low + 1) syscall(SYS_close_range, low + 1, high - 1, 0);
    syscall(SYS_close_range, high + 1, ~0U, 0);
  }
  if (data->rlim_cur != RLIM_INFINITY && setrlimit(RLIMIT_DATA, data) != 0) fail(3);
  if (setrlimit(RLIMIT_NOFILE, files) != 0) fail(4);
  if (switch_user) {
    // The raw calls change this one thread: the child has no other.
    if (syscall(SYS_setgroups, num_groups, groups) != 0) fail(5);
    if (syscall(SYS_setresgid, who.gid, who.gid, who.gid) != 0) fail(6);
    if (processes->rlim_cur != RLIM_INFINITY && setrlimit(RLIMIT_NPROC, processes) != 0) fail(7);
    if (syscall(SYS_setresuid, who.uid, who.uid, who.uid) != 0) fail(8);
  }
  // After the identity change, which clears it: die with the daemon.
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) fail(9);
  if (getppid() != parent) _exit(126);
  syscall(SYS_execveat, exe_fd, "", argv, envp, AT_EMPTY_PATH);
  fail(10);
  _exit(127);
}

const char* ChildStepName(int step) {
  switch (step) {
    case 1: return "setpgid";
    case 2: return "dup2";
    case 3: return "setrlimit(RLIMIT_DATA)";
    case 4: return "setrlimit(RLIMIT_NOFILE)";
    case 5: return "setgroups";
    case 6: return "setresgid";
    case 7: return "setrlimit(RLIMIT_NPROC)";
    case 8: return "setresuid";
    case 9: return "prctl(PR_SET_PDEATHSIG)";
    default: return "execveat";
  }
}

// `fd` moved to a number of 10 or more (close-on-exec), so that the child's dup2 onto 0-3
// clobbers none of the descriptors it still needs.
int High(int fd) {
  if (fd < 0 || fd >= 10) return fd;
  const int high = fcntl(fd, F_DUPFD_CLOEXEC, 10);
  close(fd);
  return high;
}

}  // namespace

absl::StatusOr<int> OpenOwnExecutable() {
  const int fd = High(open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("cannot open /proc/self/exe: ", strerror(errno)));
  }
  return fd;
}

absl::StatusOr<std::unique_ptr<WorkerProcess>> WorkerProcess::Spawn(const Caller& who,
                                                                    const WorkerOptions& options) {
  const bool switch_user = geteuid() == 0 && who.uid != 0;
  if (geteuid() != 0 && who.uid != geteuid()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "this daemon runs as uid ", geteuid(), " and cannot start work as ", who.user));
  }
  // Everything the child needs, made before fork.
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    if (switch_user && (entry.rfind("HOME=", 0) == 0 || entry.rfind("USER=", 0) == 0 ||
                        entry.rfind("LOGNAME=", 0) == 0)) {
      continue;
    }
    env.push_back(entry);
  }
  if (switch_user) {
    std::vector<char> buf(16384);
    passwd pw{}, *found = nullptr;
    if (getpwuid_r(who.uid, &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr) {
      env.push_back(absl::StrCat("HOME=", pw.pw_dir));
    }
    env.push_back(absl::StrCat("USER=", who.user));
    env.push_back(absl::StrCat("LOGNAME=", who.user));
  }
  std::vector<char*> envp;
  for (std::string& entry : env) envp.push_back(entry.data());
  envp.push_back(nullptr);
  std::string arg0 = "megatraind", arg1 = "worker";
  char* argv[] = {arg0.data(), arg1.data(), nullptr};
  std::vector<gid_t> groups = who.groups;
  if (groups.empty()) groups.push_back(who.gid);
  rlimit current_files{};
  getrlimit(RLIMIT_NOFILE, &current_files);
  rlimit files = current_files;
  if (options.open_files > 0) {
    files.rlim_cur = std::min<rlim_t>(options.open_files, current_files.rlim_max);
    files.rlim_max = files.rlim_cur;
  }
  // The data segment (heap and private mappings) as a backstop at twice the watched
  // resident limit: the watch names the cause, the limit stops a runaway between looks.
  rlimit data{RLIM_INFINITY, RLIM_INFINITY};
  if (options.memory_bytes > 0) data.rlim_cur = data.rlim_max = 2 * options.memory_bytes;
  rlimit processes{RLIM_INFINITY, RLIM_INFINITY};
  if (options.processes > 0) processes.rlim_cur = processes.rlim_max = options.processes;

  int channel[2], output[2], report[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, channel) != 0) {
    return absl::InternalError(absl::StrCat("socketpair: ", strerror(errno)));
  }
  if (pipe2(output, O_CLOEXEC) != 0 || pipe2(report, O_CLOEXEC) != 0) {
    close(channel[0]);
    close(channel[1]);
    return absl::InternalError(absl::StrCat("pipe2: ", strerror(errno)));
  }
  channel[1] = High(channel[1]);
  output[1] = High(output[1]);
  report[1] = High(report[1]);
  const int null_fd = High(open("/dev/null", O_RDONLY | O_CLOEXEC));
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    ChildExec(options.exe_fd, channel[1], output[1], null_fd, who, switch_user, groups.data(),
              groups.size(), &data, &files, &processes, parent, argv, envp.data(), report[1]);
  }
  const int fork_errno = errno;
  close(channel[1]);
  close(output[1]);
  close(report[1]);
  if (null_fd >= 0) close(null_fd);
  if (pid < 0) {
    close(channel[0]);
    close(output[0]);
    close(report[0]);
    return absl::ResourceExhaustedError(absl::StrCat("cannot start ", options.what, ": fork: ",
                                                     strerror(fork_errno)));
  }
  // The report pipe closes at exec; a step that failed writes why first.
  int err[2] = {0, 0};
  ssize_t got;
  do {
    got = read(report[0], err, sizeof(err));
  } while (got < 0 && errno == EINTR);
  close(report[0]);
  fcntl(output[0], F_SETFL, fcntl(output[0], F_GETFL) | O_NONBLOCK);
  std::unique_ptr<WorkerProcess> worker(new WorkerProcess(pid, channel[0], output[0], options));
  if (got == sizeof(err)) {
    worker->Reap(absl::Seconds(5));
    return absl::InternalError(absl::StrCat("cannot start ", options.what, " as ", who.user, ": ",
                                            ChildStepName(err[0]), ": ", strerror(err[1])));
  }
  return worker;
}

WorkerProcess::WorkerProcess(pid_t pid, int channel_fd, int output_fd,
                             const WorkerOptions& options)
    : pid_(pid), channel_(channel_fd), output_fd_(output_fd), options_(options) {}

WorkerProcess::~WorkerProcess() {
  if (!reaped_) {
    kill(-pid_, SIGKILL);
    Reap(absl::InfiniteDuration());
  }
  close(output_fd_);
}

void WorkerProcess::Signal(int signal) {
  if (!reaped_) kill(-pid_, signal);
}

bool WorkerProcess::Reap(absl::Duration timeout) {
  if (reaped_) return true;
  const absl::Time until = timeout == absl::InfiniteDuration() ? absl::InfiniteFuture()
                                                               : absl::Now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_ || (r < 0 && errno == ECHILD)) {
      reaped_ = true;
      DrainOutput();
      if (ended_.empty() && r == pid_) {
        if (WIFEXITED(status)) {
          ended_ = absl::StrCat("exited with status ", WEXITSTATUS(status));
        } else if (WIFSIGNALED(status)) {
          ended_ = absl::StrCat("was killed by ", SignalName(WTERMSIG(status)),
                                WCOREDUMP(status) ? " (core dumped)" : "");
        }
      }
      // Whatever it started in its group goes with it.
      kill(-pid_, SIGKILL);
      return true;
    }
    if (absl::Now() >= until) return false;
    DrainOutput();
    absl::SleepFor(absl::Milliseconds(20));
  }
}

void WorkerProcess::Stop(absl::Duration grace) {
  if (reaped_) return;
  kill(-pid_, SIGTERM);
  if (!Reap(grace)) {
    kill(-pid_, SIGKILL);
    Reap(absl::InfiniteDuration());
  }
}

void WorkerProcess::Exit(absl::Duration grace) {
  if (reaped_) return;
  // Its answer may take a while (a checkpoint being written finishes first): it is
  // awaited as any other, while the worker keeps reporting.
  internal::WorkerRequest request;
  request.mutable_exit();
  if (Call(request).ok() && Reap(grace)) return;
  Stop(grace);
}

void WorkerProcess::DrainOutput() {
  char chunk[4096];
  for (;;) {
    const ssize_t n = read(output_fd_, chunk, sizeof(chunk));
    if (n <= 0) break;
    partial_line_.append(chunk, static_cast<size_t>(n));
    size_t newline;
    while ((newline = partial_line_.find('\n')) != std::string::npos) {
      tail_.push_back(partial_line_.substr(0, newline));
      partial_line_.erase(0, newline + 1);
      if (tail_.size() > kTailLines) tail_.pop_front();
    }
    // A line without end is kept to 4 KiB: output is for people.
    if (partial_line_.size() > 4096) partial_line_.resize(4096);
  }
}

std::string WorkerProcess::OutputTail() const {
  std::vector<std::string> lines(tail_.begin(), tail_.end());
  if (!partial_line_.empty()) lines.push_back(partial_line_);
  for (std::string& line : lines) line = Printable(line.substr(0, 1000));
  return absl::StrJoin(lines, "\n");
}

int64_t WorkerProcess::ResidentBytes() const {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/statm", static_cast<int>(pid_));
  FILE* f = fopen(path, "re");
  if (f == nullptr) return 0;
  long long size = 0, resident = 0;
  const int got = fscanf(f, "%lld %lld", &size, &resident);
  fclose(f);
  return got == 2 ? resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE)) : 0;
}

absl::Status WorkerProcess::Ended(const std::string& how) {
  if (ended_.empty()) ended_ = how;
  const std::string tail = OutputTail();
  // Between two looks at its resident memory, a worker can run into its data-segment cap
  // (twice the limit) and die of a failed allocation: say so, with the rule.
  if (options_.memory_bytes > 0 && ended_.find("memory limit") == std::string::npos &&
      (tail.find("std::bad_alloc") != std::string::npos ||
       tail.find("Cannot allocate memory") != std::string::npos)) {
    absl::StrAppend(&ended_, absl::StrFormat(
        " after an allocation failed: out of memory under its memory limit (%.2f GiB "
        "resident, its data segment capped at twice that%s)",
        GiB(options_.memory_bytes),
        options_.memory_rule.empty() ? "" : absl::StrCat("; ", options_.memory_rule)));
  }
  return absl::AbortedError(absl::StrCat(options_.what, " ", ended_,
                                         tail.empty() ? "" : "; its last output:\n", tail));
}

absl::StatusOr<internal::WorkerReply> WorkerProcess::Call(
    const internal::WorkerRequest& request, const std::function<bool()>& interrupted,
    absl::Time deadline) {
  if (reaped_) return Ended("");
  if (absl::Status sent = channel_.Write(request); !sent.ok()) {
    Reap(absl::Seconds(5));
    if (!reaped_) Stop(absl::Seconds(1));
    return Ended("closed its channel");
  }
  absl::Time heard = absl::Now();
  absl::Time next_memory_check = absl::Now();
  for (;;) {
    internal::WorkerReply reply;
    const absl::Time now = absl::Now();
    absl::Status read = channel_.Read(&reply, std::min(deadline, now + absl::Milliseconds(50)));
    DrainOutput();
    if (read.ok()) {
      heard = absl::Now();
      if (reply.has_heartbeat()) continue;
      if (reply.error_code() != 0) {
        return absl::Status(static_cast<absl::StatusCode>(reply.error_code()),
                            reply.error_message());
      }
      return reply;
    }
    if (!absl::IsDeadlineExceeded(read)) {
      // The channel closed or broke: the worker exited, or is about to.
      if (!Reap(absl::Seconds(10))) Stop(absl::Seconds(1));
      return Ended(absl::IsUnavailable(read) ? "closed its channel"
                                             : absl::StrCat("broke its channel: ", read.message()));
    }
    if (absl::Now() >= deadline) return absl::DeadlineExceededError(options_.what);
    if (interrupted && interrupted()) return absl::CancelledError("interrupted");
    if (absl::Now() - heard > options_.silence_timeout) {
      ended_ = absl::StrFormat("stopped reporting for %.0f s (hung) and was stopped",
                               absl::ToDoubleSeconds(options_.silence_timeout));
      Signal(SIGKILL);
      Reap(absl::InfiniteDuration());
      return Ended("");
    }
    if (options_.memory_bytes > 0 && absl::Now() >= next_memory_check) {
      next_memory_check = absl::Now() + absl::Milliseconds(50);
      const int64_t resident = ResidentBytes();
      if (resident > options_.memory_bytes) {
        ended_ = absl::StrFormat(
            "exceeded its memory limit (%.2f GiB resident, the limit %.2f GiB%s) and was "
            "stopped",
            GiB(resident), GiB(options_.memory_bytes),
            options_.memory_rule.empty() ? "" : absl::StrCat(": ", options_.memory_rule));
        Signal(SIGKILL);
        Reap(absl::InfiniteDuration());
        return Ended("");
      }
    }
  }
}

}  // namespace megatrain::server
