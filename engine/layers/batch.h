// A micro-batch as the layer templates see it: device pointers to its int32 arrays.
#pragma once

#include <cstdint>

namespace megatrain {

struct DeviceBatch {
  int64_t num_tokens = 0;            // n = rows * seq_len
  const int32_t* tokens = nullptr;   // (n)
  const int32_t* targets = nullptr;  // (n), -100 = no loss
  const int32_t* doc_start = nullptr;  // (n) first token of each token's document
  const int32_t* positions = nullptr;  // (n) RoPE positions
};

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
