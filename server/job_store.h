// JobStore: megatraind's durable record of jobs, their events and logs, and an audit log.
//
// One SQLite database (WAL, synchronous=FULL), so nothing a user submitted is lost when
// the daemon is killed (kill -9) or the machine loses power: every mutating call has
// committed (and the WAL is fsync'ed) before it returns. Rows keep the serialized
// megatrain.v1 messages as blobs; the columns that queries filter on (owner, state,
// priority, created time) are broken out, and Insert/Update keep them in sync. Keys (a
// job's id; an event's job_id, seq, unix_ms) are stored only in columns.
//
// The schema is versioned with PRAGMA user_version: a new file gets the current schema;
// a file written by a newer megatraind is refused rather than half understood.
//
// Thread-safe: one connection, one mutex; every call holds it for its duration.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/common/mutex.h"
#include "megatrain/v1/jobs.pb.h"

struct sqlite3;
struct sqlite3_stmt;

namespace megatrain::server {

// One row of the audit log: who did what to which job.
struct AuditEntry {
  int64_t id = 0;  // increases in the order entries were recorded
  int64_t unix_ms = 0;
  std::string user;
  std::string action;  // e.g. "submit", "cancel"
  int64_t job_id = 0;  // 0 when the action concerns no job
  std::string detail;
  std::string outcome;  // "ok", or the error the call returned
};

// An access token for TCP callers. Only its SHA-256 is stored.
struct TokenRecord {
  int64_t id = 0;
  std::string user;  // the local user it stands for
  std::string name;  // what its owner calls it
  int64_t created_ms = 0;
  int64_t last_used_ms = 0;  // 0: never; updated at most once a minute
};

// Errors: NOT_FOUND for an unknown job; INVALID_ARGUMENT for a bad argument (a
// non-positive limit); DATA_LOSS when the file is not a job store or is corrupt;
// FAILED_PRECONDITION for a file written by a newer megatraind; UNAVAILABLE when the
// database is locked by another process or the file system fails; RESOURCE_EXHAUSTED
// when the disk is full; INTERNAL for anything else SQLite reports. Every message names
// the database file.
class JobStore {
 public:
  // The schema version this build writes and understands (PRAGMA user_version).
  static constexpr int kSchemaVersion = 2;  // version 1 files are upgraded

  // Opens the database at `path`, creating the file and the schema if needed.
  // ":memory:" gives a private in-memory store (tests). REQUIRES: path is not "".
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<JobStore>> Open(const std::string& path);

  // Closes the connection. Everything was committed already.
  ~JobStore();
  JobStore(const JobStore&) = delete;
  JobStore& operator=(const JobStore&) = delete;

  const std::string& path() const { return path_; }

  // Stores a new job. Assigns job->id (any id the caller set is ignored) and sets
  // job->created_unix_ms to now if it is 0. Returns the id; ids increase and are never
  // reused. On error *job is left as it was.
  [[nodiscard]] absl::StatusOr<int64_t> Insert(v1::Job* job);

  // Replaces the stored job with id job.id(); NOT_FOUND if there is none.
  [[nodiscard]] absl::Status Update(const v1::Job& job);

  // NOT_FOUND "job 12 not found" if there is no such job.
  [[nodiscard]] absl::StatusOr<v1::Job> Get(int64_t id);

  // Newest first (id descending): jobs whose state is one of `states` (empty: any
  // state), owned by `owner` ("" : anyone), with id < before_id (0: no bound), at most
  // `limit` of them. To page, pass the last id of one page as before_id of the next.
  // INVALID_ARGUMENT unless limit > 0.
  [[nodiscard]] absl::StatusOr<std::vector<v1::Job>> List(const std::vector<v1::JobState>& states,
                                                          const std::string& owner,
                                                          int64_t before_id, int limit);

  // All jobs in `state`, oldest first (id ascending): used at startup and by the
  // scheduler.
  [[nodiscard]] absl::StatusOr<std::vector<v1::Job>> ListInState(v1::JobState state);

  // Appends an event of job `job_id` with seq = that job's last seq + 1 (the first is 1).
  // Sets event->job_id and event->seq, and event->unix_ms to now if it is 0; on error
  // *event is left as it was. Returns the seq. NOT_FOUND if the job does not exist.
  [[nodiscard]] absl::StatusOr<int64_t> AppendEvent(int64_t job_id, v1::JobEvent* event);

  // The newest event's seq of job `job_id` (0 when it has none).
  [[nodiscard]] absl::StatusOr<int64_t> LastEventSeq(int64_t job_id);
  // Events of `job_id` with seq > after_seq, in seq order, at most `limit` (> 0).
  // An unknown job has no events.
  [[nodiscard]] absl::StatusOr<std::vector<v1::JobEvent>> EventsAfter(int64_t job_id,
                                                                      int64_t after_seq, int limit);

  // Like AppendEvent, for log lines; logs have their own sequence per job.
  [[nodiscard]] absl::StatusOr<int64_t> AppendLog(int64_t job_id, v1::LogLine* line);

  // Like EventsAfter, for log lines.
  [[nodiscard]] absl::StatusOr<std::vector<v1::LogLine>> LogsAfter(int64_t job_id,
                                                                   int64_t after_seq, int limit);

  // Records `entry` (its id and unix_ms are assigned: now).
  [[nodiscard]] absl::Status Audit(const AuditEntry& entry);
  // Records that `user` did `action` to job `job_id` (0: no job), outcome "ok".
  [[nodiscard]] absl::Status Audit(const std::string& user, const std::string& action,
                                   int64_t job_id, const std::string& detail);

  // The newest `limit` (> 0) audit entries, newest first; only those of `user` unless it
  // is "", only those about job `job_id` unless it is 0.
  [[nodiscard]] absl::StatusOr<std::vector<AuditEntry>> AuditLog(int limit,
                                                                 const std::string& user = "",
                                                                 int64_t job_id = 0);

  // Access tokens, stored by hash (see server/identity.h). InsertToken returns the id;
  // UseToken finds a token by hash (NOT_FOUND if none) and notes its use; DeleteToken is
  // NOT_FOUND for an unknown id. ListTokens: every user's when `user` is "".
  [[nodiscard]] absl::StatusOr<int64_t> InsertToken(const std::string& hash,
                                                    const std::string& user,
                                                    const std::string& name);
  [[nodiscard]] absl::StatusOr<TokenRecord> UseToken(const std::string& hash);
  [[nodiscard]] absl::StatusOr<TokenRecord> GetToken(int64_t id);
  [[nodiscard]] absl::StatusOr<std::vector<TokenRecord>> ListTokens(const std::string& user);
  [[nodiscard]] absl::Status DeleteToken(int64_t id);

  // Fair-share usage: device seconds per user, decaying with half-life `half_life_s`
  // (<= 0: never). AddUsage decays the stored total to `now` and adds `seconds`.
  [[nodiscard]] absl::Status AddUsage(const std::string& user, double seconds, double half_life_s,
                                      absl::Time now = absl::Now());
  // Every user's usage, decayed to `now`.
  [[nodiscard]] absl::StatusOr<std::map<std::string, double>> Usage(double half_life_s,
                                                                    absl::Time now = absl::Now());

  // Number of jobs in each state. Every defined state except UNSPECIFIED has an entry,
  // 0 when no job is in it.
  [[nodiscard]] absl::StatusOr<std::map<v1::JobState, int64_t>> CountByState();

 private:
  explicit JobStore(std::string path);

  // Opens the connection, sets the pragmas, checks or creates the schema.
  [[nodiscard]] absl::Status Init() ABSL_LOCKS_EXCLUDED(mu_);
  [[nodiscard]] absl::Status CreateOrCheckSchema() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  [[nodiscard]] absl::StatusOr<int> ReadSchemaVersion() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `sql` (any number of statements, rows ignored) without caching it: for setup.
  [[nodiscard]] absl::Status Exec(const std::string& sql, absl::string_view doing)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The prepared statement for `sql`, compiled on first use and kept until the store
  // closes. Callers reset it after use (see Query in the .cc).
  [[nodiscard]] absl::StatusOr<sqlite3_stmt*> Prepare(const std::string& sql)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Steps `stmt` (bound; it selects id, job) to the end and decodes the jobs.
  [[nodiscard]] absl::StatusOr<std::vector<v1::Job>> ReadJobs(sqlite3_stmt* stmt,
                                                              absl::string_view doing)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Turns SQLite result code `rc` into a Status naming the file; OK for OK/ROW/DONE.
  [[nodiscard]] absl::Status Error(int rc, absl::string_view doing)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  Mutex mu_;
  sqlite3* db_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::unordered_map<std::string, sqlite3_stmt*> statements_ ABSL_GUARDED_BY(mu_);
};

// For a write whose failure no caller can act on (a lane's loop; an audit entry once the
// call's outcome is decided): one line on stderr, "megatraind: job 12: <doing> failed:
// <status>" ("job 12: " left out when job_id is 0). Thread-safe.
void ReportWriteFailure(int64_t job_id, absl::string_view doing, const absl::Status& status);

}  // namespace megatrain::server
