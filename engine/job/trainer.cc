#include "engine/job/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/common/status.h"
#include "engine/job/eval_set.h"
#include "engine/job/inputs.h"
#include "engine/job/preference_pass.h"
#include "engine/model/lora.h"
#include "engine/optim/schedule.h"

namespace megatrain {

Trainer::~Trainer() {
  checkpoints_.reset();  // an unfinished background checkpoint is abandoned
  // Updates still running read the pipelines' events: let them finish first (unless a
  // step failed half-way: its held gradients are never applied).
  if (parts_ != nullptr && parts_->optimizer != nullptr && !step_failed_) {
    parts_->optimizer->Drain();
  }
  parts_.reset();
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const JobSpec& spec,
                                                         const MachineProfile* profile) {
  std::unique_ptr<Trainer> t(new Trainer);
  t->spec_ = spec;
  ASSIGN_OR_RETURN(t->parts_, SetUpJob(spec, profile));
  JobParts& p = *t->parts_;
  t->batches_.resize(p.plan.micro_batches);
  if (p.eval_docs != nullptr) {
    t->eval_batches_ = PackEvalSet(p.eval_docs, spec, p.eval_pack, p.plan.micro_batch_rows);
  }
  t->state_ = p.state;
  t->reporter_ = std::make_unique<StepReporter>(spec, p.config, p.plan, p.profile,
                                                p.store->layout().TotalElements(),
                                                p.backend.get(), p.optimizer.get());
  JobCheckpointOptions checkpoints;
  checkpoints.dir = spec.checkpoint_dir;
  checkpoints.every_steps = spec.checkpoint_every_steps;
  checkpoints.background = spec.checkpoint_background;
  checkpoints.keep_last = spec.keep_last;
  checkpoints.total_steps = spec.steps;
  checkpoints.files.max_shard_bytes = static_cast<uint64_t>(spec.max_shard_bytes);
  checkpoints.files.tokenizer_dir = p.tokenizer_dir;
  checkpoints.files.moments = p.store->moment_dtype();
  if (HasLora(p.store->layout())) {  // its checkpoints are PEFT adapter folders
    checkpoints.files.adapter_config =
        PeftAdapterConfigJson(p.store->layout(), spec.lora, spec.model_path);
  }
  t->checkpoints_ = std::make_unique<JobCheckpoints>(checkpoints, &p.config, p.store.get(),
                                                     p.optimizer.get(), p.last_saved_step);
  if (spec.dpo.enabled) {
    ASSIGN_OR_RETURN(t->references_, PreferenceReferences::Open(spec, p));
  }
  return t;
}

absl::Status Trainer::EnsureReference() {
  if (references_ == nullptr) return absl::OkStatus();
  return references_->Ensure(spec_, state_.step - parts_->state.step, parts_.get());
}

absl::StatusOr<StepReport> Trainer::Step() {
  if (done()) return absl::FailedPreconditionError("the job has already run all its steps");
  const int64_t step = state_.step + 1;
  std::vector<EvalReport> evals;
  RETURN_IF_ERROR(EnsureReference());
  if (state_.step == 0 && EvaluatesAfter(spec_, 0)) {  // the starting point
    ASSIGN_OR_RETURN(evals.emplace_back(), Evaluate());
  }
  CheckpointOutcomes checkpoints;
  const double checkpoint_wait = checkpoints_->BeforeStep(step, &checkpoints);
  double lr = 0;
  absl::StatusOr<StepResult> result = RunStep(step, &lr);
  if (!result.ok()) return result.status();
  state_.step = step;
  state_.data = parts_->packer != nullptr ? parts_->packer->position()
                                          : parts_->pair_stream->position();
  StepReport report = reporter_->Report(*result, step, lr, checkpoint_wait);
  if (spec_.dpo.enabled) {
    const PreferenceStep dpo = PreferenceStepMetrics(pair_step_, result->token_values,
                                                     references_->train(),
                                                     PreferenceOptionsOf(spec_.dpo));
    const PreferenceMetrics& m = dpo.metrics;
    report.loss = m.loss;
    report.has_preference = true;
    report.preference = StepReport::Preference{m.rewards_chosen,     m.rewards_rejected,
                                               m.rewards_accuracies, m.rewards_margins,
                                               m.logps_chosen,       m.logps_rejected,
                                               m.pairs};
  }
  state_.last_loss = report.loss;
  RETURN_IF_ERROR(checkpoints_->AfterStep(state_, &checkpoints));
  report.checkpoint_paths = std::move(checkpoints.paths);
  report.checkpoint_error = std::move(checkpoints.error);
  report.failed_checkpoint_steps = std::move(checkpoints.failed_steps);
  if (EvaluatesAfter(spec_, step)) {
    ASSIGN_OR_RETURN(evals.emplace_back(), Evaluate());
  }
  report.evals = std::move(evals);
  return report;
}

absl::StatusOr<EvalReport> Trainer::Evaluate() {
  JobParts& p = *parts_;
  if (eval_batches_.empty() && p.eval_pairs == nullptr) {
    return absl::FailedPreconditionError("the job has no eval set (eval.path)");
  }
  p.optimizer->Drain();  // the weights after the last step, every update applied
  RETURN_IF_ERROR(p.optimizer->status());
  if (p.eval_pairs != nullptr) return EvaluatePairs();
  ASSIGN_OR_RETURN(const EvalResult r, p.pipeline->Evaluate(eval_batches_));
  EvalReport report;
  report.step = state_.step;
  report.loss = r.loss();
  report.perplexity = std::exp(report.loss);
  report.targets = r.num_targets;
  report.tokens = r.micro_batches * p.plan.micro_batch_rows * spec_.seq_len;
  report.seconds = r.seconds;
  report.tokens_per_second = r.seconds > 0 ? report.tokens / r.seconds : 0;
  return report;
}

absl::StatusOr<EvalReport> Trainer::EvaluatePairs() {
  RETURN_IF_ERROR(EnsureReference());
  JobParts& p = *parts_;
  const auto start = std::chrono::steady_clock::now();
  ReferenceLogps policy = ReferenceLogps::InMemory(static_cast<int64_t>(p.eval_pairs->size()));
  RETURN_IF_ERROR(RunReferencePass(p.pipeline.get(), *p.eval_pairs, p.plan.micro_batch_rows,
                                   spec_.seq_len, p.pair_pad_id,
                                   std::max<int64_t>(1, p.pipeline->eval_micro_batches()),
                                   &policy));
  const PreferenceMetrics m = PairSetMetrics(*p.eval_pairs, policy, references_->eval(),
                                             PreferenceOptionsOf(spec_.dpo));
  EvalReport report;
  report.step = state_.step;
  report.loss = m.loss;
  report.has_preference = true;
  report.preference = PreferenceReport{m.rewards_chosen,  m.rewards_rejected, m.rewards_accuracies,
                                       m.rewards_margins, m.logps_chosen,     m.logps_rejected,
                                       m.pairs};
  for (const SequencePair& pair : *p.eval_pairs) {
    report.targets += static_cast<int64_t>(
        std::count(pair.first.completion.begin(), pair.first.completion.end(), 1) +
        std::count(pair.second.completion.begin(), pair.second.completion.end(), 1));
    report.tokens += static_cast<int64_t>(pair.first.ids.size() + pair.second.ids.size());
  }
  report.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report.tokens_per_second = report.seconds > 0 ? report.tokens / report.seconds : 0;
  return report;
}

absl::StatusOr<StepResult> Trainer::RunStep(int64_t step, double* lr) {
  JobParts& p = *parts_;
  if (p.pair_stream != nullptr) {  // a DPO job: the step's pairs, over every device
    const int64_t M = p.plan.micro_batches, devices = 1 + p.replicas->size();
    pair_step_ = p.pair_stream->NextStep(M * devices, p.plan.micro_batch_rows);
    std::vector<MicroBatch> all = PreferenceStepBatches(&pair_step_, references_->train(),
                                                        PreferenceOptionsOf(spec_.dpo));
    p.replicas->TakeBatches(std::vector<MicroBatch>(std::make_move_iterator(all.begin() + M),
                                                    std::make_move_iterator(all.end())));
    all.resize(M);
    batches_ = std::move(all);
  } else {
    // In data order: the first device's share, then the next's (as one device would).
    for (MicroBatch& b : batches_) p.packer->Next(p.plan.micro_batch_rows, &b);
    p.replicas->NextBatches(p.packer.get(), p.plan.micro_batch_rows);
  }
  // An NVMe tier's I/O error in the last step's updates (they run on into this one).
  if (absl::Status s = p.optimizer->status(); !s.ok()) {
    step_failed_ = true;
    return s;
  }
  *lr = LearningRate(spec_.schedule, state_.step);
  p.optimizer->BeginStep(*lr, step);
  absl::StatusOr<StepResult> result = p.replicas->Step(p.pipeline.get(), batches_,
                                                       p.optimizer.get());
  if (!result.ok()) {
    step_failed_ = true;
    checkpoints_->StepFailed(step);
  }
  return result;
}

absl::StatusOr<std::string> Trainer::SaveCheckpoint() { return checkpoints_->Save(state_); }

absl::Status Trainer::StartBackgroundCheckpoint() { return checkpoints_->StartNow(state_); }

absl::StatusOr<std::string> Trainer::SaveCheckpointTo(const std::string& root) {
  return checkpoints_->SaveTo(root, state_);
}

absl::StatusOr<std::string> Trainer::FinishBackgroundCheckpoint() {
  return checkpoints_->FinishBackground();
}

int64_t Trainer::pinned_host_bytes() const {
  return static_cast<int64_t>(parts_->store->transfer_bytes() + parts_->slabs->bytes());
}

int64_t Trainer::pageable_host_bytes() const {
  return static_cast<int64_t>(parts_->store->state_bytes());
}

}  // namespace megatrain
