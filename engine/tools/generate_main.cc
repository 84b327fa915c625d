// megatrain-generate: completions of prompts by a model folder or a job's checkpoint, on one
// device, without the daemon.
//
//   megatrain-generate MODEL_DIR --prompt "Once upon a time" [--prompt ...]
//   megatrain-generate MODEL_DIR --prompts prompts.jsonl --output completions.jsonl
//       [--max-new-tokens 256] [--temperature 0] [--top-k 0] [--top-p 1] [--seed 0]
//       [--stop STR]... [--stop-id ID]... [--ignore-eos] [--chat]
//       [--tokenizer auto|byte|model|PATH]
//       [--backend auto|cpu|cuda:N] [--max-sequences N] [--score [--answer-pattern RE]]
//
// A prompts file holds one JSON object a line: {"prompt": "text"}, {"input_ids": [ids]}, or
// with --chat {"messages": [{"role": "user", "content": "..."}]} (a "prompt" is then one
// user message).
// --chat renders the model's chat template with its generation prompt; without it a prompt
// is [bos] + its tokens. Generation stops at the tokenizer's end-of-sequence id unless
// --ignore-eos, as transformers' generate does. Each completion is a JSON line: index, prompt, completion,
// finish_reason ("stop" | "length"), ids and their log-probabilities. --score compares
// each completion's answer (its last number, or --answer-pattern's last match) with the
// line's "answer" (exact match, numbers as numbers), adds answer, extracted and correct to
// its line, and prints {"prompts", "correct", "accuracy"}. Exit codes: 0 done, 2 bad input, 1 a failure.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "engine/backend/factory.h"
#include "engine/common/engine_settings.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"
#include "engine/data/chat_template.h"
#include "engine/data/line_reader.h"
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
    return absl::InvalidArgumentError("expected {\"prompt\": text} (or --chat for messages)");
  }
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, tokenizer.Encode(line["prompt"].get<std::string>()));
  if (tokenizer.bos_id() >= 0) ids.insert(ids.begin(), tokenizer.bos_id());
  return ids;
}

absl::StatusOr<Prompts> ReadPrompts(const std::vector<std::string>& inline_prompts,
                                    const std::string& path, const Tokenizer& tokenizer,
                                    const DatasetOptions* chat) {
  std::vector<nlohmann::json> lines;
  for (const std::string& p : inline_prompts) lines.push_back({{"prompt", p}});
  if (!path.empty()) {
    ASSIGN_OR_RETURN(LineReader reader, LineReader::Open(path, "--prompts"));
    std::string line;
    for (int64_t number = 1;; ++number) {
      ASSIGN_OR_RETURN(const bool more, reader.Next(&line));
      if (!more) break;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ":", number, ": not a JSON object"));
      }
      lines.push_back(std::move(j));
    }
  }
  if (lines.empty()) {
    return absl::InvalidArgumentError(
        path.empty() ? "no prompt: give --prompt TEXT or --prompts FILE.jsonl"
                     : absl::StrCat("--prompts: ", path, " holds no prompt"));
  }
  Prompts out;
  for (size_t i = 0; i < lines.size(); ++i) {
    absl::StatusOr<std::vector<int32_t>> ids = Encode(lines[i], tokenizer, chat);
    if (!ids.ok()) return Annotate(ids.status(), absl::StrCat("prompt ", i));
    if (ids->empty()) {
      return absl::InvalidArgumentError(absl::StrCat("prompt ", i, " has no tokens"));
    }
    out.shown.push_back(lines[i].contains("prompt") ? lines[i]["prompt"] : lines[i]);
    out.answers.push_back(AnswerOf(lines[i]));
    out.ids.push_back(*std::move(ids));
  }
  return out;
}

struct Flags {
  std::string model, prompts_path, output, tokenizer = "auto", backend = "auto";
  std::vector<std::string> prompts;
  bool chat = false, ignore_eos = false, score = false;
  std::string answer_pattern;
  int64_t max_sequences = 0;
  SamplingOptions sampling;
};

// Everything from the model folder to the completions written out.
absl::Status Run(const Flags& f) {
  JobSpec spec;  // the job rules for a model folder's tokenizer and chat template
  spec.model_path = f.model;
  spec.data_format = DataFormat::kMessages;
  RETURN_IF_ERROR(SetSpecTokenizer(f.tokenizer, "", &spec));
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(f.model + "/config.json"));
  std::string tokenizer_dir;
  ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, LoadJobTokenizer(spec, &tokenizer_dir));
  ASSIGN_OR_RETURN(const DatasetOptions chat,
                   JobDatasetOptions(spec, tokenizer_dir, config.vocab_size));
  if (f.chat && !chat.chat.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("--chat: ", f.model,
                                                   " names no chat template we know"));
  }
  SamplingOptions sampling = f.sampling;
  if (!f.ignore_eos && tokenizer->eos_id() >= 0) sampling.stop_ids.push_back(tokenizer->eos_id());
  ASSIGN_OR_RETURN(const Prompts prompts,
                   ReadPrompts(f.prompts, f.prompts_path, *tokenizer, f.chat ? &chat : nullptr));
  ASSIGN_OR_RETURN(const AnswerMatcher matcher, AnswerMatcher::Create(f.answer_pattern));
  for (size_t i = 0; f.score && i < prompts.answers.size(); ++i) {
    if (prompts.answers[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--score: prompt ", i, " has no \"answer\""));
    }
  }
  int64_t longest = 0;
  for (size_t i = 0; i < prompts.ids.size(); ++i) {
    const int64_t len = static_cast<int64_t>(prompts.ids[i].size());
    longest = std::max(longest, len);
    if (config.max_position_embeddings > 0 &&
        len + sampling.max_new_tokens > config.max_position_embeddings) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt ", i, " is ", len, " tokens; with --max-new-tokens ", sampling.max_new_tokens,
          " it passes the model's max_position_embeddings (", config.max_position_embeddings,
          "): shorten it or lower --max-new-tokens"));
    }
  }
  const int64_t max_len = longest + sampling.max_new_tokens + 1;
  config.rope_scaling.dynamic_seq_len = max_len;
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, CreateBackend(BackendRequest{f.backend}));
  StoreOptions store_options;
  store_options.weights_only = true;
  ASSIGN_OR_RETURN(std::unique_ptr<HostStore> store,
                   HostStore::Create(BuildLayout(config), -1, store_options));
  ASSIGN_OR_RETURN(const ModelTensorReader reader, ModelTensorReader::OpenFolder(f.model));
  RETURN_IF_ERROR(LoadWeights(reader, store.get()));
  const int64_t budget = backend->device_memory_budget() > 0
                             ? PlannableDeviceBytes(backend->device_memory_budget())
                             : int64_t{1} << 40;  // the CPU's: host memory
  const int64_t wanted = f.max_sequences > 0 ? f.max_sequences
                                             : static_cast<int64_t>(prompts.ids.size());
  ASSIGN_OR_RETURN(const GeneratorOptions options,
                   PlanGenerator(config, store->layout(), backend.get(), budget, wanted, max_len,
                                 std::max<int64_t>(longest, 4096)));
  std::fprintf(stderr, "%zu prompt(s); %lld sequence(s) at once, layers %s, %s\n",
               prompts.ids.size(), static_cast<long long>(options.max_sequences),
               options.weight_slots >= config.num_layers ? "resident" : "streamed",
               backend->name().c_str());
  ASSIGN_OR_RETURN(std::unique_ptr<Generator> generator,
                   Generator::Create(config, store.get(), backend.get(), options));
  std::ofstream out;
  if (!f.output.empty()) out.open(f.output);
  int64_t correct = 0;
  auto done = [&](int64_t i, const Completion& c) {
    nlohmann::json line = {{"index", i}, {"prompt", prompts.shown[i]},
                           {"completion", c.text}, {"finish_reason", FinishReasonName(c.finish)},
                           {"ids", c.ids}, {"logprobs", c.logprobs}};
    if (f.score) {
      const std::optional<std::string> answer = matcher.Extract(c.text);
      const bool right = answer.has_value() && AnswerMatcher::SameAnswer(*answer, prompts.answers[i]);
      correct += right;
      line["answer"] = prompts.answers[i];
      line["extracted"] = answer.has_value() ? nlohmann::json(*answer) : nlohmann::json();
      line["correct"] = right;
    }
    if (out.is_open()) out << line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    if (f.output.empty() && !f.score) std::printf("%s\n", c.text.c_str());
  };
  ASSIGN_OR_RETURN(const std::vector<Completion> completions,
                   Generate(generator.get(), tokenizer.get(), prompts.ids, sampling, done));
  if (out.is_open() && !out.good()) {
    return absl::DataLossError(absl::StrCat("--output: writing ", f.output, " failed"));
  }
  if (f.score) {
    const int64_t n = static_cast<int64_t>(completions.size());
    std::printf("%s\n", nlohmann::json{{"prompts", n}, {"correct", correct},
                                       {"accuracy", static_cast<double>(correct) / n}}
                            .dump().c_str());
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace megatrain

int main(int argc, char** argv) {
  using namespace megatrain;
  SetEngineSettings(
      EngineSettingsFromEnvironment([](const char* name) { return std::getenv(name); }));
  Flags f;
  CLI::App app{"megatrain-generate: completions of prompts by a model or checkpoint folder"};
  app.add_option("model", f.model, "a Hugging Face model folder or a job's checkpoint")->required();
  app.add_option("--prompt", f.prompts, "a prompt (repeatable)");
  app.add_option("--prompts", f.prompts_path, "a JSONL file of {\"prompt\"} or {\"messages\"}");
  app.add_option("--output", f.output, "write completions as JSONL here (else print them)");
  app.add_option("--max-new-tokens", f.sampling.max_new_tokens);
  app.add_option("--temperature", f.sampling.temperature, "0 = greedy");
  app.add_option("--top-k", f.sampling.top_k, "0 = off");
  app.add_option("--top-p", f.sampling.top_p, "nucleus mass in (0, 1]");
  app.add_option("--seed", f.sampling.seed, "the same seed gives the same text");
  app.add_option("--stop", f.sampling.stop_strings, "a stop string (repeatable)");
  app.add_option("--stop-id", f.sampling.stop_ids, "a stop token id (repeatable)");
  app.add_flag("--chat", f.chat, "apply the model's chat template");
  app.add_flag("--ignore-eos", f.ignore_eos, "do not stop at the tokenizer's end-of-sequence id");
  app.add_flag("--score", f.score,
               "exact match against each line's \"answer\"; prints the accuracy as JSON");
  app.add_option("--answer-pattern", f.answer_pattern,
                 "with --score: a regex whose last match (its first group) is a completion's "
                 "answer; default: its last number");
  app.add_option("--tokenizer", f.tokenizer, "auto | byte | model | a tokenizer.json");
  app.add_option("--backend", f.backend, "auto | cpu | cuda | cuda:N");
  app.add_option("--max-sequences", f.max_sequences, "sequences at once; 0 = as many as fit");
  CLI11_PARSE(app, argc, argv);
  const absl::Status s = Run(f);
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", Printable(s.ToString()).c_str());
    return s.code() == absl::StatusCode::kInvalidArgument ||
                   s.code() == absl::StatusCode::kNotFound
               ? 2
               : 1;
  }
  return 0;
}
