// JobStore on SQLite.
//
// Every mutation is one SQL statement in autocommit mode, so it is atomic and, with WAL and
// synchronous=FULL, durable when sqlite3_step() reports SQLITE_DONE. The next id or seq is
// computed inside that statement (AUTOINCREMENT; INSERT ... SELECT MAX(seq) + 1 ...
// RETURNING seq), which is why a job's id and an event's job_id/seq/unix_ms live only in
// their columns: the blob is written before they are known, and readers fill them in
// from the columns. The mutex serializes this process; the primary keys reject a
// duplicate seq should a second process ever write to the same file.
#include "server/job_store.h"

#include <sqlite3.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/common/check.h"
#include "engine/common/status.h"
#include "engine/common/units.h"

namespace megatrain::server {
namespace {

// How long a statement waits for a lock held by another connection before UNAVAILABLE.
constexpr int kBusyTimeoutMs = 5000;

constexpr char kSchema[] = R"sql(
CREATE TABLE IF NOT EXISTS jobs (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  owner TEXT NOT NULL,
  state INTEGER NOT NULL,
  priority INTEGER NOT NULL,
  created_ms INTEGER NOT NULL,
  job BLOB NOT NULL  -- megatrain.v1.Job; its id is the id column
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state);
CREATE INDEX IF NOT EXISTS jobs_by_owner ON jobs (owner);
CREATE TABLE IF NOT EXISTS events (
  job_id INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
  seq INTEGER NOT NULL,
  unix_ms INTEGER NOT NULL,
  payload BLOB NOT NULL,  -- megatrain.v1.JobEvent; job_id, seq, unix_ms are the columns
  PRIMARY KEY (job_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS logs (
  job_id INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
  seq INTEGER NOT NULL,
  unix_ms INTEGER NOT NULL,
  text TEXT NOT NULL,
  PRIMARY KEY (job_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS audit (
  id INTEGER PRIMARY KEY,
  unix_ms INTEGER NOT NULL,
  user TEXT NOT NULL,
  action TEXT NOT NULL,
  job_id INTEGER NOT NULL,  -- no foreign key: the audit outlives what it describes
  detail TEXT NOT NULL,
  outcome TEXT NOT NULL DEFAULT ''  -- "ok", or the error the call returned
);
)sql";

// Tables new in schema 2: created with a new file, and by the upgrade from 1.
constexpr char kSchema2Tables[] = R"sql(
CREATE TABLE IF NOT EXISTS tokens (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  hash TEXT NOT NULL UNIQUE,  -- hex SHA-256 of the token; the token itself is never stored
  user TEXT NOT NULL,
  name TEXT NOT NULL,
  created_ms INTEGER NOT NULL,
  last_used_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS usage (
  user TEXT PRIMARY KEY,
  seconds REAL NOT NULL,     -- device seconds, decayed to updated_ms
  updated_ms INTEGER NOT NULL
) WITHOUT ROWID;
)sql";

// Schema 1 -> 2: the audit's outcome (then kSchema2Tables).
constexpr char kUpgrade1To2[] = "ALTER TABLE audit ADD COLUMN outcome TEXT NOT NULL DEFAULT '';";

constexpr char kInsertJob[] =
    "INSERT INTO jobs (owner, state, priority, created_ms, job) VALUES (?, ?, ?, ?, ?) "
    "RETURNING id";
constexpr char kUpdateJob[] =
    "UPDATE jobs SET owner = ?, state = ?, priority = ?, created_ms = ?, job = ? WHERE id = ?";
constexpr char kGetJob[] = "SELECT id, job FROM jobs WHERE id = ?";
constexpr char kJobsInState[] = "SELECT id, job FROM jobs WHERE state = ? ORDER BY id";
constexpr char kAppendEvent[] =
    "INSERT INTO events (job_id, seq, unix_ms, payload) "
    "SELECT ?1, COALESCE(MAX(seq), 0) + 1, ?2, ?3 FROM events WHERE job_id = ?1 RETURNING seq";
constexpr char kEventsAfter[] =
    "SELECT seq, unix_ms, payload FROM events WHERE job_id = ? AND seq > ? ORDER BY seq "
    "LIMIT ?";
constexpr char kLastEventSeq[] = "SELECT COALESCE(MAX(seq), 0) FROM events WHERE job_id = ?";
constexpr char kAppendLog[] =
    "INSERT INTO logs (job_id, seq, unix_ms, text) "
    "SELECT ?1, COALESCE(MAX(seq), 0) + 1, ?2, ?3 FROM logs WHERE job_id = ?1 RETURNING seq";
constexpr char kLogsAfter[] =
    "SELECT seq, unix_ms, text FROM logs WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?";
constexpr char kAudit[] =
    "INSERT INTO audit (unix_ms, user, action, job_id, detail, outcome) "
    "VALUES (?, ?, ?, ?, ?, ?)";
constexpr char kAuditLog[] =
    "SELECT id, unix_ms, user, action, job_id, detail, outcome FROM audit "
    "WHERE (?1 = '' OR user = ?1) AND (?2 = 0 OR job_id = ?2) ORDER BY id DESC LIMIT ?3";
constexpr char kInsertToken[] =
    "INSERT INTO tokens (hash, user, name, created_ms, last_used_ms) VALUES (?, ?, ?, ?, 0) "
    "RETURNING id";
constexpr char kTokenByHash[] = "SELECT id, user, name, created_ms, last_used_ms FROM tokens "
                                "WHERE hash = ?";
constexpr char kTouchToken[] = "UPDATE tokens SET last_used_ms = ? WHERE id = ?";
constexpr char kListTokens[] = "SELECT id, user, name, created_ms, last_used_ms FROM tokens "
                               "WHERE (?1 = '' OR user = ?1) ORDER BY id";
constexpr char kGetToken[] = "SELECT id, user, name, created_ms, last_used_ms FROM tokens "
                             "WHERE id = ?";
constexpr char kDeleteToken[] = "DELETE FROM tokens WHERE id = ?";
constexpr char kGetUsage[] = "SELECT user, seconds, updated_ms FROM usage";
constexpr char kPutUsage[] =
    "INSERT INTO usage (user, seconds, updated_ms) VALUES (?1, ?2, ?3) "
    "ON CONFLICT (user) DO UPDATE SET seconds = ?2, updated_ms = ?3";
constexpr char kUsageOf[] = "SELECT seconds, updated_ms FROM usage WHERE user = ?";
constexpr char kCountByState[] = "SELECT state, COUNT(*) FROM jobs GROUP BY state";

absl::Status JobNotFound(int64_t id) {
  return absl::NotFoundError(absl::StrCat("job ", id, " not found"));
}

absl::Status CheckLimit(int limit) {
  if (limit > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("limit must be at least 1, got ", limit));
}

// A number bound as REAL rather than INTEGER.
struct RealNumber {
  double value;
};

// Bytes bound as a BLOB rather than TEXT.
struct Blob {
  absl::string_view bytes;
};

// One use of a cached prepared statement: binds parameters left to right across Bind()
// calls; resets the statement and clears its bindings at scope exit.
class Query {
 public:
  explicit Query(sqlite3_stmt* stmt) : stmt_(stmt) {}
  ~Query() {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
  }
  Query(const Query&) = delete;
  Query& operator=(const Query&) = delete;

  // Returns the SQLite result code of the first bind that failed, or SQLITE_OK.
  template <typename... Args>
  int Bind(const Args&... args) {
    int rc = SQLITE_OK;
    ((rc = rc != SQLITE_OK ? rc : BindOne(++bound_, args)), ...);
    return rc;
  }
  int Step() { return sqlite3_step(stmt_); }
  // Steps an INSERT ... RETURNING of one integer to completion (the commit happens at
  // SQLITE_DONE); *value is the returned integer.
  int StepReturning(int64_t* value) {
    int rc = Step();
    if (rc != SQLITE_ROW) return rc == SQLITE_DONE ? SQLITE_INTERNAL : rc;
    *value = Int(0);
    return Step();
  }

  int64_t Int(int col) { return sqlite3_column_int64(stmt_, col); }
  double Real(int col) { return sqlite3_column_double(stmt_, col); }
  std::string Text(int col) {
    const unsigned char* text = sqlite3_column_text(stmt_, col);
    if (text == nullptr) return "";
    return std::string(reinterpret_cast<const char*>(text), sqlite3_column_bytes(stmt_, col));
  }
  bool Parse(int col, google::protobuf::MessageLite* message) {
    const void* bytes = sqlite3_column_blob(stmt_, col);
    const int size = sqlite3_column_bytes(stmt_, col);
    if (size == 0) {
      message->Clear();
      return true;
    }
    return message->ParseFromArray(bytes, size);
  }

 private:
  int BindOne(int index, int64_t value) { return sqlite3_bind_int64(stmt_, index, value); }
  int BindOne(int index, RealNumber value) {
    return sqlite3_bind_double(stmt_, index, value.value);
  }
  int BindOne(int index, absl::string_view text) {
    return sqlite3_bind_text64(stmt_, index, text.data(), text.size(), SQLITE_TRANSIENT,
                               SQLITE_UTF8);
  }
  int BindOne(int index, Blob blob) {
    return sqlite3_bind_blob64(stmt_, index, blob.bytes.data(), blob.bytes.size(),
                               SQLITE_TRANSIENT);
  }

  sqlite3_stmt* const stmt_;
  int bound_ = 0;
};

}  // namespace

void ReportWriteFailure(int64_t job_id, absl::string_view doing, const absl::Status& status) {
  const std::string job = job_id != 0 ? absl::StrCat("job ", job_id, ": ") : "";
  // One call, one line: lines of concurrent callers do not interleave.
  std::fprintf(stderr, "megatraind: %s%s failed: %s\n", job.c_str(), std::string(doing).c_str(),
               status.ToString().c_str());
}

JobStore::JobStore(std::string path) : path_(std::move(path)) {}

JobStore::~JobStore() {
  MutexLock lock(&mu_);
  for (auto& [sql, stmt] : statements_) sqlite3_finalize(stmt);
  sqlite3_close(db_);  // no-op on nullptr
}

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::Open(const std::string& path) {
  if (path.empty()) {
    return absl::InvalidArgumentError(
        "job store path is empty: pass a database file (e.g. /var/lib/megatrain/jobs.db)");
  }
  std::unique_ptr<JobStore> store(new JobStore(path));
  RETURN_IF_ERROR(store->Init());
  return store;
}

absl::Status JobStore::Init() {
  MutexLock lock(&mu_);
  // NOMUTEX: mu_ serializes every use of the connection.
  const int rc =
      sqlite3_open_v2(path_.c_str(), &db_,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  if (rc != SQLITE_OK) return Error(rc, "opening");
  sqlite3_extended_result_codes(db_, 1);
  sqlite3_busy_timeout(db_, kBusyTimeoutMs);
  return CreateOrCheckSchema();
}

absl::Status JobStore::CreateOrCheckSchema() {
  // Reading the version is the first access to the file: a non-database fails here,
  // and a newer schema is refused, before anything is written.
  ASSIGN_OR_RETURN(int version, ReadSchemaVersion());
  // If the file system cannot do WAL, SQLite keeps a rollback journal, which with
  // synchronous=FULL is just as durable.
  RETURN_IF_ERROR(Exec("PRAGMA journal_mode = WAL", "enabling WAL"));
  RETURN_IF_ERROR(Exec("PRAGMA synchronous = FULL", "setting synchronous=FULL"));
  RETURN_IF_ERROR(Exec("PRAGMA foreign_keys = ON", "enabling foreign keys"));
  if (version == kSchemaVersion) return absl::OkStatus();

  // A new file, or an older schema to upgrade. Re-read the version under the write lock
  // so that two daemons starting together do not both create or upgrade it.
  RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE", "creating the schema"));
  absl::StatusOr<int> locked_version = ReadSchemaVersion();
  absl::Status status = locked_version.status();
  if (status.ok() && *locked_version == 0) {
    status =
        Exec(absl::StrCat(kSchema, kSchema2Tables, "PRAGMA user_version = ", kSchemaVersion, ";"),
             "creating the schema");
  } else if (status.ok() && *locked_version == 1) {
    status = Exec(absl::StrCat(kUpgrade1To2, kSchema2Tables, "PRAGMA user_version = 2;"),
                  "upgrading the schema from version 1");
  }
  if (status.ok()) status = Exec("COMMIT", "creating the schema");
  if (!status.ok()) sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
  return status;
}

absl::StatusOr<int> JobStore::ReadSchemaVersion() {
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare("PRAGMA user_version"));
  Query query(stmt);
  const int rc = query.Step();
  if (rc != SQLITE_ROW) return Error(rc, "reading the schema version");
  const int64_t version = query.Int(0);
  if (version > kSchemaVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("job store ", path_, " has schema version ", version,
                     " but this megatraind knows ", "versions up to ", kSchemaVersion,
                     ": run a newer megatraind, or point it at ", "another database file"));
  }
  if (version < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job store ", path_, " has schema version ", version, ", which this megatraind ",
        "cannot upgrade: point it at another database file"));
  }
  return static_cast<int>(version);
}

absl::Status JobStore::Exec(const std::string& sql, absl::string_view doing) {
  return Error(sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, nullptr), doing);
}

absl::StatusOr<sqlite3_stmt*> JobStore::Prepare(const std::string& sql) {
  auto it = statements_.find(sql);
  if (it != statements_.end()) return it->second;
  sqlite3_stmt* stmt = nullptr;
  const int rc = sqlite3_prepare_v3(db_, sql.data(), static_cast<int>(sql.size()),
                                    SQLITE_PREPARE_PERSISTENT, &stmt, nullptr);
  if (rc != SQLITE_OK) return Error(rc, "preparing a query");
  MT_CHECK(stmt != nullptr);  // our SQL is never empty
  statements_.emplace(sql, stmt);
  return stmt;
}

absl::Status JobStore::Error(int rc, absl::string_view doing) {
  if (rc == SQLITE_OK || rc == SQLITE_ROW || rc == SQLITE_DONE) return absl::OkStatus();
  // sqlite3_errmsg describes the most recent failure on db_; without db_ (out of memory
  // at open) there is only the code.
  const std::string what = absl::StrCat("job store ", path_, ": ", doing, ": ",
                                        db_ != nullptr ? sqlite3_errmsg(db_) : sqlite3_errstr(rc));
  switch (rc & 0xff) {
    case SQLITE_NOTADB:
    case SQLITE_CORRUPT:
      return absl::DataLossError(absl::StrCat(
          what, "; the file is not a megatrain job store or is damaged: restore it from a ",
          "backup, or move it aside to start with an empty store"));
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      return absl::UnavailableError(absl::StrCat(
          what, "; another process holds the database locked (is a second megatraind using ",
          "it?): stop that process or retry"));
    case SQLITE_FULL:
      return absl::ResourceExhaustedError(
          absl::StrCat(what, "; free space on the file system that holds it"));
    case SQLITE_NOMEM:
      return absl::ResourceExhaustedError(absl::StrCat(what, "; the daemon is out of memory"));
    case SQLITE_TOOBIG:
      return absl::InvalidArgumentError(absl::StrCat(what, "; the record is too large to store"));
    case SQLITE_IOERR:
    case SQLITE_CANTOPEN:
    case SQLITE_READONLY:
    case SQLITE_PERM:
    case SQLITE_PROTOCOL:
      return absl::UnavailableError(absl::StrCat(
          what, "; check that the file and its directory exist and are writable by the ",
          "daemon, and that the disk is healthy"));
    default:
      return absl::InternalError(what);
  }
}

absl::StatusOr<std::vector<v1::Job>> JobStore::ReadJobs(sqlite3_stmt* stmt,
                                                        absl::string_view doing) {
  std::vector<v1::Job> jobs;
  while (true) {
    const int rc = sqlite3_step(stmt);
    if (rc == SQLITE_DONE) return jobs;
    if (rc != SQLITE_ROW) return Error(rc, doing);
    const int64_t id = sqlite3_column_int64(stmt, 0);
    v1::Job& job = jobs.emplace_back();
    const void* bytes = sqlite3_column_blob(stmt, 1);
    const int size = sqlite3_column_bytes(stmt, 1);
    if (size > 0 && !job.ParseFromArray(bytes, size)) {
      return absl::DataLossError(absl::StrCat("job store ", path_, ": job ", id,
                                              " does not parse as a megatrain.v1.Job; the ",
                                              "file is damaged: restore it from a backup"));
    }
    job.set_id(id);
  }
}

absl::StatusOr<int64_t> JobStore::Insert(v1::Job* job) {
  v1::Job stored = *job;
  stored.clear_id();
  if (stored.created_unix_ms() == 0) stored.set_created_unix_ms(NowUnixMs());
  const std::string bytes = stored.SerializeAsString();

  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kInsertJob));
  Query query(stmt);
  int64_t id = 0;
  int rc = query.Bind(stored.owner(), stored.state(), stored.priority(), stored.created_unix_ms(),
                      Blob{bytes});
  if (rc == SQLITE_OK) rc = query.StepReturning(&id);
  RETURN_IF_ERROR(Error(rc, "storing a new job"));
  stored.set_id(id);
  *job = std::move(stored);
  return id;
}

absl::Status JobStore::Update(const v1::Job& job) {
  v1::Job stored = job;
  stored.clear_id();
  const std::string bytes = stored.SerializeAsString();

  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kUpdateJob));
  Query query(stmt);
  int rc = query.Bind(job.owner(), job.state(), job.priority(), job.created_unix_ms(), Blob{bytes},
                      job.id());
  if (rc == SQLITE_OK) rc = query.Step();
  RETURN_IF_ERROR(Error(rc, absl::StrCat("updating job ", job.id())));
  if (sqlite3_changes64(db_) == 0) return JobNotFound(job.id());
  return absl::OkStatus();
}

absl::StatusOr<v1::Job> JobStore::Get(int64_t id) {
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kGetJob));
  Query query(stmt);
  RETURN_IF_ERROR(Error(query.Bind(id), "reading a job"));
  ASSIGN_OR_RETURN(std::vector<v1::Job> jobs, ReadJobs(stmt, absl::StrCat("reading job ", id)));
  if (jobs.empty()) return JobNotFound(id);
  return std::move(jobs.front());
}

absl::StatusOr<std::vector<v1::Job>> JobStore::List(const std::vector<v1::JobState>& states,
                                                    const std::string& owner, int64_t before_id,
                                                    int limit) {
  RETURN_IF_ERROR(CheckLimit(limit));
  if (before_id < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("before_id must be 0 (no bound) or a job id, got ", before_id));
  }
  // Unknown enum values match no job; dropping them and duplicates bounds the number of
  // distinct SQL texts, and so of cached statements, by 2 * 2^(number of states).
  std::vector<int64_t> wanted;
  for (v1::JobState state : states) {
    if (v1::JobState_IsValid(state)) wanted.push_back(state);
  }
  std::sort(wanted.begin(), wanted.end());
  wanted.erase(std::unique(wanted.begin(), wanted.end()), wanted.end());
  if (!states.empty() && wanted.empty()) return std::vector<v1::Job>();

  std::string sql = "SELECT id, job FROM jobs WHERE id < ?";
  if (!owner.empty()) absl::StrAppend(&sql, " AND owner = ?");
  if (!wanted.empty()) {
    absl::StrAppend(&sql, " AND state IN (?");
    for (size_t i = 1; i < wanted.size(); ++i) absl::StrAppend(&sql, ", ?");
    absl::StrAppend(&sql, ")");
  }
  absl::StrAppend(&sql, " ORDER BY id DESC LIMIT ?");

  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(sql));
  Query query(stmt);
  int rc = query.Bind(before_id == 0 ? std::numeric_limits<int64_t>::max() : before_id);
  if (rc == SQLITE_OK && !owner.empty()) rc = query.Bind(owner);
  for (int64_t state : wanted) {
    if (rc == SQLITE_OK) rc = query.Bind(state);
  }
  if (rc == SQLITE_OK) rc = query.Bind(limit);
  RETURN_IF_ERROR(Error(rc, "listing jobs"));
  return ReadJobs(stmt, "listing jobs");
}

absl::StatusOr<std::vector<v1::Job>> JobStore::ListInState(v1::JobState state) {
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kJobsInState));
  Query query(stmt);
  const std::string doing = absl::StrCat("listing jobs in state ", v1::JobState_Name(state));
  RETURN_IF_ERROR(Error(query.Bind(state), doing));
  return ReadJobs(stmt, doing);
}

absl::StatusOr<int64_t> JobStore::AppendEvent(int64_t job_id, v1::JobEvent* event) {
  v1::JobEvent payload = *event;
  const int64_t unix_ms = payload.unix_ms() != 0 ? payload.unix_ms() : NowUnixMs();
  payload.clear_job_id();
  payload.clear_seq();
  payload.clear_unix_ms();
  const std::string bytes = payload.SerializeAsString();

  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kAppendEvent));
  Query query(stmt);
  int64_t seq = 0;
  int rc = query.Bind(job_id, unix_ms, Blob{bytes});
  if (rc == SQLITE_OK) rc = query.StepReturning(&seq);
  if (rc == SQLITE_CONSTRAINT_FOREIGNKEY) return JobNotFound(job_id);
  RETURN_IF_ERROR(Error(rc, absl::StrCat("appending an event to job ", job_id)));
  event->set_job_id(job_id);
  event->set_seq(seq);
  event->set_unix_ms(unix_ms);
  return seq;
}

absl::StatusOr<int64_t> JobStore::LastEventSeq(int64_t job_id) {
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kLastEventSeq));
  Query query(stmt);
  const std::string doing = absl::StrCat("reading the last event of job ", job_id);
  RETURN_IF_ERROR(Error(query.Bind(job_id), doing));
  const int rc = query.Step();
  if (rc != SQLITE_ROW) return Error(rc, doing);
  return query.Int(0);
}

absl::StatusOr<std::vector<v1::JobEvent>> JobStore::EventsAfter(int64_t job_id, int64_t after_seq,
                                                                int limit) {
  RETURN_IF_ERROR(CheckLimit(limit));
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kEventsAfter));
  Query query(stmt);
  const std::string doing = absl::StrCat("reading events of job ", job_id);
  RETURN_IF_ERROR(Error(query.Bind(job_id, after_seq, limit), doing));
  std::vector<v1::JobEvent> events;
  while (true) {
    const int rc = query.Step();
    if (rc == SQLITE_DONE) return events;
    if (rc != SQLITE_ROW) return Error(rc, doing);
    v1::JobEvent& event = events.emplace_back();
    if (!query.Parse(2, &event)) {
      return absl::DataLossError(absl::StrCat(
          "job store ", path_, ": event ", query.Int(0), " of job ", job_id, " does not ",
          "parse as a megatrain.v1.JobEvent; the file is damaged: restore it from a backup"));
    }
    event.set_job_id(job_id);
    event.set_seq(query.Int(0));
    event.set_unix_ms(query.Int(1));
  }
}

absl::StatusOr<int64_t> JobStore::AppendLog(int64_t job_id, v1::LogLine* line) {
  const int64_t unix_ms = line->unix_ms() != 0 ? line->unix_ms() : NowUnixMs();
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kAppendLog));
  Query query(stmt);
  int64_t seq = 0;
  int rc = query.Bind(job_id, unix_ms, line->text());
  if (rc == SQLITE_OK) rc = query.StepReturning(&seq);
  if (rc == SQLITE_CONSTRAINT_FOREIGNKEY) return JobNotFound(job_id);
  RETURN_IF_ERROR(Error(rc, absl::StrCat("appending a log line to job ", job_id)));
  line->set_seq(seq);
  line->set_unix_ms(unix_ms);
  return seq;
}

absl::StatusOr<std::vector<v1::LogLine>> JobStore::LogsAfter(int64_t job_id, int64_t after_seq,
                                                             int limit) {
  RETURN_IF_ERROR(CheckLimit(limit));
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kLogsAfter));
  Query query(stmt);
  const std::string doing = absl::StrCat("reading logs of job ", job_id);
  RETURN_IF_ERROR(Error(query.Bind(job_id, after_seq, limit), doing));
  std::vector<v1::LogLine> lines;
  while (true) {
    const int rc = query.Step();
    if (rc == SQLITE_DONE) return lines;
    if (rc != SQLITE_ROW) return Error(rc, doing);
    v1::LogLine& line = lines.emplace_back();
    line.set_seq(query.Int(0));
    line.set_unix_ms(query.Int(1));
    line.set_text(query.Text(2));
  }
}

absl::Status JobStore::Audit(const AuditEntry& entry) {
  const int64_t unix_ms = NowUnixMs();
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kAudit));
  Query query(stmt);
  int rc = query.Bind(unix_ms, entry.user, entry.action, entry.job_id, entry.detail,
                      entry.outcome);
  if (rc == SQLITE_OK) rc = query.Step();
  return Error(rc, "recording an audit entry");
}

absl::Status JobStore::Audit(const std::string& user, const std::string& action, int64_t job_id,
                             const std::string& detail) {
  AuditEntry entry;
  entry.user = user;
  entry.action = action;
  entry.job_id = job_id;
  entry.detail = detail;
  entry.outcome = "ok";
  return Audit(entry);
}

absl::StatusOr<std::vector<AuditEntry>> JobStore::AuditLog(int limit, const std::string& user,
                                                           int64_t job_id) {
  RETURN_IF_ERROR(CheckLimit(limit));
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kAuditLog));
  Query query(stmt);
  RETURN_IF_ERROR(Error(query.Bind(user, job_id, static_cast<int64_t>(limit)),
                        "reading the audit log"));
  std::vector<AuditEntry> entries;
  while (true) {
    const int rc = query.Step();
    if (rc == SQLITE_DONE) return entries;
    if (rc != SQLITE_ROW) return Error(rc, "reading the audit log");
    entries.push_back(AuditEntry{query.Int(0), query.Int(1), query.Text(2), query.Text(3),
                                 query.Int(4), query.Text(5), query.Text(6)});
  }
}

absl::StatusOr<int64_t> JobStore::InsertToken(const std::string& hash, const std::string& user,
                                              const std::string& name) {
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kInsertToken));
  Query query(stmt);
  int64_t id = 0;
  int rc = query.Bind(hash, user, name, NowUnixMs());
  if (rc == SQLITE_OK) rc = query.StepReturning(&id);
  RETURN_IF_ERROR(Error(rc, "storing a token"));
  return id;
}

namespace {
TokenRecord ReadToken(Query& query) {
  return TokenRecord{query.Int(0), query.Text(1), query.Text(2), query.Int(3), query.Int(4)};
}
}  // namespace

absl::StatusOr<TokenRecord> JobStore::UseToken(const std::string& hash) {
  MutexLock lock(&mu_);
  TokenRecord token;
  {
    ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kTokenByHash));
    Query query(stmt);
    RETURN_IF_ERROR(Error(query.Bind(hash), "looking up a token"));
    const int rc = query.Step();
    if (rc == SQLITE_DONE) return absl::NotFoundError("no such token");
    if (rc != SQLITE_ROW) return Error(rc, "looking up a token");
    token = ReadToken(query);
  }
  // Recorded at most once a minute: a busy client does not write on every call.
  const int64_t now = NowUnixMs();
  if (now - token.last_used_ms > 60'000) {
    ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kTouchToken));
    Query query(stmt);
    int rc = query.Bind(now, token.id);
    if (rc == SQLITE_OK) rc = query.Step();
    RETURN_IF_ERROR(Error(rc, "recording a token's use"));
    token.last_used_ms = now;
  }
  return token;
}

absl::StatusOr<std::vector<TokenRecord>> JobStore::ListTokens(const std::string& user) {
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kListTokens));
  Query query(stmt);
  RETURN_IF_ERROR(Error(query.Bind(user), "listing tokens"));
  std::vector<TokenRecord> tokens;
  while (true) {
    const int rc = query.Step();
    if (rc == SQLITE_DONE) return tokens;
    if (rc != SQLITE_ROW) return Error(rc, "listing tokens");
    tokens.push_back(ReadToken(query));
  }
}

absl::StatusOr<TokenRecord> JobStore::GetToken(int64_t id) {
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kGetToken));
  Query query(stmt);
  RETURN_IF_ERROR(Error(query.Bind(id), "reading a token"));
  const int rc = query.Step();
  if (rc == SQLITE_DONE) return absl::NotFoundError(absl::StrCat("token ", id, " not found"));
  if (rc != SQLITE_ROW) return Error(rc, "reading a token");
  return ReadToken(query);
}

absl::Status JobStore::DeleteToken(int64_t id) {
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kDeleteToken));
  Query query(stmt);
  int rc = query.Bind(id);
  if (rc == SQLITE_OK) rc = query.Step();
  RETURN_IF_ERROR(Error(rc, "deleting a token"));
  if (sqlite3_changes(db_) == 0) {
    return absl::NotFoundError(absl::StrCat("token ", id, " not found"));
  }
  return absl::OkStatus();
}

namespace {
// `seconds` recorded at `from_ms`, decayed to `to_ms` with half-life `half_life_s`.
double Decayed(double seconds, int64_t from_ms, int64_t to_ms, double half_life_s) {
  if (half_life_s <= 0 || to_ms <= from_ms) return seconds;
  return seconds * std::exp2(-(to_ms - from_ms) / 1000.0 / half_life_s);
}
}  // namespace

absl::Status JobStore::AddUsage(const std::string& user, double seconds, double half_life_s,
                                absl::Time now) {
  const int64_t now_ms = absl::ToUnixMillis(now);
  MutexLock lock(&mu_);
  double total = seconds;
  {
    ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kUsageOf));
    Query query(stmt);
    RETURN_IF_ERROR(Error(query.Bind(user), "reading usage"));
    const int rc = query.Step();
    if (rc == SQLITE_ROW) {
      total += Decayed(query.Real(0), query.Int(1), now_ms, half_life_s);
    } else if (rc != SQLITE_DONE) {
      return Error(rc, "reading usage");
    }
  }
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kPutUsage));
  Query query(stmt);
  int rc = query.Bind(user, RealNumber{total}, now_ms);
  if (rc == SQLITE_OK) rc = query.Step();
  return Error(rc, "recording usage");
}

absl::StatusOr<std::map<std::string, double>> JobStore::Usage(double half_life_s,
                                                              absl::Time now) {
  const int64_t now_ms = absl::ToUnixMillis(now);
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kGetUsage));
  Query query(stmt);
  std::map<std::string, double> usage;
  while (true) {
    const int rc = query.Step();
    if (rc == SQLITE_DONE) return usage;
    if (rc != SQLITE_ROW) return Error(rc, "reading usage");
    usage[query.Text(0)] = Decayed(query.Real(1), query.Int(2), now_ms, half_life_s);
  }
}

absl::StatusOr<std::map<v1::JobState, int64_t>> JobStore::CountByState() {
  std::map<v1::JobState, int64_t> counts;
  for (int state = v1::JobState_MIN; state <= v1::JobState_MAX; ++state) {
    if (v1::JobState_IsValid(state) && state != v1::JOB_STATE_UNSPECIFIED) {
      counts[static_cast<v1::JobState>(state)] = 0;
    }
  }
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(kCountByState));
  Query query(stmt);
  while (true) {
    const int rc = query.Step();
    if (rc == SQLITE_DONE) return counts;
    if (rc != SQLITE_ROW) return Error(rc, "counting jobs by state");
    counts[static_cast<v1::JobState>(query.Int(0))] = query.Int(1);
  }
}

}  // namespace megatrain::server
