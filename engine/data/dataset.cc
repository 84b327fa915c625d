// Datasets. nlohmann::json throws on malformed input; every parse is caught here and
// becomes a Status naming the line.
#include "engine/data/dataset.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/common/fnv1a.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"
#include "engine/data/line_reader.h"

namespace megatrain {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr int kMaxReportedErrors = 5;
constexpr size_t kChunkLines = 512;
constexpr size_t kChunkBytes = 1 << 20;

absl::StatusOr<std::string> StringField(const json& object, const char* field, bool optional,
                                        absl::string_view what) {
  const std::string where = what.empty() ? "field" : absl::StrCat(what, " field");
  const auto it = object.find(field);
  if (it == object.end() || (optional && it->is_null())) {
    if (optional) return std::string();
    return absl::InvalidArgumentError(absl::StrCat(where, " '", field, "' missing"));
  }
  if (!it->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " '", field, "' is a ", it->type_name(), ", expected a string"));
  }
  return it->get<std::string>();
}

absl::StatusOr<const json*> ArrayField(const json& object, const char* field) {
  const auto it = object.find(field);
  if (it == object.end()) {
    return absl::InvalidArgumentError(absl::StrCat("field '", field, "' missing"));
  }
  if (!it->is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat("field '", field, "' is a ", it->type_name(), ", expected an array"));
  }
  return &*it;
}

absl::StatusOr<std::vector<ChatMessage>> ShareGptMessages(const json& doc) {
  ASSIGN_OR_RETURN(const json* turns, ArrayField(doc, "conversations"));
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < turns->size(); ++i) {
    const json& turn = (*turns)[i];
    const std::string where = absl::StrCat("conversations[", i, "]");
    if (!turn.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(where, " is a ", turn.type_name(),
                                                     ", expected an object {from, value}"));
    }
    ASSIGN_OR_RETURN(std::string from, StringField(turn, "from", false, where));
    ASSIGN_OR_RETURN(std::string value, StringField(turn, "value", false, where));
    std::string role;
    if (from == "system") {
      role = "system";
    } else if (from == "human" || from == "user") {
      role = "user";
    } else if (from == "gpt" || from == "assistant" || from == "chatgpt") {
      role = "assistant";
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".from is '", from, "'; expected system, human, user, gpt or assistant"));
    }
    messages.push_back({std::move(role), std::move(value)});
  }
  return messages;
}

absl::StatusOr<std::vector<ChatMessage>> MessagesField(const json& doc) {
  ASSIGN_OR_RETURN(const json* turns, ArrayField(doc, "messages"));
  return MessagesFromJson(*turns, "messages");
}

}  // namespace

absl::StatusOr<std::vector<ChatMessage>> MessagesFromJson(const json& turns,
                                                          absl::string_view field) {
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < turns.size(); ++i) {
    const json& turn = turns[i];
    const std::string where = absl::StrCat(field, "[", i, "]");
    if (!turn.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(where, " is a ", turn.type_name(),
                                                     ", expected an object {role, content}"));
    }
    ASSIGN_OR_RETURN(std::string role, StringField(turn, "role", false, where));
    ASSIGN_OR_RETURN(std::string content, StringField(turn, "content", false, where));
    if (role != "system" && role != "user" && role != "assistant") {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".role is '", role, "'; expected system, user or assistant"));
    }
    messages.push_back({std::move(role), std::move(content)});
  }
  return messages;
}

namespace {

absl::StatusOr<std::vector<ChatMessage>> AlpacaMessages(const json& doc) {
  ASSIGN_OR_RETURN(std::string instruction, StringField(doc, "instruction", false, ""));
  ASSIGN_OR_RETURN(std::string input, StringField(doc, "input", true, ""));
  ASSIGN_OR_RETURN(std::string output, StringField(doc, "output", false, ""));
  std::string prompt = std::move(instruction);
  if (!input.empty()) absl::StrAppend(&prompt, "\n\n", input);
  return std::vector<ChatMessage>{{"user", std::move(prompt)}, {"assistant", std::move(output)}};
}

void Append(const std::vector<int32_t>& ids, bool trained, Example* e) {
  e->trained.insert(e->trained.end(), ids.size(), trained ? 1 : 0);
  e->ids.insert(e->ids.end(), ids.begin(), ids.end());
}

// The ids of `text`, appended to *e.
absl::Status AppendText(const Tokenizer& tokenizer, absl::string_view text, bool trained,
                        Example* e) {
  ASSIGN_OR_RETURN(const std::vector<int32_t> ids, tokenizer.Encode(text));
  Append(ids, trained, e);
  return absl::OkStatus();
}

// Without a model chat template: "<system>\n\n" "User: <u>\n\n" "Assistant: " <a> <eos>,
// pieces encoded one by one; the assistant text and its eos are trained.
absl::StatusOr<Example> PlainChat(const std::vector<ChatMessage>& messages,
                                  const Tokenizer& tokenizer) {
  bool any_assistant = false;
  Example e;
  if (tokenizer.bos_id() >= 0) Append({tokenizer.bos_id()}, false, &e);
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "system") {
      if (i != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("message ", i, " is a system message; only the first may be"));
      }
      RETURN_IF_ERROR(AppendText(tokenizer, m.content + "\n\n", false, &e));
    } else if (m.role == "user") {
      RETURN_IF_ERROR(AppendText(tokenizer, "User: " + m.content + "\n\n", false, &e));
    } else {
      any_assistant = true;
      RETURN_IF_ERROR(AppendText(tokenizer, "Assistant: ", false, &e));
      RETURN_IF_ERROR(AppendText(tokenizer, m.content, true, &e));
      if (tokenizer.eos_id() >= 0) Append({tokenizer.eos_id()}, true, &e);
      RETURN_IF_ERROR(AppendText(tokenizer, "\n\n", false, &e));
    }
  }
  if (!any_assistant) {
    return absl::InvalidArgumentError("the conversation has no assistant message to train on");
  }
  return e;
}

absl::StatusOr<Example> TokensExample(const json& doc, int64_t vocab_size,
                                      const char* vocab_owner) {
  ASSIGN_OR_RETURN(const json* ids, ArrayField(doc, "input_ids"));
  Example e;
  e.ids.reserve(ids->size());
  for (size_t i = 0; i < ids->size(); ++i) {
    const json& v = (*ids)[i];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("input_ids[", i, "] is ", v.dump(), ", expected an id in [0, ",
                       vocab_size, ") (", vocab_owner, " vocab_size is ", vocab_size, ")"));
    }
    e.ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
  }
  if (doc.contains("labels")) {
    ASSIGN_OR_RETURN(const json* labels, ArrayField(doc, "labels"));
    if (labels->size() != ids->size()) {
      return absl::InvalidArgumentError(absl::StrCat("labels has ", labels->size(),
                                                     " entries, input_ids ", ids->size()));
    }
    e.trained.resize(ids->size());
    for (size_t i = 0; i < labels->size(); ++i) {
      const json& v = (*labels)[i];
      if (!v.is_number_integer()) {
        return absl::InvalidArgumentError(
            absl::StrCat("labels[", i, "] is ", v.dump(), ", expected an integer"));
      }
      e.trained[i] = v.get<int64_t>() == -100 ? 0 : 1;
    }
  }
  return e;
}

// The index of the first token of `ids` (the tokenization of `text`) that is not part of
// the tokenization of text[0, byte): where a byte offset falls in token space.
absl::StatusOr<size_t> TokenIndexAt(const std::string& text, size_t byte,
                                    const std::vector<int32_t>& ids, const Tokenizer& tokenizer) {
  if (byte == 0) return 0;
  if (byte >= text.size()) return ids.size();
  ASSIGN_OR_RETURN(const std::vector<int32_t> prefix,
                   tokenizer.Encode(absl::string_view(text).substr(0, byte)));
  size_t k = 0;
  while (k < prefix.size() && k < ids.size() && prefix[k] == ids[k]) ++k;
  return k;
}

// File identity for the cache key.
json FileIdentity(const std::string& path) {
  struct stat st;
  std::error_code ec;
  const std::string absolute = fs::absolute(path, ec).string();
  if (::stat(path.c_str(), &st) != 0) return json{{"path", absolute}};
  return json{{"path", absolute},
              {"bytes", static_cast<int64_t>(st.st_size)},
              {"mtime_ns", static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 +
                               static_cast<int64_t>(st.st_mtim.tv_nsec)}};
}

struct LineResult {
  int64_t line = 0;  // 1-based
  absl::StatusOr<Example> example;
};

struct Chunk {
  std::vector<std::pair<int64_t, std::string>> lines;  // (line number, text)
  std::vector<LineResult> results;
  bool done = false;
};

}  // namespace

const char* DataFormatName(DataFormat format) {
  switch (format) {
    case DataFormat::kText: return "text";
    case DataFormat::kAlpaca: return "alpaca";
    case DataFormat::kShareGpt: return "sharegpt";
    case DataFormat::kMessages: return "messages";
    case DataFormat::kTokens: return "tokens";
  }
  return "?";
}

bool IsChatFormat(DataFormat format) {
  return format == DataFormat::kAlpaca || format == DataFormat::kShareGpt ||
         format == DataFormat::kMessages;
}

json DatasetStats::ToJson() const {
  return json{{"lines", lines},           {"examples", examples},
              {"bad_lines", bad_lines},   {"tokens", tokens},
              {"trained_tokens", trained_tokens}, {"first_errors", first_errors},
              {"seconds", seconds},       {"reused", reused}};
}

std::string DatasetStats::Summary() const {
  std::string out = absl::StrCat("dataset: ", examples, " examples, ", tokens, " tokens (",
                                 trained_tokens, " trained)");
  if (bad_lines > 0) {
    absl::StrAppend(&out, "; ", bad_lines, " malformed line", bad_lines == 1 ? "" : "s",
                    " skipped", first_errors.empty() ? "" : ", first: ",
                    first_errors.empty() ? "" : first_errors[0]);
  }
  if (reused) {
    absl::StrAppend(&out, "; tokenized earlier (cached)");
  } else {
    absl::StrAppend(&out, absl::StrFormat("; tokenized in %.2f s", seconds));
  }
  return out;
}

absl::StatusOr<Example> TextExample(absl::string_view text, const Tokenizer& tokenizer) {
  Example e;
  ASSIGN_OR_RETURN(const std::vector<int32_t> ids, tokenizer.Encode(text));
  e.ids.reserve(ids.size() + 2);
  if (tokenizer.bos_id() >= 0) e.ids.push_back(tokenizer.bos_id());
  e.ids.insert(e.ids.end(), ids.begin(), ids.end());
  if (tokenizer.eos_id() >= 0) e.ids.push_back(tokenizer.eos_id());
  return e;
}

absl::StatusOr<Example> EncodeWithTrainedSpans(
    const std::string& text, const std::vector<std::pair<size_t, size_t>>& trained,
    const Tokenizer& tokenizer) {
  Example e;
  ASSIGN_OR_RETURN(e.ids, tokenizer.Encode(text));
  e.trained.assign(e.ids.size(), 0);
  for (const auto& [begin, end] : trained) {
    ASSIGN_OR_RETURN(const size_t first, TokenIndexAt(text, begin, e.ids, tokenizer));
    ASSIGN_OR_RETURN(const size_t last, TokenIndexAt(text, end, e.ids, tokenizer));
    for (size_t i = first; i < last && i < e.ids.size(); ++i) e.trained[i] = 1;
  }
  return e;
}

bool IsBlankLine(absl::string_view line) {
  for (char c : line) {
    if (c != ' ' && c != '\t' && c != '\r' && c != '\n') return false;
  }
  return true;
}

absl::Status CheckDatasetTrainable(absl::string_view field, const std::string& path,
                                   const DatasetStats& stats) {
  if (stats.examples == 0 || stats.tokens == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", path, " holds no examples to train on (", stats.lines, " lines, ",
        stats.bad_lines, " malformed",
        stats.first_errors.empty() ? "" : absl::StrCat("; first: ", stats.first_errors[0]), ")"));
  }
  if (stats.trained_tokens == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", path, ": no token of any example is trained (every label is masked)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Example> ExampleFromLine(absl::string_view line, const DatasetOptions& options,
                                        const Tokenizer& tokenizer) {
  json doc;
  try {
    doc = json::parse(line.begin(), line.end());
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("not valid JSON: ", Printable(e.what())));
  }
  if (!doc.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected a JSON object, got a ", doc.type_name()));
  }
  std::vector<ChatMessage> messages;
  switch (options.format) {
    case DataFormat::kText: {
      ASSIGN_OR_RETURN(std::string text,
                       StringField(doc, options.text_field.c_str(), false, ""));
      return TextExample(text, tokenizer);
    }
    case DataFormat::kTokens:
      if (options.vocab_size > 0) return TokensExample(doc, options.vocab_size, "the model's");
      return TokensExample(doc, tokenizer.vocab_size(), "the tokenizer's");
    case DataFormat::kAlpaca: {
      ASSIGN_OR_RETURN(messages, AlpacaMessages(doc));
      break;
    }
    case DataFormat::kShareGpt: {
      ASSIGN_OR_RETURN(messages, ShareGptMessages(doc));
      break;
    }
    case DataFormat::kMessages: {
      ASSIGN_OR_RETURN(messages, MessagesField(doc));
      break;
    }
  }
  if (!options.chat.has_value()) return PlainChat(messages, tokenizer);
  ASSIGN_OR_RETURN(ChatRendering r, RenderChat(*options.chat, messages, options.chat_options));
  if (r.trained.empty()) {
    return absl::InvalidArgumentError("the conversation has no assistant message to train on");
  }
  return EncodeWithTrainedSpans(r.text, r.trained, tokenizer);
}

json DatasetSource(const DatasetOptions& options, const Tokenizer& tokenizer) {
  json source{{"file", FileIdentity(options.path)},
              {"format", DataFormatName(options.format)},
              {"tokenizer", tokenizer.name()},
              {"vocab_size", tokenizer.vocab_size()},
              {"bos_id", tokenizer.bos_id()},
              {"eos_id", tokenizer.eos_id()},
              {"skip_bad_lines", options.skip_bad_lines}};
  if (options.format == DataFormat::kTokens && options.vocab_size > 0) {
    source["model_vocab_size"] = options.vocab_size;  // what the ids were checked against
  }
  // The tokenizer file's identity, when the name is a path to one.
  const std::string name = tokenizer.name();
  if (const size_t colon = name.find(':'); colon != std::string::npos) {
    source["tokenizer_file"] = FileIdentity(name.substr(colon + 1));
  }
  if (options.format == DataFormat::kText) source["text_field"] = options.text_field;
  if (IsChatFormat(options.format)) {
    source["chat"] = options.chat ? std::string(ChatFormatName(*options.chat)) : "plain";
    if (options.chat) {
      const ChatOptions& c = options.chat_options;
      source["chat_options"] = {{"bos", c.bos_token}, {"eos", c.eos_token},
                                {"date", c.date_string}, {"effort", c.reasoning_effort},
                                {"identity", c.model_identity}};
    }
  }
  return source;
}

namespace {

// Threads that tokenize chunks of lines, handed back in the order they were submitted: a
// chunk is taken only once every earlier one has been. One thread feeds and takes; the
// pool's threads tokenize. Closing (or destroying) the pool drops chunks no thread has
// started and joins the threads.
class TokenizingPool {
 public:
  // At most `max_in_flight` chunks are out before Next() waits for the oldest.
  TokenizingPool(const DatasetOptions& options, const Tokenizer& tokenizer,
                 size_t max_in_flight)
      : options_(options), tokenizer_(tokenizer), max_in_flight_(max_in_flight) {}
  ~TokenizingPool() { Close(); }

  // Starts `threads` tokenizing threads; an exception never leaves: a thread the system will
  // not make (a process or cgroup limit) is ResourceExhausted, with none left running.
  absl::Status Start(int threads) {
    absl::Status started;
    for (int t = 0; t < threads && started.ok(); ++t) {
      try {
        pool_.emplace_back([this] { Tokenize(); });
      } catch (const std::system_error& e) {
        started = absl::ResourceExhaustedError(absl::StrCat(
            "data.tokenize_threads: cannot start tokenizing thread ", pool_.size() + 1, " of ",
            threads, " (", e.what(), "); lower data.tokenize_threads"));
      }
    }
    if (!started.ok()) Close();
    return started;
  }

  void Submit(std::shared_ptr<Chunk> chunk) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      todo_.push_back(chunk);
      in_order_.push_back(std::move(chunk));
    }
    work_cv_.notify_one();
  }

  // The oldest chunk out, once tokenized: waited for when `all` or when max_in_flight are
  // out, else null while it is not done. Null when none is out.
  std::shared_ptr<Chunk> Next(bool all) {
    std::unique_lock<std::mutex> lock(mu_);
    if (in_order_.empty()) return nullptr;
    if (all || in_order_.size() >= max_in_flight_) {
      done_cv_.wait(lock, [&] { return in_order_.front()->done; });
    } else if (!in_order_.front()->done) {
      return nullptr;
    }
    std::shared_ptr<Chunk> chunk = in_order_.front();
    in_order_.pop_front();
    return chunk;
  }

  void Close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
      todo_.clear();
    }
    work_cv_.notify_all();
    for (std::thread& t : pool_) t.join();
    pool_.clear();
    in_order_.clear();
  }

 private:
  void Tokenize() {
    for (;;) {
      std::shared_ptr<Chunk> chunk;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [&] { return closing_ || !todo_.empty(); });
        if (todo_.empty()) return;
        chunk = todo_.front();
        todo_.pop_front();
      }
      chunk->results.reserve(chunk->lines.size());
      for (auto& [number, text] : chunk->lines) {
        chunk->results.push_back({number, ExampleFromLine(text, options_, tokenizer_)});
        std::string().swap(text);
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        chunk->done = true;
      }
      done_cv_.notify_all();
    }
  }

  const DatasetOptions& options_;
  const Tokenizer& tokenizer_;
  const size_t max_in_flight_;
  std::vector<std::thread> pool_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::shared_ptr<Chunk>> todo_;      // waiting for a tokenizer
  std::deque<std::shared_ptr<Chunk>> in_order_;  // every chunk not yet taken, in order
  bool closing_ = false;
};

// Writes a tokenized chunk's examples and counts them (and its bad lines, when skipped).
// InvalidArgument naming the file and line of a bad one otherwise; the writer's error.
absl::Status WriteExamples(const Chunk& chunk, const DatasetOptions& options,
                           TokenStoreWriter* writer, DatasetStats* stats) {
  for (const LineResult& r : chunk.results) {
    ++stats->lines;
    if (!r.example.ok()) {
      const std::string message =
          absl::StrCat(options.path, ":", r.line, ": ", r.example.status().message());
      if (!options.skip_bad_lines) {
        return absl::InvalidArgumentError(
            absl::StrCat(message, " (set data.on_bad_line: skip to leave such lines out)"));
      }
      ++stats->bad_lines;
      if (stats->first_errors.size() < kMaxReportedErrors) stats->first_errors.push_back(message);
      continue;
    }
    const Example& e = *r.example;
    RETURN_IF_ERROR(writer->Add(e));
    ++stats->examples;
    stats->tokens += static_cast<int64_t>(e.ids.size());
    stats->trained_tokens += e.trained.empty()
                                 ? static_cast<int64_t>(e.ids.size())
                                 : std::count(e.trained.begin(), e.trained.end(), 1);
  }
  return absl::OkStatus();
}

// Reads `in` into chunks of its non-blank lines (numbered as in the file) and submits each
// to `pool`; after each, `written()` writes what is done and says whether to go on. The
// read's error (a read that failed, or a line over the bound), if any.
absl::Status ReadInChunks(LineReader* in, TokenizingPool* pool,
                          const std::function<bool()>& written) {
  int64_t line_number = 0;
  std::string line;
  auto chunk = std::make_shared<Chunk>();
  size_t chunk_bytes = 0;
  bool go_on = true;
  auto submit = [&] {
    if (chunk->lines.empty()) return;
    pool->Submit(chunk);
    chunk = std::make_shared<Chunk>();
    chunk_bytes = 0;
    go_on = written();
  };
  absl::Status read_status;
  while (go_on) {
    absl::StatusOr<bool> more = in->Next(&line);
    if (!more.ok()) read_status = more.status();
    if (!more.ok() || !*more) break;
    ++line_number;
    if (IsBlankLine(line)) continue;
    chunk_bytes += line.size();
    chunk->lines.emplace_back(line_number, std::move(line));
    if (chunk->lines.size() >= kChunkLines || chunk_bytes >= kChunkBytes) submit();
  }
  submit();
  return read_status;
}

}  // namespace

// The file is read on this thread in chunks, tokenized by a pool of threads and written
// in file order as chunks finish, at most 2 x threads + 1 chunks out at once.
absl::StatusOr<DatasetStats> BuildTokenStore(const DatasetOptions& options,
                                             const Tokenizer& tokenizer, const std::string& dir,
                                             const json& source) {
  const auto started = std::chrono::steady_clock::now();
  std::error_code ec;
  if (fs::is_directory(options.path, ec)) {
    return absl::NotFoundError(absl::StrCat(
        options.field, ": ", options.path, " is a directory; expected a .jsonl file"));
  }
  ASSIGN_OR_RETURN(LineReader in,
                   LineReader::Open(options.path, options.field, options.max_line_bytes));
  ASSIGN_OR_RETURN(std::unique_ptr<TokenStoreWriter> writer, TokenStoreWriter::Create(dir));

  const int threads = options.threads > 0
                          ? options.threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  TokenizingPool pool(options, tokenizer, static_cast<size_t>(2 * threads + 1));
  RETURN_IF_ERROR(pool.Start(threads));
  DatasetStats stats;
  absl::Status failure;
  // Writes finished chunks at the front, in file order. `all`: wait for every chunk.
  auto drain = [&](bool all) {
    while (std::shared_ptr<Chunk> chunk = pool.Next(all)) {
      if (failure.ok()) failure = WriteExamples(*chunk, options, writer.get(), &stats);
    }
  };
  const absl::Status read_status = ReadInChunks(&in, &pool, [&] {
    drain(false);
    return failure.ok();
  });
  drain(true);
  pool.Close();

  RETURN_IF_ERROR(failure);
  RETURN_IF_ERROR(read_status);
  RETURN_IF_ERROR(CheckDatasetTrainable(options.field, options.path, stats));
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  json full_source = source;
  full_source["stats"] = stats.ToJson();
  RETURN_IF_ERROR(writer->Finish(full_source));
  return stats;
}

absl::StatusOr<std::shared_ptr<const TokenDocs>> OpenOrBuildTokenStore(
    const DatasetOptions& options, const Tokenizer& tokenizer, const std::string& cache_dir,
    DatasetStats* stats) {
  const json source = DatasetSource(options, tokenizer);
  const std::string key = absl::StrFormat("%016x", Fnv1a(source.dump()));
  const std::string dir = (fs::path(cache_dir) / ("tokens-" + key)).string();
  absl::StatusOr<std::shared_ptr<const TokenDocs>> docs = TokenDocs::Open(dir);
  if (docs.ok()) {
    json stored = (*docs)->source();
    json recorded_stats = stored.value("stats", json::object());
    stored.erase("stats");
    if (stored == source) {
      if (stats != nullptr) {
        *stats = DatasetStats{};
        stats->lines = recorded_stats.value("lines", int64_t{0});
        stats->examples = recorded_stats.value("examples", int64_t{0});
        stats->bad_lines = recorded_stats.value("bad_lines", int64_t{0});
        stats->tokens = recorded_stats.value("tokens", int64_t{0});
        stats->trained_tokens = recorded_stats.value("trained_tokens", int64_t{0});
        stats->first_errors =
            recorded_stats.value("first_errors", std::vector<std::string>{});
        stats->reused = true;
      }
      return docs;
    }
  }
  std::error_code ec;
  fs::create_directories(cache_dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat(
        "data.cache_dir: cannot create ", cache_dir, ": ", ec.message()));
  }
  ASSIGN_OR_RETURN(DatasetStats built, BuildTokenStore(options, tokenizer, dir, source));
  if (stats != nullptr) *stats = built;
  return TokenDocs::Open(dir);
}

}  // namespace megatrain
