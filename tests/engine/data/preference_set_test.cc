// A DPO job's data file (data/preference_set.h): every pair tokenized and cut, a bad line
// refused naming path:line and its problem or left out and counted, and the fingerprint
// that a reference cache is tied to following the data.
#include "engine/data/preference_set.h"

#include <string>

#include "engine/data/byte_tokenizer.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace megatrain {
namespace {

using testing::TempDir;
using testing::WriteFile;

constexpr char kGood[] =
    R"({"prompt": "2+2=", "chosen": "4", "rejected": "5"})"
    "\n\n"
    R"({"prompt": "capital of France? ", "chosen": "Paris", "rejected": "Rome"})"
    "\n";

TEST(PreferenceSet, EveryPairIsTokenizedCutAndFingerprinted) {
  TempDir dir;
  const std::string path = dir.Join("pairs.jsonl");
  WriteFile(path, kGood);
  ByteTokenizer tok;
  PreferenceSetOptions o;
  o.path = path;
  absl::StatusOr<PreferenceSet> set = LoadPreferenceSet(o, tok);
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_EQ(set->pairs->size(), 2u);
  EXPECT_EQ(set->stats.lines, 2);
  EXPECT_EQ(set->stats.examples, 2);
  const PreferenceSequence& chosen = (*set->pairs)[0].first;
  EXPECT_EQ(chosen.ids.size(), 1 + 4 + 2u);  // bos, "2+2=", "4", eos
  EXPECT_EQ(set->stats.trained_tokens, 2 + 2 + 6 + 5);  // completions and their eos

  o.cut.max_length = 24;  // the second pair's chosen cut (26 tokens): another fingerprint
  absl::StatusOr<PreferenceSet> cut = LoadPreferenceSet(o, tok);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ((*cut->pairs)[1].first.ids.size(), 24u);
  EXPECT_NE(cut->fingerprint, set->fingerprint);
  o.cut.max_length = 0;
  EXPECT_EQ(LoadPreferenceSet(o, tok)->fingerprint, set->fingerprint);
}

TEST(PreferenceSet, ABadLineIsRefusedNamingItOrLeftOutAndCounted) {
  TempDir dir;
  const std::string path = dir.Join("pairs.jsonl");
  WriteFile(path, std::string(kGood) +
                      R"({"prompt": "a", "chosen": "b"})" "\n"
                      R"({"prompt": "a", "chosen": "same", "rejected": "same"})" "\n");
  ByteTokenizer tok;
  PreferenceSetOptions o;
  o.path = path;
  absl::StatusOr<PreferenceSet> set = LoadPreferenceSet(o, tok);
  ASSERT_EQ(set.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(set.status().message().find(path + ":4: "), std::string::npos) << set.status();
  EXPECT_NE(set.status().message().find("rejected"), std::string::npos) << set.status();

  o.skip_bad_lines = true;
  set = LoadPreferenceSet(o, tok);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->pairs->size(), 2u);
  EXPECT_EQ(set->stats.bad_lines, 2);
  ASSERT_EQ(set->stats.first_errors.size(), 2u);
  EXPECT_NE(set->stats.first_errors[1].find(path + ":5: "), std::string::npos);
}

TEST(PreferenceSet, AFileWithNoUsablePairIsRefused) {
  TempDir dir;
  const std::string path = dir.Join("pairs.jsonl");
  WriteFile(path, "not json\n");
  ByteTokenizer tok;
  PreferenceSetOptions o;
  o.path = path;
  o.skip_bad_lines = true;
  absl::StatusOr<PreferenceSet> set = LoadPreferenceSet(o, tok);
  ASSERT_EQ(set.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(set.status().message().find("no preference pair"), std::string::npos)
      << set.status();
  o.path = dir.Join("missing.jsonl");
  EXPECT_EQ(LoadPreferenceSet(o, tok).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace megatrain
