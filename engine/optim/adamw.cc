// AdamW element loop. Scalars are hoisted and rounded to float exactly where PyTorch
// rounds them (a Python float passed to an fp32 tensor op becomes a float), so the loop
// body is plain fp32 math the compiler can vectorise.
#include "engine/optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "engine/common/adamw_math.h"
#include "engine/common/check.h"
#include "engine/common/dtype.h"

namespace megatrain {
namespace {

// Elements per OpenMP work item: large enough to amortise scheduling, small enough to
// balance across cores on a layer of a few million parameters.
constexpr int64_t kChunk = 1 << 14;

// The loop over [begin, end): AdamWElement's operations (common/adamw_math.h) written out,
// the scalars as plain values. kLerpSmall selects torch.lerp's branch for weight < 0.5.
// Compiled for AVX-512, AVX2 and the x86-64 baseline, picked at load time: the ops are
// IEEE adds, multiplies, divides and square roots (no contraction: -ffp-contract=off),
// so every width gives the same bits, and the wide ones run at memory bandwidth.
template <bool kLerpSmall>
// (Not under ThreadSanitizer: the load-time resolver would run before TSan is set up.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void AdamWChunk(float* __restrict master, float* __restrict m, float* __restrict v,
                uint16_t* __restrict bf16_out, const float* __restrict grad, int64_t begin,
                int64_t end, float grad_scale, float decay, float lerp_weight,
                float one_minus_lerp_weight, float beta2, float one_minus_beta2,
                float bias_correction2_sqrt, float eps, float neg_step_size) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float g = grad[i] * grad_scale;
    float p = master[i] * decay;
    const float mi = m[i];
    const float m_new =
        kLerpSmall ? mi + lerp_weight * (g - mi) : g - (g - mi) * one_minus_lerp_weight;
    const float v_new = v[i] * beta2 + one_minus_beta2 * g * g;
    const float denom = std::sqrt(v_new) / bias_correction2_sqrt + eps;
    p = p + neg_step_size * m_new / denom;
    m[i] = m_new;
    v[i] = v_new;
    master[i] = p;
  }
  if (bf16_out != nullptr) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) bf16_out[i] = AdamWRoundToBf16(master[i]);
  }
}

// Sum of squares of [begin, end) in double, lanes in a fixed order (the build's vector
// width: the same bits wherever this binary runs, unlike the dispatched update above).
double ChunkSumOfSquares(const float* __restrict g, int64_t begin, int64_t end) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = begin; i < end; ++i) sum += static_cast<double>(g[i]) * g[i];
  return sum;
}

AdamWScalars MakeScalars(int64_t step, double lr, double weight_decay, const AdamWHyper& hyper) {
  return MakeAdamWScalars(step, lr, weight_decay, hyper.beta1, hyper.beta2, hyper.eps);
}

void Chunk(const AdamWScalars& s, float* master, float* m, float* v, uint16_t* bf16_out,
           const float* grad, int64_t begin, int64_t end, float grad_scale) {
  if (s.lerp_small) {
    AdamWChunk<true>(master, m, v, bf16_out, grad, begin, end, grad_scale, s.decay, s.lerp_w,
                     s.one_minus_lerp_w, s.beta2, s.one_minus_beta2, s.bc2_sqrt, s.eps,
                     s.neg_step_size);
  } else {
    AdamWChunk<false>(master, m, v, bf16_out, grad, begin, end, grad_scale, s.decay, s.lerp_w,
                      s.one_minus_lerp_w, s.beta2, s.one_minus_beta2, s.bc2_sqrt, s.eps,
                      s.neg_step_size);
  }
}

// ---- quantised moments

// murmur3's finaliser: a 32-bit hash whose output bits all depend on every input bit.
inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  x ^= x >> 16;
  return x;
}

// A uniform draw in [0, 1) from 24 random bits.
inline float Uniform(uint32_t r) {
  return static_cast<float>(static_cast<int32_t>(r >> 8)) * 0x1.0p-24f;  // signed: vectorises
}

// x rounded to one of the two bf16 values around it, up with probability equal to the
// distance from the lower one over the gap: adding 16 random bits below the cut does it.
inline uint16_t Bf16Stochastic(float x, uint32_t r) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + (r & 0xffffu)) >> 16);
}

constexpr float kMCodes = 127.0f, kVCodes = 255.0f;

constexpr float kMStep = 1.0f / kMCodes, kVStep = 1.0f / kVCodes;

// (Comparisons and selects only, no branches or library calls such as std::fmin, so that
// the encoding loop vectorises.)
inline float Clamp01(float t) {
  t = t < 1.0f ? t : 1.0f;
  return t > 0.0f ? t : 0.0f;  // also takes NaN to 0
}

// The magnitude code of t = |m| / scale in [0, 1] (values (q / 127)^2), chosen between the
// two around t with probabilities that make its value t on average (u uniform in [0, 1)).
inline float EncodeM(float t, float u) {
  t = Clamp01(t);
  float q = std::floor(std::sqrt(t) * kMCodes);
  q = q < kMCodes - 1.0f ? q : kMCodes - 1.0f;
  const float a = q * kMStep, b = (q + 1.0f) * kMStep;
  const float lo = a * a, hi = b * b;
  return q + (u * (hi - lo) < t - lo ? 1.0f : 0.0f);
}

// The same for t = v / scale with values (q / 255)^4; a nonzero t keeps code 1 at least.
inline float EncodeV(float t, float u) {
  t = Clamp01(t);
  float q = std::floor(std::sqrt(std::sqrt(t)) * kVCodes);
  q = q < kVCodes - 1.0f ? q : kVCodes - 1.0f;
  const float a = q * kVStep, b = (q + 1.0f) * kVStep;
  const float lo = (a * a) * (a * a), hi = (b * b) * (b * b);
  const float code = q + (u * (hi - lo) < t - lo ? 1.0f : 0.0f);
  const float least = t > 0.0f ? 1.0f : 0.0f;
  return code > least ? code : least;
}

// Decodes elements [begin, end) of a block-aligned run into m and v (fp32). Built for
// several vector widths as AdamWChunk is (floor needs SSE4.1 to vectorise at all); every
// operation is exact IEEE arithmetic, so each width gives the same bits.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void DecodeRun(const UnitMoments& s, int64_t begin, int64_t end, float* m, float* v) {
  if (s.dtype == MomentDType::kBF16) {
    const uint16_t* mb = static_cast<const uint16_t*>(s.m);
    const uint16_t* vb = static_cast<const uint16_t*>(s.v);
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      m[i - begin] = Bf16ToFloat(mb[i]);
      v[i - begin] = Bf16ToFloat(vb[i]);
    }
    return;
  }
  const int8_t* mq = static_cast<const int8_t*>(s.m);
  const uint8_t* vq = static_cast<const uint8_t*>(s.v);
  for (int64_t b0 = begin; b0 < end; b0 = (b0 / kMomentBlock + 1) * kMomentBlock) {
    const int64_t blk = b0 / kMomentBlock, b1 = std::min(end, (blk + 1) * kMomentBlock);
    const float ms = s.m_scales[blk] / (kMCodes * kMCodes);
    const float vs = s.v_scales[blk] / ((kVCodes * kVCodes) * (kVCodes * kVCodes));
#pragma omp simd
    for (int64_t i = b0; i < b1; ++i) {
      const float qm = static_cast<float>(mq[i]), qv = static_cast<float>(vq[i]);
      m[i - begin] = (qm * std::fabs(qm)) * ms;  // the code's sign, its square's size
      v[i - begin] = ((qv * qv) * (qv * qv)) * vs;
    }
  }
}

// Encodes one block [b0, b1) of fp32 moments into the store (block index blk); built as
// DecodeRun is.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void EncodeBlock(const UnitMoments& s, int64_t b0, int64_t b1, const float* m, const float* v,
                 uint32_t key_m, uint32_t key_v) {
  const int64_t n = b1 - b0;
  if (s.dtype == MomentDType::kBF16) {
    uint16_t* mb = static_cast<uint16_t*>(s.m) + b0;
    uint16_t* vb = static_cast<uint16_t*>(s.v) + b0;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t index = static_cast<uint32_t>(b0 + i);
      mb[i] = Bf16Stochastic(m[i], Mix32(index ^ key_m));
      vb[i] = Bf16Stochastic(v[i], Mix32(index ^ key_v));
    }
    return;
  }
  float m_max = 0.0f, v_max = 0.0f;
#pragma omp simd reduction(max : m_max, v_max)
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(m[i]);
    m_max = a > m_max ? a : m_max;
    v_max = v[i] > v_max ? v[i] : v_max;
  }
  const int64_t blk = b0 / kMomentBlock;
  s.m_scales[blk] = m_max;
  s.v_scales[blk] = v_max;
  const float m_inv = m_max > 0.0f ? 1.0f / m_max : 0.0f;
  const float v_inv = v_max > 0.0f ? 1.0f / v_max : 0.0f;
  int8_t* mq = static_cast<int8_t*>(s.m) + b0;
  uint8_t* vq = static_cast<uint8_t*>(s.v) + b0;
  // The codes as floats first (the loop that does the arithmetic, vectorised), then as bytes.
  float cm[kMomentBlock], cv[kMomentBlock];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t index = static_cast<uint32_t>(b0 + i);
    const float qm = EncodeM(std::fabs(m[i]) * m_inv, Uniform(Mix32(index ^ key_m)));
    cm[i] = m[i] < 0.0f ? -qm : qm;
    cv[i] = EncodeV(v[i] * v_inv, Uniform(Mix32(index ^ key_v)));
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    mq[i] = static_cast<int8_t>(static_cast<int32_t>(cm[i]));
    vq[i] = static_cast<uint8_t>(static_cast<int32_t>(cv[i]));
  }
}

}  // namespace

void AdamWUpdate(float* master, float* m, float* v, uint16_t* bf16_out, const float* grad,
                 int64_t n, int64_t step, double lr, double weight_decay, float grad_scale,
                 const AdamWHyper& hyper, double* grad_sum_squares) {
  MT_CHECK(n >= 0);
  MT_CHECK(step >= 1);
  if (n == 0) return;
  MT_CHECK(master != nullptr && m != nullptr && v != nullptr && grad != nullptr);
  const AdamWScalars sc = MakeScalars(step, lr, weight_decay, hyper);
  const int64_t num_chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partials(grad_sum_squares != nullptr ? num_chunks : 0);
  // Dynamic: a core that is busy with something else (a CUDA driver thread, the pipeline)
  // must not hold the whole team back, as a static split would.
#pragma omp parallel for schedule(dynamic, 8) if (num_chunks > 1)
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t begin = c * kChunk;
    const int64_t end = std::min(n, begin + kChunk);
    Chunk(sc, master, m, v, bf16_out, grad, begin, end, grad_scale);
    if (grad_sum_squares != nullptr) partials[c] = ChunkSumOfSquares(grad, begin, end);
  }
  if (grad_sum_squares != nullptr) {
    double total = 0.0;
    for (double p : partials) total += p;
    *grad_sum_squares = total;
  }
}

void AdamWUpdateRanges(float* master, float* m, float* v, uint16_t* bf16_out, const float* grad,
                       int64_t grad_begin, const std::vector<ElementRange>& ranges, int64_t step,
                       double lr, double weight_decay, float grad_scale, const AdamWHyper& hyper,
                       double* grad_sum_squares) {
  MT_CHECK(step >= 1);
  const AdamWScalars decayed = MakeScalars(step, lr, weight_decay, hyper);
  const AdamWScalars plain = MakeScalars(step, lr, 0.0, hyper);
  // AdamWUpdate's chunks of each range (from the range's first element), all in one loop.
  struct Piece {
    size_t range;
    int64_t begin, end;
  };
  std::vector<Piece> pieces;
  for (size_t r = 0; r < ranges.size(); ++r) {
    MT_CHECK(ranges[r].begin <= ranges[r].end && ranges[r].begin >= grad_begin);
    for (int64_t b = ranges[r].begin; b < ranges[r].end; b += kChunk) {
      pieces.push_back(Piece{r, b, std::min(ranges[r].end, b + kChunk)});
    }
  }
  if (pieces.empty()) {
    if (grad_sum_squares != nullptr) *grad_sum_squares = 0.0;
    return;
  }
  MT_CHECK(master != nullptr && m != nullptr && v != nullptr && grad != nullptr);
  const float* g = grad - grad_begin;  // indexed like the others
  std::vector<double> partials(grad_sum_squares != nullptr ? pieces.size() : 0);
  const int64_t num_pieces = static_cast<int64_t>(pieces.size());
#pragma omp parallel for schedule(dynamic, 8) if (num_pieces > 1)
  for (int64_t i = 0; i < num_pieces; ++i) {
    const Piece& p = pieces[i];
    Chunk(ranges[p.range].decay ? decayed : plain, master, m, v, bf16_out, g, p.begin, p.end,
          grad_scale);
    if (grad_sum_squares != nullptr) partials[i] = ChunkSumOfSquares(g, p.begin, p.end);
  }
  if (grad_sum_squares != nullptr) {
    double total = 0.0, range_total = 0.0;
    for (size_t i = 0; i < pieces.size(); ++i) {
      range_total += partials[i];
      if (i + 1 == pieces.size() || pieces[i + 1].range != pieces[i].range) {
        total += range_total;
        range_total = 0.0;
      }
    }
    *grad_sum_squares = total;
  }
}

uint32_t MomentRoundingKey(int64_t unit, int64_t step) {
  return Mix32(static_cast<uint32_t>(unit) * 0x9e3779b9u ^ Mix32(static_cast<uint32_t>(step)));
}

void DecodeMoments(const UnitMoments& moments, int64_t begin, int64_t end, float* m, float* v) {
  if (moments.dtype == MomentDType::kF32) {
    std::memcpy(m, static_cast<const float*>(moments.m) + begin, (end - begin) * sizeof(float));
    std::memcpy(v, static_cast<const float*>(moments.v) + begin, (end - begin) * sizeof(float));
    return;
  }
  DecodeRun(moments, begin, end, m, v);
}

void AdamWUpdateQuantized(float* master, const UnitMoments& moments, uint16_t* bf16_out,
                          const float* grad, int64_t begin, int64_t end, int64_t unit_elements,
                          const std::vector<ElementRange>& tensors, int64_t step, double lr,
                          double weight_decay, float grad_scale, const AdamWHyper& hyper,
                          uint32_t key, double* grad_sum_squares) {
  MT_CHECK(step >= 1);
  MT_CHECK(moments.dtype != MomentDType::kF32);
  MT_CHECK_MSG(begin >= 0 && begin <= end && end <= unit_elements && begin % kMomentBlock == 0 &&
                   (end % kMomentBlock == 0 || end == unit_elements),
               "AdamWUpdateQuantized: [%lld, %lld) of %lld is not whole moment blocks",
               static_cast<long long>(begin), static_cast<long long>(end),
               static_cast<long long>(unit_elements));
  if (begin == end) return;
  const AdamWScalars with_decay = MakeScalars(step, lr, weight_decay, hyper);
  const AdamWScalars no_decay = MakeScalars(step, lr, 0.0, hyper);
  const uint32_t key_m = Mix32(key ^ 0x1b873593u), key_v = Mix32(key ^ 0xcc9e2d51u);
  const int64_t blocks = (end - begin + kMomentBlock - 1) / kMomentBlock;
  std::vector<double> partials(grad_sum_squares != nullptr ? blocks : 0);
#pragma omp parallel for schedule(dynamic, 64) if (blocks > 64)
  for (int64_t k = 0; k < blocks; ++k) {
    const int64_t b0 = begin + k * kMomentBlock, b1 = std::min(end, b0 + kMomentBlock);
    float m[kMomentBlock], v[kMomentBlock];
    DecodeRun(moments, b0, b1, m, v);
    // The tensors' runs in the block (sorted by begin, so also by end), each with its decay.
    // Indices relative to the block for m and v, to the unit for master and bf16.
    auto r = std::upper_bound(tensors.begin(), tensors.end(), b0,
                              [](int64_t x, const ElementRange& t) { return x < t.end; });
    double squares = 0.0;
    for (; r != tensors.end() && r->begin < b1; ++r) {
      const int64_t i0 = std::max(b0, r->begin), i1 = std::min(b1, r->end);
      Chunk(r->decay ? with_decay : no_decay, master + b0, m, v,
            bf16_out != nullptr ? bf16_out + b0 : nullptr, grad + (b0 - begin), i0 - b0, i1 - b0,
            grad_scale);
      if (grad_sum_squares != nullptr) squares += ChunkSumOfSquares(grad, i0 - begin, i1 - begin);
    }
    EncodeBlock(moments, b0, b1, m, v, key_m, key_v);
    if (grad_sum_squares != nullptr) partials[k] = squares;
  }
  if (grad_sum_squares != nullptr) {
    double total = 0.0;
    for (double p : partials) total += p;
    *grad_sum_squares = total;
  }
}

}  // namespace megatrain
