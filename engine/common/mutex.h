// The mutex of the engine and the server: absl::Mutex's Await semantics (a waiter's
// condition is checked again whenever the mutex is released) on std::mutex and
// std::condition_variable, so ThreadSanitizer sees every lock. (Debian's abseil is not
// built with -fsanitize=thread: TSan cannot see absl::Mutex and would report every access
// it guards.) Annotated for Clang's thread-safety analysis like absl::Mutex: members it
// guards are ABSL_GUARDED_BY(mu_).
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace megatrain {

class ABSL_LOCKABLE Mutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    mu_.unlock();
    cv_.notify_all();  // cheap without waiters
  }
  // Blocks until `condition()` holds; the mutex is held when it is called and on return.
  template <typename Condition>
  void Await(Condition condition) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    cv_.wait(lock, condition);
    lock.release();
  }
  // The same, giving up at `deadline`; returns whether the condition holds.
  template <typename Condition>
  bool AwaitWithDeadline(Condition condition, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    const bool held = cv_.wait_until(lock, absl::ToChronoTime(deadline), condition);
    lock.release();
    return held;
  }
  template <typename Condition>
  bool AwaitWithTimeout(Condition condition, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    return AwaitWithDeadline(condition, absl::Now() + timeout);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
};

// Holds a Mutex for its scope.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* mu_;
};

}  // namespace megatrain
