// JobRunner: the daemon's devices and the one queue they drain. Each device has a lane
// (a thread) that runs one job at a time on it, with the job's host store on the NUMA
// node nearest that device. An idle lane asks the scheduler (server/scheduler.h: order by
// priority, fair share and age; per-user and host-memory admission; gangs of lanes for
// jobs of several devices; preemption) what to take, and applies the answer: the runner
// keeps the lanes' state, reads the queue, notes why jobs wait, claims the lanes and runs
// the job. Between its steps, the lane running the lowest-priority job asks whether to
// step aside: with preemption on, when no lane is idle, it checkpoints and requeues its
// job (losing no step) for a waiting job of higher priority that would fit. A job of
// several devices runs on its gang of lanes: the others are lent to it and take nothing
// else until it stops; its device time is charged N times.
//
// A job runs in a worker process of its own, as its owner (server/worker_process.h): the
// engine's Trainer lives there, so its files are touched with the owner's credentials and
// whatever it does (abort, crash, exceed its memory, hang) fails that job alone. Cancel
// stops the worker at once (SIGTERM, SIGKILL after workers.stop_grace_s). Between steps
// the runner honours requests: cancel, checkpoint now, hold (checkpoint and step aside),
// and shutdown (checkpoint and requeue, so the next daemon resumes it). Every state change
// and step is committed to the job store before watchers are woken. A write that fails is
// returned where a caller can act on it (SetState, Transition); in a lane's loop, where
// none can, it is reported on stderr naming the job (ReportWriteFailure) and the job goes
// on.
//
// Thread-safe: requests come from RPC threads; each lane's loop runs on its own thread.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/common/mutex.h"
#include "engine/engine.h"
#include "megatrain/internal/worker.pb.h"
#include "megatrain/v1/jobs.pb.h"
#include "server/config.h"
#include "server/daemon_metrics.h"
#include "server/event_hub.h"
#include "server/job_store.h"
#include "server/scheduler.h"

namespace megatrain::server {

struct JobRunnerOptions {
  // One lane per entry: "cpu" or "cuda:N" (a "cpu" entry may repeat).
  std::vector<std::string> devices = {"cpu"};
  int64_t host_memory_bytes = 0;  // what jobs may be admitted with in all; 0 = no limit
  std::string state_dir;       // default checkpoints: state_dir/jobs/<id>/checkpoints
  DaemonMetrics* metrics = nullptr;  // optional: what jobs report to Prometheus
  const DaemonConfig* config = nullptr;  // limits, fair share, preemption, file roots;
                                         // null = the defaults
  int exe_fd = -1;           // the daemon's executable, for workers (OpenOwnExecutable)
  std::string profile_json;  // the planner's profile (ProfileToJson), for workers
};

class JobRunner {
 public:
  JobRunner(JobStore* store, EventHub* hub, const JobRunnerOptions& options);
  ~JobRunner();  // stops as Shutdown() does

  void Start();
  // Checkpoints the running job (if any) and requeues it, then stops the loop.
  void Shutdown();
  // A job was queued or released: look at the queue again.
  void Wake();

  // Requests against a running job; NotFound when no lane runs it.
  [[nodiscard]] absl::Status CancelRunning(int64_t job_id, const std::string& why = "cancelled");
  [[nodiscard]] absl::Status HoldRunning(int64_t job_id);
  // Blocks until the checkpoint after the current step is written.
  [[nodiscard]] absl::StatusOr<v1::CheckpointJobResponse> CheckpointRunning(int64_t job_id);
  // The jobs running now, one entry per lane (0: idle; a gang's job on each of its lanes).
  std::vector<int64_t> running_jobs() const;
  // OK when some N of the lanes can form a gang (a job of N devices can ever run here),
  // else InvalidArgument naming the lanes.
  [[nodiscard]] absl::Status CanRunDevices(int64_t devices) const;

  // Commits a state change and tells watchers: the log line `why` (unless ""), the job,
  // then a state-change event (only once the job is stored). A log line that fails does
  // not keep the state from being stored; the first error is returned. REQUIRES: the
  // caller owns the job's state (the runner while it runs the job; otherwise use
  // Transition).
  [[nodiscard]] absl::Status SetState(v1::Job* job, v1::JobState state, const std::string& why);
  // Atomically (with respect to other transitions) moves job `id` from one of `from` to
  // `to`: FailedPrecondition naming the current state otherwise.
  [[nodiscard]] absl::StatusOr<v1::Job> Transition(int64_t id,
                                                   std::initializer_list<v1::JobState> from,
                                                   v1::JobState to, const std::string& why);
  // Appends a line to the job's log and wakes its watchers. A line the store fails to
  // take is reported on stderr (ReportWriteFailure): no caller could do more with it.
  void Log(int64_t job_id, const std::string& text);

 private:
  enum class Request { kNone, kCancel, kHold };
  // One device's worker. Every field but `index`, `thread` and `slot.device` (all fixed
  // once the lanes are made) is guarded by mu_.
  struct Lane {
    int index = 0;   // in lanes_, and in the scheduler's state
    LaneState slot;  // what the scheduler sees: the device, its job, whom it is lent to
    std::thread thread;
    bool wake = false;
    Request request = Request::kNone;
    std::string cancel_why;
    int64_t checkpoint_requests = 0;  // pending
    int64_t checkpoints_done = 0;     // completed request rounds
    absl::StatusOr<v1::CheckpointJobResponse> last_checkpoint;
    std::vector<Lane*> gang;          // the lanes lent to this one's job
  };
  // The scheduler's view of the lanes now.
  std::vector<LaneState> LaneStates() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Under mu_: `lane` stops running; its gang's lanes are idle again and look at the queue.
  void ReleaseLane(Lane& lane) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Loop(Lane& lane);
  // Claims for `lane` the job the scheduler gives it (its gang too), moved to RUNNING into
  // *job; false when there is none (the jobs passed over note why they wait).
  bool PickNext(Lane& lane, v1::Job* job);
  // Reads the queue, the running jobs, fair-share usage and host memory, and asks the
  // scheduler what `lane` starts; nullopt when nothing is queued.
  std::optional<StartDecision> Decide(const Lane& lane);

  // One run of a job on a lane: what the stages of Run share (defined in the .cc).
  struct RunningJob;
  // How a run ends: the state it leaves the job in, and the reason logged.
  struct RunEnd {
    v1::JobState state;
    std::string why;
  };
  // Sends `request` to the run's worker and waits for its reply; with `cancellable`, a
  // cancel request stops the worker and returns Cancelled.
  [[nodiscard]] absl::StatusOr<internal::WorkerReply> CallWorker(
      RunningJob& run, const internal::WorkerRequest& request, bool cancellable);
  // Runs `job`, claimed by `lane`, to its end: PrepareJob, BeginTraining, then steps
  // with HandleRequests before and RecordStep after each, and Finish.
  void Run(Lane& lane, v1::Job job);
  // Parses the stored spec, resolves the backend for the lane, makes the job's folder,
  // starts the owner's worker process and has it check the files and create the Trainer.
  [[nodiscard]] absl::Status PrepareJob(RunningJob& run);
  // Once the trainer exists: starts the usage clock and the metrics, logs what runs.
  void BeginTraining(RunningJob& run);
  // The usage clock, the preemption checks and the job's metrics, from `step` of
  // `total_steps`.
  void StartClocks(RunningJob& run, int64_t step, int64_t total_steps);
  // Stores the job with its progress, then sends the progress as an event.
  void RecordProgress(const v1::Job& job);
  // Between steps: checkpoint now, cancel, preemption, hold, the daemon stopping. How the
  // run ends, or nullopt to take the next step.
  [[nodiscard]] std::optional<RunEnd> HandleRequests(RunningJob& run);
  // Checkpoints and steps aside for a waiting job of higher priority, if there is one.
  [[nodiscard]] std::optional<RunEnd> Preempt(RunningJob& run);
  // After a step: its checkpoints, metrics, progress (stored, an event), log, usage.
  void RecordStep(RunningJob& run, const StepReport& report);
  // The same for a generate or eval job: what it runs, and after each step its
  // completions (logged, one line each), progress in prompts and accuracy (eval).
  void BeginGeneration(RunningJob& run);
  void RecordGeneration(RunningJob& run, const internal::StepReply& step);
  // Drops the trainer (as the owner), then frees the lane and commits the state change
  // (CANCELLED instead of a requeue or hold when a cancel came meanwhile), stops the
  // job's metrics and charges the rest of its device time.
  void Finish(RunningJob& run, v1::JobState state, const std::string& why);
  // Finish as FAILED with `status` as the job's error.
  void Fail(RunningJob& run, const absl::Status& status);
  // Writes a checkpoint now (training waits); its path.
  [[nodiscard]] absl::StatusOr<std::string> SaveCheckpoint(RunningJob& run);
  // Answers the `megatrain checkpoint` requests of the lane (CheckpointRunning).
  void AnswerCheckpoint(RunningJob& run, absl::StatusOr<v1::CheckpointJobResponse> response);
  // Charges the device time since the last charge to the owner: at most every 10 s (each
  // record is a durable write) unless `now_or_never`. Time a failed record leaves
  // uncharged is charged by the next.
  void ChargeUsage(RunningJob& run, bool now_or_never);
  Lane* LaneRunning(int64_t job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Notes why queued job `id` waits ("" : it no longer does), if that changed.
  void SetWaiting(int64_t id, const std::string& why);
  // A queued job that should take `lane`'s device from the job it runs, if any
  // (preemption); the lane is then noted as stepping aside for it.
  std::optional<QueuedJob> Preemptor(Lane& lane);
  const DaemonConfig& config() const {
    return options_.config != nullptr ? *options_.config : defaults_;
  }

  DaemonConfig defaults_;

  JobStore* store_;
  EventHub* hub_;
  JobRunnerOptions options_;
  const Scheduler scheduler_;  // pure: asked under no lock, from any lane's thread

  Mutex transition_mu_;  // serialises Transition() calls, across lanes
  std::map<int64_t, absl::Time> waiting_noted_ ABSL_GUARDED_BY(transition_mu_);
  mutable Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::unique_ptr<Lane>> lanes_;  // fixed at construction
};

}  // namespace megatrain::server
