#include "bench/step_schedule.h"

#include <algorithm>
#include <numeric>

namespace megatrain {
namespace {

// The optimizer over one step's gradient pieces, preemptive, always on the lowest unit's
// lowest piece that has landed. Pieces are made known as their landing times are (in
// download order); Advance() runs it only as far as the pieces known allow, which is
// exact for every time before the next piece lands.
class Optimizer {
 public:
  Optimizer(const std::vector<ScheduleUnit>& units, double start) : t_(start) {
    for (size_t u = 0; u < units.size(); ++u) {
      first_.push_back(left_.size());
      for (int64_t p = 0; p < units[u].pieces; ++p) {
        left_.push_back(units[u].optimizer / static_cast<double>(units[u].pieces));
      }
    }
    land_.assign(left_.size(), 0);
    known_.assign(left_.size(), false);
    done_.assign(left_.size(), -1);
  }
  // Piece `p` of unit `u` lands at `t`.
  void Land(size_t u, int64_t p, double t) {
    land_[first_[u] + p] = t;
    known_[first_[u] + p] = true;
  }
  // Runs until `k` pieces are done (k <= the pieces known); returns when the k-th was.
  double Advance(size_t k) {
    while (completions_.size() < k) Step();
    return completions_[k - 1];
  }
  // Every piece landed: when each unit's last piece is done; *end when the optimizer is free.
  std::vector<double> Finish(double* end) {
    Advance(left_.size());
    std::vector<double> unit_done;
    for (size_t u = 0; u < first_.size(); ++u) {
      const size_t last = u + 1 < first_.size() ? first_[u + 1] : left_.size();
      double d = 0;
      for (size_t q = first_[u]; q < last; ++q) d = std::max(d, done_[q]);
      unit_done.push_back(d);
    }
    *end = t_;
    return unit_done;
  }

 private:
  void Step() {
    const size_t n = left_.size();
    size_t pick = n;
    double next_landing = 0;
    bool any_later = false;
    for (size_t q = 0; q < n; ++q) {
      if (!known_[q] || done_[q] >= 0) continue;
      if (land_[q] <= t_) {
        pick = q;
        break;
      }
      next_landing = any_later ? std::min(next_landing, land_[q]) : land_[q];
      any_later = true;
    }
    if (pick == n) {  // nothing landed yet: idle until the next piece does
      t_ = next_landing;
      return;
    }
    // Until it is done, or a lower piece lands and takes over.
    double until = t_ + left_[pick];
    for (size_t q = 0; q < pick; ++q) {
      if (known_[q] && done_[q] < 0) until = std::min(until, land_[q]);
    }
    const bool completes = until >= t_ + left_[pick];
    left_[pick] -= until - t_;
    t_ = until;
    if (completes) {
      done_[pick] = t_;
      completions_.push_back(t_);
    }
  }

  double t_;
  std::vector<size_t> first_;  // each unit's first piece
  std::vector<double> left_, land_, done_;  // done: -1 until done
  std::vector<bool> known_;
  std::vector<double> completions_;  // in time order
};

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
    if (times.slab_elements > 0) {
      u.pieces = std::max<int64_t>(1, (unit_elements[i] + times.slab_elements - 1) /
                                          times.slab_elements);
    }
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
  const bool slabs_bind = stages.slabs > 0 && !stages.clipping;
  const size_t buffers = static_cast<size_t>(stages.device_grad_buffers);
  for (int s = 0; s < kSteps; ++s) {
    double t = gpu;
    for (size_t i = 0; i < n; ++i) {
      t = std::max(t, ready[i]);
      if (i == 0) starts.push_back(t);
      t += units[i].forward;
    }
    // The backward from the top; each unit's gradient over D2H piece by piece, each piece
    // into a free slab (a slab frees when its piece is updated; with clipping the plan
    // holds every gradient, so the slabs do not bind); a unit's backward once the gradient
    // device_grad_buffers above it has crossed.
    Optimizer opt(units, optimizer);
    std::vector<double> crossed(n, 0);  // when each unit's gradient has crossed
    size_t pieces_down = 0;
    for (size_t i = n; i-- > 0;) {  // the head's gradient first, the embedding's last
      // (Layers only, units 1 .. n - 2: the embedding and the head have buffers of their own.)
      if (buffers > 0 && i >= 1 && i + buffers + 2 <= n) t = std::max(t, crossed[i + buffers]);
      t += units[i].backward;
      const double piece = units[i].download / static_cast<double>(units[i].pieces);
      for (int64_t p = 0; p < units[i].pieces; ++p, ++pieces_down) {
        double start = std::max(d2h, t);
        if (slabs_bind && pieces_down >= static_cast<size_t>(stages.slabs)) {
          start = std::max(start, opt.Advance(pieces_down - stages.slabs + 1));
        }
        d2h = start + piece;
        if (!stages.clipping) opt.Land(i, p, d2h);
      }
      crossed[i] = d2h;
    }
    gpu = t;
    if (stages.clipping) {  // every update waits for the norm over every gradient
      const double all = *std::max_element(crossed.begin(), crossed.end()) + stages.norm;
      for (size_t i = 0; i < n; ++i) {
        for (int64_t p = 0; p < units[i].pieces; ++p) opt.Land(i, p, all);
      }
    }
    const std::vector<double> done = opt.Finish(&optimizer);
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
