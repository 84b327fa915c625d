// Generation's attention on the device: the KV cache write, and decode attention, one new
// query token per sequence against its slot of the cache (kernels/reference/decode_attention.h).
//
// A decode step reads every cached key and value and does little math per byte: it is bound
// by HBM bandwidth, so the kernel reads each cached element once per step. A block takes one
// (sequence, kv head) and the G = H/KV query heads that read it as the rows of one 16-row mma
// tile (rows past G are zeros; G > 16 takes ceil(G/16) blocks per kv head). S = Q K^T and
// O += P V run on tensor cores (bf16 mma.sync m16n8k16, fp32 accumulators), which makes the
// FLOPs of any group size free beside the bytes. Tiles of 64 keys and values stream into
// shared memory with 16-byte cp.async, double-buffered; each of the 4 warps takes 16 keys of
// a tile with an online softmax of its own (fp32, log2 units), and the warps' (max, sum, O)
// merge in warp order at the end.
//
// Few sequences with long caches give too few blocks to fill the device. Then (flash-decoding)
// a sequence's visible tiles are cut into `splits` equal runs, one block each, whose partial
// (max, sum, O) go to the partials scratch in fp32; a second kernel merges them in split
// order, adds the sink and normalises. The split count is a function of the shape, max_len and
// the device (its SM count and the kernel's occupancy) only, never of timing or of the
// lengths, so one device gives the same bits on every run. No atomics.
//
// Shapes: q, o (B,H,D) bf16; caches (slots, max_len, KV, D) bf16; seq_slot, length (B) int32;
// sinks (H) bf16 | null; partials f32 (splits, B, H, D) then (splits, B, H, 2).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "engine/common/check.h"
#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/mma.cuh"
#include "engine/kernels/cuda/ops.h"

namespace megatrain::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kWarps = 4, kThreads = 32 * kWarps;
constexpr int kRows = 16;           // query heads of a block: one mma tile's rows
constexpr int kKeys = kWarps * 16;  // keys of a tile, 16 per warp
constexpr int kMinSplitTiles = 2;   // a split takes at least this many tiles
constexpr int kMaxSplits = 256;

// ---- mma over one 16-row tile (the primitives: mma.cuh) ----

// s (16 x 16) = A (16 x kD) * B^T, A the 16 rows at a, B the 16 rows at b, both row-major
// with stride kD + 8 in shared memory. Accumulator layout (mma C fragment): s[t][e] is row
// lane/4 + 8*(e/2), column 8t + 2*(lane%4) + e%2.
template <int kD>
__device__ __forceinline__ void MmaABt(float (&s)[2][4], const bf16* a, const bf16* b) {
  constexpr int kStride = kD + 8;
  const int lane = threadIdx.x % 32;
  const bf16* a_lane = a + (lane % 16) * kStride + (lane / 16) * 8;
  const bf16* b_lane = b + (lane % 8 + (lane / 16) * 8) * kStride + ((lane / 8) % 2) * 8;
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
    uint32_t af[4], bf[4];
    LdMatrix(af, a_lane + ks * 16);
    LdMatrix(bf, b_lane + ks * 16);
    Mma(s[0], af, bf[0], bf[1]);
    Mma(s[1], af, bf[2], bf[3]);
  }
}

// acc (16 x kD) += P (16 x 16) * B, P in registers in MmaABt's layout (rounded to bf16
// here), B the 16 rows at b, row-major with stride kD + 8. acc[t][e]: row lane/4 + 8*(e/2),
// column 8t + 2*(lane%4) + e%2.
template <int kD>
__device__ __forceinline__ void MmaPB(float (&acc)[kD / 8][4], const float (&p)[2][4],
                                      const bf16* b) {
  constexpr int kStride = kD + 8;
  const int lane = threadIdx.x % 32;
  const bf16* b_lane = b + (lane % 8 + ((lane / 8) % 2) * 8) * kStride + (lane / 16) * 8;
  // The C fragments of two adjacent 8-column tiles are the A fragment of one 16-deep step.
  const uint32_t af[4] = {Pack(p[0][0], p[0][1]), Pack(p[0][2], p[0][3]), Pack(p[1][0], p[1][1]),
                          Pack(p[1][2], p[1][3])};
#pragma unroll
  for (int np = 0; np < kD / 16; ++np) {
    uint32_t bf[4];
    LdMatrixTrans(bf, b_lane + np * 16);
    Mma(acc[2 * np], af, bf[0], bf[1]);
    Mma(acc[2 * np + 1], af, bf[2], bf[3]);
  }
}

// ---- decode attention ----

struct DecodeParams {
  bf16* o;                  // (B,H,D)
  const bf16* q;            // (B,H,D)
  const bf16* k_cache;      // (slots, max_len, KV, D)
  const bf16* v_cache;      // (slots, max_len, KV, D)
  const int32_t* seq_slot;  // (B)
  const int32_t* length;    // (B)
  const bf16* sinks;        // (H) | null
  float* part_o;            // (splits, B, H, D), used when splits > 1
  float* part_ml;           // (splits, B, H, 2): max (log2 units), sum relative to it
  int B, H, KV, group, head_tiles, window, max_len, splits;
  float scale_log2;  // log2(e) / sqrt(D)
};

// Sequence b's visible keys [lo, hi) lie in tiles [first, first + tiles) of kKeys keys from
// position 0; split c takes tiles [first + c*per, first + min((c+1)*per, tiles)), and splits
// c >= used take none. Every tile of the range holds a visible key.
struct KeyTiles {
  int lo, hi, first, tiles, per, used;
};

__device__ __forceinline__ KeyTiles SequenceTiles(const DecodeParams& p, int b) {
  KeyTiles r;
  // A length past the cache reads no further; a negative slot, nothing.
  r.hi = p.seq_slot[b] < 0 ? 0 : min(max(p.length[b], 0), p.max_len);
  r.lo = p.window > 0 ? max(0, r.hi - p.window) : 0;
  r.first = r.lo / kKeys;
  r.tiles = r.hi > r.lo ? (r.hi + kKeys - 1) / kKeys - r.first : 0;
  r.per = (r.tiles + p.splits - 1) / p.splits;
  r.used = r.per > 0 ? (r.tiles + r.per - 1) / r.per : 0;
  return r;
}

// A row's output from its (max m in log2 units, sum l and value o relative to m), with the
// sink's exp(sink_h) joining the sum. m = -inf (no key) has l = o = 0: the output is 0.
__device__ __forceinline__ float Finalize(float m, float l, float o, const bf16* sinks, int h) {
  if (sinks != nullptr) {
    const float sink2 = ToF(sinks[h]) * kLog2e;
    const float m_new = fmaxf(m, sink2), corr = exp2f(m - m_new);
    return o * corr / (l * corr + exp2f(sink2 - m_new));
  }
  return l > 0.0f ? o / l : 0.0f;
}

template <int kD>
constexpr int DecodeSmemBytes() {
  return (kRows + 4 * kKeys) * (kD + 8) * 2 + kWarps * kRows * 2 * 4;
}

// Starts copying tile t of the keys and values of one (slot, kv head) into s_k, s_v
// (kKeys, kD + 8); keys outside [lo, hi) are stored as zeros (past a sequence's length the
// cache holds anything, NaN included, and P = 0 must not meet it).
template <int kD>
__device__ __forceinline__ void LoadTile(bf16* s_k, bf16* s_v, const bf16* kc, const bf16* vc,
                                         int64_t row_stride, int t, int lo, int hi) {
  constexpr int kChunks = kD / 8;
#pragma unroll
  for (int it = 0; it < kKeys * kChunks / kThreads; ++it) {
    const int idx = it * kThreads + static_cast<int>(threadIdx.x);
    const int r = idx / kChunks, c = idx % kChunks, j = t * kKeys + r;
    bf16* dk = s_k + r * (kD + 8) + c * 8;
    bf16* dv = s_v + r * (kD + 8) + c * 8;
    if (j >= lo && j < hi) {
      CpAsync16(dk, kc + j * row_stride + c * 8);
      CpAsync16(dv, vc + j * row_stride + c * 8);
    } else {
      *reinterpret_cast<uint4*>(dk) = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(dv) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// grid (splits, KV * head_tiles, B), kThreads threads: one block per (split, kv head, head
// tile, sequence). Without a split it writes o; with one, its rows of the partials.
template <int kD>
__global__ void __launch_bounds__(kThreads) DecodeAttentionKernel(DecodeParams p) {
  constexpr int kStride = kD + 8, kTile = kKeys * kStride, kOStride = kD + 4;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* s_q = reinterpret_cast<bf16*>(smem);                // (kRows, kStride)
  bf16* s_k = s_q + kRows * kStride;                        // (2, kKeys, kStride)
  bf16* s_v = s_k + 2 * kTile;                              // (2, kKeys, kStride)
  float* s_ml = reinterpret_cast<float*>(s_v + 2 * kTile);  // (kWarps, kRows, 2)
  float* s_o = reinterpret_cast<float*>(s_k);  // (kWarps, kRows, kOStride) once tiles are done

  const int split = blockIdx.x, b = blockIdx.z;
  const int kvh = blockIdx.y / p.head_tiles,
            h0 = kvh * p.group + (blockIdx.y % p.head_tiles) * kRows;
  const int rows = min(kRows, kvh * p.group + p.group - h0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const KeyTiles r = SequenceTiles(p, b);
  const int t_begin = r.first + split * r.per, t_end = r.first + min((split + 1) * r.per, r.tiles);
  if (p.splits > 1 && split >= r.used) return;  // an empty split: the merge skips it

  const int64_t row_stride = static_cast<int64_t>(p.KV) * kD;  // between a slot's keys
  const int64_t slot = p.seq_slot[b];
  const bf16* kc = p.k_cache + slot * p.max_len * row_stride + kvh * kD;
  const bf16* vc = p.v_cache + slot * p.max_len * row_stride + kvh * kD;
  for (int idx = threadIdx.x; idx < kRows * kD / 8; idx += kThreads) {
    const int row = idx / (kD / 8), c = idx % (kD / 8);
    bf16* dst = s_q + row * kStride + c * 8;
    if (row < rows) {
      CpAsync16(dst, p.q + (static_cast<int64_t>(b) * p.H + h0 + row) * kD + c * 8);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  if (t_begin < t_end) LoadTile<kD>(s_k, s_v, kc, vc, row_stride, t_begin, r.lo, r.hi);
  CpAsyncCommit();

  float acc[kD / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows lane/4 and lane/4 + 8
  for (int t = t_begin, buf = 0; t < t_end; ++t, buf ^= 1) {
    CpAsyncWaitAll();
    __syncthreads();  // tile t is visible, and every warp is done with the other buffer
    if (t + 1 < t_end) {
      LoadTile<kD>(s_k + (buf ^ 1) * kTile, s_v + (buf ^ 1) * kTile, kc, vc, row_stride, t + 1,
                   r.lo, r.hi);
    }
    CpAsyncCommit();
    const int w_off = warp * 16 * kStride;  // the warp's 16 keys of the tile
    float s[2][4] = {};
    MmaABt<kD>(s, s_q, s_k + buf * kTile + w_off);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = t * kKeys + warp * 16 + nt * 8 + (lane % 4) * 2 + e % 2;
        const float x = j >= r.lo && j < r.hi ? s[nt][e] * p.scale_log2 : -INFINITY;
        s[nt][e] = x;
        mx[e / 2] = fmaxf(mx[e / 2], x);
      }
    }
    float base[2], corr[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m_new = fmaxf(m[i], QuadMax(mx[i]));
      base[i] = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet stays at 0
      corr[i] = exp2f(m[i] - base[i]);
      m[i] = m_new;
      l[i] *= corr[i];
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = exp2f(s[nt][e] - base[e / 2]);
        l[e / 2] += s[nt][e];
      }
    }
#pragma unroll
    for (int c = 0; c < kD / 8; ++c) {
      acc[c][0] *= corr[0];
      acc[c][1] *= corr[0];
      acc[c][2] *= corr[1];
      acc[c][3] *= corr[1];
    }
    MmaPB<kD>(acc, s, s_v + buf * kTile + w_off);
  }

  // Merge the warps' rows in warp order, through shared memory (the tiles' space).
  CpAsyncWaitAll();
  __syncthreads();
  float* s_ow = s_o + warp * kRows * kOStride;
#pragma unroll
  for (int c = 0; c < kD / 8; ++c) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s_ow[(lane / 4 + 8 * (e / 2)) * kOStride + c * 8 + (lane % 4) * 2 + e % 2] = acc[c][e];
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float sum = QuadSum(l[i]);
    if (lane % 4 == 0) {
      s_ml[(warp * kRows + lane / 4 + 8 * i) * 2] = m[i];
      s_ml[(warp * kRows + lane / 4 + 8 * i) * 2 + 1] = sum;
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < rows * kD; idx += kThreads) {
    const int row = idx / kD, d = idx % kD, h = h0 + row;
    float mx = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_ml[(w * kRows + row) * 2]);
    const float base = mx == -INFINITY ? 0.0f : mx;
    float sum = 0.0f, out = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      const float f = exp2f(s_ml[(w * kRows + row) * 2] - base);
      sum += s_ml[(w * kRows + row) * 2 + 1] * f;
      out += s_o[(w * kRows + row) * kOStride + d] * f;
    }
    const int64_t bh = static_cast<int64_t>(b) * p.H + h;
    if (p.splits == 1) {
      p.o[bh * kD + d] = ToB(Finalize(mx, sum, out, p.sinks, h));
    } else {
      const int64_t part = static_cast<int64_t>(split) * p.B * p.H + bh;
      p.part_o[part * kD + d] = out;
      if (d == 0) {
        p.part_ml[part * 2] = mx;
        p.part_ml[part * 2 + 1] = sum;
      }
    }
  }
}

// grid (B*H), kD threads: o row (b, h) from its used splits' partials, merged in split order.
template <int kD>
__global__ void __launch_bounds__(kD) DecodeMergeKernel(DecodeParams p) {
  const int b = blockIdx.x / p.H, h = blockIdx.x % p.H, d = threadIdx.x;
  const int used = SequenceTiles(p, b).used;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h, stride = static_cast<int64_t>(p.B) * p.H;
  float mx = -INFINITY;
  for (int c = 0; c < used; ++c) mx = fmaxf(mx, p.part_ml[(c * stride + bh) * 2]);
  const float base = mx == -INFINITY ? 0.0f : mx;
  float sum = 0.0f, out = 0.0f;
  for (int c = 0; c < used; ++c) {
    const int64_t part = c * stride + bh;
    const float f = exp2f(p.part_ml[part * 2] - base);
    sum += p.part_ml[part * 2 + 1] * f;
    out += p.part_o[part * kD + d] * f;
  }
  p.o[bh * kD + d] = ToB(Finalize(mx, sum, out, p.sinks, h));
}

// Blocks of DecodeAttentionKernel<kD> resident on one SM of the current device's kind
// (asked once per process: every device of a box is alike).
template <int kD>
int ResidentBlocksPerSm() {
  static const int blocks = [] {
    int n = 0;
    MT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, DecodeAttentionKernel<kD>,
                                                                kThreads, DecodeSmemBytes<kD>()));
    return n;
  }();
  return blocks;
}

template <int kD>
void LaunchDecode(DecodeParams p, int64_t blocks_per_split, int64_t partial_floats,
                  cudaStream_t stream) {
  constexpr int kBytes = DecodeSmemBytes<kD>();
  MT_CUDA_CHECK(cudaFuncSetAttribute(DecodeAttentionKernel<kD>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  // Splits: as many as keep one wave of resident blocks, no more than the longest visible
  // range has pairs of tiles, and no more than the partials hold.
  int device = 0, sms = 0;
  MT_CUDA_CHECK(cudaGetDevice(&device));
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t resident = static_cast<int64_t>(sms) * ResidentBlocksPerSm<kD>();
  MT_CHECK_MSG(resident > 0, "DecodeAttention: no block of %d bytes fits on an SM", kBytes);
  const int64_t span = p.window > 0 ? p.window : p.max_len;  // keys one row may see
  const int64_t max_tiles = (span + kKeys - 1) / kKeys + (p.window > 0 ? 1 : 0);
  const int64_t row_floats = static_cast<int64_t>(p.B) * p.H * (kD + 2);
  int64_t splits = std::min<int64_t>(resident / blocks_per_split, kMaxSplits);
  splits = std::min(splits, (max_tiles + kMinSplitTiles - 1) / kMinSplitTiles);
  splits = std::min(splits, p.part_o != nullptr ? partial_floats / row_floats : 1);
  p.splits = static_cast<int>(std::max<int64_t>(splits, 1));
  if (p.splits > 1) p.part_ml = p.part_o + static_cast<int64_t>(p.splits) * p.B * p.H * kD;
  const dim3 grid(p.splits, p.KV * p.head_tiles, p.B);
  DecodeAttentionKernel<kD><<<grid, kThreads, kBytes, stream>>>(p);
  MT_CUDA_LAUNCH_CHECK();
  if (p.splits > 1) {
    DecodeMergeKernel<kD><<<static_cast<unsigned>(p.B) * p.H, kD, 0, stream>>>(p);
    MT_CUDA_LAUNCH_CHECK();
  }
}

// ---- KV cache write ----

// One thread per 16 bytes of a token's k (and the same of its v).
__global__ void KvCacheWriteKernel(bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                   const bf16* __restrict__ k, const bf16* __restrict__ v,
                                   const int32_t* __restrict__ seq_slot,
                                   const int32_t* __restrict__ position, int64_t n,
                                   int64_t row_chunks, int64_t max_len) {
  const int64_t total = n * row_chunks;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx / row_chunks, c = idx % row_chunks;
    const int64_t slot = seq_slot[i], pos = position[i];
    if (slot < 0 || pos < 0 || pos >= max_len) continue;  // outside the cache: not written
    const int64_t dst = ((slot * max_len + pos) * row_chunks + c) * 8;
    *reinterpret_cast<uint4*>(k_cache + dst) = *reinterpret_cast<const uint4*>(k + idx * 8);
    *reinterpret_cast<uint4*>(v_cache + dst) = *reinterpret_cast<const uint4*>(v + idx * 8);
  }
}

void CheckAligned(const char* op, std::initializer_list<const void*> tensors) {
  for (const void* t : tensors) {
    MT_CHECK_MSG(Aligned16(t), "%s: tensor at %p is not 16-byte aligned", op, t);
  }
}

}  // namespace

void KvCacheWrite(bf16* k_cache, bf16* v_cache, const bf16* k, const bf16* v,
                  const int32_t* seq_slot, const int32_t* position, int64_t n, int64_t KV,
                  int64_t D, int64_t max_len, cudaStream_t stream) {
  MT_CHECK_MSG(KV > 0 && D > 0 && KV * D % 8 == 0 && max_len > 0 && n >= 0,
               "KvCacheWrite: %lld kv heads x head_dim %lld must be a positive multiple of 8",
               static_cast<long long>(KV), static_cast<long long>(D));
  CheckAligned("KvCacheWrite", {k_cache, v_cache, k, v});
  if (n == 0) return;
  constexpr int kBlock = 256;
  const int64_t chunks = n * KV * D / 8;
  const int64_t blocks = std::min<int64_t>((chunks + kBlock - 1) / kBlock, int64_t{1} << 20);
  KvCacheWriteKernel<<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(
      k_cache, v_cache, k, v, seq_slot, position, n, KV * D / 8, max_len);
  MT_CUDA_LAUNCH_CHECK();
}

void DecodeAttention(bf16* o, const bf16* q, const bf16* k_cache, const bf16* v_cache,
                     const int32_t* seq_slot, const int32_t* length, const bf16* sinks,
                     int64_t window, int64_t B, int64_t H, int64_t KV, int64_t D, int64_t max_len,
                     float* partials, int64_t partial_floats, cudaStream_t stream) {
  MT_CHECK_MSG(H > 0 && KV > 0 && H % KV == 0,
               "DecodeAttention: %lld query heads must be a positive multiple of %lld kv heads",
               static_cast<long long>(H), static_cast<long long>(KV));
  MT_CHECK_MSG(D == 64 || D == 128, "DecodeAttention: head_dim %lld; the kernel takes 64 or 128",
               static_cast<long long>(D));
  MT_CHECK_MSG(window >= 0, "DecodeAttention: sliding window %lld is negative (0 means none)",
               static_cast<long long>(window));
  const int64_t group = H / KV, head_tiles = (group + kRows - 1) / kRows;
  MT_CHECK_MSG(B >= 0 && B <= 65535 && KV * head_tiles <= 65535 && max_len > 0 &&
                   max_len <= INT32_MAX && H <= 65535,
               "DecodeAttention: %lld sequences x %lld heads, %lld keys exceed the kernel's grid",
               static_cast<long long>(B), static_cast<long long>(H),
               static_cast<long long>(max_len));
  CheckAligned("DecodeAttention", {o, q, k_cache, v_cache});
  if (B == 0) return;
  DecodeParams p{};
  p.o = o;
  p.q = q;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.seq_slot = seq_slot;
  p.length = length;
  p.sinks = sinks;
  p.part_o = partials;
  p.B = static_cast<int>(B);
  p.H = static_cast<int>(H);
  p.KV = static_cast<int>(KV);
  p.group = static_cast<int>(group);
  p.head_tiles = static_cast<int>(head_tiles);
  p.window = window >= max_len ? 0 : static_cast<int>(window);  // hides no key: none
  p.max_len = static_cast<int>(max_len);
  p.scale_log2 = kLog2e / sqrtf(static_cast<float>(D));
  const int64_t blocks_per_split = B * KV * head_tiles;
  if (D == 64) {
    LaunchDecode<64>(p, blocks_per_split, partial_floats, stream);
  } else {
    LaunchDecode<128>(p, blocks_per_split, partial_floats, stream);
  }
}

}  // namespace megatrain::cuda
