#include "engine/generate/answer_match.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstdlib>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace megatrain {
namespace {

// A number as written in text: an optional sign, digits with optional thousands commas,
// an optional fraction.
constexpr char kNumberPattern[] = R"((-?\d[\d,]*(?:\.\d+)?))";

// `text` as a number when all of it reads as one (commas dropped), else nullopt.
std::optional<double> AsNumber(absl::string_view text) {
  std::string digits;
  for (char ch : absl::StripAsciiWhitespace(text)) {
    if (ch != ',') digits.push_back(ch);
  }
  if (!digits.empty() && digits.back() == '.') digits.pop_back();  // "42." ends a sentence
  if (digits.empty()) return std::nullopt;
  char* end = nullptr;
  const double value = std::strtod(digits.c_str(), &end);
  if (end != digits.c_str() + digits.size()) return std::nullopt;
  return value;
}

}  // namespace

struct AnswerMatcher::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

absl::StatusOr<AnswerMatcher> AnswerMatcher::Create(const std::string& pattern) {
  const std::string source = pattern.empty() ? kNumberPattern : pattern;
  int error = 0;
  PCRE2_SIZE offset = 0;
  auto code = std::make_shared<Code>();
  code->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(),
                             PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (code->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return absl::InvalidArgumentError(absl::StrCat("answer pattern '", pattern, "' at offset ",
                                                   offset, ": ",
                                                   reinterpret_cast<char*>(message)));
  }
  return AnswerMatcher(std::move(code));
}

std::optional<std::string> AnswerMatcher::Extract(absl::string_view completion) const {
  pcre2_match_data* data = pcre2_match_data_create_from_pattern(code_->code, nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(completion.data());
  std::optional<std::string> last;
  size_t start = 0;
  while (start <= completion.size()) {
    // Text that is not valid UTF-8 (a completion cut mid-character) matches nothing.
    const int rc = pcre2_match(code_->code, subject, completion.size(), start, 0, data, nullptr);
    if (rc < 0) break;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data);
    const int group = rc > 1 && ov[2] != PCRE2_UNSET ? 1 : 0;
    last = std::string(completion.substr(ov[2 * group], ov[2 * group + 1] - ov[2 * group]));
    start = ov[1] > ov[0] ? ov[1] : ov[1] + 1;  // past an empty match
  }
  pcre2_match_data_free(data);
  return last;
}

bool AnswerMatcher::SameAnswer(absl::string_view a, absl::string_view b) {
  const std::optional<double> x = AsNumber(a), y = AsNumber(b);
  if (x.has_value() && y.has_value()) return *x == *y;
  return absl::StripAsciiWhitespace(a) == absl::StripAsciiWhitespace(b);
}

bool AnswerMatcher::Correct(absl::string_view completion, absl::string_view expected) const {
  const std::optional<std::string> answer = Extract(completion);
  return answer.has_value() && SameAnswer(*answer, expected);
}

}  // namespace megatrain
