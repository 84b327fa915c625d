// Which keys and query tiles the Hopper attention kernels visit (attention_hopper.cu), and
// which of them need the causal mask, as functions of the batch's document starts alone: one
// definition for the kernels and for their CPU tests (tests/engine/kernels/
// attention_order_test.cc), the one-pass backward's fixed order of dq sums above all, which
// must never leave a block waiting for a sum that no block will add. Plain C++ where CUDA is not compiling.
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

// The forward's key tile t (tile_keys keys from j_first + t tile_keys) for a consumer whose
// queries start at qa and whose last query's first key (the largest first key of its
// queries) is last_lo: whether some score of it is masked (a key before a query's first or
// after the query).
MT_ORDER_FN bool ForwardTileMasked(int j_first, int t, int last_lo, int qa, int tile_keys) {
  const int j0 = j_first + t * tile_keys;
  return j0 + tile_keys - 1 > qa || j0 < last_lo;
}

// The tiles ForwardTileMasked says need no mask: [*lo, *hi), empty when *hi <= *lo.
// REQUIRES: last_lo and qa below INT_MAX - tile_keys.
MT_ORDER_FN void ForwardUnmaskedTiles(int j_first, int last_lo, int qa, int tile_keys, int* lo,
                                      int* hi) {
  *lo = last_lo > j_first ? (last_lo - j_first + tile_keys - 1) / tile_keys : 0;
  *hi = qa - tile_keys + 1 >= j_first ? (qa - tile_keys + 1 - j_first) / tile_keys + 1 : 0;
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
// first_key: the first query's first key.
MT_ORDER_FN bool TileMeetsKeys(int first_key, int i_last, int ka, int kb) {
  return i_last >= ka && first_key <= kb;
}

template <bool kWindow>
MT_ORDER_FN bool TileMeetsKeys(const int32_t* doc_start, int i0, int i_last, int ka, int kb,
                               int window) {
  return TileMeetsKeys(FirstKey<kWindow>(doc_start, i0, window), i_last, ka, kb);
}

// The dk/dv pass's item `it` of a block whose queries span q_tiles tiles of tile_rows from j0,
// over `group` query heads: the tiles from the last down, each tile's heads in turn (the
// head's index in the group in *head, the tile's first query in *i0). Every block of a kv
// head is then at the same tile at the same item, which is what the one-pass backward's
// fixed order of dq sums (below) needs to wait little.
MT_ORDER_FN void DkDvItem(int it, int group, int q_tiles, int j0, int tile_rows, int* head,
                          int* i0) {
  *head = it % group;
  *i0 = j0 + (q_tiles - 1 - it / group) * tile_rows;
}

// The one-pass backward's dq sums: a query tile's consumers (64 keys each, ka = 64 c) that
// meet it are c from first_key / 64 (first_key: the tile's first query's first key, the
// smallest of its queries') up to its last query / 64, and they add in ascending c; so the
// one of keys ka.. comes after this many.
MT_ORDER_FN int DqAddsBefore(int first_key, int ka) { return ka / 64 - first_key / 64; }

// The one-pass backward's blocks in the order they start (a ticket taken at the start, so a
// block's ticket is below those of every block that starts after it): the lowest keys (the
// most queries) first, the launch's kv heads in turn. A block waits only for blocks of
// lower keys of its kv head, which hold lower tickets and so have started.
MT_ORDER_FN void FusedBlock(int ticket, int kv_heads, int* key_block, int* kv_head) {
  *key_block = ticket / kv_heads;
  *kv_head = ticket % kv_heads;
}

}  // namespace megatrain::cuda::order
