// TextStream: a window of the last ids, decoded whole at each step; what it gained is the
// new text. See text_stream.h for why the window may start over.
#include "engine/data/text_stream.h"

#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/data/bpe_text.h"

namespace megatrain {

std::string TextStream::Next(int32_t id) {
  ++num_ids_;
  window_.push_back(id);
  const std::string text = tokenizer_->Decode(window_);
  std::string piece;
  if (text.size() > returned_bytes_) {
    absl::string_view fresh = absl::string_view(text).substr(returned_bytes_);
    // Text returned so far never ends inside a character, so the one cut here starts
    // in `fresh`.
    fresh.remove_suffix(IncompleteUtf8SuffixLength(fresh));
    piece.assign(fresh.data(), fresh.size());
    returned_bytes_ += piece.size();
  }
  if (returned_bytes_ >= text.size() && window_.size() >= kMaxWindowIds) Restart();
  return piece;
}

std::string TextStream::Flush() {
  const std::string text = tokenizer_->Decode(window_);
  if (text.size() <= returned_bytes_) return "";
  std::string rest = text.substr(returned_bytes_);
  returned_bytes_ = text.size();
  return rest;
}

void TextStream::Restart() {
  // From the last id with text on, the window decodes to non-empty text, so by locality
  // (Tokenizer::Decode) what later ids add no longer depends on the ids before it. Its own
  // text is where the window's text will be cut.
  for (size_t first = window_.size(); first-- > 1;) {
    const int32_t id = window_[first];
    if (tokenizer_->Decode(absl::MakeConstSpan(&id, 1)).empty()) continue;
    window_.erase(window_.begin(), window_.begin() + first);
    returned_bytes_ = tokenizer_->Decode(window_).size();
    return;
  }
}

}  // namespace megatrain
