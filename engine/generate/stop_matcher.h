// Stop conditions of one sequence: stop token ids and stop strings, checked over the
// stream of generated tokens and the text they decode to.
//
// Text arrives piece by piece (a token's piece may be empty when its bytes end inside a
// UTF-8 character; a later piece then carries them), so a stop string may span pieces.
// The stop is at the first point of the text where any stop string ends (the longest one
// when several end there), so the outcome does not depend on how the text is cut into
// pieces. The text before the stop string is kept; the stop string and whatever follows
// it are dropped. While text streams out, its tail that could still turn out to be the
// start of a stop string is held back: stable_size() says how much may be sent.
//
// Example:
//   StopMatcher stop(options.stop_strings, options.stop_ids);
//   for each generated token: if (stop.Feed(id, piece)) break;
//                             send stop.text().substr(sent, stop.stable_size() - sent)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace megatrain {

enum class StopReason {
  kNone,        // not stopped
  kStopId,      // a stop id was generated
  kStopString,  // the text holds a stop string
};

// One per sequence. Not thread-safe.
class StopMatcher {
 public:
  // REQUIRES: no stop string is empty (ValidateSamplingOptions checks it).
  StopMatcher(std::vector<std::string> stop_strings, std::vector<int32_t> stop_ids);

  // Feeds the token just generated and the text it decoded to. A stop id stops
  // generation and its piece is dropped (an end-of-turn token's text is no answer);
  // otherwise the piece is appended as by FeedText(). Returns stopped().
  // REQUIRES: !stopped().
  bool Feed(int32_t id, absl::string_view piece);
  // Appends text that comes with no new token (what a decoder flushes at the end) and
  // looks for stop strings in it. Returns stopped(). REQUIRES: !stopped().
  bool FeedText(absl::string_view piece);

  bool stopped() const { return reason_ != StopReason::kNone; }
  StopReason reason() const { return reason_; }
  // The stop id generated. REQUIRES: reason() == kStopId.
  int32_t stop_id() const;
  // Index into stop_strings of the stop string found. REQUIRES: reason() == kStopString.
  int64_t stop_string_index() const;

  // The text kept: all pieces fed, cut before the stop string once one is found.
  const std::string& text() const { return text_; }
  // How much of text() is final: no later piece can make it part of a stop string. All
  // of text() once stopped; when generation ends otherwise (max_new_tokens), all of
  // text() is final too. Never decreases.
  size_t stable_size() const { return stable_size_; }

 private:
  // Cuts text_ before the first stop string that ends after byte `from`; true if found.
  bool FindStopString(size_t from);
  // The length of the longest end of text_ that is a proper prefix of a stop string.
  size_t HeldBackSize() const;

  std::vector<std::string> stop_strings_;
  std::vector<int32_t> stop_ids_;  // sorted
  std::string text_;
  size_t stable_size_ = 0;
  StopReason reason_ = StopReason::kNone;
  int32_t stop_id_ = -1;
  int64_t stop_string_index_ = -1;
};

}  // namespace megatrain
