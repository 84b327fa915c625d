// Text primitives of Hugging Face BPE tokenizers: UTF-8 repair, NFC, the GPT-2 byte
// alphabet and the regex split of a pre-tokenizer.
//
// The reference we match is the JavaScript port (@huggingface/tokenizers, used by
// transformers.js), not the Rust library. Its regexes are Oniguruma patterns rewritten
// for JS, so RegexSplitter rewrites them the same way before handing them to PCRE2:
// `\s` is Unicode White_Space (not PCRE2's or JS's own \s), and `(?i:...)` folds ASCII
// letters only (PCRE2 would also fold U+017F 'ſ' into 's' and U+212A into 'k').
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace megatrain {

// Number of bytes of the UTF-8 sequence that starts with `lead` (1 for invalid leads).
int Utf8SequenceLength(unsigned char lead);

// `text` with every ill-formed UTF-8 subsequence replaced by U+FFFD, one per maximal
// subpart, as the WHATWG TextDecoder does. Valid input is returned unchanged.
std::string RepairUtf8(absl::string_view text);

// Canonical composition (NFC) of valid UTF-8 `text`.
std::string NfcNormalize(absl::string_view text);

// The GPT-2 byte alphabet: every byte maps to one printable code point, so a byte string
// can be a vocab string. ByteLevelEncode maps each byte of `text`; ByteLevelDecode maps
// back, dropping code points outside the alphabet.
std::string ByteLevelEncode(absl::string_view text);
std::string ByteLevelDecode(absl::string_view text);

// Splits text at the matches of one regex, keeping the matches and the text between them
// as pieces, in order ("Isolated" behaviour of the Split pre-tokenizer).
//
// Immutable after Create(); Split() is safe to call from many threads.
class RegexSplitter {
 public:
  // Compiles an Oniguruma-syntax `pattern` (as stored in tokenizer.json).
  // InvalidArgument when the pattern uses a construct we do not rewrite or PCRE2 rejects.
  static absl::StatusOr<RegexSplitter> Create(absl::string_view pattern);

  // REQUIRES: `text` is valid UTF-8. Pieces are non-empty views into `text`.
  std::vector<absl::string_view> Split(absl::string_view text) const;

 private:
  struct Code;
  explicit RegexSplitter(std::shared_ptr<const Code> code) : code_(std::move(code)) {}
  std::shared_ptr<const Code> code_;
};

// The PCRE2 pattern that matches what the JS reference compiles `pattern` to.
// Exposed for tests. InvalidArgument for constructs we do not rewrite.
absl::StatusOr<std::string> RewriteOnigurumaPattern(absl::string_view pattern);

}  // namespace megatrain
