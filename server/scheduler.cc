#include "server/scheduler.h"

#include <algorithm>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/common/device_name.h"
#include "engine/common/units.h"

namespace megatrain::server {
namespace {

// What the running jobs of one user hold.
struct UserLoad {
  int running = 0;
  int64_t host_bytes = 0;
};

// Why `job` may not start now, with its user's `limits` and `load` and `available` bytes
// of host memory (nullopt: unknown, not checked); "" when it may.
std::string WhyItWaits(const QueuedJob& job, const UserLimits& limits, const UserLoad& load,
                       std::optional<int64_t> available) {
  if (limits.max_running_jobs > 0 && load.running >= limits.max_running_jobs) {
    return absl::StrCat(job.owner, " has ", load.running, " running jobs, the most allowed");
  }
  if (limits.max_host_bytes > 0 && load.host_bytes + job.host_bytes > limits.max_host_bytes) {
    return absl::StrFormat(
        "%s's running jobs hold %.2f GiB of host memory; this one needs "
        "%.2f GiB more, over the limit of %.2f GiB",
        job.owner, GiB(load.host_bytes), GiB(job.host_bytes), GiB(limits.max_host_bytes));
  }
  if (available.has_value() && job.host_bytes > *available) {
    return absl::StrFormat("needs %.2f GiB of host memory; %.2f GiB is available now",
                           GiB(job.host_bytes), GiB(std::max<int64_t>(0, *available)));
  }
  return "";
}

// Adds a note for `job` when `why` is not the reason it shows already.
void Note(const QueuedJob& job, const std::string& why, std::vector<WaitingNote>* notes) {
  if (job.waiting != why) notes->push_back({job.id, why});
}

}  // namespace

std::vector<const QueuedJob*> Scheduler::QueueOrder(const SchedulerState& state) const {
  auto used = [&](const std::string& user) {
    auto it = state.usage.find(user);
    return it == state.usage.end() ? 0.0 : it->second;
  };
  std::vector<const QueuedJob*> order;
  for (const QueuedJob& job : state.queued) {
    if (!job.held) order.push_back(&job);
  }
  std::stable_sort(order.begin(), order.end(), [&](const QueuedJob* lhs, const QueuedJob* rhs) {
    if (lhs->priority != rhs->priority) return lhs->priority > rhs->priority;
    const double lhs_used = used(lhs->owner), rhs_used = used(rhs->owner);
    if (lhs_used != rhs_used) return lhs_used < rhs_used;
    return lhs->id < rhs->id;
  });
  return order;
}

StartDecision Scheduler::Next(const SchedulerState& state, int lane) const {
  StartDecision decision;
  if (state.lanes[lane].lent_to >= 0) return decision;  // its device is in another's gang
  std::map<std::string, UserLoad> load;
  int64_t reserved = 0;  // what running jobs were admitted with
  for (const AdmittedJob& running : state.running) {
    load[running.owner].running += 1;
    load[running.owner].host_bytes += running.host_bytes;
    reserved += running.host_bytes;
  }
  // What the OS reports free (0: it could not be read), capped at the node's admissible
  // memory less what running jobs were admitted with (a job another lane just claimed
  // holds its memory before it has allocated it). Running jobs that hold all of it leave
  // nothing: that is not "unknown".
  std::optional<int64_t> available;
  if (state.host_available_bytes > 0) available = state.host_available_bytes;
  if (options_.host_memory_bytes > 0) {
    const int64_t left = options_.host_memory_bytes - reserved;
    available = available.has_value() ? std::min(*available, left) : left;
  }
  for (const QueuedJob* candidate : QueueOrder(state)) {
    std::string why = WhyItWaits(*candidate, options_.config.LimitsFor(candidate->owner),
                                 load[candidate->owner], available);
    if (why.empty() && candidate->devices > 1) {
      const int64_t devices = candidate->devices;
      // Its lanes may have changed since it was submitted (a restart with fewer): then it
      // waits aside. Else it starts from this lane with its gang idle now, or it waits,
      // and so does everything behind it (no lane backfills: it would never find them
      // free).
      if (!AnyGang(state.lanes, devices)) {
        why = absl::StrFormat("needs %d devices; this daemon's lanes hold no %d in a row", devices,
                              devices);
      } else if (!GangFor(state.lanes, lane, devices, /*idle=*/true).has_value()) {
        const int64_t idle = std::count_if(state.lanes.begin(), state.lanes.end(),
                                           [](const LaneState& other) { return other.idle(); });
        Note(*candidate,
             absl::StrFormat("needs %d devices at once; %d of the node's %d are free", devices,
                             idle, static_cast<int>(state.lanes.size())),
             &decision.notes);
        return decision;
      }
    }
    if (why.empty()) {
      decision.job = *candidate;
      decision.gang = *GangFor(state.lanes, lane, candidate->devices, /*idle=*/true);
      return decision;
    }
    Note(*candidate, why, &decision.notes);
  }
  return decision;
}

bool Scheduler::MayPreempt(const SchedulerState& state, int lane) const {
  if (!options_.config.preemption) return false;
  const int32_t priority = state.lanes[lane].running_priority;
  for (int other = 0; other < static_cast<int>(state.lanes.size()); ++other) {
    const LaneState& it = state.lanes[other];
    if (it.running == 0) return false;  // an idle lane will take the waiting job
    if (other == lane || it.lent_to >= 0) continue;
    // Only the lane with the lowest-priority job steps aside (ties: the first lane).
    if (it.running_priority < priority || (it.running_priority == priority && other < lane)) {
      return false;
    }
  }
  return true;
}

std::optional<QueuedJob> Scheduler::Preemptor(const SchedulerState& state, int lane) const {
  if (!MayPreempt(state, lane)) return std::nullopt;
  const LaneState& own = state.lanes[lane];
  std::set<int64_t> taken;  // waiting jobs other lanes already step aside for
  for (int other = 0; other < static_cast<int>(state.lanes.size()); ++other) {
    const LaneState& it = state.lanes[other];
    if (other != lane && it.lent_to < 0 && it.preempting_for != 0) taken.insert(it.preempting_for);
  }
  // What the host would have once this lane's job left.
  const int64_t available = state.host_available_bytes + own.running_host_bytes;
  const QueuedJob* best = nullptr;
  for (const QueuedJob& candidate : state.queued) {
    if (candidate.held || candidate.priority <= own.running_priority) continue;
    if (taken.count(candidate.id) > 0) continue;
    if (candidate.devices > 1) continue;  // one lane freed would not start it
    if (candidate.host_bytes > available) continue;
    if (best == nullptr || candidate.priority > best->priority) best = &candidate;
  }
  if (best == nullptr) return std::nullopt;
  return *best;
}

std::optional<std::vector<int>> Scheduler::GangFor(const std::vector<LaneState>& lanes, int lane,
                                                   int64_t devices, bool idle) {
  std::vector<int> gang;
  if (devices <= 1) return gang;
  auto usable = [&](int other) { return !idle || lanes[other].idle(); };
  const int count = static_cast<int>(lanes.size());
  if (lanes[lane].device == "cpu") {  // simulated devices: any other CPU lanes
    for (int other = 0; other < count; ++other) {
      if (other == lane || lanes[other].device != "cpu" || !usable(other)) continue;
      gang.push_back(other);
      if (static_cast<int64_t>(gang.size()) + 1 == devices) return gang;
    }
    return std::nullopt;
  }
  // The trainer takes cuda:k+1 .. k+N-1 after the lane's cuda:k (Trainer::Init).
  const int first = CudaDeviceIndexOf(lanes[lane].device);
  if (first < 0) return std::nullopt;
  for (int64_t offset = 1; offset < devices; ++offset) {
    const std::string want = absl::StrCat("cuda:", first + offset);
    int found = -1;
    for (int other = 0; other < count; ++other) {
      if (lanes[other].device == want) found = other;
    }
    if (found < 0 || !usable(found)) return std::nullopt;
    gang.push_back(found);
  }
  return gang;
}

bool Scheduler::AnyGang(const std::vector<LaneState>& lanes, int64_t devices) {
  for (int lane = 0; lane < static_cast<int>(lanes.size()); ++lane) {
    if (GangFor(lanes, lane, devices, /*idle=*/false).has_value()) return true;
  }
  return false;
}

absl::Status Scheduler::CanRunDevices(const std::vector<LaneState>& lanes, int64_t devices) {
  if (AnyGang(lanes, devices)) return absl::OkStatus();
  std::vector<std::string> names;
  for (const LaneState& lane : lanes) names.push_back(lane.device);
  return absl::InvalidArgumentError(absl::StrCat(
      "train.devices is ", devices, "; this daemon's lanes (", absl::StrJoin(names, ", "),
      ") hold no ", devices, " devices in a row (cuda:k .. cuda:k+", devices - 1, ")"));
}

}  // namespace megatrain::server
