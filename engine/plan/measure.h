// Helpers of the rate measurements (machine_profile.cc, bench/machine_bench.cc): device
// buffers filled with random values (matmuls run faster on zeros), event timing, and a
// device held at its power limit.
//
// A GPU that draws its power limit under a long load settles at a lower clock within about
// a second, and a training step is such a load: on the H200 (700 W) the SM clock sits at
// 1,515-1,560 MHz through a dense step against 1,980 in short bursts, and a bf16 GEMM that
// runs 800 TFLOP/s for a few milliseconds runs 700 held.
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

// Calls made by TimeOnStreamFor: in all, and in the timings whose rate it returned.
struct TimedCalls {
  int64_t made = 0;
  int64_t timed = 0;
};

// Seconds per call of `work`, timed over at least `reps` calls and `min_seconds` of device
// time. A first timing of `reps` calls sizes the next; timings are then added until they
// cover min_seconds, each sized by the rate so far for the time still missing (the first
// calls may run slower than the rest, a cold cache or a clock still rising, and a CPU
// backend's are as noisy as the machine is busy). The rate returned is theirs together.
template <typename F>
double TimeOnStreamFor(Backend* be, StreamId stream, int reps, double min_seconds, F&& work,
                       TimedCalls* calls = nullptr) {
  double per_call = TimeOnStream(be, stream, reps, work);
  TimedCalls made{1 + reps, reps};
  if (per_call > 0 && per_call * reps < min_seconds) {
    double seconds = 0;
    int64_t timed = 0;
    // At most 64 timings: a device whose timer reads 0 adds nothing.
    for (int round = 0; round < 64 && seconds < min_seconds; ++round) {
      const double rate = seconds > 0 ? seconds / timed : per_call;
      const double left = std::ceil((min_seconds - seconds) / rate);
      const int n = static_cast<int>(std::clamp(left, 1.0, 1e6));
      seconds += TimeOnStream(be, stream, n, work) * n;
      timed += n;
      made.made += 1 + n;
    }
    per_call = seconds / timed;
    made.timed = timed;
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
