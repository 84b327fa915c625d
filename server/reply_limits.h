// Reply limits: every message megatraind sends stays under gRPC's 4 MiB limit on a
// received message, whatever the store holds.
//
// The store may hold text of any size: a job named with megabytes of text by an older
// daemon, a huge error, a log line without newlines. Sent as stored, one such job made
// every `list` and `status` fail, for every user, with RESOURCE_EXHAUSTED on the client.
// So text fields are cut, on a UTF-8 boundary, to a bound of their own, and the cut is
// said in the text itself ("... (truncated, N bytes)"); a page of jobs stops early at a
// byte budget and hands the rest to the next page, as if page_size had been smaller.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "google/protobuf/message.h"
#include "megatrain/v1/access.pb.h"
#include "megatrain/v1/jobs.pb.h"

namespace megatrain::server {

// The most bytes of jobs one ListJobs reply carries (the client's limit is 4 MiB).
inline constexpr size_t kListReplyBudgetBytes = 3 << 20;

// Bounds on single fields, in bytes before the marker. Each Job stays under ~1 MiB.
inline constexpr size_t kMaxNameBytes = 1 << 10;        // name, owner
inline constexpr size_t kMaxShortTextBytes = 4 << 10;   // paths, waiting, device, a warning
inline constexpr size_t kMaxErrorBytes = 64 << 10;      // error, plan text, a log line
inline constexpr size_t kMaxSpecYamlBytes = 256 << 10;  // spec_yaml
inline constexpr int kMaxPlanWarnings = 64;

// Cuts `*text` to at most `max_bytes` bytes, never inside a UTF-8 sequence, and appends
// "... (truncated, N bytes)" where N is its size before. Returns whether it cut.
bool TruncateForReply(std::string* text, size_t max_bytes);

// Bounds every text field of `job` (and of its plan) as above. Numbers are untouched.
void BoundJobForReply(v1::Job* job);

// A state change's job bounded; progress events are numbers and pass as they are.
void BoundJobEventForReply(v1::JobEvent* event);

void BoundLogLineForReply(v1::LogLine* line);

void BoundAuditEntryForReply(v1::AuditEntry* entry);

// Counts the bytes of a reply's repeated field as messages are added to it.
//
//   ReplyBudget budget;
//   for (v1::AuditEntry& e : entries) {
//     BoundAuditEntryForReply(&e);
//     if (!budget.Take(e)) break;  // the reply stops here
//     *reply.add_entries() = std::move(e);
//   }
class ReplyBudget {
 public:
  explicit ReplyBudget(size_t budget_bytes = kListReplyBudgetBytes) : left_bytes_(budget_bytes) {}

  // Whether `message`, framed as an element of a repeated field, fits in what is left;
  // if so, counts it as spent.
  bool Take(const google::protobuf::Message& message);

 private:
  size_t left_bytes_;
};

// Adds `jobs` (newest first, as the store lists them), each bounded, to `reply` until it
// holds `limit` jobs or the next one would take it past `budget_bytes` (it always holds at
// least one). Where jobs remain (more than `limit` were read, or the budget stopped it),
// next_page_token is the id of the last job added: ListJobs' token, "list jobs older
// than this one".
void FillListJobsReply(std::vector<v1::Job> jobs, int limit, v1::ListJobsResponse* reply,
                       size_t budget_bytes = kListReplyBudgetBytes);

}  // namespace megatrain::server
