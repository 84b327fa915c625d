// Sequence packing: tokenized documents -> fixed-shape micro-batches of (rows, seq_len).
//
// kPack lays documents end to end, each row filled with consecutive documents; kPad puts
// one document per row. What does not fit depends on the truncation policy: kSplit
// continues the document at the start of the next row, as a new attention segment whose
// positions restart at 0; kTruncate keeps each document whole in one row (the rest of a
// row is padded when the next document does not fit) and drops the tokens of a document
// past seq_len. Nothing attends across documents: doc_start tells the attention kernel
// where each token's segment begins; a padding token is its own segment and no target.
// A token is a target only where the document marks it trained (SFT loss masks). The order of documents is a
// permutation per epoch that depends only on (seed, epoch), so the stream of batches is
// a pure function of (docs, seq_len, seed) and a DataPosition resumes it bit for bit.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/data/micro_batch.h"
#include "engine/data/token_docs.h"
#include "nlohmann/json_fwd.hpp"

namespace megatrain {

// Where the packer is in the stream: the next token it emits is token `token_offset` of
// document DocumentOrder(num_docs, seed, epoch)[doc_cursor]. Saved in checkpoints.
struct DataPosition {
  int64_t epoch = 0;
  int64_t doc_cursor = 0;    // index into this epoch's document order
  int64_t token_offset = 0;  // tokens of that document already emitted
};

// {"epoch": E, "doc_cursor": C, "token_offset": T}
nlohmann::json DataPositionToJson(const DataPosition& position);
// InvalidArgument naming the field when one is missing, not an integer, or negative.
[[nodiscard]] absl::StatusOr<DataPosition> DataPositionFromJson(const nlohmann::json& json);

// The order documents are visited in during `epoch`: a permutation of [0, num_docs).
// Fisher-Yates driven by std::mt19937_64 seeded from (seed, epoch), with our own
// unbiased bounded draw, so it is the same on every platform and standard library.
std::vector<int64_t> DocumentOrder(int64_t num_docs, uint64_t seed, int64_t epoch);

struct PackOptions {
  enum class Mode { kPack, kPad } mode = Mode::kPack;
  enum class Truncation { kSplit, kTruncate } truncation = Truncation::kSplit;
  int32_t pad_id = 0;  // the input id of padding tokens (never a target)
  // One pass over the documents (an evaluation set): once the first epoch's documents are
  // used up, every further token is padding, and exhausted() says so.
  bool single_pass = false;
};

// Reads shared, immutable documents. Not thread-safe: one packer per data stream.
class Packer {
 public:
  // docs: each document's ids, bos / eos included as the caller wishes (see
  // TokenizeDocuments). REQUIRES: seq_len >= 1 and at least one token in docs.
  Packer(std::vector<std::vector<int32_t>> docs, int64_t seq_len, uint64_t seed);
  Packer(std::shared_ptr<const TokenDocs> docs, int64_t seq_len, uint64_t seed,
         PackOptions options = {});

  // Fills `out` with the next rows * seq_len tokens of the stream, crossing into the next
  // epoch (and its order) when the last document of this one is used up. Reuses out's
  // buffers, so after the first call with a given shape it allocates nothing except at
  // an epoch boundary. REQUIRES: rows >= 1, rows * seq_len < 2^31.
  void Next(int64_t rows, MicroBatch* out);

  // The position after the last Next(); it depends on documents only, not on seq_len.
  DataPosition position() const;
  // Continues from `position`, taken from a packer over the same documents and seed.
  // InvalidArgument when it cannot belong to this dataset (a cursor past the last
  // document, an offset past the document's end); the packer is unchanged then.
  [[nodiscard]] absl::Status Seek(const DataPosition& position);

  // single_pass only: every document has been emitted; further rows are padding.
  bool exhausted() const { return options_.single_pass && epoch_ > 0; }

  int64_t num_docs() const { return docs_->num_docs(); }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t seq_len() const { return seq_len_; }

 private:
  // Moves to the next document of the order, and to the next epoch after the last one.
  void AdvanceDocument();
  // Tokens of `doc` the packer emits: all, or at most seq_len under kTruncate.
  int64_t EmittedLength(int64_t doc) const;

  std::shared_ptr<const TokenDocs> docs_;
  int64_t seq_len_;
  uint64_t seed_;
  PackOptions options_;
  int64_t num_tokens_ = 0;
  int64_t epoch_ = 0;
  int64_t cursor_ = 0;          // index into order_
  int64_t offset_ = 0;          // within docs_[order_[cursor_]]
  std::vector<int64_t> order_;  // DocumentOrder(num_docs, seed_, epoch_)
};

}  // namespace megatrain
