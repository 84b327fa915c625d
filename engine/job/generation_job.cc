// engine.h's GenerationJob: a model folder's weights in a weights-only store, its tokenizer
// and chat template as a training job would find them, the prompts, and a Generator planned
// for the device; Run() is Generate() with the completions written out as JSON lines.
#include <algorithm>
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
      return absl::InvalidArgumentError(absl::StrCat("score: prompt ", i, " has no \"answer\""));
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

class GeneratorJob final : public GenerationJob {
 public:
  std::string Describe() const override { return description_; }
  absl::StatusOr<GenerationSummary> Run(
      const std::function<void(const CompletionReport&)>& on_completion) override;

  GenerateSpec spec_;
  SamplingOptions sampling_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<HostStore> store_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Generator> generator_;  // before the store and backend it uses go
  std::optional<AnswerMatcher> matcher_;
  Prompts prompts_;
  std::string description_;
};

absl::StatusOr<GenerationSummary> GeneratorJob::Run(
    const std::function<void(const CompletionReport&)>& on_completion) {
  std::ofstream out;
  if (!spec_.output_path.empty()) out.open(spec_.output_path);
  GenerationSummary summary;
  auto done = [&](int64_t i, const Completion& c) {
    nlohmann::json line = {{"index", i}, {"prompt", prompts_.shown[i]},
                           {"completion", c.text}, {"finish_reason", FinishReasonName(c.finish)},
                           {"ids", c.ids}, {"logprobs", c.logprobs}};
    if (spec_.score) {
      const std::optional<std::string> answer = matcher_->Extract(c.text);
      const bool right =
          answer.has_value() && AnswerMatcher::SameAnswer(*answer, prompts_.answers[i]);
      summary.correct += right;
      line["answer"] = prompts_.answers[i];
      line["extracted"] = answer.has_value() ? nlohmann::json(*answer) : nlohmann::json();
      line["correct"] = right;
    }
    summary.new_tokens += static_cast<int64_t>(c.ids.size());
    const std::string json =
        line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (out.is_open()) out << json << "\n";
    if (on_completion) on_completion(CompletionReport{i, c.text, FinishReasonName(c.finish), json});
  };
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(const std::vector<Completion> completions,
                   Generate(generator_.get(), tokenizer_.get(), prompts_.ids, sampling_, done));
  summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  summary.prompts = static_cast<int64_t>(completions.size());
  summary.accuracy = spec_.score ? static_cast<double>(summary.correct) / summary.prompts : 0;
  summary.tokens_per_second = summary.seconds > 0 ? summary.new_tokens / summary.seconds : 0;
  if (out.is_open()) out.flush();
  if (!spec_.output_path.empty() && !out.good()) {
    return absl::DataLossError(absl::StrCat("output: writing ", spec_.output_path, " failed"));
  }
  return summary;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GenerationJob>> GenerationJob::Create(const GenerateSpec& spec,
                                                                     const RunOptions& options) {
  auto job = std::make_unique<GeneratorJob>();
  job->spec_ = spec;
  JobSpec rules;  // a training job's rules for a model folder's tokenizer and chat template
  rules.model_path = spec.model_path;
  rules.data_format = DataFormat::kMessages;
  RETURN_IF_ERROR(SetSpecTokenizer(spec.tokenizer, "", &rules));
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(spec.model_path + "/config.json"));
  std::string tokenizer_dir;
  ASSIGN_OR_RETURN(job->tokenizer_, LoadJobTokenizer(rules, &tokenizer_dir));
  ASSIGN_OR_RETURN(const DatasetOptions chat,
                   JobDatasetOptions(rules, tokenizer_dir, config.vocab_size));
  if (spec.chat && !chat.chat.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat: ", spec.model_path, " names no chat template we know"));
  }
  job->sampling_ = SamplingOf(spec, *job->tokenizer_);
  RETURN_IF_ERROR(ValidateSamplingOptions(job->sampling_, config.vocab_size));
  ASSIGN_OR_RETURN(const AnswerMatcher matcher, AnswerMatcher::Create(spec.answer_pattern));
  job->matcher_ = matcher;
  ASSIGN_OR_RETURN(job->prompts_, ReadPrompts(spec, *job->tokenizer_, spec.chat ? &chat : nullptr,
                                              config.max_position_embeddings));
  int64_t longest = 0;
  for (const std::vector<int32_t>& p : job->prompts_.ids) {
    longest = std::max<int64_t>(longest, p.size());
  }
  const int64_t max_len = longest + spec.max_new_tokens + 1;
  config.rope_scaling.dynamic_seq_len = max_len;
  const std::string device = options.device.empty() ? spec.backend : options.device;
  ASSIGN_OR_RETURN(job->backend_, CreateBackend(BackendRequest{device}));
  StoreOptions store_options;
  store_options.weights_only = true;
  ASSIGN_OR_RETURN(job->store_, HostStore::Create(BuildLayout(config), -1, store_options));
  absl::StatusOr<ModelTensorReader> reader = ModelTensorReader::OpenFolder(spec.model_path);
  if (!reader.ok()) return Annotate(reader.status(), "model");
  RETURN_IF_ERROR(Annotate(LoadWeights(*reader, job->store_.get()), "model"));
  Backend* be = job->backend_.get();
  const int64_t budget = be->device_memory_budget() > 0
                             ? PlannableDeviceBytes(be->device_memory_budget())
                             : int64_t{1} << 40;  // the CPU's: host memory
  const int64_t wanted = spec.max_sequences > 0 ? spec.max_sequences
                                                : static_cast<int64_t>(job->prompts_.ids.size());
  ASSIGN_OR_RETURN(const GeneratorOptions g,
                   PlanGenerator(config, job->store_->layout(), be, budget, wanted, max_len,
                                 std::max<int64_t>(longest, 4096)));
  job->description_ = absl::StrCat(
      job->prompts_.ids.size(), " prompt(s); ", g.max_sequences, " sequence(s) at once, layers ",
      g.weight_slots >= config.num_layers ? "resident" : "streamed", ", ", be->name());
  ASSIGN_OR_RETURN(job->generator_, Generator::Create(config, job->store_.get(), be, g));
  return std::unique_ptr<GenerationJob>(std::move(job));
}

}  // namespace megatrain
