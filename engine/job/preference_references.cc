#include "engine/job/preference_references.h"

#include <algorithm>
#include <filesystem>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/common/status.h"
#include "engine/job/inputs.h"
#include "engine/job/preference_pass.h"

namespace megatrain {

namespace {

// The file of `pairs` (fingerprinted `pairs_fingerprint`) in `folder`, opened.
absl::Status OpenFile(const JobSpec& spec, const std::string& folder,
                      const std::vector<SequencePair>& pairs, uint64_t pairs_fingerprint,
                      std::unique_ptr<ReferenceLogps>* file, std::string* path) {
  const std::string fingerprint = ReferenceFingerprint(spec, pairs_fingerprint);
  *path = (std::filesystem::path(folder) / ReferenceFileName(fingerprint)).string();
  ASSIGN_OR_RETURN(ReferenceLogps opened,
                   ReferenceLogps::Open(*path, fingerprint, static_cast<int64_t>(pairs.size())));
  *file = std::make_unique<ReferenceLogps>(std::move(opened));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<PreferenceReferences>> PreferenceReferences::Open(
    const JobSpec& spec, const JobParts& p) {
  std::unique_ptr<PreferenceReferences> r(new PreferenceReferences);
  if (!spec.dpo.enabled || spec.dpo.reference_free) return r;
  const std::string folder = JobDataCacheDir(spec);
  std::error_code error;
  std::filesystem::create_directories(folder, error);
  if (error) {
    return absl::FailedPreconditionError(absl::StrCat(
        "dpo: cannot create ", folder, " for the reference's values: ", error.message()));
  }
  RETURN_IF_ERROR(OpenFile(spec, folder, *p.pairs, p.pairs_fingerprint, &r->train_,
                           &r->train_path_));
  if (p.eval_pairs != nullptr) {
    RETURN_IF_ERROR(OpenFile(spec, folder, *p.eval_pairs, p.eval_pairs_fingerprint, &r->eval_,
                             &r->eval_path_));
  }
  return r;
}

bool PreferenceReferences::complete() const {
  return (train_ == nullptr || train_->complete()) && (eval_ == nullptr || eval_->complete());
}

absl::Status PreferenceReferences::Ensure(const JobSpec& spec, int64_t steps_run,
                                          JobParts* p) {
  if (complete()) return absl::OkStatus();
  const bool named = !spec.dpo.reference.empty();
  if (!named && (steps_run > 0 || p->state.step > 0)) {
    const std::string& path = train_->complete() ? eval_path_ : train_path_;
    return absl::FailedPreconditionError(absl::StrCat(
        "dpo: the reference log-probabilities (", path, ") are incomplete after ",
        p->state.step + steps_run,
        " steps; they come from the starting weights: restore the file, start the job "
        "afresh, or name the reference model (dpo.reference)"));
  }
  if (named && steps_run > 0) {
    return absl::FailedPreconditionError(
        "dpo: the reference log-probabilities are incomplete after steps of this run");
  }
  if (named) {
    p->optimizer->Drain();  // nothing may still write the weights
    RETURN_IF_ERROR(p->optimizer->status());
    RETURN_IF_ERROR(LoadReferenceWeights(spec, p));
    p->pipeline->WeightsReplaced();
  }
  const int64_t at_once = std::max<int64_t>(1, p->pipeline->eval_micro_batches());
  for (const auto& [pairs, file] : {std::pair{p->pairs.get(), train_.get()},
                                    std::pair{p->eval_pairs.get(), eval_.get()}}) {
    if (file == nullptr || file->complete()) continue;
    RETURN_IF_ERROR(RunReferencePass(p->pipeline.get(), *pairs, p->plan.micro_batch_rows,
                                     spec.seq_len, p->pair_pad_id, at_once, file));
  }
  if (!named) return absl::OkStatus();
  RETURN_IF_ERROR(Annotate(LoadStartWeights(spec, p), "dpo: loading the job's weights back"));
  p->pipeline->WeightsReplaced();
  return absl::OkStatus();
}

}  // namespace megatrain
