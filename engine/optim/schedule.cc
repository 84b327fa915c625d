// LR schedules. The arithmetic follows transformers/optimization.py expression by
// expression (in double) so our numbers match a Hugging Face run's.
#include "engine/optim/schedule.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "engine/common/check.h"

namespace megatrain {
namespace {

constexpr double kPi = 3.14159265358979323846;

}  // namespace

double LearningRate(const ScheduleOptions& options, int64_t step) {
  MT_CHECK(step >= 0);
  if (step < options.warmup_steps) {
    return options.lr * (static_cast<double>(step) /
                         static_cast<double>(std::max<int64_t>(1, options.warmup_steps)));
  }
  const double decay_steps =
      static_cast<double>(std::max<int64_t>(1, options.total_steps - options.warmup_steps));
  double factor = 1.0;
  switch (options.type) {
    case ScheduleType::kConstant:
      return options.lr;
    case ScheduleType::kLinear:
      factor = std::max(0.0, static_cast<double>(options.total_steps - step) / decay_steps);
      break;
    case ScheduleType::kCosine: {
      const double progress =
          std::min(1.0, static_cast<double>(step - options.warmup_steps) / decay_steps);
      factor = std::max(0.0, 0.5 * (1.0 + std::cos(kPi * progress)));
      break;
    }
  }
  // With r = 0 this is exactly Hugging Face's lr * factor.
  const double r = options.min_lr_ratio;
  return options.lr * (r + (1.0 - r) * factor);
}

const char* ScheduleTypeName(ScheduleType type) {
  switch (type) {
    case ScheduleType::kConstant:
      return "constant";
    case ScheduleType::kLinear:
      return "linear";
    case ScheduleType::kCosine:
      return "cosine";
  }
  return "?";
}

}  // namespace megatrain
