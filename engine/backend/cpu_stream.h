// A host thread that runs closures in order: the CPU backend's stand-in for a CUDA stream.
//
// Thread-safe: Enqueue() may be called from any thread. The destructor drains the queue.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "engine/common/mutex.h"

namespace megatrain {

class CpuStream {
 public:
  CpuStream();
  ~CpuStream();
  CpuStream(const CpuStream&) = delete;
  CpuStream& operator=(const CpuStream&) = delete;

  void Enqueue(std::function<void()> work);
  // Blocks until everything enqueued so far has run.
  void Drain();

 private:
  void Loop();

  Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool running_ ABSL_GUARDED_BY(mu_) = false;  // a closure is executing
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// An event: Record() bumps `recorded` on the host; the stream bumps `completed` when it
// reaches the record. Waiters wait for the generation current at the time they asked.
// A std::mutex, not a Mutex: the CPU backend locks `mu` and notifies `cv` itself.
struct CpuEvent {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;
  uint64_t completed = 0;
  double completed_at_s = 0;  // steady clock, seconds

  void WaitFor(uint64_t generation);
};

}  // namespace megatrain
