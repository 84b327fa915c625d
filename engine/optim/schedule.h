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
#include "engine/engine.h"  // ScheduleType, ScheduleOptions

namespace megatrain {

// The learning rate of the step about to run; step is its 0-based index.
//   warmup (step < warmup_steps): lr * step / max(1, warmup_steps)
//   constant: lr
//   linear:   factor = max(0, (total - step) / max(1, total - warmup))
//   cosine:   progress = min(1, (step - warmup) / max(1, total - warmup))
//             factor = max(0, 0.5 * (1 + cos(pi * progress)))
//   linear and cosine return lr * (min_lr_ratio + (1 - min_lr_ratio) * factor).
// With min_lr_ratio = 0 these are exactly Hugging Face's values (cosine: up to
// total_steps). REQUIRES: options valid (a JobSpec's pass ValidateJobSpec), step >= 0.
double LearningRate(const ScheduleOptions& options, int64_t step);

// "constant", "linear" or "cosine" (SpecName; ParseSpecName reads them back).
const char* ScheduleTypeName(ScheduleType type);

}  // namespace megatrain
