// EventHub: wakes watchers when a job has something new (an event, a log line, a state).
//
// The job store is the record; the hub only says "look again". A watcher remembers the
// version it last saw and blocks until the job's version moves past it (or a deadline,
// so it can notice a cancelled RPC). Thread-safe.
#pragma once

#include <cstdint>

#include "absl/container/flat_hash_map.h"
#include "engine/common/mutex.h"
#include "absl/time/time.h"

namespace megatrain::server {

class EventHub {
 public:
  // Marks something new for `job_id`.
  void Notify(int64_t job_id);
  // The job's current version (0 before any Notify).
  int64_t Version(int64_t job_id);
  // Blocks until Version(job_id) > seen or `deadline`; returns the version then.
  int64_t WaitPast(int64_t job_id, int64_t seen, absl::Time deadline);

 private:
  Mutex mu_;
  absl::flat_hash_map<int64_t, int64_t> versions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace megatrain::server
