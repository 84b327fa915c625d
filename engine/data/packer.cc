// Packer. The shuffle is written out (Fisher-Yates with a rejection-sampled bounded
// draw) because std::shuffle and std::uniform_int_distribution are
// implementation-defined: a checkpoint must resume to the same batches on any machine.
#include "engine/data/packer.h"

#include <algorithm>
#include <limits>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/common/check.h"
#include "engine/common/status.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

// SplitMix64's finaliser: spreads nearby seeds and epochs over the whole 64-bit space.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [0, bound): rejects the 2^64 mod bound lowest draws so every residue is
// equally likely.
uint64_t UniformBelow(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;
  uint64_t x = rng();
  while (x < threshold) x = rng();
  return x % bound;
}

void FillDocumentOrder(int64_t num_docs, uint64_t seed, int64_t epoch,
                       std::vector<int64_t>* order) {
  order->resize(num_docs);
  for (int64_t i = 0; i < num_docs; ++i) (*order)[i] = i;
  std::mt19937_64 rng(Mix(seed ^ Mix(static_cast<uint64_t>(epoch))));
  for (int64_t i = num_docs - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(UniformBelow(rng, static_cast<uint64_t>(i) + 1));
    std::swap((*order)[i], (*order)[j]);
  }
}

absl::StatusOr<int64_t> NonNegativeField(const nlohmann::json& json, const char* name) {
  const auto it = json.find(name);
  if (it == json.end()) {
    return absl::InvalidArgumentError(absl::StrCat("data position: field '", name, "' missing"));
  }
  if (!it->is_number_integer() ||
      (it->is_number_unsigned() &&
       it->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) ||
      (!it->is_number_unsigned() && it->get<int64_t>() < 0)) {
    return absl::InvalidArgumentError(absl::StrCat("data position: field '", name, "' is ",
                                                   it->dump(), ", expected an integer >= 0"));
  }
  return it->get<int64_t>();
}

}  // namespace

nlohmann::json DataPositionToJson(const DataPosition& position) {
  return nlohmann::json{{"epoch", position.epoch},
                        {"doc_cursor", position.doc_cursor},
                        {"token_offset", position.token_offset}};
}

absl::StatusOr<DataPosition> DataPositionFromJson(const nlohmann::json& json) {
  if (!json.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("data position is a ", json.type_name(),
                     ", expected an object {\"epoch\", \"doc_cursor\", \"token_offset\"}"));
  }
  DataPosition position;
  ASSIGN_OR_RETURN(position.epoch, NonNegativeField(json, "epoch"));
  ASSIGN_OR_RETURN(position.doc_cursor, NonNegativeField(json, "doc_cursor"));
  ASSIGN_OR_RETURN(position.token_offset, NonNegativeField(json, "token_offset"));
  return position;
}

std::vector<int64_t> DocumentOrder(int64_t num_docs, uint64_t seed, int64_t epoch) {
  MT_CHECK(num_docs >= 0 && epoch >= 0);
  std::vector<int64_t> order;
  FillDocumentOrder(num_docs, seed, epoch, &order);
  return order;
}

Packer::Packer(std::vector<std::vector<int32_t>> docs, int64_t seq_len, uint64_t seed)
    : Packer(TokenDocs::FromVectors(std::move(docs)), seq_len, seed) {}

Packer::Packer(std::shared_ptr<const TokenDocs> docs, int64_t seq_len, uint64_t seed,
               PackOptions options)
    : docs_(std::move(docs)), seq_len_(seq_len), seed_(seed), options_(options) {
  MT_CHECK(seq_len_ >= 1);
  num_tokens_ = docs_->num_tokens();
  MT_CHECK_MSG(num_tokens_ > 0, "Packer needs at least one token (%lld documents)",
               static_cast<long long>(docs_->num_docs()));
  FillDocumentOrder(num_docs(), seed_, epoch_, &order_);
}

int64_t Packer::EmittedLength(int64_t doc) const {
  const int64_t n = docs_->size(doc);
  return options_.truncation == PackOptions::Truncation::kTruncate ? std::min(n, seq_len_) : n;
}

void Packer::Next(int64_t rows, MicroBatch* out) {
  MT_CHECK(rows >= 1);
  MT_CHECK(rows * seq_len_ <= std::numeric_limits<int32_t>::max());
  const size_t n = static_cast<size_t>(rows * seq_len_);
  out->rows = rows;
  out->seq_len = seq_len_;
  out->tokens.resize(n);
  out->targets.resize(n);
  out->doc_start.resize(n);
  out->positions.resize(n);
  const bool whole = options_.truncation == PackOptions::Truncation::kTruncate;
  const bool one_per_row = options_.mode == PackOptions::Mode::kPad;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t col = 0;
    while (col < seq_len_ && !exhausted()) {
      const int64_t d = order_[cursor_];
      const int64_t doc_len = EmittedLength(d);
      if (doc_len == 0) {  // nothing to emit: skip it wherever it is
        AdvanceDocument();
        continue;
      }
      // A row holds one document (kPad), or documents kept whole (kTruncate): the rest of
      // the row is padding when the next one does not fit.
      if (col > 0 && (one_per_row || (whole && doc_len - offset_ > seq_len_ - col))) break;
      const absl::Span<const int32_t> ids = docs_->ids(d);
      const absl::Span<const uint8_t> trained = docs_->trained(d);
      const int64_t take = std::min(doc_len - offset_, seq_len_ - col);
      const int64_t start = r * seq_len_ + col;  // this segment's first flat index
      for (int64_t k = 0; k < take; ++k) {
        const int64_t t = offset_ + k;  // index within the document
        out->tokens[start + k] = ids[t];
        out->targets[start + k] = t + 1 < doc_len && trained[t + 1] ? ids[t + 1] : kIgnoreIndex;
        out->doc_start[start + k] = static_cast<int32_t>(start);
        out->positions[start + k] = static_cast<int32_t>(k);
      }
      col += take;
      offset_ += take;
      if (offset_ == doc_len) AdvanceDocument();
    }
    for (int64_t j = r * seq_len_ + col; j < (r + 1) * seq_len_; ++j) {  // padding
      out->tokens[j] = options_.pad_id;
      out->targets[j] = kIgnoreIndex;
      out->doc_start[j] = static_cast<int32_t>(j);
      out->positions[j] = 0;
    }
  }
}

void Packer::AdvanceDocument() {
  offset_ = 0;
  if (++cursor_ < num_docs()) return;
  cursor_ = 0;
  ++epoch_;
  FillDocumentOrder(num_docs(), seed_, epoch_, &order_);
}

DataPosition Packer::position() const { return DataPosition{epoch_, cursor_, offset_}; }

absl::Status Packer::Seek(const DataPosition& position) {
  if (position.epoch < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("data position epoch is ", position.epoch, "; it must be >= 0"));
  }
  if (position.doc_cursor < 0 || position.doc_cursor >= num_docs()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data position doc_cursor is ", position.doc_cursor, " but the dataset has ", num_docs(),
        " documents; resume with the dataset the checkpoint was trained on"));
  }
  std::vector<int64_t> order;
  FillDocumentOrder(num_docs(), seed_, position.epoch, &order);
  const int64_t doc = order[position.doc_cursor];
  const int64_t doc_len = EmittedLength(doc);
  if (position.token_offset < 0 || position.token_offset > doc_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data position token_offset is ", position.token_offset, " but document ", doc, " (cursor ",
        position.doc_cursor, " of epoch ", position.epoch, ") has ", doc_len,
        " tokens; resume with the dataset, tokenizer and seed the checkpoint was trained "
        "with"));
  }
  epoch_ = position.epoch;
  cursor_ = position.doc_cursor;
  offset_ = position.token_offset;
  order_ = std::move(order);
  return absl::OkStatus();
}

}  // namespace megatrain
