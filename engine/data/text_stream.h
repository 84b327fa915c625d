// TextStream: the text of one generated sequence, id by id, for streaming it out.
//
// Each id's text is not the text of the id alone: a character may be cut between ids
// (byte-level BPE, byte fallback), and SentencePiece-style decoders strip the space only
// at the start of the text ("▁Hello" is "Hello" first, " Hello" later). So the stream
// decodes a short window of the last ids with Tokenizer::Decode and returns what the
// window's text gained. The window starts over from the last ids whose text is not empty
// (Decode is local, tokenizer.h), which keeps each step's work constant however long the
// sequence grows. Both rely on Decode being prefix-stable and local (tokenizer.h).
//
// Contract: after ids x1..xn, the concatenation of what Next() returned is Decode(x1..xn)
// less an incomplete UTF-8 sequence at its end, held back until an id completes it or
// Flush() returns it. Bytes no later byte can make valid are returned as they are (see
// Tokenizer::Decode; RepairUtf8 makes them U+FFFD).
//
// Example:
//   TextStream stream(tokenizer);
//   for each generated id: send(stream.Next(id));
//   at the end:            send(stream.Flush());
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/data/tokenizer.h"

namespace megatrain {

// One per sequence. Not thread-safe; movable. Keeps a pointer to the tokenizer, which
// must outlive it.
class TextStream {
 public:
  explicit TextStream(const Tokenizer& tokenizer) : tokenizer_(&tokenizer) {}

  // Takes the sequence's next id; returns the text it completes, possibly empty.
  std::string Next(int32_t id);
  // The bytes held back: an incomplete UTF-8 sequence at the end of the text, or "".
  // Call at the end of the sequence; later ids may still follow (their text then comes
  // after these bytes, which are no longer held).
  std::string Flush();

  // Ids taken so far.
  int64_t num_ids() const { return num_ids_; }
  // Ids kept to decode the next one with (for tests): at most 8, and the ids of a
  // character not yet complete, unless ids with no text of their own pile up.
  size_t window_size() const { return window_.size(); }

 private:
  // Once the window holds this many ids and nothing is held back, it starts over from
  // its last ids whose text is not empty.
  static constexpr size_t kMaxWindowIds = 8;

  // Drops the window's ids before the last one whose own text is not empty.
  // REQUIRES: all of the window's text has been returned.
  void Restart();

  const Tokenizer* tokenizer_;
  // The last ids: a context whose text was returned (what later ids decode to may depend
  // on it: SentencePiece's strip), then ids whose text is not all returned yet.
  std::vector<int32_t> window_;
  size_t returned_bytes_ = 0;  // bytes of Decode(window_) returned by Next() or Flush()
  int64_t num_ids_ = 0;
};

}  // namespace megatrain
