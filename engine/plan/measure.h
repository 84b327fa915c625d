// Helpers of the rate measurements (machine_profile.cc, bench/machine_bench.cc): device
// buffers filled with random values (matmuls run faster on zeros) and event timing.
#pragma once

#include <cstdint>

#include "engine/common/backend.h"
#include "engine/common/dtype.h"

namespace megatrain {

// Fills n elements of `dtype` at device `dst` with uniform values in [-1, 1): a 4 MiB
// random pattern, repeated. Synchronous (the backend is synced after each copy).
void FillRandom(Backend* be, void* dst, int64_t n, DType dtype, uint64_t seed);

// Seconds per call of `work` (enqueued on `stream`), timed with events over `reps` calls
// after one warm-up call.
template <typename F>
double TimeOnStream(Backend* be, StreamId stream, int reps, F&& work) {
  work();
  Event start(be), end(be);
  be->Record(start.get(), stream);
  for (int i = 0; i < reps; ++i) work();
  be->Record(end.get(), stream);
  be->EventSync(end.get());
  return be->ElapsedSeconds(start.get(), end.get()) / reps;
}

}  // namespace megatrain
