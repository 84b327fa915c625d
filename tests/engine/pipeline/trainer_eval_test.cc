// Evaluation inside a training job (the spec's eval section) on the CPU backend: when it
// runs, that it measures what training measures, that it changes nothing a checkpoint
// holds, and that a bad eval set is refused naming eval.path.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "engine/job/trainer.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace megatrain {
namespace {
namespace fs = std::filesystem;
using ::megatrain::testing::TempDir;
using ::megatrain::testing::WriteFile;

constexpr const char* kText =
    "{\"text\": \"The cat sat on the mat. The dog sat on the log.\"}\n"
    "{\"text\": \"Streaming layers through the GPU keeps memory small.\"}\n"
    "{\"text\": \"A held-out line measures what the model learned, not what it saw.\"}\n";

// A tiny llama, 4 sequences of 32 per step in 2 micro-batches; `eval` and `checkpoint`
// are whole sections or "".
std::string Spec(int steps, const std::string& eval, const std::string& checkpoint = "") {
  return "model:\n"
         "  config: {architectures: [LlamaForCausalLM], hidden_size: 64, intermediate_size: 96,\n"
         "           num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,\n"
         "           vocab_size: 258, tie_word_embeddings: true}\n"
         "  init_seed: 3\n"
         "data: {path: data.jsonl, seq_len: 32, seed: 5, cache_dir: cache}\n"
         "train: {steps: " + std::to_string(steps) + ", micro_batch_rows: 2, micro_batches: 2,\n"
         "        lr: 1.0e-2, warmup_steps: 2, max_grad_norm: 1.0}\n" + eval + checkpoint;
}

absl::StatusOr<std::unique_ptr<Trainer>> Make(const std::string& dir, const std::string& yaml) {
  absl::StatusOr<JobSpec> spec = ParseJobSpec(yaml, dir);
  if (!spec.ok()) return spec.status();
  return Trainer::Create(*spec);
}

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The eval set is the training file with the data's seed and packing: its first 4 rows
// are step 1's batch, so the evaluation before step 1 measures that step's loss.
TEST(TrainerEval, StartingPointEqualsTheFirstStepsLossBitForBitAndRunsWhenAsked) {
  TempDir dir;
  WriteFile(dir.path() + "/data.jsonl", kText);
  absl::StatusOr<std::unique_ptr<Trainer>> t =
      Make(dir.path(), Spec(5, "eval: {path: data.jsonl, every_steps: 2, max_rows: 4}\n"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->eval_batches().size(), 2u);
  std::vector<int64_t> eval_steps;
  while (!(*t)->done()) {
    absl::StatusOr<StepReport> r = (*t)->Step();
    ASSERT_TRUE(r.ok()) << r.status();
    if (r->step == 1) {
      ASSERT_FALSE(r->evals.empty());
      EXPECT_EQ(r->evals[0].step, 0);
      EXPECT_EQ(r->evals[0].loss, r->loss);
      EXPECT_DOUBLE_EQ(r->evals[0].perplexity, std::exp(r->loss));
      EXPECT_EQ(r->evals[0].tokens, 4 * 32);
      EXPECT_GT(r->evals[0].targets, 0);
    }
    for (const EvalReport& e : r->evals) eval_steps.push_back(e.step);
  }
  EXPECT_EQ(eval_steps, (std::vector<int64_t>{0, 2, 4, 5}));
  // And on demand, changing nothing: twice the same bits.
  absl::StatusOr<EvalReport> a = (*t)->Evaluate(), b = (*t)->Evaluate();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->loss, b->loss);
  EXPECT_EQ(a->step, 5);
}

// On the CPU backend the pass's buffers are host memory: the whole set (3 micro-batches,
// more than a step's 2) fits the step's activations (4 micro-batches) in one pass.
TEST(TrainerEval, TheWholeSetGoesThroughTheLayersInOnePassWhenItFits) {
  TempDir dir;
  WriteFile(dir.path() + "/data.jsonl", kText);
  absl::StatusOr<std::unique_ptr<Trainer>> t =
      Make(dir.path(), Spec(1, "eval: {path: data.jsonl, max_rows: 8}\n"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->eval_batches().size(), 3u);
  EXPECT_EQ((*t)->plan().eval_micro_batches, 4);
  absl::StatusOr<EvalReport> e = (*t)->Evaluate();
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->tokens, 3 * 2 * 32);
}

TEST(TrainerEval, EvaluatingChangesNoByteOfAnyCheckpoint) {
  TempDir dir;
  WriteFile(dir.path() + "/data.jsonl", kText);
  WriteFile(dir.path() + "/held.jsonl", "{\"text\": \"Held out, never trained on.\"}\n");
  const std::string every_2 = "checkpoint: {every_steps: 2, background: false, keep_last: 9, dir: ";
  for (const char* name : {"with", "without"}) {
    const std::string eval =
        std::string(name) == "with" ? "eval: {path: held.jsonl, every_steps: 1}\n" : "";
    absl::StatusOr<std::unique_ptr<Trainer>> t =
        Make(dir.path(), Spec(4, eval, every_2 + name + "}\n"));
    ASSERT_TRUE(t.ok()) << t.status();
    while (!(*t)->done()) {
      absl::StatusOr<StepReport> r = (*t)->Step();
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->evals.empty(), eval.empty());
    }
  }
  int compared = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir.path() + "/without")) {
    if (!e.is_regular_file()) continue;
    const fs::path rel = fs::relative(e.path(), dir.path() + "/without");
    EXPECT_EQ(ReadFile(e.path()), ReadFile(fs::path(dir.path()) / "with" / rel)) << rel;
    ++compared;
  }
  EXPECT_GE(compared, 2 * 4);  // two checkpoints of several files each
}

TEST(TrainerEval, EvalSetWithoutATargetIsRefusedNamingEvalPath) {
  TempDir dir;
  WriteFile(dir.path() + "/data.jsonl", kText);
  // A prompt without an answer: every token masked, nothing to measure.
  WriteFile(dir.path() + "/held.jsonl",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n");
  absl::StatusOr<std::unique_ptr<Trainer>> t =
      Make(dir.path(), Spec(2, "eval: {path: held.jsonl, format: messages}\n"));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_NE(t.status().message().find("eval.path"), std::string::npos) << t.status();
}

TEST(TrainerEval, MissingEvalFileIsNotFoundNamingEvalPath) {
  TempDir dir;
  WriteFile(dir.path() + "/data.jsonl", kText);
  absl::StatusOr<std::unique_ptr<Trainer>> t =
      Make(dir.path(), Spec(2, "eval: {path: nowhere.jsonl}\n"));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound) << t.status();
  EXPECT_NE(t.status().message().find("eval.path"), std::string::npos) << t.status();
}

}  // namespace
}  // namespace megatrain
