// Text primitives of Hugging Face BPE tokenizers: UTF-8 repair, NFC, the GPT-2 byte
// alphabet and the regex split of a pre-tokenizer.
//
// The reference we match is the JavaScript port (@huggingface/tokenizers, used by
// transformers.js), not the Rust library. Its regexes are Oniguruma patterns rewritten
// for JS, so RegexSplitter rewrites them the same way before handing them to PCRE2:
// `\s` is Unicode White_Space (not PCRE2's or JS's own \s), and `(?i:...)` folds ASCII
// letters only (PCRE2 would also fold U+017F 'ſ' into 's' and U+212A into 'k').
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace megatrain {

// Number of bytes of the UTF-8 sequence that starts with `lead` (1 for invalid leads).
int Utf8SequenceLength(unsigned char lead);

// Whether `text` is well-formed UTF-8 (what RepairUtf8 returns unchanged). ASCII runs are
// checked 8 bytes at a time.
bool IsValidUtf8(absl::string_view text);

// `text` with every ill-formed UTF-8 subsequence replaced by U+FFFD, one per maximal
// subpart, as the WHATWG TextDecoder does. Valid input is returned unchanged.
std::string RepairUtf8(absl::string_view text);

// Length of the incomplete UTF-8 sequence `text` ends in: a lead byte (C2..F4) and fewer
// continuation bytes than it needs, each in the range it allows, so that more bytes could
// still complete it ("\xE4\xBD" -> 2). 0 when `text` ends in a complete sequence, in
// ASCII, or in bytes no continuation can make valid ("\xE4a", "\xC0", "\xED\xA0").
size_t IncompleteUtf8SuffixLength(absl::string_view text);

// Whether valid UTF-8 `text` is NFC without looking it up: true when every code point is
// below U+0300 (no byte >= 0xCC). Those code points are all starters that NFC keeps and
// that never compose with what precedes them, so such text is its own NFC.
bool IsNfcByQuickCheck(absl::string_view text);

// Canonical composition (NFC) of valid UTF-8 `text`. Only the stretches around code
// points from U+0300 up go through utf8proc; a code point below U+0300 is a boundary that
// normalization never crosses. utf8proc's errors (out of memory for a giant run of
// combining marks, invalid UTF-8) are ResourceExhausted / InvalidArgument.
[[nodiscard]] absl::StatusOr<std::string> NfcNormalize(absl::string_view text);

// The GPT-2 byte alphabet: every byte maps to one printable code point, so a byte string
// can be a vocab string. ByteLevelEncode maps each byte of `text` (the second form appends
// to `out`); ByteLevelDecode maps back, dropping code points outside the alphabet.
std::string ByteLevelEncode(absl::string_view text);
void ByteLevelEncode(absl::string_view text, std::string* out);
std::string ByteLevelDecode(absl::string_view text);

// Splits text at the matches of one regex, keeping the matches and the text between them
// as pieces, in order ("Isolated" behaviour of the Split pre-tokenizer).
//
// Immutable after Create(); Split() is safe to call from many threads.
class RegexSplitter {
 public:
  // Compiles an Oniguruma-syntax `pattern` (as stored in tokenizer.json).
  // InvalidArgument when the pattern uses a construct we do not rewrite or PCRE2 rejects.
  [[nodiscard]] static absl::StatusOr<RegexSplitter> Create(absl::string_view pattern);

  // REQUIRES: `text` is valid UTF-8. Pieces are non-empty views into `text`.
  // InvalidArgument when PCRE2 gives up on the text: a pattern that backtracks
  // catastrophically runs into its match limit ("the pre-tokenizer regex gave up at byte
  // 0 (match limit exceeded) on text starting 'aaaa...'").
  [[nodiscard]] absl::StatusOr<std::vector<absl::string_view>> Split(absl::string_view text) const;
  // The same pieces, into `pieces` (cleared first), so that a caller can reuse its buffer.
  // Matching allocates nothing: the match data is per thread.
  [[nodiscard]] absl::Status Split(absl::string_view text,
                                   std::vector<absl::string_view>* pieces) const;

 private:
  struct Code;
  explicit RegexSplitter(std::shared_ptr<const Code> code) : code_(std::move(code)) {}
  std::shared_ptr<const Code> code_;
};

// The PCRE2 pattern that matches what the JS reference compiles `pattern` to.
// Exposed for tests. InvalidArgument for constructs we do not rewrite.
[[nodiscard]] absl::StatusOr<std::string> RewriteOnigurumaPattern(absl::string_view pattern);

}  // namespace megatrain
