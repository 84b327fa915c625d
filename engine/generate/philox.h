// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011):
// the counter-based generator behind the sampler's draws.
//
// A counter-based generator is a keyed hash: the draw for (seed, sequence, step) is
// computed from those numbers alone, with no state carried from one draw to the next. So
// a sequence's tokens do not depend on which other sequences share its batch, on the
// order rows are processed, or on the number of threads; and a device sampler that
// includes this header draws the same numbers as the host. Plain 32-bit integer
// arithmetic, checked against Random123's known-answer vectors (sampling_test.cc).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MT_PHILOX_HOST_DEVICE __host__ __device__
#else
#define MT_PHILOX_HOST_DEVICE
#endif

namespace megatrain {

// out = Philox4x32-10(counter, key): ten rounds, the key bumped by the Weyl constants
// between rounds.
MT_PHILOX_HOST_DEVICE inline void Philox4x32(const uint32_t counter[4], const uint32_t key[2],
                                             uint32_t out[4]) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// A uniform double in [0, 1) with 53 random bits, keyed by the request's seed and
// counted by (sequence_index, step): the counter is (step lo, step hi, sequence lo,
// sequence hi), the key (seed lo, seed hi).
MT_PHILOX_HOST_DEVICE inline double PhiloxUniform(uint64_t seed, uint64_t sequence_index,
                                                  uint64_t step) {
  const uint32_t counter[4] = {static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32),
                               static_cast<uint32_t>(sequence_index),
                               static_cast<uint32_t>(sequence_index >> 32)};
  const uint32_t key[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  uint32_t out[4];
  Philox4x32(counter, key, out);
  const uint64_t bits = (static_cast<uint64_t>(out[0]) << 32) | out[1];
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

}  // namespace megatrain

#undef MT_PHILOX_HOST_DEVICE
