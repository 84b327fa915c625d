// A DPO job's reference values: each pair's chosen and rejected log-probability under the
// reference model, for the training pairs and the eval set's, each in its own file in the
// job's data cache (ReferenceLogps), computed by the reference pass where a file is not
// complete and reused after a restart.
//
// The reference is the job's starting weights, or the model folder dpo.reference names:
// its weights are loaded into the host store for the pass and the job's own loaded back
// (LoadStartWeights), so that no second model is ever in memory. Starting weights that
// steps have since changed can no longer give the values: a file left incomplete after
// steps is refused unless dpo.reference names the weights.
//
// Thread-compatible.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "engine/job/job_setup.h"
#include "engine/job/reference_logps.h"

namespace megatrain {

class PreferenceReferences {
 public:
  // The files for `spec`'s pairs in `p` (p->pairs, p->eval_pairs), opened (an existing one
  // read, ReferenceLogps::Open's errors). A reference-free job has none.
  // FailedPrecondition when the data cache folder cannot be made.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<PreferenceReferences>> Open(
      const JobSpec& spec, const JobParts& p);

  // Completes every file not complete, by the reference pass over its pairs. `steps_run`:
  // steps taken since `p`'s weights were loaded (the store then no longer holds the
  // starting weights: refused without dpo.reference). The store holds the job's weights
  // after it, as before.
  [[nodiscard]] absl::Status Ensure(const JobSpec& spec, int64_t steps_run, JobParts* p);

  // The training pairs' and the eval pairs' values (null: reference-free, or no eval set).
  // REQUIRES for use: Ensure() succeeded.
  const ReferenceLogps* train() const { return train_.get(); }
  const ReferenceLogps* eval() const { return eval_.get(); }

 private:
  PreferenceReferences() = default;
  bool complete() const;

  std::unique_ptr<ReferenceLogps> train_, eval_;
  std::string train_path_, eval_path_;
};

}  // namespace megatrain
