#include "engine/plan/step_schedule.h"

#include <algorithm>
#include <numeric>

namespace megatrain {
namespace {

// The optimizer's pass over one step's gradients, from `start` (when it is free): the
// lowest unit landed first, preempted when a lower one lands. Returns when each unit's
// update is done.
std::vector<double> UpdateTimes(const std::vector<ScheduleUnit>& units,
                                const std::vector<double>& landed, double* start) {
  const size_t n = units.size();
  std::vector<double> left(n), done(n, 0);
  std::vector<bool> finished(n, false);
  for (size_t i = 0; i < n; ++i) left[i] = units[i].optimizer;
  double t = *start;
  for (size_t remaining = n; remaining > 0;) {
    size_t pick = n;
    double next_landing = 0;
    bool any_later = false;
    for (size_t i = 0; i < n; ++i) {
      if (finished[i]) continue;
      if (landed[i] <= t) {
        pick = i;
        break;
      }
      next_landing = any_later ? std::min(next_landing, landed[i]) : landed[i];
      any_later = true;
    }
    if (pick == n) {  // nothing landed yet: idle until the next gradient does
      t = next_landing;
      continue;
    }
    // Until it is done, or a lower unit lands and takes over.
    double until = t + left[pick];
    for (size_t i = 0; i < pick; ++i) {
      if (!finished[i]) until = std::min(until, landed[i]);
    }
    const bool completes = until >= t + left[pick];
    left[pick] -= until - t;
    t = until;
    if (completes) {
      finished[pick] = true;
      done[pick] = t;
      --remaining;
    }
  }
  *start = t;
  return done;
}

}  // namespace

StepStages StackStages(const std::vector<int64_t>& unit_elements, const StackTimes& times) {
  StepStages s;
  const size_t n = unit_elements.size();
  const double layers = n > 2 ? static_cast<double>(n - 2) : 1.0;
  for (size_t i = 0; i < n; ++i) {
    const double elements = static_cast<double>(unit_elements[i]);
    ScheduleUnit u;
    if (i + 1 == n) {
      u.forward = times.head;
    } else if (i > 0) {
      u.forward = times.layers_forward / layers;
      u.backward = times.layers_backward / layers;
    }
    u.optimizer = elements * times.optimizer_per_element;
    u.download = elements * times.download_per_element;
    u.upload = elements * times.upload_per_element;
    s.units.push_back(u);
  }
  return s;
}

double ScheduleStepSeconds(const StepStages& stages) {
  const std::vector<ScheduleUnit>& units = stages.units;
  const size_t n = units.size();
  if (n == 0) return 0;
  // Enough steps for the start-up to wash out; the period is averaged over the last ones
  // (a schedule may alternate between two step lengths).
  constexpr int kSteps = 32, kMeasured = 8;
  std::vector<double> ready(n, 0.0), starts;
  double gpu = 0, d2h = 0, optimizer = 0, h2d = 0;
  for (int s = 0; s < kSteps; ++s) {
    double t = gpu;
    for (size_t i = 0; i < n; ++i) {
      t = std::max(t, ready[i]);
      if (i == 0) starts.push_back(t);
      t += units[i].forward;
    }
    std::vector<double> landed(n);
    for (size_t i = n; i-- > 0;) {  // the head's gradient first, the embedding's last
      t += units[i].backward;
      d2h = std::max(d2h, t) + units[i].download;
      landed[i] = d2h;
    }
    gpu = t;
    if (stages.clipping) {  // every update waits for the norm over every gradient
      const double all = *std::max_element(landed.begin(), landed.end()) + stages.norm;
      std::fill(landed.begin(), landed.end(), all);
    }
    const std::vector<double> done = UpdateTimes(units, landed, &optimizer);
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return done[a] < done[b]; });
    for (size_t i : order) {
      h2d = std::max(h2d, done[i]) + units[i].upload;
      ready[i] = h2d;
    }
  }
  return (starts[kSteps - 1] - starts[kSteps - 1 - kMeasured]) / kMeasured;
}

}  // namespace megatrain
