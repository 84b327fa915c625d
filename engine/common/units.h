// Units and clocks shared by the engine and the server: byte counts in GiB for messages,
// and the wall clock in Unix milliseconds (what job records and events carry).
#pragma once

#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace megatrain {

constexpr int64_t kGiB = int64_t{1} << 30;

// Bytes as GiB, for messages ("96.4 GiB").
inline double GiB(int64_t bytes) { return static_cast<double>(bytes) / kGiB; }

// Now, in milliseconds since the Unix epoch.
inline int64_t NowUnixMs() { return absl::ToUnixMillis(absl::Now()); }

}  // namespace megatrain
