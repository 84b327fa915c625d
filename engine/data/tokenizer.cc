#include "engine/data/tokenizer.h"

#include "absl/strings/str_cat.h"

namespace megatrain {

Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::vector<std::vector<int32_t>>> TokenizeDocuments(
    const std::vector<std::string>& texts, const Tokenizer& tokenizer) {
  if (texts.empty()) {
    return absl::InvalidArgumentError("no documents to tokenize; the dataset is empty");
  }
  const int32_t bos = tokenizer.bos_id();
  const int32_t eos = tokenizer.eos_id();
  std::vector<std::vector<int32_t>> docs;
  docs.reserve(texts.size());
  int64_t num_tokens = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    absl::StatusOr<std::vector<int32_t>> encoded = tokenizer.Encode(texts[i]);
    if (!encoded.ok()) {
      return absl::Status(encoded.status().code(),
                          absl::StrCat("document ", i, ": ", encoded.status().message()));
    }
    const std::vector<int32_t>& ids = *encoded;
    std::vector<int32_t> doc;
    doc.reserve(ids.size() + 2);
    if (bos >= 0) doc.push_back(bos);
    doc.insert(doc.end(), ids.begin(), ids.end());
    if (eos >= 0) doc.push_back(eos);
    num_tokens += static_cast<int64_t>(doc.size());
    docs.push_back(std::move(doc));
  }
  if (num_tokens == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("all ", texts.size(), " documents are empty after tokenizing with '",
                     tokenizer.name(), "'; there is nothing to train on"));
  }
  return docs;
}

}  // namespace megatrain
