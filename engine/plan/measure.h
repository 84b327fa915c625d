// Helpers of the rate measurements (machine_profile.cc, bench/machine_bench.cc): device
// buffers filled with random values (matmuls run faster on zeros), event timing, and a
// device held at its power limit.
//
// A GPU that draws its power limit under a long load settles at a lower clock within about
// a second, and a training step is such a load: on the H200 (700 W) the SM clock sits at
// 1,515-1,560 MHz through a dense step against 1,980 in short bursts, and a bf16 GEMM that
// runs 800 TFLOP/s for a few milliseconds runs 700 held (bench/results/h200-2026-12-03c).
// Rates the planner predicts steps with are measured held.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
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

// Calls made by TimeOnStreamFor: in all, and in the timing whose rate it returned.
struct TimedCalls {
  int64_t made = 0;
  int64_t timed = 0;
};

// Seconds per call of `work`, timed over at least `reps` calls and `min_seconds` of device
// time: a first timing of `reps` calls sizes the next, and a timing that still fell short
// (the first calls ran slower than the rest: a cold cache, a clock still rising) sizes
// another, up to four.
template <typename F>
double TimeOnStreamFor(Backend* be, StreamId stream, int reps, double min_seconds, F&& work,
                       TimedCalls* calls = nullptr) {
  double per_call = TimeOnStream(be, stream, reps, work);
  TimedCalls made{1 + reps, reps};
  for (int round = 0; round < 4 && per_call > 0 && per_call * made.timed < min_seconds;
       ++round) {
    // 5% over the estimate, so that a timing as fast as the last one covers min_seconds.
    const int more = static_cast<int>(std::min(1e6, std::ceil(1.05 * min_seconds / per_call)));
    per_call = TimeOnStream(be, stream, more, work);
    made.made += 1 + more;
    made.timed = more;
  }
  if (calls != nullptr) *calls = made;
  return per_call;
}

// Runs `work` back to back on `stream` for `seconds` of wall time (none for 0), waiting for
// each batch of calls before the next, so that the device settles at the clock it holds
// under load; returns the calls made.
template <typename F>
int64_t HoldBusy(Backend* be, StreamId stream, double seconds, F&& work) {
  if (!(seconds > 0)) return 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  int64_t calls = 0;
  Event done(be);
  do {
    for (int i = 0; i < 4; ++i, ++calls) work();
    be->Record(done.get(), stream);
    be->EventSync(done.get());
  } while (std::chrono::steady_clock::now() < until);
  return calls;
}

}  // namespace megatrain
