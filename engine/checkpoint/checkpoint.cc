#include "engine/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "engine/common/status.h"
#include "engine/model/safetensors.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace fs = std::filesystem;
namespace {

constexpr const char* kTokenizerFiles[] = {"tokenizer.json", "tokenizer_config.json",
                                           "special_tokens_map.json", "tokenizer.model",
                                           "generation_config.json", "chat_template.jinja"};

absl::Status FsyncPath(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return absl::InternalError(absl::StrCat("open ", path, ": ", std::strerror(errno)));
  int rc = fsync(fd);
  int err = errno;
  close(fd);
  if (rc != 0) return absl::InternalError(absl::StrCat("fsync ", path, ": ", std::strerror(err)));
  return absl::OkStatus();
}

absl::Status WriteFileSynced(const std::string& path, const std::string& text) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  return FsyncPath(path);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// One TensorToWrite per tensor of every unit, pointing into `base(unit)`.
template <typename Fn>
std::vector<TensorToWrite> TensorsOf(const HostStore& store, DType dtype, Fn base) {
  std::vector<TensorToWrite> out;
  for (int64_t u = 0; u < store.num_units(); ++u) {
    for (const TensorSlot& t : store.layout().units[u].tensors) {
      out.push_back(TensorToWrite{t.name, dtype, t.shape,
                                  reinterpret_cast<const char*>(base(u)) + t.offset * DTypeSize(dtype)});
    }
  }
  return out;
}

// The optimizer state, one folder of safetensors each, Hugging Face tensor names.
struct StatePart {
  const char* name;
  float* (HostStore::*get)(int64_t) const;
};
constexpr StatePart kStateParts[] = {{"master", &HostStore::master},
                                     {"exp_avg", &HostStore::exp_avg},
                                     {"exp_avg_sq", &HostStore::exp_avg_sq}};

int64_t StepOf(const std::string& name) {
  const std::string prefix = "checkpoint-";
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size()) return -1;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
  }
  if (name.size() - prefix.size() > 18) return -1;  // beyond int64: not one of ours
  return std::stoll(name.substr(prefix.size()));
}

}  // namespace

namespace {

absl::StatusOr<std::string> SaveCheckpointOrLeaveTemp(const std::string& root,
                                                      const ModelConfig& config,
                                                      const HostStore& store,
                                                      const TrainerState& state,
                                                      const CheckpointOptions& options) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", root, ": ", ec.message()));
  const std::string name = absl::StrCat("checkpoint-", state.step);
  const std::string final_dir = (fs::path(root) / name).string();
  const std::string tmp = (fs::path(root) / absl::StrCat(".", name, ".tmp")).string();
  fs::remove_all(tmp, ec);
  fs::create_directories(fs::path(tmp) / "optimizer", ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", tmp, ": ", ec.message()));

  const std::map<std::string, std::string> pt = {{"format", "pt"}};
  RETURN_IF_ERROR(WriteFileSynced((fs::path(tmp) / "config.json").string(),
                                  ModelConfigToJson(config)));
  RETURN_IF_ERROR(WriteShardedSafetensors(
      tmp, "model", TensorsOf(store, DType::kBF16, [&](int64_t u) { return store.weights(u); }),
      options.max_shard_bytes, pt));
  const std::string opt = (fs::path(tmp) / "optimizer").string();
  for (const StatePart& part : kStateParts) {
    const std::string dir = (fs::path(opt) / part.name).string();
    fs::create_directories(dir, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
    RETURN_IF_ERROR(WriteShardedSafetensors(
        dir, "model",
        TensorsOf(store, DType::kF32, [&](int64_t u) { return (store.*part.get)(u); }),
        options.max_shard_bytes, pt));
    RETURN_IF_ERROR(FsyncPath(dir));
  }
  if (!options.tokenizer_dir.empty()) {
    for (const char* file : kTokenizerFiles) {
      fs::path src = fs::path(options.tokenizer_dir) / file;
      if (!fs::exists(src)) continue;
      fs::copy_file(src, fs::path(tmp) / file, fs::copy_options::overwrite_existing, ec);
      if (ec) return absl::InternalError(absl::StrCat("copying ", src.string(), ": ", ec.message()));
      RETURN_IF_ERROR(FsyncPath((fs::path(tmp) / file).string()));
    }
  }
  nlohmann::json js = {{"step", state.step},
                       {"data_position", DataPositionToJson(state.data)},
                       {"data_seed", state.data_seed},
                       {"init_seed", state.init_seed},
                       {"last_loss", state.last_loss},
                       {"spec_fingerprint", state.spec_fingerprint}};
  RETURN_IF_ERROR(WriteFileSynced((fs::path(tmp) / "trainer_state.json").string(), js.dump(2)));
  RETURN_IF_ERROR(FsyncPath(opt));
  RETURN_IF_ERROR(FsyncPath(tmp));
  fs::remove_all(final_dir, ec);  // a re-save of the same step replaces it
  fs::rename(tmp, final_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("rename to ", final_dir, ": ", ec.message()));
  RETURN_IF_ERROR(FsyncPath(root));
  return final_dir;
}

}  // namespace

absl::StatusOr<std::string> SaveCheckpoint(const std::string& root, const ModelConfig& config,
                                           const HostStore& store, const TrainerState& state,
                                           const CheckpointOptions& options) {
  absl::StatusOr<std::string> saved =
      SaveCheckpointOrLeaveTemp(root, config, store, state, options);
  if (!saved.ok()) {
    // A failed write (a full disk, say) leaves no half checkpoint behind, and gives the
    // space it took back; the checkpoints before it are untouched.
    std::error_code ec;
    fs::remove_all(fs::path(root) / absl::StrCat(".checkpoint-", state.step, ".tmp"), ec);
  }
  return saved;
}

absl::Status LoadCheckpoint(const std::string& path, HostStore* store, TrainerState* state) {
  ASSIGN_OR_RETURN(std::string text, ReadFile((fs::path(path) / "trainer_state.json").string()));
  nlohmann::json js = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (js.is_discarded() || !js.is_object()) {
    return absl::DataLossError(absl::StrCat(path, "/trainer_state.json is not valid JSON"));
  }
  try {
    state->step = js.at("step").get<int64_t>();
    ASSIGN_OR_RETURN(state->data, DataPositionFromJson(js.at("data_position")));
    state->data_seed = js.at("data_seed").get<uint64_t>();
    state->init_seed = js.at("init_seed").get<uint64_t>();
    // JSON has no NaN: a diverged loss is written as null.
    const nlohmann::json& loss = js.at("last_loss");
    state->last_loss = loss.is_null() ? std::nan("") : loss.get<double>();
    state->spec_fingerprint = js.value("spec_fingerprint", "");
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(absl::StrCat(path, "/trainer_state.json: ", e.what()));
  }
  for (const StatePart& part : kStateParts) {
    ASSIGN_OR_RETURN(ModelTensorReader reader,
                     ModelTensorReader::OpenFolder(
                         (fs::path(path) / "optimizer" / part.name).string()));
    for (int64_t u = 0; u < store->num_units(); ++u) {
      float* base = (store->*part.get)(u);
      for (const TensorSlot& t : store->layout().units[u].tensors) {
        RETURN_IF_ERROR(reader.ReadAsFloat(t.name, t.shape, base + t.offset));
      }
    }
  }
  for (int64_t u = 0; u < store->num_units(); ++u) store->RefreshWeightsFromMaster(u);
  return absl::OkStatus();
}

std::vector<std::string> ListCheckpoints(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    const int64_t step = StepOf(e.path().filename().string());
    if (step >= 0 && e.is_directory() && fs::exists(e.path() / "trainer_state.json")) {
      found.emplace_back(step, e.path().string());
    }
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

absl::Status PruneCheckpoints(const std::string& root, int64_t keep_last) {
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() > 4 && n[0] == '.' && n.substr(n.size() - 4) == ".tmp") fs::remove_all(e.path(), ec);
  }
  if (keep_last <= 0) return absl::OkStatus();
  std::vector<std::string> all = ListCheckpoints(root);
  for (size_t i = 0; i + keep_last < all.size(); ++i) {
    fs::remove_all(all[i], ec);
    if (ec) return absl::InternalError(absl::StrCat("removing ", all[i], ": ", ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace megatrain
