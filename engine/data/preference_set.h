// A DPO job's data: a JSONL file of preference pairs (preference.h: TRL's layout, standard
// or conversational), read whole, each line tokenized and cut into its two training
// sequences (PreferenceSequences). A bad line stops the load naming path:line and the
// problem, or is left out and counted (skip_bad_lines): a malformed line, a missing or
// mismatched field, chosen equal to rejected, a prompt that fills cut.max_length. Pairs whose
// whole did not start with the prompt's ids are counted (TRL warns about them).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/data/chat_template.h"
#include "engine/data/dataset.h"
#include "engine/data/pair_stream.h"
#include "engine/data/preference.h"
#include "engine/data/tokenizer.h"

namespace megatrain {

struct PreferenceSetOptions {
  std::string path;
  std::string field = "data.path";  // the spec's field naming `path`, for errors
  std::optional<ChatFormat> chat;   // conversational pairs need one
  ChatOptions chat_options;
  PreferenceCut cut;                // each sequence's cutting
  bool skip_bad_lines = false;
  int64_t max_line_bytes = kMaxLineBytes;
  int64_t max_lines = 0;  // read at most this many non-blank lines (0: the whole file)
};

struct PreferenceSet {
  std::shared_ptr<const std::vector<SequencePair>> pairs;
  // lines, examples (pairs), bad_lines, tokens (both sequences'), trained_tokens
  // (completion tokens), first_errors, seconds.
  DatasetStats stats;
  int64_t prefix_mismatches = 0;  // pairs whose whole did not start with the prompt's ids
  // FNV-1a over every pair's ids and completion masks: what a reference cache was
  // computed on (with the model's fingerprint).
  uint64_t fingerprint = 0;
};

// Errors: the file's (NotFound, a FIFO refused, a line too long, DataLoss), a bad line
// without skip_bad_lines ("path:line: problem"), and InvalidArgument when no pair is left.
[[nodiscard]] absl::StatusOr<PreferenceSet> LoadPreferenceSet(const PreferenceSetOptions& options,
                                                              const Tokenizer& tokenizer);

}  // namespace megatrain
