#include "engine/job/eval_set.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/common/status.h"
#include "engine/job/inputs.h"

namespace megatrain {

JobSpec EvalDataSpec(const JobSpec& spec) {
  JobSpec eval = spec;
  eval.data_path = spec.eval.path;
  eval.data_format = spec.eval.format;
  return eval;
}

absl::StatusOr<std::shared_ptr<const TokenDocs>> LoadEvalDocs(const JobSpec& spec,
                                                              const Tokenizer& tokenizer,
                                                              const std::string& tokenizer_dir,
                                                              int64_t model_vocab_size,
                                                              DatasetStats* stats) {
  const JobSpec eval = EvalDataSpec(spec);
  ASSIGN_OR_RETURN(DatasetOptions options,
                   JobDatasetOptions(eval, tokenizer_dir, model_vocab_size));
  options.field = "eval.path";
  absl::StatusOr<std::shared_ptr<const TokenDocs>> docs =
      OpenOrBuildTokenStore(options, tokenizer, JobDataCacheDir(spec), stats);
  if (!docs.ok() && !absl::StartsWith(docs.status().message(), options.field)) {
    return Annotate(docs.status(), options.field);
  }
  if (!docs.ok()) return docs.status();
  if (stats->trained_tokens == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "eval.path: ", spec.eval.path, " gives no token to evaluate (", stats->examples,
        " examples, ", stats->tokens, " tokens, none of them a target of the loss)"));
  }
  return docs;
}

std::vector<MicroBatch> PackEvalSet(std::shared_ptr<const TokenDocs> docs, const JobSpec& spec,
                                    PackOptions pack, int64_t rows) {
  pack.single_pass = true;
  Packer packer(std::move(docs), spec.seq_len, spec.data_seed, pack);
  std::vector<MicroBatch> batches;
  int64_t taken = 0;  // rows
  while (!packer.exhausted() && (spec.eval.max_rows == 0 || taken < spec.eval.max_rows)) {
    MicroBatch& b = batches.emplace_back();
    packer.Next(rows, &b);
    const int64_t keep = spec.eval.max_rows == 0 ? rows : std::min(rows, spec.eval.max_rows - taken);
    std::fill(b.targets.begin() + keep * spec.seq_len, b.targets.end(), kIgnoreIndex);
    taken += rows;
  }
  // A last micro-batch the packer filled with padding alone measures nothing.
  if (!batches.empty() && batches.back().num_targets() == 0) batches.pop_back();
  return batches;
}

bool EvaluatesAfter(const JobSpec& spec, int64_t step) {
  if (spec.eval.path.empty()) return false;
  if (step == 0 || step == spec.steps) return true;
  return spec.eval.every_steps > 0 && step % spec.eval.every_steps == 0;
}

}  // namespace megatrain
