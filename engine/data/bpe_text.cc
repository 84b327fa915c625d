#include "engine/data/bpe_text.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <array>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "engine/common/check.h"

namespace megatrain {
namespace {

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// byte -> code point of the GPT-2 alphabet: printable Latin-1 bytes map to themselves,
// the other 68 to U+0100.. in byte order.
const std::array<uint32_t, 256>& ByteToCodePoint() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      t[b] = printable ? static_cast<uint32_t>(b) : next++;
    }
    return t;
  }();
  return table;
}

// The members of Unicode White_Space, as the body of a character class.
constexpr absl::string_view kWhiteSpaceClassBody =
    "\\t\\n\\x{0B}\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";

bool IsAsciiLetter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
char OtherCase(char c) { return (c >= 'a' && c <= 'z') ? c - 'a' + 'A' : c - 'A' + 'a'; }

}  // namespace

int Utf8SequenceLength(unsigned char lead) {
  if (lead < 0xC0) return 1;
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  if (lead < 0xF8) return 4;
  return 1;
}

std::string RepairUtf8(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char b = static_cast<unsigned char>(text[i]);
    if (b < 0x80) {
      out.push_back(static_cast<char>(b));
      ++i;
      continue;
    }
    int need = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // bounds of the second byte
    if (b >= 0xC2 && b <= 0xDF) {
      need = 1;
    } else if (b >= 0xE0 && b <= 0xEF) {
      need = 2;
      if (b == 0xE0) lo = 0xA0;
      if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      need = 3;
      if (b == 0xF0) lo = 0x90;
      if (b == 0xF4) hi = 0x8F;
    }
    size_t j = i + 1;
    int got = 0;
    while (need > 0 && got < need && j < n) {
      const unsigned char c = static_cast<unsigned char>(text[j]);
      const unsigned char min = got == 0 ? lo : 0x80, max = got == 0 ? hi : 0xBF;
      if (c < min || c > max) break;
      ++got;
      ++j;
    }
    if (need > 0 && got == need) {
      out.append(text.data() + i, j - i);
    } else {
      out.append("\xEF\xBF\xBD");  // U+FFFD for the maximal subpart [i, j)
    }
    i = j;
  }
  return out;
}

std::string NfcNormalize(absl::string_view text) {
  utf8proc_uint8_t* result = nullptr;
  const utf8proc_ssize_t len =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   static_cast<utf8proc_ssize_t>(text.size()), &result,
                   static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  MT_CHECK_MSG(len >= 0, "utf8proc_map: %s (input must be valid UTF-8)", utf8proc_errmsg(len));
  std::string out(reinterpret_cast<const char*>(result), static_cast<size_t>(len));
  std::free(result);
  return out;
}

std::string ByteLevelEncode(absl::string_view text) {
  const std::array<uint32_t, 256>& table = ByteToCodePoint();
  std::string out;
  out.reserve(text.size() * 2);
  for (char c : text) AppendUtf8(table[static_cast<unsigned char>(c)], &out);
  return out;
}

std::string ByteLevelDecode(absl::string_view text) {
  static const std::array<int, 324> inverse = [] {
    std::array<int, 324> t;
    t.fill(-1);
    const std::array<uint32_t, 256>& table = ByteToCodePoint();
    for (int b = 0; b < 256; ++b) t[table[b]] = b;
    return t;
  }();
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const unsigned char lead = static_cast<unsigned char>(text[i]);
    const int len = Utf8SequenceLength(lead);
    uint32_t cp = lead;
    if (len == 2 && i + 1 < text.size()) {
      cp = ((lead & 0x1F) << 6) | (static_cast<unsigned char>(text[i + 1]) & 0x3F);
    } else if (len > 2) {
      cp = 0xFFFFFFFF;  // outside the alphabet
    }
    if (cp < inverse.size() && inverse[cp] >= 0) out.push_back(static_cast<char>(inverse[cp]));
    i += len;
  }
  return out;
}

absl::StatusOr<std::string> RewriteOnigurumaPattern(absl::string_view pattern) {
  std::string out;
  bool in_class = false;
  // One entry per open group: whether it folds ASCII case. (?i: groups fold, and so do
  // the groups nested in them.
  std::vector<bool> fold_stack;
  auto folding = [&] { return !fold_stack.empty() && fold_stack.back(); };
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\') {
      if (i + 1 >= pattern.size()) return absl::InvalidArgumentError("pattern ends in '\\'");
      const char e = pattern[++i];
      if (e == 's') {
        absl::StrAppend(&out, in_class ? "" : "[", kWhiteSpaceClassBody, in_class ? "" : "]");
      } else if (e == 'S') {
        if (in_class) return absl::InvalidArgumentError("'\\S' inside a character class");
        absl::StrAppend(&out, "[^", kWhiteSpaceClassBody, "]");
      } else if (e == 'p' || e == 'P' || e == 'x') {
        const size_t close = pattern.find('}', i);
        if (i + 1 >= pattern.size() || pattern[i + 1] != '{' || close == absl::string_view::npos) {
          return absl::InvalidArgumentError(
              absl::StrCat("'\\", std::string(1, e), "' without {...}"));
        }
        absl::StrAppend(&out, "\\", pattern.substr(i, close - i + 1));
        i = close;
      } else if (std::string("rntf").find(e) != std::string::npos ||
                 !(IsAsciiLetter(e) || (e >= '0' && e <= '9'))) {
        out.push_back('\\');
        out.push_back(e);
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("escape '\\", std::string(1, e), "' is not supported"));
      }
      continue;
    }
    if (in_class) {
      if (c == ']') in_class = false;
      if (c == '[') return absl::InvalidArgumentError("nested character classes");
      out.push_back(c);
      if (folding() && IsAsciiLetter(c)) out.push_back(OtherCase(c));
      continue;
    }
    if (c == '[') {
      in_class = true;
      out.push_back(c);
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out.push_back(pattern[++i]);
      // A ']' right after '[' or '[^' is a literal in Oniguruma.
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') {
        out.append("\\]");
        ++i;
      }
    } else if (c == '(') {
      if (pattern.substr(i, 4) == "(?i:") {
        fold_stack.push_back(true);
        out.append("(?:");
        i += 3;
      } else {
        if (pattern.substr(i, 2) == "(?" && pattern.substr(i, 3) != "(?:" &&
            pattern.substr(i, 3) != "(?!" && pattern.substr(i, 3) != "(?=") {
          return absl::InvalidArgumentError("only (?:, (?i:, (?= and (?! groups are supported");
        }
        fold_stack.push_back(folding());
        out.push_back(c);
      }
    } else if (c == ')') {
      if (!fold_stack.empty()) fold_stack.pop_back();
      out.push_back(c);
    } else if (folding() && IsAsciiLetter(c)) {
      absl::StrAppend(&out, "[", std::string(1, c), std::string(1, OtherCase(c)), "]");
    } else {
      out.push_back(c);
    }
  }
  if (in_class) return absl::InvalidArgumentError("unterminated character class");
  return out;
}

struct RegexSplitter::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

absl::StatusOr<RegexSplitter> RegexSplitter::Create(absl::string_view pattern) {
  absl::StatusOr<std::string> rewritten = RewriteOnigurumaPattern(pattern);
  if (!rewritten.ok()) return rewritten.status();
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten->data()), rewritten->size(),
                    PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return absl::InvalidArgumentError(absl::StrCat("PCRE2 rejects the rewritten pattern at offset ",
                                                   offset, ": ",
                                                   reinterpret_cast<const char*>(message)));
  }
  // JIT is an optimization only: when it is unavailable pcre2_match interprets.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  auto owned = std::make_shared<Code>();
  owned->code = code;
  return RegexSplitter(std::move(owned));
}

std::vector<absl::string_view> RegexSplitter::Split(absl::string_view text) const {
  std::vector<absl::string_view> pieces;
  pcre2_match_data* match = pcre2_match_data_create_from_pattern(code_->code, nullptr);
  MT_CHECK(match != nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t prev = 0;  // end of the last piece
  size_t start = 0;
  while (start < text.size()) {
    const int rc =
        pcre2_match(code_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, match, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    MT_CHECK_MSG(rc > 0, "pcre2_match failed with %d", rc);
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match);
    const size_t begin = ovector[0], end = ovector[1];
    if (begin > prev) pieces.push_back(text.substr(prev, begin - prev));
    if (end > begin) {
      pieces.push_back(text.substr(begin, end - begin));
      prev = end;
      start = end;
    } else {
      prev = begin;
      start = begin + Utf8SequenceLength(static_cast<unsigned char>(text[begin]));
    }
  }
  if (prev < text.size()) pieces.push_back(text.substr(prev));
  pcre2_match_data_free(match);
  return pieces;
}

}  // namespace megatrain
