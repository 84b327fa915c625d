// Tests for checkpoints: the folder Hugging Face loads (config.json, bf16 safetensors with
// format "pt", tokenizer files), the optimizer state and trainer state a resume restores
// bit for bit, sharding, and the listing / pruning that only trusts complete folders.
#include "engine/checkpoint/checkpoint.h"
#include "engine/checkpoint/merge.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/common/dtype.h"
#include "engine/model/layout.h"
#include "engine/model/lora.h"
#include "engine/model/safetensors.h"
#include "engine/optim/adamw.h"
#include "engine/store/model_io.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/model/same_config.h"
#include "tests/util/deadline.h"
#include "tests/util/temp_dir.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

using ::megatrain::testing::TempDir;

using ::megatrain::testing::WriteFile;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Tiny llama: C=32, I=64, L=2, H=4, KV=2 (D=8), V=300. `scale` multiplies C, I and V.
ModelConfig TinyConfig(bool tied, int64_t scale = 1) {
  ModelConfig c;
  c.architecture = Architecture::kLlama;
  c.hidden_size = 32 * scale;
  c.intermediate_size = 64 * scale;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = c.hidden_size / c.num_heads;
  c.vocab_size = 300 * scale;
  c.max_position_embeddings = 2048;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  c.tie_word_embeddings = tied;
  return c;
}

// A store holding random weights and distinct, seeded values in m and v, so that a file
// swapped between master, exp_avg and exp_avg_sq would be noticed.
std::unique_ptr<HostStore> FilledStore(const ModelConfig& config, uint64_t seed,
                                       const StoreOptions& options = {}) {
  absl::StatusOr<std::unique_ptr<HostStore>> store =
      HostStore::Create(BuildLayout(config), -1, options);
  EXPECT_TRUE(store.ok()) << store.status();
  if (!store.ok()) return nullptr;
  RandomInitWeights(config, seed, store->get());
  std::mt19937_64 gen(seed ^ 0x5eed);
  std::uniform_real_distribution<float> m_dist(-1e-2f, 1e-2f), v_dist(1.0f, 2.0f);
  for (int64_t u = 0; u < (*store)->num_units(); ++u) {
    for (const TensorSlot& t : (*store)->layout().units[u].tensors) {
      for (int64_t i = 0; i < t.num_elements; ++i) {
        (*store)->exp_avg(u)[t.offset + i] = m_dist(gen);
        (*store)->exp_avg_sq(u)[t.offset + i] = v_dist(gen);
      }
    }
  }
  return std::move(*store);
}

std::unique_ptr<HostStore> EmptyStore(const ModelConfig& config) {
  absl::StatusOr<std::unique_ptr<HostStore>> store = HostStore::Create(BuildLayout(config));
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? std::move(*store) : nullptr;
}

// A store of `config` restored from the checkpoint at `path`, its trainer state in *state;
// null, with a failure, when the store cannot be made or the load fails.
std::unique_ptr<HostStore> LoadIntoEmptyStore(const std::string& path, const ModelConfig& config,
                                              TrainerState* state) {
  std::unique_ptr<HostStore> store = EmptyStore(config);
  if (store == nullptr) return nullptr;
  const absl::Status loaded = LoadCheckpoint(path, store.get(), state);
  EXPECT_TRUE(loaded.ok()) << loaded;
  return loaded.ok() ? std::move(store) : nullptr;
}

TrainerState SampleState() {
  TrainerState s;
  s.step = 7;
  s.data.epoch = 2;
  s.data.doc_cursor = 13;
  s.data.token_offset = 5;
  s.data_seed = 0xfedcba9876543210ull;  // above INT64_MAX: must survive JSON as unsigned
  s.init_seed = 42;
  s.last_loss = 3.25;
  s.spec_fingerprint = "{\"seq_len\":64}";
  return s;
}

// Expects `a` and `b` to hold the same bits in every tensor element of every unit, for
// the part `get` selects (master, exp_avg or exp_avg_sq).
void ExpectSameState(const HostStore& a, const HostStore& b,
                     float* (HostStore::*get)(int64_t) const, const char* what) {
  ASSERT_EQ(a.num_units(), b.num_units());
  for (int64_t u = 0; u < a.num_units(); ++u) {
    for (const TensorSlot& t : a.layout().units[u].tensors) {
      EXPECT_EQ(std::memcmp((a.*get)(u) + t.offset, (b.*get)(u) + t.offset,
                            t.num_elements * sizeof(float)),
                0)
          << what << " of " << t.name;
    }
  }
}

class CheckpointTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    config_ = TinyConfig(/*tied=*/GetParam());
    store_ = FilledStore(config_, /*seed=*/1234);
    ASSERT_NE(store_, nullptr);
    WriteFile(tokenizer_.Join("tokenizer.json"), "{\"version\": \"1.0\", \"model\": {}}");
    WriteFile(tokenizer_.Join("notes.txt"), "not a tokenizer file");
    options_.tokenizer_dir = tokenizer_.path();
  }

  std::string Save() {
    absl::StatusOr<std::string> path =
        SaveCheckpoint(root_.path(), config_, *store_, SampleState(), options_);
    EXPECT_TRUE(path.ok()) << path.status();
    return path.ok() ? *path : std::string();
  }

  TempDir root_, tokenizer_;
  ModelConfig config_;
  std::unique_ptr<HostStore> store_;
  CheckpointOptions options_;
};

TEST_P(CheckpointTest, SaveWritesCheckpointFolderNamedByStepAndNoTmpRemains) {
  const std::string path = Save();
  ASSERT_FALSE(path.empty());
  EXPECT_EQ(path, root_.Join("checkpoint-7"));
  EXPECT_TRUE(fs::is_directory(path));
  EXPECT_FALSE(fs::exists(root_.Join(".checkpoint-7.tmp")));
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(root_.path())) {
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();
  }
}

TEST_P(CheckpointTest, ConfigJsonParsesBackToTheSameArchitecture) {
  const std::string path = Save();
  ASSERT_FALSE(path.empty());
  absl::StatusOr<ModelConfig> c = LoadModelConfig(path + "/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  testing_configs::ExpectSameConfig(*c, config_);
}

TEST_P(CheckpointTest, ModelSafetensorsHoldTheStoresBf16WeightsWithFormatPt) {
  const std::string path = Save();
  ASSERT_FALSE(path.empty());
  ASSERT_TRUE(fs::exists(path + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(path + "/model.safetensors.index.json"));
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata().count("format"), 1u);
  EXPECT_EQ(file->metadata().at("format"), "pt");

  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  size_t expected_tensors = 0;
  for (int64_t u = 0; u < store_->num_units(); ++u) {
    for (const TensorSlot& t : store_->layout().units[u].tensors) {
      ++expected_tensors;
      const TensorInfo* info = file->Find(t.name);
      ASSERT_NE(info, nullptr) << t.name;
      EXPECT_EQ(info->dtype, DType::kBF16) << t.name;
      EXPECT_EQ(info->shape, t.shape) << t.name;
      std::vector<uint16_t> bits(t.num_elements);
      ASSERT_TRUE(file->ReadRaw(*info, bits.data()).ok()) << t.name;
      EXPECT_EQ(std::memcmp(bits.data(), store_->weights(u) + t.offset,
                            t.num_elements * sizeof(uint16_t)),
                0)
          << t.name;
    }
  }
  EXPECT_EQ(file->tensors().size(), expected_tensors);
  EXPECT_EQ(file->Find("lm_head.weight") != nullptr, !config_.tie_word_embeddings);
}

TEST_P(CheckpointTest, OptimizerFoldersHoldF32MasterAndMoments) {
  const std::string path = Save();
  ASSERT_FALSE(path.empty());
  struct Part {
    const char* name;
    float* (HostStore::*get)(int64_t) const;
  };
  for (const Part& part : {Part{"master", &HostStore::master}, Part{"exp_avg", &HostStore::exp_avg},
                           Part{"exp_avg_sq", &HostStore::exp_avg_sq}}) {
    const std::string dir = path + "/optimizer/" + part.name;
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(dir + "/model.safetensors");
    ASSERT_TRUE(file.ok()) << file.status();
    for (int64_t u = 0; u < store_->num_units(); ++u) {
      for (const TensorSlot& t : store_->layout().units[u].tensors) {
        const TensorInfo* info = file->Find(t.name);
        ASSERT_NE(info, nullptr) << part.name << " " << t.name;
        EXPECT_EQ(info->dtype, DType::kF32) << part.name << " " << t.name;
        EXPECT_EQ(info->shape, t.shape) << part.name << " " << t.name;
        std::vector<float> values(t.num_elements);
        ASSERT_TRUE(file->ReadRaw(*info, values.data()).ok());
        EXPECT_EQ(std::memcmp(values.data(), ((*store_).*part.get)(u) + t.offset,
                              t.num_elements * sizeof(float)),
                  0)
            << part.name << " " << t.name;
      }
    }
  }
}

TEST_P(CheckpointTest, TrainerStateJsonAndTokenizerFilesAreWritten) {
  const std::string path = Save();
  ASSERT_FALSE(path.empty());
  const nlohmann::json js = nlohmann::json::parse(ReadFile(path + "/trainer_state.json"));
  EXPECT_EQ(js.at("step").get<int64_t>(), 7);
  EXPECT_EQ(js.at("data_seed").get<uint64_t>(), 0xfedcba9876543210ull);
  EXPECT_EQ(js.at("spec_fingerprint").get<std::string>(), "{\"seq_len\":64}");
  EXPECT_EQ(ReadFile(path + "/tokenizer.json"), ReadFile(tokenizer_.Join("tokenizer.json")));
  EXPECT_FALSE(fs::exists(path + "/notes.txt"));
}

TEST_P(CheckpointTest, LoadRestoresStateBitExactlyAndDerivesBf16FromMaster) {
  const std::string path = Save();
  ASSERT_FALSE(path.empty());
  TrainerState state;
  std::unique_ptr<HostStore> fresh = LoadIntoEmptyStore(path, config_, &state);
  ASSERT_NE(fresh, nullptr);

  ExpectSameState(*store_, *fresh, &HostStore::master, "master");
  ExpectSameState(*store_, *fresh, &HostStore::exp_avg, "exp_avg");
  ExpectSameState(*store_, *fresh, &HostStore::exp_avg_sq, "exp_avg_sq");
  for (int64_t u = 0; u < fresh->num_units(); ++u) {
    for (const TensorSlot& t : fresh->layout().units[u].tensors) {
      for (int64_t i = 0; i < t.num_elements; ++i) {
        ASSERT_EQ(fresh->weights(u)[t.offset + i], FloatToBf16(fresh->master(u)[t.offset + i]))
            << t.name << "[" << i << "]";
      }
    }
  }

  const TrainerState want = SampleState();
  EXPECT_EQ(state.step, want.step);
  EXPECT_EQ(state.data.epoch, want.data.epoch);
  EXPECT_EQ(state.data.doc_cursor, want.data.doc_cursor);
  EXPECT_EQ(state.data.token_offset, want.data.token_offset);
  EXPECT_EQ(state.data_seed, want.data_seed);
  EXPECT_EQ(state.init_seed, want.init_seed);
  EXPECT_EQ(state.last_loss, want.last_loss);
  EXPECT_EQ(state.spec_fingerprint, want.spec_fingerprint);
}

TEST_P(CheckpointTest, ModelFolderLoadsAsPretrainedWeights) {
  const std::string path = Save();
  ASSERT_FALSE(path.empty());
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::unique_ptr<HostStore> fresh = EmptyStore(config_);
  ASSERT_NE(fresh, nullptr);
  ASSERT_TRUE(LoadWeights(*reader, fresh.get()).ok());
  for (int64_t u = 0; u < fresh->num_units(); ++u) {
    for (const TensorSlot& t : fresh->layout().units[u].tensors) {
      EXPECT_EQ(std::memcmp(fresh->weights(u) + t.offset, store_->weights(u) + t.offset,
                            t.num_elements * sizeof(uint16_t)),
                0)
          << t.name;
    }
  }
}

TEST_P(CheckpointTest, ResavingTheSameStepReplacesTheCheckpoint) {
  ASSERT_FALSE(Save().empty());
  // A second save of step 7 with other optimizer moments must win.
  for (int64_t u = 0; u < store_->num_units(); ++u) {
    for (int64_t i = 0; i < store_->unit_elements(u); ++i) store_->exp_avg(u)[i] = 0.5f;
  }
  const std::string path = Save();
  ASSERT_FALSE(path.empty());
  TrainerState state;
  std::unique_ptr<HostStore> fresh = LoadIntoEmptyStore(path, config_, &state);
  ASSERT_NE(fresh, nullptr);
  EXPECT_EQ(fresh->exp_avg(0)[0], 0.5f);
  EXPECT_THAT(ListCheckpoints(root_.path()), ElementsAre(path));
}

INSTANTIATE_TEST_SUITE_P(TiedAndUntied, CheckpointTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Tied" : "Untied";
                         });

// A LoRA job's checkpoint is a PEFT adapter folder: adapter_config.json and
// adapter_model.safetensors (the adapters, f32 from the master, PEFT's names), no model
// files; a resume over the base (drawn again) restores the adapters and their moments,
// and the folder starts another job's adapters (LoadLoraAdapter).
TEST(CheckpointLoraTest, AdapterCheckpointIsAPeftFolderThatResumesAndLoads) {
  TempDir root;
  const ModelConfig config = TinyConfig(/*tied=*/true);
  LoraConfig lora;
  lora.rank = 4;
  lora.alpha = 8;
  lora.target_modules = {"q_proj", "v_proj", "down_proj"};
  ModelLayout layout = BuildLayout(config);
  ASSERT_TRUE(AddLoraAdapters(lora, config, &layout).ok());
  auto make = [&]() {
    std::unique_ptr<HostStore> store = std::move(*HostStore::Create(layout, -1, {}));
    RandomInitWeights(config, 5, store.get());
    return store;
  };
  std::unique_ptr<HostStore> store = make();
  InitLoraAdapters(LoraInit::kDefault, 9, store.get());
  std::mt19937_64 gen(1);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  for (int64_t u = 0; u < store->num_units(); ++u) {  // trained: B and the moments not zero
    for (const TensorSlot& t : layout.units[u].tensors) {
      if (t.role != TensorRole::kLoraB) continue;
      std::vector<float> b(t.num_elements);
      for (float& x : b) x = normal(gen);
      store->WriteTensor(u, t, b.data());
    }
    for (int64_t i = 0; i < store->state_elements(u); ++i) {
      store->exp_avg(u)[i] = normal(gen);
      store->exp_avg_sq(u)[i] = std::fabs(normal(gen));
    }
  }
  CheckpointOptions options;
  options.adapter_config = PeftAdapterConfigJson(layout, lora, "/models/base");
  absl::StatusOr<std::string> path =
      SaveCheckpoint(root.path(), config, *store, SampleState(), options);
  ASSERT_TRUE(path.ok()) << path.status();
  EXPECT_FALSE(fs::exists(*path + "/model.safetensors"));
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(*path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->names().size(), 3u * 2 * config.num_layers);
  const std::string q_a = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight";
  ASSERT_TRUE(reader->Has(q_a));
  EXPECT_EQ(reader->Find(q_a)->dtype, DType::kF32);
  const nlohmann::json js = nlohmann::json::parse(ReadFile(*path + "/adapter_config.json"));
  EXPECT_EQ(js["peft_type"], "LORA");
  EXPECT_EQ(js["r"], 4);
  EXPECT_EQ(js["target_modules"], nlohmann::json({"q_proj", "v_proj", "down_proj"}));
  absl::StatusOr<LoraConfig> read = ReadPeftAdapterConfig(*path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->rank, 4);
  EXPECT_EQ(read->alpha, 8);

  std::unique_ptr<HostStore> resumed = make();  // the base as the job sets it up again
  TrainerState state;
  ASSERT_TRUE(LoadCheckpoint(*path, resumed.get(), &state).ok());
  std::unique_ptr<HostStore> started = make();
  ASSERT_TRUE(LoadLoraAdapter(*path, lora, started.get()).ok());
  for (int64_t u = 0; u < store->num_units(); ++u) {
    const int64_t n = store->unit_elements(u);
    const std::vector<uint16_t> want(store->weights(u), store->weights(u) + n);
    EXPECT_EQ(std::vector<uint16_t>(resumed->weights(u), resumed->weights(u) + n), want) << u;
    EXPECT_EQ(std::vector<uint16_t>(started->weights(u), started->weights(u) + n), want) << u;
    const int64_t k = store->state_elements(u);
    if (k == 0) continue;
    EXPECT_EQ(std::vector<float>(resumed->master(u), resumed->master(u) + k),
              std::vector<float>(store->master(u), store->master(u) + k));
    EXPECT_EQ(std::vector<float>(resumed->exp_avg_sq(u), resumed->exp_avg_sq(u) + k),
              std::vector<float>(store->exp_avg_sq(u), store->exp_avg_sq(u) + k));
  }
  // An adapter of another rank is refused, naming both.
  LoraConfig other = lora;
  other.rank = 8;
  absl::Status wrong = LoadLoraAdapter(*path, other, started.get());
  EXPECT_THAT(std::string(wrong.message()), HasSubstr("has r 4; lora.rank is 8"));
  // One of another base (wider layers: its tensors' shapes differ) names the tensor.
  const ModelConfig wider = TinyConfig(/*tied=*/true, /*scale=*/2);
  ModelLayout wide_layout = BuildLayout(wider);
  ASSERT_TRUE(AddLoraAdapters(lora, wider, &wide_layout).ok());
  std::unique_ptr<HostStore> wide = std::move(*HostStore::Create(wide_layout, -1, {}));
  RandomInitWeights(wider, 5, wide.get());
  absl::Status base = LoadLoraAdapter(*path, lora, wide.get());
  EXPECT_FALSE(base.ok());
  EXPECT_THAT(std::string(base.message()), HasSubstr("lora.adapter"));
  EXPECT_THAT(std::string(base.message()), HasSubstr("lora_A.weight"));
}

// A base model (drawn, seed 3) saved under root/base, and a LoRA job's adapter checkpoint
// over it under root/adapter: A drawn (gaussian), B a fixed pattern (not zero, so that the
// product counts); the stores too, for the expected values. Empty dirs on a failure.
struct SavedAdapter {
  std::string base_dir, adapter_dir;
  ModelLayout layout;
  std::unique_ptr<HostStore> base, adapted;
};
SavedAdapter SaveBaseAndAdapter(const std::string& root, const ModelConfig& config,
                                const LoraConfig& lora) {
  SavedAdapter r;
  r.base = std::move(*HostStore::Create(BuildLayout(config), -1, {}));
  RandomInitWeights(config, 3, r.base.get());
  absl::StatusOr<std::string> base_dir =
      SaveCheckpoint(root + "/base", config, *r.base, SampleState(), {});
  EXPECT_TRUE(base_dir.ok()) << base_dir.status();
  r.layout = BuildLayout(config);
  const absl::Status added = AddLoraAdapters(lora, config, &r.layout);
  EXPECT_TRUE(added.ok()) << added;
  if (!base_dir.ok() || !added.ok()) return r;
  r.base_dir = *base_dir;
  r.adapted = std::move(*HostStore::Create(r.layout, -1, {}));
  RandomInitWeights(config, 3, r.adapted.get());
  InitLoraAdapters(LoraInit::kGaussian, 4, r.adapted.get());
  for (int64_t u = 0; u < r.adapted->num_units(); ++u) {
    for (const TensorSlot& t : r.layout.units[u].tensors) {
      if (t.role != TensorRole::kLoraB) continue;
      std::vector<float> b(t.num_elements);
      for (size_t i = 0; i < b.size(); ++i) b[i] = 0.01f * static_cast<float>(i % 7) - 0.03f;
      r.adapted->WriteTensor(u, t, b.data());
    }
  }
  CheckpointOptions options;
  options.adapter_config = PeftAdapterConfigJson(r.layout, lora, r.base_dir);
  absl::StatusOr<std::string> adapter_dir =
      SaveCheckpoint(root + "/adapter", config, *r.adapted, SampleState(), options);
  EXPECT_TRUE(adapter_dir.ok()) << adapter_dir.status();
  if (adapter_dir.ok()) r.adapter_dir = *adapter_dir;
  return r;
}

// megatrain merge: each adapted projection of the merged folder is bf16(W + scale B A), the
// rest the base's bits; the folder loads as a model; an out folder in use is refused, and
// an adapter of another model names the tensor.
TEST(CheckpointLoraTest, MergedModelHoldsTheBasePlusTheScaledLowRankProduct) {
  TempDir root;
  const ModelConfig config = TinyConfig(/*tied=*/false);
  LoraConfig lora;
  lora.rank = 2;
  lora.alpha = 6;
  lora.rslora = true;
  lora.target_modules = {"k_proj", "up_proj"};
  SavedAdapter saved = SaveBaseAndAdapter(root.path(), config, lora);
  ASSERT_FALSE(saved.adapter_dir.empty());
  const auto& [base_dir, adapter_dir, layout, base, adapted] = saved;
  const std::string out = root.path() + "/merged";
  ASSERT_TRUE(MergeLoraAdapter(base_dir, adapter_dir, out).ok());

  absl::StatusOr<ModelTensorReader> merged = ModelTensorReader::OpenFolder(out);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_TRUE(fs::exists(out + "/config.json"));
  const UnitLayout& unit = layout.units[layout.DecoderUnit(1)];
  const int64_t u = layout.DecoderUnit(1);
  for (TensorRole role : {TensorRole::kK, TensorRole::kUp, TensorRole::kQ}) {
    const TensorSlot& w = *unit.Find(role);
    std::vector<uint16_t> got(w.num_elements);
    ASSERT_TRUE(merged->ReadRaw(w.name, w.shape, DType::kBF16, got.data()).ok()) << w.name;
    const TensorSlot* a = unit.FindLora(role, TensorRole::kLoraA);
    for (int64_t o = 0; o < w.shape[0]; o += 5) {
      for (int64_t i = 0; i < w.shape[1]; i += 3) {
        double want = Bf16ToFloat(base->weights(u)[w.offset + o * w.shape[1] + i]);
        if (a != nullptr) {
          const TensorSlot& b = *unit.FindLora(role, TensorRole::kLoraB);
          const float* ma = adapted->master(u) + (a->offset - adapted->state_begin(u));
          const float* mb = adapted->master(u) + (b.offset - adapted->state_begin(u));
          double sum = 0;
          for (int64_t j = 0; j < 2; ++j) sum += double(mb[o * 2 + j]) * ma[j * w.shape[1] + i];
          want += lora.Scale() * sum;
        }
        ASSERT_EQ(got[o * w.shape[1] + i], FloatToBf16(static_cast<float>(want)))
            << w.name << " [" << o << ", " << i << "]";
      }
    }
  }
  EXPECT_EQ(MergeLoraAdapter(base_dir, adapter_dir, out).code(),
            absl::StatusCode::kAlreadyExists);
  lora.target_modules = {"k_proj"};  // the adapter holds up_proj's too
  ModelLayout k_only = BuildLayout(config);
  ASSERT_TRUE(AddLoraAdapters(lora, config, &k_only).ok());
  WriteFile(adapter_dir + "/adapter_config.json", PeftAdapterConfigJson(k_only, lora, ""));
  absl::Status other = MergeLoraAdapter(base_dir, adapter_dir, root.path() + "/other");
  EXPECT_THAT(std::string(other.message()), HasSubstr("mlp.up_proj.lora_A.weight"));
}

// LoRA on the experts: the adapter folder holds them as PEFT's ParamWrapper does (A (E*r,
// in); B (out, r*E), expert e's rank-j column at j*E + e; gate_up_proj's one base_layer
// down when down_proj is adapted too; target_parameters in the config), a job starts from
// it exactly, and megatrain merge adds each expert's scale B_e A_e to its weights: Qwen3-MoE's
// per-expert gate, up and down rows, GPT-OSS's input-major fused tensors transposed.
class CheckpointExpertLoraTest : public ::testing::TestWithParam<bool> {};

TEST_P(CheckpointExpertLoraTest, ExpertAdaptersAreSavedAsPeftParamWrappersAndMerge) {
  const bool gpt_oss = GetParam();
  TempDir root;
  ModelConfig config = TinyConfig(/*tied=*/false);
  config.architecture = gpt_oss ? Architecture::kGptOss : Architecture::kQwen3Moe;
  config.moe.num_experts = 3;
  config.moe.experts_per_token = 2;
  config.moe.intermediate_size = 12;
  config.moe.gpt_oss_experts = gpt_oss;
  config.qk_norm = !gpt_oss;  // as config.json implies each
  config.qkv_bias = config.o_bias = config.attention_sinks = gpt_oss;
  if (gpt_oss) config.intermediate_size = 12;
  const int64_t E = 3, I = 12, C = config.hidden_size, r = 2;
  LoraConfig lora;
  lora.rank = r;
  lora.alpha = 6;
  lora.target_modules = {"q_proj", "experts.gate_up_proj", "experts.down_proj"};
  SavedAdapter saved = SaveBaseAndAdapter(root.path(), config, lora);
  ASSERT_FALSE(saved.adapter_dir.empty());
  const auto& [base_dir, adapter_dir, layout, base, adapted] = saved;
  const nlohmann::json js = nlohmann::json::parse(ReadFile(adapter_dir + "/adapter_config.json"));
  EXPECT_EQ(js["target_modules"], nlohmann::json({"q_proj"}));
  EXPECT_EQ(js["target_parameters"],
            nlohmann::json({"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}));
  absl::StatusOr<LoraConfig> read = ReadPeftAdapterConfig(adapter_dir);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_THAT(read->target_modules,
              ElementsAre("q_proj", "experts.gate_up_proj", "experts.down_proj"));

  absl::StatusOr<ModelTensorReader> file = ModelTensorReader::OpenFolder(adapter_dir);
  ASSERT_TRUE(file.ok()) << file.status();
  const std::string experts = "base_model.model.model.layers.1.mlp.experts.";
  ASSERT_TRUE(file->Has(experts + "base_layer.lora_A.weight"));  // gate_up_proj's
  EXPECT_EQ(file->Find(experts + "base_layer.lora_A.weight")->shape,
            (std::vector<int64_t>{E * r, C}));
  ASSERT_TRUE(file->Has(experts + "lora_B.weight"));  // down_proj's
  EXPECT_EQ(file->Find(experts + "lora_B.weight")->shape, (std::vector<int64_t>{C, r * E}));
  const int64_t u = layout.DecoderUnit(1);
  const UnitLayout& unit = layout.units[u];
  const TensorRole down_role = gpt_oss ? TensorRole::kExpertDownT : TensorRole::kExpertDown;
  const TensorSlot& down_b = *unit.FindLora(down_role, TensorRole::kLoraB);
  std::vector<float> down_file(down_b.num_elements);
  ASSERT_TRUE(file->ReadAsFloat(experts + "lora_B.weight", {C, r * E}, down_file.data()).ok());
  const float* down_master = adapted->master(u) + (down_b.offset - adapted->state_begin(u));
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t o = 0; o < C; o += 7) {
      for (int64_t j = 0; j < r; ++j) {
        ASSERT_EQ(down_file[o * r * E + j * E + e], down_master[(e * C + o) * r + j])
            << "expert " << e << " [" << o << ", " << j << "]";
      }
    }
  }
  std::unique_ptr<HostStore> started = std::move(*HostStore::Create(layout, -1, {}));
  RandomInitWeights(config, 3, started.get());
  ASSERT_TRUE(LoadLoraAdapter(adapter_dir, lora, started.get()).ok());
  const int64_t n = adapted->unit_elements(u);
  EXPECT_EQ(std::vector<uint16_t>(started->weights(u), started->weights(u) + n),
            std::vector<uint16_t>(adapted->weights(u), adapted->weights(u) + n));

  const std::string out = root.path() + "/merged";
  const absl::Status merge = MergeLoraAdapter(base_dir, adapter_dir, out);
  ASSERT_TRUE(merge.ok()) << merge;
  absl::StatusOr<ModelTensorReader> merged = ModelTensorReader::OpenFolder(out);
  ASSERT_TRUE(merged.ok()) << merged.status();
  // want(e, o, i): expert e's merged weight at output o, input i of target (0 gate_up, 1 down)
  auto want = [&](int target, int64_t e, int64_t o, int64_t i, double w) {
    const TensorRole role = LoraExpertRole(unit, target);
    const TensorSlot& a = *unit.FindLora(role, TensorRole::kLoraA);
    const TensorSlot& b = *unit.FindLora(role, TensorRole::kLoraB);
    const int64_t in = a.shape[2], outs = b.shape[1];
    const HostStore& store = *saved.adapted;  // (a lambda captures no structured binding)
    const float* ma = store.master(u) + (a.offset - store.state_begin(u)) + e * r * in;
    const float* mb = store.master(u) + (b.offset - store.state_begin(u)) + e * outs * r;
    double sum = 0;
    for (int64_t j = 0; j < r; ++j) sum += double(mb[o * r + j]) * ma[j * in + i];
    return FloatToBf16(static_cast<float>(w + lora.Scale() * sum));
  };
  for (const TensorSlot& w : unit.tensors) {
    if (IsLora(w) || (w.expert < 0 && w.role != TensorRole::kExpertGateUpT &&
                      w.role != TensorRole::kExpertDownT)) {
      continue;
    }
    std::vector<uint16_t> got(w.num_elements);
    ASSERT_TRUE(merged->ReadRaw(w.name, w.shape, DType::kBF16, got.data()).ok()) << w.name;
    const uint16_t* before = base->weights(u) + w.offset;
    for (int64_t x = 0; x < w.num_elements; x += 5) {
      const double b = Bf16ToFloat(before[x]);
      uint16_t expect;
      if (gpt_oss) {  // (E, in, out)
        const bool gu = w.role == TensorRole::kExpertGateUpT;
        const int64_t outs = gu ? 2 * I : C, in = gu ? C : I;
        const int64_t e = x / (in * outs), i = x / outs % in, o = x % outs;
        expect = want(gu ? 0 : 1, e, o, i, b);
      } else {  // expert w.expert's gate (rows 0..I of gate_up), up (I..2I) or down (C, I)
        const int64_t in = w.shape[1], o = x / in, i = x % in;
        const int target = w.role == TensorRole::kExpertDown ? 1 : 0;
        expect = want(target, w.expert, o + (w.role == TensorRole::kExpertUp ? I : 0), i, b);
      }
      ASSERT_EQ(got[x], expect) << w.name << " element " << x;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Qwen3MoeAndGptOss, CheckpointExpertLoraTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "GptOss" : "Qwen3Moe";
                         });

TEST(CheckpointShardingTest, SmallMaxShardBytesWritesNumberedShardsAndIndexThatLoad) {
  TempDir root;
  const ModelConfig config = TinyConfig(/*tied=*/false, /*scale=*/2);
  std::unique_ptr<HostStore> store = FilledStore(config, /*seed=*/99);
  ASSERT_NE(store, nullptr);
  CheckpointOptions options;
  options.max_shard_bytes = 64 << 10;
  absl::StatusOr<std::string> path =
      SaveCheckpoint(root.path(), config, *store, SampleState(), options);
  ASSERT_TRUE(path.ok()) << path.status();

  // bf16: embedding and lm_head are 75 KiB each, every layer 72 KiB: at least 4 shards.
  std::vector<std::string> shards;
  for (const fs::directory_entry& e : fs::directory_iterator(*path)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("model-", 0) == 0) shards.push_back(name);
  }
  ASSERT_GE(shards.size(), 4u);
  for (size_t k = 1; k <= shards.size(); ++k) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", k, shards.size());
    EXPECT_TRUE(fs::exists(*path + "/" + name)) << name;
  }
  EXPECT_TRUE(fs::exists(*path + "/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(*path + "/model.safetensors"));
  EXPECT_TRUE(fs::exists(*path + "/optimizer/master/model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(*path + "/optimizer/exp_avg_sq/model.safetensors.index.json"));

  TrainerState state;
  std::unique_ptr<HostStore> fresh = LoadIntoEmptyStore(*path, config, &state);
  ASSERT_NE(fresh, nullptr);
  ExpectSameState(*store, *fresh, &HostStore::master, "master");
  ExpectSameState(*store, *fresh, &HostStore::exp_avg, "exp_avg");
  ExpectSameState(*store, *fresh, &HostStore::exp_avg_sq, "exp_avg_sq");
  EXPECT_EQ(state.step, 7);
}

// A checkpoint written piece by piece, in shuffled order, from several threads (as one
// written while training runs is), is byte for byte the one SaveCheckpoint writes: with the
// store's bf16 copy, and without it, where the model's pieces are the master rounded (an odd
// piece size must not cut a bf16 element in two).
class CheckpointPiecesTest : public ::testing::TestWithParam<bool> {};

TEST_P(CheckpointPiecesTest, PiecesInAnyOrderFromThreadsEqualASequentialSave) {
  TempDir root;
  const ModelConfig config = TinyConfig(/*tied=*/false, /*scale=*/2);
  StoreOptions store_options;
  store_options.bf16_copy = GetParam();
  std::unique_ptr<HostStore> store = FilledStore(config, /*seed=*/5, store_options);
  ASSERT_NE(store, nullptr);
  CheckpointOptions whole;  // default pieces: each part of a unit in one
  whole.max_shard_bytes = 64 << 10;
  CheckpointOptions options = whole;
  options.piece_bytes = 3001;  // pieces straddle shards and tensors
  TrainerState state = SampleState();
  absl::StatusOr<std::string> sequential =
      SaveCheckpoint(root.path() + "/a", config, *store, state, whole);
  ASSERT_TRUE(sequential.ok()) << sequential.status();

  absl::StatusOr<std::unique_ptr<CheckpointWriter>> writer =
      CheckpointWriter::Begin(root.path() + "/b", config, store->layout(), state.step, options);
  ASSERT_TRUE(writer.ok()) << writer.status();
  std::vector<std::pair<int64_t, int64_t>> pieces;
  for (int64_t u = 0; u < store->num_units(); ++u) {
    for (int64_t p = 0; p < (*writer)->NumPieces(u); ++p) pieces.emplace_back(u, p);
  }
  ASSERT_GT(pieces.size(), 4 * static_cast<size_t>(store->num_units()));
  std::shuffle(pieces.begin(), pieces.end(), std::mt19937_64(3));
  std::vector<std::thread> threads;
  for (int k = 0; k < 3; ++k) {
    threads.emplace_back([&, k] {
      for (size_t i = k; i < pieces.size(); i += 3) {
        EXPECT_TRUE((*writer)->WritePiece(*store, pieces[i].first, pieces[i].second).ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  absl::StatusOr<std::string> pieced = (*writer)->Commit(state);
  ASSERT_TRUE(pieced.ok()) << pieced.status();

  int compared = 0;
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(*sequential)) {
    if (!e.is_regular_file()) continue;
    const fs::path other = fs::path(*pieced) / fs::relative(e.path(), *sequential);
    EXPECT_EQ(ReadFile(e.path().string()), ReadFile(other.string())) << other;
    ++compared;
  }
  EXPECT_GE(compared, 16);  // several shards per part, indexes, config, trainer state
}

INSTANTIATE_TEST_SUITE_P(Bf16Copy, CheckpointPiecesTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "WithCopy" : "MasterOnly"; });

TEST(CheckpointWriterTest, AbandonedBeforeCommitLeavesNothing) {
  TempDir root;
  const ModelConfig config = TinyConfig(/*tied=*/true);
  std::unique_ptr<HostStore> store = FilledStore(config, /*seed=*/6);
  ASSERT_NE(store, nullptr);
  {
    absl::StatusOr<std::unique_ptr<CheckpointWriter>> writer = CheckpointWriter::Begin(
        root.path(), config, store->layout(), SampleState().step, CheckpointOptions{});
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE((*writer)->WriteUnit(*store, 0).ok());
  }
  EXPECT_TRUE(fs::is_empty(root.path()));
}

// Each case saves a checkpoint of a FilledStore with default options and loads it back.
class CheckpointLoadTest : public ::testing::Test {
 protected:
  // Saves `state` with a FilledStore (seed 5) of TinyConfig(tied) under root_, into path_.
  void Save(bool tied, const TrainerState& state = SampleState()) {
    config_ = TinyConfig(tied);
    store_ = FilledStore(config_, /*seed=*/5);
    ASSERT_NE(store_, nullptr);
    absl::StatusOr<std::string> path =
        SaveCheckpoint(root_.path(), config_, *store_, state, CheckpointOptions{});
    ASSERT_TRUE(path.ok()) << path.status();
    path_ = *path;
  }

  TempDir root_;
  ModelConfig config_;
  std::unique_ptr<HostStore> store_;
  std::string path_;
};

TEST_F(CheckpointLoadTest, StoreOfAnotherShapeIsRefusedNamingTheTensor) {
  ASSERT_NO_FATAL_FAILURE(Save(/*tied=*/true));
  std::unique_ptr<HostStore> untied = EmptyStore(TinyConfig(/*tied=*/false));
  ASSERT_NE(untied, nullptr);
  TrainerState state;
  absl::Status s = LoadCheckpoint(path_, untied.get(), &state);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("lm_head.weight"));

  std::unique_ptr<HostStore> wider = EmptyStore(TinyConfig(/*tied=*/true, /*scale=*/2));
  ASSERT_NE(wider, nullptr);
  s = LoadCheckpoint(path_, wider.get(), &state);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("model.embed_tokens.weight"));
}

TEST_F(CheckpointLoadTest, CorruptTrainerStateIsAnErrorNamingTheFile) {
  ASSERT_NO_FATAL_FAILURE(Save(/*tied=*/true));
  TrainerState state;

  WriteFile(path_ + "/trainer_state.json", "{\"step\": 7, \"data_pos");
  absl::Status s = LoadCheckpoint(path_, store_.get(), &state);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("trainer_state.json"));

  WriteFile(path_ + "/trainer_state.json", "{\"step\": 7}");  // valid JSON, fields missing
  s = LoadCheckpoint(path_, store_.get(), &state);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("trainer_state.json"));

  fs::remove(path_ + "/trainer_state.json");
  s = LoadCheckpoint(path_, store_.get(), &state);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("trainer_state.json"));
}

TEST_F(CheckpointLoadTest, TruncatedOptimizerMasterFileIsAnErrorNamingTheFile) {
  ASSERT_NO_FATAL_FAILURE(Save(/*tied=*/false));
  const std::string master = path_ + "/optimizer/master/model.safetensors";
  fs::resize_file(master, fs::file_size(master) / 2);

  std::unique_ptr<HostStore> fresh = EmptyStore(config_);
  ASSERT_NE(fresh, nullptr);
  TrainerState state;
  absl::Status s = LoadCheckpoint(path_, fresh.get(), &state);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("optimizer/master/model.safetensors"));
}

TEST_F(CheckpointLoadTest, NanLastLossSurvivesTheRoundTrip) {
  TrainerState saved = SampleState();
  saved.last_loss = std::numeric_limits<double>::quiet_NaN();
  ASSERT_NO_FATAL_FAILURE(Save(/*tied=*/true, saved));
  TrainerState state;
  absl::Status s = LoadCheckpoint(path_, store_.get(), &state);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(state.step, 7);
  EXPECT_TRUE(std::isnan(state.last_loss));
}

// The plan's split survives the round trip (ReadTrainerState reads it alone); a checkpoint
// written before it was recorded reads as "not recorded"; a malformed one names the field.
TEST_F(CheckpointLoadTest, ThePlansSplitSurvivesTheRoundTripAndABadOneIsNamed) {
  TrainerState saved = SampleState();
  saved.micro_batch_rows = 4;
  saved.mlp_tile_tokens = 2048;
  ASSERT_NO_FATAL_FAILURE(Save(/*tied=*/true, saved));
  TrainerState loaded;
  ASSERT_TRUE(LoadCheckpoint(path_, store_.get(), &loaded).ok());
  EXPECT_EQ(loaded.micro_batch_rows, 4);
  EXPECT_EQ(loaded.mlp_tile_tokens, 2048);
  absl::StatusOr<TrainerState> alone = ReadTrainerState(path_);
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ(alone->micro_batch_rows, 4);
  EXPECT_EQ(alone->step, saved.step);

  const std::string file = path_ + "/trainer_state.json";
  nlohmann::json js = nlohmann::json::parse(ReadFile(file));
  js.erase("plan");  // as written before the split was recorded
  WriteFile(file, js.dump());
  alone = ReadTrainerState(path_);
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ(alone->micro_batch_rows, 0);
  EXPECT_EQ(alone->mlp_tile_tokens, -1);

  js["plan"] = {{"micro_batch_rows", 0}, {"mlp_tile_tokens", 0}};
  WriteFile(file, js.dump());
  alone = ReadTrainerState(path_);
  EXPECT_EQ(alone.status().code(), absl::StatusCode::kDataLoss) << alone.status();
  EXPECT_THAT(std::string(alone.status().message()), HasSubstr("plan.micro_batch_rows"));
}

// Makes `root/name` a folder; with a trainer_state.json when `complete`.
void MakeFakeCheckpoint(const std::string& root, const std::string& name, bool complete) {
  fs::create_directories(fs::path(root) / name);
  if (complete) WriteFile((fs::path(root) / name / "trainer_state.json").string(), "{}");
}

TEST(ListCheckpointsTest, OrdersByStepNumericallyAndSkipsIncompleteFolders) {
  TempDir root;
  MakeFakeCheckpoint(root.path(), "checkpoint-10", true);
  MakeFakeCheckpoint(root.path(), "checkpoint-9", true);
  MakeFakeCheckpoint(root.path(), "checkpoint-100", true);
  MakeFakeCheckpoint(root.path(), "checkpoint-2", true);
  MakeFakeCheckpoint(root.path(), ".checkpoint-11.tmp", true);  // interrupted save
  MakeFakeCheckpoint(root.path(), "checkpoint-12", false);      // no trainer_state.json
  MakeFakeCheckpoint(root.path(), "checkpoint-13a", true);
  MakeFakeCheckpoint(root.path(), "checkpoint-", true);
  MakeFakeCheckpoint(root.path(), "old-checkpoint-14", true);
  WriteFile(root.Join("checkpoint-15"), "a file, not a folder");
  EXPECT_THAT(ListCheckpoints(root.path()),
              ElementsAre(root.Join("checkpoint-2"), root.Join("checkpoint-9"),
                          root.Join("checkpoint-10"), root.Join("checkpoint-100")));
}

TEST(ListCheckpointsTest, MissingRootListsNothing) {
  TempDir root;
  EXPECT_TRUE(ListCheckpoints(root.Join("never-created")).empty());
}

TEST(ListCheckpointsTest, StepTooLargeForInt64IsIgnored) {
  TempDir root;
  MakeFakeCheckpoint(root.path(), "checkpoint-3", true);
  MakeFakeCheckpoint(root.path(), "checkpoint-99999999999999999999", true);
  EXPECT_THAT(ListCheckpoints(root.path()), ElementsAre(root.Join("checkpoint-3")));
}

TEST(ListCheckpointsTest, ASymlinkLoopNamedLikeACheckpointIsIgnoredNotThrown) {
  TempDir root;
  MakeFakeCheckpoint(root.path(), "checkpoint-3", true);
  ASSERT_EQ(::symlink("checkpoint-7", root.Join("checkpoint-7").c_str()), 0);
  EXPECT_THAT(ListCheckpoints(root.path()), ElementsAre(root.Join("checkpoint-3")));
  EXPECT_TRUE(PruneCheckpoints(root.path(), 1).ok());
}

TEST(ReadTrainerStateTest, AFifoAsTrainerStateIsRefusedWithoutBlocking) {
  TempDir root;
  fs::create_directories(root.Join("checkpoint-3"));
  ASSERT_EQ(::mkfifo(root.Join("checkpoint-3/trainer_state.json").c_str(), 0600), 0);
  std::optional<absl::Status> s = megatrain::testing::RunWithin(
      5, [&] { return ReadTrainerState(root.Join("checkpoint-3")).status(); });
  ASSERT_TRUE(s.has_value()) << "reading a FIFO blocked";
  EXPECT_THAT(std::string(s->message()), HasSubstr("is not a regular file (a FIFO)"));
}

TEST(PruneCheckpointsTest, KeepLastTwoLeavesTheNewestTwoAndRemovesTmpLeftovers) {
  TempDir root;
  for (const char* name : {"checkpoint-1", "checkpoint-9", "checkpoint-10", "checkpoint-20"}) {
    MakeFakeCheckpoint(root.path(), name, true);
  }
  MakeFakeCheckpoint(root.path(), ".checkpoint-21.tmp", false);
  MakeFakeCheckpoint(root.path(), "checkpoint-5", false);  // not ours to judge: kept
  WriteFile(root.Join("notes.txt"), "kept");

  ASSERT_TRUE(PruneCheckpoints(root.path(), 2).ok());
  EXPECT_THAT(ListCheckpoints(root.path()),
              ElementsAre(root.Join("checkpoint-10"), root.Join("checkpoint-20")));
  EXPECT_FALSE(fs::exists(root.Join("checkpoint-1")));
  EXPECT_FALSE(fs::exists(root.Join("checkpoint-9")));
  EXPECT_FALSE(fs::exists(root.Join(".checkpoint-21.tmp")));
  EXPECT_TRUE(fs::exists(root.Join("checkpoint-5")));
  EXPECT_TRUE(fs::exists(root.Join("notes.txt")));
}

TEST(PruneCheckpointsTest, KeepLastZeroKeepsAllButStillRemovesTmpLeftovers) {
  TempDir root;
  MakeFakeCheckpoint(root.path(), "checkpoint-1", true);
  MakeFakeCheckpoint(root.path(), "checkpoint-2", true);
  MakeFakeCheckpoint(root.path(), ".checkpoint-3.tmp", true);
  ASSERT_TRUE(PruneCheckpoints(root.path(), 0).ok());
  EXPECT_THAT(ListCheckpoints(root.path()),
              ElementsAre(root.Join("checkpoint-1"), root.Join("checkpoint-2")));
  EXPECT_FALSE(fs::exists(root.Join(".checkpoint-3.tmp")));
}

TEST(PruneCheckpointsTest, KeepLastAboveCountRemovesNothing) {
  TempDir root;
  MakeFakeCheckpoint(root.path(), "checkpoint-1", true);
  MakeFakeCheckpoint(root.path(), "checkpoint-2", true);
  ASSERT_TRUE(PruneCheckpoints(root.path(), 5).ok());
  EXPECT_EQ(ListCheckpoints(root.path()).size(), 2u);
}

TEST(PruneCheckpointsTest, RealSavesPrunedToTheNewestTwoStillLoad) {
  TempDir root;
  const ModelConfig config = TinyConfig(/*tied=*/true);
  std::unique_ptr<HostStore> store = FilledStore(config, /*seed=*/8);
  ASSERT_NE(store, nullptr);
  TrainerState state = SampleState();
  for (int64_t step : {3, 6, 9}) {
    state.step = step;
    ASSERT_TRUE(SaveCheckpoint(root.path(), config, *store, state, CheckpointOptions{}).ok());
  }
  ASSERT_TRUE(PruneCheckpoints(root.path(), 2).ok());
  const std::vector<std::string> left = ListCheckpoints(root.path());
  ASSERT_THAT(left, ElementsAre(root.Join("checkpoint-6"), root.Join("checkpoint-9")));
  TrainerState loaded;
  ASSERT_NE(LoadIntoEmptyStore(left.back(), config, &loaded), nullptr);
  EXPECT_EQ(loaded.step, 9);
}


// bf16 and int8 moments are written as kept (bf16; I8/U8 codes and the blocks' scales), so
// a resume restores the same bytes; the checkpoint names the choice, and a job that keeps
// its moments otherwise is refused with both named.
class QuantizedMomentsCheckpoint : public ::testing::TestWithParam<MomentDType> {};

StoreOptions MomentsOnly(MomentDType moments) {
  StoreOptions o;
  o.moments = moments;
  return o;
}

TEST_P(QuantizedMomentsCheckpoint, RoundTripsTheStoredBytesAndRefusesAnotherDtype) {
  const ModelConfig config = TinyConfig(/*tied=*/false);
  absl::StatusOr<std::unique_ptr<HostStore>> store =
      HostStore::Create(BuildLayout(config), -1, MomentsOnly(GetParam()));
  ASSERT_TRUE(store.ok()) << store.status();
  RandomInitWeights(config, 5, store->get());
  // One real update per unit fills the moments (and the int8 scales) with trained values.
  std::mt19937 gen(3);
  std::normal_distribution<float> dist(0.0f, 0.01f);
  for (int64_t u = 0; u < (*store)->num_units(); ++u) {
    const UnitLayout& unit = (*store)->layout().units[u];
    std::vector<float> grad(unit.num_elements);
    for (float& g : grad) g = dist(gen);
    std::vector<ElementRange> tensors;
    for (const TensorSlot& t : unit.tensors) tensors.push_back({t.offset, t.offset + t.num_elements, true});
    std::sort(tensors.begin(), tensors.end(),
              [](const ElementRange& a, const ElementRange& b) { return a.begin < b.begin; });
    for (int64_t step = 1; step <= 2; ++step) {
      AdamWUpdateQuantized((*store)->master(u), (*store)->moments(u), (*store)->weights(u),
                           grad.data(), 0, unit.num_elements, unit.num_elements, tensors, step,
                           1e-3, 0.0, 1.0f, AdamWHyper{}, MomentRoundingKey(u, step));
    }
  }
  TempDir root;
  absl::StatusOr<std::string> path =
      SaveCheckpoint(root.path(), config, **store, SampleState(), CheckpointOptions{});
  ASSERT_TRUE(path.ok()) << path.status();
  const nlohmann::json ts = nlohmann::json::parse(ReadFile(*path + "/trainer_state.json"));
  EXPECT_EQ(ts.at("optimizer_state_dtype"), MomentDTypeName(GetParam()));

  absl::StatusOr<std::unique_ptr<HostStore>> back =
      HostStore::Create(BuildLayout(config), -1, MomentsOnly(GetParam()));
  ASSERT_TRUE(back.ok());
  TrainerState state;
  ASSERT_TRUE(LoadCheckpoint(*path, back->get(), &state).ok());
  for (int64_t u = 0; u < (*store)->num_units(); ++u) {
    const UnitMoments a = (*store)->moments(u), b = (*back)->moments(u);
    const size_t bytes = (*store)->moment_bytes(u), scales = (*store)->moment_scale_bytes(u);
    EXPECT_EQ(std::memcmp(a.m, b.m, bytes), 0) << "exp_avg of unit " << u;
    EXPECT_EQ(std::memcmp(a.v, b.v, bytes), 0) << "exp_avg_sq of unit " << u;
    if (scales > 0) {
      EXPECT_EQ(std::memcmp(a.m_scales, b.m_scales, scales), 0) << "exp_avg scales of " << u;
      EXPECT_EQ(std::memcmp(a.v_scales, b.v_scales, scales), 0) << "exp_avg_sq scales of " << u;
    }
    EXPECT_EQ(std::memcmp((*store)->master(u), (*back)->master(u),
                          (*store)->unit_elements(u) * sizeof(float)),
              0);
  }
  std::unique_ptr<HostStore> fp32 = EmptyStore(config);
  const absl::Status refused = LoadCheckpoint(*path, fp32.get(), &state);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr(absl::StrCat("keeps its AdamW moments in ", MomentDTypeName(GetParam()),
                                     "; this job asks for fp32")));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, QuantizedMomentsCheckpoint,
                         ::testing::Values(MomentDType::kBF16, MomentDType::kInt8),
                         [](const ::testing::TestParamInfo<MomentDType>& info) {
                           return std::string(MomentDTypeName(info.param));
                         });

}  // namespace
}  // namespace megatrain
