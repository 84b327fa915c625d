// Preference pairs (data/preference.h) tokenized as TRL's DPOTrainer tokenizes them, cut
// as its collator cuts them, and the bad lines refused naming the problem.
#include "engine/data/preference.h"

#include <string>

#include "engine/data/byte_tokenizer.h"
#include "gtest/gtest.h"

namespace megatrain {
namespace {

std::vector<int32_t> Bytes(const std::string& s) {
  return std::vector<int32_t>(s.begin(), s.end());
}

TEST(PreferencePair, StandardPairIsBosPromptThenCompletionWithEos) {
  ByteTokenizer tok;
  absl::StatusOr<PreferencePair> p = PreferencePairFromLine(
      R"({"prompt": "2+2=", "chosen": "4", "rejected": "5"})", std::nullopt, {}, tok);
  ASSERT_TRUE(p.ok()) << p.status();
  std::vector<int32_t> prompt = {tok.bos_id()};
  for (int32_t b : Bytes("2+2=")) prompt.push_back(b);
  EXPECT_EQ(p->prompt, prompt);
  EXPECT_EQ(p->chosen, (std::vector<int32_t>{'4', tok.eos_id()}));
  EXPECT_EQ(p->rejected, (std::vector<int32_t>{'5', tok.eos_id()}));
  EXPECT_FALSE(p->prefix_mismatch);
}

TEST(PreferencePair, ConversationalPairRendersThePromptWithTheGenerationPrompt) {
  ByteTokenizer tok;
  absl::StatusOr<PreferencePair> p = PreferencePairFromLine(
      R"({"prompt": [{"role": "user", "content": "hi"}],
          "chosen": [{"role": "assistant", "content": "hello"}],
          "rejected": [{"role": "assistant", "content": "go away"}]})",
      ChatFormat::kQwen25, {}, tok);
  ASSERT_TRUE(p.ok()) << p.status();
  const std::string prompt =
      "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
      "assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
  EXPECT_EQ(p->prompt, Bytes(prompt));
  EXPECT_EQ(p->chosen, Bytes("hello<|im_end|>\n"));
  EXPECT_EQ(p->rejected, Bytes("go away<|im_end|>\n"));
}

PreferenceCut Cut(int64_t max_length, PreferenceTruncation truncation) {
  PreferenceCut cut;
  cut.max_length = max_length;
  cut.truncation = truncation;
  return cut;
}

TEST(PreferencePair, SequencesAreCutAsTrlsCollatorCutsThem) {
  PreferencePair pair;
  pair.prompt = {1, 2, 3};
  pair.chosen = {4, 5, 6, 7};
  pair.rejected = {8};
  auto both = PreferenceSequences(pair, Cut(5, PreferenceTruncation::kKeepStart));
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(both->first.ids, (std::vector<int32_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(both->first.completion, (std::vector<uint8_t>{0, 0, 0, 1, 1}));
  EXPECT_EQ(both->second.ids, (std::vector<int32_t>{1, 2, 3, 8}));
  EXPECT_EQ(both->second.completion, (std::vector<uint8_t>{0, 0, 0, 1}));
  both = PreferenceSequences(pair, Cut(5, PreferenceTruncation::kKeepEnd));
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(both->first.ids, (std::vector<int32_t>{3, 4, 5, 6, 7}));
  EXPECT_EQ(both->first.completion, (std::vector<uint8_t>{0, 1, 1, 1, 1}));
  both = PreferenceSequences(pair, Cut(0, PreferenceTruncation::kKeepStart));  // uncut
  ASSERT_TRUE(both.ok());
  EXPECT_EQ(both->first.ids.size(), 7u);
  EXPECT_EQ(PreferenceSequences(pair, Cut(3, PreferenceTruncation::kKeepStart)).status().message(),
            "the prompt is 3 tokens, and max_length 3 keeps no completion token after it "
            "(truncation keep_start)");
  EXPECT_TRUE(PreferenceSequences(pair, Cut(3, PreferenceTruncation::kKeepEnd)).ok());
}

// TRL's tokenizer step: the prompt keeps its end, each completion its start; then the
// collator's max_length over the whole.
TEST(PreferencePair, ThePromptKeepsItsEndAndTheCompletionsTheirStartBeforeMaxLength) {
  PreferencePair pair;
  pair.prompt = {1, 2, 3, 4};
  pair.chosen = {5, 6, 7};
  pair.rejected = {8};
  PreferenceCut cut;
  cut.max_prompt_length = 2;
  cut.max_completion_length = 2;
  auto both = PreferenceSequences(pair, cut);
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(both->first.ids, (std::vector<int32_t>{3, 4, 5, 6}));
  EXPECT_EQ(both->first.completion, (std::vector<uint8_t>{0, 0, 1, 1}));
  EXPECT_EQ(both->second.ids, (std::vector<int32_t>{3, 4, 8}));
  cut.max_length = 3;  // after the prompt's cut it leaves a completion token: accepted
  both = PreferenceSequences(pair, cut);
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(both->first.ids, (std::vector<int32_t>{3, 4, 5}));
  cut.max_prompt_length = 0;  // the whole prompt fills max_length
  EXPECT_FALSE(PreferenceSequences(pair, cut).ok());
}

TEST(PreferencePair, BadLinesAreRefusedNamingTheProblem) {
  ByteTokenizer tok;
  auto error = [&](const std::string& line) {
    return std::string(
        PreferencePairFromLine(line, ChatFormat::kQwen25, {}, tok).status().message());
  };
  EXPECT_EQ(error("[1]"), "expected a JSON object {prompt, chosen, rejected}");
  EXPECT_EQ(error(R"({"prompt": "a", "chosen": "b"})"), "field 'rejected' missing");
  EXPECT_EQ(error(R"({"prompt": "a", "chosen": "b", "rejected": "b"})"),
            "chosen and rejected are the same: nothing to prefer");
  EXPECT_EQ(error(R"({"prompt": "a", "chosen": 3, "rejected": "b"})"),
            "field 'chosen' is a number, expected a string or a message list");
  EXPECT_EQ(error(R"({"prompt": "a", "chosen": [], "rejected": "b"})"),
            "field 'chosen' is a message list but the prompt is not: a pair is all strings or "
            "all message lists");
  EXPECT_EQ(error(R"({"prompt": [{"role": "user", "content": "a"}],
                      "chosen": [{"role": "user", "content": "b"}],
                      "rejected": [{"role": "assistant", "content": "c"}]})"),
            "chosen must end with an assistant message (the reply)");
  EXPECT_EQ(error(R"({"prompt": [{"role": "bot", "content": "a"}], "chosen": [],
                      "rejected": [{"role": "assistant", "content": "c"}]})"),
            "prompt[0].role is 'bot'; expected system, user or assistant");
  EXPECT_EQ(std::string(PreferencePairFromLine(
                            R"({"prompt": [], "chosen": [{"role": "assistant", "content": "b"}],
                                "rejected": [{"role": "assistant", "content": "c"}]})",
                            std::nullopt, {}, tok)
                            .status()
                            .message()),
            "a conversational pair needs the model family's chat template (data.chat_template)");
}

}  // namespace
}  // namespace megatrain
