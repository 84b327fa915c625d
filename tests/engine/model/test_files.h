// File helpers for the model tests: fresh temp folders and hand-made safetensors bytes.
#pragma once

#include <stdlib.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>

#include "gtest/gtest.h"

namespace megatrain {
namespace testing_files {

// A new, empty folder under the test temp dir.
inline std::string MakeTempDir() {
  std::string tmpl = ::testing::TempDir();
  if (tmpl.empty() || tmpl.back() != '/') tmpl += '/';
  tmpl += "mt_model_XXXXXX";
  char* dir = ::mkdtemp(tmpl.data());
  EXPECT_NE(dir, nullptr) << "mkdtemp " << tmpl;
  return tmpl;
}

inline void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "writing " << path;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The 8-byte little-endian length of `header`, `header`, then `data`: a safetensors file
// with whatever header the test wants, valid or not.
inline std::string RawSafetensors(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

}  // namespace testing_files
}  // namespace megatrain
