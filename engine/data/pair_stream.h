// A preference dataset's pairs in training order, a step's micro-batches at a time: each
// epoch visits the pairs in a seeded permutation (DocumentOrder, the packer's), and each
// micro-batch takes the next pairs while they fit (PackPairs: a pair never split, both of
// its sequences in one micro-batch). position() / Seek() resume the order exactly, so a
// job restarted from a checkpoint sees the pairs an uninterrupted one would.
//
// Not thread-safe: one stream per job.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "engine/data/packer.h"
#include "engine/data/pair_packer.h"
#include "engine/data/preference.h"

namespace megatrain {

using SequencePair = std::pair<PreferenceSequence, PreferenceSequence>;

class PairStream {
 public:
  // REQUIRES: pairs not empty; each sequence at most seq_len tokens (PreferenceSequences
  // cuts them to max_length <= seq_len).
  PairStream(std::shared_ptr<const std::vector<SequencePair>> pairs, int64_t seq_len,
             uint64_t seed, int32_t pad_id);

  // The next step: `micro_batches` micro-batches of rows x seq_len, each packed from the
  // next pairs of the order (crossing into the next epoch when one is used up); each
  // PairBatch's pair_index holds the pairs' dataset indices.
  std::vector<PairBatch> NextStep(int64_t micro_batches, int64_t rows);

  // Where the next step starts: epoch and doc_cursor (the next pair of that epoch's order);
  // token_offset is always 0.
  DataPosition position() const { return DataPosition{epoch_, cursor_, 0}; }
  // Continues from `position`. InvalidArgument when it cannot belong to this dataset (a
  // cursor past the last pair, a token offset); the stream is unchanged then.
  [[nodiscard]] absl::Status Seek(const DataPosition& position);

  int64_t num_pairs() const { return static_cast<int64_t>(pairs_->size()); }

 private:
  std::shared_ptr<const std::vector<SequencePair>> pairs_;
  int64_t seq_len_;
  uint64_t seed_;
  int32_t pad_id_;
  int64_t epoch_ = 0, cursor_ = 0;
  std::vector<int64_t> order_;  // this epoch's
};

}  // namespace megatrain
