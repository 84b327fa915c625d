// Datasets: JSONL files of text, instruction or chat examples, or pre-tokenized ids,
// streamed from disk, tokenized in parallel into a token store (token_docs.h) that the
// packer then reads through a memory map. The whole dataset is never held in memory.
//
// Formats, one JSON object per line (blank lines are skipped):
//   text      {"<text_field>": "..."}                       -> [bos] text [eos], all trained
//   alpaca    {"instruction", "input" (optional), "output"} -> user / assistant turns
//   sharegpt  {"conversations": [{"from": "system|human|user|gpt|assistant", "value"}]}
//   messages  {"messages": [{"role": "system|user|assistant", "content"}]}
//   tokens    {"input_ids": [ids], "labels": [ids or -100] (optional)}: ids as given,
//             each below the model's vocab_size (no tokenizer is used); a token is
//             trained where its label is not -100 (all when no labels)
// Chat formats (alpaca, sharegpt, messages) render through the chat template: the model's
// family (chat_template.h) or, with none, a plain "User: ...\n\nAssistant: ...<eos>"
// layout. Only assistant turns, and the tokens that end them, are trained.
//
// A malformed line (not JSON, a missing or mistyped field, an unknown role, an id out of
// the vocabulary) fails the whole build naming "path:line", or with skip_bad_lines is
// counted, the first few reported, and left out.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/data/chat_template.h"
#include "engine/data/line_reader.h"
#include "engine/data/token_docs.h"
#include "engine/engine.h"  // DataFormat
#include "engine/data/tokenizer.h"
#include "nlohmann/json.hpp"

namespace megatrain {

// DataFormat (engine.h) by name: "text" | "alpaca" | "sharegpt" | "messages" | "tokens"
// (SpecName; ParseSpecName reads them back).
const char* DataFormatName(DataFormat format);
bool IsChatFormat(DataFormat format);

struct DatasetOptions {
  std::string path;
  std::string field = "data.path";          // the spec's field naming `path`, for errors
  DataFormat format = DataFormat::kText;
  std::string text_field = "text";          // kText
  std::optional<ChatFormat> chat;           // chat formats; nullopt = the plain layout
  ChatOptions chat_options;                 // bos/eos strings, gpt-oss date ...
  bool skip_bad_lines = false;
  int threads = 0;                          // tokenizing threads; 0 = one per core
  // kTokens: ids must lie in [0, vocab_size), the model's vocabulary (0 = the tokenizer's).
  int64_t vocab_size = 0;
  // A longer line is refused (line_reader.h): one example is held whole.
  int64_t max_line_bytes = kMaxLineBytes;
};

struct DatasetStats {
  int64_t lines = 0;           // non-blank lines read
  int64_t examples = 0;        // documents written
  int64_t bad_lines = 0;       // malformed lines left out (skip_bad_lines)
  int64_t tokens = 0;
  int64_t trained_tokens = 0;  // tokens that are targets of the loss
  std::vector<std::string> first_errors;  // up to 5 "path:line: problem"
  double seconds = 0;
  bool reused = false;         // an existing token store was opened, nothing tokenized
  nlohmann::json ToJson() const;
  // One line for logs: "dataset: 2 examples, 40 tokens (8 trained); 1 malformed line
  // skipped, first: d.jsonl:3: not valid JSON ...; tokenized in 0.01 s".
  std::string Summary() const;
};

// InvalidArgument "<field>: <path> holds no examples to train on (...)" when `stats` (of
// the whole file) found no example or no token, or "... no token of any example is
// trained" when every label is masked; OK otherwise. `field`: the spec's ("data.path").
[[nodiscard]] absl::Status CheckDatasetTrainable(absl::string_view field, const std::string& path,
                                                 const DatasetStats& stats);

// A JSON array of {"role": "system|user|assistant", "content"} objects; errors name
// "<field>[i]" and what is wrong with it.
[[nodiscard]] absl::StatusOr<std::vector<ChatMessage>> MessagesFromJson(
    const nlohmann::json& turns, absl::string_view field);

// A line of only spaces, tabs and CRs: skipped, not an example.
bool IsBlankLine(absl::string_view line);

// One line's example; errors name the problem but not the line (the caller adds it).
[[nodiscard]] absl::StatusOr<Example> ExampleFromLine(absl::string_view line,
                                                      const DatasetOptions& options,
                                                      const Tokenizer& tokenizer);

// Tokenizes the file into a new token store at `dir` (replacing any there), streaming:
// one reader, `threads` tokenizers, one writer, a bounded number of chunks in flight.
// Errors: NotFound (no file), InvalidArgument "path:line: ..." (a bad line without
// skip_bad_lines, a line over max_line_bytes, no example at all, or a path that is not a
// regular file: a FIFO or a device is refused without blocking), DataLoss (a read failed
// part-way).
[[nodiscard]] absl::StatusOr<DatasetStats> BuildTokenStore(const DatasetOptions& options,
                                             const Tokenizer& tokenizer, const std::string& dir,
                                             const nlohmann::json& source);

// What a token store built from `options` and `tokenizer` is keyed by: the file's path,
// size and modification time, the format and its settings, and the tokenizer's identity.
nlohmann::json DatasetSource(const DatasetOptions& options, const Tokenizer& tokenizer);

// Opens the token store for this dataset under `cache_dir` when one was built from the
// same source, else builds it there first. `stats` (optional) says which happened.
[[nodiscard]] absl::StatusOr<std::shared_ptr<const TokenDocs>> OpenOrBuildTokenStore(
    const DatasetOptions& options, const Tokenizer& tokenizer, const std::string& cache_dir,
    DatasetStats* stats = nullptr);

// [bos] Encode(text) [eos] with bos / eos left out where the tokenizer has none.
// Errors: the tokenizer's (Tokenizer::Encode).
[[nodiscard]] absl::StatusOr<Example> TextExample(absl::string_view text,
                                                  const Tokenizer& tokenizer);
// The ids of `text` and, per token, whether it lies in one of the byte ranges `trained`
// (a token is trained when it begins at or after a range's start and ends by its end,
// measured on the tokenization of the text's prefixes).
[[nodiscard]] absl::StatusOr<Example> EncodeWithTrainedSpans(
    const std::string& text, const std::vector<std::pair<size_t, size_t>>& trained,
    const Tokenizer& tokenizer);

}  // namespace megatrain
