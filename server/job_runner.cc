#include "server/job_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "engine/common/device_name.h"
#include "engine/common/printable.h"
#include "engine/engine.h"
#include "server/node_service.h"
#include "server/run_as.h"
#include "server/spec_convert.h"

namespace megatrain::server {
namespace {

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

// Devices a job runs on (its plan's; jobs stored before data parallelism: one).
int64_t JobDevices(const v1::Job& j) { return std::max<int64_t>(1, j.plan().devices()); }

bool Terminal(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED || s == v1::JOB_STATE_CANCELLED;
}

}  // namespace

JobRunner::JobRunner(JobStore* store, EventHub* hub, const JobRunnerOptions& options)
    : store_(store), hub_(hub), options_(options) {
  for (const std::string& device : options_.devices) {
    lanes_.push_back(std::make_unique<Lane>());
    lanes_.back()->device = device;
  }
}

JobRunner::~JobRunner() { Shutdown(); }

void JobRunner::Start() {
  for (auto& lane : lanes_) {
    Lane* l = lane.get();
    l->thread = std::thread([this, l] { Loop(*l); });
  }
}

void JobRunner::Shutdown() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  for (auto& lane : lanes_) {
    if (lane->thread.joinable()) lane->thread.join();
  }
}

void JobRunner::Wake() {
  MutexLock lock(&mu_);
  for (auto& lane : lanes_) lane->wake = true;
}

std::vector<int64_t> JobRunner::running_jobs() const {
  MutexLock lock(&mu_);
  std::vector<int64_t> ids;
  for (const auto& lane : lanes_) ids.push_back(lane->running);
  return ids;
}

JobRunner::Lane* JobRunner::LaneRunning(int64_t job_id) {
  for (auto& lane : lanes_) {
    // A gang's job is run by its lead lane; the lanes lent to it only show it.
    if (lane->running == job_id && job_id != 0 && lane->lent_to == nullptr) return lane.get();
  }
  return nullptr;
}

std::optional<std::vector<JobRunner::Lane*>> JobRunner::GangFor(const Lane& lane,
                                                                int64_t devices,
                                                                bool idle) const {
  std::vector<Lane*> gang;
  if (devices <= 1) return gang;
  auto usable = [&](const Lane* l) { return !idle || l->idle(); };
  if (lane.device == "cpu") {  // simulated devices: any other CPU lanes
    for (const auto& l : lanes_) {
      if (l.get() == &lane || l->device != "cpu" || !usable(l.get())) continue;
      gang.push_back(l.get());
      if (static_cast<int64_t>(gang.size()) + 1 == devices) return gang;
    }
    return std::nullopt;
  }
  // The trainer takes cuda:k+1 .. k+N-1 after the lane's cuda:k (Trainer::Init).
  const int first = CudaDeviceIndexOf(lane.device);
  if (first < 0) return std::nullopt;
  for (int64_t d = 1; d < devices; ++d) {
    const std::string want = absl::StrCat("cuda:", first + d);
    Lane* found = nullptr;
    for (const auto& l : lanes_) {
      if (l->device == want) found = l.get();
    }
    if (found == nullptr || !usable(found)) return std::nullopt;
    gang.push_back(found);
  }
  return gang;
}

bool JobRunner::AnyGang(int64_t devices) const {
  for (const auto& lane : lanes_) {
    if (GangFor(*lane, devices, /*idle=*/false).has_value()) return true;
  }
  return false;
}

absl::Status JobRunner::CanRunDevices(int64_t devices) const {
  MutexLock lock(&mu_);
  if (AnyGang(devices)) return absl::OkStatus();
  std::vector<std::string> names;
  for (const auto& lane : lanes_) names.push_back(lane->device);
  return absl::InvalidArgumentError(absl::StrCat(
      "train.devices is ", devices, "; this daemon's lanes (", absl::StrJoin(names, ", "),
      ") hold no ", devices, " devices in a row (cuda:k .. cuda:k+", devices - 1, ")"));
}

void JobRunner::ReleaseLane(Lane& lane) {
  lane.running = 0;
  lane.preempting_for = 0;
  for (Lane* g : lane.gang) {
    g->running = 0;
    g->running_priority = 0;
    g->lent_to = nullptr;
    g->wake = true;
  }
  lane.gang.clear();
}

absl::Status JobRunner::SetState(v1::Job* job, v1::JobState state, const std::string& why) {
  // The log line first: a follower that sees the terminal state has every line by then.
  if (!why.empty()) {
    v1::LogLine line;
    line.set_text(why);
    (void)store_->AppendLog(job->id(), &line);
  }
  job->set_state(state);
  if (state == v1::JOB_STATE_RUNNING && job->started_unix_ms() == 0) job->set_started_unix_ms(NowMs());
  if (Terminal(state)) job->set_finished_unix_ms(NowMs());
  absl::Status s = store_->Update(*job);
  if (s.ok()) {
    v1::JobEvent event;
    *event.mutable_state_change() = *job;
    s = store_->AppendEvent(job->id(), &event).status();
  }
  hub_->Notify(job->id());
  return s;
}

absl::StatusOr<v1::Job> JobRunner::Transition(int64_t id,
                                              std::initializer_list<v1::JobState> from,
                                              v1::JobState to, const std::string& why) {
  MutexLock lock(&transition_mu_);
  absl::StatusOr<v1::Job> job = store_->Get(id);
  if (!job.ok()) return job.status();
  if (std::find(from.begin(), from.end(), job->state()) == from.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", id, " is ", absl::AsciiStrToLower(v1::JobState_Name(job->state()).substr(10)),
        "; cannot make it ", absl::AsciiStrToLower(v1::JobState_Name(to).substr(10))));
  }
  absl::Status s = SetState(&*job, to, why);
  if (!s.ok()) return s;
  return job;
}

void JobRunner::Log(int64_t job_id, const std::string& text) {
  v1::LogLine line;
  line.set_text(Printable(text));
  (void)store_->AppendLog(job_id, &line);
  hub_->Notify(job_id);
}

absl::Status JobRunner::CancelRunning(int64_t job_id, const std::string& why) {
  MutexLock lock(&mu_);
  Lane* lane = LaneRunning(job_id);
  if (lane == nullptr) return absl::NotFoundError(absl::StrCat("job ", job_id, " is not running"));
  lane->request = Request::kCancel;
  lane->cancel_why = why;
  return absl::OkStatus();
}

absl::Status JobRunner::HoldRunning(int64_t job_id) {
  MutexLock lock(&mu_);
  Lane* lane = LaneRunning(job_id);
  if (lane == nullptr) return absl::NotFoundError(absl::StrCat("job ", job_id, " is not running"));
  lane->request = Request::kHold;
  return absl::OkStatus();
}

absl::StatusOr<v1::CheckpointJobResponse> JobRunner::CheckpointRunning(int64_t job_id) {
  MutexLock lock(&mu_);
  Lane* lane = LaneRunning(job_id);
  if (lane == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " is not running"));
  }
  const int64_t ticket = lane->checkpoints_done + 1;
  ++lane->checkpoint_requests;
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return lane->checkpoints_done >= ticket || lane->running != job_id;
  };
  mu_.Await(done);
  if (lane->checkpoints_done < ticket) {
    return absl::AbortedError(absl::StrCat("job ", job_id, " stopped before the checkpoint"));
  }
  return lane->last_checkpoint;
}

void JobRunner::SetWaiting(int64_t id, const std::string& why) {
  MutexLock lock(&transition_mu_);
  absl::StatusOr<v1::Job> job = store_->Get(id);
  if (!job.ok() || job->state() != v1::JOB_STATE_QUEUED || job->waiting() == why) return;
  // A reason that only changes its numbers (memory available now) is noted once a minute,
  // not every time a lane looks at the queue.
  const absl::Time now = absl::Now();
  auto noted = waiting_noted_.find(id);
  if (!why.empty() && !job->waiting().empty() && noted != waiting_noted_.end() &&
      now - noted->second < absl::Minutes(1)) {
    return;
  }
  if (why.empty()) {
    waiting_noted_.erase(id);
  } else {
    waiting_noted_[id] = now;
  }
  job->set_waiting(why);
  if (store_->Update(*job).ok() && !why.empty()) Log(id, absl::StrCat("waiting: ", why));
  hub_->Notify(id);
}

namespace {

double GiB(int64_t b) { return b / double(1ll << 30); }

// What the running jobs of each user hold.
struct UserLoad {
  int running = 0;
  int64_t host_bytes = 0;
};

}  // namespace

bool JobRunner::PickNext(Lane& lane, v1::Job* job) {
  for (;;) {
    {
      MutexLock lock(&mu_);
      if (lane.lent_to != nullptr) return false;  // its device is in another lane's gang
    }
    absl::StatusOr<std::vector<v1::Job>> queued = store_->ListInState(v1::JOB_STATE_QUEUED);
    if (!queued.ok() || queued->empty()) return false;
    absl::StatusOr<std::vector<v1::Job>> running = store_->ListInState(v1::JOB_STATE_RUNNING);
    std::map<std::string, UserLoad> load;
    int64_t reserved = 0;  // what running jobs were admitted with
    if (running.ok()) {
      for (const v1::Job& r : *running) {
        load[r.owner()].running += 1;
        load[r.owner()].host_bytes += r.host_bytes_estimate();
        reserved += r.host_bytes_estimate();
      }
    }
    const double half_life_s = config().fair_share_half_life_hours * 3600;
    absl::StatusOr<std::map<std::string, double>> usage = store_->Usage(half_life_s);
    auto used = [&](const std::string& user) {
      if (!usage.ok()) return 0.0;
      auto it = usage->find(user);
      return it == usage->end() ? 0.0 : it->second;
    };
    // Priority, then fair share, then age.
    std::vector<const v1::Job*> order;
    for (const v1::Job& j : *queued) order.push_back(&j);
    std::stable_sort(order.begin(), order.end(), [&](const v1::Job* a, const v1::Job* b) {
      if (a->priority() != b->priority()) return a->priority() > b->priority();
      const double ua = used(a->owner()), ub = used(b->owner());
      if (ua != ub) return ua < ub;
      return a->id() < b->id();
    });
    int64_t available = ReadHostMemory().available_bytes;
    if (options_.host_memory_bytes > 0) {
      // A job another lane just claimed holds its memory before it has allocated it.
      available = std::min(available, options_.host_memory_bytes - reserved);
    }
    const v1::Job* best = nullptr;
    for (const v1::Job* j : order) {
      const UserLimits limits = config().LimitsFor(j->owner());
      const UserLoad& mine = load[j->owner()];
      std::string why;
      if (limits.max_running_jobs > 0 && mine.running >= limits.max_running_jobs) {
        why = absl::StrCat(j->owner(), " has ", mine.running, " running jobs, the most allowed");
      } else if (limits.max_host_bytes > 0 &&
                 mine.host_bytes + j->host_bytes_estimate() > limits.max_host_bytes) {
        why = absl::StrFormat("%s's running jobs hold %.2f GiB of host memory; this one needs "
                              "%.2f GiB more, over the limit of %.2f GiB",
                              j->owner(), GiB(mine.host_bytes), GiB(j->host_bytes_estimate()),
                              GiB(limits.max_host_bytes));
      } else if (available > 0 && j->host_bytes_estimate() > available) {
        why = absl::StrFormat("needs %.2f GiB of host memory; %.2f GiB is available now",
                              GiB(j->host_bytes_estimate()), GiB(available));
      }
      if (why.empty() && JobDevices(*j) > 1) {
        // Several devices: from this lane, with its gang idle now; else it waits, and so
        // does everything behind it (no lane backfills: it would never find them free).
        std::string reason;
        {
          MutexLock lock(&mu_);
          // Its lanes may have changed since it was submitted (a restart with fewer).
          if (!AnyGang(JobDevices(*j))) {
            why = absl::StrFormat("needs %d devices; this daemon's lanes hold no %d in a row",
                                  JobDevices(*j), JobDevices(*j));
          } else if (!GangFor(lane, JobDevices(*j), /*idle=*/true).has_value()) {
            int idle = 0;
            for (const auto& l : lanes_) idle += l->idle();
            reason = absl::StrFormat("needs %d devices at once; %d of the node's %d are free",
                                     JobDevices(*j), idle, static_cast<int>(lanes_.size()));
          }
        }
        if (!reason.empty()) {
          if (j->waiting() != reason) SetWaiting(j->id(), reason);
          return false;
        }
      }
      if (why.empty()) {
        best = j;
        break;
      }
      if (j->waiting() != why) SetWaiting(j->id(), why);  // a write only when it changed
    }
    if (best == nullptr) return false;
    {
      MutexLock lock(&mu_);
      std::optional<std::vector<Lane*>> gang = GangFor(lane, JobDevices(*best), true);
      if (lane.lent_to != nullptr) return false;  // lent to another lane meanwhile
      if (!gang.has_value()) continue;            // a gang lane was taken meanwhile
      lane.running = best->id();  // from here on, requests for it reach this lane
      lane.running_priority = best->priority();
      lane.request = Request::kNone;
      lane.checkpoint_requests = 0;
      lane.gang = *std::move(gang);
      for (Lane* g : lane.gang) {
        g->running = best->id();
        g->running_priority = best->priority();
        g->lent_to = &lane;
      }
    }
    if (!best->waiting().empty()) SetWaiting(best->id(), "");
    absl::StatusOr<v1::Job> claimed =
        Transition(best->id(), {v1::JOB_STATE_QUEUED}, v1::JOB_STATE_RUNNING, "");
    if (claimed.ok()) {
      *job = *claimed;
      return true;
    }
    MutexLock lock(&mu_);
    ReleaseLane(lane);  // cancelled, held or taken by another lane meanwhile: look again
  }
}

std::optional<v1::Job> JobRunner::Preemptor(Lane& lane, const v1::Job& running) {
  if (!config().preemption) return std::nullopt;
  std::set<int64_t> taken;  // waiting jobs other lanes already step aside for
  {
    MutexLock lock(&mu_);
    for (const auto& other : lanes_) {
      if (other->running == 0) return std::nullopt;  // an idle lane will take it
      if (other.get() == &lane || other->lent_to != nullptr) continue;
      if (other->preempting_for != 0) taken.insert(other->preempting_for);
      // Only the lane with the lowest-priority job steps aside (ties: the first lane).
      if (other->running_priority < running.priority() ||
          (other->running_priority == running.priority() && other.get() < &lane)) {
        return std::nullopt;
      }
    }
  }
  absl::StatusOr<std::vector<v1::Job>> queued = store_->ListInState(v1::JOB_STATE_QUEUED);
  if (!queued.ok()) return std::nullopt;
  // What the host would have once this job left.
  const int64_t available = ReadHostMemory().available_bytes + running.host_bytes_estimate();
  const v1::Job* best = nullptr;
  for (const v1::Job& j : *queued) {
    if (j.priority() <= running.priority() || taken.count(j.id()) > 0) continue;
    if (JobDevices(j) > 1) continue;  // one lane freed would not start it
    if (j.host_bytes_estimate() > available) continue;
    if (best == nullptr || j.priority() > best->priority()) best = &j;
  }
  if (best == nullptr) return std::nullopt;
  MutexLock lock(&mu_);
  lane.preempting_for = best->id();
  return *best;
}

void JobRunner::Loop(Lane& lane) {
  for (;;) {
    {
      MutexLock lock(&mu_);
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || lane.wake; };
      mu_.AwaitWithTimeout(ready, absl::Seconds(1));
      if (stop_) return;
      lane.wake = false;
    }
    v1::Job job;
    while (PickNext(lane, &job)) {
      Run(lane, job);
      MutexLock lock(&mu_);
      if (stop_) return;
    }
  }
}

void JobRunner::Run(Lane& lane, v1::Job job) {
  // Set once the trainer exists: frees it (its host memory, its device) as the owner.
  std::function<void()> drop_trainer;
  // The trainer is gone before the state changes: a job requeued (preempted, stopping)
  // or held and released at once may be taken by another lane right away.
  auto finish = [&](v1::JobState state, const std::string& why) {
    if (drop_trainer) std::exchange(drop_trainer, nullptr)();
    (void)SetState(&job, state, why);
    MutexLock lock(&mu_);
    ReleaseLane(lane);
  };
  // Failed: the error in the job (printable, as every message quoting file content is).
  auto fail = [&](const absl::Status& status) {
    job.set_error(Printable(status.message()));
    finish(v1::JOB_STATE_FAILED, absl::StrCat("error: ", Printable(status.ToString())));
  };
  std::string devices = lane.device;
  {
    MutexLock lock(&mu_);
    for (const Lane* g : lane.gang) absl::StrAppend(&devices, ",", g->device);
  }
  job.set_device(devices);
  job.clear_error();
  (void)store_->Update(job);
  Log(job.id(), absl::StrCat("running on ", devices));

  absl::StatusOr<JobSpec> spec = ParseJobSpec(job.spec_yaml(), "", "stored job spec");
  if (!spec.ok()) {
    return fail(spec.status());
  }
  spec->checkpoint_dir = job.checkpoint_dir();
  // The lane's device decides where "auto" and CUDA jobs run (never the GPU a spec
  // names: that one may be another lane's).
  if (spec->backend == "auto") spec->backend = lane.device;
  if (spec->backend.rfind("cuda", 0) == 0 && lane.device != "cpu") spec->backend = lane.device;
  // Everything that touches the job's files runs on a worker that is its owner.
  absl::StatusOr<Caller> owner = job.owner_uid() != 0 || job.owner() == "root"
                                     ? LookupUid(job.owner_uid())
                                     : LookupUser(job.owner());
  absl::StatusOr<std::unique_ptr<UserWorker>> worker =
      owner.ok() ? UserWorker::Start(*owner) : absl::StatusOr<std::unique_ptr<UserWorker>>(owner.status());
  if (!worker.ok()) {
    return fail(worker.status());
  }
  UserWorker& as_owner = **worker;
  // The job's folder in the state folder (its default checkpoints) is its user's.
  const std::string own_dir =
      (std::filesystem::path(options_.state_dir) / "jobs" / std::to_string(job.id())).string();
  if (absl::StartsWith(spec->checkpoint_dir, own_dir + "/")) {
    absl::StatusOr<std::string> made = MakeJobFolder(options_.state_dir, job.id(), *owner);
    if (!made.ok()) {
      return fail(made.status());
    }
  }
  // Checked again: a folder may have been swapped for a link since submission.
  absl::Status files;
  as_owner.Do([&] {
    files = CheckJobFiles(*spec, FileRoots{config().file_roots, options_.state_dir}, own_dir);
  });
  if (!files.ok()) {
    return fail(files);
  }
  absl::StatusOr<std::unique_ptr<Trainer>> created = absl::UnknownError("not created");
  as_owner.Do([&] { created = Trainer::Create(*spec, options_.profile); });
  if (!created.ok()) {
    return fail(created.status());
  }
  // Destroyed as the owner too: it may be finishing a checkpoint.
  drop_trainer = [&] { as_owner.Do([&] { created->reset(); }); };
  absl::Cleanup drop_on_any_return = [&] {
    if (drop_trainer) std::exchange(drop_trainer, nullptr)();
  };
  // Fair share: the device time this job takes, charged to its owner as it goes.
  // Recorded every 10 s at most (each record is a durable write), and when it stops.
  absl::Time charged_until = absl::Now();
  auto charge = [&](bool now_or_never) {
    const absl::Time now = absl::Now();
    if (!now_or_never && now - charged_until < absl::Seconds(10)) return;
    (void)store_->AddUsage(job.owner(), JobDevices(job) * absl::ToDoubleSeconds(now - charged_until),
                           config().fair_share_half_life_hours * 3600);
    charged_until = now;
  };
  absl::Cleanup charge_rest = [&] { charge(true); };
  absl::Time next_preemption_check = absl::Now() + absl::Seconds(1);
  Trainer& t = **created;
  if (options_.metrics != nullptr) {
    options_.metrics->JobStarted(job, t.pinned_host_bytes(), t.pageable_host_bytes(), t.step(),
                                 spec->steps);
  }
  absl::Cleanup stopped = [&] {
    if (options_.metrics != nullptr) options_.metrics->JobStopped(job);
  };
  if (t.resumed_from_step() > 0) {
    job.set_resumed_from_step(t.resumed_from_step());
    // A job killed after its final checkpoint but before its end was recorded resumes
    // done: its progress is that checkpoint's step, not the last one recorded.
    job.mutable_progress()->set_step(t.step());
    job.mutable_progress()->set_total_steps(spec->steps);
    // The loss shown until a step runs is the one the checkpoint recorded, else none.
    if (std::isfinite(t.last_loss())) {
      job.mutable_progress()->set_loss(t.last_loss());
    } else {
      job.mutable_progress()->clear_loss();
    }
    Log(job.id(), absl::StrCat("resumed from the checkpoint of step ", t.resumed_from_step()));
    if (t.done()) {
      Log(job.id(), absl::StrCat("found the checkpoint of its final step ", t.step(),
                                 ": nothing left to do"));
    }
  }
  const bool nothing_to_do = t.done();
  Log(job.id(), t.dataset_stats().Summary());
  Log(job.id(), absl::StrFormat("%s, %.2fM parameters, %s backend, %d tokens/step, %d steps",
                                ArchitectureClassName(t.config().architecture),
                                t.num_parameters() / 1e6, t.backend_name(),
                                spec->tokens_per_step_resolved(), spec->steps));
  for (absl::string_view line : absl::StrSplit(t.plan_text(), '\n', absl::SkipEmpty())) {
    Log(job.id(), absl::StrCat("plan: ", line));
  }
  auto save = [&]() -> absl::StatusOr<std::string> {
    absl::StatusOr<std::string> path = absl::UnknownError("not saved");
    as_owner.Do([&] { path = t.SaveCheckpoint(); });
    if (path.ok()) {
      if (options_.metrics != nullptr) {
        options_.metrics->CheckpointWritten(job, t.last_checkpoint_seconds(),
                                            t.last_checkpoint_bytes());
      }
      job.set_last_checkpoint(*path);
      Log(job.id(), absl::StrCat("checkpoint ", *path));
    }
    return path;
  };
  double seconds_sum = 0;
  int64_t timed_steps = 0;
  // A `megatrain checkpoint` being answered: the step whose checkpoint is being written
  // while training goes on (-1: none). Requests that come meanwhile get the same one.
  int64_t answering_step = -1;
  auto answer = [&](absl::StatusOr<v1::CheckpointJobResponse> response) {
    MutexLock lock(&mu_);
    lane.last_checkpoint = std::move(response);
    lane.checkpoint_requests = 0;
    ++lane.checkpoints_done;
    answering_step = -1;
  };
  while (!t.done()) {
    Request request;
    int64_t checkpoint_requests;
    bool stop;
    {
      MutexLock lock(&mu_);
      request = lane.request;
      checkpoint_requests = lane.checkpoint_requests;
      stop = stop_;
    }
    if (checkpoint_requests > 0 && answering_step < 0) {
      // Of the next step, written while training goes on (Trainer::CheckpointNextStep);
      // answered when a step reports it committed (or the final checkpoint is it).
      answering_step = t.step() + 1;
      t.CheckpointNextStep();
    }
    if (request == Request::kCancel) {
      std::string why;
      {
        MutexLock lock(&mu_);
        why = lane.cancel_why;
      }
      return finish(v1::JOB_STATE_CANCELLED, why);
    }
    // Preemption: a waiting job of higher priority takes the device; this one resumes
    // from the checkpoint written now, losing no step.
    std::optional<v1::Job> preemptor;
    if (absl::Now() >= next_preemption_check) {
      next_preemption_check = absl::Now() + absl::Seconds(1);
      preemptor = Preemptor(lane, job);
    }
    if (preemptor.has_value()) {
      absl::StatusOr<std::string> path = save();
      if (path.ok()) {
        job.set_preemptions(job.preemptions() + 1);
        if (options_.metrics != nullptr) options_.metrics->Preempted(job);
        return finish(v1::JOB_STATE_QUEUED,
                      absl::StrCat("preempted by job ", preemptor->id(), " of ", preemptor->owner(),
                                   " (priority ", preemptor->priority(), " > ", job.priority(),
                                   "): checkpointed at step ", t.step(), ", will resume from it"));
      }
      Log(job.id(), absl::StrCat("not preempted: the checkpoint failed: ",
                                 path.status().ToString()));
      MutexLock lock(&mu_);
      lane.preempting_for = 0;
    }
    if (request == Request::kHold || stop) {
      absl::StatusOr<std::string> path = save();
      if (!path.ok()) Log(job.id(), absl::StrCat("checkpoint failed: ", path.status().ToString()));
      if (path.ok() && answering_step == t.step()) {  // the one `megatrain checkpoint` awaits
        v1::CheckpointJobResponse response;
        response.set_path(*path);
        response.set_step(answering_step);
        answer(response);
      }
      return finish(stop ? v1::JOB_STATE_QUEUED : v1::JOB_STATE_HELD,
                    stop ? "daemon stopping: checkpointed, will resume" : "held: checkpointed");
    }
    absl::StatusOr<StepReport> r = absl::UnknownError("no step");
    as_owner.Do([&] { r = t.Step(); });
    if (!r.ok()) {
      return fail(r.status());
    }
    if (!r->checkpoint_error.empty()) Log(job.id(), r->checkpoint_error);
    for (const std::string& path : r->checkpoint_paths) {
      job.set_last_checkpoint(path);
      Log(job.id(), absl::StrCat("checkpoint ", path));
      if (answering_step >= 0 &&
          std::filesystem::path(path).filename() == absl::StrCat("checkpoint-", answering_step)) {
        v1::CheckpointJobResponse response;
        response.set_path(path);
        response.set_step(answering_step);
        answer(response);
      }
    }
    for (int64_t failed : r->failed_checkpoint_steps) {
      if (failed == answering_step) answer(absl::InternalError(r->checkpoint_error));
    }
    if (r->checkpoint_wait_seconds > 0.05) {
      Log(job.id(), absl::StrFormat("step %d waited %.2f s for checkpoints being written "
                                    "(the disk takes them slower than the steps come)",
                                    r->step, r->checkpoint_wait_seconds));
    }
    if (options_.metrics != nullptr) {
      options_.metrics->StepDone(job, *r);
      if (!r->checkpoint_paths.empty()) {
        options_.metrics->CheckpointWritten(job, t.last_checkpoint_seconds(),
                                            t.last_checkpoint_bytes());
      }
    }
    if (r->step > 1) {  // the first step includes warm-up; leave it out of the ETA
      seconds_sum += r->seconds;
      ++timed_steps;
    }
    const double mean = timed_steps > 0 ? seconds_sum / timed_steps : r->seconds;
    v1::Progress* p = job.mutable_progress();
    p->set_step(r->step);
    p->set_total_steps(r->total_steps);
    p->set_loss(r->loss);
    p->set_learning_rate(r->lr);
    p->set_grad_norm(r->grad_norm);
    p->set_tokens_per_second(r->tokens_per_second);
    p->set_tflops(r->model_tflops);
    p->set_step_seconds(r->seconds);
    p->set_eta_seconds(mean * (r->total_steps - r->step));
    (void)store_->Update(job);
    v1::JobEvent event;
    *event.mutable_progress() = *p;
    (void)store_->AppendEvent(job.id(), &event);
    if (r->step == 1 || r->step % 10 == 0 || r->step == r->total_steps) {
      Log(job.id(), absl::StrFormat("step %d/%d loss %.4f lr %.3e grad_norm %.3f %.0f tok/s",
                                    r->step, r->total_steps, r->loss, r->lr, r->grad_norm,
                                    r->tokens_per_second));
    }
    charge(false);
    hub_->Notify(job.id());
  }
  if (!spec->checkpoint_dir.empty()) {
    std::vector<std::string> all;
    as_owner.Do([&] { all = ListCheckpoints(spec->checkpoint_dir); });
    if (!all.empty()) job.set_last_checkpoint(all.back());
  }
  finish(v1::JOB_STATE_SUCCEEDED,
         nothing_to_do ? "succeeded: its final checkpoint was already written; no step ran"
                       : "succeeded");
}

}  // namespace megatrain::server
