// Generation's two attention ops: the KV cache write and one-token decode attention.
//
// Each layer keeps a cache of the keys and values it has seen, (slots, max_len, KV, D) each,
// a sequence slot's keys contiguous in position order. Prefill and decode both write their
// new tokens' k and v (after QK-norm and RoPE, as QkvPrepare leaves them) at [slot, position];
// a decode step then attends each sequence's one new query to its cached keys 0 .. length-1,
// the new one included. That is exactly the last row of causal Attention (attention.h) over
// the whole sequence, and this reference is written to be that row: the same scores, the same
// order of sums, in double, so the two agree to the last bit of T wherever the compiler
// contracts them alike. A window keeps the last `window` keys, a sink adds exp(sink_h) to each
// denominator, as there.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "engine/common/check.h"
#include "engine/kernels/reference/attention.h"

namespace megatrain::ref {

// k_cache, v_cache (slots, max_len, KV, D) [seq_slot[i], position[i]] = k, v (n, KV, D) [i].
// Elements of the caches that no token names keep their values.
// REQUIRES: 0 <= position[i] < max_len, seq_slot[i] >= 0 (and < the caches' slots); no two
// tokens name the same (slot, position).
template <typename T>
void KvCacheWrite(T* k_cache, T* v_cache, const T* k, const T* v, const int32_t* seq_slot,
                  const int32_t* position, int64_t n, int64_t KV, int64_t D, int64_t max_len) {
  MT_CHECK(KV > 0 && D > 0 && max_len > 0);
  const int64_t row = KV * D;  // elements of one token's k (or v)
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    MT_CHECK(seq_slot[i] >= 0 && position[i] >= 0 && position[i] < max_len);
    const int64_t dst = (static_cast<int64_t>(seq_slot[i]) * max_len + position[i]) * row;
    std::copy(k + i * row, k + (i + 1) * row, k_cache + dst);
    std::copy(v + i * row, v + (i + 1) * row, v_cache + dst);
  }
}

// o (B,H,D) from q (B,H,D) against the caches k_cache, v_cache (slots, max_len, KV, D): row b
// is the newest token of the sequence in slot seq_slot[b], which has length[b] keys (the new
// one, at position length[b]-1, already written). With i = length[b] - 1, row b attends to
// keys j0 <= j <= i of its slot, j0 = 0, or with window > 0 max(0, i - window + 1):
//   s_j = scale q_b.k_j,  o_b = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink_h))
// (no sink term when sinks is null); scale 1/sqrt(D); query head h reads kv head h / (H/KV).
// This is Attention's output row i for that sequence packed as one document.
// REQUIRES: H % KV == 0; 1 <= length[b] <= max_len; seq_slot[b] >= 0; window >= 0.
template <typename T>
void DecodeAttention(T* o, const T* q, const T* k_cache, const T* v_cache, const int32_t* seq_slot,
                     const int32_t* length, const T* sinks, int64_t window, int64_t B, int64_t H,
                     int64_t KV, int64_t D, int64_t max_len) {
  MT_CHECK(H > 0 && KV > 0 && H % KV == 0 && D > 0 && window >= 0 && max_len > 0);
  const int64_t group = H / KV;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
#pragma omp parallel
  {
    std::vector<double> score(max_len);  // (keys of one row)
    std::vector<double> acc(D);
#pragma omp for collapse(2) schedule(dynamic, 8)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        MT_CHECK(length[b] >= 1 && length[b] <= max_len && seq_slot[b] >= 0);
        const int64_t i = length[b] - 1;
        const int64_t j0 = window > 0 ? std::max<int64_t>(0, i - window + 1) : 0;
        const int64_t g = h / group;
        const T* kc = k_cache + static_cast<int64_t>(seq_slot[b]) * max_len * KV * D;
        const T* vc = v_cache + static_cast<int64_t>(seq_slot[b]) * max_len * KV * D;
        // Attention's loop for query i, key for key.
        attention_internal::AttendOne(q + (b * H + h) * D, kc + g * D, vc + g * D, KV * D, j0,
                                      i, D, scale, sinks != nullptr ? sinks + h : nullptr,
                                      score.data(), acc.data(), o + (b * H + h) * D);
      }
    }
  }
}

}  // namespace megatrain::ref
