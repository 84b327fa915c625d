#include "engine/data/pair_stream.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/common/check.h"

namespace megatrain {

PairStream::PairStream(std::shared_ptr<const std::vector<SequencePair>> pairs, int64_t seq_len,
                       uint64_t seed, int32_t pad_id)
    : pairs_(std::move(pairs)), seq_len_(seq_len), seed_(seed), pad_id_(pad_id) {
  MT_CHECK(pairs_ != nullptr && !pairs_->empty() && seq_len_ >= 1);
  for (const SequencePair& p : *pairs_) {
    MT_CHECK(static_cast<int64_t>(p.first.ids.size()) <= seq_len_ &&
             static_cast<int64_t>(p.second.ids.size()) <= seq_len_);
  }
  order_ = DocumentOrder(num_pairs(), seed_, epoch_);
}

std::vector<PairBatch> PairStream::NextStep(int64_t micro_batches, int64_t rows) {
  MT_CHECK(micro_batches >= 1 && rows >= 1);
  std::vector<PairBatch> step(micro_batches);
  for (PairBatch& b : step) {
    // The next pairs of this epoch's order, as many as could fit (their tokens within the
    // micro-batch's, and one more): PackPairs takes from the front what does.
    std::vector<SequencePair> next;
    std::vector<int64_t> index;
    int64_t tokens = 0;
    for (int64_t k = cursor_; k < num_pairs() && tokens <= rows * seq_len_; ++k) {
      index.push_back(order_[k]);
      next.push_back((*pairs_)[index.back()]);
      tokens += static_cast<int64_t>(next.back().first.ids.size() + next.back().second.ids.size());
    }
    const int64_t taken = PackPairs(next, 0, rows, seq_len_, pad_id_, &b);
    MT_CHECK_MSG(taken >= 1, "a pair of two sequences of at most %lld tokens fits %lld rows",
                 static_cast<long long>(seq_len_), static_cast<long long>(rows));
    for (int64_t k = 0; k < taken; ++k) b.pair_index[k] = index[b.pair_index[k]];
    cursor_ += taken;
    if (cursor_ == num_pairs()) {
      ++epoch_;
      cursor_ = 0;
      order_ = DocumentOrder(num_pairs(), seed_, epoch_);
    }
  }
  return step;
}

absl::Status PairStream::Seek(const DataPosition& position) {
  if (position.epoch < 0 || position.doc_cursor < 0 || position.doc_cursor >= num_pairs() ||
      position.token_offset != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data position (epoch ", position.epoch, ", pair ", position.doc_cursor, ", offset ",
        position.token_offset, ") does not belong to a preference set of ", num_pairs(),
        " pairs"));
  }
  epoch_ = position.epoch;
  cursor_ = position.doc_cursor;
  order_ = DocumentOrder(num_pairs(), seed_, epoch_);
  return absl::OkStatus();
}

}  // namespace megatrain
