// Token embedding lookup and its scatter-add backward.
//
// The backward is a scatter: several positions may carry the same token, so rows of dtable
// receive sums. Instead of per-thread tables or atomics, threads own disjoint column
// blocks and walk the positions in order, so every element of dtable is summed in position
// order whatever the thread count: bit-identical across runs and machines.
#pragma once

#include <cstdint>
#include <cstring>

#include "engine/common/check.h"
#include "engine/kernels/reference/column_blocks.h"

namespace megatrain::ref {

// out (n, C) = table (V, C) rows selected by tokens (n). REQUIRES: tokens[i] in [0, V).
template <typename T>
void Embedding(T* out, const int32_t* tokens, const T* table, int64_t n, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    MT_CHECK(tokens[i] >= 0);
    std::memcpy(out + i * C, table + static_cast<int64_t>(tokens[i]) * C, C * sizeof(T));
  }
}

// dtable (V, C) += dout (n, C) rows scattered to rows tokens (n); accumulates.
template <typename T>
void EmbeddingBackward(T* dtable, const T* dout, const int32_t* tokens, int64_t n, int64_t C) {
  ForEachColumnBlock(C, [&](int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < n; ++i) {
      MT_CHECK(tokens[i] >= 0);
      T* row = dtable + static_cast<int64_t>(tokens[i]) * C;
      const T* g = dout + i * C;
      for (int64_t c = c0; c < c1; ++c) row[c] += g[c];
    }
  });
}

}  // namespace megatrain::ref
