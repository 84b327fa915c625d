// Fuzzes the dataset line parsers: the first byte picks the format (and, for chat
// formats, the template), the rest is the JSONL line.
#include <cstdint>

#include "engine/data/byte_tokenizer.h"
#include "engine/data/dataset.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static const megatrain::ByteTokenizer tokenizer;
  megatrain::DatasetOptions options;
  const uint8_t pick = data[0];
  options.format = static_cast<megatrain::DataFormat>(pick % 5);
  if (megatrain::IsChatFormat(options.format) && (pick / 5) % 5 != 0) {
    options.chat = static_cast<megatrain::ChatFormat>((pick / 5) % 5 - 1);
    options.chat_options.bos_token = "<s>";
    options.chat_options.eos_token = "</s>";
    options.chat_options.date_string = "2026-01-01";
  }
  const absl::string_view line(reinterpret_cast<const char*>(data + 1), size - 1);
  absl::StatusOr<megatrain::Example> e = megatrain::ExampleFromLine(line, options, tokenizer);
  if (e.ok() && !e->trained.empty() && e->trained.size() != e->ids.size()) __builtin_trap();
  return 0;
}
