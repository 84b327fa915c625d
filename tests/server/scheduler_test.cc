// The scheduler's rules, one edge case a test, on snapshots built by hand: no thread,
// store, clock or worker. What the runner does with the decisions (claiming lanes,
// noting reasons, checkpointing the job that steps aside) is e2e.daemon_cli's and
// e2e.sharing's.
#include "server/scheduler.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace megatrain::server {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

LaneState Lane(const std::string& device) {
  LaneState lane;
  lane.device = device;
  return lane;
}

LaneState Busy(const std::string& device, int64_t job, int32_t priority, int64_t host_bytes = 0) {
  LaneState lane = Lane(device);
  lane.running = job;
  lane.running_priority = priority;
  lane.running_host_bytes = host_bytes;
  return lane;
}

QueuedJob Job(int64_t id, const std::string& owner, int32_t priority = 0, int64_t devices = 1,
              int64_t host_bytes = 0) {
  QueuedJob job;
  job.id = id;
  job.owner = owner;
  job.priority = priority;
  job.devices = devices;
  job.host_bytes = host_bytes;
  return job;
}

Scheduler Make(const DaemonConfig& config = DaemonConfig(), int64_t host_memory_bytes = 0) {
  SchedulerOptions options;
  options.config = config;
  options.host_memory_bytes = host_memory_bytes;
  return Scheduler(options);
}

std::vector<int64_t> Ids(const std::vector<const QueuedJob*>& order) {
  std::vector<int64_t> ids;
  for (const QueuedJob* job : order) ids.push_back(job->id);
  return ids;
}

// --- Order ---

TEST(SchedulerTest, HigherPriorityStartsBeforeOlderJobs) {
  SchedulerState state;
  state.lanes = {Lane("cpu")};
  state.queued = {Job(1, "alice", 0), Job(2, "alice", 5), Job(3, "alice", 1)};
  EXPECT_EQ(Ids(Make().QueueOrder(state)), (std::vector<int64_t>{2, 3, 1}));
  EXPECT_EQ(Make().Next(state, 0).job.id, 2);
}

TEST(SchedulerTest, WithinAPriorityAndEqualUseTheOldestStartsFirst) {
  SchedulerState state;
  state.lanes = {Lane("cpu")};
  state.queued = {Job(7, "alice"), Job(3, "bob"), Job(5, "alice")};
  EXPECT_EQ(Ids(Make().QueueOrder(state)), (std::vector<int64_t>{3, 5, 7}));
}

TEST(SchedulerTest, FairShareStartsTheUserWithLessRecentUseBeforeAnOlderJob) {
  SchedulerState state;
  state.lanes = {Lane("cpu")};
  state.queued = {Job(1, "alice"), Job(2, "bob")};
  state.usage = {{"alice", 3600.0}};  // bob has no recorded use: 0
  EXPECT_EQ(Ids(Make().QueueOrder(state)), (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(Make().Next(state, 0).job.id, 2);
}

TEST(SchedulerTest, FairShareOrdersUsersByTheirDecayedDeviceSeconds) {
  SchedulerState state;
  state.queued = {Job(1, "alice"), Job(2, "bob"), Job(3, "carol")};
  state.usage = {{"alice", 30.0}, {"bob", 20.0}, {"carol", 10.0}};
  EXPECT_EQ(Ids(Make().QueueOrder(state)), (std::vector<int64_t>{3, 2, 1}));
}

TEST(SchedulerTest, FairShareNeverOutranksPriority) {
  SchedulerState state;
  state.queued = {Job(1, "bob", 0), Job(2, "alice", 1)};
  state.usage = {{"alice", 1e9}};
  EXPECT_EQ(Ids(Make().QueueOrder(state)), (std::vector<int64_t>{2, 1}));
}

TEST(SchedulerTest, HeldJobIsNeverOfferedWhateverItsPriority) {
  SchedulerState state;
  state.lanes = {Lane("cpu")};
  QueuedJob held = Job(1, "alice", 9);
  held.held = true;
  state.queued = {held, Job(2, "alice", 0)};
  EXPECT_EQ(Ids(Make().QueueOrder(state)), (std::vector<int64_t>{2}));
  EXPECT_EQ(Make().Next(state, 0).job.id, 2);

  state.queued = {held};
  const StartDecision decision = Make().Next(state, 0);
  EXPECT_FALSE(decision.starts());
  EXPECT_TRUE(decision.notes.empty());
}

TEST(SchedulerTest, EmptyQueueStartsNothing) {
  SchedulerState state;
  state.lanes = {Lane("cpu")};
  EXPECT_FALSE(Make().Next(state, 0).starts());
}

TEST(SchedulerTest, TheSameStateGetsTheSameDecision) {
  SchedulerState state;
  state.lanes = {Lane("cpu"), Busy("cpu", 9, 0)};
  state.queued = {Job(1, "alice", 0, 2), Job(2, "bob"), Job(3, "carol", 1)};
  state.usage = {{"bob", 5.0}};
  const StartDecision first = Make().Next(state, 0);
  for (int i = 0; i < 3; ++i) {
    const StartDecision again = Make().Next(state, 0);
    EXPECT_EQ(again.job.id, first.job.id);
    EXPECT_EQ(again.gang, first.gang);
    ASSERT_EQ(again.notes.size(), first.notes.size());
  }
}

// --- Admission ---

TEST(SchedulerTest, UserAtTheirRunningLimitWaitsAndTheNextUsersJobStarts) {
  DaemonConfig config;
  config.limits.max_running_jobs = 1;
  SchedulerState state;
  state.lanes = {Busy("cpu", 9, 0), Lane("cpu")};
  state.running = {{"alice", 0}};
  state.queued = {Job(1, "alice"), Job(2, "bob")};
  const StartDecision decision = Make(config).Next(state, 1);
  EXPECT_EQ(decision.job.id, 2);
  ASSERT_EQ(decision.notes.size(), 1u);
  EXPECT_EQ(decision.notes[0].job_id, 1);
  EXPECT_EQ(decision.notes[0].why, "alice has 1 running jobs, the most allowed");
}

TEST(SchedulerTest, PerUserLimitsReplaceTheDefaultLimits) {
  DaemonConfig config;
  config.limits.max_running_jobs = 1;
  config.user_limits["alice"].max_running_jobs = 2;
  SchedulerState state;
  state.lanes = {Busy("cpu", 9, 0), Lane("cpu")};
  state.running = {{"alice", 0}};
  state.queued = {Job(1, "alice")};
  EXPECT_EQ(Make(config).Next(state, 1).job.id, 1);
}

TEST(SchedulerTest, UserHostMemoryLimitCountsTheirRunningJobs) {
  DaemonConfig config;
  config.limits.max_host_bytes = 10 * kGiB;
  SchedulerState state;
  state.lanes = {Busy("cpu", 9, 0), Lane("cpu")};
  state.running = {{"alice", 6 * kGiB}, {"bob", 6 * kGiB}};
  state.queued = {Job(1, "alice", 0, 1, 5 * kGiB), Job(2, "bob", 0, 1, 4 * kGiB)};
  const StartDecision decision = Make(config).Next(state, 1);
  EXPECT_EQ(decision.job.id, 2);
  ASSERT_EQ(decision.notes.size(), 1u);
  EXPECT_EQ(decision.notes[0].why,
            "alice's running jobs hold 6.00 GiB of host memory; this one needs 5.00 GiB more, "
            "over the limit of 10.00 GiB");
}

TEST(SchedulerTest, JobNeedingMoreHostMemoryThanAvailableWaitsAndASmallerOneStarts) {
  SchedulerState state;
  state.lanes = {Lane("cpu")};
  state.host_available_bytes = 8 * kGiB;
  state.queued = {Job(1, "alice", 1, 1, 12 * kGiB), Job(2, "bob", 0, 1, 2 * kGiB)};
  const StartDecision decision = Make().Next(state, 0);
  EXPECT_EQ(decision.job.id, 2);
  ASSERT_EQ(decision.notes.size(), 1u);
  EXPECT_EQ(decision.notes[0].why, "needs 12.00 GiB of host memory; 8.00 GiB is available now");
}

// Alice's 4 GiB job for the idle lane of a node that admits 10 GiB, while bob's running job
// was admitted with `bob_bytes` and the OS reports `os_available_bytes` free (0: unread).
StartDecision AliceBesideBob(int64_t bob_bytes, int64_t os_available_bytes) {
  SchedulerState state;
  state.lanes = {Busy("cpu", 9, 0), Lane("cpu")};
  state.host_available_bytes = os_available_bytes;
  state.running = {{"bob", bob_bytes}};
  state.queued = {Job(1, "alice", 0, 1, 4 * kGiB)};
  return Make(DaemonConfig(), 10 * kGiB).Next(state, 1);
}

TEST(SchedulerTest, NodeAdmissionLimitLessWhatRunningJobsWereAdmittedWithBounds) {
  // The OS says 100 GiB is free, but the running job was admitted with 8 of the node's 10.
  const StartDecision decision = AliceBesideBob(8 * kGiB, 100 * kGiB);
  EXPECT_FALSE(decision.starts());
  ASSERT_EQ(decision.notes.size(), 1u);
  EXPECT_EQ(decision.notes[0].why, "needs 4.00 GiB of host memory; 2.00 GiB is available now");
}

TEST(SchedulerTest, UnknownHostMemoryAdmitsTheJob) {
  SchedulerState state;
  state.lanes = {Lane("cpu")};
  state.host_available_bytes = 0;
  state.queued = {Job(1, "alice", 0, 1, 500 * kGiB)};
  EXPECT_EQ(Make().Next(state, 0).job.id, 1);
}

// The node's admissible memory is all held by running jobs: nothing is left, which is not
// "unknown" (it admitted any job, however large, once the running ones held it all).
TEST(SchedulerTest, RunningJobsHoldingAllTheNodesMemoryLeaveNoneForTheNext) {
  const StartDecision decision = AliceBesideBob(10 * kGiB, 100 * kGiB);
  EXPECT_FALSE(decision.starts());
  ASSERT_EQ(decision.notes.size(), 1u);
  EXPECT_EQ(decision.notes[0].why, "needs 4.00 GiB of host memory; 0.00 GiB is available now");
  // And with the OS's figure unreadable, the node's own count still holds.
  EXPECT_FALSE(AliceBesideBob(10 * kGiB, 0).starts());
}

TEST(SchedulerTest, ReasonAlreadyNotedIsNotNotedAgain) {
  SchedulerState state;
  state.lanes = {Lane("cpu")};
  state.host_available_bytes = 1 * kGiB;
  QueuedJob big = Job(1, "alice", 0, 1, 2 * kGiB);
  big.waiting = "needs 2.00 GiB of host memory; 1.00 GiB is available now";
  state.queued = {big};
  const StartDecision decision = Make().Next(state, 0);
  EXPECT_FALSE(decision.starts());
  EXPECT_TRUE(decision.notes.empty());
}

TEST(SchedulerTest, StartedJobCarriesItsOldReasonForTheRunnerToClear) {
  SchedulerState state;
  state.lanes = {Lane("cpu")};
  QueuedJob job = Job(1, "alice");
  job.waiting = "alice has 1 running jobs, the most allowed";
  state.queued = {job};
  const StartDecision decision = Make().Next(state, 0);
  EXPECT_EQ(decision.job.id, 1);
  EXPECT_EQ(decision.job.waiting, job.waiting);
  EXPECT_TRUE(decision.notes.empty());
}

// --- Gangs ---

TEST(SchedulerTest, GangOnCudaTakesTheDevicesAfterTheLanesOwn) {
  SchedulerState state;
  state.lanes = {Lane("cuda:0"), Lane("cuda:1"), Lane("cuda:2"), Lane("cuda:3")};
  state.queued = {Job(1, "alice", 0, 3)};
  const StartDecision decision = Make().Next(state, 1);
  EXPECT_EQ(decision.job.id, 1);
  EXPECT_EQ(decision.gang, (std::vector<int>{2, 3}));
}

TEST(SchedulerTest, GangFromTheLastCudaLaneHasNoDevicesAfterItAndBlocks) {
  // cuda:1 cannot lead a gang of 2 (there is no cuda:2); cuda:0's lane takes the job.
  SchedulerState state;
  state.lanes = {Lane("cuda:0"), Lane("cuda:1")};
  state.queued = {Job(1, "alice", 0, 2), Job(2, "bob")};
  const StartDecision from_last = Make().Next(state, 1);
  EXPECT_FALSE(from_last.starts());
  const StartDecision from_first = Make().Next(state, 0);
  EXPECT_EQ(from_first.job.id, 1);
  EXPECT_EQ(from_first.gang, (std::vector<int>{1}));
}

TEST(SchedulerTest, GangOnCpuLanesTakesAnyOtherIdleCpuLanesInLaneOrder) {
  SchedulerState state;
  state.lanes = {Lane("cpu"), Busy("cpu", 9, 0), Lane("cpu"), Lane("cpu")};
  state.queued = {Job(1, "alice", 0, 2)};
  const StartDecision decision = Make().Next(state, 3);
  EXPECT_EQ(decision.job.id, 1);
  EXPECT_EQ(decision.gang, (std::vector<int>{0}));
}

TEST(SchedulerTest, GangJobWaitingForItsLanesHoldsBackTheJobsBehindIt) {
  // One lane of two is busy: the two-device job first in line waits, and the one-device
  // job behind it does not take the free lane (it would starve the gang job).
  SchedulerState state;
  state.lanes = {Busy("cpu", 9, 0), Lane("cpu")};
  state.queued = {Job(1, "alice", 0, 2), Job(2, "bob")};
  const StartDecision decision = Make().Next(state, 1);
  EXPECT_FALSE(decision.starts());
  ASSERT_EQ(decision.notes.size(), 1u);
  EXPECT_EQ(decision.notes[0].job_id, 1);
  EXPECT_EQ(decision.notes[0].why, "needs 2 devices at once; 1 of the node's 2 are free");
}

TEST(SchedulerTest, GangJobStartsOnItsLanesOnceTheyAreFree) {
  SchedulerState state;
  state.lanes = {Lane("cpu"), Lane("cpu")};
  QueuedJob gang = Job(1, "alice", 0, 2);
  gang.waiting = "needs 2 devices at once; 1 of the node's 2 are free";
  state.queued = {gang, Job(2, "bob")};
  const StartDecision decision = Make().Next(state, 1);
  EXPECT_EQ(decision.job.id, 1);
  EXPECT_EQ(decision.gang, (std::vector<int>{0}));
}

TEST(SchedulerTest, GangJobBehindAHigherPriorityJobDoesNotBlockIt) {
  SchedulerState state;
  state.lanes = {Busy("cpu", 9, 0), Lane("cpu")};
  state.queued = {Job(1, "alice", 0, 2), Job(2, "bob", 3)};
  EXPECT_EQ(Make().Next(state, 1).job.id, 2);
}

TEST(SchedulerTest, GangJobAtItsUsersLimitWaitsAsideAndBlocksNothing) {
  DaemonConfig config;
  config.limits.max_running_jobs = 1;
  SchedulerState state;
  state.lanes = {Busy("cpu", 9, 0), Lane("cpu")};
  state.running = {{"alice", 0}};
  state.queued = {Job(1, "alice", 0, 2), Job(2, "bob")};
  EXPECT_EQ(Make(config).Next(state, 1).job.id, 2);
}

TEST(SchedulerTest, GangNoRunOfLanesCanHoldWaitsAsideAndBlocksNothing) {
  // After a restart with fewer lanes: 3 devices on a node of 2.
  SchedulerState state;
  state.lanes = {Lane("cpu"), Lane("cpu")};
  state.queued = {Job(1, "alice", 5, 3), Job(2, "bob")};
  const StartDecision decision = Make().Next(state, 0);
  EXPECT_EQ(decision.job.id, 2);
  ASSERT_EQ(decision.notes.size(), 1u);
  EXPECT_EQ(decision.notes[0].why, "needs 3 devices; this daemon's lanes hold no 3 in a row");
}

TEST(SchedulerTest, GangOnCudaDoesNotSkipABusyDeviceInItsRun) {
  // cuda:1 is busy: a gang of 2 from cuda:0 cannot form, though cuda:2 is idle.
  SchedulerState state;
  state.lanes = {Lane("cuda:0"), Busy("cuda:1", 9, 0), Lane("cuda:2")};
  state.queued = {Job(1, "alice", 0, 2)};
  EXPECT_FALSE(Make().Next(state, 0).starts());
  EXPECT_EQ(Make().Next(state, 2).job.id, 0);  // cuda:2 has no cuda:3 either
}

TEST(SchedulerTest, LaneLentToAGangTakesNothing) {
  SchedulerState state;
  state.lanes = {Busy("cpu", 9, 0), Busy("cpu", 9, 0)};
  state.lanes[1].lent_to = 0;
  state.lanes.push_back(Lane("cpu"));
  state.queued = {Job(1, "alice")};
  const StartDecision lent = Make().Next(state, 1);
  EXPECT_FALSE(lent.starts());
  EXPECT_TRUE(lent.notes.empty());
  EXPECT_EQ(Make().Next(state, 2).job.id, 1);
}

TEST(SchedulerTest, LaneLentToAGangIsNotIdleForAnotherGang) {
  SchedulerState state;
  state.lanes = {Lane("cpu"), Busy("cpu", 9, 0), Lane("cpu")};
  state.lanes[1].lent_to = 2;
  state.lanes[2].running = 9;
  state.queued = {Job(1, "alice", 0, 2)};
  const StartDecision decision = Make().Next(state, 0);
  EXPECT_FALSE(decision.starts());
  ASSERT_EQ(decision.notes.size(), 1u);
  EXPECT_EQ(decision.notes[0].why, "needs 2 devices at once; 1 of the node's 3 are free");
}

TEST(SchedulerTest, MalformedCudaLaneLeadsNoGang) {
  const std::vector<LaneState> lanes = {Lane("cuda:x"), Lane("cuda:1")};
  EXPECT_FALSE(Scheduler::GangFor(lanes, 0, 2, /*idle=*/false).has_value());
}

TEST(SchedulerTest, OneDeviceNeedsNoGang) {
  const std::vector<LaneState> lanes = {Busy("cuda:0", 9, 0)};
  const std::optional<std::vector<int>> gang = Scheduler::GangFor(lanes, 0, 1, /*idle=*/true);
  ASSERT_TRUE(gang.has_value());
  EXPECT_TRUE(gang->empty());
}

TEST(SchedulerTest, CanRunDevicesCountsBusyLanesAndNamesTheLanesWhenNone) {
  const std::vector<LaneState> lanes = {Busy("cpu", 9, 0), Lane("cpu")};
  EXPECT_TRUE(Scheduler::CanRunDevices(lanes, 2).ok());
  const absl::Status three = Scheduler::CanRunDevices(lanes, 3);
  EXPECT_EQ(three.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(three.message(),
            "train.devices is 3; this daemon's lanes (cpu, cpu) hold no 3 devices in a row "
            "(cuda:k .. cuda:k+2)");
  EXPECT_FALSE(Scheduler::CanRunDevices({Lane("cuda:0"), Lane("cuda:2")}, 2).ok());
}

// --- Preemption ---

TEST(SchedulerTest, NoPreemptionWhileALaneIsIdle) {
  SchedulerState state;
  state.lanes = {Busy("cpu", 1, 0), Lane("cpu")};
  state.queued = {Job(2, "bob", 5)};
  EXPECT_FALSE(Make().MayPreempt(state, 0));
  EXPECT_FALSE(Make().Preemptor(state, 0).has_value());
}

TEST(SchedulerTest, OnlyTheLaneOfTheLowestPriorityJobStepsAside) {
  SchedulerState state;
  state.lanes = {Busy("cpu", 1, 1), Busy("cpu", 2, 0)};
  state.queued = {Job(3, "carol", 5)};
  EXPECT_FALSE(Make().MayPreempt(state, 0));
  EXPECT_TRUE(Make().MayPreempt(state, 1));
  EXPECT_FALSE(Make().Preemptor(state, 0).has_value());
  EXPECT_EQ(Make().Preemptor(state, 1)->id, 3);
}

TEST(SchedulerTest, AmongEqualLowestPrioritiesTheFirstLaneStepsAside) {
  SchedulerState state;
  state.lanes = {Busy("cpu", 1, 0), Busy("cpu", 2, 0)};
  EXPECT_TRUE(Make().MayPreempt(state, 0));
  EXPECT_FALSE(Make().MayPreempt(state, 1));
}

TEST(SchedulerTest, LanesLentToAGangDoNotCompeteToStepAside) {
  // Lane 0 is lent to lane 1's gang job: lane 1, the job's lead, is the one that asks.
  SchedulerState state;
  state.lanes = {Busy("cpu", 1, 0), Busy("cpu", 1, 0)};
  state.lanes[0].lent_to = 1;
  EXPECT_TRUE(Make().MayPreempt(state, 1));
}

TEST(SchedulerTest, PreemptorIsTheHighestPriorityAboveTheRunningJobOldestFirst) {
  SchedulerState state;
  state.lanes = {Busy("cpu", 1, 2)};
  state.queued = {Job(2, "bob", 1), Job(3, "bob", 4), Job(4, "carol", 6), Job(5, "alice", 6)};
  const std::optional<QueuedJob> preemptor = Make().Preemptor(state, 0);
  ASSERT_TRUE(preemptor.has_value());
  EXPECT_EQ(preemptor->id, 4);
  EXPECT_EQ(preemptor->owner, "carol");
}

TEST(SchedulerTest, JobOfEqualPriorityDoesNotPreempt) {
  SchedulerState state;
  state.lanes = {Busy("cpu", 1, 3)};
  state.queued = {Job(2, "bob", 3)};
  EXPECT_FALSE(Make().Preemptor(state, 0).has_value());
}

TEST(SchedulerTest, HeldJobDoesNotPreempt) {
  SchedulerState state;
  state.lanes = {Busy("cpu", 1, 0)};
  QueuedJob held = Job(2, "bob", 9);
  held.held = true;
  state.queued = {held};
  EXPECT_FALSE(Make().Preemptor(state, 0).has_value());
}

TEST(SchedulerTest, GangJobNeverPreempts) {
  SchedulerState state;
  state.lanes = {Busy("cpu", 1, 0), Busy("cpu", 2, 1)};
  state.queued = {Job(3, "bob", 9, 2), Job(4, "carol", 5)};
  EXPECT_EQ(Make().Preemptor(state, 0)->id, 4);
  state.queued = {Job(3, "bob", 9, 2)};
  EXPECT_FALSE(Make().Preemptor(state, 0).has_value());
}

TEST(SchedulerTest, JobAnotherLaneStepsAsideForIsNotTakenTwice) {
  // Lane 1 chose job 3 when it ran the lowest job and is still checkpointing; lane 0 has
  // since started a job as low, and is the first of the two.
  SchedulerState state;
  state.lanes = {Busy("cpu", 1, 0), Busy("cpu", 2, 0)};
  state.lanes[1].preempting_for = 3;
  state.queued = {Job(3, "bob", 5), Job(4, "carol", 5)};
  EXPECT_EQ(Make().Preemptor(state, 0)->id, 4);
  state.queued = {Job(3, "bob", 5)};
  EXPECT_FALSE(Make().Preemptor(state, 0).has_value());
}

TEST(SchedulerTest, PreemptorMustFitInTheMemoryTheRunningJobLeaves) {
  SchedulerState state;
  state.lanes = {Busy("cpu", 1, 0, 6 * kGiB)};
  state.host_available_bytes = 2 * kGiB;
  state.queued = {Job(2, "bob", 9, 1, 9 * kGiB), Job(3, "carol", 5, 1, 8 * kGiB)};
  EXPECT_EQ(Make().Preemptor(state, 0)->id, 3);
}

TEST(SchedulerTest, PreemptionTurnedOffNeverPreempts) {
  DaemonConfig config;
  config.preemption = false;
  SchedulerState state;
  state.lanes = {Busy("cpu", 1, 0)};
  state.queued = {Job(2, "bob", 9)};
  EXPECT_FALSE(Make(config).MayPreempt(state, 0));
  EXPECT_FALSE(Make(config).Preemptor(state, 0).has_value());
}

}  // namespace
}  // namespace megatrain::server
