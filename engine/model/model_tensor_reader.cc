// ModelTensorReader: the safetensors files of one model folder; see safetensors.h.
//
// Which files to read follows transformers' from_pretrained: the index when present (so
// stray files such as Mistral's consolidated.safetensors are ignored), then the single
// model.safetensors, and only as a last resort every *.safetensors in the folder.
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"
#include "engine/common/durable_file.h"
#include "engine/model/safetensors.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

using Json = nlohmann::json;

constexpr char kIndexName[] = "model.safetensors.index.json";
constexpr char kSingleName[] = "model.safetensors";

// weight_map of an index file: tensor name -> shard file name.
absl::StatusOr<std::map<std::string, std::string>> ReadWeightMap(const std::string& index_path) {
  ASSIGN_OR_RETURN(std::string text, ReadWholeFile(index_path));
  Json root;
  try {
    root = Json::parse(text);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path, ": not valid JSON (", Printable(e.what()), "); re-download it"));
  }
  auto it = root.is_object() ? root.find("weight_map") : root.end();
  if (it == root.end() || !it->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path, ": has no \"weight_map\" object"));
  }
  std::map<std::string, std::string> weight_map;
  for (const auto& [tensor, shard] : it->items()) {
    if (!shard.is_string() || shard.get<std::string>().empty() ||
        absl::StrContains(shard.get<std::string>(), "/")) {
      return absl::InvalidArgumentError(absl::StrCat(
          index_path, ": weight_map entry for tensor '", tensor,
          "' must be a file name in the same folder, got ", shard.dump()));
    }
    weight_map[tensor] = shard.get<std::string>();
  }
  return weight_map;
}

// Every regular *.safetensors file in `dir`, sorted.
absl::StatusOr<std::vector<std::string>> ListSafetensors(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return ErrnoError(errno, absl::StrCat("listing model folder ", dir));
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (absl::EndsWith(name, ".safetensors") && FileExists(JoinPath(dir, name))) {
      names.push_back(name);
    }
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

absl::StatusOr<ModelTensorReader> ModelTensorReader::OpenFolder(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    return ErrnoError(errno, absl::StrCat("model folder ", dir));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(dir, " is not a folder; pass the model folder"));
  }
  ModelTensorReader reader;
  reader.dir_ = dir;
  auto open_file = [&](const std::string& name) -> absl::StatusOr<size_t> {
    ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(JoinPath(dir, name)));
    reader.files_.push_back(std::make_unique<SafetensorsFile>(std::move(file)));
    return reader.files_.size() - 1;
  };

  const std::string index_path = JoinPath(dir, kIndexName);
  if (FileExists(index_path)) {
    ASSIGN_OR_RETURN(auto weight_map, ReadWeightMap(index_path));
    std::map<std::string, size_t> shard_index;  // shard file name -> files_ position
    for (const auto& [tensor, shard] : weight_map) {
      auto it = shard_index.find(shard);
      if (it == shard_index.end()) {
        const std::string shard_path = JoinPath(dir, shard);
        if (!FileExists(shard_path)) {
          return absl::NotFoundError(absl::StrCat(
              index_path, " maps tensor '", tensor, "' to shard ", shard_path,
              ", which does not exist; the download is incomplete"));
        }
        ASSIGN_OR_RETURN(size_t pos, open_file(shard));
        it = shard_index.emplace(shard, pos).first;
      }
      const SafetensorsFile& file = *reader.files_[it->second];
      const TensorInfo* info = file.Find(tensor);
      if (info == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            index_path, " maps tensor '", tensor, "' to shard ", file.path(),
            ", which does not contain it; the index and the shards disagree"));
      }
      reader.tensors_[tensor] = Location{it->second, info};
    }
    return reader;
  }

  std::vector<std::string> names;
  if (FileExists(JoinPath(dir, kSingleName))) {
    names.push_back(kSingleName);
  } else {
    ASSIGN_OR_RETURN(names, ListSafetensors(dir));
  }
  if (names.empty()) {
    return absl::NotFoundError(absl::StrCat("no *.safetensors in ", dir,
                                            "; is this a Hugging Face model folder?"));
  }
  for (const std::string& name : names) {
    ASSIGN_OR_RETURN(size_t pos, open_file(name));
    for (const TensorInfo& info : reader.files_[pos]->tensors()) {
      auto [it, inserted] = reader.tensors_.emplace(info.name, Location{pos, &info});
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", info.name, "' is in both ", reader.files_[it->second.file]->path(),
            " and ", reader.files_[pos]->path(), "; remove one file or add ", kIndexName));
      }
    }
  }
  return reader;
}

std::vector<std::string> ModelTensorReader::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, location] : tensors_) out.push_back(name);
  return out;
}

const TensorInfo* ModelTensorReader::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second.info;
}

std::string ModelTensorReader::FileOf(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? std::string() : files_[it->second.file]->path();
}

absl::Status ModelTensorReader::CheckTensor(const std::string& name,
                                            const std::vector<int64_t>& expected_shape,
                                            const DType* expected_dtype) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' not found in ", dir_,
                                            "; the weights do not match config.json"));
  }
  const std::string& path = files_[it->second.file]->path();
  const TensorInfo& info = *it->second.info;
  if (expected_dtype != nullptr) {
    if (info.shape != expected_shape || info.dtype != *expected_dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", name, "' in ", path, " is ", DTypeName(info.dtype), " ",
          ShapeToString(info.shape), " but config.json implies ", DTypeName(*expected_dtype),
          " ", ShapeToString(expected_shape), "; the weights do not match config.json"));
    }
    return absl::OkStatus();
  }
  if (info.shape != expected_shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name, "' in ", path, " has shape ", ShapeToString(info.shape),
        " but config.json implies ", ShapeToString(expected_shape),
        "; the weights do not match config.json"));
  }
  if (info.dtype != DType::kBF16 && info.dtype != DType::kF16 && info.dtype != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": tensor '", name, "' has dtype ", DTypeName(info.dtype),
        "; only BF16, F16 and F32 tensors can be read as fp32 weights"));
  }
  return absl::OkStatus();
}

absl::Status ModelTensorReader::ReadRaw(const std::string& name,
                                        const std::vector<int64_t>& expected_shape,
                                        DType expected_dtype, void* out) const {
  RETURN_IF_ERROR(CheckTensor(name, expected_shape, &expected_dtype));
  const Location& at = tensors_.at(name);
  return files_[at.file]->ReadRaw(*at.info, out);
}

absl::Status ModelTensorReader::ReadAsFloat(const std::string& name,
                                            const std::vector<int64_t>& expected_shape,
                                            float* out) const {
  RETURN_IF_ERROR(CheckTensor(name, expected_shape));
  const Location& at = tensors_.at(name);
  return files_[at.file]->ReadAsFloat(*at.info, out);
}

}  // namespace megatrain
