#include "engine/data/jsonl.h"

#include <unistd.h>

#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace megatrain {
namespace {

// Writes `contents` to a fresh file in the test's temp dir and returns its path.
std::string WriteFile(const std::string& name, const std::string& contents) {
  const std::string path =
      ::testing::TempDir() + "jsonl_test_" + std::to_string(getpid()) + "_" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << contents;
  return path;
}

bool Contains(const absl::Status& status, const std::string& text) {
  return std::string(status.message()).find(text) != std::string::npos;
}

// Reads the "text" field of `contents`, written as `name`: expects InvalidArgument naming
// the file's path followed by `at` (":<line>: <what>") and, when given, `also`.
void ExpectInvalidAt(const std::string& name, const std::string& contents, const std::string& at,
                     const std::string& also = "") {
  const std::string path = WriteFile(name, contents);
  const absl::Status status = ReadJsonlTexts(path, "text").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(Contains(status, path + at)) << status;
  if (!also.empty()) {
    EXPECT_TRUE(Contains(status, also)) << status;
  }
}

TEST(ReadJsonlTextsTest, ReadsTextsInOrderSkippingBlankLines) {
  const std::string path =
      WriteFile("ok.jsonl",
                "{\"text\": \"first\", \"id\": 1}\n\n   \n{\"text\": \"sec\\u00f6nd\\n\"}\r\n"
                "{\"text\": \"\"}");  // no final newline
  const absl::StatusOr<std::vector<std::string>> texts = ReadJsonlTexts(path, "text");
  ASSERT_TRUE(texts.ok()) << texts.status();
  EXPECT_EQ(*texts, (std::vector<std::string>{"first", "sec\xC3\xB6nd\n", ""}));
}

TEST(ReadJsonlTextsTest, UsesTheNamedField) {
  const std::string path = WriteFile("field.jsonl", "{\"content\": \"a\", \"text\": 3}\n");
  const absl::StatusOr<std::vector<std::string>> texts = ReadJsonlTexts(path, "content");
  ASSERT_TRUE(texts.ok()) << texts.status();
  EXPECT_EQ(*texts, std::vector<std::string>{"a"});
}

TEST(ReadJsonlTextsTest, InvalidJsonNamesPathAndLine) {
  ExpectInvalidAt("bad.jsonl", "{\"text\": \"a\"}\n\n{\"text\": \"b\"\n{\"text\": \"c\"}\n",
                  ":3: not valid JSON: ");
}

TEST(ReadJsonlTextsTest, TrailingGarbageIsInvalidJson) {
  const std::string path = WriteFile("trail.jsonl", "{\"text\": \"a\"} {\"text\": \"b\"}\n");
  EXPECT_TRUE(Contains(ReadJsonlTexts(path, "text").status(), path + ":1: not valid JSON"));
}

TEST(ReadJsonlTextsTest, NumberOverflowIsInvalidJsonNotACrash) {
  const std::string path = WriteFile("overflow.jsonl", "{\"text\": \"a\", \"x\": 1e999}\n");
  EXPECT_TRUE(Contains(ReadJsonlTexts(path, "text").status(), path + ":1: not valid JSON"));
}

TEST(ReadJsonlTextsTest, NonObjectLineNamesItsType) {
  ExpectInvalidAt("array.jsonl", "{\"text\": \"a\"}\n[\"text\"]\n", ":2: expected a JSON object",
                  "got a array");
}

TEST(ReadJsonlTextsTest, MissingFieldNamesPathLineAndField) {
  ExpectInvalidAt("missing.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"}\n{\"body\": \"c\"}\n",
                  ":3: field 'text' missing");
}

TEST(ReadJsonlTextsTest, WrongFieldTypeNamesTheType) {
  ExpectInvalidAt("number.jsonl", "{\"text\": 17}\n",
                  ":1: field 'text' is a number, expected a string");
  const std::string null_path = WriteFile("null.jsonl", "{\"text\": null}\n");
  EXPECT_TRUE(Contains(ReadJsonlTexts(null_path, "text").status(),
                       null_path + ":1: field 'text' is a null, expected a string"));
}

TEST(ReadJsonlTextsTest, MissingFileIsNotFoundNamingThePath) {
  const std::string path = ::testing::TempDir() + "does_not_exist.jsonl";
  const absl::Status status = ReadJsonlTexts(path, "text").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(status, path)) << status;
}

TEST(ReadJsonlTextsTest, DirectoryIsNotFound) {
  const absl::Status status = ReadJsonlTexts(::testing::TempDir(), "text").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(status, "is a directory")) << status;
}

TEST(ReadJsonlTextsTest, EmptyOrBlankFileIsInvalidArgument) {
  for (const char* contents : {"", "\n  \n\t\n"}) {
    ExpectInvalidAt("empty.jsonl", contents, ": no documents");
  }
}

}  // namespace
}  // namespace megatrain
