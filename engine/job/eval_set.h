// A training job's evaluation set (the spec's eval section): the held-out file tokenized,
// templated and loss-masked as the job's data is, then packed once, in a fixed order, into
// micro-batches of the plan's shape. The same micro-batches are evaluated every time, so
// successive evaluation losses compare like with like.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/data/dataset.h"
#include "engine/data/micro_batch.h"
#include "engine/data/packer.h"
#include "engine/data/token_docs.h"
#include "engine/data/tokenizer.h"
#include "engine/engine.h"

namespace megatrain {

// The spec whose data is its eval set (eval.path in eval.format), so that the data's
// settings (chat template, truncation by format, cache) apply to it as they would.
JobSpec EvalDataSpec(const JobSpec& spec);

// The eval set's documents, tokenized (or reused from the job's data cache) with
// `tokenizer`; `*stats` says what it found. InvalidArgument naming eval.path when the file
// holds no token with a target (nothing to measure a loss on), and the dataset's errors
// (a missing file, a bad line) named likewise.
[[nodiscard]] absl::StatusOr<std::shared_ptr<const TokenDocs>> LoadEvalDocs(
    const JobSpec& spec, const Tokenizer& tokenizer, const std::string& tokenizer_dir,
    int64_t model_vocab_size, DatasetStats* stats);

// The eval set's micro-batches of `rows` sequences of seq_len: its documents packed once
// in the order data.seed gives (rows after the last document are padding), at most
// eval.max_rows sequences (0: all); rows of the last micro-batch past max_rows have no
// targets. `pack`: the data's packing (JobPackOptions of EvalDataSpec).
std::vector<MicroBatch> PackEvalSet(std::shared_ptr<const TokenDocs> docs, const JobSpec& spec,
                                    PackOptions pack, int64_t rows);

// Whether the job evaluates after `step` steps: before the first step (0), every
// eval.every_steps, and after the last. False without an eval set.
bool EvaluatesAfter(const JobSpec& spec, int64_t step);

}  // namespace megatrain
