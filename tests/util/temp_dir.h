// Test helpers for files: a temporary folder removed at scope exit, and writing a file.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace megatrain::testing {

// A fresh folder under the test temp dir, removed with everything in it at scope exit.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "mt") {
    std::string tmpl =
        (std::filesystem::path(::testing::TempDir()) / (prefix + "_XXXXXX")).string();
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr) << "mkdtemp " << tmpl;
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string Join(const std::string& rel) const {
    return (std::filesystem::path(path_) / rel).string();
  }

 private:
  std::string path_;
};

// Writes `text` to `path`, creating its folder.
inline void WriteFile(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  ASSERT_TRUE(out.good()) << "writing " << path;
}

}  // namespace megatrain::testing
