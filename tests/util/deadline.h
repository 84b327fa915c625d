// RunWithin(): runs a call that must not block (opening a FIFO, say) on a thread of its
// own, so that a test of it fails after a deadline instead of hanging the suite. A call
// that overruns is left running, detached; the test binary's exit ends it.
#pragma once

#include <chrono>
#include <future>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

namespace megatrain::testing {

// The result of `f()`, or nullopt when it has not returned after `seconds`.
template <typename F>
auto RunWithin(double seconds, F f) -> std::optional<decltype(f())> {
  using Result = decltype(f());
  auto promise = std::make_shared<std::promise<Result>>();
  std::future<Result> future = promise->get_future();
  std::thread([promise, f = std::move(f)]() mutable { promise->set_value(f()); }).detach();
  if (future.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready) {
    return std::nullopt;
  }
  return future.get();
}

}  // namespace megatrain::testing
