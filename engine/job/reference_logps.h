// DPO's reference log-probabilities: each pair's chosen and rejected log p under the
// starting weights, computed once by a forward-only pass before training (TRL's
// precompute_ref_log_probs) and kept in the job's folder, so that neither a second model
// nor a second pass is needed, and a restart reuses them.
//
// The file (JSON: "fingerprint", "pairs", "chosen" and "rejected" lists, doubles written to
// round-trip exactly) names what it was computed from: a fingerprint of the model's
// weights and of the preference data with its cutting (the caller's). The pass appends
// pairs in order and saves as it goes, so an interrupted pass resumes at done(). A file of
// another fingerprint or pair count is refused, naming the file: its values belong to
// another model or dataset.
//
// Thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace megatrain {

class ReferenceLogps {
 public:
  // The values saved at `path` when it exists, else none. FailedPrecondition "<path> holds
  // the reference log-probabilities of another model or dataset ..." when its fingerprint
  // or pair count differs; InvalidArgument naming the file when it is not one of ours.
  [[nodiscard]] static absl::StatusOr<ReferenceLogps> Open(const std::string& path,
                                                           const std::string& fingerprint,
                                                           int64_t num_pairs);

  // Values held in memory alone (Save() writes nothing): a pass of the current weights.
  static ReferenceLogps InMemory(int64_t num_pairs);

  int64_t num_pairs() const { return num_pairs_; }
  int64_t done() const { return static_cast<int64_t>(chosen_.size()); }  // pairs [0, done)
  bool complete() const { return done() == num_pairs_; }
  // Pair done()'s values. REQUIRES: !complete().
  void Append(double chosen, double rejected);
  // Pair k's (chosen, rejected). REQUIRES: k < done().
  std::pair<double, double> Get(int64_t k) const;
  // Writes the file durably (a temporary file renamed over it); nothing when InMemory.
  [[nodiscard]] absl::Status Save() const;

 private:
  std::string path_, fingerprint_;
  int64_t num_pairs_ = 0;
  std::vector<double> chosen_, rejected_;
};

}  // namespace megatrain
