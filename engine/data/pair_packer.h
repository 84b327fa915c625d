// DPO's micro-batches: both sequences of a pair in the same micro-batch, so that the head
// has a pair's two log-probability sums together (layers/preference_loss.h).
//
// Sequences are laid end to end in rows of seq_len, in order (each pair's chosen, then its
// rejected), a sequence never split across rows: one that does not fit in the rest of a
// row starts the next. Each is its own attention segment (positions from 0). A token is a
// target where the next token is a completion token of the same sequence (TRL's shifted
// completion mask), and it records which of the micro-batch's sequences it belongs to.
// Once a pair does not fit in the rows left, or the micro-batch holds
// kMaxPreferenceSequences / 2 pairs (common/preference_math.h), the micro-batch ends and the
// rest is padding.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "engine/data/micro_batch.h"
#include "engine/data/preference.h"

namespace megatrain {

struct PairBatch {
  MicroBatch batch;
  // (rows*seq_len): the index of the sequence a target token belongs to, -1 where there
  // is no target. Sequence 2k is pair k's chosen, 2k+1 its rejected.
  std::vector<int32_t> sequence;
  std::vector<int64_t> pair_index;         // (pairs) each pair's index in the caller's list
  std::vector<int64_t> completion_tokens;  // (2*pairs) each sequence's target count
  int64_t pairs() const { return static_cast<int64_t>(pair_index.size()); }
};

// Packs pairs[first], pairs[first+1], ... into `out` (rows x seq_len) while they fit, and
// returns how many it took (0 when pairs[first] does not fit in an empty micro-batch).
// REQUIRES: rows >= 1, seq_len >= 1, first < pairs.size().
int64_t PackPairs(const std::vector<std::pair<PreferenceSequence, PreferenceSequence>>& pairs,
                  int64_t first, int64_t rows, int64_t seq_len, int32_t pad_id, PairBatch* out);

// Makes batch->batch a preference step's micro-batch (MicroBatch::sequence, sequence_info):
// each sequence's reference log-probability (ref_logps: 2 * pairs(), each pair's chosen then
// rejected; zeros when reference-free), its completion's token count, its pair's weight in
// the step's mean (pair_weight: 1 / the step's pairs) and each of its tokens' NLL weight
// (chosen_nll_weight on a chosen completion's: RPO's rpo_alpha / the step's chosen tokens;
// 0 on a rejected one's).
void AttachSequences(const std::vector<double>& ref_logps, double pair_weight,
                     double chosen_nll_weight, PairBatch* batch);

// Each of the batch's sequences' log-probability, the sum of log p(target) over its
// targets, from the micro-batch's per-token -log p(target) (a forward-only pass's values,
// Pipeline::Evaluate): 2 * pairs() values, each pair's chosen then rejected.
std::vector<double> SequenceLogps(const PairBatch& batch, const double* token_values);

}  // namespace megatrain
