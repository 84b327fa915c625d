// Tests for the job spec: a full spec parses field by field, omitted sections take their
// documented defaults, and every bad input is refused with the right code and a message
// that names the field at fault.
#include "engine/job/spec.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"

#include "engine/job/job_planner.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/deadline.h"
#include "tests/util/temp_dir.h"

namespace megatrain {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::IsSupersetOf;

using ::megatrain::testing::TempDir;

using ::megatrain::testing::WriteFile;

// The smallest spec that parses: an inline tiny llama and a data file.
constexpr char kTinyConfigYaml[] = R"(
    architectures: [LlamaForCausalLM]
    hidden_size: 32
    intermediate_size: 64
    num_hidden_layers: 2
    num_attention_heads: 4
    num_key_value_heads: 2
    vocab_size: 300
)";

std::string MinimalSpec() {
  return std::string("model:\n  config:") + kTinyConfigYaml + "data:\n  path: train.jsonl\n";
}

constexpr char kTinyConfigJson[] = R"({
  "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "vocab_size": 300})";

// Parses `yaml` and expects it refused with `code`, the message naming `field`.
void ExpectRefused(const std::string& yaml, absl::StatusCode code, const std::string& field) {
  TempDir dir;
  absl::StatusOr<JobSpec> spec = ParseJobSpec(yaml, dir.path());
  ASSERT_FALSE(spec.ok()) << "accepted:\n" << yaml;
  EXPECT_EQ(spec.status().code(), code) << spec.status();
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr(field)) << spec.status();
}

void ExpectInvalid(const std::string& yaml, const std::string& field) {
  ExpectRefused(yaml, absl::StatusCode::kInvalidArgument, field);
}

// MinimalSpec() with a train section of `train_fields` ("steps: -3").
std::string WithTrain(const std::string& train_fields) {
  return MinimalSpec() + "train:\n  " + train_fields + "\n";
}

TEST(JobSpecTest, FullSpecParsesEveryFieldAndResolvesRelativePaths) {
  TempDir dir;
  const std::string yaml = R"(
name: demo-run
backend: cpu
model:
  path: models/tiny
  init_seed: 11
data:
  path: data/train.jsonl
  format: text
  text_field: body
  tokenizer: byte
  seq_len: 128
  seed: 5
train:
  steps: 40
  micro_batch_rows: 3
  micro_batches: 2
  lr: 0.0003
  schedule: cosine
  warmup_steps: 4
  min_lr_ratio: 0.1
  weight_decay: 0.01
  beta1: 0.8
  beta2: 0.95
  eps: 1.0e-6
  max_grad_norm: 0.5
  activation_checkpoint_every: 2
  loss_chunk_tokens: 512
checkpoint:
  dir: ckpt
  every_steps: 10
  keep_last: 2
  max_shard_bytes: 2097152
)";
  absl::StatusOr<JobSpec> spec = ParseJobSpec(yaml, dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name, "demo-run");
  EXPECT_EQ(spec->backend, "cpu");
  EXPECT_EQ(spec->model_path, dir.Join("models/tiny"));
  EXPECT_TRUE(spec->model_config_json.empty());
  EXPECT_EQ(spec->init_seed, 11u);
  EXPECT_EQ(spec->data_path, dir.Join("data/train.jsonl"));
  EXPECT_EQ(spec->data_format, DataFormat::kText);
  EXPECT_EQ(spec->text_field, "body");
  EXPECT_EQ(spec->tokenizer, TokenizerSource::kByte);
  EXPECT_EQ(spec->seq_len, 128);
  EXPECT_EQ(spec->data_seed, 5u);
  EXPECT_EQ(spec->steps, 40);
  EXPECT_EQ(spec->micro_batch_rows, 3);
  EXPECT_EQ(spec->micro_batches, 2);
  EXPECT_DOUBLE_EQ(spec->schedule.lr, 0.0003);
  EXPECT_EQ(spec->schedule.type, ScheduleType::kCosine);
  EXPECT_EQ(spec->schedule.warmup_steps, 4);
  EXPECT_EQ(spec->schedule.total_steps, 40);  // follows train.steps
  EXPECT_DOUBLE_EQ(spec->schedule.min_lr_ratio, 0.1);
  EXPECT_DOUBLE_EQ(spec->weight_decay, 0.01);
  EXPECT_DOUBLE_EQ(spec->beta1, 0.8);
  EXPECT_DOUBLE_EQ(spec->beta2, 0.95);
  EXPECT_DOUBLE_EQ(spec->eps, 1e-6);
  EXPECT_DOUBLE_EQ(spec->max_grad_norm, 0.5);
  EXPECT_EQ(spec->activation_checkpoint_every, 2);
  EXPECT_EQ(spec->loss_chunk_tokens, 512);
  EXPECT_EQ(spec->checkpoint_dir, dir.Join("ckpt"));
  EXPECT_EQ(spec->checkpoint_every_steps, 10);
  EXPECT_EQ(spec->keep_last, 2);
  EXPECT_EQ(spec->max_shard_bytes, 2097152);
  EXPECT_EQ(spec->tokens_per_step_resolved(), 2 * 3 * 128);
}

TEST(JobSpecTest, AbsolutePathsAreKeptAndDotDotIsNormalised) {
  TempDir dir;
  const std::string yaml =
      "model: {path: /models/tiny}\n"
      "data: {path: ../shared/./train.jsonl}\n"
      "checkpoint: {dir: /ckpt/run1}\n";
  absl::StatusOr<JobSpec> spec = ParseJobSpec(yaml, dir.Join("specs"));
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model_path, "/models/tiny");
  EXPECT_EQ(spec->data_path, dir.Join("shared/train.jsonl"));
  EXPECT_EQ(spec->checkpoint_dir, "/ckpt/run1");
}

TEST(JobSpecTest, OmittedSectionsAndFieldsTakeTheDocumentedDefaults) {
  TempDir dir;
  absl::StatusOr<JobSpec> spec = ParseJobSpec(MinimalSpec(), dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  const JobSpec defaults;
  EXPECT_EQ(spec->name, "job");
  EXPECT_EQ(spec->backend, "auto");
  EXPECT_TRUE(spec->model_path.empty());
  EXPECT_FALSE(spec->model_config_json.empty());
  EXPECT_EQ(spec->init_seed, 0u);
  EXPECT_EQ(spec->data_path, dir.Join("train.jsonl"));
  EXPECT_EQ(spec->data_format, DataFormat::kText);
  EXPECT_EQ(spec->text_field, "text");
  EXPECT_EQ(spec->tokenizer, TokenizerSource::kAuto);
  EXPECT_EQ(spec->seq_len, 256);
  EXPECT_EQ(spec->data_seed, 0u);
  EXPECT_EQ(spec->steps, 100);
  // The batch: one sequence per step; its split is the planner's.
  EXPECT_EQ(spec->tokens_per_step, 0);
  EXPECT_EQ(spec->rows_per_step(), 1);
  EXPECT_EQ(spec->micro_batch_rows, 0);
  EXPECT_EQ(spec->micro_batches, 0);
  EXPECT_EQ(spec->activation_checkpoints, ActivationPlacement::kAuto);
  EXPECT_EQ(spec->schedule.type, defaults.schedule.type);
  EXPECT_EQ(spec->schedule.lr, defaults.schedule.lr);
  EXPECT_EQ(spec->schedule.warmup_steps, 0);
  EXPECT_EQ(spec->schedule.total_steps, 100);
  EXPECT_EQ(spec->schedule.min_lr_ratio, 0.0);
  EXPECT_EQ(spec->weight_decay, 0.0);
  EXPECT_EQ(spec->beta1, 0.9);
  EXPECT_EQ(spec->beta2, 0.999);
  EXPECT_EQ(spec->eps, 1e-8);
  EXPECT_EQ(spec->max_grad_norm, 1.0);
  EXPECT_EQ(spec->activation_checkpoint_every, 0);
  EXPECT_EQ(spec->loss_chunk_tokens, 4096);
  EXPECT_TRUE(spec->checkpoint_dir.empty());
  EXPECT_EQ(spec->checkpoint_every_steps, 0);
  EXPECT_EQ(spec->keep_last, 3);
  EXPECT_EQ(spec->max_shard_bytes, int64_t{5} << 30);
}

// Found by fuzz_job_spec: a key with a byte that is not UTF-8 parsed, then did not survive
// JobSpecToYaml. Such a document is refused at the door.
TEST(JobSpecTest, InvalidUtf8IsRefused) {
  TempDir dir;
  absl::StatusOr<JobSpec> spec = ParseJobSpec(MinimalSpec() + "name: caf\xe9\n", dir.path());
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("not valid UTF-8"));
}

// Found by fuzz_job_spec: YAML's "\_" unescapes to the lone byte 0xA0, which then threw
// from nlohmann::json (a daemon crash). Refused, naming the field.
TEST(JobSpecTest, YamlEscapesThatAreNotUtf8AreRefusedByField) {
  TempDir dir;
  absl::StatusOr<JobSpec> spec = ParseJobSpec(MinimalSpec() + "name: \"a\\_b\"\n", dir.path());
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("name is not valid UTF-8"));
  spec = ParseJobSpec("model:\n  config: {\"a\\_b\": 1}\ndata: {path: d.jsonl}\n", dir.path());
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("model.config"));
}

// Found by fuzz_job_spec: JobSpecToYaml re-read the config JSON as YAML, which threw on
// keys with control characters. Types and odd keys now survive the round trip.
TEST(JobSpecTest, InlineConfigSurvivesTheYamlRoundTrip) {
  TempDir dir;
  absl::StatusOr<JobSpec> spec = ParseJobSpec(
      std::string("model:\n  config: {\"odd\\x14key\": null, \"flag\": true, \"theta\": 1.0,\n"
                  "    \"name\": \"1.0\", \"list\": [1, \"a\", null]}\ndata: {path: d.jsonl}\n"),
      dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<JobSpec> again = ParseJobSpec(JobSpecToYaml(*spec), "");
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << JobSpecToYaml(*spec);
  EXPECT_EQ(again->model_config_json, spec->model_config_json);
  EXPECT_NE(spec->model_config_json.find("\"theta\":1.0"), std::string::npos)
      << spec->model_config_json;
  // A key YAML could not write back as a key is refused up front.
  spec = ParseJobSpec("model:\n  config: {\"" + std::string(600, 'k') +
                          "\": 1}\ndata: {path: d.jsonl}\n", dir.path());
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("keys are at most 256"));
}

TEST(JobSpecTest, DataChoicesAreCheckedByName) {
  for (const char* field : {"packing: diagonal", "truncation: middle", "on_bad_line: ignore",
                            "chat_template: vicuna", "format: csv"}) {
    const std::string key = std::string(field).substr(0, std::string(field).find(':'));
    ExpectInvalid(std::string("model:\n  config:") + kTinyConfigYaml +
                      "data:\n  path: d.jsonl\n  " + field + "\n",
                  "data." + key);
  }
  ExpectInvalid(std::string("model:\n  config:") + kTinyConfigYaml +
                    "data:\n  path: d.jsonl\n  tokenize_threads: -1\n",
                "data.tokenize_threads");
}

TEST(JobSpecTest, DataChoicesRoundTripThroughYaml) {
  TempDir dir;
  absl::StatusOr<JobSpec> spec = ParseJobSpec(
      std::string("model:\n  config:") + kTinyConfigYaml +
          "data: {path: d.jsonl, format: sharegpt, chat_template: qwen3, packing: pad,\n"
          "       truncation: truncate, on_bad_line: skip, cache_dir: cache, tokenize_threads: 1,\n"
          "       chat_date: '2026-01-02'}\n",
      dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->data_cache_dir, (fs::path(dir.path()) / "cache").string());
  absl::StatusOr<JobSpec> again = ParseJobSpec(JobSpecToYaml(*spec), "");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->data_format, DataFormat::kShareGpt);
  EXPECT_EQ(again->chat_template, ChatTemplate::kQwen3);
  EXPECT_EQ(again->packing, Packing::kPad);
  EXPECT_EQ(again->truncation, Truncation::kTruncate);
  EXPECT_EQ(again->on_bad_line, OnBadLine::kSkip);
  EXPECT_EQ(again->data_cache_dir, spec->data_cache_dir);
  EXPECT_EQ(again->tokenize_threads, 1);
  EXPECT_EQ(again->chat_date, "2026-01-02");
  EXPECT_EQ(again->Fingerprint(), spec->Fingerprint());
}

TEST(JobSpecTest, EvalSectionRoundTripsTakesTheDataFormatAndStaysOutOfTheFingerprint) {
  TempDir dir;
  const std::string base = std::string("model:\n  config:") + kTinyConfigYaml +
                           "data: {path: d.jsonl, format: alpaca}\n";
  absl::StatusOr<JobSpec> spec =
      ParseJobSpec(base + "eval: {path: held.jsonl, every_steps: 50, max_rows: 64}\n", dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->eval.path, (fs::path(dir.path()) / "held.jsonl").string());
  EXPECT_EQ(spec->eval.format, DataFormat::kAlpaca);  // the data's, unless given
  absl::StatusOr<JobSpec> again = ParseJobSpec(JobSpecToYaml(*spec), "");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->eval.path, spec->eval.path);
  EXPECT_EQ(again->eval.format, DataFormat::kAlpaca);
  EXPECT_EQ(again->eval.every_steps, 50);
  EXPECT_EQ(again->eval.max_rows, 64);
  // Adding or changing the evaluation never stops a job resuming from its checkpoints.
  absl::StatusOr<JobSpec> without = ParseJobSpec(base, dir.path());
  ASSERT_TRUE(without.ok()) << without.status();
  EXPECT_EQ(without->Fingerprint(), spec->Fingerprint());
  EXPECT_TRUE(without->eval.path.empty());
  absl::StatusOr<JobSpec> text = ParseJobSpec(base + "eval: {path: h.jsonl, format: text}\n", "");
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(text->eval.format, DataFormat::kText);
}

TEST(JobSpecTest, EvalFieldsAreCheckedByName) {
  ExpectInvalid(MinimalSpec() + "eval: {path: h.jsonl, every_steps: -1}\n", "eval.every_steps");
  ExpectInvalid(MinimalSpec() + "eval: {path: h.jsonl, max_rows: -2}\n", "eval.max_rows");
  ExpectInvalid(MinimalSpec() + "eval: {path: h.jsonl, format: csv}\n", "eval.format");
  ExpectInvalid(MinimalSpec() + "eval: {path: h.jsonl, every: 5}\n", "eval.every");
  ExpectInvalid(MinimalSpec() + "eval: {every_steps: 5}\n", "eval.path");
  ExpectInvalid(MinimalSpec() + "eval: held.jsonl\n", "eval");
}

TEST(JobSpecTest, FreezePatternsRoundTripAsAListOrOneString) {
  absl::StatusOr<JobSpec> spec =
      ParseJobSpec(WithTrain("  freeze: [embed_tokens, layers.0-3, router]\n"), "");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->freeze, (std::vector<std::string>{"embed_tokens", "layers.0-3", "router"}));
  absl::StatusOr<JobSpec> again = ParseJobSpec(JobSpecToYaml(*spec), "");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->freeze, spec->freeze);
  absl::StatusOr<JobSpec> one = ParseJobSpec(WithTrain("  freeze: lm_head\n"), "");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->freeze, std::vector<std::string>{"lm_head"});
  ExpectInvalid(WithTrain("  freeze: {a: 1}\n"), "train.freeze");
}

// MinimalSpec() with a lora section of `lora_fields` ("rank: 16").
std::string WithLora(const std::string& lora_fields) {
  return MinimalSpec() + "lora: {" + lora_fields + "}\n";
}

TEST(JobSpecTest, LoraSectionParsesEveryFieldAndResolvesTheAdapterPath) {
  TempDir dir;
  absl::StatusOr<JobSpec> spec =
      ParseJobSpec(WithLora("rank: 8, alpha: 4.5, rslora: true, target_modules: [q_proj, v_proj], "
                            "init: gaussian, dropout: 0, adapter: adapters/run1"),
                   dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->lora.rank, 8);
  EXPECT_EQ(spec->lora.alpha, 4.5);
  EXPECT_TRUE(spec->lora.rslora);
  EXPECT_THAT(spec->lora.target_modules, ElementsAre("q_proj", "v_proj"));
  EXPECT_EQ(spec->lora.init, LoraInit::kGaussian);
  EXPECT_EQ(spec->lora_adapter, dir.Join("adapters/run1"));
}

TEST(JobSpecTest, LoraSectionParsesWithPeftDefaults) {
  absl::StatusOr<JobSpec> spec = ParseJobSpec(WithLora("rank: 16"), "");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->lora.rank, 16);
  EXPECT_EQ(spec->lora.alpha, 32);  // 2 * rank
  EXPECT_FALSE(spec->lora.rslora);
  EXPECT_THAT(spec->lora.target_modules, IsEmpty());  // all of them
  EXPECT_EQ(spec->lora.init, LoraInit::kDefault);
  EXPECT_EQ(spec->lora_adapter, "");
  absl::StatusOr<JobSpec> all = ParseJobSpec(WithLora("rank: 4, target_modules: all-linear"), "");
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_THAT(all->lora.target_modules, IsEmpty());
}

TEST(JobSpecTest, LoraTargetsNameTheExpertsProjections) {
  absl::StatusOr<JobSpec> spec = ParseJobSpec(
      WithLora("rank: 8, target_modules: [q_proj, experts.gate_up_proj, experts.down_proj]"), "");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_THAT(spec->lora.target_modules,
              ElementsAre("q_proj", "experts.gate_up_proj", "experts.down_proj"));
}

TEST(JobSpecTest, NoLoraSectionIsNoAdapters) {
  absl::StatusOr<JobSpec> spec = ParseJobSpec(MinimalSpec(), "");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->lora.rank, 0);
  EXPECT_EQ(JobSpecToYaml(*spec).find("\nlora:"), std::string::npos);
}

TEST(JobSpecTest, LoraWithFreezeIsAllowed) {
  absl::StatusOr<JobSpec> spec =
      ParseJobSpec(WithTrain("  freeze: [lm_head]\nlora: {rank: 4}"), "");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->lora.rank, 4);
  EXPECT_THAT(spec->freeze, ElementsAre("lm_head"));
}

TEST(JobSpecTest, BadLoraFieldsAreRefusedNamingTheField) {
  ExpectInvalid(WithLora("alpha: 16"), "lora.rank is required");
  ExpectInvalid(WithLora("rank: 0"), "lora.rank must be positive, got 0");
  ExpectInvalid(WithLora("rank: -4"), "lora.rank must be positive, got -4");
  ExpectInvalid(WithLora("rank: 1.5"), "lora.rank must be an integer");
  ExpectInvalid(WithLora("rank: 8, alpha: 0"), "lora.alpha must be positive");
  ExpectInvalid(WithLora("rank: 8, alpha: -1"), "lora.alpha must be positive");
  ExpectInvalid(WithLora("rank: 8, rslora: maybe"), "lora.rslora must be true or false");
  ExpectInvalid(WithLora("rank: 8, init: x"),
                "lora.init must be one of default, gaussian; got 'x'");
  ExpectInvalid(WithLora("rank: 8, target_modules: [q_proj, foo]"),
                "lora.target_modules[1] 'foo' is not a projection; choose from q_proj, k_proj, "
                "v_proj, o_proj, gate_proj, up_proj, down_proj, experts.gate_up_proj, "
                "experts.down_proj (or all-linear)");
  ExpectInvalid(WithLora("rank: 8, target_modules: [v_proj, q_proj, v_proj]"),
                "lora.target_modules[2] 'v_proj' is named twice");
  ExpectInvalid(WithLora("rank: 8, target_modules: [q_proj, all-linear]"),
                "lora.target_modules[1] 'all-linear' is not a projection");
  ExpectInvalid(WithLora("rank: 8, target_modules: {q: 1}"), "lora.target_modules must be");
  ExpectInvalid(WithLora("rank: 8, dropout: 0.05"),
                "lora.dropout is 0.05; only 0 is supported: adapters train without dropout");
  ExpectInvalid(WithLora("rank: 8, lora_dropout: 0"), "unknown field 'lora.lora_dropout'");
  ExpectInvalid(MinimalSpec() + "lora: 16\n", "lora must be a mapping");
}

TEST(JobSpecTest, LoraSectionIsOnlyForTrainingJobs) {
  ExpectInvalid("kind: generate\nmodel: {path: m}\ngenerate: {prompt: hi}\nlora: {rank: 8}\n",
                "a job of kind generate has no 'lora' section (only training jobs do)");
  JobSpec spec;
  spec.kind = JobKind::kEval;
  spec.model_path = "/m";
  spec.generate.prompts_path = "/p.jsonl";
  ASSERT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  spec.lora.rank = 8;
  spec.lora.alpha = 16;
  EXPECT_THAT(std::string(ValidateJobSpec(spec).message()), HasSubstr("'lora' section"));
}

TEST(JobSpecTest, ValidateJobSpecRefusesLoraFieldsWithoutARank) {
  absl::StatusOr<JobSpec> spec = ParseJobSpec(MinimalSpec(), "");
  ASSERT_TRUE(spec.ok()) << spec.status();
  spec->lora_adapter = "/adapters/run1";
  EXPECT_THAT(std::string(ValidateJobSpec(*spec).message()),
              HasSubstr("lora.rank must be positive, got 0"));
}

TEST(JobSpecTest, LoraSectionRoundTripsThroughYaml) {
  for (const std::string& fields :
       {std::string("rank: 16"),
        std::string("rank: 8, alpha: 12.5, rslora: true, target_modules: [o_proj, q_proj], "
                    "init: gaussian, adapter: /adapters/run1")}) {
    absl::StatusOr<JobSpec> spec = ParseJobSpec(WithLora(fields), "");
    ASSERT_TRUE(spec.ok()) << spec.status();
    const std::string yaml = JobSpecToYaml(*spec);
    absl::StatusOr<JobSpec> again = ParseJobSpec(yaml, "");
    ASSERT_TRUE(again.ok()) << again.status() << "\n" << yaml;
    EXPECT_EQ(again->lora.rank, spec->lora.rank);
    EXPECT_EQ(again->lora.alpha, spec->lora.alpha);
    EXPECT_EQ(again->lora.rslora, spec->lora.rslora);
    EXPECT_EQ(again->lora.target_modules, spec->lora.target_modules);
    EXPECT_EQ(again->lora.init, spec->lora.init);
    EXPECT_EQ(again->lora_adapter, spec->lora_adapter);
    EXPECT_EQ(JobSpecToYaml(*again), yaml);
    EXPECT_EQ(again->Fingerprint(), spec->Fingerprint());
  }
}

TEST(JobSpecTest, GenerateJobParsesResolvesItsPathsAndRoundTrips) {
  TempDir dir;
  absl::StatusOr<JobSpec> spec = ParseJobSpec(
      "kind: generate\nmodel: {path: ckpt}\n"
      "generate: {prompts: p.jsonl, prompt: [\"Hi\", \"Yo\"], output: out/c.jsonl, "
      "max_new_tokens: 9, temperature: 0.7, top_k: 5, top_p: 0.9, seed: 4, stop: \"\\n\", "
      "stop_ids: [2, 7], ignore_eos: true, chat: true, tokenizer: byte, max_sequences: 3}\n",
      dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->kind, JobKind::kGenerate);
  const GenerateSpec& g = spec->generate;
  EXPECT_EQ(g.prompts_path, (fs::path(dir.path()) / "p.jsonl").string());
  EXPECT_EQ(g.output_path, (fs::path(dir.path()) / "out/c.jsonl").string());
  EXPECT_EQ(g.prompts, (std::vector<std::string>{"Hi", "Yo"}));
  EXPECT_EQ(g.stop_strings, std::vector<std::string>{"\n"});
  EXPECT_EQ(g.stop_ids, (std::vector<int32_t>{2, 7}));
  absl::StatusOr<JobSpec> again = ParseJobSpec(JobSpecToYaml(*spec), "");
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << JobSpecToYaml(*spec);
  EXPECT_EQ(again->kind, JobKind::kGenerate);
  const GenerateSpec& h = again->generate;
  EXPECT_EQ(h.prompts_path, g.prompts_path);
  EXPECT_EQ(h.prompts, g.prompts);
  EXPECT_EQ(h.output_path, g.output_path);
  EXPECT_EQ(h.max_new_tokens, 9);
  EXPECT_EQ(h.temperature, 0.7);
  EXPECT_EQ(h.top_k, 5);
  EXPECT_EQ(h.top_p, 0.9);
  EXPECT_EQ(h.seed, 4u);
  EXPECT_EQ(h.stop_strings, g.stop_strings);
  EXPECT_EQ(h.stop_ids, g.stop_ids);
  EXPECT_TRUE(h.ignore_eos);
  EXPECT_TRUE(h.chat);
  EXPECT_EQ(h.tokenizer, "byte");
  absl::StatusOr<JobSpec> file = ParseJobSpec(
      "kind: generate\nmodel: {path: m}\ngenerate: {prompt: hi, tokenizer: tok/t.json}\n",
      dir.path());
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->generate.tokenizer, (fs::path(dir.path()) / "tok/t.json").string());
  EXPECT_EQ(h.max_sequences, 3);
  // Its output defaults to the job's folder.
  JobSpec placed = *again;
  placed.generate.output_path.clear();
  placed.checkpoint_dir = "/jobs/7";
  EXPECT_EQ(GenerateSpecOf(placed).output_path, "/jobs/7/completions.jsonl");
  EXPECT_FALSE(GenerateSpecOf(placed).score);
  placed.kind = JobKind::kEval;
  EXPECT_TRUE(GenerateSpecOf(placed).score);
}

TEST(JobSpecTest, BadGenerateJobsAreRefusedNamingTheField) {
  const std::string head = "kind: generate\nmodel: {path: m}\n";
  ExpectInvalid(head + "generate: {prompt: hi, top_p: 1.5}\n", "generate.top_p");
  ExpectInvalid(head + "generate: {prompt: hi, top_p: 0}\n", "generate.top_p");
  ExpectInvalid(head + "generate: {prompt: hi, temperature: -1}\n", "generate.temperature");
  ExpectInvalid(head + "generate: {prompt: hi, max_new_tokens: 0}\n", "generate.max_new_tokens");
  ExpectInvalid(head + "generate: {prompt: hi, top_k: -1}\n", "generate.top_k");
  ExpectInvalid(head + "generate: {prompt: hi, tokenizer: \"\"}\n", "generate.tokenizer");
  ExpectInvalid(head + "generate: {prompt: hi, nucleus: 0.9}\n", "generate.nucleus");
  ExpectInvalid(head + "generate: {prompt: hi, stop_ids: [x]}\n", "generate.stop_ids");
  ExpectInvalid(head + "generate: {max_new_tokens: 5}\n", "generate.prompts");
  ExpectInvalid(head, "'generate' section");
  ExpectInvalid(head + "generate: {prompt: hi}\ndata: {path: d.jsonl}\n", "'data' section");
  ExpectInvalid(head + "generate: {prompt: hi, answer_pattern: x}\n", "kind eval");
  ExpectInvalid("kind: eval\nmodel: {path: m}\ngenerate: {prompt: hi}\n", "generate.prompts");
  ExpectInvalid(std::string("kind: generate\nmodel:\n  config:") + kTinyConfigYaml +
                    "generate: {prompt: hi}\n",
                "model.path");
  ExpectInvalid("kind: sample\nmodel: {path: m}\n", "kind");
}

TEST(JobSpecTest, OptimizerStateDtypeIsCheckedByNameAndRoundTrips) {
  absl::StatusOr<JobSpec> plain = ParseJobSpec(MinimalSpec(), "");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->state_dtype, MomentDType::kF32);
  for (const char* name : {"fp32", "bf16", "int8"}) {
    absl::StatusOr<JobSpec> spec =
        ParseJobSpec(MinimalSpec() + "optimizer:\n  state_dtype: " + name + "\n", "");
    ASSERT_TRUE(spec.ok()) << spec.status();
    EXPECT_STREQ(MomentDTypeName(spec->state_dtype), name);
    absl::StatusOr<JobSpec> again = ParseJobSpec(JobSpecToYaml(*spec), "");
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->state_dtype, spec->state_dtype);
  }
  ExpectInvalid(MinimalSpec() + "optimizer:\n  state_dtype: fp8\n", "optimizer.state_dtype");
  ExpectInvalid(MinimalSpec() + "optimizer:\n  moments: int8\n", "optimizer.moments");
  ExpectInvalid(MinimalSpec() + "optimizer: int8\n", "optimizer");
}

TEST(JobSpecTest, UnknownTopLevelFieldIsRefusedByName) {
  ExpectInvalid(MinimalSpec() + "trian:\n  steps: 3\n", "'trian'");
}

TEST(JobSpecTest, UnknownNestedFieldIsRefusedWithItsFullPath) {
  ExpectInvalid(WithTrain("lrr: 0.1"), "train.lrr");
  ExpectInvalid(MinimalSpec() + "checkpoint:\n  every: 5\n", "checkpoint.every");
  ExpectInvalid(std::string("model:\n  pth: x\n  config:") + kTinyConfigYaml +
                    "data:\n  path: d.jsonl\n",
                "model.pth");
}

TEST(JobSpecTest, UnknownDataFieldIsRefusedWithItsFullPath) {
  ExpectInvalid(std::string("model:\n  config:") + kTinyConfigYaml +
                    "data:\n  path: d.jsonl\n  seqlen: 64\n",
                "data.seqlen");
}

TEST(JobSpecTest, NonIntegerStepsIsRefusedNamingTheFieldAndValue) {
  ExpectInvalid(WithTrain("steps: \"abc\""), "train.steps");
  ExpectInvalid(WithTrain("steps: abc"), "'abc'");
  ExpectInvalid(WithTrain("steps: 2.5"), "train.steps");
  ExpectInvalid(WithTrain("steps: [1, 2]"), "train.steps");
}

TEST(JobSpecTest, NegativeStepsIsRefused) {
  ExpectInvalid(WithTrain("steps: -3"), "train.steps");
  ExpectInvalid(WithTrain("steps: 0"), "train.steps");
}

TEST(JobSpecTest, NegativeMicroBatchesIsRefused) {
  ExpectInvalid(WithTrain("micro_batches: -1"), "train.micro_batches");
  ExpectInvalid(WithTrain("micro_batch_rows: -2"), "train.micro_batch_rows");
  ExpectInvalid(WithTrain("tokens_per_step: -4096"), "train.tokens_per_step");
}

TEST(JobSpecTest, TokensPerStepIsWholeSequencesAndAgreesWithAGivenSplit) {
  // seq_len is 256 by default.
  ExpectInvalid(WithTrain("tokens_per_step: 1000"), "multiple of data.seq_len");
  ExpectInvalid(WithTrain("tokens_per_step: 1024\n  micro_batch_rows: 3"),
                "train.micro_batch_rows (3) must divide the 4 sequences");
  ExpectInvalid(WithTrain("tokens_per_step: 1024\n  micro_batch_rows: 2\n  micro_batches: 1"),
                "must equal the 4 sequences");
  ExpectInvalid(WithTrain("tokens_per_step: 1024\n  micro_batches: 3"), "train.micro_batches (3)");
  ExpectInvalid(WithTrain("activation_checkpoints: gpu"), "train.activation_checkpoints");
  TempDir dir;
  absl::StatusOr<JobSpec> spec =
      ParseJobSpec(WithTrain("tokens_per_step: 2048\n  activation_checkpoints: host"), dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->rows_per_step(), 8);
  EXPECT_EQ(spec->tokens_per_step_resolved(), 2048);
  absl::StatusOr<JobSpec> back = ParseJobSpec(JobSpecToYaml(*spec), "");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->tokens_per_step, 2048);
  EXPECT_EQ(back->activation_checkpoints, ActivationPlacement::kHost);
  EXPECT_EQ(back->Fingerprint(), spec->Fingerprint());
  // The split is not part of the job's identity: a resume may split it differently.
  absl::StatusOr<JobSpec> split = ParseJobSpec(
      WithTrain("micro_batch_rows: 4\n  micro_batches: 2\n  activation_checkpoints: host"),
      dir.path());
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->Fingerprint(), spec->Fingerprint());
}

TEST(JobSpecTest, LearningRateOutsideItsRangeIsRefused) {
  ExpectInvalid(WithTrain("lr: -0.001"), "train.lr");
  ExpectInvalid(WithTrain("lr: 5000"), "train.lr");
  ExpectInvalid(WithTrain("lr: .nan"), "train.lr");
  ExpectInvalid(WithTrain("lr: fast"), "train.lr");
}

TEST(JobSpecTest, UnknownScheduleNameIsRefused) {
  ExpectInvalid(WithTrain("schedule: cosin"), "train.schedule");
  ExpectInvalid(WithTrain("schedule: cosin"), "cosin");
}

// Each choice's names read back as the values that print them; any other name is refused
// naming the field and listing what it allows.
template <typename E>
void ExpectNamesRoundTrip(std::initializer_list<E> values, const std::string& allowed) {
  for (E v : values) {
    absl::StatusOr<E> back = ParseSpecName<E>("f", SpecName(v));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, v) << SpecName(v);
  }
  absl::StatusOr<E> unknown = ParseSpecName<E>("section.field", "maybe");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unknown.status().message(),
            "section.field must be one of " + allowed + "; got 'maybe'");
}

TEST(JobSpecTest, EveryChoiceParsesFromItsNameAndAnUnknownNameListsTheAllowedOnes) {
  ExpectNamesRoundTrip({DataFormat::kText, DataFormat::kAlpaca, DataFormat::kShareGpt,
                        DataFormat::kMessages, DataFormat::kTokens},
                       "text, alpaca, sharegpt, messages, tokens");
  ExpectNamesRoundTrip({ChatTemplate::kAuto, ChatTemplate::kPlain, ChatTemplate::kQwen25,
                        ChatTemplate::kMistralV3Tekken},
                       "auto, plain, llama2, llama3, qwen3, gptoss, qwen2.5, mistral-v1, "
                       "mistral-v3, mistral-v3-tekken");
  ExpectNamesRoundTrip({Packing::kPack, Packing::kPad}, "pack, pad");
  ExpectNamesRoundTrip({Truncation::kAuto, Truncation::kSplit, Truncation::kTruncate},
                       "auto, split, truncate");
  ExpectNamesRoundTrip({OnBadLine::kFail, OnBadLine::kSkip}, "fail, skip");
  ExpectNamesRoundTrip({GradientReduce::kAuto, GradientReduce::kDevice, GradientReduce::kHost},
                       "auto, device, host");
  ExpectNamesRoundTrip({ActivationPlacement::kAuto, ActivationPlacement::kDevice,
                        ActivationPlacement::kHost},
                       "auto, device, host");
  ExpectNamesRoundTrip({ScheduleType::kConstant, ScheduleType::kLinear, ScheduleType::kCosine},
                       "constant, linear, cosine");
  ExpectNamesRoundTrip({MomentDType::kF32, MomentDType::kBF16, MomentDType::kInt8},
                       "fp32, bf16, int8");
  ExpectNamesRoundTrip({Bf16Copy::kAuto, Bf16Copy::kYes, Bf16Copy::kNo}, "auto, yes, no");
}

TEST(JobSpecTest, AnUnknownBf16CopyOrPlacementIsAnErrorNamingTheFieldNotAnAbort) {
  ExpectInvalid(MinimalSpec() + "optimizer: {bf16_copy: maybe}\n",
                "optimizer.bf16_copy must be one of auto, yes, no; got 'maybe'");
  ExpectInvalid(WithTrain("activation_checkpoints: nvme"),
                "train.activation_checkpoints must be one of auto, device, host; got 'nvme'");
}

// A spec made in code (the API's structured message, a test) meets the same checks as a
// parsed one.
TEST(JobSpecTest, ValidateJobSpecChecksASpecBuiltInCode) {
  JobSpec spec;
  spec.model_config_json = kTinyConfigJson;
  spec.data_path = "/data/d.jsonl";
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  const std::pair<std::function<void(JobSpec*)>, std::string> broken[] = {
      {[](JobSpec* s) { s->steps = 0; }, "train.steps must be >= 1, got 0"},
      {[](JobSpec* s) { s->seq_len = 1; }, "data.seq_len must be >= 2, got 1"},
      {[](JobSpec* s) { s->schedule.warmup_steps = -1; }, "train.warmup_steps must be >= 0"},
      {[](JobSpec* s) { s->schedule.min_lr_ratio = 2; }, "train.min_lr_ratio must be in [0, 1]"},
      {[](JobSpec* s) { s->beta2 = 2; }, "train.beta2 must be in [0, 0.999999999], got 2"},
      {[](JobSpec* s) { s->data_path.clear(); }, "data.path is required"},
      {[](JobSpec* s) { s->model_path = "/m"; }, "model needs exactly one of"},
      {[](JobSpec* s) { s->model_config_json = "[1]"; }, "model.config must be a mapping"},
      {[](JobSpec* s) { s->tokenizer = TokenizerSource::kFile; }, "data.tokenizer must be"},
      {[](JobSpec* s) { s->backend = "tpu"; }, "backend must be auto, cpu, cuda or cuda:N"},
      {[](JobSpec* s) { s->name = "a\nb"; }, "name has a control character"},
      {[](JobSpec* s) { s->checkpoint_dir = "/c\xff"; }, "checkpoint.dir is not valid UTF-8"},
      {[](JobSpec* s) {
         s->tokens_per_step = 1024;
         s->micro_batch_rows = 3;
       },
       "train.micro_batch_rows (3) must divide"}};
  for (const auto& [breaks, message] : broken) {
    JobSpec bad = spec;
    breaks(&bad);
    const absl::Status status = ValidateJobSpec(bad);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_THAT(std::string(status.message()), HasSubstr(message));
  }
}

TEST(JobSpecTest, MinLrRatioAboveOneIsRefused) {
  ExpectInvalid(WithTrain("min_lr_ratio: 1.5"), "train.min_lr_ratio");
}

TEST(JobSpecTest, OutOfRangeOptimizerAndCheckpointFieldsAreRefused) {
  ExpectInvalid(WithTrain("beta1: 1.0"), "train.beta1");
  ExpectInvalid(WithTrain("beta2: -0.1"), "train.beta2");
  ExpectInvalid(WithTrain("eps: 2"), "train.eps");
  ExpectInvalid(WithTrain("warmup_steps: -1"), "train.warmup_steps");
  ExpectInvalid(WithTrain("activation_checkpoint_every: -1"), "train.activation_checkpoint_every");
  ExpectInvalid(MinimalSpec() + "checkpoint:\n  max_shard_bytes: 1000\n",
                "checkpoint.max_shard_bytes");
  ExpectInvalid(MinimalSpec() + "checkpoint:\n  keep_last: -1\n", "checkpoint.keep_last");
  ExpectInvalid(std::string("model:\n  config:") + kTinyConfigYaml +
                    "data:\n  path: d.jsonl\n  seq_len: 1\n",
                "data.seq_len");
}

TEST(JobSpecTest, SectionThatIsNotAMappingIsRefusedByName) {
  ExpectInvalid(MinimalSpec() + "train: 5\n", "train");
  ExpectInvalid(MinimalSpec() + "checkpoint: [a]\n", "checkpoint");
}

TEST(JobSpecTest, MissingModelSectionIsRefused) {
  ExpectInvalid("data:\n  path: d.jsonl\n", "model");
}

TEST(JobSpecTest, TwoModelSourcesAtOnceAreRefused) {
  ExpectInvalid(std::string("model:\n  path: models/tiny\n  config:") + kTinyConfigYaml +
                    "data:\n  path: d.jsonl\n",
                "exactly one of model.path");
}

TEST(JobSpecTest, ModelWithNoSourceIsRefused) {
  ExpectInvalid("model:\n  init_seed: 3\ndata:\n  path: d.jsonl\n", "exactly one of model.path");
}

TEST(JobSpecTest, MissingDataPathIsRefused) {
  ExpectInvalid(std::string("model:\n  config:") + kTinyConfigYaml + "data:\n  seq_len: 64\n",
                "data.path");
}

TEST(JobSpecTest, MissingDataSectionIsRefused) {
  ExpectInvalid(std::string("model:\n  config:") + kTinyConfigYaml, "data");
}

TEST(JobSpecTest, UnsupportedDataFormatIsRefused) {
  ExpectInvalid(std::string("model:\n  config:") + kTinyConfigYaml +
                    "data:\n  path: d.jsonl\n  format: parquet\n",
                "data.format");
}

TEST(JobSpecTest, ModelTokenizerWithoutModelFolderIsRefused) {
  ExpectInvalid(std::string("model:\n  config:") + kTinyConfigYaml +
                    "data:\n  path: d.jsonl\n  tokenizer: model\n",
                "data.tokenizer");
}

TEST(JobSpecTest, TokenizerPathResolvesAgainstTheSpecFolder) {
  TempDir dir;
  absl::StatusOr<JobSpec> spec = ParseJobSpec(
      std::string("model:\n  config:") + kTinyConfigYaml +
          "data:\n  path: d.jsonl\n  tokenizer: tok/tokenizer.json\n",
      dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->tokenizer, TokenizerSource::kFile);
  EXPECT_EQ(spec->tokenizer_path, dir.Join("tok/tokenizer.json"));
}

TEST(JobSpecTest, BadBackendIsRefused) {
  ExpectInvalid(MinimalSpec() + "backend: gpu\n", "backend");
  ExpectInvalid(MinimalSpec() + "backend: gpu\n", "'gpu'");
}

TEST(JobSpecTest, TextThatIsNotYamlIsRefused) {
  ExpectInvalid("model: [unclosed\ndata: {path: x\n", "not valid YAML");
}

TEST(JobSpecTest, YamlListInsteadOfMappingIsRefused) {
  ExpectInvalid("- model\n- data\n", "mapping");
}

TEST(JobSpecTest, EmptyDocumentIsRefused) { ExpectInvalid("", "mapping"); }

TEST(JobSpecTest, ErrorsArePrefixedWithTheSourceName) {
  TempDir dir;
  absl::StatusOr<JobSpec> spec = ParseJobSpec(WithTrain("steps: -3"), dir.path(), "run.yaml");
  ASSERT_FALSE(spec.ok());
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("run.yaml"));
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("-3"));
}

TEST(JobSpecTest, ConfigPathToMissingFileIsNotFound) {
  ExpectRefused("model:\n  config_path: nowhere/config.json\ndata:\n  path: d.jsonl\n",
                absl::StatusCode::kNotFound, "model.config_path");
}

TEST(JobSpecTest, ConfigPathIsReadRelativeToBaseDir) {
  TempDir dir;
  WriteFile(dir.Join("cfg/config.json"), kTinyConfigJson);
  absl::StatusOr<JobSpec> spec =
      ParseJobSpec("model:\n  config_path: cfg/config.json\ndata:\n  path: d.jsonl\n", dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model_config_json, kTinyConfigJson);
  absl::StatusOr<ModelConfig> config = ResolveModelConfig(*spec);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->hidden_size, 32);
}

TEST(JobSpecTest, ModelConfigThatIsNotAMappingIsRefused) {
  ExpectInvalid("model:\n  config: [1, 2]\ndata:\n  path: d.jsonl\n", "model.config");
  ExpectInvalid("model:\n  config: llama\ndata:\n  path: d.jsonl\n", "model.config");
}

TEST(JobSpecTest, TokensPerStepOf2To31IsRefused) {
  // 2^15 * 2^8 * 2^8 = 2^31 tokens: one past the limit.
  ExpectInvalid(MinimalSpec() + "train:\n  micro_batches: 32768\n  micro_batch_rows: 256\n",
                "2^31");
}

TEST(JobSpecTest, TokensPerStepWhoseProductOverflowsInt64IsRefused) {
  // 2^32 * 2^32 * 256 wraps to 0 in two's complement int64 arithmetic.
  ExpectInvalid(MinimalSpec() +
                    "train:\n  micro_batches: 4294967296\n  micro_batch_rows: 4294967296\n",
                "2^31");
}

TEST(JobSpecTest, NameOver256BytesIsRefusedNamingTheLimit) {
  ExpectInvalid("name: " + std::string(257, 'x') + "\n" + MinimalSpec(), "at most 256");
  TempDir dir;
  EXPECT_TRUE(ParseJobSpec("name: " + std::string(256, 'x') + "\n" + MinimalSpec(), dir.path())
                  .ok());
}

TEST(JobSpecTest, NameWithAControlCharacterIsRefusedNamingItsPosition) {
  ExpectInvalid("name: \"ab\\ncd\"\n" + MinimalSpec(), "name has a control character (U+000A) at byte 2");
  ExpectInvalid("name: \"\\e[31mred\"\n" + MinimalSpec(), "(U+001B) at byte 0");
  ExpectInvalid("name: \"x\\x7f\"\n" + MinimalSpec(), "(U+007F) at byte 1");
  ExpectInvalid("name: \"x\\x85\"\n" + MinimalSpec(), "(U+0085) at byte 1");  // C1 NEL
  TempDir dir;
  EXPECT_TRUE(ParseJobSpec("name: \"caf\u00e9 run-1\"\n" + MinimalSpec(), dir.path()).ok());
}

TEST(JobSpecTest, TokenizeThreadsAboveTheCoresIsRefusedNamingThem) {
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  ExpectInvalid(MinimalSpec() + "  tokenize_threads: 1000000\n",
                absl::StrCat("data.tokenize_threads is 1000000; this machine has ", cores));
  TempDir dir;
  EXPECT_TRUE(ParseJobSpec(MinimalSpec() + absl::StrCat("  tokenize_threads: ", cores, "\n"),
                           dir.path()).ok());
}

TEST(JobSpecTest, ConfigPathThatIsAFifoIsRefusedWithoutBlocking) {
  TempDir dir;
  ASSERT_EQ(::mkfifo(dir.Join("config.json").c_str(), 0600), 0);
  std::optional<absl::Status> s = testing::RunWithin(5, [&] {
    return ParseJobSpec("model:\n  config_path: config.json\ndata:\n  path: d.jsonl\n",
                        dir.path()).status();
  });
  ASSERT_TRUE(s.has_value()) << "reading a FIFO blocked";
  EXPECT_EQ(s->code(), absl::StatusCode::kInvalidArgument) << *s;
  EXPECT_THAT(std::string(s->message()),
              HasSubstr("model.config_path: " + dir.Join("config.json") +
                        " is not a regular file (a FIFO)"));
}

TEST(ResolveModelConfigTest, ConfigJsonSymlinkLoopIsRefusedNotThrown) {
  TempDir dir;
  fs::create_directories(dir.Join("model"));
  ASSERT_EQ(::symlink("config.json", dir.Join("model/config.json").c_str()), 0);
  absl::StatusOr<JobSpec> spec =
      ParseJobSpec("model: {path: model}\ndata: {path: d.jsonl}\n", dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<ModelConfig> config = ResolveModelConfig(*spec);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << config.status();
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("model.path: "));
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("a loop of symbolic links"));
}

TEST(ResolveModelConfigTest, UnreadableConfigJsonIsRefusedNotThrown) {
  if (::geteuid() == 0) GTEST_SKIP() << "root reads every file";
  TempDir dir;
  WriteFile(dir.Join("model/config.json"), kTinyConfigJson);
  fs::permissions(dir.Join("model/config.json"), fs::perms::none);
  absl::StatusOr<JobSpec> spec =
      ParseJobSpec("model: {path: model}\ndata: {path: d.jsonl}\n", dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<ModelConfig> config = ResolveModelConfig(*spec);
  EXPECT_EQ(config.status().code(), absl::StatusCode::kPermissionDenied) << config.status();
}

// Dynamic-NTK RoPE takes the job's sequence length (data.seq_len) for its frequencies.
TEST(ResolveModelConfigTest, DynamicRopeGetsTheJobsSequenceLength) {
  TempDir dir;
  absl::StatusOr<JobSpec> spec = ParseJobSpec(
      "model:\n  config: {architectures: [LlamaForCausalLM], hidden_size: 32, "
      "intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, vocab_size: 300, "
      "max_position_embeddings: 128, rope_scaling: {rope_type: dynamic, factor: 2.0}}\n"
      "data:\n  path: d.jsonl\n  seq_len: 512\n",
      dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<ModelConfig> config = ResolveModelConfig(*spec);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->rope_scaling.type, RopeScaling::Type::kDynamic);
  EXPECT_EQ(config->rope_scaling.dynamic_seq_len, 512);
}

// A sequence past max_position_embeddings without rope_scaling is warned about (naming
// the fields and a fix), not refused; with scaling, or within the length, nothing is said.
TEST(JobWarningsTest, SequencePastMaxPositionsWithoutRopeScalingIsWarnedAbout) {
  JobSpec spec;
  spec.seq_len = 8192;
  ModelConfig config;
  config.max_position_embeddings = 4096;
  const std::vector<std::string> w = JobWarnings(spec, config);
  ASSERT_EQ(w.size(), 1u);
  for (const char* want : {"data.seq_len 8192", "max_position_embeddings 4096", "rope_scaling",
                           "\"factor\": 2", "data.seq_len to 4096 or less"}) {
    EXPECT_THAT(w[0], HasSubstr(want));
  }
  config.rope_scaling.type = RopeScaling::Type::kLinear;
  config.rope_scaling.factor = 2;
  EXPECT_TRUE(JobWarnings(spec, config).empty());
  config.rope_scaling = RopeScaling{};
  spec.seq_len = 4096;
  EXPECT_TRUE(JobWarnings(spec, config).empty());
}

TEST(ResolveModelConfigTest, FolderWithoutConfigJsonIsNotFoundNamingTheFolder) {
  TempDir dir;
  fs::create_directories(dir.Join("models/empty"));
  absl::StatusOr<JobSpec> spec =
      ParseJobSpec("model: {path: models/empty}\ndata: {path: d.jsonl}\n", dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<ModelConfig> config = ResolveModelConfig(*spec);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kNotFound) << config.status();
  EXPECT_THAT(std::string(config.status().message()), HasSubstr(dir.Join("models/empty")));
}

TEST(ResolveModelConfigTest, FolderWithConfigJsonIsRead) {
  TempDir dir;
  WriteFile(dir.Join("models/tiny/config.json"), kTinyConfigJson);
  absl::StatusOr<JobSpec> spec =
      ParseJobSpec("model: {path: models/tiny}\ndata: {path: d.jsonl}\n", dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<ModelConfig> config = ResolveModelConfig(*spec);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->num_layers, 2);
  EXPECT_EQ(config->vocab_size, 300);
}

TEST(ResolveModelConfigTest, InlineConfigParsesWithNaturalScalarTypes) {
  TempDir dir;
  const std::string yaml = std::string("model:\n  config:") + kTinyConfigYaml +
                           "    rms_norm_eps: 1.0e-5\n"
                           "    rope_theta: 500000.0\n"
                           "    tie_word_embeddings: true\n"
                           "    rope_scaling: null\n"
                           "    model_type: \"llama\"\n"
                           "data:\n  path: d.jsonl\n";
  absl::StatusOr<JobSpec> spec = ParseJobSpec(yaml, dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<ModelConfig> config = ResolveModelConfig(*spec);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->architecture, Architecture::kLlama);
  EXPECT_EQ(config->hidden_size, 32);
  EXPECT_EQ(config->intermediate_size, 64);
  EXPECT_EQ(config->num_layers, 2);
  EXPECT_EQ(config->num_heads, 4);
  EXPECT_EQ(config->num_kv_heads, 2);
  EXPECT_EQ(config->head_dim, 8);
  EXPECT_EQ(config->vocab_size, 300);
  EXPECT_DOUBLE_EQ(config->rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(config->rope_theta, 500000.0);
  EXPECT_TRUE(config->tie_word_embeddings);
}

TEST(ResolveModelConfigTest, InlineConfigErrorsNameModelConfig) {
  TempDir dir;
  const std::string yaml =
      "model:\n  config:\n    architectures: [LlamaForCausalLM]\n    hidden_size: 32\n"
      "data:\n  path: d.jsonl\n";
  absl::StatusOr<JobSpec> spec = ParseJobSpec(yaml, dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<ModelConfig> config = ResolveModelConfig(*spec);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("model.config"));
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("num_hidden_layers"));
}

TEST(ResolveModelConfigTest, QuotedNumberInInlineConfigStaysAString) {
  TempDir dir;
  const std::string yaml =
      "model:\n  config:\n    architectures: [LlamaForCausalLM]\n    hidden_size: \"32\"\n"
      "    intermediate_size: 64\n    num_hidden_layers: 2\n    num_attention_heads: 4\n"
      "    vocab_size: 300\n"
      "data:\n  path: d.jsonl\n";
  absl::StatusOr<JobSpec> spec = ParseJobSpec(yaml, dir.path());
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<ModelConfig> config = ResolveModelConfig(*spec);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("hidden_size"));
}

TEST(LoadJobSpecTest, RelativePathsResolveAgainstTheSpecFilesFolder) {
  TempDir dir;
  WriteFile(dir.Join("jobs/run.yaml"), MinimalSpec() + "checkpoint:\n  dir: out\n");
  absl::StatusOr<JobSpec> spec = LoadJobSpec(dir.Join("jobs/run.yaml"));
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->data_path, dir.Join("jobs/train.jsonl"));
  EXPECT_EQ(spec->checkpoint_dir, dir.Join("jobs/out"));
}

TEST(LoadJobSpecTest, MissingFileIsNotFoundAndErrorsNameTheFile) {
  TempDir dir;
  absl::StatusOr<JobSpec> missing = LoadJobSpec(dir.Join("nope.yaml"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr(dir.Join("nope.yaml")));

  WriteFile(dir.Join("bad.yaml"), WithTrain("steps: -3"));
  absl::StatusOr<JobSpec> bad = LoadJobSpec(dir.Join("bad.yaml"));
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr(dir.Join("bad.yaml")));
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("train.steps"));
}

// The Fingerprint() of the tiny model's spec with `extra_data` lines under data: and `train`
// under train: ("" when it does not parse, which fails the test).
std::string TinyFingerprint(const std::string& dir, const std::string& extra_data,
                            const std::string& train) {
  const std::string yaml = std::string("model:\n  config:") + kTinyConfigYaml +
                           "data:\n  path: d.jsonl\n" + extra_data + "train:\n  " + train + "\n";
  absl::StatusOr<JobSpec> spec = ParseJobSpec(yaml, dir);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? spec->Fingerprint() : std::string();
}

TEST(JobSpecFingerprintTest, ChangesWithSeqLenButNotWithSteps) {
  TempDir dir;
  auto parse = [&](const std::string& extra_data, const std::string& train) {
    return TinyFingerprint(dir.path(), extra_data, train);
  };
  const std::string base = parse("  seq_len: 64\n", "steps: 10");
  ASSERT_FALSE(base.empty());
  EXPECT_EQ(base, parse("  seq_len: 64\n", "steps: 500"));
  EXPECT_EQ(base, parse("  seq_len: 64\n", "lr: 0.5"));
  EXPECT_NE(base, parse("  seq_len: 128\n", "steps: 10"));
  EXPECT_NE(base, parse("  seq_len: 64\n", "micro_batches: 2"));
  EXPECT_NE(base, parse("  seq_len: 64\n  seed: 9\n", "steps: 10"));
}

// A checkpoint of other adapters (or of none) is not resumed; a job without them keeps the
// fingerprint it had before adapters were a field.
TEST(JobSpecFingerprintTest, ChangesWithTheLoraSetup) {
  TempDir dir;
  auto parse = [&](const std::string& lora) {
    return TinyFingerprint(dir.path(), "", "steps: 10\nlora: {" + lora + "}");
  };
  const std::string plain = TinyFingerprint(dir.path(), "", "steps: 10");
  ASSERT_FALSE(plain.empty());
  EXPECT_EQ(plain.find("\"lora_"), std::string::npos);
  const std::string base = parse("rank: 16");
  ASSERT_FALSE(base.empty());
  EXPECT_NE(base, plain);
  EXPECT_EQ(base, parse("rank: 16, alpha: 32"));
  EXPECT_NE(base, parse("rank: 8"));
  EXPECT_NE(base, parse("rank: 16, alpha: 16"));
  EXPECT_NE(base, parse("rank: 16, rslora: true"));
  EXPECT_NE(base, parse("rank: 16, target_modules: [q_proj]"));
  EXPECT_NE(base, parse("rank: 16, init: gaussian"));
  EXPECT_NE(base, parse("rank: 16, adapter: /adapters/run1"));
  EXPECT_THAT(FingerprintDifferences(base, parse("rank: 8")),
              ElementsAre("lora.alpha (32.0 there, 16.0 here)", "lora.rank (16 there, 8 here)"));
}

// A resume refused for another job's checkpoints says which fields differ, as the spec
// names them, with short values (in the order of Fingerprint()'s keys).
TEST(JobSpecFingerprintTest, DifferencesNameTheSpecFields) {
  TempDir dir;
  auto parse = [&](const std::string& extra_data, const std::string& train) {
    return TinyFingerprint(dir.path(), extra_data, train);
  };
  const std::string base = parse("  seq_len: 64\n", "micro_batch_rows: 2");
  EXPECT_THAT(FingerprintDifferences(base, base), IsEmpty());
  const std::string longer = parse("  seq_len: 64\n", "steps: 500\n  micro_batch_rows: 2");
  EXPECT_THAT(FingerprintDifferences(base, longer), IsEmpty());
  EXPECT_THAT(FingerprintDifferences(base, parse("  seq_len: 128\n  seed: 9\n  packing: pad\n",
                                                 "micro_batch_rows: 2")),
              ElementsAre("data.seed (0 there, 9 here)",
                          "data.packing (\"pack\" there, \"pad\" here)",
                          "data.seq_len (64 there, 128 here)"));
  EXPECT_THAT(FingerprintDifferences(base, parse("  seq_len: 64\n", "micro_batch_rows: 4")),
              ElementsAre("sequences per step (2 there, 4 here)"));
  // A key this version does not know is shown as it is; a fingerprint that is not JSON (or
  // none) gives nothing to name.
  std::string extra = base;
  extra.insert(1, "\"new_key\":1,");
  EXPECT_THAT(FingerprintDifferences(extra, base), ElementsAre("new_key (1 there, null here)"));
  EXPECT_THAT(FingerprintDifferences("not json", base), IsEmpty());
  EXPECT_THAT(FingerprintDifferences("", base), IsEmpty());
}

}  // namespace
}  // namespace megatrain

namespace megatrain {
namespace {

std::string WithDpo(const std::string& fields) {
  return MinimalSpec() + "dpo: {" + fields + "}\n";
}

TEST(JobSpecTest, DpoSectionParsesEveryFieldRoundTripsAndEntersTheFingerprint) {
  absl::StatusOr<JobSpec> plain = ParseJobSpec(MinimalSpec(), "");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->dpo.enabled);
  EXPECT_EQ(JobSpecToYaml(*plain).find("\ndpo:"), std::string::npos);
  absl::StatusOr<JobSpec> defaults = ParseJobSpec(WithDpo(""), "");
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_TRUE(defaults->dpo.enabled);
  EXPECT_EQ(defaults->dpo.beta, 0.1);
  EXPECT_EQ(defaults->dpo.loss, DpoLoss::kSigmoid);
  EXPECT_NE(defaults->Fingerprint(), plain->Fingerprint());

  absl::StatusOr<JobSpec> spec = ParseJobSpec(
      WithDpo("beta: 0.3, loss: ipo, rpo_alpha: 0.5, reference_free: true, max_length: 128, "
              "truncation: keep_end"),
      "");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->dpo.beta, 0.3);
  EXPECT_EQ(spec->dpo.loss, DpoLoss::kIpo);
  EXPECT_EQ(spec->dpo.rpo_alpha, 0.5);
  EXPECT_TRUE(spec->dpo.reference_free);
  EXPECT_EQ(spec->dpo.max_length, 128);
  EXPECT_EQ(spec->dpo.truncation, DpoTruncation::kKeepEnd);
  const std::string yaml = JobSpecToYaml(*spec);
  absl::StatusOr<JobSpec> again = ParseJobSpec(yaml, "");
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << yaml;
  EXPECT_EQ(JobSpecToYaml(*again), yaml);
  EXPECT_EQ(again->Fingerprint(), spec->Fingerprint());
  EXPECT_THAT(FingerprintDifferences(defaults->Fingerprint(), spec->Fingerprint()),
              ::testing::Contains(HasSubstr("dpo.beta")));

  // TRL's prompt and completion cuts, and a named reference (resolved against the spec's
  // folder): each enters the fingerprint.
  absl::StatusOr<JobSpec> cut = ParseJobSpec(
      WithDpo("max_prompt_length: 12, max_completion_length: 20, reference: sft/checkpoint-9"),
      "/lab");
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->dpo.max_prompt_length, 12);
  EXPECT_EQ(cut->dpo.max_completion_length, 20);
  EXPECT_EQ(cut->dpo.reference, "/lab/sft/checkpoint-9");
  const std::string cut_yaml = JobSpecToYaml(*cut);
  absl::StatusOr<JobSpec> cut_again = ParseJobSpec(cut_yaml, "/elsewhere");
  ASSERT_TRUE(cut_again.ok()) << cut_again.status() << "\n" << cut_yaml;
  EXPECT_EQ(cut_again->Fingerprint(), cut->Fingerprint());
  EXPECT_THAT(FingerprintDifferences(defaults->Fingerprint(), cut->Fingerprint()),
              IsSupersetOf({HasSubstr("dpo.max_prompt_length"),
                                       HasSubstr("dpo.max_completion_length"),
                                       HasSubstr("dpo.reference")}));
}

TEST(JobSpecTest, DpoSettingsOutOfRangeOrMisplacedAreRefusedNamingTheField) {
  ExpectInvalid(WithDpo("beta: 0"), "dpo.beta");
  ExpectInvalid(WithDpo("loss: kto"), "dpo.loss");
  ExpectInvalid(WithDpo("label_smoothing: 0.5"), "dpo.label_smoothing");
  ExpectInvalid(WithDpo("loss: hinge, label_smoothing: 0.1"), "dpo.label_smoothing");
  ExpectInvalid(WithDpo("rpo_alpha: -1"), "dpo.rpo_alpha");
  ExpectInvalid(WithDpo("max_length: 100000"), "dpo.max_length");
  ExpectInvalid(WithDpo("reference: sft, reference_free: true"), "dpo.reference");
  ExpectInvalid(WithDpo("max_prompt_length: -1"), "dpo.max_prompt_length");
  ExpectInvalid(WithDpo("max_completion_length: 100000"), "dpo.max_completion_length");
  ExpectInvalid(WithDpo("referenc: sft"), "referenc");
  ExpectInvalid(MinimalSpec() + "dpo: 3\n", "dpo");
  ExpectInvalid(WithDpo("") + "eval: {path: held.jsonl, format: alpaca}\n", "eval.format");
  ExpectInvalid(std::string("model:\n  config:") + kTinyConfigYaml +
                    "data: {path: train.jsonl, format: alpaca}\ndpo: {}\n",
                "data.format");
}

}  // namespace
}  // namespace megatrain
