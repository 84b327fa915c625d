// Opening, validating and reading one .safetensors file; see safetensors.h.
//
// Every check runs in Open() so that reads need no validation and cannot disagree about
// what the file holds. bf16/f16 are widened in place: the raw bytes land in the upper
// half of the caller's fp32 buffer and are converted front to back, so a read needs no
// staging buffer however large the tensor.
#include "engine/model/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/common/check.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"
#include "engine/common/durable_file.h"
#include "nlohmann/json.hpp"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian");

namespace megatrain {
namespace {

using Json = nlohmann::json;

// The safetensors reference implementation refuses headers above 100 MB; so do we,
// rather than allocating whatever a corrupt length field says.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

absl::Status TensorError(const std::string& path, absl::string_view tensor,
                         absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", tensor, "' ", what));
}

absl::StatusOr<DType> ParseDType(const std::string& path, const std::string& tensor,
                                 const std::string& name) {
  static const std::pair<const char*, DType> kKnown[] = {
      {"BF16", DType::kBF16}, {"F16", DType::kF16}, {"F32", DType::kF32},
      {"F64", DType::kF64},   {"I32", DType::kI32}, {"U8", DType::kU8}, {"I8", DType::kI8}};
  for (const auto& [text, dtype] : kKnown) {
    if (name == text) return dtype;
  }
  static const char* const kSpecOnly[] = {"BOOL", "I8",      "I16",     "U16",
                                          "U32",  "I64", "U64",     "F8_E4M3", "F8_E5M2",
                                          "F4",   "F6_E2M3", "F6_E3M2", "E8M0", "F8_E8M0"};
  for (const char* text : kSpecOnly) {
    if (name == text) {
      return TensorError(path, tensor,
                         absl::StrCat("has dtype ", name,
                                      ", which megatrain does not read (it reads BF16, F16, "
                                      "F32, F64, I32, and U8 for MXFP4 experts); convert the "
                                      "checkpoint to bf16"));
    }
  }
  return TensorError(path, tensor, absl::StrCat("has unknown dtype '", name, "'"));
}

// A JSON array of non-negative integers, or an error naming `field`.
absl::StatusOr<std::vector<uint64_t>> UnsignedList(const std::string& path,
                                                   const std::string& tensor, const Json& entry,
                                                   const char* field) {
  auto it = entry.find(field);
  if (it == entry.end() || !it->is_array()) {
    return TensorError(path, tensor, absl::StrCat("has no '", field, "' list"));
  }
  std::vector<uint64_t> values;
  for (const Json& v : *it) {
    if (!v.is_number_unsigned()) {
      return TensorError(path, tensor, absl::StrCat("has a '", field, "' entry that is not a ",
                                                    "non-negative integer: ", v.dump()));
    }
    values.push_back(v.get<uint64_t>());
  }
  return values;
}

// Parses one header entry; `data_start` is the file offset of the data buffer.
absl::StatusOr<TensorInfo> ParseEntry(const std::string& path, const std::string& name,
                                      const Json& entry, uint64_t data_start,
                                      uint64_t data_bytes) {
  if (!entry.is_object()) return TensorError(path, name, "is not a JSON object in the header");
  auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end() || !dtype_it->is_string()) {
    return TensorError(path, name, "has no 'dtype' string");
  }
  TensorInfo info;
  info.name = name;
  ASSIGN_OR_RETURN(info.dtype, ParseDType(path, name, dtype_it->get<std::string>()));
  ASSIGN_OR_RETURN(std::vector<uint64_t> dims, UnsignedList(path, name, entry, "shape"));
  ASSIGN_OR_RETURN(std::vector<uint64_t> range, UnsignedList(path, name, entry, "data_offsets"));
  if (range.size() != 2) {
    return TensorError(path, name, "has 'data_offsets' that is not [begin, end]");
  }
  const uint64_t begin = range[0], end = range[1];
  const std::string offsets = absl::StrCat("data_offsets [", begin, ", ", end, "]");
  if (begin > end) return TensorError(path, name, absl::StrCat("has ", offsets, " with begin > end"));
  if (end > data_bytes) {
    return TensorError(path, name,
                       absl::StrCat("has ", offsets, " past the end of the data buffer (",
                                    data_bytes, " bytes); the file is truncated: re-download "
                                    "or re-save it"));
  }
  uint64_t expected_bytes = static_cast<uint64_t>(DTypeSize(info.dtype));
  bool overflow = false;
  for (uint64_t d : dims) {
    overflow |= d > uint64_t{INT64_MAX} || __builtin_mul_overflow(expected_bytes, d, &expected_bytes);
    info.shape.push_back(static_cast<int64_t>(d));
  }
  if (overflow || expected_bytes != end - begin) {
    return TensorError(path, name,
                       absl::StrCat("has shape ", ShapeToString(info.shape), " of ",
                                    DTypeName(info.dtype), ", which needs ",
                                    overflow ? "an impossible number of" : absl::StrCat(expected_bytes),
                                    " bytes, but ", offsets, " span ", end - begin,
                                    " bytes; the file is corrupt: re-download or re-save it"));
  }
  info.offset = data_start + begin;
  info.num_bytes = end - begin;
  return info;
}

// Sorted by offset, no two non-empty tensors may share a byte.
absl::Status CheckNoOverlap(const std::string& path, uint64_t data_start,
                            std::vector<TensorInfo>& tensors) {
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.name < b.name;
  });
  const TensorInfo* furthest = nullptr;  // the non-empty tensor reaching furthest so far
  for (const TensorInfo& t : tensors) {
    if (t.num_bytes == 0) continue;
    if (furthest != nullptr && t.offset < furthest->offset + furthest->num_bytes) {
      auto range = [&](const TensorInfo& x) {
        return absl::StrCat("[", x.offset - data_start, ", ", x.offset - data_start + x.num_bytes,
                            ")");
      };
      return TensorError(path, t.name,
                         absl::StrCat("bytes ", range(t), " overlap tensor '", furthest->name,
                                      "' bytes ", range(*furthest),
                                      "; the file is corrupt: re-download or re-save it"));
    }
    if (furthest == nullptr ||
        t.offset + t.num_bytes > furthest->offset + furthest->num_bytes) {
      furthest = &t;
    }
  }
  return absl::OkStatus();
}

absl::Status ParseHeader(const std::string& path, const std::string& header, uint64_t data_start,
                         uint64_t data_bytes, std::vector<TensorInfo>& tensors,
                         std::map<std::string, std::string>& metadata) {
  Json root;
  try {
    root = Json::parse(header);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": header is not valid JSON (", Printable(e.what()), "); the file is corrupt or not safetensors"));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header is JSON ", root.type_name(), ", not an object"));
  }
  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": __metadata__ is not an object"));
      }
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(
              path, ": __metadata__ entry '", key, "' is not a string: ", value.dump()));
        }
        metadata[key] = value.get<std::string>();
      }
      continue;
    }
    ASSIGN_OR_RETURN(TensorInfo info, ParseEntry(path, name, entry, data_start, data_bytes));
    tensors.push_back(std::move(info));
  }
  return CheckNoOverlap(path, data_start, tensors);
}

}  // namespace

int64_t TensorInfo::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeToString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  SafetensorsFile file;
  file.path_ = path;
  file.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file.fd_ < 0) return ErrnoError(errno, absl::StrCat("opening ", path));
  struct stat st;
  if (::fstat(file.fd_, &st) != 0) return ErrnoError(errno, absl::StrCat("stat of ", path));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": file is ", file_bytes, " bytes, too short for the 8-byte header length; "
        "it is truncated or not a safetensors file"));
  }
  unsigned char len_bytes[8];
  RETURN_IF_ERROR(PreadAll(file.fd_, 0, 8, len_bytes, absl::StrCat("reading ", path)));
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | len_bytes[i];
  if (header_bytes > file_bytes - 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": header length ", header_bytes, " runs past the end of the file (", file_bytes,
        " bytes); the file is truncated or not a safetensors file"));
  }
  if (header_bytes > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": header length ", header_bytes, " exceeds the 100 MiB safetensors limit; the "
        "file is corrupt or not a safetensors file"));
  }
  std::string header(header_bytes, '\0');
  RETURN_IF_ERROR(PreadAll(file.fd_, 8, header_bytes, header.data(),
                           absl::StrCat("reading the header of ", path)));
  const uint64_t data_start = 8 + header_bytes;
  RETURN_IF_ERROR(ParseHeader(path, header, data_start, file_bytes - data_start, file.tensors_,
                              file.metadata_));
  for (size_t i = 0; i < file.tensors_.size(); ++i) file.index_[file.tensors_[i].name] = i;
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      path_(std::move(other.path_)),
      tensors_(std::move(other.tensors_)),
      index_(std::move(other.index_)),
      metadata_(std::move(other.metadata_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    tensors_ = std::move(other.tensors_);
    index_ = std::move(other.index_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

const TensorInfo* SafetensorsFile::Find(absl::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::Status SafetensorsFile::ReadRaw(const TensorInfo& info, void* out) const {
  MT_CHECK(fd_ >= 0);
  return PreadAll(fd_, info.offset, info.num_bytes, out,
                  absl::StrCat(path_, ": reading tensor '", info.name, "'"));
}

absl::Status SafetensorsFile::ReadAsFloat(const TensorInfo& info, float* out) const {
  const uint64_t n = static_cast<uint64_t>(info.num_elements());
  switch (info.dtype) {
    case DType::kF32:
      return ReadRaw(info, out);
    case DType::kBF16:
    case DType::kF16: {
      // Raw halves go to bytes [2n, 4n) of `out`; element i is read from 2n + 2i before
      // out[i] (bytes [4i, 4i + 4)) is written, and 4i + 4 <= 2n + 2(i + 1) for i < n,
      // so no unread element is overwritten.
      char* base = reinterpret_cast<char*>(out);
      const char* halves = base + 2 * n;
      RETURN_IF_ERROR(ReadRaw(info, base + 2 * n));
      const bool bf16 = info.dtype == DType::kBF16;
      for (uint64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, halves + 2 * i, 2);
        out[i] = bf16 ? Bf16ToFloat(h) : F16ToFloat(h);
      }
      return absl::OkStatus();
    }
    case DType::kF64:
    case DType::kI32:
    case DType::kU8:
    case DType::kI8:
      break;
  }
  return TensorError(path_, info.name,
                     absl::StrCat("has dtype ", DTypeName(info.dtype),
                                  "; only BF16, F16 and F32 tensors can be read as fp32 weights"));
}

}  // namespace megatrain
