#include "engine/data/token_docs.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "engine/common/durable_file.h"
#include "engine/common/status.h"

namespace megatrain {
namespace {

namespace fs = std::filesystem;

constexpr char kFormat[] = "megatrain-token-store";
constexpr int kVersion = 1;

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

// Maps the whole file read-only; an empty file maps to nothing.
absl::StatusOr<std::pair<void*, size_t>> MapFile(const std::string& path) {
  // The cache folder is the user's: a FIFO there is refused without blocking.
  absl::StatusOr<ScopedFd> opened = OpenRegularFile(path, "token store");
  if (!opened.ok()) {
    return absl::DataLossError(absl::StrCat("token store: cannot open ", path, ": ",
                                            opened.status().message()));
  }
  const int fd = opened->Release();
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return Errno("token store: cannot stat", path);
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  void* p = nullptr;
  if (bytes > 0) {
    p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      return Errno("token store: cannot map", path);
    }
    ::madvise(p, bytes, MADV_SEQUENTIAL);
  }
  ::close(fd);
  return std::make_pair(p, bytes);
}

absl::Status SyncFile(std::FILE* f, const std::string& path) {
  if (std::fflush(f) != 0 || ::fsync(::fileno(f)) != 0) return Errno("cannot write", path);
  return absl::OkStatus();
}

}  // namespace

std::shared_ptr<const TokenDocs> TokenDocs::FromVectors(std::vector<std::vector<int32_t>> docs) {
  std::vector<Example> examples(docs.size());
  for (size_t i = 0; i < docs.size(); ++i) examples[i].ids = std::move(docs[i]);
  return FromExamples(examples);
}

std::shared_ptr<const TokenDocs> TokenDocs::FromExamples(const std::vector<Example>& examples) {
  std::shared_ptr<TokenDocs> d(new TokenDocs);
  d->own_offsets_.push_back(0);
  for (const Example& e : examples) {
    d->own_ids_.insert(d->own_ids_.end(), e.ids.begin(), e.ids.end());
    if (e.trained.empty()) {
      d->own_trained_.insert(d->own_trained_.end(), e.ids.size(), 1);
    } else {
      d->own_trained_.insert(d->own_trained_.end(), e.trained.begin(), e.trained.end());
    }
    d->own_offsets_.push_back(static_cast<int64_t>(d->own_ids_.size()));
  }
  d->num_docs_ = static_cast<int64_t>(examples.size());
  d->ids_ = d->own_ids_.data();
  d->trained_ = d->own_trained_.data();
  d->offsets_ = d->own_offsets_.data();
  return d;
}

absl::StatusOr<std::shared_ptr<const TokenDocs>> TokenDocs::Open(const std::string& dir) {
  const fs::path root(dir);
  const std::string meta_path = (root / "meta.json").string();
  absl::StatusOr<std::string> meta_text = ReadWholeFile(meta_path);
  if (absl::IsNotFound(meta_text.status())) {
    return absl::NotFoundError(absl::StrCat("token store ", dir, " has no meta.json"));
  }
  if (!meta_text.ok()) {
    return absl::DataLossError(absl::StrCat("token store ", dir, ": ", meta_text.status().message()));
  }
  nlohmann::json meta = nlohmann::json::parse(*meta_text, nullptr, /*allow_exceptions=*/false);
  if (meta.is_discarded() || !meta.is_object() || meta.value("format", "") != kFormat ||
      meta.value("version", 0) != kVersion || !meta.contains("num_docs") ||
      !meta["num_docs"].is_number_integer() || !meta.contains("num_tokens") ||
      !meta["num_tokens"].is_number_integer()) {
    return absl::DataLossError(absl::StrCat(meta_path, " is not a version ", kVersion, " ",
                                            kFormat, " header"));
  }
  const int64_t num_docs = meta["num_docs"].get<int64_t>();
  const int64_t num_tokens = meta["num_tokens"].get<int64_t>();
  // A store is built only with something to train on (CheckDatasetTrainable); the packer
  // requires it, so a header that says otherwise was edited: rebuilt, not trusted.
  if (num_docs < 1 || num_tokens < 1) {
    return absl::DataLossError(absl::StrCat(meta_path, " says ", num_docs, " documents of ",
                                            num_tokens, " tokens; a store holds at least one"));
  }
  std::shared_ptr<TokenDocs> d(new TokenDocs);
  d->num_docs_ = num_docs;
  d->source_ = meta.value("source", nlohmann::json::object());
  const struct {
    const char* name;
    size_t expected;
  } files[] = {{"tokens.i32", static_cast<size_t>(num_tokens) * 4},
               {"trained.u8", static_cast<size_t>(num_tokens)},
               {"offsets.i64", static_cast<size_t>(num_docs + 1) * 8}};
  for (const auto& f : files) {
    const std::string path = (root / f.name).string();
    ASSIGN_OR_RETURN(auto mapping, MapFile(path));
    d->mappings_.push_back({mapping.first, mapping.second});
    if (mapping.second != f.expected) {
      return absl::DataLossError(absl::StrCat(path, " has ", mapping.second, " bytes; meta.json (",
                                              num_docs, " documents, ", num_tokens,
                                              " tokens) needs ", f.expected));
    }
  }
  d->ids_ = static_cast<const int32_t*>(d->mappings_[0].data);
  d->trained_ = static_cast<const uint8_t*>(d->mappings_[1].data);
  d->offsets_ = static_cast<const int64_t*>(d->mappings_[2].data);
  if (d->offsets_[0] != 0 || d->offsets_[num_docs] != num_tokens) {
    return absl::DataLossError(absl::StrCat(dir, "/offsets.i64 does not span the ", num_tokens,
                                            " tokens"));
  }
  for (int64_t i = 0; i < num_docs; ++i) {
    if (d->offsets_[i + 1] < d->offsets_[i]) {
      return absl::DataLossError(
          absl::StrCat(dir, "/offsets.i64 decreases at document ", i));
    }
  }
  return std::shared_ptr<const TokenDocs>(std::move(d));
}

TokenDocs::~TokenDocs() {
  for (const Mapping& m : mappings_) {
    if (m.data != nullptr) ::munmap(m.data, m.bytes);
  }
}

absl::StatusOr<std::unique_ptr<TokenStoreWriter>> TokenStoreWriter::Create(const std::string& dir) {
  std::unique_ptr<TokenStoreWriter> w(new TokenStoreWriter);
  w->dir_ = dir;
  w->tmp_ = absl::StrCat(dir, ".tmp-", ::getpid());
  std::error_code ec;
  fs::remove_all(w->tmp_, ec);
  fs::create_directories(w->tmp_, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create the token store folder ", w->tmp_, ": ", ec.message()));
  }
  const std::string ids = w->tmp_ + "/tokens.i32", trained = w->tmp_ + "/trained.u8";
  w->ids_file_ = std::fopen(ids.c_str(), "wb");
  w->trained_file_ = std::fopen(trained.c_str(), "wb");
  if (w->ids_file_ == nullptr || w->trained_file_ == nullptr) return Errno("cannot create", ids);
  std::setvbuf(w->ids_file_, nullptr, _IOFBF, 1 << 20);
  std::setvbuf(w->trained_file_, nullptr, _IOFBF, 1 << 18);
  return w;
}

TokenStoreWriter::~TokenStoreWriter() {
  if (ids_file_ != nullptr) std::fclose(ids_file_);
  if (trained_file_ != nullptr) std::fclose(trained_file_);
  if (!finished_) {
    std::error_code ec;
    fs::remove_all(tmp_, ec);
  }
}

absl::Status TokenStoreWriter::Add(const Example& e) {
  const size_t n = e.ids.size();
  if (!e.trained.empty() && e.trained.size() != n) {
    return absl::InvalidArgumentError("an example's trained flags and ids differ in length");
  }
  if (n > 0 && std::fwrite(e.ids.data(), 4, n, ids_file_) != n) {
    return Errno("cannot write", tmp_ + "/tokens.i32");
  }
  if (e.trained.empty()) {
    const std::vector<uint8_t> ones(n, 1);
    if (n > 0 && std::fwrite(ones.data(), 1, n, trained_file_) != n) {
      return Errno("cannot write", tmp_ + "/trained.u8");
    }
  } else if (n > 0 && std::fwrite(e.trained.data(), 1, n, trained_file_) != n) {
    return Errno("cannot write", tmp_ + "/trained.u8");
  }
  offsets_.push_back(offsets_.back() + static_cast<int64_t>(n));
  return absl::OkStatus();
}

absl::Status TokenStoreWriter::Finish(const nlohmann::json& source) {
  RETURN_IF_ERROR(SyncFile(ids_file_, tmp_ + "/tokens.i32"));
  RETURN_IF_ERROR(SyncFile(trained_file_, tmp_ + "/trained.u8"));
  {
    const std::string path = tmp_ + "/offsets.i64";
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) return Errno("cannot create", path);
    const bool ok = std::fwrite(offsets_.data(), 8, offsets_.size(), f) == offsets_.size();
    absl::Status s = ok ? SyncFile(f, path) : Errno("cannot write", path);
    std::fclose(f);
    RETURN_IF_ERROR(s);
  }
  {
    const std::string path = tmp_ + "/meta.json";
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) return Errno("cannot create", path);
    const std::string text = nlohmann::json{{"format", kFormat},
                                            {"version", kVersion},
                                            {"num_docs", num_docs()},
                                            {"num_tokens", num_tokens()},
                                            {"source", source}}
                                 .dump(2);
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    absl::Status s = ok ? SyncFile(f, path) : Errno("cannot write", path);
    std::fclose(f);
    RETURN_IF_ERROR(s);
  }
  std::error_code ec;
  fs::remove_all(dir_, ec);
  fs::rename(tmp_, dir_, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot publish the token store ", dir_, ": ", ec.message()));
  }
  finished_ = true;
  return absl::OkStatus();
}

}  // namespace megatrain
