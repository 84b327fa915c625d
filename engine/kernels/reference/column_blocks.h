// Column blocks: how the references spread a sum down each column over OpenMP threads.
//
// A gradient summed over rows per column (a bias, a norm weight, an embedding row) is split
// by columns, never by rows: a block of kColumnBlock columns is one thread's, and it adds
// the rows in order, so the sums are the same bits for any thread count.
#pragma once

#include <algorithm>
#include <cstdint>

namespace megatrain::ref {

constexpr int64_t kColumnBlock = 64;

// Calls fn(c0, c1) for each block [c0, c1) of kColumnBlock columns (the last one shorter)
// covering [0, C), the blocks spread statically over the OpenMP threads.
template <typename Fn>
void ForEachColumnBlock(int64_t C, const Fn& fn) {
  const int64_t num_blocks = (C + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t c0 = b * kColumnBlock;
    fn(c0, std::min(C, c0 + kColumnBlock));
  }
}

}  // namespace megatrain::ref
