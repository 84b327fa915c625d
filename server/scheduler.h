// Scheduler: which queued job an idle lane starts (and on which gang of lanes), and which
// running job steps aside for a waiting one. It decides from a snapshot the runner hands
// it and returns its decisions as values; it reads no clock, store or device, starts
// nothing and keeps no state between calls, so the same snapshot always gets the same
// answer. JobRunner (server/job_runner.h) owns the threads, the workers and the store: it
// takes the snapshot, asks, and applies the answer, re-checking under its lock that the
// lanes chosen are still free (lanes move while the store is read).
//
// The rules:
//  - Order: highest priority first; within a priority, the user with the least recent
//    device time (fair share: the decayed device seconds the store keeps), then the
//    oldest job (lowest id). Held jobs are never offered.
//  - Admission: a job is passed over, with a reason to note, while its user is at their
//    running-jobs or host-memory limit, or while the host has less memory available than
//    the job's plan needs (what the OS says is available, at most the node's admission
//    limit minus what running jobs were admitted with).
//  - Gangs: a job of N devices runs on the lane that takes it (cuda:k) and the lanes of
//    cuda:k+1 .. k+N-1 (any N-1 other CPU lanes for a "cpu" lane), all idle. While such a
//    job is the first admissible one in order and its gang is not free, the lane takes
//    nothing: no job behind it backfills, so smaller jobs cannot starve it. A job of more
//    devices than any run of lanes holds (a restart with fewer) waits aside and blocks
//    nothing. A lane lent to a gang takes nothing until the gang's job stops.
//  - Preemption (if on): only when no lane is idle, and only the lane running the
//    lowest-priority job (ties: the first lane) steps aside, for the queued job of highest
//    priority above its own (ties: the oldest) that needs one device, fits in the memory
//    the host would have once the running job left, and no other lane is already stepping
//    aside for. User limits are not consulted: the job is admitted by Next() once the lane
//    is free. A gang job never preempts.
//
// Thread-safe without a lock: every method is const and reads only its arguments and the
// options, so lanes may ask at once.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "server/config.h"

namespace megatrain::server {

// One lane (one device) as the scheduler sees it. Lanes are named by their index in
// SchedulerState::lanes, which is fixed for a runner's life.
struct LaneState {
  std::string device;              // "cpu" or "cuda:N"
  int64_t running = 0;             // the job on this device (a gang's on each lane); 0: none
  int32_t running_priority = 0;    // that job's priority
  int64_t running_host_bytes = 0;  // the host memory that job was admitted with
  int lent_to = -1;                // the lane whose gang job uses this device; -1: none
  int64_t preempting_for = 0;      // the queued job this lane is stepping aside for; 0: none

  bool idle() const { return running == 0 && lent_to < 0; }
};

// A job that waits to start (QUEUED, or HELD: then never offered).
struct QueuedJob {
  int64_t id = 0;  // submit order: lower is older
  std::string owner;
  int32_t priority = 0;
  int64_t devices = 1;     // a gang of this many lanes
  int64_t host_bytes = 0;  // the plan's estimate, what the job is admitted with
  bool held = false;
  std::string waiting;  // the reason noted for it now; "" when none
};

// A job running now, as admission counts it against its user and the node.
struct AdmittedJob {
  std::string owner;
  int64_t host_bytes = 0;
};

// Everything a decision depends on, taken at one moment.
struct SchedulerState {
  std::vector<LaneState> lanes;
  std::vector<QueuedJob> queued;        // in submit order (preemption's ties go to the first)
  std::vector<AdmittedJob> running;     // one entry per running job (a gang's once)
  std::map<std::string, double> usage;  // each user's decayed device seconds; absent: 0
  int64_t host_available_bytes = 0;     // what the OS says is available now; 0: unknown
};

// A queued job's reason to wait changed: note it in Job.waiting.
struct WaitingNote {
  int64_t job_id = 0;
  std::string why;
};

// What an idle lane does now.
struct StartDecision {
  QueuedJob job;          // the job to start; id 0: none
  std::vector<int> gang;  // the other lanes its devices take (job.devices - 1 of them)
  // The jobs passed over whose reason to wait changed, in queue order. The started job's
  // reason (job.waiting, if any) is the runner's to clear once it has claimed the job.
  std::vector<WaitingNote> notes;

  bool starts() const { return job.id != 0; }
};

struct SchedulerOptions {
  // What the scheduler reads of it: preemption, limits and user_limits (LimitsFor).
  DaemonConfig config;
  int64_t host_memory_bytes = 0;  // what running jobs may be admitted with in all; 0: no limit
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerOptions options) : options_(std::move(options)) {}

  // The jobs `state.queued` offers, in the order they are offered (held ones left out).
  std::vector<const QueuedJob*> QueueOrder(const SchedulerState& state) const;

  // What idle lane `lane` starts: the first job in QueueOrder it may run, with its gang,
  // or none (the lane is lent to a gang, nothing is admissible, or a gang job first in
  // line waits for its lanes).
  StartDecision Next(const SchedulerState& state, int lane) const;

  // Whether lane `lane` is the one that would step aside if a job were waiting for it:
  // preemption is on, no lane is idle and this lane runs the lowest-priority job. Needs
  // only state.lanes: the runner asks it before it reads the queue.
  bool MayPreempt(const SchedulerState& state, int lane) const;
  // The queued job lane `lane` should step aside for, if any (MayPreempt first).
  std::optional<QueuedJob> Preemptor(const SchedulerState& state, int lane) const;

  // The other lanes a job of `devices` on `lane` would use: the devices after lane's, or
  // other CPU lanes; with `idle`, only if all are idle now. nullopt when there are none.
  static std::optional<std::vector<int>> GangFor(const std::vector<LaneState>& lanes, int lane,
                                                 int64_t devices, bool idle);
  // Whether some lane could ever run a job of `devices` (GangFor, idle or not).
  static bool AnyGang(const std::vector<LaneState>& lanes, int64_t devices);
  // OK when AnyGang; else InvalidArgument naming the lanes (what submit answers).
  [[nodiscard]] static absl::Status CanRunDevices(const std::vector<LaneState>& lanes,
                                                  int64_t devices);

 private:
  SchedulerOptions options_;
};

}  // namespace megatrain::server
