// Exact-match scoring of completions against reference answers, the evaluation of
// math-style sets (GSM8K, MetaMathQA: "... The answer is: 42"): the answer a completion
// gives is the last match of a pattern in its text, or, with no pattern, its last number.
//
// Numbers compare as numbers: "1,000", "1000" and "1000.0" are one answer; anything else
// compares as text with surrounding spaces trimmed. Immutable after Create(); thread-safe.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace megatrain {

class AnswerMatcher {
 public:
  // `pattern`: a PCRE2 regex whose last match in a completion is its answer (its first
  // capture group when it has one, else the whole match); "" = the last number in the
  // text. InvalidArgument naming the pattern and PCRE2's reason when it does not compile.
  [[nodiscard]] static absl::StatusOr<AnswerMatcher> Create(const std::string& pattern);

  // The answer `completion` gives, or nullopt when it gives none.
  std::optional<std::string> Extract(absl::string_view completion) const;
  // Whether `completion`'s answer equals `expected` (a reference answer, as written).
  bool Correct(absl::string_view completion, absl::string_view expected) const;
  // Whether two answers are the same: as numbers when both read as one, else as text.
  static bool SameAnswer(absl::string_view a, absl::string_view b);

 private:
  struct Code;
  explicit AnswerMatcher(std::shared_ptr<const Code> code) : code_(std::move(code)) {}
  std::shared_ptr<const Code> code_;
};

}  // namespace megatrain
