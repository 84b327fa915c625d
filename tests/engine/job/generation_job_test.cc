// A generation job (engine.h's GenerationJob) on the CPU backend, run in parts as the daemon's
// steps run it: the parts' completions are those of one run, and an output resumed after a
// stop (a last line cut short included) keeps its completions and adds the others'.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/backend/planning_backend.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/engine.h"
#include "engine/job/generation_job.h"
#include "engine/store/model_io.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/engine/pipeline/tiny_model.h"
#include "tests/util/temp_dir.h"

namespace megatrain::testing {
namespace {

// A tiny model folder (a checkpoint's), written once per test.
std::string TinyModelFolder(const TempDir& dir) {
  ModelConfig config = TinyConfig(Variant::kQwen3QkNorm);
  config.vocab_size = 260;  // the byte tokenizer's ids and a few more
  std::unique_ptr<HostStore> store = std::move(*HostStore::Create(BuildLayout(config)));
  RandomInitWeights(config, 5, store.get());
  absl::StatusOr<std::string> path =
      SaveCheckpoint(dir.Join("model"), config, *store, TrainerState{}, CheckpointOptions{});
  EXPECT_TRUE(path.ok()) << path.status();
  return path.ok() ? *path : "";
}

GenerateSpec Sampled(const std::string& model, const std::string& output) {
  GenerateSpec g;
  g.model_path = model;
  g.prompts = {"The cat", "A", "Once upon", "x y z", "Hello there", "7"};
  g.output_path = output;
  g.tokenizer = "byte";
  g.temperature = 1.0;
  g.seed = 3;
  g.max_new_tokens = 6;
  g.ignore_eos = true;
  g.backend = "cpu";
  g.max_sequences = 2;
  return g;
}

// Each output line's ids, by prompt index.
std::map<int64_t, std::vector<int32_t>> IdsByIndex(const std::string& path) {
  std::map<int64_t, std::vector<int32_t>> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    EXPECT_EQ(out.count(j["index"].get<int64_t>()), 0u) << "prompt completed twice";
    out[j["index"].get<int64_t>()] = j["ids"].get<std::vector<int32_t>>();
  }
  return out;
}

TEST(GenerationJobTest, PartsAndAResumedOutputGiveTheCompletionsOfOneRun) {
  TempDir dir;
  const std::string model = TinyModelFolder(dir);
  const RunOptions run{"cpu", "", ""};
  absl::StatusOr<std::unique_ptr<GenerationJob>> whole =
      GenerationJob::Create(Sampled(model, dir.Join("whole.jsonl")), run);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_TRUE((*whole)->Run(nullptr).ok());
  const std::map<int64_t, std::vector<int32_t>> want = IdsByIndex(dir.Join("whole.jsonl"));
  ASSERT_EQ(want.size(), 6u);

  const std::string parts = dir.Join("parts.jsonl");
  {
    absl::StatusOr<std::unique_ptr<GenerationJob>> first =
        GenerationJob::Create(Sampled(model, parts), run);
    ASSERT_TRUE(first.ok()) << first.status();
    absl::StatusOr<GenerationSummary> some = (*first)->RunSome(2, nullptr);
    ASSERT_TRUE(some.ok()) << some.status();
    EXPECT_EQ(some->prompts, 2);
    EXPECT_EQ((*first)->prompts_done(), 2);
  }
  std::ofstream(parts, std::ios::app) << "{\"index\": 4, \"completion\": \"cut sh";  // killed
  GenerateSpec resumed = Sampled(model, parts);
  resumed.resume_output = true;
  absl::StatusOr<std::unique_ptr<GenerationJob>> second = GenerationJob::Create(resumed, run);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*second)->prompts_done(), 2) << "the line cut short counts as done";
  int64_t called = 0;
  absl::StatusOr<GenerationSummary> rest =
      (*second)->RunSome(3, [&](const CompletionReport&) { ++called; });
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(called, 3);
  EXPECT_EQ(rest->prompts, 5);
  ASSERT_TRUE((*second)->Run(nullptr).ok());
  EXPECT_EQ((*second)->prompts_done(), 6);
  EXPECT_EQ(IdsByIndex(parts), want);

  // Without resume_output the file starts afresh.
  absl::StatusOr<std::unique_ptr<GenerationJob>> afresh =
      GenerationJob::Create(Sampled(model, parts), run);
  ASSERT_TRUE(afresh.ok());
  EXPECT_EQ((*afresh)->prompts_done(), 0);
  EXPECT_TRUE(IdsByIndex(parts).empty());
}

TEST(GenerationJobTest, AResumedOutputOfAnotherRunIsRefusedNamingIt) {
  TempDir dir;
  const std::string model = TinyModelFolder(dir);
  const std::string output = dir.Join("other.jsonl");
  std::ofstream(output) << "{\"index\": 9, \"completion\": \"x\"}\n";
  GenerateSpec g = Sampled(model, output);
  g.resume_output = true;
  absl::StatusOr<std::unique_ptr<GenerationJob>> job = GenerationJob::Create(g, RunOptions{"cpu", "", ""});
  ASSERT_FALSE(job.ok());
  EXPECT_NE(job.status().message().find("another run's output"), std::string::npos)
      << job.status();
  EXPECT_NE(job.status().message().find(output), std::string::npos) << job.status();
}

// Planned at submit on a CUDA box's figures (a PlanningBackend), from config.json and the
// prompts alone: a Qwen2.5-7B folder with no weights at all plans resident on an H200's
// memory, and streamed through two slots on a 12 GB card (its 15 GB of bf16 weights do not
// fit), with the sequences the memory left holds.
TEST(GenerationJobTest, PlansFromTheConfigAndPromptsOnACudaBoxsFigures) {
  TempDir dir;
  const std::string model = dir.Join("qwen2.5-7b");
  std::filesystem::create_directories(model);
  std::ofstream(model + "/config.json")
      << R"({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
             "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "vocab_size": 152064, "rms_norm_eps": 1e-06,
             "rope_theta": 1000000.0, "max_position_embeddings": 32768,
             "tie_word_embeddings": false})";
  {
    std::ofstream prompts(dir.Join("prompts.jsonl"));
    for (int i = 0; i < 64; ++i) {
      prompts << "{\"input_ids\": [" << i;
      for (int t = 1; t < 512; ++t) prompts << ", " << (t * 7 + i) % 150000;
      prompts << "]}\n";
    }
  }
  GenerateSpec g;
  g.model_path = model;
  g.prompts_path = dir.Join("prompts.jsonl");
  g.tokenizer = "byte";
  g.max_new_tokens = 512;
  PlanningBackend h200("cuda:0", int64_t{140} << 30);
  absl::StatusOr<PlanSummary> resident = PlanGeneration(g, &h200);
  ASSERT_TRUE(resident.ok()) << resident.status();
  EXPECT_EQ(resident->weight_slots, 28);
  EXPECT_EQ(resident->sequences, 64);
  EXPECT_GT(resident->device_bytes, int64_t{15} << 30);  // the weights, at least
  EXPECT_LE(resident->device_bytes, int64_t{140} << 30);
  EXPECT_NEAR(static_cast<double>(resident->host_bytes), 2.0 * 7.62e9, 0.02 * 2 * 7.62e9);
  EXPECT_NE(resident->text.find("64 prompt(s); 64 sequence(s) at once, layers resident"),
            std::string::npos) << resident->text;

  PlanningBackend small("cuda:0", int64_t{12} << 30);
  absl::StatusOr<PlanSummary> streamed = PlanGeneration(g, &small);
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_EQ(streamed->weight_slots, 2);
  EXPECT_LT(streamed->device_bytes, int64_t{12} << 30);
  EXPECT_GE(streamed->sequences, 1);
  EXPECT_LE(streamed->sequences, 64);
  EXPECT_NE(streamed->text.find("streamed"), std::string::npos) << streamed->text;
}

}  // namespace
}  // namespace megatrain::testing
