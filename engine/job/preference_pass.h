// A DPO job's passes over its pairs (layers/preference_loss.h has the losses):
//   - the reference pass: each pair's chosen and rejected log-probability under the
//     starting weights, by the pipeline's forward-only pass over the pairs in dataset order,
//     appended to the job's ReferenceLogps file as it goes (an interrupted pass resumes);
//   - a step's micro-batches made ready: each sequence's reference value and the step's
//     weights attached (AttachSequences: 1 / the step's pairs, RPO's weight over the
//     step's chosen tokens);
//   - a step's metrics, TRL's, from the per-token values the step returns.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/data/pair_stream.h"
#include "engine/engine.h"
#include "engine/job/reference_logps.h"
#include "engine/layers/preference_loss.h"
#include "engine/pipeline/pipeline.h"

namespace megatrain {

// The losses' options a job's dpo section names.
PreferenceOptions PreferenceOptionsOf(const JobSpec::Dpo& dpo);

// What a job's reference values are tied to: the reference's weights (dpo.reference's
// folder, else the starting weights: the model folder, or its config and init seed; a LoRA
// job's starting adapter) and the pairs as cut.
std::string ReferenceFingerprint(const JobSpec& spec, uint64_t pairs_fingerprint);
// The file in the job's data cache holding them: reference_logps-<16 hex digits of the
// fingerprint's FNV-1a>.json, so that jobs sharing a cache folder (the temporary one of
// jobs without checkpoint.dir) keep theirs apart.
std::string ReferenceFileName(const std::string& fingerprint);

// Runs the reference pass from cache->done() on: packs the pairs (in dataset order) into
// micro-batches of rows x seq_len, evaluates them on `pipeline` a group of
// `micro_batches_at_once` at a time, appends each pair's two log-probabilities and saves
// the file after each group. Stops after at most `max_pairs` pairs (< 0: every pair left).
// Errors: the pipeline's, or the file's.
[[nodiscard]] absl::Status RunReferencePass(Pipeline* pipeline,
                                            const std::vector<SequencePair>& pairs,
                                            int64_t rows, int64_t seq_len, int32_t pad_id,
                                            int64_t micro_batches_at_once,
                                            ReferenceLogps* cache, int64_t max_pairs = -1);

// Attaches to each of the step's micro-batches its sequences' reference values (`ref`:
// complete, or null for reference-free) and the step's weights. Returns the micro-batches.
std::vector<MicroBatch> PreferenceStepBatches(std::vector<PairBatch>* step,
                                              const ReferenceLogps* ref,
                                              const PreferenceOptions& options);

// The loss and metrics of a whole set of pairs (an eval set): `policy` their values under
// the weights evaluated (complete), `ref` the reference's (complete; null: reference-free).
PreferenceMetrics PairSetMetrics(const std::vector<SequencePair>& pairs,
                                 const ReferenceLogps& policy, const ReferenceLogps* ref,
                                 const PreferenceOptions& options);

// The step's loss and metrics from its per-token values (StepResult::token_values, the
// micro-batches' in order).
PreferenceStep PreferenceStepMetrics(const std::vector<PairBatch>& step,
                                     const std::vector<double>& token_values,
                                     const ReferenceLogps* ref, const PreferenceOptions& options);

}  // namespace megatrain
