// Writing .safetensors files and sharded folders; see safetensors.h.
//
// Every file is written beside its final name, fsynced and renamed into place, and the
// shard index last of all: a crash mid-save leaves either the previous files or complete
// new ones, never a header promising bytes that were not written.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/common/check.h"
#include "engine/common/status.h"
#include "engine/model/posix_file.h"
#include "engine/model/safetensors.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

using Json = nlohmann::json;

uint64_t NumBytes(const TensorToWrite& t) {
  uint64_t n = static_cast<uint64_t>(DTypeSize(t.dtype));
  for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
  return n;
}

absl::Status CheckTensors(const std::string& path, const std::vector<TensorToWrite>& tensors) {
  std::set<std::string> seen;
  for (const TensorToWrite& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") {
      return absl::InvalidArgumentError(
          absl::StrCat("writing ", path, ": invalid tensor name '", t.name, "'"));
    }
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("writing ", path, ": tensor '", t.name, "' is given twice"));
    }
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "writing ", path, ": tensor '", t.name, "' has shape ", ShapeToString(t.shape)));
      }
    }
    MT_CHECK_MSG(t.data != nullptr || NumBytes(t) == 0, "tensor '%s' has no data",
                 t.name.c_str());
  }
  return absl::OkStatus();
}

// The 8-byte length followed by the JSON header, padded with spaces so the data buffer
// starts 8-byte aligned.
absl::StatusOr<std::string> BuildHeader(const std::string& path,
                                        const std::vector<TensorToWrite>& tensors,
                                        const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    const uint64_t end = offset + NumBytes(t);
    header[t.name] = {{"dtype", DTypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, end}}};
    offset = end;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text;
  try {
    text = header.dump();  // throws on names that are not valid UTF-8
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("writing ", path, ": cannot encode the header (", e.what(), ")"));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((uint64_t{text.size()} >> (8 * i)) & 0xff);
  return out + text;
}

}  // namespace

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  RETURN_IF_ERROR(CheckTensors(path, tensors));
  ASSIGN_OR_RETURN(std::string header, BuildHeader(path, tensors, metadata));
  const std::string tmp = path + ".tmp";
  ScopedFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return ErrnoError(errno, absl::StrCat("creating ", tmp));
  const std::string context = absl::StrCat("writing ", tmp);
  absl::Status status = WriteAll(fd.get(), header.data(), header.size(), context);
  for (const TensorToWrite& t : tensors) {
    if (!status.ok()) break;
    status = WriteAll(fd.get(), t.data, NumBytes(t), absl::StrCat(context, " (tensor '", t.name, "')"));
  }
  if (status.ok() && ::fsync(fd.get()) != 0) {
    status = ErrnoError(errno, absl::StrCat("fsync of ", tmp));
  }
  if (status.ok()) status = fd.Close(tmp);
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status = ErrnoError(errno, absl::StrCat("renaming ", tmp, " to ", path));
  }
  if (!status.ok()) {
    fd = ScopedFd();
    ::unlink(tmp.c_str());
    return status;
  }
  return FsyncDir(DirName(path));
}

absl::Status WriteShardedSafetensors(const std::string& dir, const std::string& prefix,
                                     const std::vector<TensorToWrite>& tensors,
                                     uint64_t max_shard_bytes,
                                     const std::map<std::string, std::string>& metadata) {
  if (max_shard_bytes == 0) {
    return absl::InvalidArgumentError("WriteShardedSafetensors: max_shard_bytes must be > 0");
  }
  const std::string index_path = JoinPath(dir, prefix + ".safetensors.index.json");
  RETURN_IF_ERROR(CheckTensors(index_path, tensors));

  // Greedy, in the given order: a new shard starts when the next tensor would not fit.
  std::vector<std::vector<TensorToWrite>> shards(1);
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (const TensorToWrite& t : tensors) {
    const uint64_t n = NumBytes(t);
    if (!shards.back().empty() && shard_bytes + n > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(t);
    shard_bytes += n;
    total_bytes += n;
  }

  if (shards.size() == 1) {
    RETURN_IF_ERROR(WriteSafetensors(JoinPath(dir, prefix + ".safetensors"), tensors, metadata));
    if (::unlink(index_path.c_str()) != 0 && errno != ENOENT) {
      return ErrnoError(errno, absl::StrCat("removing stale ", index_path));
    }
    return absl::OkStatus();
  }

  Json weight_map = Json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string name = absl::StrFormat("%s-%05d-of-%05d.safetensors", prefix, i + 1,
                                             shards.size());
    RETURN_IF_ERROR(WriteSafetensors(JoinPath(dir, name), shards[i], metadata));
    for (const TensorToWrite& t : shards[i]) weight_map[t.name] = name;
  }
  const Json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  // The names already went through a header dump, so this cannot throw.
  return WriteFileDurably(index_path, index.dump(2) + "\n");
}

}  // namespace megatrain
