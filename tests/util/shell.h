// Running shell commands from tests (the node reference harnesses).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace megatrain::testing {

// Runs `command` through the shell; its stdout, with *ok = false when it failed.
inline std::string RunShell(const std::string& command, bool* ok) {
  std::string out;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) {
    *ok = false;
    return out;
  }
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) out.append(buffer, n);
  *ok = pclose(pipe) == 0;
  return out;
}

// Whether node and npm are on PATH (the reference tests skip without them).
inline bool HaveNode() {
  return std::system("command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1") == 0;
}

}  // namespace megatrain::testing
