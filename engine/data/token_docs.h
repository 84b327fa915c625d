// Tokenized documents: every document's ids and, per token, whether the loss trains on
// predicting it. In memory (tests, small sets) or memory-mapped from a token store on
// disk, so a dataset larger than RAM is paged in by the kernel as the packer walks it.
//
// A token store is a folder of four files, written once by TokenStoreWriter and never
// changed after its meta.json exists:
//   tokens.i32    int32 little-endian ids, every document end to end
//   trained.u8    one byte per token: 1 = a target of the loss, 0 = context only
//   offsets.i64   num_docs + 1 int64: document d is tokens [offsets[d], offsets[d+1])
//   meta.json     {"format": "megatrain-token-store", "version": 1, "num_docs",
//                  "num_tokens", "source": {...}}; written last, so a folder without it
//                  is an interrupted write and is never read
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "nlohmann/json.hpp"

namespace megatrain {

// One example before packing. trained[i] says whether ids[i] is a target, i.e. whether
// predicting it from ids[0..i) counts in the loss. Empty `trained` = every token.
struct Example {
  std::vector<int32_t> ids;
  std::vector<uint8_t> trained;
};

// Read-only view over documents; immutable, safe to share between threads.
class TokenDocs {
 public:
  // In memory: every token trained when `trained` is empty, else one flag vector per doc.
  static std::shared_ptr<const TokenDocs> FromVectors(std::vector<std::vector<int32_t>> docs);
  static std::shared_ptr<const TokenDocs> FromExamples(const std::vector<Example>& examples);
  // Maps a finished token store. NotFound when there is no meta.json; DataLoss naming the
  // file when sizes, offsets or the header disagree.
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<const TokenDocs>> Open(
      const std::string& dir);

  ~TokenDocs();
  TokenDocs(const TokenDocs&) = delete;
  TokenDocs& operator=(const TokenDocs&) = delete;

  int64_t num_docs() const { return num_docs_; }
  int64_t num_tokens() const { return offsets_[num_docs_]; }
  int64_t size(int64_t doc) const { return offsets_[doc + 1] - offsets_[doc]; }
  absl::Span<const int32_t> ids(int64_t doc) const {
    return {ids_ + offsets_[doc], static_cast<size_t>(size(doc))};
  }
  absl::Span<const uint8_t> trained(int64_t doc) const {
    return {trained_ + offsets_[doc], static_cast<size_t>(size(doc))};
  }
  // meta.json's "source" (empty for in-memory documents).
  const nlohmann::json& source() const { return source_; }

 private:
  TokenDocs() = default;
  struct Mapping {
    void* data = nullptr;
    size_t bytes = 0;
  };

  int64_t num_docs_ = 0;
  const int32_t* ids_ = nullptr;
  const uint8_t* trained_ = nullptr;
  const int64_t* offsets_ = nullptr;
  // Owners: vectors for in-memory documents, mappings for a store.
  std::vector<int32_t> own_ids_;
  std::vector<uint8_t> own_trained_;
  std::vector<int64_t> own_offsets_;
  std::vector<Mapping> mappings_;
  nlohmann::json source_;
};

// Appends documents to a new token store in `dir`'s temporary sibling and publishes it
// with Finish() (meta.json written, fsynced, folder renamed to `dir`). Not thread-safe.
class TokenStoreWriter {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<TokenStoreWriter>> Create(
      const std::string& dir);
  ~TokenStoreWriter();  // an unfinished store is removed

  [[nodiscard]] absl::Status Add(const Example& example);
  int64_t num_docs() const { return static_cast<int64_t>(offsets_.size()) - 1; }
  int64_t num_tokens() const { return offsets_.back(); }
  // `source` describes what the store was made from (path, tokenizer, format, stats).
  [[nodiscard]] absl::Status Finish(const nlohmann::json& source);

 private:
  TokenStoreWriter() = default;
  [[nodiscard]] absl::Status Flush();

  std::string dir_, tmp_;
  std::FILE* ids_file_ = nullptr;
  std::FILE* trained_file_ = nullptr;
  std::vector<int64_t> offsets_{0};  // 8 bytes per document: the index stays in memory
  bool finished_ = false;
};

}  // namespace megatrain
