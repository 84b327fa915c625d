// Fuzzes the tokenizer.json loader; a tokenizer it accepts must encode and decode text.
#include <cstdint>
#include <memory>
#include <string>

#include "engine/data/hf_tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = megatrain::fuzz::WriteInput(data, size, "tokenizer.json");
  absl::StatusOr<std::unique_ptr<megatrain::HfTokenizer>> tok =
      megatrain::HfTokenizer::Load(path, "");
  if (!tok.ok()) return 0;
  for (const char* text : {"Hello world!  12345 \xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\x91\x8d\n\t",
                           "", " a  b\xff\xfe c", "abc<eos>abc"}) {
    const absl::StatusOr<std::vector<int32_t>> ids = (*tok)->Encode(text);
    if (ids.ok()) (void)(*tok)->Decode(*ids);
  }
  return 0;
}
