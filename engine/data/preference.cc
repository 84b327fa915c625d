#include "engine/data/preference.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/common/status.h"
#include "engine/data/dataset.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

using json = nlohmann::json;

constexpr const char* kFields[] = {"prompt", "chosen", "rejected"};

// [bos] Encode(text) (TRL's tokenizer(text): special tokens added at the start).
absl::StatusOr<std::vector<int32_t>> WithBos(const Tokenizer& tokenizer, const std::string& text) {
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, tokenizer.Encode(text));
  if (tokenizer.bos_id() >= 0) ids.insert(ids.begin(), tokenizer.bos_id());
  return ids;
}

// The ids of a rendered conversation (the template prints its own special tokens).
absl::StatusOr<std::vector<int32_t>> Rendered(ChatFormat chat, const ChatOptions& options,
                                              const std::vector<ChatMessage>& messages,
                                              bool generation_prompt,
                                              const Tokenizer& tokenizer) {
  ChatOptions o = options;
  o.add_generation_prompt = generation_prompt;
  ASSIGN_OR_RETURN(const ChatRendering r, RenderChat(chat, messages, o));
  return tokenizer.Encode(r.text);
}

// prompt + completion's ids (standard: eos appended where missing) and the prompt's.
struct Whole {
  std::vector<int32_t> prompt, chosen, rejected;
};

absl::StatusOr<Whole> Standard(const json& doc, const Tokenizer& tokenizer) {
  Whole w;
  const std::string prompt = doc["prompt"].get<std::string>();
  ASSIGN_OR_RETURN(w.prompt, WithBos(tokenizer, prompt));
  for (const char* field : {"chosen", "rejected"}) {
    ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                     WithBos(tokenizer, prompt + doc[field].get<std::string>()));
    if (tokenizer.eos_id() >= 0 && (ids.empty() || ids.back() != tokenizer.eos_id())) {
      ids.push_back(tokenizer.eos_id());
    }
    (std::string(field) == "chosen" ? w.chosen : w.rejected) = std::move(ids);
  }
  return w;
}

absl::StatusOr<Whole> Conversational(const json& doc, const std::optional<ChatFormat>& chat,
                                     const ChatOptions& options, const Tokenizer& tokenizer) {
  if (!chat.has_value()) {
    return absl::InvalidArgumentError(
        "a conversational pair needs the model family's chat template (data.chat_template)");
  }
  ASSIGN_OR_RETURN(const std::vector<ChatMessage> prompt,
                   MessagesFromJson(doc["prompt"], "prompt"));
  Whole w;
  ASSIGN_OR_RETURN(w.prompt, Rendered(*chat, options, prompt, true, tokenizer));
  for (const char* field : {"chosen", "rejected"}) {
    ASSIGN_OR_RETURN(std::vector<ChatMessage> messages, MessagesFromJson(doc[field], field));
    if (messages.empty() || messages.back().role != "assistant") {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " must end with an assistant message (the reply)"));
    }
    messages.insert(messages.begin(), prompt.begin(), prompt.end());
    ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                     Rendered(*chat, options, messages, false, tokenizer));
    (std::string(field) == "chosen" ? w.chosen : w.rejected) = std::move(ids);
  }
  return w;
}

}  // namespace

absl::StatusOr<PreferencePair> PreferencePairFromLine(absl::string_view line,
                                                      const std::optional<ChatFormat>& chat,
                                                      const ChatOptions& chat_options,
                                                      const Tokenizer& tokenizer) {
  const json doc = json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) {
    return absl::InvalidArgumentError("expected a JSON object {prompt, chosen, rejected}");
  }
  for (const char* field : kFields) {
    if (!doc.contains(field)) {
      return absl::InvalidArgumentError(absl::StrCat("field '", field, "' missing"));
    }
    const json& v = doc[field];
    if (!v.is_string() && !v.is_array()) {
      return absl::InvalidArgumentError(absl::StrCat("field '", field, "' is a ", v.type_name(),
                                                     ", expected a string or a message list"));
    }
    if (v.is_string() != doc["prompt"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "field '", field, "' is ", v.is_string() ? "a string" : "a message list",
          " but the prompt is not: a pair is all strings or all message lists"));
    }
  }
  if (doc["chosen"] == doc["rejected"]) {
    return absl::InvalidArgumentError("chosen and rejected are the same: nothing to prefer");
  }
  ASSIGN_OR_RETURN(const Whole w, doc["prompt"].is_string()
                                      ? Standard(doc, tokenizer)
                                      : Conversational(doc, chat, chat_options, tokenizer));
  PreferencePair pair;
  pair.prompt = w.prompt;
  const size_t n = w.prompt.size();
  for (const auto* whole : {&w.chosen, &w.rejected}) {
    const bool chosen = whole == &w.chosen;
    if (whole->size() <= n) {
      return absl::InvalidArgumentError(absl::StrCat(
          chosen ? "chosen" : "rejected", " adds no token after the prompt (",
          whole->size(), " tokens with it, ", n, " without)"));
    }
    if (!std::equal(w.prompt.begin(), w.prompt.end(), whole->begin())) pair.prefix_mismatch = true;
    (chosen ? pair.chosen : pair.rejected).assign(whole->begin() + n, whole->end());
  }
  return pair;
}

absl::StatusOr<std::pair<PreferenceSequence, PreferenceSequence>> PreferenceSequences(
    const PreferencePair& pair, const PreferenceCut& cut) {
  // The tokenizer's cuts: the prompt's end, each completion's start.
  const auto kept_prompt = [&] {
    const int64_t n = static_cast<int64_t>(pair.prompt.size());
    const int64_t from = cut.max_prompt_length > 0 ? std::max<int64_t>(0, n - cut.max_prompt_length)
                                                   : 0;
    return std::vector<int32_t>(pair.prompt.begin() + from, pair.prompt.end());
  }();
  const int64_t prompt = static_cast<int64_t>(kept_prompt.size());
  const int64_t max_length = cut.max_length;
  if (max_length > 0 && cut.truncation == PreferenceTruncation::kKeepStart &&
      prompt >= max_length) {
    return absl::InvalidArgumentError(
        absl::StrCat("the prompt is ", prompt, " tokens, and max_length ", max_length,
                     " keeps no completion token after it (truncation keep_start)"));
  }
  auto sequence = [&](const std::vector<int32_t>& completion) {
    const int64_t kept = cut.max_completion_length > 0
                             ? std::min<int64_t>(cut.max_completion_length,
                                                 static_cast<int64_t>(completion.size()))
                             : static_cast<int64_t>(completion.size());
    PreferenceSequence s;
    s.ids = kept_prompt;
    s.ids.insert(s.ids.end(), completion.begin(), completion.begin() + kept);
    s.completion.assign(kept_prompt.size(), 0);
    s.completion.resize(s.ids.size(), 1);
    const int64_t length = static_cast<int64_t>(s.ids.size());
    if (max_length > 0 && length > max_length) {  // the collator's cut
      const int64_t first =
          cut.truncation == PreferenceTruncation::kKeepStart ? 0 : length - max_length;
      s.ids.assign(s.ids.begin() + first, s.ids.begin() + first + max_length);
      s.completion.assign(s.completion.begin() + first, s.completion.begin() + first + max_length);
    }
    return s;
  };
  return std::make_pair(sequence(pair.chosen), sequence(pair.rejected));
}

}  // namespace megatrain
