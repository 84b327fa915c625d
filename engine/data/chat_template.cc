// Each Render* function below follows its family's chat_template statement by statement,
// for messages that CheckConversation has accepted. Stripping is Python's: transformers
// runs the templates in jinja2, where strip() / trim remove what str.isspace() calls
// whitespace and strip('\n') removes only newlines.
#include "engine/data/chat_template.h"

#include <ctime>
#include <initializer_list>

#include "absl/algorithm/container.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace megatrain {
namespace {

// The UTF-8 encodings of the non-ASCII code points for which Python's str.isspace() is
// true: U+0085, U+00A0, U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000.
constexpr absl::string_view kWideSpaces[] = {
    "\xC2\x85",     "\xC2\xA0",     "\xE1\x9A\x80", "\xE2\x80\x80", "\xE2\x80\x81",
    "\xE2\x80\x82", "\xE2\x80\x83", "\xE2\x80\x84", "\xE2\x80\x85", "\xE2\x80\x86",
    "\xE2\x80\x87", "\xE2\x80\x88", "\xE2\x80\x89", "\xE2\x80\x8A", "\xE2\x80\xA8",
    "\xE2\x80\xA9", "\xE2\x80\xAF", "\xE2\x81\x9F", "\xE3\x80\x80"};

// ASCII whitespace for Python: \t \n \v \f \r, the separators \x1c..\x1f, and space.
bool IsAsciiSpace(char c) { return (c >= '\t' && c <= '\r') || (c >= '\x1c' && c <= ' '); }

// Python's str.strip() with no argument (jinja2's `trim` filter too).
absl::string_view PyStrip(absl::string_view text) {
  for (bool stripped = true; stripped && !text.empty();) {
    stripped = IsAsciiSpace(text.front());
    if (stripped) {
      text.remove_prefix(1);
      continue;
    }
    for (absl::string_view space : kWideSpaces) {
      if (absl::StartsWith(text, space)) {
        text.remove_prefix(space.size());
        stripped = true;
        break;
      }
    }
  }
  // UTF-8 is self-synchronizing: a suffix that encodes a whole code point is one.
  for (bool stripped = true; stripped && !text.empty();) {
    stripped = IsAsciiSpace(text.back());
    if (stripped) {
      text.remove_suffix(1);
      continue;
    }
    for (absl::string_view space : kWideSpaces) {
      if (absl::EndsWith(text, space)) {
        text.remove_suffix(space.size());
        stripped = true;
        break;
      }
    }
  }
  return text;
}

// Python's str.lstrip('\n') and str.rstrip('\n').
absl::string_view LStripNewlines(absl::string_view text) {
  while (!text.empty() && text.front() == '\n') text.remove_prefix(1);
  return text;
}
absl::string_view RStripNewlines(absl::string_view text) {
  while (!text.empty() && text.back() == '\n') text.remove_suffix(1);
  return text;
}

// Appends the concatenation of `pieces` to out->text as one trained span.
void AppendTrained(ChatRendering* out, std::initializer_list<absl::string_view> pieces) {
  const size_t begin = out->text.size();
  for (absl::string_view piece : pieces) out->text.append(piece.data(), piece.size());
  out->trained.emplace_back(begin, out->text.size());
}

std::string TodayLocalDate() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char date[16];
  std::strftime(date, sizeof(date), "%Y-%m-%d", &local);
  return date;
}

absl::Status CheckConversation(ChatFormat format, absl::Span<const ChatMessage> messages,
                               const ChatOptions& options) {
  if (messages.empty()) return absl::InvalidArgumentError("the conversation has no messages");
  bool has_assistant = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant") {
      return absl::InvalidArgumentError(
          absl::StrCat("messages[", i, "] has role \"", absl::CEscape(role),
                       "\"; the roles are system, user and assistant"));
    }
    if (role == "system" && i > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "messages[", i, "] is a system message; a system message may only come first"));
    }
    has_assistant |= role == "assistant";
  }
  if (!has_assistant && !options.add_generation_prompt) {
    return absl::InvalidArgumentError(
        "the conversation has no assistant message, so nothing in it would be trained; "
        "add one, or set add_generation_prompt to render a prompt");
  }
  const bool needs_eos = format == ChatFormat::kLlama2 || format == ChatFormat::kMistralV1 ||
                         format == ChatFormat::kMistralV3 || format == ChatFormat::kMistralV3Tekken;
  if (needs_eos && options.eos_token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(ChatFormatName(format), " needs eos_token (\"</s>\" in its ",
                     "tokenizer_config.json): it ends every assistant turn"));
  }
  return absl::OkStatus();
}

// What llama2's and Mistral's templates raise on: after the optional system message
// (index `first`), user and assistant turns must alternate, starting with the user.
absl::Status CheckAlternation(ChatFormat format, absl::Span<const ChatMessage> messages,
                              size_t first) {
  for (size_t i = first; i < messages.size(); ++i) {
    const bool user_turn = (i - first) % 2 == 0;
    if ((messages[i].role == "user") != user_turn) {
      return absl::InvalidArgumentError(absl::StrCat(
          "messages[", i, "] is ", messages[i].role == "assistant" ? "an " : "a ", messages[i].role,
          " message where ", ChatFormatName(format), " expects a",
          user_turn ? " user" : "n assistant",
          " one: its chat template requires the roles to alternate user/assistant/user/... "
          "after the optional system message"));
    }
  }
  return absl::OkStatus();
}

// [INST] blocks; the system prompt is folded into the first one.
absl::Status RenderLlama2(absl::Span<const ChatMessage> messages, const ChatOptions& options,
                          ChatRendering* out) {
  const bool has_system = messages[0].role == "system";
  const size_t first = has_system ? 1 : 0;
  absl::Status status = CheckAlternation(ChatFormat::kLlama2, messages, first);
  if (!status.ok()) return status;
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& message = messages[i];
    if (message.role == "assistant") {
      AppendTrained(out, {" ", PyStrip(message.content), " ", options.eos_token});
      continue;
    }
    // The template strips the system block and the user text as one string.
    const std::string content =
        i == first && has_system
            ? absl::StrCat("<<SYS>>\n", messages[0].content, "\n<</SYS>>\n\n", message.content)
            : message.content;
    absl::StrAppend(&out->text, options.bos_token, "[INST] ", PyStrip(content), " [/INST]");
  }
  return absl::OkStatus();
}

absl::Status RenderLlama3(absl::Span<const ChatMessage> messages, const ChatOptions& options,
                          ChatRendering* out) {
  out->text = options.bos_token;
  for (const ChatMessage& message : messages) {
    absl::StrAppend(&out->text, "<|start_header_id|>", message.role, "<|end_header_id|>\n\n");
    if (message.role == "assistant") {
      AppendTrained(out, {PyStrip(message.content), "<|eot_id|>"});
    } else {
      absl::StrAppend(&out->text, PyStrip(message.content), "<|eot_id|>");
    }
  }
  if (options.add_generation_prompt) {
    absl::StrAppend(&out->text, "<|start_header_id|>assistant<|end_header_id|>\n\n");
  }
  return absl::OkStatus();
}

absl::Status RenderQwen3(absl::Span<const ChatMessage> messages, const ChatOptions& options,
                         ChatRendering* out) {
  // The last user message that is not a tool response wrapped as a user turn; assistant
  // turns after it may get a <think> block. None: no assistant turn gets one.
  size_t last_query = messages.size() - 1;
  for (size_t i = messages.size(); i-- > 0;) {
    const std::string& content = messages[i].content;
    if (messages[i].role == "user" && !(absl::StartsWith(content, "<tool_response>") &&
                                        absl::EndsWith(content, "</tool_response>"))) {
      last_query = i;
      break;
    }
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& message = messages[i];
    if (message.role != "assistant") {
      absl::StrAppend(&out->text, "<|im_start|>", message.role, "\n", message.content,
                      "<|im_end|>\n");
      continue;
    }
    // Reasoning written inline: the text before the first </think>, after its last
    // <think>; the answer is what follows the last </think>.
    absl::string_view content = message.content;
    absl::string_view reasoning;
    const size_t first_close = content.find("</think>");
    if (first_close != absl::string_view::npos) {
      absl::string_view before = RStripNewlines(content.substr(0, first_close));
      const size_t last_open = before.rfind("<think>");
      if (last_open != absl::string_view::npos) before.remove_prefix(last_open + 7);
      reasoning = LStripNewlines(before);
      content = LStripNewlines(content.substr(content.rfind("</think>") + 8));
    }
    out->text.append("<|im_start|>assistant\n");
    const bool last = i + 1 == messages.size();
    if (i > last_query && (last || !reasoning.empty())) {
      AppendTrained(out, {"<think>\n", LStripNewlines(RStripNewlines(reasoning)), "\n</think>\n\n",
                          LStripNewlines(content), "<|im_end|>"});
    } else {
      AppendTrained(out, {content, "<|im_end|>"});
    }
    out->text.append("\n");
  }
  if (options.add_generation_prompt) {
    out->text.append("<|im_start|>assistant\n");
    if (!options.enable_thinking) out->text.append("<think>\n\n</think>\n\n");
  }
  return absl::OkStatus();
}

constexpr absl::string_view kQwen25DefaultSystem =
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

// Qwen2.5's template without tools: its default system prompt when none is given.
absl::Status RenderQwen25(absl::Span<const ChatMessage> messages, const ChatOptions& options,
                          ChatRendering* out) {
  const bool has_system = messages[0].role == "system";
  absl::StrAppend(&out->text, "<|im_start|>system\n",
                  has_system ? absl::string_view(messages[0].content) : kQwen25DefaultSystem,
                  "<|im_end|>\n");
  for (size_t i = has_system ? 1 : 0; i < messages.size(); ++i) {
    const ChatMessage& message = messages[i];
    absl::StrAppend(&out->text, "<|im_start|>", message.role, "\n");
    if (message.role == "assistant") {
      AppendTrained(out, {message.content, "<|im_end|>"});
    } else {
      absl::StrAppend(&out->text, message.content, "<|im_end|>");
    }
    out->text.append("\n");
  }
  if (options.add_generation_prompt) out->text.append("<|im_start|>assistant\n");
  return absl::OkStatus();
}

// Mistral's official templates differ only in these pieces.
struct MistralStyle {
  absl::string_view inst_open;   // before a user turn's text
  absl::string_view inst_close;  // after it
  absl::string_view reply_open;  // before an assistant turn's text
  bool strip_reply;              // the assistant text is |trim()med
  bool system_on_first_user;     // else on the last message, when that is a user turn
};

MistralStyle StyleOf(ChatFormat format) {
  switch (format) {
    case ChatFormat::kMistralV1:
      return {" [INST] ", " [/INST]", " ", false, true};
    case ChatFormat::kMistralV3:
      return {"[INST] ", "[/INST]", " ", true, false};
    default:  // kMistralV3Tekken
      return {"[INST]", "[/INST]", "", false, false};
  }
}

absl::Status RenderMistral(ChatFormat format, absl::Span<const ChatMessage> messages,
                           const ChatOptions& options, ChatRendering* out) {
  const MistralStyle style = StyleOf(format);
  const bool has_system = messages[0].role == "system";
  const size_t first = has_system ? 1 : 0;
  absl::Status status = CheckAlternation(format, messages, first);
  if (!status.ok()) return status;
  // The one user turn that carries the system message, if any.
  const size_t system_turn = !has_system                  ? messages.size()
                             : style.system_on_first_user ? first
                                                          : messages.size() - 1;
  out->text = options.bos_token;
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& message = messages[i];
    if (message.role == "assistant") {
      const absl::string_view reply =
          style.strip_reply ? PyStrip(message.content) : absl::string_view(message.content);
      AppendTrained(out, {style.reply_open, reply, options.eos_token});
      continue;
    }
    out->text.append(style.inst_open.data(), style.inst_open.size());
    if (i == system_turn) absl::StrAppend(&out->text, messages[0].content, "\n\n");
    absl::StrAppend(&out->text, message.content, style.inst_close);
  }
  return absl::OkStatus();
}

// Harmony: a fixed system message, the user's system prompt as developer instructions,
// assistant replies on the final channel.
absl::Status RenderGptOss(absl::Span<const ChatMessage> messages, const ChatOptions& options,
                          ChatRendering* out) {
  const std::string date = options.date_string.empty() ? TodayLocalDate() : options.date_string;
  absl::StrAppend(&out->text, "<|start|>system<|message|>", options.model_identity,
                  "\nKnowledge cutoff: 2024-06\nCurrent date: ", date,
                  "\n\nReasoning: ", options.reasoning_effort,
                  "\n\n# Valid channels: analysis, commentary, final. Channel must be "
                  "included for every message.<|end|>");
  const bool has_system = messages[0].role == "system";
  if (has_system && !messages[0].content.empty()) {
    absl::StrAppend(&out->text, "<|start|>developer<|message|># Instructions\n\n",
                    messages[0].content, "\n\n<|end|>");
  }
  for (size_t i = has_system ? 1 : 0; i < messages.size(); ++i) {
    const ChatMessage& message = messages[i];
    if (message.role == "user") {
      absl::StrAppend(&out->text, "<|start|>user<|message|>", message.content, "<|end|>");
      continue;
    }
    if (absl::StrContains(message.content, "<|channel|>analysis<|message|>") ||
        absl::StrContains(message.content, "<|channel|>final<|message|>")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "messages[", i, "] is an assistant message whose content holds a harmony ",
          "channel header (<|channel|>analysis<|message|> or <|channel|>final<|message|>); ",
          "the gptoss chat template rejects it: pass only the final answer as content"));
    }
    out->text.append("<|start|>assistant");
    if (i + 1 == messages.size() && !options.add_generation_prompt) {
      AppendTrained(out, {"<|channel|>final<|message|>", message.content, "<|return|>"});
    } else {
      AppendTrained(out, {"<|channel|>final<|message|>", message.content});
      out->text.append("<|end|>");
    }
  }
  if (options.add_generation_prompt) out->text.append("<|start|>assistant");
  return absl::OkStatus();
}

constexpr ChatFormat kAllFormats[] = {ChatFormat::kLlama2,          ChatFormat::kLlama3,
                                      ChatFormat::kQwen3,           ChatFormat::kQwen25,
                                      ChatFormat::kMistralV1,       ChatFormat::kMistralV3,
                                      ChatFormat::kMistralV3Tekken, ChatFormat::kGptOss};
constexpr absl::string_view kFormatList =
    "llama2, llama3, qwen3, qwen2.5, mistral-v1, mistral-v3, mistral-v3-tekken and gptoss";

// Each official Mistral template by the Jinja expressions that decide its text, written
// with single quotes (the template is compared with its double quotes made single).
struct MistralTemplate {
  ChatFormat format;
  absl::string_view user_turn;    // a user turn without the system message
  absl::string_view system_turn;  // the user turn that carries it
  absl::string_view system_when;  // the condition that picks that turn
  absl::string_view reply;        // an assistant turn
};

constexpr MistralTemplate kMistralTemplates[] = {
    {ChatFormat::kMistralV1, "' [INST] ' + message['content'] + ' [/INST]'",
     "' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]'",
     "loop.first and system_message is defined", "' ' + message['content'] + eos_token"},
    {ChatFormat::kMistralV3, "'[INST] ' + message['content'] + '[/INST]'",
     "'[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]'",
     "loop.last and system_message is defined", "' ' + message['content']|trim + eos_token"},
    {ChatFormat::kMistralV3Tekken, "'[INST]' + message['content'] + '[/INST]'",
     "'[INST]' + system_message + '\\n\\n' + message['content'] + '[/INST]'",
     "loop.last and system_message is defined", "{{- message['content'] + eos_token"},
};

// An [INST] template without <<SYS>>: one of Mistral's, or InvalidArgument naming the
// part that differs.
absl::StatusOr<ChatFormat> DetectMistral(absl::string_view chat_template) {
  if (absl::StrContains(chat_template, "[SYSTEM_PROMPT]")) {
    return absl::InvalidArgumentError(
        "the chat_template is a Mistral one with a [SYSTEM_PROMPT] block (the v7 tokenizer's, "
        "e.g. Mistral Small 3 or Mistral Large 2411), which no built-in format renders");
  }
  std::string source(chat_template);
  absl::c_replace(source, '"', '\'');
  for (const MistralTemplate& t : kMistralTemplates) {
    if (!absl::StrContains(source, t.user_turn)) continue;
    for (absl::string_view part : {t.system_turn, t.system_when, t.reply}) {
      if (!absl::StrContains(source, part)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the chat_template prints user turns as Mistral's ", ChatFormatName(t.format),
            " template does (", t.user_turn, ") but lacks its `", part,
            "`, so it renders differently from the built-in ", ChatFormatName(t.format),
            "; name the format if its rendering is that one"));
      }
    }
    return t.format;
  }
  return absl::InvalidArgumentError(
      "the chat_template uses [INST] without a <<SYS>> block, but its user turns are none of "
      "Mistral's official templates (' [INST] ' ... ' [/INST]' mistral-v1, '[INST] ' ... "
      "'[/INST]' mistral-v3, '[INST]' ... '[/INST]' mistral-v3-tekken); e.g. the templates "
      "Mistral 7B Instruct v0.1 / v0.2 and Mixtral 8x7B Instruct shipped before 2024, which "
      "take no system message, render differently. Name the format if its rendering is one "
      "of them");
}

// A ChatML template with Qwen2.5's default system prompt: Qwen2.5's if it prints each
// turn as Qwen2.5's does (quote style aside), else InvalidArgument naming that line.
absl::StatusOr<ChatFormat> DetectQwen25(absl::string_view chat_template) {
  constexpr absl::string_view kTurn =
      "'<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n'";
  std::string source(chat_template);
  absl::c_replace(source, '"', '\'');
  if (absl::StrContains(source, kTurn)) return ChatFormat::kQwen25;
  return absl::InvalidArgumentError(absl::StrCat(
      "the chat_template has Qwen2.5's default system prompt but not its turn `", kTurn,
      "`, so it renders differently from the built-in qwen2.5; name the format if its "
      "rendering is that one"));
}

}  // namespace

absl::StatusOr<ChatFormat> ChatFormatFromName(absl::string_view name) {
  for (ChatFormat format : kAllFormats) {
    if (name == ChatFormatName(format)) return format;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown chat format \"", absl::CEscape(name),
                                                 "\"; the formats are ", kFormatList));
}

absl::string_view ChatFormatName(ChatFormat format) {
  switch (format) {
    case ChatFormat::kLlama2:
      return "llama2";
    case ChatFormat::kLlama3:
      return "llama3";
    case ChatFormat::kQwen3:
      return "qwen3";
    case ChatFormat::kGptOss:
      return "gptoss";
    case ChatFormat::kQwen25:
      return "qwen2.5";
    case ChatFormat::kMistralV1:
      return "mistral-v1";
    case ChatFormat::kMistralV3:
      return "mistral-v3";
    case ChatFormat::kMistralV3Tekken:
      return "mistral-v3-tekken";
  }
  return "unknown";
}

absl::StatusOr<ChatFormat> DetectChatFormat(absl::string_view chat_template) {
  auto has = [&](absl::string_view marker) { return absl::StrContains(chat_template, marker); };
  if (PyStrip(chat_template).empty()) {
    return absl::NotFoundError(absl::StrCat(
        "the chat_template is empty; name the chat format instead (", kFormatList, ")"));
  }
  if (has("<|channel|>")) return ChatFormat::kGptOss;
  if (has("<|start_header_id|>")) {
    if (has("Cutting Knowledge Date")) {
      return absl::InvalidArgumentError(
          "the chat_template is a Llama 3.1-style one (a dated system header, 'Cutting "
          "Knowledge Date'), which renders differently from the built-in llama3 (Llama 3)");
    }
    return ChatFormat::kLlama3;
  }
  if (has("<|im_start|>")) {
    if (has("</think>")) return ChatFormat::kQwen3;
    if (has(kQwen25DefaultSystem)) return DetectQwen25(chat_template);
    return absl::InvalidArgumentError(
        "the chat_template is ChatML (<|im_start|>) with neither Qwen3's <think> handling nor "
        "Qwen2.5's default system prompt (\"You are Qwen, created by Alibaba Cloud. ...\"), "
        "e.g. Qwen2's or Qwen2.5-Math's, which render differently from the built-in qwen3 "
        "and qwen2.5");
  }
  if (has("[INST]")) {
    if (has("<<SYS>>")) return ChatFormat::kLlama2;
    return DetectMistral(chat_template);
  }
  return absl::NotFoundError(
      "the chat_template has none of the markers of the built-in formats (<|channel|> "
      "gptoss, <|start_header_id|> llama3, <|im_start|> qwen3 / qwen2.5, [INST] llama2 / "
      "mistral-v1 / mistral-v3 / mistral-v3-tekken); name the format if its rendering is one "
      "of them");
}

absl::StatusOr<ChatRendering> RenderChat(ChatFormat format, absl::Span<const ChatMessage> messages,
                                         const ChatOptions& options) {
  absl::Status status = CheckConversation(format, messages, options);
  if (!status.ok()) return status;
  ChatRendering out;
  switch (format) {
    case ChatFormat::kLlama2:
      status = RenderLlama2(messages, options, &out);
      break;
    case ChatFormat::kLlama3:
      status = RenderLlama3(messages, options, &out);
      break;
    case ChatFormat::kQwen3:
      status = RenderQwen3(messages, options, &out);
      break;
    case ChatFormat::kGptOss:
      status = RenderGptOss(messages, options, &out);
      break;
    case ChatFormat::kQwen25:
      status = RenderQwen25(messages, options, &out);
      break;
    case ChatFormat::kMistralV1:
    case ChatFormat::kMistralV3:
    case ChatFormat::kMistralV3Tekken:
      status = RenderMistral(format, messages, options, &out);
      break;
  }
  if (!status.ok()) return status;
  return out;
}

}  // namespace megatrain
