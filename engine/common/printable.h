// Printable(): file content made safe to quote in an error message. Text read from a
// user's files (a corrupt safetensors header, a binary file named as a dataset) can hold
// any bytes; quoted raw, they put binary on a terminal and make the message invalid
// UTF-8, which protobuf refuses to carry in a string field. Valid UTF-8 text passes
// unchanged; control characters become \n, \t, \r or \xNN, and each byte that is not
// part of a valid UTF-8 sequence becomes \xNN.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace megatrain {

// The length of the valid UTF-8 sequence (no overlong forms, no surrogates, at most
// U+10FFFF) that starts text[i], or 0.
inline size_t Utf8SequenceLength(absl::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(text[k]); };
  const uint8_t b = byte(i);
  size_t n = 0;
  uint32_t cp = 0;
  if (b < 0x80) return 1;
  if (b >= 0xC2 && b <= 0xDF) {
    n = 2, cp = b & 0x1F;
  } else if (b >= 0xE0 && b <= 0xEF) {
    n = 3, cp = b & 0x0F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    n = 4, cp = b & 0x07;
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3F);
  }
  if ((n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) || cp > 0x10FFFF ||
      (cp >= 0xD800 && cp <= 0xDFFF)) {
    return 0;
  }
  return n;
}

inline std::string Printable(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const uint8_t b = static_cast<uint8_t>(text[i]);
    const size_t n = Utf8SequenceLength(text, i);
    if (n > 1 || (n == 1 && b >= 0x20 && b != 0x7F)) {
      out.append(text.data() + i, n);
      i += n;
      continue;
    }
    if (b == '\n') {
      out += "\\n";
    } else if (b == '\t') {
      out += "\\t";
    } else if (b == '\r') {
      out += "\\r";
    } else {
      out += absl::StrFormat("\\x%02x", b);
    }
    ++i;
  }
  return out;
}

}  // namespace megatrain
