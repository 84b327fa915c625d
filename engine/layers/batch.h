// A micro-batch as the layer templates see it: device pointers to its int32 arrays.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace megatrain {

struct DeviceBatch {
  int64_t num_tokens = 0;            // n = rows * seq_len
  const int32_t* tokens = nullptr;   // (n)
  const int32_t* targets = nullptr;  // (n), -100 = no loss
  const int32_t* doc_start = nullptr;  // (n) first token of each token's document
  const int32_t* positions = nullptr;  // (n) RoPE positions
  const int32_t* token_order = nullptr;  // (n) TokenOrder of tokens
  // Generation (engine/generate/): each token's sequence slot in the KV cache, where its key
  // and value are written at its position; null in training. In a decode step kv_length is
  // set too: each token is its sequence's newest and attends to the first kv_length[i] keys
  // of its slot's cache (its own included) instead of to the batch.
  const int32_t* seq_slot = nullptr;   // (n)
  const int32_t* kv_length = nullptr;  // (n) decode only
  // A preference objective's training pass (preference_objective.h): each token's sequence
  // in the micro-batch (2k: pair k's chosen, 2k+1 its rejected; -1: no target) and each
  // sequence's kPrefFields doubles (common/preference_math.h); null otherwise.
  const int32_t* sequence = nullptr;      // (n)
  const double* sequence_info = nullptr;  // (num_sequences, kPrefFields)
  int64_t num_sequences = 0;
};

// One layer's KV cache in generation: the keys and values of every sequence slot, after
// QK-norm and RoPE, as the layer's attention reads them.
struct KvCacheLayer {
  void* k = nullptr;     // act (slots, max_len, KV, D)
  void* v = nullptr;     // act (slots, max_len, KV, D)
  int64_t max_len = 0;
};

// order (n) = the positions 0 .. n-1 sorted by (tokens[i], i): each token's positions in a
// run, in increasing order. The embedding backward sums a token's gradient rows in this
// order, so that it needs no atomics and its result does not vary from run to run.
// REQUIRES: tokens[i] >= 0.
inline void TokenOrder(const int32_t* tokens, int64_t n, int32_t* order) {
  std::vector<uint64_t> keys(n);
  for (int64_t i = 0; i < n; ++i) {
    keys[i] = uint64_t{static_cast<uint32_t>(tokens[i])} << 32 | static_cast<uint32_t>(i);
  }
  std::sort(keys.begin(), keys.end());
  for (int64_t i = 0; i < n; ++i) order[i] = static_cast<int32_t>(keys[i] & 0xffffffffu);
}

// Carves typed regions out of one device buffer, 256-byte aligned.
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}
  void* Take(int64_t bytes) {
    void* p = base_ == nullptr ? nullptr : base_ + used_;
    used_ += (bytes + 255) / 256 * 256;
    return p;
  }
  int64_t used() const { return used_; }

 private:
  char* base_;
  int64_t used_ = 0;
};

}  // namespace megatrain
