// Writing .safetensors files and sharded folders; see safetensors.h.
//
// A single file is written beside its final name, fsynced and renamed into place. A
// sharded save writes its shards in place (its folder is the unit of atomicity) and the
// index last of all.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/common/check.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"
#include "engine/common/durable_file.h"
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

// `with_data`: the tensors' bytes are given now (not only their layout).
absl::Status CheckTensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                          bool with_data = true) {
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
    MT_CHECK_MSG(!with_data || t.data != nullptr || NumBytes(t) == 0, "tensor '%s' has no data",
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
        absl::StrCat("writing ", path, ": cannot encode the header (", Printable(e.what()), ")"));
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
  return WriteFileDurably(path, [&](int fd, const std::string& context) {
    RETURN_IF_ERROR(WriteAll(fd, header.data(), header.size(), context));
    for (const TensorToWrite& t : tensors) {
      RETURN_IF_ERROR(
          WriteAll(fd, t.data, NumBytes(t), absl::StrCat(context, " (tensor '", t.name, "')")));
    }
    return absl::OkStatus();
  });
}

struct ShardedSafetensorsWriter::Shard {
  std::string path;
  ScopedFd fd;
  uint64_t bytes = 0;  // the whole file
};

absl::StatusOr<std::unique_ptr<ShardedSafetensorsWriter>> ShardedSafetensorsWriter::Open(
    const std::string& dir, const std::string& prefix, const std::vector<TensorToWrite>& tensors,
    uint64_t max_shard_bytes, const std::map<std::string, std::string>& metadata) {
  if (max_shard_bytes == 0) {
    return absl::InvalidArgumentError("writing safetensors shards: max_shard_bytes must be > 0");
  }
  std::unique_ptr<ShardedSafetensorsWriter> w(new ShardedSafetensorsWriter());
  w->dir_ = dir;
  w->index_path_ = JoinPath(dir, prefix + ".safetensors.index.json");
  RETURN_IF_ERROR(CheckTensors(w->index_path_, tensors, /*with_data=*/false));

  // Greedy, in the given order: a new shard starts when the next tensor would not fit.
  std::vector<std::vector<size_t>> shards(1);
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t n = NumBytes(tensors[i]);
    if (!shards.back().empty() && shard_bytes + n > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += n;
    total_bytes += n;
  }

  w->placement_.resize(tensors.size());
  Json weight_map = Json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name =
        shards.size() == 1 ? prefix + ".safetensors"
                           : absl::StrFormat("%s-%05d-of-%05d.safetensors", prefix, s + 1,
                                             shards.size());
    auto shard = std::make_unique<Shard>();
    shard->path = JoinPath(dir, name);
    std::vector<TensorToWrite> in_shard;
    for (size_t i : shards[s]) in_shard.push_back(tensors[i]);
    ASSIGN_OR_RETURN(std::string header, BuildHeader(shard->path, in_shard, metadata));
    uint64_t offset = header.size();
    for (size_t i : shards[s]) {
      w->placement_[i] = Placement{s, offset, NumBytes(tensors[i])};
      offset += NumBytes(tensors[i]);
      weight_map[tensors[i].name] = name;
    }
    shard->bytes = offset;
    shard->fd = ScopedFd(::open(shard->path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (shard->fd.get() < 0) return ErrnoError(errno, absl::StrCat("creating ", shard->path));
    RETURN_IF_ERROR(ReserveFile(shard->fd.get(), shard->bytes,
                                absl::StrCat("reserving ", shard->bytes, " bytes for ", shard->path)));
    RETURN_IF_ERROR(PwriteAll(shard->fd.get(), 0, header.data(), header.size(),
                              absl::StrCat("writing ", shard->path)));
    w->shards_.push_back(std::move(shard));
  }
  if (shards.size() > 1) {
    // The names already went through a header dump, so this cannot throw.
    w->index_text_ =
        Json{{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}}.dump(2) + "\n";
  }
  return w;
}

ShardedSafetensorsWriter::~ShardedSafetensorsWriter() = default;

absl::Status ShardedSafetensorsWriter::Write(size_t first, const std::vector<const void*>& data) {
  MT_CHECK(first + data.size() <= placement_.size());
  size_t i = 0;
  while (i < data.size()) {
    const Placement& p = placement_[first + i];
    uint64_t bytes = p.bytes;
    size_t j = i + 1;
    for (; j < data.size(); ++j) {  // extend over neighbours contiguous in memory and file
      const Placement& q = placement_[first + j];
      if (q.shard != p.shard || q.file_offset != p.file_offset + bytes ||
          static_cast<const char*>(data[j]) != static_cast<const char*>(data[i]) + bytes) {
        break;
      }
      bytes += q.bytes;
    }
    const Shard& shard = *shards_[p.shard];
    RETURN_IF_ERROR(PwriteAll(shard.fd.get(), p.file_offset, data[i], bytes,
                              absl::StrCat("writing ", shard.path)));
    i = j;
  }
  return absl::OkStatus();
}

absl::Status ShardedSafetensorsWriter::WriteBytes(size_t tensor, uint64_t offset,
                                                  const void* data, uint64_t bytes) {
  MT_CHECK(tensor < placement_.size());
  const Placement& p = placement_[tensor];
  MT_CHECK(offset + bytes <= p.bytes);
  const Shard& shard = *shards_[p.shard];
  return PwriteAll(shard.fd.get(), p.file_offset + offset, data, bytes,
                   absl::StrCat("writing ", shard.path));
}

absl::Status ShardedSafetensorsWriter::Commit() {
  for (const std::unique_ptr<Shard>& shard : shards_) {
    if (::fsync(shard->fd.get()) != 0) return ErrnoError(errno, absl::StrCat("fsync of ", shard->path));
    (void)::posix_fadvise(shard->fd.get(), 0, 0, POSIX_FADV_DONTNEED);
    RETURN_IF_ERROR(shard->fd.Close(shard->path));
  }
  if (index_text_.empty()) {
    if (::unlink(index_path_.c_str()) != 0 && errno != ENOENT) {
      return ErrnoError(errno, absl::StrCat("removing stale ", index_path_));
    }
    return FsyncPath(dir_);
  }
  return WriteFileDurably(index_path_, index_text_);
}

uint64_t ShardedSafetensorsWriter::total_file_bytes() const {
  uint64_t n = index_text_.size();
  for (const std::unique_ptr<Shard>& shard : shards_) n += shard->bytes;
  return n;
}

absl::Status WriteShardedSafetensors(const std::string& dir, const std::string& prefix,
                                     const std::vector<TensorToWrite>& tensors,
                                     uint64_t max_shard_bytes,
                                     const std::map<std::string, std::string>& metadata) {
  RETURN_IF_ERROR(CheckTensors(JoinPath(dir, prefix + ".safetensors.index.json"), tensors));
  ASSIGN_OR_RETURN(std::unique_ptr<ShardedSafetensorsWriter> writer,
                   ShardedSafetensorsWriter::Open(dir, prefix, tensors, max_shard_bytes, metadata));
  std::vector<const void*> data;
  for (const TensorToWrite& t : tensors) data.push_back(t.data);
  RETURN_IF_ERROR(writer->Write(0, data));
  return writer->Commit();
}

}  // namespace megatrain
