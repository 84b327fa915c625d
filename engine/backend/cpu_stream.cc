#include "engine/backend/cpu_stream.h"

#include <utility>

namespace megatrain {

CpuStream::CpuStream() : thread_([this] { Loop(); }) {}

CpuStream::~CpuStream() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void CpuStream::Enqueue(std::function<void()> work) {
  MutexLock lock(&mu_);
  queue_.push_back(std::move(work));
}

void CpuStream::Drain() {
  MutexLock lock(&mu_);
  mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && !running_; });
}

// Takes everything queued at once and runs it in order without the lock: every Unlock()
// wakes Drain() to re-check, and a lock per closure woke it twice per closure, which made
// the CPU backend's runs of small closures 40% slower. Each closure is destroyed before
// the next one runs and before running_ clears, so before Drain() can return.
void CpuStream::Loop() {
  std::deque<std::function<void()>> batch;
  for (;;) {
    {
      MutexLock lock(&mu_);
      mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      batch.swap(queue_);
      running_ = true;
    }
    while (!batch.empty()) {
      batch.front()();
      batch.pop_front();
    }
    MutexLock lock(&mu_);  // its Unlock() wakes Drain()
    running_ = false;
  }
}

void CpuEvent::WaitFor(uint64_t generation) {
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return completed >= generation; });
}

}  // namespace megatrain
