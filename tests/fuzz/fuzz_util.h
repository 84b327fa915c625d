// Helpers for the fuzz targets: inputs that the code under test reads from a file.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <set>
#include <string>

namespace megatrain::fuzz {

// Paths WriteInput used, removed when the process exits (/dev/shm is memory).
struct InputFiles {
  std::set<std::string> paths;
  ~InputFiles() {
    for (const std::string& path : paths) unlink(path.c_str());
  }
};

// Writes `data` to a file private to this process (in /dev/shm when it exists) and
// returns its path; the same path is reused, input after input, and removed at exit.
inline std::string WriteInput(const uint8_t* data, size_t size, const char* name) {
  static const std::string dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  static InputFiles files;
  const std::string path = dir + "/megatrain-fuzz-" + std::to_string(getpid()) + "-" + name;
  files.paths.insert(path);
  if (std::FILE* f = std::fopen(path.c_str(), "wb")) {
    if (size > 0) std::fwrite(data, 1, size, f);
    std::fclose(f);
  }
  return path;
}

}  // namespace megatrain::fuzz
