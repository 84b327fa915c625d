#include "server/job_runner.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"
#include "engine/common/units.h"
#include "engine/engine.h"
#include "server/node_service.h"
#include "server/run_as.h"
#include "server/spec_convert.h"
#include "server/worker_process.h"

namespace megatrain::server {
namespace {

// Devices a job runs on (its plan's; jobs stored before data parallelism: one).
int64_t JobDevices(const v1::Job& job) { return std::max<int64_t>(1, job.plan().devices()); }

bool Terminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

// A stored job as the scheduler sees it, waiting.
QueuedJob QueuedJobOf(const v1::Job& job) {
  QueuedJob queued;
  queued.id = job.id();
  queued.owner = job.owner();
  queued.priority = job.priority();
  queued.devices = JobDevices(job);
  queued.host_bytes = job.host_bytes_estimate();
  queued.held = job.state() == v1::JOB_STATE_HELD;
  queued.waiting = job.waiting();
  return queued;
}

// A lane's slot with no job, lent to none. The device stays as it is (it is read without
// the lock).
void Vacate(LaneState* slot) {
  slot->running = 0;
  slot->running_priority = 0;
  slot->running_host_bytes = 0;
  slot->lent_to = -1;
  slot->preempting_for = 0;
}

SchedulerOptions SchedulerOptionsOf(const DaemonConfig& config, int64_t host_memory_bytes) {
  SchedulerOptions options;
  options.config = config;
  options.host_memory_bytes = host_memory_bytes;
  return options;
}

}  // namespace

JobRunner::JobRunner(JobStore* store, EventHub* hub, const JobRunnerOptions& options)
    : store_(store),
      hub_(hub),
      options_(options),
      scheduler_(SchedulerOptionsOf(config(), options.host_memory_bytes)) {
  for (const std::string& device : options_.devices) {
    lanes_.push_back(std::make_unique<Lane>());
    lanes_.back()->index = static_cast<int>(lanes_.size()) - 1;
    lanes_.back()->slot.device = device;
  }
}

JobRunner::~JobRunner() { Shutdown(); }

void JobRunner::Start() {
  for (auto& lane : lanes_) {
    Lane* own = lane.get();
    own->thread = std::thread([this, own] { Loop(*own); });
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
  for (const auto& lane : lanes_) ids.push_back(lane->slot.running);
  return ids;
}

std::vector<LaneState> JobRunner::LaneStates() const {
  std::vector<LaneState> states;
  for (const auto& lane : lanes_) states.push_back(lane->slot);
  return states;
}

JobRunner::Lane* JobRunner::LaneRunning(int64_t job_id) {
  for (auto& lane : lanes_) {
    // A gang's job is run by its lead lane; the lanes lent to it only show it.
    if (lane->slot.running == job_id && job_id != 0 && lane->slot.lent_to < 0) {
      return lane.get();
    }
  }
  return nullptr;
}

absl::Status JobRunner::CanRunDevices(int64_t devices) const {
  MutexLock lock(&mu_);
  return Scheduler::CanRunDevices(LaneStates(), devices);
}

void JobRunner::ReleaseLane(Lane& lane) {
  Vacate(&lane.slot);
  for (Lane* lent : lane.gang) {
    Vacate(&lent->slot);
    lent->wake = true;
  }
  lane.gang.clear();
}

absl::Status JobRunner::SetState(v1::Job* job, v1::JobState state, const std::string& why) {
  // The log line first: a follower that sees the terminal state has every line by then.
  absl::Status logged;
  if (!why.empty()) {
    v1::LogLine line;
    line.set_text(why);
    logged = store_->AppendLog(job->id(), &line).status();
  }
  job->set_state(state);
  if (state == v1::JOB_STATE_RUNNING && job->started_unix_ms() == 0) {
    job->set_started_unix_ms(NowUnixMs());
  }
  if (Terminal(state)) job->set_finished_unix_ms(NowUnixMs());
  absl::Status stored = store_->Update(*job);
  if (stored.ok()) {
    v1::JobEvent event;
    *event.mutable_state_change() = *job;
    stored = store_->AppendEvent(job->id(), &event).status();
  }
  hub_->Notify(job->id());
  return logged.ok() ? stored : logged;
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
  RETURN_IF_ERROR(SetState(&*job, to, why));
  return job;
}

void JobRunner::Log(int64_t job_id, const std::string& text) {
  v1::LogLine line;
  line.set_text(Printable(text));
  if (absl::Status logged = store_->AppendLog(job_id, &line).status(); !logged.ok()) {
    ReportWriteFailure(job_id, absl::StrCat("recording the log line \"", line.text(), "\""),
                       logged);
  }
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
    return lane->checkpoints_done >= ticket || lane->slot.running != job_id;
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
  if (absl::Status recorded = store_->Update(*job); !recorded.ok()) {
    ReportWriteFailure(id, "recording why it waits", recorded);
  } else if (!why.empty()) {
    Log(id, absl::StrCat("waiting: ", why));
  }
  hub_->Notify(id);
}

std::optional<StartDecision> JobRunner::Decide(const Lane& lane) {
  absl::StatusOr<std::vector<v1::Job>> queued = store_->ListInState(v1::JOB_STATE_QUEUED);
  if (!queued.ok() || queued->empty()) return std::nullopt;
  SchedulerState state;
  for (const v1::Job& job : *queued) state.queued.push_back(QueuedJobOf(job));
  // Unreadable running jobs or usage count as none: the queue still moves.
  absl::StatusOr<std::vector<v1::Job>> running = store_->ListInState(v1::JOB_STATE_RUNNING);
  if (running.ok()) {
    for (const v1::Job& job : *running) {
      state.running.push_back({job.owner(), job.host_bytes_estimate()});
    }
  }
  absl::StatusOr<std::map<std::string, double>> usage =
      store_->Usage(config().fair_share_half_life_hours * 3600);
  if (usage.ok()) state.usage = *std::move(usage);
  state.host_available_bytes = ReadHostMemory().available_bytes;
  {
    MutexLock lock(&mu_);
    state.lanes = LaneStates();
  }
  return scheduler_.Next(state, lane.index);
}

bool JobRunner::PickNext(Lane& lane, v1::Job* job) {
  for (;;) {
    {
      MutexLock lock(&mu_);
      // Its device is in another lane's gang: the scheduler would say so too; asking
      // here spares the store's reads.
      if (lane.slot.lent_to >= 0) return false;
    }
    std::optional<StartDecision> decision = Decide(lane);
    if (!decision.has_value()) return false;
    for (const WaitingNote& note : decision->notes) SetWaiting(note.job_id, note.why);
    if (!decision->starts()) return false;
    const QueuedJob& chosen = decision->job;
    {
      MutexLock lock(&mu_);
      if (lane.slot.lent_to >= 0) return false;  // lent to another lane meanwhile
      const bool gang_free = std::all_of(decision->gang.begin(), decision->gang.end(),
                                         [&](int other) { return lanes_[other]->slot.idle(); });
      if (!gang_free) continue;  // a gang lane was taken meanwhile: ask again
      // From here on, requests for the job reach this lane.
      lane.slot.running = chosen.id;
      lane.slot.running_priority = chosen.priority;
      lane.slot.running_host_bytes = chosen.host_bytes;
      lane.request = Request::kNone;
      lane.checkpoint_requests = 0;
      lane.gang.clear();
      for (int other : decision->gang) {
        Lane* lent = lanes_[other].get();
        lent->slot.running = chosen.id;
        lent->slot.running_priority = chosen.priority;
        lent->slot.lent_to = lane.index;
        lane.gang.push_back(lent);
      }
    }
    if (!chosen.waiting.empty()) SetWaiting(chosen.id, "");
    absl::StatusOr<v1::Job> claimed =
        Transition(chosen.id, {v1::JOB_STATE_QUEUED}, v1::JOB_STATE_RUNNING, "");
    if (claimed.ok()) {
      *job = *claimed;
      return true;
    }
    MutexLock lock(&mu_);
    ReleaseLane(lane);  // cancelled, held or taken by another lane meanwhile: look again
  }
}

std::optional<QueuedJob> JobRunner::Preemptor(Lane& lane) {
  SchedulerState state;
  {
    MutexLock lock(&mu_);
    state.lanes = LaneStates();
  }
  // Most of the time this lane is not the one to step aside: the queue is not read.
  if (!scheduler_.MayPreempt(state, lane.index)) return std::nullopt;
  absl::StatusOr<std::vector<v1::Job>> queued = store_->ListInState(v1::JOB_STATE_QUEUED);
  if (!queued.ok()) return std::nullopt;
  for (const v1::Job& job : *queued) state.queued.push_back(QueuedJobOf(job));
  state.host_available_bytes = ReadHostMemory().available_bytes;
  std::optional<QueuedJob> preemptor = scheduler_.Preemptor(state, lane.index);
  if (!preemptor.has_value()) return std::nullopt;
  MutexLock lock(&mu_);
  lane.slot.preempting_for = preemptor->id;
  return preemptor;
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

// One run of a job on a lane: what PrepareJob makes and the stages after it share.
struct JobRunner::RunningJob {
  RunningJob(Lane& lane, v1::Job job) : lane(lane), job(std::move(job)) {}

  Lane& lane;
  v1::Job job;  // as last stored, plus what the next record adds
  JobSpec spec;  // the stored spec, with the lane's backend and the job's checkpoints
  // The job's own process, as its owner: the trainer lives there (server/worker.h).
  std::unique_ptr<WorkerProcess> worker;
  internal::StartReply started;  // what the worker's trainer is
  int64_t step = 0;              // steps done
  bool done = false;
  double last_checkpoint_seconds = 0;
  int64_t last_checkpoint_bytes = 0;
  bool generates = false;  // a generate or eval job (its steps complete prompts)
  int64_t generated_tokens = 0;  // its new tokens in this run so far
  bool began = false;  // BeginTraining ran: Finish stops the metrics and charges usage
  bool nothing_to_do = false;  // resumed from the checkpoint of its final step
  absl::Time charged_until;  // device time up to here is charged to the owner
  absl::Time next_preemption_check;
  // Seconds of the steps after the first (which includes warm-up), for the ETA.
  double timed_seconds = 0;
  int64_t timed_steps = 0;
  // A `megatrain checkpoint` being answered: the step whose checkpoint is being written
  // while training goes on (-1: none). Requests that come meanwhile get the same one.
  int64_t answering_step = -1;
};

namespace {

v1::CheckpointJobResponse CheckpointResponse(const std::string& path, int64_t step) {
  v1::CheckpointJobResponse response;
  response.set_path(path);
  response.set_step(step);
  return response;
}

StepReport ReportFromReply(const internal::StepReply& r) {
  StepReport report;
  report.step = r.step();
  report.total_steps = r.total_steps();
  report.loss = r.loss();
  for (const internal::EvalReply& e : r.evals()) {
    EvalReport& eval = report.evals.emplace_back();
    eval.step = e.step();
    eval.loss = e.loss();
    eval.perplexity = e.perplexity();
    eval.targets = e.targets();
    eval.tokens = e.tokens();
    eval.seconds = e.seconds();
    eval.tokens_per_second = e.tokens_per_second();
    eval.has_preference = e.has_preference();
    if (e.has_preference()) eval.preference = PreferenceFromMessage(e.preference());
  }
  report.has_aux_loss = r.has_aux_loss();
  report.aux_loss = r.aux_loss();
  report.aux_loss_coef = r.aux_loss_coef();
  report.has_preference = r.has_preference();
  if (r.has_preference()) report.preference = PreferenceFromMessage(r.preference());
  report.lr = r.lr();
  report.grad_norm = r.grad_norm();
  report.tokens = r.tokens();
  report.seconds = r.seconds();
  report.tokens_per_second = r.tokens_per_second();
  report.model_tflops = r.model_tflops();
  report.device_bytes_peak = r.device_bytes_peak();
  report.device_bytes_in_use = r.device_bytes_in_use();
  for (int i = 0; i < r.stream_busy_seconds_size() && i < kNumStreams; ++i) {
    report.stream_busy_seconds[i] = r.stream_busy_seconds(i);
  }
  report.optimizer_busy_seconds = r.optimizer_busy_seconds();
  report.optimizer_params_per_second = r.optimizer_params_per_second();
  report.optimizer_in_step_fraction = r.optimizer_in_step_fraction();
  report.h2d_bytes = r.h2d_bytes();
  report.d2h_bytes = r.d2h_bytes();
  report.checkpoint_paths.assign(r.checkpoint_paths().begin(), r.checkpoint_paths().end());
  report.checkpoint_wait_seconds = r.checkpoint_wait_seconds();
  report.checkpoint_error = r.checkpoint_error();
  report.failed_checkpoint_steps.assign(r.failed_checkpoint_steps().begin(),
                                        r.failed_checkpoint_steps().end());
  return report;
}

}  // namespace

absl::StatusOr<internal::WorkerReply> JobRunner::CallWorker(RunningJob& run,
                                                           const internal::WorkerRequest& request,
                                                           bool cancellable) {
  Lane& lane = run.lane;
  auto cancelled = [&] {
    MutexLock lock(&mu_);
    return lane.request == Request::kCancel;
  };
  absl::StatusOr<internal::WorkerReply> reply =
      run.worker->Call(request, cancellable ? std::function<bool()>(cancelled) : nullptr);
  if (absl::IsCancelled(reply.status())) {
    // Cancel does not wait for the step: the worker is stopped, its checkpoints stand.
    run.worker->Stop(absl::Seconds(config().workers.stop_grace_s));
  }
  return reply;
}

void JobRunner::Run(Lane& lane, v1::Job job) {
  RunningJob run(lane, std::move(job));
  auto failed = [&](const absl::Status& status) {
    if (!absl::IsCancelled(status)) return Fail(run, status);
    std::string why;
    {
      MutexLock lock(&mu_);
      why = lane.cancel_why;
    }
    Finish(run, v1::JOB_STATE_CANCELLED, why);
  };
  if (absl::Status prepared = PrepareJob(run); !prepared.ok()) return failed(prepared);
  run.generates ? BeginGeneration(run) : BeginTraining(run);
  while (!run.done) {
    // Requests first (they may end the run), then the step, in the worker.
    if (std::optional<RunEnd> end = HandleRequests(run)) {
      return Finish(run, end->state, end->why);
    }
    internal::WorkerRequest request;
    request.mutable_step();
    absl::StatusOr<internal::WorkerReply> reply = CallWorker(run, request, true);
    if (!reply.ok()) return failed(reply.status());
    run.step = reply->step().step();
    run.done = reply->step().done();
    run.last_checkpoint_seconds = reply->step().last_checkpoint_seconds();
    run.last_checkpoint_bytes = reply->step().last_checkpoint_bytes();
    if (run.generates) {
      RecordGeneration(run, reply->step());
    } else {
      RecordStep(run, ReportFromReply(reply->step()));
    }
  }
  if (!run.generates && !run.spec.checkpoint_dir.empty()) {
    internal::WorkerRequest request;
    request.mutable_list_checkpoints();
    absl::StatusOr<internal::WorkerReply> all = CallWorker(run, request, false);
    if (all.ok() && all->checkpoints().paths_size() > 0) {
      run.job.set_last_checkpoint(all->checkpoints().paths(all->checkpoints().paths_size() - 1));
    }
  }
  const char* nothing_ran = run.generates
                               ? "succeeded: its output already held every completion; none ran"
                               : "succeeded: its final checkpoint was already written; no step ran";
  Finish(run, v1::JOB_STATE_SUCCEEDED, run.nothing_to_do ? nothing_ran : "succeeded");
}

absl::Status JobRunner::PrepareJob(RunningJob& run) {
  const absl::Time dispatched = absl::Now();
  v1::Job& job = run.job;
  std::string devices = run.lane.slot.device;
  {
    MutexLock lock(&mu_);
    for (const Lane* lent : run.lane.gang) absl::StrAppend(&devices, ",", lent->slot.device);
  }
  job.set_device(devices);
  job.clear_error();
  // Job records are whole: one that fails is reported, and the next one carries it.
  if (absl::Status recorded = store_->Update(job); !recorded.ok()) {
    ReportWriteFailure(job.id(), "recording its devices", recorded);
  }
  Log(job.id(), absl::StrCat("running on ", devices));

  ASSIGN_OR_RETURN(run.spec, ParseJobSpec(job.spec_yaml(), "", "stored job spec"));
  JobSpec& spec = run.spec;
  spec.checkpoint_dir = job.checkpoint_dir();
  run.generates = spec.kind != JobKind::kTrain;
  // The lane's device decides where "auto" and CUDA jobs run (never the GPU a spec
  // names: that one may be another lane's).
  const std::string& lane_device = run.lane.slot.device;  // fixed: read without mu_
  if (spec.backend == "auto") spec.backend = lane_device;
  if (spec.backend.rfind("cuda", 0) == 0 && lane_device != "cpu") spec.backend = lane_device;
  absl::StatusOr<Caller> owner = job.owner_uid() != 0 || job.owner() == "root"
                                     ? LookupUid(job.owner_uid())
                                     : LookupUser(job.owner());
  if (!owner.ok()) return owner.status();
  // The job's folder in the state folder (its default checkpoints) is its user's.
  const std::string own_dir =
      (std::filesystem::path(options_.state_dir) / "jobs" / std::to_string(job.id())).string();
  if (absl::StartsWith(spec.checkpoint_dir, own_dir + "/")) {
    RETURN_IF_ERROR(MakeJobFolder(options_.state_dir, job.id(), *owner).status());
  }
  const WorkerLimits& limits = config().workers;
  WorkerOptions worker;
  worker.exe_fd = options_.exe_fd;
  worker.what = absl::StrCat("job ", job.id(), "'s worker");
  worker.memory_bytes = static_cast<int64_t>(
      static_cast<double>(job.host_bytes_estimate()) * limits.memory_factor +
      limits.memory_headroom_gib * static_cast<double>(int64_t{1} << 30));
  worker.memory_rule = absl::StrFormat(
      "the plan's %.2f GiB of host memory times workers.memory_factor %g, plus "
      "workers.memory_headroom_gib %g",
      GiB(job.host_bytes_estimate()), limits.memory_factor, limits.memory_headroom_gib);
  worker.open_files = limits.open_files;
  worker.processes = limits.processes;
  worker.silence_timeout = absl::Seconds(limits.silence_timeout_s);
  ASSIGN_OR_RETURN(run.worker, WorkerProcess::Spawn(*owner, worker));
  Log(job.id(), absl::StrFormat("worker process %d as %s, memory limit %.2f GiB",
                                run.worker->pid(), owner->user, GiB(worker.memory_bytes)));
  internal::WorkerRequest request;
  internal::WorkerContext* context = request.mutable_context();
  for (const std::string& root : config().file_roots) context->add_file_roots(root);
  context->set_state_dir(options_.state_dir);
  context->set_own_dir(own_dir);
  context->set_profile_json(options_.profile_json);
  context->set_heartbeat_ms(absl::ToInt64Milliseconds(worker.heartbeat));
  internal::StartRequest* start = request.mutable_start();
  start->set_spec_yaml(job.spec_yaml());
  start->set_checkpoint_dir(spec.checkpoint_dir);
  start->set_backend(spec.backend);
  // A generate job that recorded completions keeps its output's; else it starts afresh.
  start->set_resume_output(job.progress().prompts_done() > 0);
  ASSIGN_OR_RETURN(internal::WorkerReply reply, CallWorker(run, request, true));
  run.started = reply.start();
  // What the process costs beyond the trainer's own setup (bench/daemon_vs_bench.py).
  Log(job.id(), absl::StrFormat("worker ready in %.3f s: the trainer's setup %.3f s, the "
                                "process %.3f s",
                                absl::ToDoubleSeconds(absl::Now() - dispatched),
                                run.started.create_seconds(),
                                absl::ToDoubleSeconds(absl::Now() - dispatched) -
                                    run.started.create_seconds()));
  run.step = run.started.step();
  run.done = run.started.done();
  return absl::OkStatus();
}

void JobRunner::StartClocks(RunningJob& run, int64_t step, int64_t total_steps) {
  // Fair share: the device time this job takes, charged to its owner as it goes.
  run.charged_until = absl::Now();
  run.next_preemption_check = absl::Now() + absl::Seconds(1);
  if (options_.metrics != nullptr) {
    options_.metrics->JobStarted(run.job, run.started.pinned_host_bytes(),
                                 run.started.pageable_host_bytes(), step, total_steps);
  }
  run.began = true;
}

void JobRunner::RecordProgress(const v1::Job& job) {
  // Job records are whole: one that fails is reported, and the next step's carries it.
  // Its event is sent only once the job holds what it says.
  if (absl::Status recorded = store_->Update(job); !recorded.ok()) {
    ReportWriteFailure(job.id(), "recording progress", recorded);
    return;
  }
  v1::JobEvent event;
  *event.mutable_progress() = job.progress();
  if (absl::Status sent = store_->AppendEvent(job.id(), &event).status(); !sent.ok()) {
    ReportWriteFailure(job.id(), "recording a progress event", sent);
  }
}

void JobRunner::BeginTraining(RunningJob& run) {
  v1::Job& job = run.job;
  const internal::StartReply& trainer = run.started;
  StartClocks(run, trainer.step(), run.spec.steps);
  if (trainer.resumed_from_step() > 0) {
    job.set_resumed_from_step(trainer.resumed_from_step());
    // A job killed after its final checkpoint but before its end was recorded resumes
    // done: its progress is that checkpoint's step, not the last one recorded.
    job.mutable_progress()->set_step(trainer.step());
    job.mutable_progress()->set_total_steps(run.spec.steps);
    // The loss shown until a step runs is the one the checkpoint recorded, else none.
    if (std::isfinite(trainer.last_loss())) {
      job.mutable_progress()->set_loss(trainer.last_loss());
    } else {
      job.mutable_progress()->clear_loss();
    }
    Log(job.id(),
        absl::StrCat("resumed from the checkpoint of step ", trainer.resumed_from_step()));
    if (trainer.done()) {
      Log(job.id(), absl::StrCat("found the checkpoint of its final step ", trainer.step(),
                                 ": nothing left to do"));
    }
  }
  run.nothing_to_do = trainer.done();
  Log(job.id(), trainer.dataset_summary());
  if (!trainer.eval_summary().empty()) Log(job.id(), trainer.eval_summary());
  Log(job.id(), absl::StrFormat("%s, %.2fM parameters, %s backend, %d tokens/step, %d steps",
                                trainer.architecture(), trainer.num_parameters() / 1e6,
                                trainer.backend_name(), trainer.tokens_per_step(),
                                run.spec.steps));
  for (absl::string_view line : absl::StrSplit(trainer.plan_text(), '\n', absl::SkipEmpty())) {
    Log(job.id(), absl::StrCat("plan: ", line));
  }
}

std::optional<JobRunner::RunEnd> JobRunner::HandleRequests(RunningJob& run) {
  Lane& lane = run.lane;
  Request request;
  int64_t checkpoint_requests;
  bool stop;
  {
    MutexLock lock(&mu_);
    request = lane.request;
    checkpoint_requests = lane.checkpoint_requests;
    stop = stop_;
  }
  if (checkpoint_requests > 0 && run.answering_step < 0) {
    // Of the next step, written while training goes on (Trainer::CheckpointNextStep);
    // answered when a step reports it committed (or the final checkpoint is it).
    run.answering_step = run.step + 1;
    internal::WorkerRequest next;
    next.mutable_checkpoint_next_step();
    if (absl::Status asked = CallWorker(run, next, false).status(); !asked.ok()) {
      AnswerCheckpoint(run, asked);
    }
  }
  if (request == Request::kCancel) {
    MutexLock lock(&mu_);
    return RunEnd{v1::JOB_STATE_CANCELLED, lane.cancel_why};
  }
  if (absl::Now() >= run.next_preemption_check) {
    run.next_preemption_check = absl::Now() + absl::Seconds(1);
    if (std::optional<RunEnd> end = Preempt(run)) return end;
  }
  if (request == Request::kHold || stop) {
    absl::StatusOr<std::string> path = SaveCheckpoint(run);
    if (!path.ok()) {
      Log(run.job.id(), absl::StrCat("checkpoint failed: ", path.status().ToString()));
    }
    if (path.ok() && run.answering_step == run.step) {  // the one awaited
      AnswerCheckpoint(run, CheckpointResponse(*path, run.answering_step));
    }
    if (stop) return RunEnd{v1::JOB_STATE_QUEUED, "daemon stopping: checkpointed, will resume"};
    return RunEnd{v1::JOB_STATE_HELD, "held: checkpointed"};
  }
  return std::nullopt;
}

std::optional<JobRunner::RunEnd> JobRunner::Preempt(RunningJob& run) {
  // A waiting job of higher priority takes the device; this one resumes from the
  // checkpoint written now, losing no step.
  std::optional<QueuedJob> preemptor = Preemptor(run.lane);
  if (!preemptor.has_value()) return std::nullopt;
  absl::StatusOr<std::string> path = SaveCheckpoint(run);
  if (!path.ok()) {
    Log(run.job.id(),
        absl::StrCat("not preempted: the checkpoint failed: ", path.status().ToString()));
    MutexLock lock(&mu_);
    run.lane.slot.preempting_for = 0;
    return std::nullopt;
  }
  run.job.set_preemptions(run.job.preemptions() + 1);
  if (options_.metrics != nullptr) options_.metrics->Preempted(run.job);
  return RunEnd{v1::JOB_STATE_QUEUED,
                absl::StrCat("preempted by job ", preemptor->id, " of ", preemptor->owner,
                             " (priority ", preemptor->priority, " > ", run.job.priority(),
                             "): checkpointed at step ", run.step, ", will resume from it")};
}

void JobRunner::RecordStep(RunningJob& run, const StepReport& report) {
  v1::Job& job = run.job;
  if (!report.checkpoint_error.empty()) Log(job.id(), report.checkpoint_error);
  for (const std::string& path : report.checkpoint_paths) {
    job.set_last_checkpoint(path);
    Log(job.id(), absl::StrCat("checkpoint ", path));
    if (run.answering_step >= 0 && std::filesystem::path(path).filename() ==
                                       absl::StrCat("checkpoint-", run.answering_step)) {
      AnswerCheckpoint(run, CheckpointResponse(path, run.answering_step));
    }
  }
  for (int64_t failed : report.failed_checkpoint_steps) {
    if (failed == run.answering_step) {
      AnswerCheckpoint(run, absl::InternalError(report.checkpoint_error));
    }
  }
  if (report.checkpoint_wait_seconds > 0.05) {
    Log(job.id(), absl::StrFormat("step %d waited %.2f s for checkpoints being written "
                                  "(the disk takes them slower than the steps come)",
                                  report.step, report.checkpoint_wait_seconds));
  }
  if (options_.metrics != nullptr) {
    options_.metrics->StepDone(job, report);
    if (!report.checkpoint_paths.empty()) {
      options_.metrics->CheckpointWritten(job, run.last_checkpoint_seconds,
                                          run.last_checkpoint_bytes);
    }
  }
  if (report.step > 1) {  // the first step includes warm-up; leave it out of the ETA
    run.timed_seconds += report.seconds;
    ++run.timed_steps;
  }
  const double mean_step_seconds =
      run.timed_steps > 0 ? run.timed_seconds / run.timed_steps : report.seconds;
  v1::Progress* progress = job.mutable_progress();
  progress->set_step(report.step);
  progress->set_total_steps(report.total_steps);
  progress->set_loss(report.loss);
  if (report.has_aux_loss) progress->set_aux_loss(report.aux_loss);
  if (report.has_preference) PreferenceToMessage(report.preference, progress->mutable_preference());
  progress->set_learning_rate(report.lr);
  progress->set_grad_norm(report.grad_norm);
  progress->set_tokens_per_second(report.tokens_per_second);
  progress->set_tflops(report.model_tflops);
  progress->set_step_seconds(report.seconds);
  progress->set_eta_seconds(mean_step_seconds * (report.total_steps - report.step));
  if (!report.evals.empty()) {  // the newest
    progress->set_eval_loss(report.evals.back().loss);
    progress->set_eval_perplexity(report.evals.back().perplexity);
    progress->set_eval_step(report.evals.back().step);
    if (report.evals.back().has_preference) {
      PreferenceToMessage(report.evals.back().preference, progress->mutable_eval_preference());
    }
  }
  RecordProgress(job);
  if (report.step == 1 || report.step % 10 == 0 || report.step == report.total_steps) {
    const std::string aux =
        report.has_aux_loss ? absl::StrFormat(" aux_loss %.4f (x%g)", report.aux_loss,
                                              report.aux_loss_coef)
                            : "";
    const std::string dpo =
        report.has_preference
            ? absl::StrFormat(" rewards/accuracies %.3f rewards/margins %.4f",
                              report.preference.rewards_accuracies,
                              report.preference.rewards_margins)
            : "";
    Log(job.id(), absl::StrFormat("step %d/%d loss %.4f%s%s lr %.3e grad_norm %.3f %.0f tok/s",
                                  report.step, report.total_steps, report.loss, aux, dpo,
                                  report.lr, report.grad_norm, report.tokens_per_second));
  }
  for (const EvalReport& e : report.evals) {
    if (e.has_preference) {  // a DPO job's eval pairs
      Log(job.id(), absl::StrFormat("eval at step %d: loss %.4f rewards/accuracies %.3f "
                                    "rewards/margins %.4f (%d pairs, %.2f s)",
                                    e.step, e.loss, e.preference.rewards_accuracies,
                                    e.preference.rewards_margins, e.preference.pairs,
                                    e.seconds));
      continue;
    }
    Log(job.id(), absl::StrFormat("eval at step %d: loss %.4f perplexity %.3f (%d targets, "
                                  "%.2f s)",
                                  e.step, e.loss, e.perplexity, e.targets, e.seconds));
  }
  ChargeUsage(run, /*now_or_never=*/false);
  hub_->Notify(job.id());
}

void JobRunner::Finish(RunningJob& run, v1::JobState state, const std::string& why) {
  // The worker is gone before the state changes: a job requeued (preempted, stopping) or
  // held and released at once may be taken by another lane right away. It exits when
  // asked (it may be finishing a checkpoint), else is stopped.
  if (run.worker != nullptr) {
    run.worker->Exit(absl::Seconds(config().workers.stop_grace_s));
    run.worker.reset();
  }
  {
    // The lane is freed and the state stored as one step for Transition: a request that
    // finds the lane free (CancelJob, HoldJob) waits here and then acts on the stored state.
    // A cancel that found the lane still running wins over a requeue or a hold (it came
    // while the run checkpointed to step aside): else the job would be queued again after
    // its owner was told it was cancelled.
    MutexLock transitions(&transition_mu_);
    std::string reason = why;
    {
      MutexLock lock(&mu_);
      if (!Terminal(state) && run.lane.request == Request::kCancel) {
        state = v1::JOB_STATE_CANCELLED;
        reason = run.lane.cancel_why;
      }
      ReleaseLane(run.lane);
    }
    if (absl::Status changed = SetState(&run.job, state, reason); !changed.ok()) {
      ReportWriteFailure(run.job.id(), "recording its state change", changed);
    }
  }
  if (!run.began) return;
  if (options_.metrics != nullptr) options_.metrics->JobStopped(run.job);
  ChargeUsage(run, /*now_or_never=*/true);
}

void JobRunner::Fail(RunningJob& run, const absl::Status& status) {
  // The error in the job (printable, as every message quoting file content is).
  run.job.set_error(Printable(status.message()));
  Finish(run, v1::JOB_STATE_FAILED, absl::StrCat("error: ", Printable(status.ToString())));
}

void JobRunner::BeginGeneration(RunningJob& run) {
  v1::Job& job = run.job;
  const internal::StartReply& started = run.started;
  StartClocks(run, 0, 0);
  run.nothing_to_do = started.done();
  Log(job.id(), started.dataset_summary());
  Log(job.id(), absl::StrCat("plan: ", started.plan_text()));
}

void JobRunner::RecordGeneration(RunningJob& run, const internal::StepReply& step) {
  v1::Job& job = run.job;
  for (const std::string& line : step.completions()) Log(job.id(), absl::StrCat("completion ", line));
  const bool eval = run.spec.kind == JobKind::kEval;
  v1::Progress* progress = job.mutable_progress();
  progress->set_step(step.step());
  progress->set_total_steps(step.total_steps());
  progress->set_prompts_done(step.step());
  progress->set_prompts_total(step.total_steps());
  progress->set_tokens_per_second(step.tokens_per_second());
  // From this run's prompts: those a resumed output held took no time in it.
  const int64_t ran = step.step() - run.started.step();
  progress->set_eta_seconds(step.seconds() / std::max<int64_t>(1, ran) *
                            static_cast<double>(step.total_steps() - step.step()));
  if (eval) {
    progress->set_correct(step.correct());
    progress->set_accuracy(static_cast<double>(step.correct()) /
                           static_cast<double>(std::max<int64_t>(1, step.step())));
  }
  RecordProgress(job);
  if (options_.metrics != nullptr) {
    options_.metrics->GenerationStepDone(job, step.tokens() - run.generated_tokens);
  }
  run.generated_tokens = step.tokens();
  Log(job.id(), absl::StrFormat("prompts %d/%d, %d new tokens at %.0f tok/s",
                                step.step(), step.total_steps(), step.tokens(),
                                step.tokens_per_second()));
  if (step.done()) {
    Log(job.id(), absl::StrFormat("generated %d prompt(s), %d new tokens in this run, into %s",
                                  step.total_steps(), step.tokens(),
                                  GenerateSpecOf(run.spec).output_path));
    if (eval) {
      Log(job.id(), absl::StrFormat("accuracy %d/%d = %.4f", step.correct(), step.total_steps(),
                                    progress->accuracy()));
    }
  }
  ChargeUsage(run, /*now_or_never=*/false);
  hub_->Notify(job.id());
}

absl::StatusOr<std::string> JobRunner::SaveCheckpoint(RunningJob& run) {
  if (run.generates) {  // its completions are in its output as each finishes
    const std::string output = GenerateSpecOf(run.spec).output_path;
    Log(run.job.id(), absl::StrCat(run.job.progress().prompts_done(), " completion(s) kept in ",
                                   output, "; the next run completes the other prompts"));
    return output;
  }
  internal::WorkerRequest request;
  request.mutable_save_checkpoint();
  ASSIGN_OR_RETURN(internal::WorkerReply reply, CallWorker(run, request, false));
  const internal::CheckpointReply& saved = reply.checkpoint();
  run.last_checkpoint_seconds = saved.seconds();
  run.last_checkpoint_bytes = saved.bytes();
  if (options_.metrics != nullptr) {
    options_.metrics->CheckpointWritten(run.job, saved.seconds(), saved.bytes());
  }
  run.job.set_last_checkpoint(saved.path());
  Log(run.job.id(), absl::StrCat("checkpoint ", saved.path()));
  return saved.path();
}

void JobRunner::AnswerCheckpoint(RunningJob& run,
                                 absl::StatusOr<v1::CheckpointJobResponse> response) {
  MutexLock lock(&mu_);
  run.lane.last_checkpoint = std::move(response);
  run.lane.checkpoint_requests = 0;
  ++run.lane.checkpoints_done;
  run.answering_step = -1;
}

void JobRunner::ChargeUsage(RunningJob& run, bool now_or_never) {
  const absl::Time now = absl::Now();
  if (!now_or_never && now - run.charged_until < absl::Seconds(10)) return;
  const double device_seconds =
      JobDevices(run.job) * absl::ToDoubleSeconds(now - run.charged_until);
  absl::Status charged = store_->AddUsage(run.job.owner(), device_seconds,
                                          config().fair_share_half_life_hours * 3600);
  if (!charged.ok()) {
    // The time stays uncharged: the next record charges it too.
    ReportWriteFailure(run.job.id(), "charging its device time", charged);
    return;
  }
  run.charged_until = now;
}

}  // namespace megatrain::server
