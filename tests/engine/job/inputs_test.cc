// A job's inputs as checked before it is queued (ValidateJobInputs) and as the trainer
// reads them: the default tokenizer, pre-tokenized ids against the model's vocabulary,
// and datasets with nothing to train on.
#include "engine/job/inputs.h"

#include <sys/stat.h>

#include <cstdio>
#include <optional>
#include <string>
#include <utility>

#include "engine/job/trainer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/deadline.h"
#include "tests/util/temp_dir.h"

namespace megatrain {
namespace {

using ::testing::HasSubstr;
using ::megatrain::testing::TempDir;
using ::megatrain::testing::WriteFile;

// A tiny random-init model of `vocab` ids, trained on data.jsonl in `dir`.
std::string Spec(int vocab, const std::string& data_extra = "") {
  return "model:\n"
         "  config: {architectures: [LlamaForCausalLM], hidden_size: 32, intermediate_size: 64,\n"
         "           num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 1,\n"
         "           vocab_size: " + std::to_string(vocab) + ", tie_word_embeddings: true}\n"
         "data: {path: data.jsonl, seq_len: 16" + data_extra + "}\n"
         "train: {steps: 1, micro_batch_rows: 1, micro_batches: 1}\n";
}

JobSpec Parse(const TempDir& dir, const std::string& yaml) {
  absl::StatusOr<JobSpec> spec = ParseJobSpec(yaml, dir.path());
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? *spec : JobSpec{};
}

TEST(JobInputs, TheDefaultTokenizerIsTheModelFoldersElseByte) {
  TempDir dir;
  JobSpec spec = Parse(dir, Spec(258));
  EXPECT_EQ(spec.tokenizer, TokenizerSource::kAuto);
  EXPECT_EQ(ResolvedTokenizer(spec), TokenizerSource::kByte);  // random init: no model folder
  spec.model_path = dir.Join("model");
  WriteFile(dir.Join("model/config.json"), "{}");
  EXPECT_EQ(ResolvedTokenizer(spec), TokenizerSource::kByte);  // a model folder without a tokenizer
  WriteFile(dir.Join("model/tokenizer.json"), "{}");
  EXPECT_EQ(ResolvedTokenizer(spec), TokenizerSource::kModel);
  spec.tokenizer = TokenizerSource::kByte;
  EXPECT_EQ(ResolvedTokenizer(spec), TokenizerSource::kByte);  // named: as named
}

TEST(JobInputs, TokenIdsAreCheckedAgainstTheModelsVocabulary) {
  TempDir dir;
  WriteFile(dir.Join("data.jsonl"), "{\"input_ids\": [7108, 8191, 0, 5]}\n"
                                    "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7]}\n");
  const JobSpec spec = Parse(dir, Spec(8192, ", format: tokens"));
  EXPECT_TRUE(ValidateJobInputs(spec).ok()) << ValidateJobInputs(spec);
  absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(spec);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  EXPECT_EQ((*trainer)->dataset_stats().tokens, 11);

  WriteFile(dir.Join("data.jsonl"), "{\"input_ids\": [1, 8192]}\n");
  const absl::Status refused = ValidateJobInputs(spec);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("data.jsonl:1: input_ids[1] is 8192"));
  EXPECT_THAT(refused.message(), HasSubstr("the model's vocab_size is 8192"));
  absl::StatusOr<std::unique_ptr<Trainer>> failed = Trainer::Create(spec);
  ASSERT_FALSE(failed.ok());
  EXPECT_THAT(failed.status().message(), HasSubstr("the model's vocab_size is 8192"));
}

TEST(JobInputs, TokenIdsNeedNoTokenizerEvenForAVocabularySmallerThanBytes) {
  TempDir dir;
  WriteFile(dir.Join("data.jsonl"), "{\"input_ids\": [1, 99, 3, 50]}\n");
  const JobSpec spec = Parse(dir, Spec(100, ", format: tokens"));
  EXPECT_TRUE(ValidateJobInputs(spec).ok()) << ValidateJobInputs(spec);
  absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(spec);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  absl::StatusOr<StepReport> step = (*trainer)->Step();
  ASSERT_TRUE(step.ok()) << step.status();
}

// A file named where a job writes a folder is refused naming the field, at submit and at
// start (before, a checkpoint.dir that was a file read as "data.cache_dir: cannot create
// <file>/data-cache", PERMISSION_DENIED).
TEST(JobInputs, AFileNamedAsAFolderIsRefusedNamingTheField) {
  TempDir dir;
  WriteFile(dir.Join("data.jsonl"), "{\"text\": \"hello there\"}\n");
  const JobSpec good = Parse(dir, Spec(258));
  const std::pair<std::string, std::string JobSpec::*> fields[] = {
      {"checkpoint.dir", &JobSpec::checkpoint_dir},
      {"data.cache_dir", &JobSpec::data_cache_dir},
      {"optimizer.nvme_dir", &JobSpec::nvme_dir}};
  for (const auto& [field, member] : fields) {
    SCOPED_TRACE(field);
    JobSpec spec = good;
    std::string* path = &(spec.*member);
    *path = dir.Join("data.jsonl");
    const absl::Status s = ValidateJobInputs(spec);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(field + ": "));
    EXPECT_THAT(s.message(), HasSubstr("data.jsonl is a file, not a folder"));
    absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(spec);
    ASSERT_FALSE(trainer.ok());
    EXPECT_EQ(trainer.status().message(), s.message()) << "the same words at submit and start";
    *path = dir.Join("new/folder");  // missing: made when needed
    EXPECT_TRUE(CheckJobFolders(spec).ok());
  }
}

TEST(JobInputs, AnEmptyOrBlankDatasetIsRefusedAsTheJobWouldBe) {
  TempDir dir;
  const JobSpec spec = Parse(dir, Spec(258));
  for (const char* text : {"", "\n\n  \n\t\r\n"}) {
    WriteFile(dir.Join("data.jsonl"), text);
    const absl::Status s = ValidateJobInputs(spec);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("holds no examples to train on (0 lines, 0 malformed)"));
    absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(spec);
    ASSERT_FALSE(trainer.ok());
    EXPECT_EQ(trainer.status().message(), s.message()) << "the same words at submit and start";
  }
}

// The eval set is checked at submit as the data is, in its own format, naming eval.path,
// and the trainer refuses it with the same words.
TEST(JobInputs, AMissingEmptyOrMalformedEvalSetIsRefusedNamingEvalPath) {
  TempDir dir;
  WriteFile(dir.Join("data.jsonl"), "{\"text\": \"some text to train on\"}\n");
  const std::string base = Spec(258);
  const struct {
    const char* eval;
    const char* file;  // null: none written
    absl::StatusCode code;
    const char* says;
  } cases[] = {
      {"eval: {path: held.jsonl}\n", nullptr, absl::StatusCode::kNotFound, "eval.path"},
      {"eval: {path: held.jsonl}\n", "\n", absl::StatusCode::kInvalidArgument,
       "eval.path: "},
      {"eval: {path: held.jsonl, format: alpaca}\n", "{\"text\": \"x\"}\n",
       absl::StatusCode::kInvalidArgument, "(eval.format is 'alpaca'"},
  };
  for (const auto& c : cases) {
    std::remove(dir.Join("held.jsonl").c_str());
    if (c.file != nullptr) WriteFile(dir.Join("held.jsonl"), c.file);
    const JobSpec spec = Parse(dir, base + c.eval);
    const absl::Status s = ValidateJobInputs(spec);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.says));
    EXPECT_THAT(s.message(), HasSubstr("eval.path"));
    absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(spec);
    ASSERT_FALSE(trainer.ok());
    EXPECT_EQ(trainer.status().code(), c.code) << trainer.status();
    EXPECT_THAT(trainer.status().message(), HasSubstr("eval.path"));
  }
}

TEST(JobInputs, ADatasetOfOnlySkippedLinesIsRefused) {
  TempDir dir;
  WriteFile(dir.Join("data.jsonl"), "not json\n{\"txt\": \"wrong field\"}\n");
  const JobSpec spec = Parse(dir, Spec(258, ", on_bad_line: skip"));
  const absl::Status s = ValidateJobInputs(spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("holds no examples to train on (2 lines, 2 malformed; "
                                     "first: "));
  EXPECT_THAT(s.message(), HasSubstr("data.jsonl:1: not valid JSON"));
}

TEST(JobInputs, ALongDatasetIsJudgedOnItsFirstLinesOnly) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 100; ++i) text += "{\"text\": \"line\"}\n";
  WriteFile(dir.Join("data.jsonl"), text);
  EXPECT_TRUE(ValidateJobInputs(Parse(dir, Spec(258))).ok());
}

}  // namespace
}  // namespace megatrain

namespace megatrain {
namespace {

TEST(JobInputs, AFifoAsDataPathIsRefusedWithoutBlocking) {
  TempDir dir;
  ASSERT_EQ(::mkfifo(dir.Join("data.jsonl").c_str(), 0600), 0);
  const JobSpec spec = Parse(dir, Spec(258));
  std::optional<absl::Status> s = testing::RunWithin(5, [&] { return ValidateJobInputs(spec); });
  ASSERT_TRUE(s.has_value()) << "a FIFO as data.path blocked";
  EXPECT_EQ(s->code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s->message()),
              HasSubstr("data.path " + dir.Join("data.jsonl") + " is not a regular file (a FIFO)"));
}

TEST(JobInputs, ATokenizerConfigSymlinkLoopIsRefusedNotThrown) {
  TempDir dir;
  WriteFile(dir.Join("data.jsonl"), "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"},"
                                    " {\"role\": \"assistant\", \"content\": \"yo\"}]}\n");
  WriteFile(dir.Join("tok/tokenizer.json"), R"({"normalizer": null, "pre_tokenizer": null,
    "model": {"type": "BPE", "vocab": {"h": 0, "i": 1}, "merges": []},
    "decoder": null, "added_tokens": []})");
  ASSERT_EQ(::symlink("tokenizer_config.json", dir.Join("tok/tokenizer_config.json").c_str()), 0);
  const JobSpec spec = Parse(dir, Spec(258, ", format: messages, tokenizer: tok"));
  const absl::Status s = ValidateJobInputs(spec);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("tokenizer_config.json"));
}

}  // namespace
}  // namespace megatrain
