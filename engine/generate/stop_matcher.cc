// StopMatcher: only the end of the text is searched on each piece, from where a stop
// string that was not complete before could start, so a long generation costs time in
// proportion to its text, not to the square of it.
#include "engine/generate/stop_matcher.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "engine/common/check.h"

namespace megatrain {

StopMatcher::StopMatcher(std::vector<std::string> stop_strings, std::vector<int32_t> stop_ids)
    : stop_strings_(std::move(stop_strings)), stop_ids_(std::move(stop_ids)) {
  for (const std::string& s : stop_strings_) MT_CHECK(!s.empty());
  std::sort(stop_ids_.begin(), stop_ids_.end());
}

bool StopMatcher::Feed(int32_t id, absl::string_view piece) {
  MT_CHECK(!stopped());
  if (std::binary_search(stop_ids_.begin(), stop_ids_.end(), id)) {
    reason_ = StopReason::kStopId;
    stop_id_ = id;
    stable_size_ = text_.size();
    return true;
  }
  return FeedText(piece);
}

bool StopMatcher::FeedText(absl::string_view piece) {
  MT_CHECK(!stopped());
  if (piece.empty()) return false;
  const size_t old_size = text_.size();
  text_.append(piece.data(), piece.size());
  if (FindStopString(old_size)) {
    reason_ = StopReason::kStopString;
    stable_size_ = text_.size();
    return true;
  }
  stable_size_ = text_.size() - HeldBackSize();
  return false;
}

bool StopMatcher::FindStopString(size_t from) {
  // The text up to `from` holds no stop string, so one ends after it and starts at most
  // size - 1 bytes before it. The first to end wins; of those ending together, the
  // longest (it starts first), then the first listed.
  size_t best_start = 0, best_end = 0;
  int64_t best = -1;
  for (size_t i = 0; i < stop_strings_.size(); ++i) {
    const std::string& s = stop_strings_[i];
    const size_t search_from = from >= s.size() - 1 ? from - (s.size() - 1) : 0;
    const size_t start = text_.find(s, search_from);
    if (start == std::string::npos) continue;
    const size_t end = start + s.size();
    if (best < 0 || end < best_end || (end == best_end && start < best_start)) {
      best = static_cast<int64_t>(i);
      best_start = start;
      best_end = end;
    }
  }
  if (best < 0) return false;
  stop_string_index_ = best;
  text_.resize(best_start);
  return true;
}

size_t StopMatcher::HeldBackSize() const {
  // What was stable stays stable (a longer held-back end would have been held before),
  // so only the text after stable_size_ is looked at.
  const size_t open = text_.size() - stable_size_;
  size_t held = 0;
  for (const std::string& s : stop_strings_) {
    for (size_t n = std::min(s.size() - 1, open); n > held; --n) {
      if (absl::EndsWith(text_, absl::string_view(s).substr(0, n))) {
        held = n;
        break;
      }
    }
  }
  return held;
}

int32_t StopMatcher::stop_id() const {
  MT_CHECK(reason_ == StopReason::kStopId);
  return stop_id_;
}

int64_t StopMatcher::stop_string_index() const {
  MT_CHECK(reason_ == StopReason::kStopString);
  return stop_string_index_;
}

}  // namespace megatrain
