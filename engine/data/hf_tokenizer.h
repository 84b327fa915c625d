// Hugging Face tokenizer.json BPE tokenizers (Llama 2 / 3, Qwen3, GPT-OSS style) behind
// the Tokenizer interface.
//
// Ids match the JavaScript reference (@huggingface/transformers' PreTrainedTokenizer,
// encode with add_special_tokens=false) byte for byte; tests/tokenizer/ holds the harness
// that checks it. Encode runs, per text:
//   1. added tokens (special or not) are cut out first: at each position the longest
//      added token that matches there; they are never split or normalized;
//   2. each remaining section is normalized (NFC, Prepend, Replace), pre-tokenized
//      (Split by regex, then the ByteLevel byte alphabet) and BPE-merged, pre-token by
//      pre-token (bpe_model.h); fuse_unk merges runs of unknown ids in a section.
// Supported components are exactly those listed in LoadHfTokenizer's comment; anything
// else is rejected at load, never ignored, so an id mismatch cannot come from a silently
// skipped step. The post_processor, truncation and padding are ignored: they only apply
// when special tokens are added, which Encode never does.
//
// Invalid UTF-8 in the input is first replaced by U+FFFD per maximal subpart (what a JS
// TextDecoder would give the reference). Decode runs the decoder chain on the tokens as
// bytes and never repairs them, so that a stream of ids can be decoded piece by piece.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/data/bpe_model.h"
#include "engine/data/bpe_text.h"
#include "engine/data/tokenizer.h"

namespace megatrain {

// Immutable after Load(); safe to use from many threads. Encode keeps per-thread scratch
// memory, a cache of the ids of recent pre-tokens (about 1 MiB), for each of the last four
// tokenizers a thread used; it is freed when the thread exits.
class HfTokenizer final : public Tokenizer {
 public:
  // See LoadHfTokenizer.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HfTokenizer>> Load(
      const std::string& tokenizer_json_path, const std::string& tokenizer_config_json_path);

  // InvalidArgument naming the tokenizer.json when its pre-tokenizer regex gives up on
  // `text` (catastrophic backtracking; see RegexSplitter::Split).
  [[nodiscard]] absl::StatusOr<std::vector<int32_t>> Encode(
      absl::string_view text) const override;
  // max(id) + 1 over the vocab and the added tokens.
  int64_t vocab_size() const override { return vocab_size_; }
  int32_t bos_id() const override { return bos_id_; }
  int32_t eos_id() const override { return eos_id_; }
  // "hf-bpe:" + the tokenizer.json path.
  std::string name() const override { return name_; }

  // The bytes of `ids` through the tokenizer.json decoder (hf_tokenizer_decode.cc), as the
  // reference's decode(ids, skip_special_tokens=false, clean_up_tokenization_spaces=false)
  // but unrepaired: RepairUtf8(Decode(ids)) is the reference's text. Added tokens are
  // their content; ids outside [0, vocab_size()) add nothing. Decode(Encode(x)) == x for
  // the texts on which the reference round-trips.
  //
  // Prefix-stable and local (tokenizer.h) for every chain of Llama 2 / 3, Qwen, GPT-OSS
  // and Mistral: ByteLevel; Replace, ByteFallback, Fuse, Strip(start only). A Replace or
  // Strip(stop) after Fuse or a byte run can change text that earlier ids gave; TextStream
  // then streams text that may differ from Decode.
  std::string Decode(absl::Span<const int32_t> ids) const override;

 private:
  struct NormalizerStep {
    enum Kind { kNfc, kPrepend, kReplace } kind;
    std::string from, to;  // kPrepend: `to` is prepended; kReplace: every `from` -> `to`
  };
  struct DecoderStep {
    enum Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip } kind;
    std::string from, to;     // kReplace; kStrip: `from` is the stripped code point
    int start = 0, stop = 0;  // kStrip: at most this many leading / trailing
  };
  struct AddedToken {
    std::string content;
    int32_t id;
  };

  // Per-thread working memory of Encode: a cache of the ids of recent pre-tokens and
  // buffers that keep their capacity (hf_tokenizer.cc). One per thread and tokenizer.
  struct Scratch;
  // Load's stages, one per part of tokenizer.json (hf_tokenizer_load.cc).
  struct Loader;

  HfTokenizer() = default;
  Scratch& ThreadScratch() const;
  // Encode's ids appended to *ids; errors do not name the tokenizer yet.
  absl::Status EncodeTo(absl::string_view text, std::vector<int32_t>* ids) const;
  absl::Status EncodeSection(absl::string_view section, Scratch* scratch,
                             std::vector<int32_t>* ids) const;
  // The normalized `section`: `section` itself, or a view into scratch's buffers.
  absl::StatusOr<absl::string_view> Normalize(absl::string_view section, Scratch* scratch) const;
  void EncodePreToken(absl::string_view pre_token, Scratch* scratch,
                      std::vector<int32_t>* ids) const;
  // The first index from `i` on where an added token may start, or text.size().
  size_t NextAddedTokenStart(absl::string_view text, size_t i) const;
  // Longest added token at the start of `text`, or nullptr.
  const AddedToken* MatchAddedToken(absl::string_view text) const;
  // One step of the decoder on the tokens' bytes (hf_tokenizer_decode.cc).
  void ApplyDecoderStep(const DecoderStep& step, std::vector<std::string>* tokens) const;

  // Pipeline, in order.
  std::vector<NormalizerStep> normalizers_;
  std::optional<RegexSplitter> split_;  // Split pre-tokenizer, if any
  bool byte_level_ = false;             // ByteLevel pre-tokenizer
  // Without a pre-tokenizer, a word may still be cut before every U+2581 that follows
  // another code point when no vocab token has such a pair inside (Llama 2): no merge can
  // cross the cut, so the ids are the same, and the pieces are short and repeat.
  bool split_before_metaspace_ = false;
  std::optional<BpeModel> model_;
  bool fuse_unk_ = false;
  int32_t unk_id_ = -1;
  bool has_decoder_ = false;  // no decoder: tokens are joined with ' ', as the reference does
  std::vector<DecoderStep> decoders_;

  std::vector<AddedToken> added_;
  std::vector<std::vector<int32_t>> added_by_first_byte_;  // [256] -> indices, longest first
  std::array<bool, 256> starts_added_{};  // [byte]: some added token starts with it
  int num_added_first_bytes_ = 0;         // distinct bytes that start added tokens
  char added_first_byte_ = 0;             // the one, when num_added_first_bytes_ == 1
  absl::flat_hash_set<std::string> added_contents_;
  std::vector<std::string> id_to_token_;  // [vocab_size_]

  int64_t vocab_size_ = 0;
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  std::string name_;
  std::string json_path_;     // the tokenizer.json it was loaded from
  uint64_t scratch_key_ = 0;  // unique per tokenizer ever loaded: finds this one's Scratch
};

// Loads a tokenizer.json (and optionally its tokenizer_config.json; pass "" for none).
//
// Supported: normalizer null | NFC | Prepend | Replace(String) | Sequence of those;
// pre_tokenizer null | Split(Regex, behavior Isolated, invert false) |
// ByteLevel(add_prefix_space false, use_regex false) | Sequence[Split, ByteLevel];
// model BPE (vocab, merges as "a b" or [a, b], byte_fallback, ignore_merges, fuse_unk,
// unk_token; no dropout, continuing_subword_prefix or end_of_word_suffix);
// decoder null | ByteLevel | Replace(String) | ByteFallback | Fuse | Strip | Sequence;
// added_tokens with single_word, lstrip, rstrip and normalized all false.
//
// bos_id: the id of tokenizer_config's bos_token, or -1 when it has none or sets
// add_bos_token false. eos_id: the id of eos_token, or -1 when it has none (whatever
// add_eos_token says: packing needs a document separator). Both are -1 without a config.
//
// NotFound when a file is missing; InvalidArgument naming the file and the component for
// malformed JSON or an unsupported component ("tokenizer.json: pre_tokenizer type
// 'Whitespace' is not supported").
[[nodiscard]] absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHfTokenizer(
    const std::string& tokenizer_json_path, const std::string& tokenizer_config_json_path);

}  // namespace megatrain
