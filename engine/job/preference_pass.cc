#include "engine/job/preference_pass.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "engine/common/check.h"
#include "engine/common/fnv1a.h"
#include "engine/common/status.h"
#include "nlohmann/json.hpp"

namespace megatrain {

PreferenceOptions PreferenceOptionsOf(const JobSpec::Dpo& dpo) {
  PreferenceOptions o;
  o.beta = dpo.beta;
  o.loss = dpo.loss == DpoLoss::kIpo     ? PreferenceLoss::kIpo
           : dpo.loss == DpoLoss::kHinge ? PreferenceLoss::kHinge
                                         : PreferenceLoss::kSigmoid;
  o.label_smoothing = dpo.label_smoothing;
  o.rpo_alpha = dpo.rpo_alpha;
  return o;
}

std::string ReferenceFingerprint(const JobSpec& spec, uint64_t pairs_fingerprint) {
  const nlohmann::json pairs = {{"seq_len", spec.seq_len},
                                {"pairs", absl::StrCat(absl::Hex(pairs_fingerprint))}};
  if (!spec.dpo.reference.empty()) {  // the named model's weights, the adapters' none
    nlohmann::json j = {{"reference", spec.dpo.reference}};
    j.update(pairs);
    return j.dump();
  }
  nlohmann::json j = {{"model_path", spec.model_path},
                      {"model_config", spec.model_config_json},
                      {"init_seed", spec.init_seed},
                      {"lora_adapter", spec.lora_adapter}};
  j.update(pairs);
  return j.dump();
}

std::string ReferenceFileName(const std::string& fingerprint) {
  return absl::StrCat("reference_logps-", absl::Hex(Fnv1a(fingerprint), absl::kZeroPad16),
                      ".json");
}

absl::Status RunReferencePass(Pipeline* pipeline, const std::vector<SequencePair>& pairs,
                              int64_t rows, int64_t seq_len, int32_t pad_id,
                              int64_t micro_batches_at_once, ReferenceLogps* cache,
                              int64_t max_pairs) {
  MT_CHECK(micro_batches_at_once >= 1 && cache->num_pairs() == static_cast<int64_t>(pairs.size()));
  const int64_t end =
      max_pairs < 0 ? cache->num_pairs() : std::min(cache->num_pairs(), cache->done() + max_pairs);
  while (cache->done() < end) {
    std::vector<PairBatch> group;
    for (int64_t first = cache->done();
         first < end && static_cast<int64_t>(group.size()) < micro_batches_at_once;) {
      PairBatch& b = group.emplace_back();
      const int64_t taken = PackPairs(pairs, first, rows, seq_len, pad_id, &b);
      MT_CHECK_MSG(taken >= 1, "pair %lld does not fit a micro-batch",
                   static_cast<long long>(first));
      // Past `end`: packed, evaluated, not kept (the next call packs them again alike).
      first += taken;
    }
    std::vector<MicroBatch> batches;
    for (const PairBatch& b : group) batches.push_back(b.batch);
    std::vector<double> values;
    ASSIGN_OR_RETURN(const EvalResult r, pipeline->Evaluate(batches, &values));
    (void)r;
    const int64_t n = rows * seq_len;
    for (size_t m = 0; m < group.size(); ++m) {
      const std::vector<double> logps = SequenceLogps(group[m], &values[m * n]);
      for (int64_t k = 0; k < group[m].pairs() && cache->done() < end; ++k) {
        cache->Append(logps[2 * k], logps[2 * k + 1]);
      }
    }
    RETURN_IF_ERROR(cache->Save());
  }
  return absl::OkStatus();
}

std::vector<MicroBatch> PreferenceStepBatches(std::vector<PairBatch>* step,
                                              const ReferenceLogps* ref,
                                              const PreferenceOptions& options) {
  int64_t pairs = 0, chosen_tokens = 0;
  for (const PairBatch& b : *step) {
    pairs += b.pairs();
    for (int64_t k = 0; k < b.pairs(); ++k) chosen_tokens += b.completion_tokens[2 * k];
  }
  MT_CHECK(pairs > 0);
  const double nll = chosen_tokens > 0 ? options.rpo_alpha / static_cast<double>(chosen_tokens)
                                       : 0.0;
  std::vector<MicroBatch> batches;
  for (PairBatch& b : *step) {
    std::vector<double> values(2 * b.pairs(), 0.0);
    for (int64_t k = 0; ref != nullptr && k < b.pairs(); ++k) {
      std::tie(values[2 * k], values[2 * k + 1]) = ref->Get(b.pair_index[k]);
    }
    AttachSequences(values, 1.0 / static_cast<double>(pairs), nll, &b);
    batches.push_back(b.batch);
  }
  return batches;
}

PreferenceMetrics PairSetMetrics(const std::vector<SequencePair>& pairs,
                                 const ReferenceLogps& policy, const ReferenceLogps* ref,
                                 const PreferenceOptions& options) {
  MT_CHECK(policy.complete() && policy.num_pairs() == static_cast<int64_t>(pairs.size()));
  const auto completion_tokens = [](const PreferenceSequence& s) {
    return static_cast<int64_t>(std::count(s.completion.begin(), s.completion.end(), 1));
  };
  std::vector<PairLogps> values(pairs.size());
  for (size_t k = 0; k < pairs.size(); ++k) {
    PairLogps& v = values[k];
    std::tie(v.chosen, v.rejected) = policy.Get(static_cast<int64_t>(k));
    if (ref != nullptr) std::tie(v.ref_chosen, v.ref_rejected) = ref->Get(static_cast<int64_t>(k));
    v.chosen_tokens = completion_tokens(pairs[k].first);
    v.rejected_tokens = completion_tokens(pairs[k].second);
  }
  return ComputePreferenceStep(options, values).metrics;
}

PreferenceStep PreferenceStepMetrics(const std::vector<PairBatch>& step,
                                     const std::vector<double>& token_values,
                                     const ReferenceLogps* ref, const PreferenceOptions& options) {
  std::vector<PairLogps> pairs;
  size_t offset = 0;
  for (const PairBatch& b : step) {
    MT_CHECK(offset + b.batch.tokens.size() <= token_values.size());
    const std::vector<double> logps = SequenceLogps(b, &token_values[offset]);
    offset += b.batch.tokens.size();
    for (int64_t k = 0; k < b.pairs(); ++k) {
      PairLogps p;
      p.chosen = logps[2 * k];
      p.rejected = logps[2 * k + 1];
      if (ref != nullptr) std::tie(p.ref_chosen, p.ref_rejected) = ref->Get(b.pair_index[k]);
      p.chosen_tokens = b.completion_tokens[2 * k];
      p.rejected_tokens = b.completion_tokens[2 * k + 1];
      pairs.push_back(p);
    }
  }
  return ComputePreferenceStep(options, pairs);
}

}  // namespace megatrain
