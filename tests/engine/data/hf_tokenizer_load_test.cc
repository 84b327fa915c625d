// HfTokenizer on small hand-written tokenizer.json files: the errors a user can cause,
// bos / eos from tokenizer_config.json, BPE merge order, and ids that stay the same from
// many threads. No node needed.
#include <sys/stat.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/data/hf_tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/util/deadline.h"

namespace megatrain {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

// Under the running test's own name: ctest runs each test in its own process, in
// parallel, and they share TempDir().
std::string WriteFile(const std::string& name, const std::string& text) {
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string path = absl::StrCat(::testing::TempDir(), "/", test->test_suite_name(), ".",
                                        test->name(), "-", name);
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// A byte-level tokenizer over "a", "b", "c" and " " (Ġ), with merges a+b then ab+c.
Json TinyByteLevel() {
  return Json::parse(R"({
    "normalizer": null,
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": " ?\\p{L}+|\\s+"}, "behavior": "Isolated",
       "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
       "use_regex": false}]},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "fuse_unk": false,
              "byte_fallback": false, "ignore_merges": false,
              "vocab": {"a": 0, "b": 1, "c": 2, "Ġ": 3, "ab": 4, "abc": 5, "Ġa": 6},
              "merges": ["a b", ["ab", "c"], "Ġ a"]},
    "decoder": {"type": "ByteLevel"},
    "added_tokens": [{"id": 7, "content": "<eos>", "special": true, "normalized": false,
                      "lstrip": false, "rstrip": false, "single_word": false}]
  })");
}

absl::StatusOr<std::unique_ptr<HfTokenizer>> LoadJson(const Json& doc,
                                                      const std::string& config = "") {
  const std::string path = WriteFile("tokenizer.json", doc.dump());
  return HfTokenizer::Load(path, config.empty() ? "" : WriteFile("tokenizer_config.json", config));
}

// Found by fuzz_tokenizer_json: one huge id made Load() allocate a table for it.
TEST(HfTokenizerLoadTest, AnIdBeyondTheSupportedRangeIsRefused) {
  Json doc = TinyByteLevel();
  doc["model"]["vocab"]["\u0120a"] = 222222227;
  auto tok = LoadJson(doc);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("has id 222222227; ids must be integers"));
  // Found by fuzz_tokenizer_json too: a float id (UB when cast to int) and a negative one.
  doc = TinyByteLevel();
  doc["model"]["vocab"]["\u0120a"] = 7.77778e12;
  EXPECT_THAT(LoadJson(doc).status().message(), HasSubstr("has id 7777780000000.0"));
  doc = TinyByteLevel();
  doc["added_tokens"][0]["id"] = -3;
  EXPECT_THAT(LoadJson(doc).status().message(), HasSubstr("'<eos>' has id -3"));
  // And a Strip decoder count that is a huge float.
  doc = TinyByteLevel();
  doc["decoder"] = Json::parse(R"({"type": "Strip", "content": " ", "start": 1.1e73, "stop": 0})");
  EXPECT_THAT(LoadJson(doc).status().message(), HasSubstr("decoder Strip start is"));
}

TEST(HfTokenizerLoadTest, MissingFileIsNotFoundNamingThePath) {
  auto tok = HfTokenizer::Load("/nonexistent/tokenizer.json", "");
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(tok.status().message(), HasSubstr("/nonexistent/tokenizer.json"));
}

TEST(HfTokenizerLoadTest, MissingConfigIsNotFound) {
  const std::string path = WriteFile("tokenizer.json", TinyByteLevel().dump());
  auto tok = HfTokenizer::Load(path, "/nonexistent/tokenizer_config.json");
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(tok.status().message(), HasSubstr("tokenizer_config.json"));
}

TEST(HfTokenizerLoadTest, BacktrackingRegexFailsEncodeNamingTheTokenizerFile) {
  Json doc = TinyByteLevel();
  doc["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(a+)+$";
  const std::string path = WriteFile("tokenizer.json", doc.dump());
  auto tok = HfTokenizer::Load(path, "");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const absl::StatusOr<std::vector<int32_t>> ids = (*tok)->Encode(std::string(4096, 'a') + "b");
  ASSERT_FALSE(ids.ok());
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ids.status().message(), HasSubstr("tokenizer " + path + ": the pre-tokenizer regex"));
  EXPECT_THAT(ids.status().message(), HasSubstr("'aaaa"));
  EXPECT_EQ(*(*tok)->Encode("ab"), (std::vector<int32_t>{4}));  // other text still encodes
}

TEST(HfTokenizerLoadTest, FifoAsTokenizerJsonIsRefusedWithoutBlocking) {
  const std::string path = WriteFile("fifo-tokenizer.json", "");
  ASSERT_EQ(std::remove(path.c_str()), 0);
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  std::optional<absl::Status> s =
      testing::RunWithin(5, [&] { return HfTokenizer::Load(path, "").status(); });
  std::remove(path.c_str());
  ASSERT_TRUE(s.has_value()) << "loading a FIFO blocked";
  EXPECT_EQ(s->code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s->message(), HasSubstr(path + " is not a regular file (a FIFO)"));
}

TEST(HfTokenizerLoadTest, BadJsonIsInvalidArgumentNamingTheFile) {
  auto tok = HfTokenizer::Load(WriteFile("tokenizer.json", "{\"model\": "), "");
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("tokenizer.json: not valid JSON"));
}

TEST(HfTokenizerLoadTest, FieldOfWrongTypeIsInvalidArgument) {
  Json doc = TinyByteLevel();
  doc["model"]["vocab"]["a"] = "zero";
  auto tok = LoadJson(doc);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("tokenizer.json: token 'a' has id \"zero\""));
  doc = TinyByteLevel();
  doc["model"]["merges"] = 3;
  tok = LoadJson(doc);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("tokenizer.json: unexpected structure"));
}

TEST(HfTokenizerLoadTest, UnsupportedPreTokenizerNamesComponentAndFile) {
  Json doc = TinyByteLevel();
  doc["pre_tokenizer"] = {{"type", "Whitespace"}};
  auto tok = LoadJson(doc);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(),
              HasSubstr("tokenizer.json: pre_tokenizer type 'Whitespace' is not supported"));
}

TEST(HfTokenizerLoadTest, UnsupportedNormalizerModelAndDecoderAreRejected) {
  Json doc = TinyByteLevel();
  doc["normalizer"] = {{"type", "Lowercase"}};
  EXPECT_THAT(LoadJson(doc).status().message(),
              HasSubstr("normalizer type 'Lowercase' is not supported"));
  doc = TinyByteLevel();
  doc["model"]["type"] = "WordPiece";
  EXPECT_THAT(LoadJson(doc).status().message(),
              HasSubstr("model type 'WordPiece' is not supported"));
  doc = TinyByteLevel();
  doc["decoder"] = {{"type", "Metaspace"}};
  EXPECT_THAT(LoadJson(doc).status().message(),
              HasSubstr("decoder type 'Metaspace' is not supported"));
  doc = TinyByteLevel();
  doc["added_tokens"][0]["lstrip"] = true;
  EXPECT_THAT(LoadJson(doc).status().message(), HasSubstr("with lstrip true is not supported"));
}

TEST(HfTokenizerLoadTest, MergeOutsideTheVocabIsInvalidArgument) {
  Json doc = TinyByteLevel();
  doc["model"]["merges"].push_back("b c");
  auto tok = LoadJson(doc);
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tok.status().message(), HasSubstr("merge 3 ('b' 'c')"));
}

TEST(HfTokenizerLoadTest, MergesApplyByRankAndAddedTokensAreNeverSplit) {
  auto tok = LoadJson(TinyByteLevel());
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 8);
  EXPECT_EQ(*(*tok)->Encode("abc"), (std::vector<int32_t>{5}));
  EXPECT_EQ(*(*tok)->Encode("cab"), (std::vector<int32_t>{2, 4}));
  // "Ġa" ranks after "ab", so " ab" is Ġ + ab, not Ġa + b.
  EXPECT_EQ(*(*tok)->Encode(" ab"), (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(*(*tok)->Encode("ab<eos>c"), (std::vector<int32_t>{4, 7, 2}));
  EXPECT_EQ(*(*tok)->Encode(""), (std::vector<int32_t>{}));
  EXPECT_EQ((*tok)->Decode({3, 4, 7, 2}), " ab<eos>c");
  EXPECT_EQ((*tok)->Decode({8}), "");  // outside the vocab
}

TEST(HfTokenizerLoadTest, AddedTokensMayStartWithDifferentBytes) {
  Json doc = TinyByteLevel();
  Json hashes = doc["added_tokens"][0];
  hashes["id"] = 8;
  hashes["content"] = "##";
  doc["added_tokens"].push_back(hashes);
  auto tok = LoadJson(doc);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ(*(*tok)->Encode("a##b<eos><eos>#c<"), (std::vector<int32_t>{0, 8, 1, 7, 7, 2}));
}

TEST(HfTokenizerLoadTest, EachTokenizerKeepsItsOwnIdsOnEveryThread) {
  // Pre-tokens are cached per thread and tokenizer: more tokenizers than a thread keeps
  // caches for, two of them disagreeing on "abc", used in turn from several threads.
  Json without_abc = TinyByteLevel();
  without_abc["model"]["merges"].erase(1);
  std::vector<std::unique_ptr<HfTokenizer>> tokenizers;
  for (int i = 0; i < 6; ++i) {
    auto tok = LoadJson(i % 2 == 0 ? TinyByteLevel() : without_abc);
    ASSERT_TRUE(tok.ok()) << tok.status();
    tokenizers.push_back(*std::move(tok));
  }
  const std::vector<int32_t> with_merge = {5, 3, 2, 4, 4};  // abc Ġ c ab ab
  const std::vector<int32_t> without_merge = {4, 2, 3, 2, 4, 4};
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int round = 0; round < 200; ++round) {
        for (size_t i = 0; i < tokenizers.size(); ++i) {
          if (*tokenizers[i]->Encode("abc cabab") != (i % 2 == 0 ? with_merge : without_merge)) {
            ++mismatches;
          }
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// A SentencePiece-style tokenizer: no pre-tokenizer, spaces become U+2581 ("▁").
Json TinyMetaspace() {
  return Json::parse(R"({
    "normalizer": {"type": "Sequence", "normalizers": [
      {"type": "Prepend", "prepend": "▁"},
      {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
    "pre_tokenizer": null,
    "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "fuse_unk": true,
              "byte_fallback": true,
              "vocab": {"<unk>": 0, "▁": 1, "a": 2, "b": 3, "▁a": 4, "▁b": 5, "<0x21>": 6},
              "merges": ["▁ a", "▁ b"]},
    "decoder": null,
    "added_tokens": []
  })");
}

TEST(HfTokenizerLoadTest, MetaspaceWordsMergeAsOneWord) {
  auto tok = LoadJson(TinyMetaspace());
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ(*(*tok)->Encode("a  b!?"), (std::vector<int32_t>{4, 1, 5, 6, 0}));
  // With a token that has "▁" after another code point, merges can cross the spaces.
  Json crossing = TinyMetaspace();
  crossing["model"]["vocab"]["a▁"] = 7;
  crossing["model"]["merges"].insert(crossing["model"]["merges"].begin(), "a ▁");
  tok = LoadJson(crossing);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ(*(*tok)->Encode("a  b!?"), (std::vector<int32_t>{1, 7, 5, 6, 0}));
}

TEST(HfTokenizerLoadTest, BosAndEosComeFromTheConfig) {
  auto tok = LoadJson(TinyByteLevel(), R"({"bos_token": {"content": "a"}, "eos_token": "<eos>"})");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->bos_id(), 0);
  EXPECT_EQ((*tok)->eos_id(), 7);
  tok =
      LoadJson(TinyByteLevel(), R"({"bos_token": "a", "add_bos_token": false, "eos_token": null})");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->bos_id(), -1);
  EXPECT_EQ((*tok)->eos_id(), -1);
  tok = LoadJson(TinyByteLevel(), R"({"eos_token": "<missing>"})");
  EXPECT_THAT(tok.status().message(), HasSubstr("special token '<missing>' is not in"));
}

TEST(HfTokenizerLoadTest, LoadHfTokenizerReturnsTheInterface) {
  const std::string path = WriteFile("tokenizer.json", TinyByteLevel().dump());
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = LoadHfTokenizer(path, "");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ(*(*tok)->Encode("abc"), (std::vector<int32_t>{5}));
  EXPECT_EQ((*tok)->name(), absl::StrCat("hf-bpe:", path));
}

}  // namespace
}  // namespace megatrain
