#include "engine/job/spec.h"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/common/check.h"
#include "engine/common/durable_file.h"
#include "engine/common/device_name.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"
#include "engine/data/bpe_text.h"
#include "engine/data/dataset.h"
#include "engine/model/lora.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/yaml.h"

namespace megatrain {
namespace fs = std::filesystem;
namespace {

// Reads typed fields out of one YAML mapping, remembering which keys were consumed.
class Section {
 public:
  Section(const YAML::Node& node, std::string path) : node_(node), path_(std::move(path)) {}

  std::string Name(const std::string& key) const {
    return path_.empty() ? key : absl::StrCat(path_, ".", key);
  }
  bool Has(const std::string& key) {
    seen_.insert(key);
    return node_[key].IsDefined() && !node_[key].IsNull();
  }
  YAML::Node Get(const std::string& key) { return node_[key]; }

  absl::Status String(const std::string& key, std::string* out) {
    if (!Has(key)) return absl::OkStatus();
    const YAML::Node& n = node_[key];
    if (!n.IsScalar()) return Error(key, "must be a string");
    *out = n.Scalar();
    return absl::OkStatus();
  }
  // A string or a list of strings.
  absl::Status Strings(const std::string& key, std::vector<std::string>* out) {
    if (!Has(key)) return absl::OkStatus();
    const YAML::Node& n = node_[key];
    if (n.IsScalar()) {
      out->assign(1, n.Scalar());
      return absl::OkStatus();
    }
    if (!n.IsSequence()) return Error(key, "must be a string or a list of strings");
    out->clear();
    for (const YAML::Node& e : n) {
      if (!e.IsScalar()) return Error(key, "must be a string or a list of strings");
      out->push_back(e.Scalar());
    }
    return absl::OkStatus();
  }
  // Types only: the ranges are ValidateJobSpec's.
  absl::Status Int(const std::string& key, int64_t* out) {
    if (!Has(key)) return absl::OkStatus();
    const YAML::Node& n = node_[key];
    int64_t v = 0;
    if (!n.IsScalar() || !YAML::convert<int64_t>::decode(n, v)) {
      return Error(key, absl::StrCat("must be an integer, got '", Text(n), "'"));
    }
    *out = v;
    return absl::OkStatus();
  }
  template <typename E>
  absl::Status Enum(const std::string& key, E* out) {
    std::string name;
    RETURN_IF_ERROR(String(key, &name));
    if (name.empty() && !Has(key)) return absl::OkStatus();
    ASSIGN_OR_RETURN(*out, ParseSpecName<E>(Name(key), name));
    return absl::OkStatus();
  }
  absl::Status Bool(const std::string& key, bool* out) {
    if (!Has(key)) return absl::OkStatus();
    const YAML::Node& n = node_[key];
    bool v = false;
    if (!n.IsScalar() || !YAML::convert<bool>::decode(n, v)) {
      return Error(key, absl::StrCat("must be true or false, got '", Text(n), "'"));
    }
    *out = v;
    return absl::OkStatus();
  }
  absl::Status Uint(const std::string& key, uint64_t* out) {
    int64_t v = static_cast<int64_t>(*out);
    RETURN_IF_ERROR(Int(key, &v));
    if (v < 0) return Error(key, absl::StrCat("must be >= 0, got ", v));
    *out = static_cast<uint64_t>(v);
    return absl::OkStatus();
  }
  absl::Status Double(const std::string& key, double* out) {
    if (!Has(key)) return absl::OkStatus();
    const YAML::Node& n = node_[key];
    double v = 0;
    if (!n.IsScalar() || !YAML::convert<double>::decode(n, v)) {
      return Error(key, absl::StrCat("must be a number, got '", Text(n), "'"));
    }
    *out = v;
    return absl::OkStatus();
  }
  // Unknown keys are errors: a typo must never silently fall back to a default.
  absl::Status CheckNoUnknown() const {
    for (const auto& kv : node_) {
      const std::string key = kv.first.Scalar();
      if (seen_.count(key) == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "unknown field '", Name(key), "' (known here: ", absl::StrJoin(seen_, ", "), ")"));
      }
    }
    return absl::OkStatus();
  }
  absl::Status Error(const std::string& key, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(Name(key), " ", what));
  }

 private:
  static std::string Text(const YAML::Node& n) {
    if (n.IsScalar()) return n.Scalar();
    std::stringstream ss;
    ss << n;
    return ss.str();
  }
  YAML::Node node_;
  std::string path_;
  std::set<std::string> seen_;
};

constexpr size_t kMaxConfigKeyBytes = 256;
constexpr char kModelSources[] =
    "model needs exactly one of model.path (a Hugging Face folder), model.config (inline "
    "config.json fields) or model.config_path (a config.json for random init)";
constexpr size_t kMaxJobNameBytes = 256;

// YAML -> JSON for an inline config.json; scalars keep their natural JSON type.
nlohmann::json ToJson(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Map: {
      nlohmann::json j = nlohmann::json::object();
      for (const auto& kv : n) {
        // config.json keys are short names; YAML cannot write a key past 1024 characters
        // as an implicit key, so a longer one could not be stored and read back.
        if (kv.first.Scalar().size() > kMaxConfigKeyBytes) {
          throw YAML::Exception(kv.first.Mark(), absl::StrCat("model.config has a key of ",
                                                             kv.first.Scalar().size(),
                                                             " bytes; keys are at most ",
                                                             kMaxConfigKeyBytes));
        }
        j[kv.first.Scalar()] = ToJson(kv.second);
      }
      return j;
    }
    case YAML::NodeType::Sequence: {
      nlohmann::json j = nlohmann::json::array();
      for (const auto& e : n) j.push_back(ToJson(e));
      return j;
    }
    case YAML::NodeType::Scalar: {
      const std::string& s = n.Scalar();
      if (n.Tag() == "!") return s;  // quoted
      int64_t i;
      double d;
      bool b;
      if (YAML::convert<int64_t>::decode(n, i)) return i;
      if (YAML::convert<double>::decode(n, d)) return d;
      if (YAML::convert<bool>::decode(n, b)) return b;
      if (s == "null" || s == "~") return nullptr;
      return s;
    }
    default:
      return nullptr;
  }
}

absl::Status ParseModel(Section& top, const std::string& base_dir, JobSpec* spec) {
  if (!top.Has("model")) return absl::InvalidArgumentError("field 'model' is required");
  Section model(top.Get("model"), "model");
  if (!top.Get("model").IsMap()) return top.Error("model", "must be a mapping");
  RETURN_IF_ERROR(model.String("path", &spec->model_path));
  std::string config_path;
  RETURN_IF_ERROR(model.String("config_path", &config_path));
  if (model.Has("config")) {
    if (!model.Get("config").IsMap()) return model.Error("config", "must be a mapping of config.json fields");
    spec->model_config_json = ToJson(model.Get("config")).dump();
  }
  RETURN_IF_ERROR(model.Uint("init_seed", &spec->init_seed));
  RETURN_IF_ERROR(model.CheckNoUnknown());
  const int sources = !spec->model_path.empty() + !config_path.empty() + !spec->model_config_json.empty();
  if (sources != 1) return absl::InvalidArgumentError(kModelSources);
  spec->model_path = ResolveSpecPath(base_dir, spec->model_path);
  if (!config_path.empty()) {
    // A FIFO or a device is refused without blocking; a missing file is NotFound.
    absl::StatusOr<std::string> text = ReadWholeFile(ResolveSpecPath(base_dir, config_path));
    if (!text.ok()) return Annotate(text.status(), "model.config_path");
    spec->model_config_json = *std::move(text);
  }
  return absl::OkStatus();
}

absl::Status ParseData(Section& top, const std::string& base_dir, JobSpec* spec) {
  if (!top.Has("data")) return absl::InvalidArgumentError("field 'data' is required");
  if (!top.Get("data").IsMap()) return top.Error("data", "must be a mapping");
  Section data(top.Get("data"), "data");
  RETURN_IF_ERROR(data.String("path", &spec->data_path));
  spec->data_path = ResolveSpecPath(base_dir, spec->data_path);
  RETURN_IF_ERROR(data.Enum("format", &spec->data_format));
  RETURN_IF_ERROR(data.String("text_field", &spec->text_field));
  RETURN_IF_ERROR(data.Enum("chat_template", &spec->chat_template));
  RETURN_IF_ERROR(data.String("chat_date", &spec->chat_date));
  RETURN_IF_ERROR(data.Enum("packing", &spec->packing));
  RETURN_IF_ERROR(data.Enum("truncation", &spec->truncation));
  RETURN_IF_ERROR(data.Enum("on_bad_line", &spec->on_bad_line));
  RETURN_IF_ERROR(data.String("cache_dir", &spec->data_cache_dir));
  spec->data_cache_dir = ResolveSpecPath(base_dir, spec->data_cache_dir);
  RETURN_IF_ERROR(data.Int("tokenize_threads", &spec->tokenize_threads));
  if (data.Has("tokenizer")) {
    std::string tokenizer;
    RETURN_IF_ERROR(data.String("tokenizer", &tokenizer));
    RETURN_IF_ERROR(SetSpecTokenizer(tokenizer, base_dir, spec));
  }
  RETURN_IF_ERROR(data.Int("seq_len", &spec->seq_len));
  RETURN_IF_ERROR(data.Uint("seed", &spec->data_seed));
  return data.CheckNoUnknown();
}

// After ParseData: the eval set's format defaults to the data's.
absl::Status ParseEval(Section& top, const std::string& base_dir, JobSpec* spec) {
  spec->eval.format = spec->data_format;
  if (!top.Has("eval")) return absl::OkStatus();
  if (!top.Get("eval").IsMap()) return top.Error("eval", "must be a mapping");
  Section e(top.Get("eval"), "eval");
  RETURN_IF_ERROR(e.String("path", &spec->eval.path));
  spec->eval.path = ResolveSpecPath(base_dir, spec->eval.path);
  RETURN_IF_ERROR(e.Enum("format", &spec->eval.format));
  RETURN_IF_ERROR(e.Int("every_steps", &spec->eval.every_steps));
  RETURN_IF_ERROR(e.Int("max_rows", &spec->eval.max_rows));
  return e.CheckNoUnknown();
}

// Kinds generate and eval: the prompts, the output and the sampling.
absl::Status ParseGenerate(Section& top, const std::string& base_dir, JobSpec* spec) {
  if (!top.Has("generate")) {
    return absl::InvalidArgumentError(absl::StrCat("a job of kind ", SpecName(spec->kind),
                                                   " needs a 'generate' section (its prompts)"));
  }
  if (!top.Get("generate").IsMap()) return top.Error("generate", "must be a mapping");
  for (const char* training_only : {"data", "eval", "train", "optimizer", "lora", "dpo"}) {
    if (top.Has(training_only)) {
      return absl::InvalidArgumentError(absl::StrCat("a job of kind ", SpecName(spec->kind),
                                                     " has no '", training_only,
                                                     "' section (only training jobs do)"));
    }
  }
  GenerateSpec& g = spec->generate;
  Section s(top.Get("generate"), "generate");
  RETURN_IF_ERROR(s.String("prompts", &g.prompts_path));
  g.prompts_path = ResolveSpecPath(base_dir, g.prompts_path);
  RETURN_IF_ERROR(s.Strings("prompt", &g.prompts));
  RETURN_IF_ERROR(s.String("output", &g.output_path));
  g.output_path = ResolveSpecPath(base_dir, g.output_path);
  RETURN_IF_ERROR(s.Int("max_new_tokens", &g.max_new_tokens));
  RETURN_IF_ERROR(s.Double("temperature", &g.temperature));
  RETURN_IF_ERROR(s.Int("top_k", &g.top_k));
  RETURN_IF_ERROR(s.Double("top_p", &g.top_p));
  RETURN_IF_ERROR(s.Uint("seed", &g.seed));
  RETURN_IF_ERROR(s.Strings("stop", &g.stop_strings));
  std::vector<std::string> stop_ids;
  RETURN_IF_ERROR(s.Strings("stop_ids", &stop_ids));
  g.stop_ids.clear();
  for (const std::string& id : stop_ids) {
    int32_t v = 0;
    if (!absl::SimpleAtoi(id, &v) || v < 0) {
      return s.Error("stop_ids", absl::StrCat("must be token ids (integers >= 0), got '", id, "'"));
    }
    g.stop_ids.push_back(v);
  }
  RETURN_IF_ERROR(s.Bool("ignore_eos", &g.ignore_eos));
  RETURN_IF_ERROR(s.Bool("chat", &g.chat));
  RETURN_IF_ERROR(s.String("tokenizer", &g.tokenizer));
  g.tokenizer = ResolveTokenizerText(base_dir, g.tokenizer);
  RETURN_IF_ERROR(s.Int("max_sequences", &g.max_sequences));
  RETURN_IF_ERROR(s.String("answer_pattern", &g.answer_pattern));
  return s.CheckNoUnknown();
}

absl::Status ParseTrain(Section& top, JobSpec* spec) {
  if (top.Has("train")) {
    if (!top.Get("train").IsMap()) return top.Error("train", "must be a mapping");
    Section t(top.Get("train"), "train");
    RETURN_IF_ERROR(t.Int("steps", &spec->steps));
    RETURN_IF_ERROR(t.Int("tokens_per_step", &spec->tokens_per_step));
    RETURN_IF_ERROR(t.Int("micro_batch_rows", &spec->micro_batch_rows));
    RETURN_IF_ERROR(t.Int("micro_batches", &spec->micro_batches));
    RETURN_IF_ERROR(t.Int("devices", &spec->devices));
    RETURN_IF_ERROR(t.Enum("gradient_reduce", &spec->gradient_reduce));
    RETURN_IF_ERROR(t.Double("lr", &spec->schedule.lr));
    RETURN_IF_ERROR(t.Enum("schedule", &spec->schedule.type));
    RETURN_IF_ERROR(t.Int("warmup_steps", &spec->schedule.warmup_steps));
    RETURN_IF_ERROR(t.Double("min_lr_ratio", &spec->schedule.min_lr_ratio));
    RETURN_IF_ERROR(t.Double("weight_decay", &spec->weight_decay));
    RETURN_IF_ERROR(t.Double("beta1", &spec->beta1));
    RETURN_IF_ERROR(t.Double("beta2", &spec->beta2));
    RETURN_IF_ERROR(t.Double("eps", &spec->eps));
    RETURN_IF_ERROR(t.Double("max_grad_norm", &spec->max_grad_norm));
    RETURN_IF_ERROR(t.Int("activation_checkpoint_every", &spec->activation_checkpoint_every));
    RETURN_IF_ERROR(t.Enum("activation_checkpoints", &spec->activation_checkpoints));
    RETURN_IF_ERROR(t.Int("loss_chunk_tokens", &spec->loss_chunk_tokens));
    RETURN_IF_ERROR(t.Double("router_aux_loss_coef", &spec->router_aux_loss_coef));
    RETURN_IF_ERROR(t.Strings("freeze", &spec->freeze));
    RETURN_IF_ERROR(t.CheckNoUnknown());
  }
  spec->schedule.total_steps = spec->steps;
  return absl::OkStatus();
}

absl::Status ParseOptimizer(Section& top, const std::string& base_dir, JobSpec* spec) {
  if (!top.Has("optimizer")) return absl::OkStatus();
  if (!top.Get("optimizer").IsMap()) return top.Error("optimizer", "must be a mapping");
  Section o(top.Get("optimizer"), "optimizer");
  RETURN_IF_ERROR(o.Enum("state_dtype", &spec->state_dtype));
  RETURN_IF_ERROR(o.Enum("bf16_copy", &spec->bf16_copy));
  RETURN_IF_ERROR(o.Enum("clip_store", &spec->clip_store));
  RETURN_IF_ERROR(o.String("nvme_dir", &spec->nvme_dir));
  spec->nvme_dir = ResolveSpecPath(base_dir, spec->nvme_dir);
  RETURN_IF_ERROR(o.Int("nvme_layers", &spec->nvme_layers));
  return o.CheckNoUnknown();
}

// A training job's adapters: PEFT's LoraConfig fields, alpha 2 * rank unless given, every
// projection unless target_modules names some.
absl::Status ParseLora(Section& top, const std::string& base_dir, JobSpec* spec) {
  if (!top.Has("lora")) return absl::OkStatus();
  if (!top.Get("lora").IsMap()) return top.Error("lora", "must be a mapping");
  Section l(top.Get("lora"), "lora");
  LoraConfig& lora = spec->lora;
  if (!l.Has("rank")) {
    return absl::InvalidArgumentError("lora.rank is required: the adapters' rank r (e.g. 16)");
  }
  RETURN_IF_ERROR(l.Int("rank", &lora.rank));
  if (lora.rank <= 0) return l.Error("rank", absl::StrCat("must be positive, got ", lora.rank));
  lora.alpha = 2.0 * static_cast<double>(lora.rank);
  RETURN_IF_ERROR(l.Double("alpha", &lora.alpha));
  RETURN_IF_ERROR(l.Bool("rslora", &lora.rslora));
  RETURN_IF_ERROR(l.Strings("target_modules", &lora.target_modules));
  if (lora.target_modules == std::vector<std::string>{"all-linear"}) lora.target_modules.clear();
  RETURN_IF_ERROR(l.Enum("init", &lora.init));
  double dropout = 0;
  RETURN_IF_ERROR(l.Double("dropout", &dropout));
  if (dropout != 0) {
    return l.Error("dropout", absl::StrFormat("is %.10g; only 0 is supported: adapters train "
                                              "without dropout",
                                              dropout));
  }
  RETURN_IF_ERROR(l.String("adapter", &spec->lora_adapter));
  spec->lora_adapter = ResolveSpecPath(base_dir, spec->lora_adapter);
  return l.CheckNoUnknown();
}

// A preference job: the section's presence makes one (every field has a default).
absl::Status ParseDpo(Section& top, const std::string& base_dir, JobSpec* spec) {
  if (!top.Has("dpo")) return absl::OkStatus();
  if (!top.Get("dpo").IsMap()) return top.Error("dpo", "must be a mapping");
  Section d(top.Get("dpo"), "dpo");
  JobSpec::Dpo& dpo = spec->dpo;
  dpo.enabled = true;
  RETURN_IF_ERROR(d.Double("beta", &dpo.beta));
  RETURN_IF_ERROR(d.Enum("loss", &dpo.loss));
  RETURN_IF_ERROR(d.Double("label_smoothing", &dpo.label_smoothing));
  RETURN_IF_ERROR(d.Double("rpo_alpha", &dpo.rpo_alpha));
  RETURN_IF_ERROR(d.Bool("reference_free", &dpo.reference_free));
  RETURN_IF_ERROR(d.Int("max_length", &dpo.max_length));
  RETURN_IF_ERROR(d.Enum("truncation", &dpo.truncation));
  RETURN_IF_ERROR(d.Int("max_prompt_length", &dpo.max_prompt_length));
  RETURN_IF_ERROR(d.Int("max_completion_length", &dpo.max_completion_length));
  RETURN_IF_ERROR(d.String("reference", &dpo.reference));
  dpo.reference = ResolveSpecPath(base_dir, dpo.reference);
  return d.CheckNoUnknown();
}

absl::Status ParseCheckpoint(Section& top, const std::string& base_dir, JobSpec* spec) {
  if (top.Has("checkpoint")) {
    if (!top.Get("checkpoint").IsMap()) return top.Error("checkpoint", "must be a mapping");
    Section c(top.Get("checkpoint"), "checkpoint");
    RETURN_IF_ERROR(c.String("dir", &spec->checkpoint_dir));
    spec->checkpoint_dir = ResolveSpecPath(base_dir, spec->checkpoint_dir);
    RETURN_IF_ERROR(c.Int("every_steps", &spec->checkpoint_every_steps));
    RETURN_IF_ERROR(c.Int("keep_last", &spec->keep_last));
    RETURN_IF_ERROR(c.Int("max_shard_bytes", &spec->max_shard_bytes));
    RETURN_IF_ERROR(c.Bool("background", &spec->checkpoint_background));
    RETURN_IF_ERROR(c.CheckNoUnknown());
  }
  return absl::OkStatus();
}

// The batch's shape: tokens per step, micro-batches and devices that divide it.
absl::Status CheckBatchShape(const JobSpec& spec) {
  // In 128 bits: each factor may be up to 2^63 on its own.
  const __int128 split = static_cast<__int128>(std::max<int64_t>(1, spec.micro_batches)) *
                         std::max<int64_t>(1, spec.micro_batch_rows) * spec.seq_len;
  if (split >= (__int128{1} << 31) || spec.tokens_per_step >= (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(
        "train: tokens per step (tokens_per_step, or micro_batches * micro_batch_rows * "
        "data.seq_len) must be < 2^31");
  }
  if (spec.tokens_per_step > 0 && spec.tokens_per_step % spec.seq_len != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.tokens_per_step (", spec.tokens_per_step, ") must be a multiple of data.seq_len (",
        spec.seq_len, "): a step is whole sequences"));
  }
  const int64_t rows = spec.rows_per_step();
  if (spec.micro_batch_rows > 0 && rows % spec.micro_batch_rows != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.micro_batch_rows (", spec.micro_batch_rows, ") must divide the ", rows,
        " sequences of a step (train.tokens_per_step / data.seq_len)"));
  }
  if (spec.micro_batch_rows > 0 && spec.micro_batches > 0 &&
      spec.micro_batch_rows * spec.micro_batches != rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "train: micro_batch_rows * micro_batches (", spec.micro_batch_rows, " * ",
        spec.micro_batches, ") must equal the ", rows,
        " sequences of train.tokens_per_step; give tokens_per_step alone and let the planner "
        "split it"));
  }
  if (spec.micro_batches > 0 && rows % spec.micro_batches != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.micro_batches (", spec.micro_batches, ") must divide the ", rows,
        " sequences of a step"));
  }
  if (spec.devices > 1) {
    const int64_t rows_per_batch = spec.micro_batch_rows > 0 ? spec.micro_batch_rows
                                   : spec.micro_batches > 0  ? rows / spec.micro_batches
                                                              : 1;
    if ((rows / rows_per_batch) % spec.devices != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "train.devices (", spec.devices, ") must divide the step's ", rows / rows_per_batch,
          " micro-batches of ", rows_per_batch, " sequence(s): each device takes an equal share"));
    }
  }
  return absl::OkStatus();
}

// A job's name is shown in listings, logs and file names: short, and one printable line.
absl::Status CheckJobName(const std::string& name) {
  if (name.size() > kMaxJobNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("name is ", name.size(),
                                                   " bytes long; a job name is at most ",
                                                   kMaxJobNameBytes));
  }
  for (size_t i = 0; i < name.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    // C0 controls, DEL, and the C1 controls U+0080..U+009F (UTF-8 0xC2 0x80..0x9F).
    const bool c1 = c == 0xC2 && i + 1 < name.size() &&
                    static_cast<unsigned char>(name[i + 1]) >= 0x80 &&
                    static_cast<unsigned char>(name[i + 1]) <= 0x9F;
    if (c < 0x20 || c == 0x7F || c1) {
      const int code = c1 ? static_cast<unsigned char>(name[i + 1]) : c;  // its code point
      return absl::InvalidArgumentError(absl::StrFormat(
          "name has a control character (U+%04X) at byte %d; a job name is one line of "
          "printable text",
          code, i));
    }
  }
  return absl::OkStatus();
}

absl::Status ParseSections(const YAML::Node& root, const std::string& base_dir, JobSpec* spec) {
  if (!root.IsMap()) return absl::InvalidArgumentError("must be a YAML mapping of sections");
  Section top(root, "");
  RETURN_IF_ERROR(top.String("name", &spec->name));
  RETURN_IF_ERROR(top.String("backend", &spec->backend));
  RETURN_IF_ERROR(top.Int("device_memory_cap_bytes", &spec->device_memory_cap_bytes));
  RETURN_IF_ERROR(top.Enum("kind", &spec->kind));
  RETURN_IF_ERROR(ParseModel(top, base_dir, spec));
  if (spec->kind == JobKind::kTrain) {
    RETURN_IF_ERROR(ParseData(top, base_dir, spec));
    RETURN_IF_ERROR(ParseEval(top, base_dir, spec));
    RETURN_IF_ERROR(ParseTrain(top, spec));
    RETURN_IF_ERROR(ParseOptimizer(top, base_dir, spec));
    RETURN_IF_ERROR(ParseLora(top, base_dir, spec));
    RETURN_IF_ERROR(ParseDpo(top, base_dir, spec));
  } else {
    RETURN_IF_ERROR(ParseGenerate(top, base_dir, spec));
  }
  RETURN_IF_ERROR(ParseCheckpoint(top, base_dir, spec));
  return top.CheckNoUnknown();
}

// Each integer field's floor, and each number's range, as ValidateJobSpec checks them.
absl::Status AtLeast(const char* field, int64_t value, int64_t min) {
  if (value >= min) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, " must be >= ", min, ", got ", value));
}
absl::Status InRange(const char* field, double value, double min, double max) {
  if (value >= min && value <= max) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("%s must be in [%.10g, %.10g], got %.10g", field, min, max, value));
}

absl::Status CheckRanges(const JobSpec& s) {
  if (s.kind != JobKind::kTrain) return AtLeast("device_memory_cap_bytes", s.device_memory_cap_bytes, 0);
  const std::pair<const char*, std::pair<int64_t, int64_t>> ints[] = {
      {"device_memory_cap_bytes", {s.device_memory_cap_bytes, 0}},
      {"data.tokenize_threads", {s.tokenize_threads, 0}},
      {"data.seq_len", {s.seq_len, 2}},
      {"train.steps", {s.steps, 1}},
      {"train.tokens_per_step", {s.tokens_per_step, 0}},
      {"train.micro_batch_rows", {s.micro_batch_rows, 0}},
      {"train.micro_batches", {s.micro_batches, 0}},
      {"train.devices", {s.devices, 1}},
      {"train.warmup_steps", {s.schedule.warmup_steps, 0}},
      {"train.activation_checkpoint_every", {s.activation_checkpoint_every, 0}},
      {"train.loss_chunk_tokens", {s.loss_chunk_tokens, 1}},
      {"optimizer.nvme_layers", {s.nvme_layers, -1}},
      {"eval.every_steps", {s.eval.every_steps, 0}},
      {"eval.max_rows", {s.eval.max_rows, 0}},
      {"checkpoint.every_steps", {s.checkpoint_every_steps, 0}},
      {"checkpoint.keep_last", {s.keep_last, 0}},
      {"checkpoint.max_shard_bytes", {s.max_shard_bytes, int64_t{1} << 20}}};
  for (const auto& [field, value_min] : ints) {
    RETURN_IF_ERROR(AtLeast(field, value_min.first, value_min.second));
  }
  RETURN_IF_ERROR(InRange("train.lr", s.schedule.lr, 0, 1e3));
  RETURN_IF_ERROR(InRange("train.min_lr_ratio", s.schedule.min_lr_ratio, 0, 1));
  RETURN_IF_ERROR(InRange("train.weight_decay", s.weight_decay, 0, 1e3));
  RETURN_IF_ERROR(InRange("train.beta1", s.beta1, 0, 0.999999));
  RETURN_IF_ERROR(InRange("train.beta2", s.beta2, 0, 0.999999999));
  RETURN_IF_ERROR(InRange("train.eps", s.eps, 0, 1));
  RETURN_IF_ERROR(InRange("train.max_grad_norm", s.max_grad_norm, 0, 1e30));
  if (s.router_aux_loss_coef != -1) {  // -1: the model config's
    RETURN_IF_ERROR(InRange("train.router_aux_loss_coef", s.router_aux_loss_coef, 0, 1e3));
  }
  // Each is a thread; more than the cores only adds threads (and a million of them cannot
  // be made at all).
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  if (s.tokenize_threads > cores) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.tokenize_threads is ", s.tokenize_threads, "; this machine has ",
                     cores, " cores: use at most ", cores, ", or 0 for one per core"));
  }
  return absl::OkStatus();
}

// A generate or eval job: a model folder (its weights are what it runs), prompts, and
// sampling options in range.
absl::Status CheckGenerate(const JobSpec& s) {
  const GenerateSpec& g = s.generate;
  if (s.model_path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.path is required for a job of kind ", SpecName(s.kind),
        ": the model or checkpoint folder whose weights generate (a config alone has none)"));
  }
  if (g.prompts_path.empty() && g.prompts.empty()) {
    return absl::InvalidArgumentError(
        "generate.prompts (a JSONL file) or generate.prompt (texts) is required");
  }
  if (s.kind == JobKind::kEval && g.prompts_path.empty()) {
    return absl::InvalidArgumentError(
        "generate.prompts is required for an eval job: a JSONL of {prompt, answer} lines");
  }
  if (s.kind != JobKind::kEval && !g.answer_pattern.empty()) {
    return absl::InvalidArgumentError(
        "generate.answer_pattern scores answers: it belongs to a job of kind eval");
  }
  if (g.tokenizer.empty()) {
    return absl::InvalidArgumentError(
        "generate.tokenizer must be 'auto', 'byte', 'model', or a tokenizer.json path");
  }
  RETURN_IF_ERROR(AtLeast("generate.max_new_tokens", g.max_new_tokens, 1));
  RETURN_IF_ERROR(AtLeast("generate.top_k", g.top_k, 0));
  RETURN_IF_ERROR(AtLeast("generate.max_sequences", g.max_sequences, 0));
  RETURN_IF_ERROR(InRange("generate.temperature", g.temperature, 0, 1e3));
  if (!(g.top_p > 0 && g.top_p <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("generate.top_p must be in (0, 1], got %.10g", g.top_p));
  }
  return absl::OkStatus();
}

// The adapters: a rank with every other lora field, each target once, only when training.
absl::Status CheckLora(const JobSpec& s) {
  const LoraConfig& lora = s.lora;
  const bool given = lora.rank != 0 || lora.alpha != 0 || lora.rslora ||
                     !lora.target_modules.empty() || lora.init != LoraInit::kDefault ||
                     !s.lora_adapter.empty();
  if (!given) return absl::OkStatus();
  if (s.kind != JobKind::kTrain) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a job of kind ", SpecName(s.kind), " has no 'lora' section (only training jobs do)"));
  }
  if (lora.rank <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("lora.rank must be positive, got ", lora.rank,
                                                   " (it is required with any lora field)"));
  }
  if (!(lora.alpha > 0 && lora.alpha <= 1e6)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("lora.alpha must be positive (at most 1e6), got %.10g", lora.alpha));
  }
  std::set<std::string> seen;
  for (size_t i = 0; i < lora.target_modules.size(); ++i) {
    const std::string& name = lora.target_modules[i];
    const std::string field = absl::StrCat("lora.target_modules[", i, "] '", Printable(name), "'");
    if (std::find(std::begin(kLoraTargets), std::end(kLoraTargets), name) ==
            std::end(kLoraTargets) &&
        std::find(std::begin(kLoraExpertTargets), std::end(kLoraExpertTargets), name) ==
            std::end(kLoraExpertTargets)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " is not a projection; choose from ", absl::StrJoin(kLoraTargets, ", "), ", ",
          absl::StrJoin(kLoraExpertTargets, ", "),
          name == "all-linear" ? " (all-linear stands alone: it means all but the experts')"
                               : " (or all-linear)"));
    }
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat(field, " is named twice"));
    }
  }
  return absl::OkStatus();
}

// A preference job's settings, and what it cannot be combined with.
absl::Status CheckDpo(const JobSpec& s) {
  const JobSpec::Dpo& d = s.dpo;
  if (!d.enabled) return absl::OkStatus();
  if (s.kind != JobKind::kTrain) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a job of kind ", SpecName(s.kind), " has no 'dpo' section (only training jobs do)"));
  }
  if (!(d.beta > 0 && d.beta <= 1e3)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("dpo.beta must be in (0, 1000], got %.10g", d.beta));
  }
  if (!(d.label_smoothing >= 0 && d.label_smoothing < 0.5)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "dpo.label_smoothing must be in [0, 0.5), got %.10g", d.label_smoothing));
  }
  if (d.label_smoothing > 0 && d.loss != DpoLoss::kSigmoid) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dpo.label_smoothing belongs to the sigmoid loss; dpo.loss is ", SpecName(d.loss)));
  }
  RETURN_IF_ERROR(InRange("dpo.rpo_alpha", d.rpo_alpha, 0, 1e3));
  if (d.max_length < 0 || d.max_length > s.seq_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dpo.max_length must be in [0, data.seq_len = ", s.seq_len, "] (0: data.seq_len), got ",
        d.max_length));
  }
  if (s.data_format != DataFormat::kText) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.format is ", SpecName(s.data_format), "; a dpo job reads data.path as "
        "{prompt, chosen, rejected} pairs: leave data.format out"));
  }
  for (const auto& [field, value] : {std::pair{"dpo.max_prompt_length", d.max_prompt_length},
                                     std::pair{"dpo.max_completion_length",
                                               d.max_completion_length}}) {
    if (value < 0 || value > s.seq_len) {
      return absl::InvalidArgumentError(absl::StrCat(field, " must be in [0, data.seq_len = ",
                                                     s.seq_len, "] (0: uncut), got ", value));
    }
  }
  if (d.reference_free && !d.reference.empty()) {
    return absl::InvalidArgumentError(
        "dpo.reference names a reference model and dpo.reference_free has none: give one");
  }
  if (!s.eval.path.empty() && s.eval.format != DataFormat::kText) {
    return absl::InvalidArgumentError(absl::StrCat(
        "eval.format is ", SpecName(s.eval.format), "; a dpo job's eval.path holds pairs as "
        "data.path does: leave eval.format out"));
  }
  return absl::OkStatus();
}

// The model, data and device the spec names: each given once, and consistent.
absl::Status CheckSources(const JobSpec& s) {
  if (s.model_path.empty() == s.model_config_json.empty()) {
    return absl::InvalidArgumentError(kModelSources);
  }
  if (!s.model_config_json.empty()) {
    const nlohmann::json j =
        nlohmann::json::parse(s.model_config_json, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) {
      return absl::InvalidArgumentError("model.config must be a mapping of config.json fields");
    }
  }
  RETURN_IF_ERROR(CheckLora(s));
  RETURN_IF_ERROR(CheckDpo(s));
  if (s.kind != JobKind::kTrain) return CheckGenerate(s);
  if (s.data_path.empty()) {
    return absl::InvalidArgumentError("data.path is required (a JSONL file)");
  }
  if (s.eval.path.empty() && (s.eval.every_steps > 0 || s.eval.max_rows > 0)) {
    return absl::InvalidArgumentError(
        "eval.every_steps / eval.max_rows are set but eval.path names no file to evaluate");
  }
  if (s.tokenizer == TokenizerSource::kModel && s.model_path.empty()) {
    return absl::InvalidArgumentError(
        "data.tokenizer is 'model', but model.path names no model folder");
  }
  if ((s.tokenizer == TokenizerSource::kFile) == s.tokenizer_path.empty()) {
    return absl::InvalidArgumentError(
        "data.tokenizer must be 'auto', 'byte', 'model', or a tokenizer.json path");
  }
  const bool cuda_n = s.backend.rfind("cuda:", 0) == 0 && CudaDeviceIndexOf(s.backend) >= 0;
  if (s.backend != "auto" && s.backend != "cpu" && s.backend != "cuda" && !cuda_n) {
    return absl::InvalidArgumentError(
        absl::StrCat("backend must be auto, cpu, cuda or cuda:N, got '", s.backend, "'"));
  }
  return absl::OkStatus();
}

// Every string is stored, logged and written to JSON, so each must be UTF-8 (YAML escapes
// such as "\xA0" unescape to bytes that are not).
absl::Status CheckUtf8(const JobSpec& s) {
  const std::pair<const char*, const std::string*> strings[] = {
      {"name", &s.name},
      {"model.path", &s.model_path},
      {"model.config", &s.model_config_json},
      {"data.path", &s.data_path},
      {"data.text_field", &s.text_field},
      {"data.tokenizer", &s.tokenizer_path},
      {"data.chat_date", &s.chat_date},
      {"data.cache_dir", &s.data_cache_dir},
      {"eval.path", &s.eval.path},
      {"generate.prompts", &s.generate.prompts_path},
      {"generate.output", &s.generate.output_path},
      {"generate.tokenizer", &s.generate.tokenizer},
      {"generate.answer_pattern", &s.generate.answer_pattern},
      {"optimizer.nvme_dir", &s.nvme_dir},
      {"lora.adapter", &s.lora_adapter},
      {"dpo.reference", &s.dpo.reference},
      {"checkpoint.dir", &s.checkpoint_dir},
      {"backend", &s.backend}};
  for (const auto& [field, value] : strings) {
    if (!IsValidUtf8(*value)) {
      return absl::InvalidArgumentError(absl::StrCat(field, " is not valid UTF-8"));
    }
  }
  const std::pair<const char*, const std::vector<std::string>*> lists[] = {
      {"generate.prompt", &s.generate.prompts},
      {"generate.stop", &s.generate.stop_strings},
      {"train.freeze", &s.freeze},
      {"lora.target_modules", &s.lora.target_modules}};
  for (const auto& [field, list] : lists) {
    for (const std::string& text : *list) {
      if (!IsValidUtf8(text)) return absl::InvalidArgumentError(absl::StrCat(field, " is not valid UTF-8"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string ResolveSpecPath(const std::string& base_dir, const std::string& path) {
  if (path.empty() || fs::path(path).is_absolute() || base_dir.empty()) return path;
  return (fs::path(base_dir) / path).lexically_normal().string();
}

namespace {

// The source a tokenizer field's text names (auto, byte, model), if it names one.
std::optional<TokenizerSource> NamedTokenizer(const std::string& text) {
  for (TokenizerSource named :
       {TokenizerSource::kAuto, TokenizerSource::kByte, TokenizerSource::kModel}) {
    if (text == SpecName(named)) return named;
  }
  return std::nullopt;
}

}  // namespace

bool IsTokenizerName(const std::string& text) { return NamedTokenizer(text).has_value(); }

std::string ResolveTokenizerText(const std::string& base_dir, const std::string& text) {
  return IsTokenizerName(text) ? text : ResolveSpecPath(base_dir, text);
}

absl::Status SetSpecTokenizer(const std::string& text, const std::string& base_dir,
                              JobSpec* spec) {
  if (const std::optional<TokenizerSource> named = NamedTokenizer(text)) {
    spec->tokenizer = *named;
    spec->tokenizer_path.clear();
    return absl::OkStatus();
  }
  if (text.empty()) {
    return absl::InvalidArgumentError(
        "data.tokenizer must be 'auto', 'byte', 'model', or a tokenizer.json path");
  }
  spec->tokenizer = TokenizerSource::kFile;
  spec->tokenizer_path = ResolveSpecPath(base_dir, text);
  return absl::OkStatus();
}

// ---- The spec's names of its choices ----

namespace {

template <typename E>
struct Values;
#define MT_SPEC_VALUES(E, ...)                    \
  template <>                                     \
  struct Values<E> {                              \
    static constexpr E kAll[] = {__VA_ARGS__};    \
  };
MT_SPEC_VALUES(DataFormat, DataFormat::kText, DataFormat::kAlpaca, DataFormat::kShareGpt,
               DataFormat::kMessages, DataFormat::kTokens)
MT_SPEC_VALUES(TokenizerSource, TokenizerSource::kAuto, TokenizerSource::kByte,
               TokenizerSource::kModel, TokenizerSource::kFile)
MT_SPEC_VALUES(ChatTemplate, ChatTemplate::kAuto, ChatTemplate::kPlain, ChatTemplate::kLlama2,
               ChatTemplate::kLlama3, ChatTemplate::kQwen3, ChatTemplate::kGptOss,
               ChatTemplate::kQwen25, ChatTemplate::kMistralV1, ChatTemplate::kMistralV3,
               ChatTemplate::kMistralV3Tekken)
MT_SPEC_VALUES(Packing, Packing::kPack, Packing::kPad)
MT_SPEC_VALUES(Truncation, Truncation::kAuto, Truncation::kSplit, Truncation::kTruncate)
MT_SPEC_VALUES(OnBadLine, OnBadLine::kFail, OnBadLine::kSkip)
MT_SPEC_VALUES(GradientReduce, GradientReduce::kAuto, GradientReduce::kDevice,
               GradientReduce::kHost)
MT_SPEC_VALUES(ActivationPlacement, ActivationPlacement::kAuto, ActivationPlacement::kDevice,
               ActivationPlacement::kHost)
MT_SPEC_VALUES(ScheduleType, ScheduleType::kConstant, ScheduleType::kLinear, ScheduleType::kCosine)
MT_SPEC_VALUES(MomentDType, MomentDType::kF32, MomentDType::kBF16, MomentDType::kInt8)
MT_SPEC_VALUES(Bf16Copy, Bf16Copy::kAuto, Bf16Copy::kYes, Bf16Copy::kNo)
MT_SPEC_VALUES(ClipStore, ClipStore::kAuto, ClipStore::kFp32, ClipStore::kFp16)
MT_SPEC_VALUES(JobKind, JobKind::kTrain, JobKind::kGenerate, JobKind::kEval)
MT_SPEC_VALUES(LoraInit, LoraInit::kDefault, LoraInit::kGaussian)
MT_SPEC_VALUES(DpoLoss, DpoLoss::kSigmoid, DpoLoss::kIpo, DpoLoss::kHinge)
MT_SPEC_VALUES(DpoTruncation, DpoTruncation::kKeepStart, DpoTruncation::kKeepEnd)
#undef MT_SPEC_VALUES

// auto | device | host, for the enums that offer those three.
template <typename E>
const char* AutoDeviceHost(E value) {
  return value == E::kDevice ? "device" : value == E::kHost ? "host" : "auto";
}

}  // namespace

const char* SpecName(DataFormat value) { return DataFormatName(value); }
const char* SpecName(TokenizerSource value) {
  constexpr const char* kNames[] = {"auto", "byte", "model", "file"};
  return kNames[static_cast<int>(value)];
}
const char* SpecName(ChatTemplate value) {
  constexpr const char* kNames[] = {"auto",    "plain",      "llama2",     "llama3",
                                    "qwen3",   "gptoss",     "qwen2.5",    "mistral-v1",
                                    "mistral-v3", "mistral-v3-tekken"};
  return kNames[static_cast<int>(value)];
}
const char* SpecName(Packing value) { return value == Packing::kPad ? "pad" : "pack"; }
const char* SpecName(Truncation value) {
  constexpr const char* kNames[] = {"auto", "split", "truncate"};
  return kNames[static_cast<int>(value)];
}
const char* SpecName(OnBadLine value) { return value == OnBadLine::kSkip ? "skip" : "fail"; }
const char* SpecName(GradientReduce value) { return AutoDeviceHost(value); }
const char* SpecName(ActivationPlacement value) { return AutoDeviceHost(value); }
const char* SpecName(ScheduleType value) { return ScheduleTypeName(value); }
const char* SpecName(MomentDType value) { return MomentDTypeName(value); }
const char* SpecName(JobKind value) {
  switch (value) {
    case JobKind::kGenerate: return "generate";
    case JobKind::kEval: return "eval";
    default: return "train";
  }
}
const char* SpecName(LoraInit value) { return LoraInitName(value); }
const char* SpecName(DpoLoss value) {
  constexpr const char* kNames[] = {"sigmoid", "ipo", "hinge"};
  return kNames[static_cast<int>(value)];
}
const char* SpecName(DpoTruncation value) {
  return value == DpoTruncation::kKeepEnd ? "keep_end" : "keep_start";
}
const char* SpecName(Bf16Copy value) {
  return value == Bf16Copy::kYes ? "yes" : value == Bf16Copy::kNo ? "no" : "auto";
}
const char* SpecName(ClipStore value) {
  return value == ClipStore::kFp32 ? "fp32" : value == ClipStore::kFp16 ? "fp16" : "auto";
}

template <typename E>
absl::StatusOr<E> ParseSpecName(absl::string_view field, absl::string_view name) {
  std::vector<std::string> names;
  for (E value : Values<E>::kAll) {
    if (name == SpecName(value)) return value;
    names.push_back(SpecName(value));
  }
  return absl::InvalidArgumentError(absl::StrCat(field, " must be one of ",
                                                 absl::StrJoin(names, ", "), "; got '",
                                                 Printable(name), "'"));
}
template absl::StatusOr<DataFormat> ParseSpecName(absl::string_view, absl::string_view);
template absl::StatusOr<TokenizerSource> ParseSpecName(absl::string_view, absl::string_view);
template absl::StatusOr<ChatTemplate> ParseSpecName(absl::string_view, absl::string_view);
template absl::StatusOr<Packing> ParseSpecName(absl::string_view, absl::string_view);
template absl::StatusOr<Truncation> ParseSpecName(absl::string_view, absl::string_view);
template absl::StatusOr<OnBadLine> ParseSpecName(absl::string_view, absl::string_view);
template absl::StatusOr<GradientReduce> ParseSpecName(absl::string_view, absl::string_view);
template absl::StatusOr<ActivationPlacement> ParseSpecName(absl::string_view, absl::string_view);
template absl::StatusOr<ScheduleType> ParseSpecName(absl::string_view, absl::string_view);
template absl::StatusOr<MomentDType> ParseSpecName(absl::string_view, absl::string_view);
template absl::StatusOr<Bf16Copy> ParseSpecName(absl::string_view, absl::string_view);
template absl::StatusOr<ClipStore> ParseSpecName(absl::string_view, absl::string_view);
template absl::StatusOr<JobKind> ParseSpecName(absl::string_view, absl::string_view);
template absl::StatusOr<LoraInit> ParseSpecName(absl::string_view, absl::string_view);
template absl::StatusOr<DpoLoss> ParseSpecName(absl::string_view, absl::string_view);
template absl::StatusOr<DpoTruncation> ParseSpecName(absl::string_view, absl::string_view);

std::string TokenizerText(const JobSpec& spec) {
  return spec.tokenizer == TokenizerSource::kFile ? spec.tokenizer_path : SpecName(spec.tokenizer);
}

int64_t JobSpec::rows_per_step() const {
  if (tokens_per_step > 0 && seq_len > 0) return tokens_per_step / seq_len;
  return std::max<int64_t>(1, micro_batch_rows) * std::max<int64_t>(1, micro_batches);
}

std::string JobSpec::Fingerprint() const {
  nlohmann::json j = {{"model_path", model_path},   {"model_config", model_config_json},
                      {"init_seed", init_seed},     {"data_path", data_path},
                      {"text_field", text_field},   {"tokenizer", TokenizerText(*this)},
                      {"format", SpecName(data_format)},
                      {"chat_template", SpecName(chat_template)},
                      {"chat_date", chat_date},     {"packing", SpecName(packing)},
                      {"truncation", SpecName(truncation)},
                      {"on_bad_line", SpecName(on_bad_line)},
                      {"seq_len", seq_len},         {"data_seed", data_seed},
                      {"rows_per_step", rows_per_step()}};
  // Only a LoRA job's: the fingerprints of checkpoints without adapters stay as they were.
  if (lora.rank > 0) {
    j["lora_rank"] = lora.rank;
    j["lora_alpha"] = lora.alpha;
    j["lora_rslora"] = lora.rslora;
    j["lora_target_modules"] = lora.target_modules;
    j["lora_init"] = SpecName(lora.init);
    j["lora_adapter"] = lora_adapter;
  }
  if (dpo.enabled) {  // what decides a preference job's steps and its reference
    j["dpo_beta"] = dpo.beta;
    j["dpo_loss"] = SpecName(dpo.loss);
    j["dpo_label_smoothing"] = dpo.label_smoothing;
    j["dpo_rpo_alpha"] = dpo.rpo_alpha;
    j["dpo_reference_free"] = dpo.reference_free;
    j["dpo_max_length"] = dpo.max_length;
    j["dpo_truncation"] = SpecName(dpo.truncation);
    // Set only: a job saved before these existed keeps its fingerprint.
    if (dpo.max_prompt_length > 0) j["dpo_max_prompt_length"] = dpo.max_prompt_length;
    if (dpo.max_completion_length > 0) j["dpo_max_completion_length"] = dpo.max_completion_length;
    if (!dpo.reference.empty()) j["dpo_reference"] = dpo.reference;
  }
  return j.dump();
}

std::vector<std::string> FingerprintDifferences(const std::string& there,
                                                const std::string& here) {
  // Fingerprint()'s keys, named as the spec's fields (a key not here is shown as it is).
  static const std::map<std::string, std::string> kFields = {
      {"model_path", "model.path"},       {"model_config", "model.config"},
      {"init_seed", "model.init_seed"},   {"data_path", "data.path"},
      {"text_field", "data.text_field"},  {"tokenizer", "data.tokenizer"},
      {"format", "data.format"},          {"chat_template", "data.chat_template"},
      {"chat_date", "data.chat_date"},    {"packing", "data.packing"},
      {"truncation", "data.truncation"},  {"on_bad_line", "data.on_bad_line"},
      {"seq_len", "data.seq_len"},        {"data_seed", "data.seed"},
      {"lora_rank", "lora.rank"},         {"lora_alpha", "lora.alpha"},
      {"lora_rslora", "lora.rslora"},     {"lora_target_modules", "lora.target_modules"},
      {"lora_init", "lora.init"},         {"lora_adapter", "lora.adapter"},
      {"dpo_beta", "dpo.beta"},           {"dpo_loss", "dpo.loss"},
      {"dpo_label_smoothing", "dpo.label_smoothing"}, {"dpo_rpo_alpha", "dpo.rpo_alpha"},
      {"dpo_reference_free", "dpo.reference_free"},   {"dpo_max_length", "dpo.max_length"},
      {"dpo_truncation", "dpo.truncation"},
      {"dpo_max_prompt_length", "dpo.max_prompt_length"},
      {"dpo_max_completion_length", "dpo.max_completion_length"},
      {"dpo_reference", "dpo.reference"},
      {"rows_per_step", "sequences per step"}};
  const nlohmann::json a = nlohmann::json::parse(there, nullptr, /*allow_exceptions=*/false);
  const nlohmann::json b = nlohmann::json::parse(here, nullptr, /*allow_exceptions=*/false);
  std::vector<std::string> out;
  if (!a.is_object() || !b.is_object()) return out;
  std::set<std::string> keys;
  for (const auto& [key, value] : a.items()) keys.insert(key);
  for (const auto& [key, value] : b.items()) keys.insert(key);
  auto shown = [](const nlohmann::json& v) {
    return v.is_string() ? absl::StrCat("\"", Printable(v.get<std::string>()), "\"") : v.dump();
  };
  for (const std::string& key : keys) {
    const nlohmann::json x = a.value(key, nlohmann::json()), y = b.value(key, nlohmann::json());
    if (x == y) continue;
    const auto named = kFields.find(key);
    const std::string field = named != kFields.end() ? named->second : Printable(key);
    const std::string sx = shown(x), sy = shown(y);
    out.push_back(sx.size() + sy.size() <= 160
                      ? absl::StrCat(field, " (", sx, " there, ", sy, " here)")
                      : field);
  }
  return out;
}

absl::StatusOr<JobSpec> ParseJobSpec(const std::string& yaml_text, const std::string& base_dir,
                                     const std::string& source) {
  if (!IsValidUtf8(yaml_text)) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not valid UTF-8; a job spec is a UTF-8 YAML document"));
  }
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid YAML: ", Printable(e.what())));
  }
  JobSpec spec;
  absl::Status s;
  try {
    s = ParseSections(root, base_dir, &spec);
  } catch (const YAML::Exception& e) {
    s = absl::InvalidArgumentError(Printable(e.what()));
  } catch (const nlohmann::json::exception& e) {
    s = absl::InvalidArgumentError(absl::StrCat("model.config: ", Printable(e.what())));
  }
  if (s.ok()) s = ValidateJobSpec(spec);
  if (!s.ok()) return Annotate(s, source);
  return spec;
}

absl::Status ValidateJobSpec(const JobSpec& spec) {
  RETURN_IF_ERROR(CheckUtf8(spec));
  RETURN_IF_ERROR(CheckJobName(spec.name));
  RETURN_IF_ERROR(CheckSources(spec));
  RETURN_IF_ERROR(CheckRanges(spec));
  return spec.kind == JobKind::kTrain ? CheckBatchShape(spec) : absl::OkStatus();
}

absl::StatusOr<JobSpec> LoadJobSpec(const std::string& path) {
  absl::StatusOr<std::string> text = ReadWholeFile(path);
  if (!text.ok()) return Annotate(text.status(), "cannot read job spec");
  return ParseJobSpec(*text, fs::path(path).parent_path().string(), path);
}

namespace {

// JSON as YAML: objects and arrays in flow style, strings double-quoted (so ToJson keeps
// them strings), numbers, booleans and null as JSON writes them (so ToJson reads the same
// type back: "1.0" stays a float).
void EmitJson(const nlohmann::json& j, YAML::Emitter* out) {
  if (j.is_object()) {
    *out << YAML::Flow << YAML::BeginMap;
    for (const auto& [key, value] : j.items()) {
      *out << YAML::Key << YAML::DoubleQuoted << key << YAML::Value;
      EmitJson(value, out);
    }
    *out << YAML::EndMap;
  } else if (j.is_array()) {
    *out << YAML::Flow << YAML::BeginSeq;
    for (const nlohmann::json& e : j) EmitJson(e, out);
    *out << YAML::EndSeq;
  } else if (j.is_string()) {
    *out << YAML::DoubleQuoted << j.get<std::string>();
  } else if (j.is_null()) {
    *out << YAML::Null;
  } else if (j.is_boolean()) {
    *out << j.get<bool>();
  } else {
    *out << j.dump();  // a number, as JSON spells it
  }
}

}  // namespace

namespace {

void EmitStrings(const char* key, const std::vector<std::string>& values, YAML::Emitter* out) {
  *out << YAML::Key << key << YAML::Value << YAML::Flow << YAML::BeginSeq;
  for (const std::string& v : values) *out << YAML::DoubleQuoted << v;
  *out << YAML::EndSeq;
}

// A training job's adapters; target_modules empty is all-linear.
void EmitLora(const JobSpec& s, YAML::Emitter* out) {
  *out << YAML::Key << "lora" << YAML::Value << YAML::BeginMap;
  *out << YAML::Key << "rank" << YAML::Value << s.lora.rank;
  *out << YAML::Key << "alpha" << YAML::Value << s.lora.alpha;
  *out << YAML::Key << "rslora" << YAML::Value << s.lora.rslora;
  EmitStrings("target_modules",
              s.lora.target_modules.empty() ? std::vector<std::string>{"all-linear"}
                                            : s.lora.target_modules,
              out);
  *out << YAML::Key << "init" << YAML::Value << SpecName(s.lora.init);
  *out << YAML::Key << "adapter" << YAML::Value << YAML::DoubleQuoted << s.lora_adapter;
  *out << YAML::EndMap;
}

// A preference job's section, every field.
void EmitDpo(const JobSpec::Dpo& d, YAML::Emitter* out) {
  *out << YAML::Key << "dpo" << YAML::Value << YAML::BeginMap;
  *out << YAML::Key << "beta" << YAML::Value << d.beta;
  *out << YAML::Key << "loss" << YAML::Value << SpecName(d.loss);
  *out << YAML::Key << "label_smoothing" << YAML::Value << d.label_smoothing;
  *out << YAML::Key << "rpo_alpha" << YAML::Value << d.rpo_alpha;
  *out << YAML::Key << "reference_free" << YAML::Value << d.reference_free;
  *out << YAML::Key << "max_length" << YAML::Value << d.max_length;
  *out << YAML::Key << "truncation" << YAML::Value << SpecName(d.truncation);
  *out << YAML::Key << "max_prompt_length" << YAML::Value << d.max_prompt_length;
  *out << YAML::Key << "max_completion_length" << YAML::Value << d.max_completion_length;
  *out << YAML::Key << "reference" << YAML::Value << YAML::DoubleQuoted << d.reference;
  *out << YAML::EndMap;
}

// The sections of a training job: data, eval, train, optimizer, lora, dpo.
void EmitTraining(const JobSpec& s, YAML::Emitter* out) {
  *out << YAML::Key << "data" << YAML::Value << YAML::BeginMap;
  *out << YAML::Key << "path" << YAML::Value << YAML::DoubleQuoted << s.data_path;
  *out << YAML::Key << "format" << YAML::Value << SpecName(s.data_format);
  *out << YAML::Key << "text_field" << YAML::Value << YAML::DoubleQuoted << s.text_field;
  *out << YAML::Key << "tokenizer" << YAML::Value << YAML::DoubleQuoted << TokenizerText(s);
  *out << YAML::Key << "chat_template" << YAML::Value << SpecName(s.chat_template);
  *out << YAML::Key << "chat_date" << YAML::Value << YAML::DoubleQuoted << s.chat_date;
  *out << YAML::Key << "packing" << YAML::Value << SpecName(s.packing);
  *out << YAML::Key << "truncation" << YAML::Value << SpecName(s.truncation);
  *out << YAML::Key << "on_bad_line" << YAML::Value << SpecName(s.on_bad_line);
  *out << YAML::Key << "cache_dir" << YAML::Value << YAML::DoubleQuoted << s.data_cache_dir;
  *out << YAML::Key << "tokenize_threads" << YAML::Value << s.tokenize_threads;
  *out << YAML::Key << "seq_len" << YAML::Value << s.seq_len;
  *out << YAML::Key << "seed" << YAML::Value << s.data_seed << YAML::EndMap;
  if (!s.eval.path.empty()) {
    *out << YAML::Key << "eval" << YAML::Value << YAML::BeginMap;
    *out << YAML::Key << "path" << YAML::Value << YAML::DoubleQuoted << s.eval.path;
    *out << YAML::Key << "format" << YAML::Value << SpecName(s.eval.format);
    *out << YAML::Key << "every_steps" << YAML::Value << s.eval.every_steps;
    *out << YAML::Key << "max_rows" << YAML::Value << s.eval.max_rows << YAML::EndMap;
  }
  *out << YAML::Key << "train" << YAML::Value << YAML::BeginMap;
  *out << YAML::Key << "steps" << YAML::Value << s.steps;
  *out << YAML::Key << "tokens_per_step" << YAML::Value << s.tokens_per_step;
  *out << YAML::Key << "micro_batch_rows" << YAML::Value << s.micro_batch_rows;
  *out << YAML::Key << "micro_batches" << YAML::Value << s.micro_batches;
  *out << YAML::Key << "devices" << YAML::Value << s.devices;
  *out << YAML::Key << "gradient_reduce" << YAML::Value << SpecName(s.gradient_reduce);
  *out << YAML::Key << "lr" << YAML::Value << s.schedule.lr;
  *out << YAML::Key << "schedule" << YAML::Value << SpecName(s.schedule.type);
  *out << YAML::Key << "warmup_steps" << YAML::Value << s.schedule.warmup_steps;
  *out << YAML::Key << "min_lr_ratio" << YAML::Value << s.schedule.min_lr_ratio;
  *out << YAML::Key << "weight_decay" << YAML::Value << s.weight_decay;
  *out << YAML::Key << "beta1" << YAML::Value << s.beta1;
  *out << YAML::Key << "beta2" << YAML::Value << s.beta2;
  *out << YAML::Key << "eps" << YAML::Value << s.eps;
  *out << YAML::Key << "max_grad_norm" << YAML::Value << s.max_grad_norm;
  *out << YAML::Key << "activation_checkpoint_every" << YAML::Value << s.activation_checkpoint_every;
  *out << YAML::Key << "activation_checkpoints" << YAML::Value << SpecName(s.activation_checkpoints);
  *out << YAML::Key << "loss_chunk_tokens" << YAML::Value << s.loss_chunk_tokens;
  if (s.router_aux_loss_coef >= 0) {
    *out << YAML::Key << "router_aux_loss_coef" << YAML::Value << s.router_aux_loss_coef;
  }
  if (!s.freeze.empty()) EmitStrings("freeze", s.freeze, out);
  *out << YAML::EndMap;
  *out << YAML::Key << "optimizer" << YAML::Value << YAML::BeginMap;
  *out << YAML::Key << "state_dtype" << YAML::Value << SpecName(s.state_dtype);
  *out << YAML::Key << "bf16_copy" << YAML::Value << YAML::DoubleQuoted << SpecName(s.bf16_copy);
  *out << YAML::Key << "clip_store" << YAML::Value << SpecName(s.clip_store);
  *out << YAML::Key << "nvme_dir" << YAML::Value << YAML::DoubleQuoted << s.nvme_dir;
  *out << YAML::Key << "nvme_layers" << YAML::Value << s.nvme_layers;
  *out << YAML::EndMap;
  if (s.lora.rank > 0) EmitLora(s, out);
  if (s.dpo.enabled) EmitDpo(s.dpo, out);
}


// The generate section of a generate or eval job.
void EmitGenerate(const GenerateSpec& g, YAML::Emitter* out) {
  *out << YAML::Key << "generate" << YAML::Value << YAML::BeginMap;
  *out << YAML::Key << "prompts" << YAML::Value << YAML::DoubleQuoted << g.prompts_path;
  EmitStrings("prompt", g.prompts, out);
  *out << YAML::Key << "output" << YAML::Value << YAML::DoubleQuoted << g.output_path;
  *out << YAML::Key << "max_new_tokens" << YAML::Value << g.max_new_tokens;
  *out << YAML::Key << "temperature" << YAML::Value << g.temperature;
  *out << YAML::Key << "top_k" << YAML::Value << g.top_k;
  *out << YAML::Key << "top_p" << YAML::Value << g.top_p;
  *out << YAML::Key << "seed" << YAML::Value << g.seed;
  EmitStrings("stop", g.stop_strings, out);
  *out << YAML::Key << "stop_ids" << YAML::Value << YAML::Flow << YAML::BeginSeq;
  for (int32_t id : g.stop_ids) *out << id;
  *out << YAML::EndSeq;
  *out << YAML::Key << "ignore_eos" << YAML::Value << g.ignore_eos;
  *out << YAML::Key << "chat" << YAML::Value << g.chat;
  *out << YAML::Key << "tokenizer" << YAML::Value << YAML::DoubleQuoted << g.tokenizer;
  *out << YAML::Key << "max_sequences" << YAML::Value << g.max_sequences;
  *out << YAML::Key << "answer_pattern" << YAML::Value << YAML::DoubleQuoted << g.answer_pattern;
  *out << YAML::EndMap;
}

}  // namespace

std::string JobSpecToYaml(const JobSpec& s) {
  YAML::Emitter out;
  out.SetDoublePrecision(15);
  out << YAML::BeginMap;
  out << YAML::Key << "name" << YAML::Value << YAML::DoubleQuoted << s.name;
  out << YAML::Key << "kind" << YAML::Value << SpecName(s.kind);
  out << YAML::Key << "backend" << YAML::Value << s.backend;
  out << YAML::Key << "device_memory_cap_bytes" << YAML::Value << s.device_memory_cap_bytes;
  out << YAML::Key << "model" << YAML::Value << YAML::BeginMap;
  if (!s.model_path.empty()) {
    out << YAML::Key << "path" << YAML::Value << YAML::DoubleQuoted << s.model_path;
  } else {
    // Flow-style JSON is valid YAML, and keeps config.json's own types.
    out << YAML::Key << "config" << YAML::Value;
    EmitJson(nlohmann::json::parse(s.model_config_json), &out);
  }
  out << YAML::Key << "init_seed" << YAML::Value << s.init_seed << YAML::EndMap;
  if (s.kind == JobKind::kTrain) {
    EmitTraining(s, &out);
  } else {
    EmitGenerate(s.generate, &out);
  }
  out << YAML::Key << "checkpoint" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "dir" << YAML::Value << YAML::DoubleQuoted << s.checkpoint_dir;
  out << YAML::Key << "every_steps" << YAML::Value << s.checkpoint_every_steps;
  out << YAML::Key << "keep_last" << YAML::Value << s.keep_last;
  out << YAML::Key << "max_shard_bytes" << YAML::Value << s.max_shard_bytes;
  out << YAML::Key << "background" << YAML::Value << s.checkpoint_background << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

absl::StatusOr<ModelConfig> ResolveModelConfig(const JobSpec& spec) {
  ModelConfig config;
  if (!spec.model_path.empty()) {
    const std::string path = (fs::path(spec.model_path) / "config.json").string();
    std::error_code ec;  // the overload that cannot throw (a symlink loop would)
    if (fs::symlink_status(path, ec).type() == fs::file_type::not_found) {
      return absl::NotFoundError(absl::StrCat("model.path: ", spec.model_path,
                                              " has no config.json (is it a Hugging Face model folder?)"));
    }
    // A symlink loop, an unreadable file, a FIFO: refused naming the field, never thrown.
    absl::StatusOr<ModelConfig> loaded = LoadModelConfig(path);
    if (!loaded.ok()) return Annotate(loaded.status(), "model.path");
    config = *std::move(loaded);
  } else {
    ASSIGN_OR_RETURN(config, ParseModelConfig(spec.model_config_json, "model.config"));
  }
  // Dynamic NTK RoPE: the frequencies of the job's sequence length (transformers takes the
  // batch's largest position at each forward; a job's rows reach seq_len).
  config.rope_scaling.dynamic_seq_len = spec.seq_len;
  return config;
}

}  // namespace megatrain
