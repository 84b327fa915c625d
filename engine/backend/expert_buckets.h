// The row count at which the CUDA backend chooses an expert GEMM's algorithm (ExpertGemms,
// expert_gemms.h): an algorithm is chosen once per bucket and kept, so the bucket bounds how
// many choices a run makes while routing changes every step, and how far from its own size
// an expert's GEMM runs an algorithm chosen for. Plain C++ (no CUDA), so that it is tested
// everywhere.
#pragma once

#include <cstdint>

namespace megatrain {

// The next power of two up to 128 rows (at least 16), then the next eighth of an octave:
// at most 8 buckets an octave, each within 1/8 above the rows it serves.
inline int64_t ExpertRowBucket(int64_t rows) {
  int64_t b = 16;
  while (b < rows) b *= 2;
  if (b <= 128) return b;
  const int64_t step = b / 16;  // the octave (b/2, b] in 8 steps
  return (rows + step - 1) / step * step;
}

}  // namespace megatrain
