// Which keys and query tiles the Hopper attention kernels visit (attention_hopper.cu), as
// functions of the batch's document starts alone: one definition for the kernels and for the
// CPU test of the one-pass backward's fixed order of dq sums
// (tests/engine/kernels/attention_order_test.cc), which must never leave a block waiting for
// a sum that no block will add. Plain C++ where CUDA is not compiling.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MT_ORDER_FN __host__ __device__ __forceinline__
#else
#define MT_ORDER_FN inline
#endif

namespace megatrain::cuda::order {

MT_ORDER_FN int32_t DocStart(const int32_t* doc_start, int i) {
#if defined(__CUDA_ARCH__)
  return __ldg(doc_start + i);
#else
  return doc_start[i];
#endif
}

MT_ORDER_FN int Min(int a, int b) {
#if defined(__CUDA_ARCH__)
  return min(a, b);
#else
  return a < b ? a : b;
#endif
}

MT_ORDER_FN int Max(int a, int b) {
#if defined(__CUDA_ARCH__)
  return max(a, b);
#else
  return a > b ? a : b;
#endif
}

// One past the last query that sees key j_last: the end of j_last's document (doc_start is
// nondecreasing, so the first i > j_last whose document starts after j_last).
MT_ORDER_FN int QueryEnd(const int32_t* doc_start, int j_last, int n) {
  int lo = j_last + 1, hi = n;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (DocStart(doc_start, mid) <= j_last) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The first key query i sees: its document's start, or the window's if that is later.
template <bool kWindow>
MT_ORDER_FN int FirstKey(const int32_t* doc_start, int i, int window) {
  const int lo = DocStart(doc_start, i);
  if constexpr (kWindow) return Max(lo, i - window + 1);
  return lo;
}

// The dk/dv pass's block of keys [j0, j_last]: one past the last query that sees any of them
// (its query tiles run from j0 up to there).
template <bool kWindow>
MT_ORDER_FN int KeyBlockQueryEnd(const int32_t* doc_start, int j_last, int window, int n) {
  const int end = QueryEnd(doc_start, j_last, n);
  if constexpr (kWindow) return Min(end, j_last + window);
  return end;
}

// Whether some query of the tile [i0, i_last] may see some key of [ka, kb]: the last query is
// at or after the first key, and the first query's first key (the smallest) at or before
// the last.
template <bool kWindow>
MT_ORDER_FN bool TileMeetsKeys(const int32_t* doc_start, int i0, int i_last, int ka, int kb,
                               int window) {
  return i_last >= ka && FirstKey<kWindow>(doc_start, i0, window) <= kb;
}

// The one-pass backward's dq sums: a query tile's consumers (64 keys each, ka = 64 c) that
// meet it are c from some c_lo up to i_last / 64, and they add in descending c; so the one
// of keys ka.. comes after this many.
MT_ORDER_FN int DqAddsBefore(int i_last, int ka) { return i_last / 64 - ka / 64; }

}  // namespace megatrain::cuda::order
