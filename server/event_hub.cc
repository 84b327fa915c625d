#include "server/event_hub.h"

namespace megatrain::server {

void EventHub::Notify(int64_t job_id) {
  MutexLock lock(&mu_);
  ++versions_[job_id];
}

int64_t EventHub::Version(int64_t job_id) {
  MutexLock lock(&mu_);
  auto it = versions_.find(job_id);
  return it == versions_.end() ? 0 : it->second;
}

int64_t EventHub::WaitPast(int64_t job_id, int64_t seen, absl::Time deadline) {
  MutexLock lock(&mu_);
  auto moved = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = versions_.find(job_id);
    return it != versions_.end() && it->second > seen;
  };
  mu_.AwaitWithDeadline(moved, deadline);
  auto it = versions_.find(job_id);
  return it == versions_.end() ? 0 : it->second;
}

}  // namespace megatrain::server
