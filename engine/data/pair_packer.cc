#include "engine/data/pair_packer.h"

#include "engine/common/check.h"
#include "engine/common/preference_math.h"

namespace megatrain {
namespace {

// Where the next sequence goes: row `row`, column `column`.
struct Cursor {
  int64_t row = 0, column = 0;
};

// The place a sequence of `length` tokens takes from `at` (false: no row left for it).
bool Place(int64_t length, int64_t rows, int64_t seq_len, Cursor* at) {
  if (length > seq_len) return false;
  if (at->column + length > seq_len) *at = Cursor{at->row + 1, 0};
  return at->row < rows;
}

// Writes sequence `index` (s) at `at` into out.
void Write(const PreferenceSequence& s, int32_t index, const Cursor& at, int64_t seq_len,
           PairBatch* out) {
  MicroBatch& b = out->batch;
  const int64_t start = at.row * seq_len + at.column, n = static_cast<int64_t>(s.ids.size());
  int64_t targets = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t j = start + k;
    b.tokens[j] = s.ids[k];
    b.doc_start[j] = static_cast<int32_t>(start);
    b.positions[j] = static_cast<int32_t>(k);
    const bool target = k + 1 < n && s.completion[k + 1] != 0;
    b.targets[j] = target ? s.ids[k + 1] : kIgnoreIndex;
    out->sequence[j] = target ? index : -1;
    targets += target;
  }
  out->completion_tokens.push_back(targets);
}

}  // namespace

void AttachSequences(const std::vector<double>& ref_logps, double pair_weight,
                     double chosen_nll_weight, PairBatch* batch) {
  const int64_t S = 2 * batch->pairs();
  MT_CHECK(static_cast<int64_t>(ref_logps.size()) == S);
  MicroBatch& b = batch->batch;
  b.sequence = batch->sequence;
  b.sequence_info.assign(S * kPrefFields, 0.0);
  for (int64_t s = 0; s < S; ++s) {
    double* f = &b.sequence_info[s * kPrefFields];
    f[kPrefRefLogp] = ref_logps[s];
    f[kPrefTokens] = static_cast<double>(batch->completion_tokens[s]);
    f[kPrefPairWeight] = pair_weight;
    f[kPrefNllWeight] = s % 2 == 0 ? chosen_nll_weight : 0.0;
  }
}

std::vector<double> SequenceLogps(const PairBatch& batch, const double* token_values) {
  std::vector<double> logps(2 * batch.pairs(), 0.0);
  for (size_t j = 0; j < batch.sequence.size(); ++j) {
    if (batch.sequence[j] >= 0) logps[batch.sequence[j]] -= token_values[j];
  }
  return logps;
}

int64_t PackPairs(const std::vector<std::pair<PreferenceSequence, PreferenceSequence>>& pairs,
                  int64_t first, int64_t rows, int64_t seq_len, int32_t pad_id, PairBatch* out) {
  MT_CHECK(rows >= 1 && seq_len >= 1 && first >= 0 &&
           first < static_cast<int64_t>(pairs.size()));
  const int64_t n = rows * seq_len;
  MicroBatch& b = out->batch;
  b.rows = rows;
  b.seq_len = seq_len;
  b.tokens.assign(n, pad_id);
  b.targets.assign(n, kIgnoreIndex);
  b.positions.assign(n, 0);
  b.doc_start.resize(n);
  for (int64_t j = 0; j < n; ++j) b.doc_start[j] = static_cast<int32_t>(j);  // padding: alone
  out->sequence.assign(n, -1);
  out->pair_index.clear();
  out->completion_tokens.clear();
  Cursor at;
  int64_t taken = 0;
  // At most the sequences a preference step's micro-batch carries (PreferenceRowScale's).
  for (int64_t p = first;
       p < static_cast<int64_t>(pairs.size()) && 2 * taken < kMaxPreferenceSequences; ++p) {
    const auto& [chosen, rejected] = pairs[p];
    Cursor c = at;
    if (!Place(static_cast<int64_t>(chosen.ids.size()), rows, seq_len, &c)) break;
    Cursor r{c.row, c.column + static_cast<int64_t>(chosen.ids.size())};
    if (!Place(static_cast<int64_t>(rejected.ids.size()), rows, seq_len, &r)) break;
    const int32_t index = static_cast<int32_t>(2 * taken);
    Write(chosen, index, c, seq_len, out);
    Write(rejected, index + 1, r, seq_len, out);
    out->pair_index.push_back(p);
    at = Cursor{r.row, r.column + static_cast<int64_t>(rejected.ids.size())};
    ++taken;
  }
  return taken;
}

}  // namespace megatrain
