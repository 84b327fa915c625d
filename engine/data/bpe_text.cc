#include "engine/data/bpe_text.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/common/check.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"

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

// The ASCII members of a property ("p{L}" -> "A-Za-z"), or "". Listing them beside the
// property is the same set, but PCRE2 then tests ASCII against a bitmap instead of
// looking up the property.
absl::string_view AsciiMembers(absl::string_view property) {
  if (property == "p{L}") return "A-Za-z";
  if (property == "p{Lu}") return "A-Z";
  if (property == "p{Ll}") return "a-z";
  if (property == "p{N}") return "0-9";
  return "";
}

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

namespace {

// Length of the well-formed UTF-8 sequence at the start of `text` (non-empty, first byte
// not ASCII), or 0 when it is ill-formed; then *subpart is the length of its maximal
// subpart (at least 1), which becomes one U+FFFD.
int NonAsciiSequenceLength(absl::string_view text, size_t* subpart) {
  const unsigned char b = static_cast<unsigned char>(text[0]);
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
  size_t j = 1;
  int got = 0;
  while (need > 0 && got < need && j < text.size()) {
    const unsigned char c = static_cast<unsigned char>(text[j]);
    const unsigned char min = got == 0 ? lo : 0x80, max = got == 0 ? hi : 0xBF;
    if (c < min || c > max) break;
    ++got;
    ++j;
  }
  if (need > 0 && got == need) return static_cast<int>(j);
  *subpart = j;
  return 0;
}

// Index of the first byte at or after `i` with any of the bits of `mask` (0x80: non-ASCII),
// or text.size(); eight bytes at a time.
size_t FindByteWithBits(absl::string_view text, size_t i, unsigned char mask) {
  const uint64_t wide_mask = 0x0101010101010101ull * mask;
  while (i + 8 <= text.size()) {
    uint64_t word;
    std::memcpy(&word, text.data() + i, 8);
    if ((word & wide_mask) != 0) break;
    i += 8;
  }
  while (i < text.size() && (static_cast<unsigned char>(text[i]) & mask) == 0) ++i;
  return i;
}

}  // namespace

bool IsValidUtf8(absl::string_view text) {
  size_t i = 0;
  while ((i = FindByteWithBits(text, i, 0x80)) < text.size()) {
    size_t subpart = 0;
    const int length = NonAsciiSequenceLength(text.substr(i), &subpart);
    if (length == 0) return false;
    i += length;
  }
  return true;
}

std::string RepairUtf8(absl::string_view text) {
  if (IsValidUtf8(text)) return std::string(text);
  std::string out;
  out.reserve(text.size() + 16);
  size_t i = 0;
  while (i < text.size()) {
    const size_t ascii_end = FindByteWithBits(text, i, 0x80);
    out.append(text.data() + i, ascii_end - i);
    i = ascii_end;
    if (i >= text.size()) break;
    size_t subpart = 0;
    const int length = NonAsciiSequenceLength(text.substr(i), &subpart);
    if (length > 0) {
      out.append(text.data() + i, length);
      i += length;
    } else {
      out.append("\xEF\xBF\xBD");  // U+FFFD for the maximal subpart
      i += subpart;
    }
  }
  return out;
}

size_t IncompleteUtf8SuffixLength(absl::string_view text) {
  // The lead is at most three bytes from the end: a longer sequence is complete or broken.
  for (size_t back = 1; back <= 3 && back <= text.size(); ++back) {
    const unsigned char c = static_cast<unsigned char>(text[text.size() - back]);
    if (c < 0x80) return 0;
    if (c < 0xC0) continue;  // a continuation byte: the lead is further back
    if (c < 0xC2 || c > 0xF4 || Utf8SequenceLength(c) <= static_cast<int>(back)) return 0;
    size_t subpart = 0;
    const int length = NonAsciiSequenceLength(text.substr(text.size() - back), &subpart);
    return length == 0 && subpart == back ? back : 0;
  }
  return 0;
}

bool IsNfcByQuickCheck(absl::string_view text) {
  for (unsigned char c : text) {
    if (c >= 0xCC) return false;
  }
  return true;
}

absl::StatusOr<std::string> NfcNormalize(absl::string_view text) {
  // Code points below U+0300 (lead bytes below 0xCC) have canonical combining class 0,
  // are NFC as they are, and are never the second half of a composition: normalization
  // never crosses the boundary before one. So only [the code point before a run of code
  // points >= U+0300, the end of that run) can change.
  auto high = [&](size_t i) {  // a byte of a code point >= U+0300
    const unsigned char c = static_cast<unsigned char>(text[i]);
    return c >= 0xCC || (c >= 0x80 && c < 0xC0);
  };
  std::string out;
  out.reserve(text.size());
  size_t done = 0;  // text[0, done) is in `out`
  for (size_t i = 0; i < text.size(); ++i) {
    if (static_cast<unsigned char>(text[i]) < 0xCC) continue;
    size_t begin = i;  // the lead of the code point before i, which may compose with it
    if (begin > done) {
      do {
        --begin;
      } while (begin > done && (static_cast<unsigned char>(text[begin]) & 0xC0) == 0x80);
    }
    size_t end = i;
    while (end < text.size() && high(end)) ++end;
    out.append(text.data() + done, begin - done);
    utf8proc_uint8_t* result = nullptr;
    const utf8proc_ssize_t len =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data() + begin),
                     static_cast<utf8proc_ssize_t>(end - begin), &result,
                     static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
    if (len < 0) {  // out of memory for a huge run of marks, or text that is not UTF-8
      const std::string message =
          absl::StrCat("NFC normalization failed at byte ", begin, ": ", utf8proc_errmsg(len));
      return len == UTF8PROC_ERROR_NOMEM ? absl::ResourceExhaustedError(message)
                                         : absl::InvalidArgumentError(message);
    }
    out.append(reinterpret_cast<const char*>(result), static_cast<size_t>(len));
    std::free(result);
    done = end;
    i = end - 1;
  }
  out.append(text.data() + done, text.size() - done);
  return out;
}

std::string ByteLevelEncode(absl::string_view text) {
  std::string out;
  ByteLevelEncode(text, &out);
  return out;
}

void ByteLevelEncode(absl::string_view text, std::string* out) {
  // byte -> its code point of the alphabet as UTF-8 (one or two bytes, all below U+0800).
  struct Utf8 {
    uint8_t size;
    char bytes[2];
  };
  static const std::array<Utf8, 256> table = [] {
    std::array<Utf8, 256> t{};
    const std::array<uint32_t, 256>& code_points = ByteToCodePoint();
    for (int b = 0; b < 256; ++b) {
      std::string utf8;
      AppendUtf8(code_points[b], &utf8);
      t[b].size = static_cast<uint8_t>(utf8.size());
      std::memcpy(t[b].bytes, utf8.data(), utf8.size());
    }
    return t;
  }();
  const size_t first = out->size();
  out->resize(first + 2 * text.size());
  char* p = out->data() + first;
  for (char c : text) {
    const Utf8& u = table[static_cast<unsigned char>(c)];
    p[0] = u.bytes[0];
    p[1] = u.bytes[1];
    p += u.size;
  }
  out->resize(p - out->data());
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
        const absl::string_view escape = pattern.substr(i, close - i + 1);
        const absl::string_view ascii = AsciiMembers(escape);
        if (ascii.empty()) {
          absl::StrAppend(&out, "\\", escape);
        } else if (in_class) {
          absl::StrAppend(&out, ascii, "\\", escape);
        } else {
          absl::StrAppend(&out, "[", ascii, "\\", escape, "]");
        }
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

// Split() runs two programs. `batch` is the pattern P wrapped as (?:(?>P)(?C255))*+ and
// anchored: one call matches piece after piece, each exactly the match P has at that
// position (the atomic group keeps P's first match, as a separate pcre2_match from there
// would return), and the callout records where each ends. Entering a match costs about
// as much as matching a short piece, so on English text this saves a quarter of the
// split. `single` is P itself, for what the batch stops at: text before P's next match,
// an empty match, or a batch that ran into PCRE2's match limit (the pieces it recorded
// stay valid).
struct RegexSplitter::Code {
  pcre2_code* single = nullptr;
  pcre2_code* batch = nullptr;                 // null if PCRE2 rejects the wrapped pattern
  bool single_jit = false, batch_jit = false;  // compiled to machine code
  ~Code() {
    pcre2_code_free(single);
    pcre2_code_free(batch);
  }
};

namespace {

constexpr int kPieceCallout = 255;

pcre2_code* Compile(const std::string& pattern, uint32_t options, int* error, PCRE2_SIZE* offset,
                    bool* jit) {
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP | options, error, offset, nullptr);
  // JIT is an optimization only: when it is unavailable pcre2_match interprets.
  if (code != nullptr) *jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return code;
}

// Per-thread match state, shared by all patterns: only the whole match is read, and a
// pattern with more groups than the match data holds still reports it (rc 0).
struct MatchState {
  pcre2_match_data* data = pcre2_match_data_create(16, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  ~MatchState() {
    pcre2_match_data_free(data);
    pcre2_match_context_free(context);
  }
};

int Match(const pcre2_code* code, bool jit, absl::string_view text, size_t start,
          MatchState* state) {
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  return jit ? pcre2_jit_match(code, subject, text.size(), start, 0, state->data, state->context)
             : pcre2_match(code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, state->data,
                           state->context);
}

// The callout of the batch program: text[end, current_position) is the next piece.
struct Batch {
  absl::string_view text;
  size_t end;
  std::vector<absl::string_view>* pieces;
};

int RecordPiece(pcre2_callout_block* block, void* data) {
  auto* batch = static_cast<Batch*>(data);
  if (block->callout_number == kPieceCallout && block->current_position > batch->end) {
    batch->pieces->push_back(batch->text.substr(batch->end, block->current_position - batch->end));
    batch->end = block->current_position;
  }
  return 0;
}

// Why a match at text[start] failed (rc < 0, not NOMATCH): PCRE2's match, depth or heap
// limit, met by a pattern that backtracks catastrophically on this text. The message
// quotes the text from `start`, a few dozen characters, printable.
absl::Status MatchError(int rc, absl::string_view text, size_t start) {
  PCRE2_UCHAR message[256];
  if (pcre2_get_error_message(rc, message, sizeof(message)) < 0) {
    absl::SNPrintF(reinterpret_cast<char*>(message), sizeof(message), "error %d", rc);
  }
  constexpr size_t kQuotedBytes = 48;
  size_t end = std::min(text.size(), start + kQuotedBytes);
  while (end > start && end < text.size() && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) {
    --end;  // not inside a UTF-8 sequence
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "the pre-tokenizer regex gave up at byte ", start, " (", reinterpret_cast<char*>(message),
      "; the pattern backtracks too much on this text) on text starting '",
      Printable(text.substr(start, end - start)), end < text.size() ? "...'" : "'"));
}

}  // namespace

absl::StatusOr<RegexSplitter> RegexSplitter::Create(absl::string_view pattern) {
  absl::StatusOr<std::string> rewritten = RewriteOnigurumaPattern(pattern);
  if (!rewritten.ok()) return rewritten.status();
  auto code = std::make_shared<Code>();
  int error = 0;
  PCRE2_SIZE offset = 0;
  code->single = Compile(*rewritten, 0, &error, &offset, &code->single_jit);
  if (code->single == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return absl::InvalidArgumentError(absl::StrCat("PCRE2 rejects the rewritten pattern at offset ",
                                                   offset, ": ",
                                                   reinterpret_cast<const char*>(message)));
  }
  code->batch = Compile(absl::StrCat("(?:(?>", *rewritten, ")(?C", kPieceCallout, "))*+"),
                        PCRE2_ANCHORED, &error, &offset, &code->batch_jit);
  return RegexSplitter(std::move(code));
}

absl::StatusOr<std::vector<absl::string_view>> RegexSplitter::Split(absl::string_view text) const {
  std::vector<absl::string_view> pieces;
  RETURN_IF_ERROR(Split(text, &pieces));
  return pieces;
}

absl::Status RegexSplitter::Split(absl::string_view text,
                                  std::vector<absl::string_view>* pieces) const {
  pieces->clear();
  thread_local MatchState state;
  MT_CHECK(state.data != nullptr && state.context != nullptr);
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
  size_t prev = 0;  // end of the last piece
  size_t start = 0;
  while (start < text.size()) {
    if (prev == start && code_->batch != nullptr) {
      Batch batch{text, start, pieces};
      pcre2_set_callout(state.context, RecordPiece, &batch);
      Match(code_->batch, code_->batch_jit, text, start, &state);
      pcre2_set_callout(state.context, nullptr, nullptr);
      if (batch.end > start) {
        prev = start = batch.end;
        continue;
      }
    }
    const int rc = Match(code_->single, code_->single_jit, text, start, &state);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) return MatchError(rc, text, start);
    const size_t begin = ovector[0], end = ovector[1];
    if (begin > prev) pieces->push_back(text.substr(prev, begin - prev));
    if (end > begin) {
      pieces->push_back(text.substr(begin, end - begin));
      prev = end;
      start = end;
    } else {
      prev = begin;
      if (begin >= text.size()) break;  // an empty match at the very end
      start = begin + Utf8SequenceLength(static_cast<unsigned char>(text[begin]));
    }
  }
  if (prev < text.size()) pieces->push_back(text.substr(prev));
  return absl::OkStatus();
}

}  // namespace megatrain
