// JSONL reader. nlohmann::json reports parse errors by throwing (parse_error, and
// out_of_range for a number that overflows a double); we catch them here, at the
// boundary, and turn them into a Status naming the line.
#include "engine/data/jsonl.h"

#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "engine/common/printable.h"
#include "engine/data/line_reader.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

bool IsBlank(const std::string& line) {
  for (char c : line) {
    if (c != ' ' && c != '\t' && c != '\r' && c != '\n') return false;
  }
  return true;
}

// The text of one line, or the reason it has none.
absl::StatusOr<std::string> ParseLine(const std::string& line, const std::string& field,
                                      const std::string& where) {
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not valid JSON: ", Printable(e.what())));
  }
  if (!doc.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(where,
                                                   ": expected a JSON object with a string field '",
                                                   field, "', got a ", doc.type_name()));
  }
  const auto it = doc.find(field);
  if (it == doc.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": field '", field, "' missing; every line needs the document text in '", field,
        "' (or set the dataset's text field to the name this file uses)"));
  }
  if (!it->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": field '", field, "' is a ", it->type_name(), ", expected a string"));
  }
  return it->get<std::string>();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ReadJsonlTexts(const std::string& path,
                                                        const std::string& field) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::NotFoundError(
        absl::StrCat(path, " is a directory; expected a .jsonl file (one JSON object a line)"));
  }
  absl::StatusOr<LineReader> in = LineReader::Open(path, "dataset");
  if (!in.ok()) return in.status();
  std::vector<std::string> texts;
  std::string line;
  int64_t line_number = 0;
  for (;;) {
    absl::StatusOr<bool> more = in->Next(&line);
    if (!more.ok()) return more.status();  // a failed read, or a line over the bound
    if (!*more) break;
    ++line_number;
    if (IsBlank(line)) continue;
    absl::StatusOr<std::string> text = ParseLine(line, field, absl::StrCat(path, ":", line_number));
    if (!text.ok()) return text.status();
    texts.push_back(*std::move(text));
  }
  if (texts.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": no documents (", line_number,
        " lines, all blank); expected one JSON object a line with a string field '", field, "'"));
  }
  return texts;
}

}  // namespace megatrain
