// A job's inputs: the tokenizer, dataset and packing settings its spec names, and the
// check that runs before a job is queued (the files exist, the first lines parse, the
// dataset is not empty). The trainer and the daemon's submit path share these, so both
// refuse the same inputs with the same words.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/data/dataset.h"
#include "engine/data/packer.h"
#include "engine/data/preference_set.h"
#include "engine/data/tokenizer.h"
#include "engine/job/spec.h"
#include "engine/model/config.h"

namespace megatrain {

// What data.tokenizer means for this spec: byte, model or a file. auto (the default) is
// model when the model folder holds a tokenizer.json, else byte.
TokenizerSource ResolvedTokenizer(const JobSpec& spec);

// The tokenizer data.tokenizer names; *dir is the folder whose tokenizer files
// checkpoints copy. Errors name data.tokenizer and the file.
[[nodiscard]] absl::StatusOr<std::unique_ptr<Tokenizer>> LoadJobTokenizer(const JobSpec& spec,
                                                                         std::string* dir);

// The dataset settings of the spec: format, chat template ("auto" reads the family from
// tokenizer_config.json in `tokenizer_dir`, with its bos / eos strings), bad-line policy.
// Pre-tokenized ids (data.format: tokens) are checked against `model_vocab_size`.
[[nodiscard]] absl::StatusOr<DatasetOptions> JobDatasetOptions(const JobSpec& spec,
                                                               const std::string& tokenizer_dir,
                                                               int64_t model_vocab_size);
// A DPO job's data settings (JobSpec::dpo): data.path's pairs through the data's chat
// template (resolved as for a chat format), each sequence cut to dpo.max_length
// (data.seq_len when 0), bad lines as data.on_bad_line says.
[[nodiscard]] absl::StatusOr<PreferenceSetOptions> JobPreferenceSetOptions(
    const JobSpec& spec, const std::string& tokenizer_dir, int64_t model_vocab_size);
// Where the job's tokenized dataset is cached (data.cache_dir or its default).
std::string JobDataCacheDir(const JobSpec& spec);
// Packing settings of the spec for this tokenizer (padding id: eos when the model has
// it, else 0).
PackOptions JobPackOptions(const JobSpec& spec, const Tokenizer& tokenizer,
                           int64_t model_vocab_size);

// CheckJobFolders and ValidateJobInputs, the checks before a job is queued: engine.h.

}  // namespace megatrain
