// Bias of a linear layer: add it to every output row (forward), sum dout's columns into
// the fp32 bias gradient (backward). The grouped forms are the experts' biases over rows
// sorted by expert (offsets (E+1) on the device): the same kernels, with the row range and
// the bias row taken from the offsets, so one launch serves every expert.
//
// BiasGrad is a column reduction over up to millions of rows, with no atomics, so that its
// result does not vary from run to run. A block owns kColLanes column vectors (x) over all
// the rows, in kRowLanes row lanes (y): a warp reads 4 adjacent 16-byte vectors of 8 rows
// (two whole 32-byte sectors per row), each lane keeps kInFlight rows' loads in flight and
// adds them in row order, a shared-memory pass folds the lanes in lane order, and one
// thread per column adds the sum to dbias. Narrow blocks give a qkv bias (OC = 4608 in a
// 7B) 144 of them, about one per SM.
//
// Shapes: out, dout (N, OC) bf16; bias (OC) bf16; dbias (OC) f32. Grouped: N = R rows,
// bias (E, OC) bf16, dbias (E, OC) f32, offsets (E+1) int32.
#include <algorithm>
#include <cstdint>

#include "engine/common/check.h"
#include "engine/kernels/cuda/common.cuh"
#include "engine/kernels/cuda/ops.h"

namespace megatrain::cuda {
namespace {

constexpr int64_t kMaxRowBlocks = 1 << 15;
constexpr int kColLanes = 4;   // column vectors per BiasGrad block
constexpr int kRowLanes = 64;  // rows summed side by side per BiasGrad block
constexpr int kInFlight = 8;   // rows each row lane loads before adding them
constexpr int kGradThreads = kColLanes * kRowLanes;

// The expert whose rows hold row r: the last e < E with offsets[e] <= r (experts without
// rows are passed over). REQUIRES offsets[0] <= r < offsets[E].
__device__ __forceinline__ int64_t ExpertOfRow(const int32_t* offsets, int64_t E, int64_t r) {
  int64_t lo = 0, hi = E;  // offsets[lo] <= r < offsets[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (offsets[mid] <= r) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Rows on grid.x (grid-strided), tiles of blockDim.x column vectors on grid.y. With
// offsets, row r adds bias row ExpertOfRow(r); without, the one bias row.
template <int kWidth>
__global__ void AddBiasKernel(bf16* out, const bf16* bias, const int32_t* offsets, int64_t E,
                              int64_t N, int64_t OC) {
  const int64_t vecs = OC / kWidth;
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    bf16* y = out + r * OC;
    const bf16* b = offsets == nullptr ? bias : bias + ExpertOfRow(offsets, E, r) * OC;
    for (int64_t v = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs;
         v += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      float yv[kWidth], bv[kWidth];
      Load<kWidth>(y + v * kWidth, yv);
      Load<kWidth>(b + v * kWidth, bv);
#pragma unroll
      for (int i = 0; i < kWidth; ++i) yv[i] += bv[i];
      Store<kWidth>(y + v * kWidth, yv);
    }
  }
}

// Block (kColLanes, kRowLanes) sums every row of the kColLanes column vectors starting at
// blockIdx.x * kColLanes; row lane y takes rows y, y + kRowLanes, ... of its range in that
// order. The range is all N rows, or with offsets expert blockIdx.y's rows, into dbias row
// blockIdx.y; an expert without rows writes nothing.
template <int kWidth>
__global__ void __launch_bounds__(kGradThreads)
    BiasGradKernel(float* dbias, const bf16* dout, const int32_t* offsets, int64_t N, int64_t OC) {
  // Element i of lane x's vector at [y][i * kColLanes + x]: the fold reads rows of it
  // conflict-free.
  __shared__ float partial[kRowLanes][kColLanes * kWidth];
  int64_t r_begin = 0, r_end = N;
  if (offsets != nullptr) {
    r_begin = offsets[blockIdx.y];
    r_end = offsets[blockIdx.y + 1];
    dbias += static_cast<int64_t>(blockIdx.y) * OC;
  }
  if (r_begin == r_end) return;  // the whole block: no thread reaches the barrier below
  const int64_t vecs = OC / kWidth;
  const int64_t v = static_cast<int64_t>(blockIdx.x) * kColLanes + threadIdx.x;
  float acc[kWidth] = {};
  if (v < vecs) {
    for (int64_t r0 = r_begin + threadIdx.y; r0 < r_end; r0 += kInFlight * kRowLanes) {
      float xv[kInFlight][kWidth];
#pragma unroll
      for (int k = 0; k < kInFlight; ++k) {
        const int64_t r = r0 + k * kRowLanes;
        if (r < r_end) Load<kWidth>(dout + r * OC + v * kWidth, xv[k]);
      }
#pragma unroll
      for (int k = 0; k < kInFlight; ++k) {
        if (r0 + k * kRowLanes < r_end) {
#pragma unroll
          for (int i = 0; i < kWidth; ++i) acc[i] += xv[k][i];
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kWidth; ++i) partial[threadIdx.y][i * kColLanes + threadIdx.x] = acc[i];
  __syncthreads();
  // Thread f folds slot f over the row lanes; slot (i, x) is column (tile + x) * kWidth + i.
  const int f = threadIdx.y * kColLanes + threadIdx.x;
  if (f < kColLanes * kWidth) {
    const int i = f / kColLanes, x = f % kColLanes;
    const int64_t vx = static_cast<int64_t>(blockIdx.x) * kColLanes + x;
    if (vx < vecs) {
      float sum = 0.0f;
      for (int y = 0; y < kRowLanes; ++y) sum += partial[y][f];
      dbias[vx * kWidth + i] += sum;  // this block is the column's only writer
    }
  }
}

template <int kWidth>
void LaunchAddBias(bf16* out, const bf16* bias, const int32_t* offsets, int64_t E, int64_t N,
                   int64_t OC, cudaStream_t stream) {
  const int64_t vecs = OC / kWidth;
  const int threads =
      static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, (vecs + 31) / 32 * 32)));
  const int64_t tiles = std::min<int64_t>((vecs + threads - 1) / threads, 65535);
  const dim3 grid(static_cast<unsigned>(std::min(N, kMaxRowBlocks)), static_cast<unsigned>(tiles));
  AddBiasKernel<kWidth><<<grid, threads, 0, stream>>>(out, bias, offsets, E, N, OC);
  MT_CUDA_LAUNCH_CHECK();
}

// groups: 1 without offsets, else E (grid.y, one per expert).
template <int kWidth>
void LaunchBiasGrad(float* dbias, const bf16* dout, const int32_t* offsets, int64_t groups,
                    int64_t N, int64_t OC, cudaStream_t stream) {
  const int64_t col_tiles = (OC / kWidth + kColLanes - 1) / kColLanes;
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(groups));
  BiasGradKernel<kWidth>
      <<<grid, dim3(kColLanes, kRowLanes), 0, stream>>>(dbias, dout, offsets, N, OC);
  MT_CUDA_LAUNCH_CHECK();
}

// The vector path (8 bf16 per access) when OC % 8 == 0 and the bases are 16-byte aligned:
// then so is every row of out, dout and (grouped) bias.
void AddBiasRows(bf16* out, const bf16* bias, const int32_t* offsets, int64_t E, int64_t N,
                 int64_t OC, cudaStream_t stream) {
  if (OC % 8 == 0 && Aligned16(out) && Aligned16(bias)) {
    LaunchAddBias<8>(out, bias, offsets, E, N, OC, stream);
  } else {
    LaunchAddBias<1>(out, bias, offsets, E, N, OC, stream);
  }
}

void BiasGradRows(float* dbias, const bf16* dout, const int32_t* offsets, int64_t groups, int64_t N,
                  int64_t OC, cudaStream_t stream) {
  if (OC % 8 == 0 && Aligned16(dout)) {
    LaunchBiasGrad<8>(dbias, dout, offsets, groups, N, OC, stream);
  } else {
    LaunchBiasGrad<1>(dbias, dout, offsets, groups, N, OC, stream);
  }
}

}  // namespace

void AddBias(bf16* out, const bf16* bias, int64_t N, int64_t OC, cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return;
  AddBiasRows(out, bias, nullptr, 1, N, OC, stream);
}

void BiasGrad(float* dbias, const bf16* dout, int64_t N, int64_t OC, cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return;
  BiasGradRows(dbias, dout, nullptr, 1, N, OC, stream);
}

void AddGroupedBias(bf16* out, const bf16* bias, const int32_t* offsets, int64_t E, int64_t R,
                    int64_t OC, cudaStream_t stream) {
  if (R <= 0 || OC <= 0) return;
  MT_CHECK_MSG(E >= 1, "AddGroupedBias: %lld experts", static_cast<long long>(E));
  AddBiasRows(out, bias, offsets, E, R, OC, stream);
}

void GroupedBiasGrad(float* dbias, const bf16* dout, const int32_t* offsets, int64_t E, int64_t OC,
                     cudaStream_t stream) {
  if (E <= 0 || OC <= 0) return;
  MT_CHECK_MSG(E <= 65535, "GroupedBiasGrad: %lld experts, at most 65535 (grid.y)",
               static_cast<long long>(E));
  BiasGradRows(dbias, dout, offsets, E, 0, OC, stream);
}

}  // namespace megatrain::cuda
