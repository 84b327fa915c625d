// Device names as specs and the daemon write them: "cpu", "auto", "cuda", "cuda:N".
#pragma once

#include <string>

namespace megatrain {

// The CUDA device index a name means: "cuda:N" is N, anything else 0 ("cuda", "auto");
// -1 when what follows "cuda:" is not a device index (1 to 4 digits).
inline int CudaDeviceIndexOf(const std::string& kind) {
  if (kind.rfind("cuda:", 0) != 0) return 0;
  const std::string digits = kind.substr(5);
  if (digits.empty() || digits.size() > 4 ||
      digits.find_first_not_of("0123456789") != std::string::npos) {
    return -1;
  }
  return std::stoi(digits);
}

}  // namespace megatrain
