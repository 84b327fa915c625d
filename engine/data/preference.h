// Preference pairs for DPO, one JSON object a line, as TRL's DPOTrainer takes them:
//   {"prompt": P, "chosen": C, "rejected": R}
// either all strings (standard) or all lists of {"role", "content"} messages
// (conversational: P the turns before the reply, C and R the reply's assistant messages).
//
// Tokenized as TRL tokenizes (trl/trainer/dpo_trainer.py): the prompt's ids alone, then
// each of prompt + completion whole, and the completion is what follows the prompt's
// length in the latter:
//   standard        [bos] Encode(P), and [bos] Encode(P + C) with eos appended to a
//                   completion that does not end with it (bos / eos where the tokenizer
//                   has them)
//   conversational  the family's chat template (chat_template.h) over P with the
//                   generation prompt, and over P + C; no tokens are added (the template
//                   prints its own)
// When the whole does not start with the prompt's ids (a merge across the boundary), the
// split is still at the prompt's length, as in TRL, and the pair says so (a warning).
//
// A pair's two training sequences are prompt + completion, cut as TRL cuts them: first the
// prompt to its last max_prompt_length tokens and each completion to its first
// max_completion_length (the tokenizer's step), then the whole to max_length (the
// collator's): keep_start keeps the first max_length tokens, keep_end the last.
// Only completion tokens are trained.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/data/chat_template.h"
#include "engine/data/tokenizer.h"

namespace megatrain {

struct PreferencePair {
  std::vector<int32_t> prompt;    // (P) the prompt's ids
  std::vector<int32_t> chosen;    // (C) the chosen completion's ids, after the prompt
  std::vector<int32_t> rejected;  // (R) the rejected one's
  bool prefix_mismatch = false;   // a whole did not start with the prompt's ids
};

// One line's pair. InvalidArgument naming the problem (the caller adds path:line): not a
// JSON object; prompt, chosen or rejected missing or of another kind than the others; an
// unknown role; a conversational pair without a chat template; a completion that
// tokenizes to nothing; chosen and rejected the same.
[[nodiscard]] absl::StatusOr<PreferencePair> PreferencePairFromLine(
    absl::string_view line, const std::optional<ChatFormat>& chat,
    const ChatOptions& chat_options, const Tokenizer& tokenizer);

enum class PreferenceTruncation { kKeepStart, kKeepEnd };

// A training sequence: its ids and, per id, 1 on a completion token.
struct PreferenceSequence {
  std::vector<int32_t> ids;
  std::vector<uint8_t> completion;
};

// How a pair's sequences are cut (each length 0: uncut).
struct PreferenceCut {
  int64_t max_length = 0;             // a whole sequence's tokens
  int64_t max_prompt_length = 0;      // the prompt's, its last kept
  int64_t max_completion_length = 0;  // each completion's, its first kept
  PreferenceTruncation truncation = PreferenceTruncation::kKeepStart;  // max_length's
};

// The pair's chosen and rejected sequences, prompt + completion cut by `cut`.
// InvalidArgument when keep_start leaves a sequence no completion token (the prompt alone
// fills max_length: TRL drops such pairs).
[[nodiscard]] absl::StatusOr<std::pair<PreferenceSequence, PreferenceSequence>>
PreferenceSequences(const PreferencePair& pair, const PreferenceCut& cut);

}  // namespace megatrain
