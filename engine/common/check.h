// Always-on invariant checks for what only a bug can cause.
//
// Unlike assert(), MT_CHECK stays in release builds: a broken invariant in a training
// engine silently corrupts hours of work, so we abort with file:line instead.
// Anything a user or the environment can cause returns an absl::Status instead.
#pragma once

#include <cstdio>
#include <cstdlib>

#define MT_CHECK(cond)                                                          \
  do {                                                                          \
    if (!(cond)) {                                                              \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                             \
    }                                                                           \
  } while (0)

#define MT_CHECK_MSG(cond, ...)                                                 \
  do {                                                                          \
    if (!(cond)) {                                                              \
      std::fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                        \
      std::fprintf(stderr, "\n");                                               \
      std::abort();                                                             \
    }                                                                           \
  } while (0)
