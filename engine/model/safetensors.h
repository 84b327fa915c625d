// safetensors: reading and writing the tensor files of Hugging Face model folders.
//
// Format: an 8-byte little-endian header length N, N bytes of JSON
//   {"<tensor>": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"<key>": "<value>"}}
// then the data buffer; data_offsets are relative to the start of that buffer.
//
// Files are validated completely when opened (dtypes, shapes against byte counts, every
// range inside the file, no overlaps), so a truncated download or a corrupt checkpoint
// fails at load time with a message naming the file and the tensor, not hours into a
// run. Reads use pread() on a shared descriptor: no mmap, so a file truncated after
// opening yields an error instead of SIGBUS, and concurrent reads need no locking.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/common/dtype.h"

namespace megatrain {

// One tensor of an opened file.
struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;     // absolute file offset of the first byte
  uint64_t num_bytes = 0;  // == num_elements() * DTypeSize(dtype)

  int64_t num_elements() const;
};

// "[4096, 1024]"; "[]" for a scalar.
std::string ShapeToString(const std::vector<int64_t>& shape);

// An open, validated .safetensors file. Move-only; owns the file descriptor.
//
// Thread-safety: all const methods may be called concurrently (reads use pread).
//
// dtypes: BF16, F16, F32, F64, I32 and U8 (MXFP4 blocks and scales) are understood. Any
// other dtype in the file, even one the safetensors spec defines (I64, F8_E4M3, ...), makes
// Open() fail naming the tensor: the model families we train store nothing else.
class SafetensorsFile {
 public:
  // Opens and validates `path`. Errors (all naming the file, and the tensor where one
  // is at fault): NotFound if the file does not exist; InvalidArgument for a file
  // shorter than 8 bytes, a header length past the end of the file, a header that is
  // not JSON or not an object, an unsupported dtype, a shape whose element count times
  // the dtype size differs from end - begin, begin > end, a range past the end of the
  // data buffer (truncated file), or two tensors whose byte ranges overlap.
  [[nodiscard]] static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // Every tensor, ordered by offset in the file.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // nullptr when the file has no tensor `name`. The pointer lives as long as the file.
  const TensorInfo* Find(absl::string_view name) const;
  // The "__metadata__" entries (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Copies the tensor's bytes, as stored (little-endian), into `out`.
  // REQUIRES: `info` belongs to this file; `out` holds info.num_bytes bytes.
  [[nodiscard]] absl::Status ReadRaw(const TensorInfo& info, void* out) const;

  // Reads the tensor converted to fp32. BF16, F16 and F32 are converted exactly; any
  // other dtype is InvalidArgument naming the tensor.
  // REQUIRES: `info` belongs to this file; `out` holds info.num_elements() floats.
  [[nodiscard]] absl::Status ReadAsFloat(const TensorInfo& info, float* out) const;

 private:
  SafetensorsFile() = default;

  int fd_ = -1;
  std::string path_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

// The weights of a Hugging Face model folder, possibly sharded over several files.
//
// Which files: model.safetensors.index.json when present (its weight_map names the shard
// of every tensor); otherwise model.safetensors; otherwise every *.safetensors in the
// folder (a tensor present in two of them is an error).
//
// Thread-safety: const methods may be called concurrently, including ReadAsFloat on
// different (or the same) tensors. Move-only.
class ModelTensorReader {
 public:
  // Opens and validates every file it will read. Errors: NotFound "no *.safetensors in
  // <dir>"; an index that is not valid JSON, names a shard that is missing, or names a
  // tensor its shard lacks (the message names the index, the shard and the tensor); and
  // every SafetensorsFile::Open error.
  [[nodiscard]] static absl::StatusOr<ModelTensorReader> OpenFolder(const std::string& dir);

  ModelTensorReader(ModelTensorReader&&) = default;
  ModelTensorReader& operator=(ModelTensorReader&&) = default;

  const std::string& dir() const { return dir_; }
  bool Has(const std::string& name) const { return tensors_.count(name) != 0; }
  // Every tensor name, sorted.
  std::vector<std::string> names() const;
  // nullptr when absent. The pointer lives as long as the reader.
  const TensorInfo* Find(const std::string& name) const;
  // The file holding `name`, or "" when absent.
  std::string FileOf(const std::string& name) const;

  // Reads tensor `name` as fp32 into `out` after checking that its shape is
  // `expected_shape` (what config.json implies). NotFound "tensor '<name>' not found in
  // <dir>" when absent; InvalidArgument naming the tensor, its file and both shapes when
  // the shapes differ; otherwise as SafetensorsFile::ReadAsFloat.
  // REQUIRES: `out` holds the product of expected_shape floats.
  [[nodiscard]] absl::Status ReadAsFloat(const std::string& name,
                                         const std::vector<int64_t>& expected_shape,
                                         float* out) const;
  // Whether tensor `name` is there with `expected_shape` and, when `expected_dtype` is
  // given, that dtype (else one ReadAsFloat converts): the errors ReadAsFloat or ReadRaw
  // would give, from the headers alone.
  [[nodiscard]] absl::Status CheckTensor(const std::string& name,
                                         const std::vector<int64_t>& expected_shape,
                                         const DType* expected_dtype = nullptr) const;
  // Reads tensor `name`'s bytes as stored after checking its shape and dtype; errors as
  // ReadAsFloat's, and InvalidArgument naming both dtypes when they differ.
  // REQUIRES: `out` holds the product of expected_shape elements of `expected_dtype`.
  [[nodiscard]] absl::Status ReadRaw(const std::string& name,
                                     const std::vector<int64_t>& expected_shape,
                                     DType expected_dtype, void* out) const;

 private:
  struct Location {
    size_t file;  // index into files_
    const TensorInfo* info;
  };
  ModelTensorReader() = default;

  std::string dir_;
  // unique_ptr keeps TensorInfo pointers valid when the reader moves.
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Location> tensors_;
};

// One tensor to write; `data` holds num_elements * DTypeSize(dtype) bytes, little-endian,
// and must stay valid for the duration of the write call.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

// Writes one .safetensors file: tensors in the given order, header padded with spaces to
// a multiple of 8 bytes, "__metadata__" when `metadata` is non-empty (checkpoints use
// {"format": "pt"}, which transformers expects). The data goes to "<path>.tmp", is
// fsynced, and is renamed onto `path`, so `path` is never seen half-written.
// InvalidArgument for an empty or duplicate tensor name; write errors carry errno's text.
[[nodiscard]] absl::Status WriteSafetensors(const std::string& path,
                                            const std::vector<TensorToWrite>& tensors,
                                            const std::map<std::string, std::string>& metadata);

// A sharded save whose layout is fixed before any tensor is written: `tensors`, in
// order, go into shards of at most `max_shard_bytes` of tensor data each (a tensor larger
// than that gets a shard of its own). One shard: "<dir>/<prefix>.safetensors" and no index
// (a stale "<prefix>.safetensors.index.json" is removed, since readers would prefer it).
// Several: "<prefix>-00001-of-00003.safetensors", ... and, written by Commit(),
// "<prefix>.safetensors.index.json" {"metadata": {"total_size": N}, "weight_map": {..}}.
//
// Open() creates every shard at its final size with its header (header padded with spaces
// to a multiple of 8 bytes, "__metadata__" when `metadata` is non-empty), reserving the
// blocks where the file system can. Then each tensor's bytes are written once, in any
// order, from any thread; Commit() fsyncs and closes the shards and writes the index.
// The files are written in place: write into a fresh folder that is renamed into place
// when complete (checkpoints do). The tensors' `data` is ignored by Open().
class ShardedSafetensorsWriter {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ShardedSafetensorsWriter>> Open(
      const std::string& dir, const std::string& prefix,
      const std::vector<TensorToWrite>& tensors, uint64_t max_shard_bytes,
      const std::map<std::string, std::string>& metadata);
  ~ShardedSafetensorsWriter();

  // Writes tensors first .. first + data.size() - 1 (indices into Open's `tensors`), the
  // i-th from data[i]; neighbours adjacent both in memory and in their file go in one
  // write. Thread-safe for disjoint tensors.
  [[nodiscard]] absl::Status Write(size_t first, const std::vector<const void*>& data);
  // Writes `bytes` bytes of tensor `tensor` from byte `offset` within it: a large tensor
  // can be written in pieces, from several threads.
  [[nodiscard]] absl::Status WriteBytes(size_t tensor, uint64_t offset, const void* data,
                                        uint64_t bytes);
  // fsyncs and closes every shard, drops their pages from the page cache (a checkpoint is
  // not read back by this process), writes the index. Every tensor must have been written.
  [[nodiscard]] absl::Status Commit();
  // Bytes of every file this save writes (headers included).
  uint64_t total_file_bytes() const;
  // Which shard file tensor `tensor` goes to (0-based). Buffered writes to one file
  // serialize in the kernel; writers that want to run in parallel pick different files.
  size_t ShardOf(size_t tensor) const { return placement_[tensor].shard; }

 private:
  struct Shard;
  struct Placement {
    size_t shard = 0;
    uint64_t file_offset = 0;
    uint64_t bytes = 0;
  };
  ShardedSafetensorsWriter() = default;

  std::string dir_;
  std::string index_path_;
  std::string index_text_;  // empty: one shard
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<Placement> placement_;  // per tensor
};

// Writes `tensors` (with their data) through a ShardedSafetensorsWriter and commits.
[[nodiscard]] absl::Status WriteShardedSafetensors(
    const std::string& dir, const std::string& prefix, const std::vector<TensorToWrite>& tensors,
    uint64_t max_shard_bytes, const std::map<std::string, std::string>& metadata);

}  // namespace megatrain
