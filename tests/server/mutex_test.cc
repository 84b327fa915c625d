// megatrain::Mutex (engine/common/mutex.h) keeps absl::Mutex's Await semantics: a waiter's condition is checked again
// whenever the mutex is released, with no explicit notify, and timeouts give up.
#include "engine/common/mutex.h"

#include <atomic>
#include <thread>

#include "gtest/gtest.h"

namespace megatrain::server {
namespace {

TEST(ServerMutex, AwaitWakesWhenAnotherThreadChangesTheStateUnderTheLock) {
  Mutex mu;
  int value = 0;
  std::thread setter([&] {
    for (int i = 1; i <= 5; ++i) {
      MutexLock lock(&mu);
      value = i;  // no notify: releasing the lock is enough
    }
  });
  {
    MutexLock lock(&mu);
    mu.Await([&] { return value == 5; });
    EXPECT_EQ(value, 5);
  }
  setter.join();
}

TEST(ServerMutex, AwaitWithTimeoutGivesUpAndSaysSo) {
  Mutex mu;
  MutexLock lock(&mu);
  const absl::Time start = absl::Now();
  EXPECT_FALSE(mu.AwaitWithTimeout([] { return false; }, absl::Milliseconds(50)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(45));
  EXPECT_TRUE(mu.AwaitWithTimeout([] { return true; }, absl::Milliseconds(50)));
}

TEST(ServerMutex, AwaitWithDeadlineSeesAChangeBeforeTheDeadline) {
  Mutex mu;
  bool ready = false;
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(20));
    MutexLock lock(&mu);
    ready = true;
  });
  {
    MutexLock lock(&mu);
    EXPECT_TRUE(mu.AwaitWithDeadline([&] { return ready; }, absl::Now() + absl::Seconds(30)));
  }
  setter.join();
}

TEST(ServerMutex, ExcludesConcurrentWriters) {
  Mutex mu;
  int64_t counter = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        MutexLock lock(&mu);
        ++counter;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(counter, 40000);
}

}  // namespace
}  // namespace megatrain::server
