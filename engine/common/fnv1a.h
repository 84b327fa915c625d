// FNV-1a, 64 bits: a fixed, portable hash of bytes (the same value on every platform and
// standard library, unlike std::hash), for seeds drawn from names and for fingerprints of
// what a cached file was computed from.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace megatrain {

inline constexpr uint64_t kFnv1aOffset = 0xcbf29ce484222325ull;  // FNV's offset basis

// `state` continued over `bytes` bytes of `data` (start from kFnv1aOffset).
inline uint64_t Fnv1a(const void* data, size_t bytes, uint64_t state = kFnv1aOffset) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    state ^= p[i];
    state *= 0x100000001b3ull;  // FNV's 64-bit prime
  }
  return state;
}

inline uint64_t Fnv1a(std::string_view s, uint64_t state = kFnv1aOffset) {
  return Fnv1a(s.data(), s.size(), state);
}

}  // namespace megatrain
