// Two small hand-made tokenizer.json files, one of each BPE kind megatrain decodes, for
// the decoder and text stream tests:
//   byte-level BPE (Qwen, Llama 3, GPT-OSS): every byte is a token of the GPT-2 alphabet,
//     ids 0..255 in byte order; a few merges; decoder ByteLevel.
//   SentencePiece-style BPE with byte fallback (Llama 2, Mistral): spaces become U+2581
//     ("▁") and one is prepended; code points outside the vocab become "<0xXX>" tokens;
//     decoder Replace("▁", " "), ByteFallback, Fuse, Strip(" ", start 1).
#pragma once

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "engine/data/bpe_text.h"
#include "engine/data/hf_tokenizer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace megatrain::testing {

// Byte-level ids beyond the 256 bytes.
namespace byte_level {
constexpr int32_t kHello = 259;       // "hello"
constexpr int32_t kSpaceWorld = 264;  // " world"
constexpr int32_t kE4Bd = 265;        // bytes E4 BD: the first two of 你 (E4 BD A0)
constexpr int32_t kEndOfText = 300;   // "<|endoftext|>", special
constexpr int32_t kImStart = 301;     // "<|im_start|>", special
constexpr int32_t kTool = 302;        // "<tool>", added, not special
constexpr int32_t kVocabSize = 303;   // 266..299 stand for nothing
}  // namespace byte_level

// Byte-fallback ids.
namespace byte_fallback {
constexpr int32_t kUnk = 0, kBos = 1, kEos = 2;
constexpr int32_t Byte(int b) { return 3 + b; }  // "<0xXX>"
constexpr int32_t kMetaspace = 259;              // "▁"
constexpr int32_t kSpaceHello = 271;             // "▁hello"
constexpr int32_t kSpaceWorld = 276;             // "▁world"
constexpr int32_t kShi = 277;                    // "世", a code point in the vocab
constexpr int32_t kVocabSize = 278;
}  // namespace byte_fallback

inline nlohmann::json ByteLevelTokenizerJson() {
  nlohmann::json doc = nlohmann::json::parse(R"({
    "normalizer": {"type": "NFC"},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex":
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
       "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
       "use_regex": false}]},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "fuse_unk": false,
              "byte_fallback": false, "ignore_merges": false, "vocab": {}, "merges": []},
    "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
                "use_regex": false},
    "added_tokens": [
      {"id": 300, "content": "<|endoftext|>", "special": true, "normalized": false,
       "lstrip": false, "rstrip": false, "single_word": false},
      {"id": 301, "content": "<|im_start|>", "special": true, "normalized": false,
       "lstrip": false, "rstrip": false, "single_word": false},
      {"id": 302, "content": "<tool>", "special": false, "normalized": false,
       "lstrip": false, "rstrip": false, "single_word": false}]
  })");
  nlohmann::json& vocab = doc["model"]["vocab"];
  for (int b = 0; b < 256; ++b) vocab[ByteLevelEncode(std::string(1, static_cast<char>(b)))] = b;
  const std::string e4 = ByteLevelEncode("\xE4"), bd = ByteLevelEncode("\xBD");
  const std::pair<std::string, std::string> merges[] = {
      {"h", "e"}, {"l", "l"},   {"he", "ll"}, {"hell", "o"},  {"Ġ", "w"},
      {"o", "r"}, {"Ġw", "or"}, {"l", "d"},   {"Ġwor", "ld"}, {e4, bd}};
  int32_t id = 256;
  for (const auto& [left, right] : merges) {
    doc["model"]["merges"].push_back({left, right});
    vocab[left + right] = id++;
  }
  return doc;
}

inline nlohmann::json ByteFallbackTokenizerJson() {
  nlohmann::json doc = nlohmann::json::parse(R"({
    "normalizer": {"type": "Sequence", "normalizers": [
      {"type": "Prepend", "prepend": "▁"},
      {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
    "pre_tokenizer": null,
    "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "fuse_unk": true,
              "byte_fallback": true, "ignore_merges": false,
              "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2}, "merges": []},
    "decoder": {"type": "Sequence", "decoders": [
      {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
      {"type": "ByteFallback"}, {"type": "Fuse"},
      {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "added_tokens": [
      {"id": 0, "content": "<unk>", "special": true, "normalized": false,
       "lstrip": false, "rstrip": false, "single_word": false},
      {"id": 1, "content": "<s>", "special": true, "normalized": false,
       "lstrip": false, "rstrip": false, "single_word": false},
      {"id": 2, "content": "</s>", "special": true, "normalized": false,
       "lstrip": false, "rstrip": false, "single_word": false}]
  })");
  nlohmann::json& vocab = doc["model"]["vocab"];
  for (int b = 0; b < 256; ++b) vocab[absl::StrFormat("<0x%02X>", b)] = 3 + b;
  int32_t id = 259;
  for (const char* symbol : {"▁", "h", "e", "l", "o", "w", "r", "d"}) vocab[symbol] = id++;
  const std::pair<std::string, std::string> merges[] = {
      {"▁", "h"}, {"e", "l"}, {"▁h", "el"}, {"l", "o"}, {"▁hel", "lo"},
      {"▁", "w"}, {"o", "r"}, {"▁w", "or"}, {"l", "d"}, {"▁wor", "ld"}};
  for (const auto& [left, right] : merges) {
    doc["model"]["merges"].push_back({left, right});
    vocab[left + right] = id++;
  }
  vocab["世"] = id;
  return doc;
}

// Writes `doc` under the running test's name (ctest runs tests in parallel, sharing
// TempDir()) and loads it without a tokenizer_config.json.
inline absl::StatusOr<std::unique_ptr<HfTokenizer>> LoadTokenizerJson(const nlohmann::json& doc) {
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name =
      absl::StrReplaceAll(absl::StrCat(test->test_suite_name(), ".", test->name()), {{"/", "_"}});
  const std::string path = absl::StrCat(::testing::TempDir(), "/", name, "-tokenizer.json");
  std::ofstream(path, std::ios::binary) << doc.dump();
  return HfTokenizer::Load(path, "");
}

}  // namespace megatrain::testing
