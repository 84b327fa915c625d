#include "engine/job/inputs.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/common/durable_file.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"
#include "engine/data/byte_tokenizer.h"
#include "engine/data/hf_tokenizer.h"
#include "engine/data/line_reader.h"
#include "engine/job/eval_set.h"
#include "engine/model/freeze.h"
#include "engine/model/lora.h"
#include "engine/model/layout.h"
#include "engine/model/safetensors.h"
#include "engine/store/model_io.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace fs = std::filesystem;
namespace {

// Whether something is there by this name. A dangling or looping symlink counts: reading
// it then says what is wrong with it, where fs::exists would throw or call it absent.
bool IsPresent(const fs::path& path) {
  std::error_code ec;
  return fs::symlink_status(path, ec).type() != fs::file_type::not_found && !ec;
}

}  // namespace

TokenizerSource ResolvedTokenizer(const JobSpec& spec) {
  if (spec.tokenizer != TokenizerSource::kAuto) return spec.tokenizer;
  std::error_code ec;
  if (!spec.model_path.empty() &&
      fs::is_regular_file(fs::path(spec.model_path) / "tokenizer.json", ec)) {
    return TokenizerSource::kModel;
  }
  return TokenizerSource::kByte;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadJobTokenizer(const JobSpec& spec, std::string* dir) {
  const TokenizerSource tokenizer = ResolvedTokenizer(spec);
  if (tokenizer == TokenizerSource::kByte) {
    *dir = spec.model_path;  // a model folder's own tokenizer files still travel along
    return std::unique_ptr<Tokenizer>(std::make_unique<ByteTokenizer>());
  }
  fs::path json = tokenizer == TokenizerSource::kModel ? fs::path(spec.model_path)
                                                      : fs::path(spec.tokenizer_path);
  if (json.extension() != ".json") json /= "tokenizer.json";
  const fs::path config = json.parent_path() / "tokenizer_config.json";
  *dir = json.parent_path().string();
  absl::StatusOr<std::unique_ptr<Tokenizer>> t =
      LoadHfTokenizer(json.string(), IsPresent(config) ? config.string() : "");
  if (!t.ok()) return Annotate(t.status(), "data.tokenizer");
  return t;
}

absl::StatusOr<DatasetOptions> JobDatasetOptions(const JobSpec& spec,
                                                 const std::string& tokenizer_dir,
                                                 int64_t model_vocab_size) {
  DatasetOptions o;
  o.path = spec.data_path;
  o.format = spec.data_format;
  o.text_field = spec.text_field;
  o.skip_bad_lines = spec.on_bad_line == OnBadLine::kSkip;
  o.threads = static_cast<int>(spec.tokenize_threads);
  if (o.format == DataFormat::kTokens) o.vocab_size = model_vocab_size;
  if (!IsChatFormat(o.format) || spec.chat_template == ChatTemplate::kPlain) return o;

  // tokenizer_config.json: the template's family and the bos / eos strings it prints.
  nlohmann::json config = nlohmann::json::object();
  const fs::path config_path = fs::path(tokenizer_dir) / "tokenizer_config.json";
  if (ResolvedTokenizer(spec) != TokenizerSource::kByte && IsPresent(config_path)) {
    absl::StatusOr<std::string> text = ReadWholeFile(config_path.string());
    if (!text.ok()) return Annotate(text.status(), "data.tokenizer");
    config = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (config.is_discarded() || !config.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat("data.tokenizer: ", config_path.string(), " is not a JSON object"));
    }
  }
  auto token_string = [&](const char* key) -> std::string {
    const auto it = config.find(key);
    if (it == config.end()) return "";
    if (it->is_string()) return it->get<std::string>();
    if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
      return (*it)["content"].get<std::string>();
    }
    return "";
  };
  o.chat_options.bos_token = token_string("bos_token");
  o.chat_options.eos_token = token_string("eos_token");
  o.chat_options.date_string = spec.chat_date;
  if (spec.chat_template != ChatTemplate::kAuto) {
    ASSIGN_OR_RETURN(ChatFormat f, ChatFormatFromName(SpecName(spec.chat_template)));
    o.chat = f;
    return o;
  }
  const auto it = config.find("chat_template");
  if (it == config.end() || !it->is_string()) return o;  // no template: the plain layout
  absl::StatusOr<ChatFormat> f = DetectChatFormat(it->get<std::string>());
  if (!f.ok()) {
    return Annotate(f.status(), absl::StrCat("data.chat_template: auto, but the chat_template of ",
                                             config_path.string(),
                                             " is none we know; name a family or 'plain'"));
  }
  o.chat = *f;
  return o;
}

std::string JobDataCacheDir(const JobSpec& spec) {
  if (!spec.data_cache_dir.empty()) return spec.data_cache_dir;
  if (!spec.checkpoint_dir.empty()) return (fs::path(spec.checkpoint_dir) / "data-cache").string();
  std::error_code ec;
  fs::path tmp = fs::temp_directory_path(ec);
  if (ec) tmp = "/tmp";
  return (tmp / absl::StrCat("megatrain-data-cache-", ::getuid())).string();
}

absl::StatusOr<PreferenceSetOptions> JobPreferenceSetOptions(const JobSpec& spec,
                                                             const std::string& tokenizer_dir,
                                                             int64_t model_vocab_size) {
  JobSpec chat_spec = spec;  // the chat template's resolution, as for a chat format
  chat_spec.data_format = DataFormat::kMessages;
  ASSIGN_OR_RETURN(const DatasetOptions data,
                   JobDatasetOptions(chat_spec, tokenizer_dir, model_vocab_size));
  PreferenceSetOptions o;
  o.path = spec.data_path;
  o.chat = data.chat;
  o.chat_options = data.chat_options;
  o.cut.max_length = spec.dpo.max_length > 0 ? spec.dpo.max_length : spec.seq_len;
  o.cut.max_prompt_length = spec.dpo.max_prompt_length;
  o.cut.max_completion_length = spec.dpo.max_completion_length;
  o.cut.truncation = spec.dpo.truncation == DpoTruncation::kKeepEnd
                         ? PreferenceTruncation::kKeepEnd
                         : PreferenceTruncation::kKeepStart;
  o.skip_bad_lines = spec.on_bad_line == OnBadLine::kSkip;
  return o;
}

PackOptions JobPackOptions(const JobSpec& spec, const Tokenizer& tokenizer,
                           int64_t model_vocab_size) {
  PackOptions p;
  p.mode = spec.packing == Packing::kPad ? PackOptions::Mode::kPad : PackOptions::Mode::kPack;
  const bool truncate =
      spec.truncation == Truncation::kTruncate ||
      (spec.truncation == Truncation::kAuto && IsChatFormat(spec.data_format));
  p.truncation = truncate ? PackOptions::Truncation::kTruncate : PackOptions::Truncation::kSplit;
  p.pad_id = tokenizer.eos_id() >= 0 && tokenizer.eos_id() < model_vocab_size ? tokenizer.eos_id()
                                                                              : 0;
  return p;
}

namespace {

// Lines of the dataset read through the tokenizer when a job is submitted.
constexpr int64_t kLinesCheckedAtSubmit = 64;

// The first lines of the data file `spec` names (data.path, or the eval set's through
// EvalDataSpec: `section` "data" or "eval" names the fields), through the job's format and
// tokenizer: a wrong format or field name fails here, naming the line, instead of when the
// job starts. When they are the whole file, it must hold something to train on.
absl::Status CheckFirstLines(const JobSpec& spec, const char* section, const Tokenizer& tokenizer,
                             const std::string& tokenizer_dir, int64_t vocab_size) {
  const std::string field = absl::StrCat(section, ".path");
  std::error_code ec;
  if (fs::is_directory(spec.data_path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", spec.data_path, " is a directory; expected a .jsonl file"));
  }
  ASSIGN_OR_RETURN(LineReader data, LineReader::Open(spec.data_path, field));
  ASSIGN_OR_RETURN(const DatasetOptions options,
                   JobDatasetOptions(spec, tokenizer_dir, vocab_size));
  DatasetStats stats;
  std::string line;
  int64_t line_number = 0;
  bool at_end = false;
  // The next line into `line`, false at the end of the file; errors: a failed read, or a
  // line over the bound.
  auto next = [&]() -> absl::StatusOr<bool> {
    ASSIGN_OR_RETURN(const bool more, data.Next(&line));
    at_end = !more;
    return more;
  };
  while (stats.lines < kLinesCheckedAtSubmit) {
    ASSIGN_OR_RETURN(const bool more, next());
    if (!more) break;
    ++line_number;
    if (IsBlankLine(line)) continue;
    ++stats.lines;
    absl::StatusOr<Example> example = ExampleFromLine(line, options, tokenizer);
    if (!example.ok()) {
      const std::string where = absl::StrCat(spec.data_path, ":", line_number, ": ",
                                             example.status().message());
      if (!options.skip_bad_lines) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ": ", where, " (", section, ".format is '",
                         SpecName(spec.data_format),
                         "'; set data.on_bad_line: skip to leave such lines out)"));
      }
      ++stats.bad_lines;
      if (stats.first_errors.empty()) stats.first_errors.push_back(where);
      continue;
    }
    ++stats.examples;
    stats.tokens += static_cast<int64_t>(example->ids.size());
    stats.trained_tokens +=
        example->trained.empty() ? static_cast<int64_t>(example->ids.size())
                                 : std::count(example->trained.begin(), example->trained.end(), 1);
  }
  // Blank lines to the end, or more examples: only a file read to its end is judged.
  while (stats.examples == 0 && !at_end) {
    ASSIGN_OR_RETURN(const bool more, next());
    if (more && !IsBlankLine(line)) return absl::OkStatus();
  }
  if (!at_end) return absl::OkStatus();
  return CheckDatasetTrainable(field, spec.data_path, stats);
}

}  // namespace

absl::Status CheckJobFolders(const JobSpec& spec) {
  const std::pair<const char*, const std::string*> folders[] = {
      {"checkpoint.dir", &spec.checkpoint_dir},
      {"data.cache_dir", &spec.data_cache_dir},
      {"optimizer.nvme_dir", &spec.nvme_dir}};
  for (const auto& [field, path] : folders) {
    std::error_code ec;
    if (path->empty() || !fs::exists(*path, ec) || fs::is_directory(*path, ec)) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", Printable(*path), " is a file, not a folder (a missing one is created)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateJobInputs(const JobSpec& spec) {
  RETURN_IF_ERROR(CheckJobFolders(spec));
  ASSIGN_OR_RETURN(const ModelConfig config, ResolveModelConfig(spec));
  // Every tensor config.json implies, with its shape (headers only): a folder that does
  // not match is refused now, not after the job has waited for its turn. A DPO job's
  // reference model holds the same tensors as the model.
  for (const auto& [field, path] : {std::pair{"model.path", &spec.model_path},
                                    std::pair{"dpo.reference", &spec.dpo.reference}}) {
    if (path->empty()) continue;
    absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(*path);
    if (!reader.ok()) return Annotate(reader.status(), field);
    absl::Status tensors = CheckModelTensors(*reader, BuildLayout(config));
    if (!tensors.ok()) return Annotate(tensors, field);
  }
  // A generate or eval job's prompts are read whole when it is planned.
  if (spec.kind != JobKind::kTrain) return absl::OkStatus();
  RETURN_IF_ERROR(TrainingLayout(config, spec.lora, spec.freeze).status());
  if (!spec.lora_adapter.empty()) {  // its config, from the folder's own file
    absl::StatusOr<LoraConfig> adapter = ReadPeftAdapterConfig(spec.lora_adapter);
    if (!adapter.ok()) return Annotate(adapter.status(), "lora.adapter");
    if (adapter->rank != spec.lora.rank) {
      return absl::InvalidArgumentError(absl::StrCat("lora.adapter ", spec.lora_adapter,
                                                     " has r ", adapter->rank,
                                                     "; lora.rank is ", spec.lora.rank));
    }
  }
  std::string tokenizer_dir;
  ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, LoadJobTokenizer(spec, &tokenizer_dir));
  if (spec.dpo.enabled) {  // the first pairs, as the job will read them
    ASSIGN_OR_RETURN(PreferenceSetOptions pairs,
                     JobPreferenceSetOptions(spec, tokenizer_dir, config.vocab_size));
    pairs.max_lines = kLinesCheckedAtSubmit;
    return LoadPreferenceSet(pairs, *tokenizer).status();
  }
  RETURN_IF_ERROR(CheckFirstLines(spec, "data", *tokenizer, tokenizer_dir, config.vocab_size));
  if (spec.eval.path.empty()) return absl::OkStatus();
  return CheckFirstLines(EvalDataSpec(spec), "eval", *tokenizer, tokenizer_dir,
                         config.vocab_size);
}

}  // namespace megatrain
