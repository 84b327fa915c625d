// Learning-rate schedules with linear warmup, as Hugging Face transformers'
// get_{constant,linear,cosine}_schedule_with_warmup, plus an optional floor.
//
// One deliberate difference: after total_steps the cosine schedule stays at its floor
// instead of rising again (Hugging Face's cosine keeps going round the cosine).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace megatrain {

enum class ScheduleType { kConstant, kLinear, kCosine };

struct ScheduleOptions {
  ScheduleType type = ScheduleType::kConstant;
  double lr = 0.0;            // peak learning rate
  int64_t warmup_steps = 0;   // steps of linear warmup from 0 to lr
  int64_t total_steps = 0;    // linear / cosine reach their floor here
  double min_lr_ratio = 0.0;  // floor of the decay, as a fraction of lr, in [0, 1]
};

// The learning rate of the step about to run; step is its 0-based index.
//   warmup (step < warmup_steps): lr * step / max(1, warmup_steps)
//   constant: lr
//   linear:   factor = max(0, (total - step) / max(1, total - warmup))
//   cosine:   progress = min(1, (step - warmup) / max(1, total - warmup))
//             factor = max(0, 0.5 * (1 + cos(pi * progress)))
//   linear and cosine return lr * (min_lr_ratio + (1 - min_lr_ratio) * factor).
// With min_lr_ratio = 0 these are exactly Hugging Face's values (cosine: up to
// total_steps). REQUIRES: options valid (ValidateScheduleOptions), step >= 0.
double LearningRate(const ScheduleOptions& options, int64_t step);

// InvalidArgument naming the field when lr < 0, warmup_steps < 0, total_steps < 0, or
// min_lr_ratio is outside [0, 1].
[[nodiscard]] absl::Status ValidateScheduleOptions(const ScheduleOptions& options);

// "constant", "linear" or "cosine"; anything else is InvalidArgument listing those.
[[nodiscard]] absl::StatusOr<ScheduleType> ParseScheduleType(absl::string_view name);

// The name ParseScheduleType accepts for `type`.
const char* ScheduleTypeName(ScheduleType type);

}  // namespace megatrain
