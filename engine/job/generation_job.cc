// engine.h's GenerationJob: a model folder's weights in a weights-only store, its tokenizer
// and chat template as a training job would find them, the prompts, and a Generator planned
// for the device; RunSome() is Generate() over the prompts not yet done, with the
// completions written out as JSON lines.
#include "engine/job/generation_job.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <chrono>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/backend/factory.h"
#include "engine/common/status.h"
#include "engine/data/chat_template.h"
#include "engine/data/line_reader.h"
#include "engine/engine.h"
#include "engine/generate/answer_match.h"
#include "engine/generate/generation.h"
#include "engine/job/inputs.h"
#include "engine/model/safetensors.h"
#include "engine/plan/planner.h"
#include "engine/store/model_io.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

namespace fs = std::filesystem;

struct Prompts {
  std::vector<nlohmann::json> shown;         // as given, for the output
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::string> answers;          // each line's "answer" ("" without one)
};

// A line's reference answer, a string or a number as written; "" when it has none.
std::string AnswerOf(const nlohmann::json& line) {
  if (!line.contains("answer")) return "";
  const nlohmann::json& a = line["answer"];
  return a.is_string() ? a.get<std::string>() : a.dump();
}

// One prompt's messages: a JSON line's "messages", or its "prompt" as one user message.
absl::StatusOr<std::vector<ChatMessage>> MessagesOf(const nlohmann::json& line) {
  std::vector<ChatMessage> messages;
  if (line.contains("prompt") && line["prompt"].is_string()) {
    messages.push_back({"user", line["prompt"].get<std::string>()});
    return messages;
  }
  if (!line.contains("messages") || !line["messages"].is_array()) {
    return absl::InvalidArgumentError("expected {\"prompt\": text} or {\"messages\": [...]}");
  }
  for (const nlohmann::json& m : line["messages"]) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() ||
        !m.contains("content") || !m["content"].is_string()) {
      return absl::InvalidArgumentError("each message needs a string role and content");
    }
    messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  }
  return messages;
}

// A prompt's ids: given ("input_ids"), the chat template's rendering with its generation
// prompt, or [bos] + text.
absl::StatusOr<std::vector<int32_t>> Encode(const nlohmann::json& line, const Tokenizer& tokenizer,
                                            const DatasetOptions* chat) {
  if (line.contains("input_ids")) {
    std::vector<int32_t> ids;
    if (!line["input_ids"].is_array()) return absl::InvalidArgumentError("input_ids is not an array");
    for (const nlohmann::json& id : line["input_ids"]) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
        return absl::InvalidArgumentError(absl::StrCat("input_ids holds ", id.dump()));
      }
      ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
    return ids;
  }
  if (chat != nullptr && chat->chat.has_value()) {
    ASSIGN_OR_RETURN(const std::vector<ChatMessage> messages, MessagesOf(line));
    ChatOptions options = chat->chat_options;
    options.add_generation_prompt = true;
    ASSIGN_OR_RETURN(const ChatRendering r, RenderChat(*chat->chat, messages, options));
    return tokenizer.Encode(r.text);
  }
  if (!line.contains("prompt") || !line["prompt"].is_string()) {
    return absl::InvalidArgumentError("expected {\"prompt\": text} (or chat for messages)");
  }
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, tokenizer.Encode(line["prompt"].get<std::string>()));
  if (tokenizer.bos_id() >= 0) ids.insert(ids.begin(), tokenizer.bos_id());
  return ids;
}

// The JSON lines of the inline prompts, then the file's.
absl::StatusOr<std::vector<nlohmann::json>> PromptLines(const GenerateSpec& spec) {
  std::vector<nlohmann::json> lines;
  for (const std::string& p : spec.prompts) lines.push_back({{"prompt", p}});
  if (!spec.prompts_path.empty()) {
    ASSIGN_OR_RETURN(LineReader reader, LineReader::Open(spec.prompts_path, "prompts"));
    std::string line;
    for (int64_t number = 1;; ++number) {
      ASSIGN_OR_RETURN(const bool more, reader.Next(&line));
      if (!more) break;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat("prompts: ", spec.prompts_path, ":", number, ": not a JSON object"));
      }
      lines.push_back(std::move(j));
    }
  }
  if (lines.empty()) {
    return absl::InvalidArgumentError(
        spec.prompts_path.empty() ? "no prompt: give prompts or a prompts file"
                                  : absl::StrCat("prompts: ", spec.prompts_path,
                                                 " holds no prompt"));
  }
  return lines;
}

absl::StatusOr<Prompts> ReadPrompts(const GenerateSpec& spec, const Tokenizer& tokenizer,
                                    const DatasetOptions* chat, int64_t max_positions) {
  ASSIGN_OR_RETURN(const std::vector<nlohmann::json> lines, PromptLines(spec));
  Prompts out;
  for (size_t i = 0; i < lines.size(); ++i) {
    absl::StatusOr<std::vector<int32_t>> ids = Encode(lines[i], tokenizer, chat);
    if (!ids.ok()) return Annotate(ids.status(), absl::StrCat("prompt ", i));
    const int64_t len = static_cast<int64_t>(ids->size());
    if (len == 0) return absl::InvalidArgumentError(absl::StrCat("prompt ", i, " has no tokens"));
    if (max_positions > 0 && len + spec.max_new_tokens > max_positions) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt ", i, " is ", len, " tokens; with max_new_tokens ", spec.max_new_tokens,
          " it passes the model's max_position_embeddings (", max_positions,
          "): shorten it or lower max_new_tokens"));
    }
    out.answers.push_back(AnswerOf(lines[i]));
    if (spec.score && out.answers.back().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompts: prompt ", i, " has no \"answer\" to score against (an eval's lines are "
          "{\"prompt\": ..., \"answer\": ...})"));
    }
    out.shown.push_back(lines[i].contains("prompt") ? lines[i]["prompt"] : lines[i]);
    out.ids.push_back(*std::move(ids));
  }
  return out;
}

SamplingOptions SamplingOf(const GenerateSpec& spec, const Tokenizer& tokenizer) {
  SamplingOptions s;
  s.temperature = spec.temperature;
  s.top_k = spec.top_k;
  s.top_p = spec.top_p;
  s.seed = spec.seed;
  s.max_new_tokens = spec.max_new_tokens;
  s.stop_strings = spec.stop_strings;
  s.stop_ids = spec.stop_ids;
  if (!spec.ignore_eos && tokenizer.eos_id() >= 0) s.stop_ids.push_back(tokenizer.eos_id());
  return s;
}

// What a generation needs before its weights: the model's config, its tokenizer, the
// prompts and the sampling, checked.
struct Prepared {
  ModelConfig config;
  std::unique_ptr<Tokenizer> tokenizer;
  Prompts prompts;
  SamplingOptions sampling;
  std::optional<AnswerMatcher> matcher;
  int64_t longest = 0;  // the longest prompt's tokens
  int64_t max_len = 0;  // a sequence's positions: the longest prompt and its new tokens
};

absl::StatusOr<Prepared> Prepare(const GenerateSpec& spec) {
  Prepared p;
  JobSpec rules;  // a training job's rules for a model folder's tokenizer and chat template
  rules.model_path = spec.model_path;
  rules.data_format = DataFormat::kMessages;
  RETURN_IF_ERROR(SetSpecTokenizer(spec.tokenizer, "", &rules));
  ASSIGN_OR_RETURN(p.config, LoadModelConfig(spec.model_path + "/config.json"));
  std::string tokenizer_dir;
  ASSIGN_OR_RETURN(p.tokenizer, LoadJobTokenizer(rules, &tokenizer_dir));
  ASSIGN_OR_RETURN(const DatasetOptions chat,
                   JobDatasetOptions(rules, tokenizer_dir, p.config.vocab_size));
  if (spec.chat && !chat.chat.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat: ", spec.model_path, " names no chat template we know"));
  }
  p.sampling = SamplingOf(spec, *p.tokenizer);
  RETURN_IF_ERROR(ValidateSamplingOptions(p.sampling, p.config.vocab_size));
  ASSIGN_OR_RETURN(const AnswerMatcher matcher, AnswerMatcher::Create(spec.answer_pattern));
  p.matcher = matcher;
  ASSIGN_OR_RETURN(p.prompts, ReadPrompts(spec, *p.tokenizer, spec.chat ? &chat : nullptr,
                                          p.config.max_position_embeddings));
  for (const std::vector<int32_t>& ids : p.prompts.ids) {
    p.longest = std::max<int64_t>(p.longest, ids.size());
  }
  p.max_len = p.longest + spec.max_new_tokens + 1;
  p.config.rope_scaling.dynamic_seq_len = p.max_len;
  return p;
}

absl::StatusOr<GeneratorOptions> PlanPrepared(const Prepared& p, const GenerateSpec& spec,
                                              const ModelLayout& layout, Backend* be) {
  const int64_t budget = be->device_memory_budget() > 0
                             ? PlannableDeviceBytes(be->device_memory_budget())
                             : int64_t{1} << 40;  // the CPU's: host memory
  const int64_t wanted = spec.max_sequences > 0 ? spec.max_sequences
                                                : static_cast<int64_t>(p.prompts.ids.size());
  return PlanGenerator(p.config, layout, be, budget, wanted, p.max_len,
                       std::max<int64_t>(p.longest, 4096));
}

std::string DescribePlan(const Prepared& p, const GeneratorOptions& g, const std::string& device) {
  return absl::StrCat(p.prompts.ids.size(), " prompt(s); ", g.max_sequences,
                      " sequence(s) at once, layers ",
                      g.weight_slots >= p.config.num_layers ? "resident" : "streamed", ", ", device);
}

// The prompts an output file already completed: each whole line's "index" (and whether it
// was correct); a last line cut short is dropped from the file.
absl::Status ReadDoneCompletions(const std::string& path, int64_t prompts, std::vector<bool>* done,
                                 int64_t* correct) {
  std::ifstream in(path, std::ios::binary);
  if (!in.is_open()) return absl::OkStatus();  // none yet
  std::string line;
  int64_t good_bytes = 0, offset = 0;
  while (std::getline(in, line)) {
    const bool whole = !in.eof();  // ended by a newline
    offset += static_cast<int64_t>(line.size()) + (whole ? 1 : 0);
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!whole || !j.is_object() || !j.contains("index") || !j["index"].is_number_integer()) break;
    const int64_t i = j["index"].get<int64_t>();
    if (i < 0 || i >= prompts) {
      return absl::InvalidArgumentError(absl::StrCat(
          "output: ", path, " holds a completion of prompt ", i, ", and there are ", prompts,
          " prompts: it is another run's output; name a new file"));
    }
    if (!(*done)[i]) *correct += j.value("correct", false) ? 1 : 0;
    (*done)[i] = true;
    good_bytes = offset;
  }
  std::error_code ec;
  fs::resize_file(path, static_cast<uintmax_t>(good_bytes), ec);
  if (ec) return absl::DataLossError(absl::StrCat("output: ", path, ": ", ec.message()));
  return absl::OkStatus();
}

class GeneratorJob final : public GenerationJob {
 public:
  std::string Describe() const override { return description_; }
  int64_t num_prompts() const override { return static_cast<int64_t>(done_.size()); }
  int64_t prompts_done() const override {
    return std::count(done_.begin(), done_.end(), true);
  }
  int64_t sequences() const override { return generator_->options().max_sequences; }
  absl::StatusOr<GenerationSummary> RunSome(
      int64_t max_prompts, const std::function<void(const CompletionReport&)>& on_completion) override;

  absl::Status OpenOutput();
  std::string CompletionLine(int64_t i, const Completion& c);

  GenerateSpec spec_;
  Prepared p_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<HostStore> store_;
  std::unique_ptr<Generator> generator_;  // before the store and backend it uses go
  std::string description_;
  std::vector<bool> done_;  // per prompt: its completion is in the output
  std::ofstream out_;
  GenerationSummary total_;  // over this job's calls, prompts and correct with the resumed
};

absl::Status GeneratorJob::OpenOutput() {
  done_.assign(p_.prompts.ids.size(), false);
  if (spec_.output_path.empty()) return absl::OkStatus();
  if (spec_.resume_output) {
    RETURN_IF_ERROR(ReadDoneCompletions(spec_.output_path, num_prompts(), &done_, &total_.correct));
  }
  total_.prompts = prompts_done();
  out_.open(spec_.output_path, spec_.resume_output ? std::ios::app : std::ios::trunc);
  if (!out_.is_open()) {
    return absl::PermissionDeniedError(
        absl::StrCat("output: cannot write ", spec_.output_path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

std::string GeneratorJob::CompletionLine(int64_t i, const Completion& c) {
  nlohmann::json line = {{"index", i}, {"prompt", p_.prompts.shown[i]},
                         {"completion", c.text}, {"finish_reason", FinishReasonName(c.finish)},
                         {"ids", c.ids}, {"logprobs", c.logprobs}};
  if (spec_.score) {
    const std::optional<std::string> answer = p_.matcher->Extract(c.text);
    const bool right =
        answer.has_value() && AnswerMatcher::SameAnswer(*answer, p_.prompts.answers[i]);
    total_.correct += right;
    line["answer"] = p_.prompts.answers[i];
    line["extracted"] = answer.has_value() ? nlohmann::json(*answer) : nlohmann::json();
    line["correct"] = right;
  }
  return line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

absl::StatusOr<GenerationSummary> GeneratorJob::RunSome(
    int64_t max_prompts, const std::function<void(const CompletionReport&)>& on_completion) {
  std::vector<int64_t> pending;  // the next prompts without a completion, in order
  for (int64_t i = 0; i < num_prompts(); ++i) {
    if (max_prompts > 0 && static_cast<int64_t>(pending.size()) >= max_prompts) break;
    if (!done_[i]) pending.push_back(i);
  }
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t i : pending) prompts.push_back(p_.prompts.ids[i]);
  auto finished = [&](int64_t k, const Completion& c) {
    const int64_t i = pending[k];
    const std::string json = CompletionLine(i, c);
    if (out_.is_open()) out_ << json << "\n" << std::flush;  // whole lines survive a kill
    done_[i] = true;
    ++total_.prompts;
    total_.new_tokens += static_cast<int64_t>(c.ids.size());
    if (on_completion) on_completion(CompletionReport{i, c.text, FinishReasonName(c.finish), json});
  };
  const auto start = std::chrono::steady_clock::now();
  if (!prompts.empty()) {
    RETURN_IF_ERROR(
        Generate(generator_.get(), p_.tokenizer.get(), prompts, p_.sampling, finished, pending)
            .status());
  }
  total_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  total_.accuracy = spec_.score && total_.prompts > 0
                        ? static_cast<double>(total_.correct) / total_.prompts
                        : 0;
  total_.tokens_per_second = total_.seconds > 0 ? total_.new_tokens / total_.seconds : 0;
  if (out_.is_open() && !out_.good()) {
    return absl::DataLossError(absl::StrCat("output: writing ", spec_.output_path, " failed"));
  }
  return total_;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GenerationJob>> GenerationJob::Create(const GenerateSpec& spec,
                                                                     const RunOptions& options) {
  auto job = std::make_unique<GeneratorJob>();
  job->spec_ = spec;
  ASSIGN_OR_RETURN(job->p_, Prepare(spec));
  const std::string device = options.device.empty() ? spec.backend : options.device;
  ASSIGN_OR_RETURN(job->backend_, CreateBackend(BackendRequest{device}));
  StoreOptions store_options;
  store_options.weights_only = true;
  const ModelConfig& config = job->p_.config;
  ASSIGN_OR_RETURN(job->store_, HostStore::Create(BuildLayout(config), -1, store_options));
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(spec.model_path);
  if (!reader.ok()) return Annotate(reader.status(), "model");
  RETURN_IF_ERROR(Annotate(LoadWeights(*reader, job->store_.get()), "model"));
  Backend* be = job->backend_.get();
  ASSIGN_OR_RETURN(const GeneratorOptions g,
                   PlanPrepared(job->p_, spec, job->store_->layout(), be));
  job->description_ = DescribePlan(job->p_, g, be->name());
  ASSIGN_OR_RETURN(job->generator_, Generator::Create(config, job->store_.get(), be, g));
  RETURN_IF_ERROR(job->OpenOutput());
  return std::unique_ptr<GenerationJob>(std::move(job));
}

absl::StatusOr<GenerationSummary> GenerationJob::Run(
    const std::function<void(const CompletionReport&)>& on_completion) {
  return RunSome(0, on_completion);
}

absl::StatusOr<PlanSummary> PlanGeneration(const GenerateSpec& spec, Backend* backend) {
  ASSIGN_OR_RETURN(const Prepared p, Prepare(spec));
  const ModelLayout layout = BuildLayout(p.config);
  ASSIGN_OR_RETURN(const GeneratorOptions g, PlanPrepared(p, spec, layout, backend));
  PlanSummary out;
  out.weight_slots = g.weight_slots;
  out.sequences = g.max_sequences;
  out.device_bytes = GeneratorDeviceBytes(p.config, layout, backend, g);
  out.host_bytes = static_cast<int64_t>(HostStore::TransferArenaBytes(layout, /*bf16_copy=*/true));
  out.text = absl::StrCat(DescribePlan(p, g, backend->name()), "; up to ", p.max_len,
                          " positions a sequence; ", out.device_bytes >> 20,
                          " MiB on the device, ", out.host_bytes >> 20,
                          " MiB of bf16 weights in host memory\n");
  return out;
}

GenerateSpec GenerateSpecOf(const JobSpec& spec) {
  GenerateSpec g = spec.generate;
  g.model_path = spec.model_path;
  g.backend = spec.backend;
  g.score = spec.kind == JobKind::kEval;
  if (g.output_path.empty() && !spec.checkpoint_dir.empty()) {
    g.output_path = (fs::path(spec.checkpoint_dir) / "completions.jsonl").string();
  }
  return g;
}

}  // namespace megatrain
