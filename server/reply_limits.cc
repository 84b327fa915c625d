// Bounds of reply_limits.h. The bounds are far above anything a daemon of today stores
// (it refuses such names at submit): they exist for what older daemons stored, and cost
// a job nothing until one of its fields is absurd.
#include "server/reply_limits.h"

#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"

namespace megatrain::server {
namespace {

// A length-delimited field: its tag (one byte for field numbers below 16) and a varint
// length of at most 5 bytes. An over-estimate is fine: the budget has room to spare.
constexpr size_t kFramingBytes = 6;

}  // namespace

bool TruncateForReply(std::string* text, size_t max_bytes) {
  if (text->size() <= max_bytes) return false;
  const size_t original_bytes = text->size();
  size_t cut = max_bytes;
  // Back to the start of the UTF-8 sequence the cut falls in: a string field must stay
  // valid UTF-8, or protobuf refuses to parse the reply.
  while (cut > 0 && (static_cast<uint8_t>((*text)[cut]) & 0xC0) == 0x80) --cut;
  text->resize(cut);
  absl::StrAppend(text, "... (truncated, ", original_bytes, " bytes)");
  return true;
}

void BoundJobForReply(v1::Job* job) {
  TruncateForReply(job->mutable_name(), kMaxNameBytes);
  TruncateForReply(job->mutable_owner(), kMaxNameBytes);
  TruncateForReply(job->mutable_spec_yaml(), kMaxSpecYamlBytes);
  TruncateForReply(job->mutable_checkpoint_dir(), kMaxShortTextBytes);
  TruncateForReply(job->mutable_last_checkpoint(), kMaxShortTextBytes);
  TruncateForReply(job->mutable_error(), kMaxErrorBytes);
  TruncateForReply(job->mutable_device(), kMaxShortTextBytes);
  TruncateForReply(job->mutable_waiting(), kMaxShortTextBytes);
  if (!job->has_plan()) return;
  v1::JobPlan* plan = job->mutable_plan();
  TruncateForReply(plan->mutable_bound(), kMaxShortTextBytes);
  TruncateForReply(plan->mutable_text(), kMaxErrorBytes);
  if (plan->warnings_size() > kMaxPlanWarnings) {
    const int dropped = plan->warnings_size() - kMaxPlanWarnings;
    plan->mutable_warnings()->DeleteSubrange(kMaxPlanWarnings, dropped);
    plan->add_warnings(absl::StrCat("... (", dropped, " more warnings truncated)"));
  }
  for (std::string& warning : *plan->mutable_warnings()) {
    TruncateForReply(&warning, kMaxShortTextBytes);
  }
}

void BoundJobEventForReply(v1::JobEvent* event) {
  if (event->has_state_change()) BoundJobForReply(event->mutable_state_change());
}

void BoundLogLineForReply(v1::LogLine* line) {
  TruncateForReply(line->mutable_text(), kMaxErrorBytes);
}

void BoundAuditEntryForReply(v1::AuditEntry* entry) {
  TruncateForReply(entry->mutable_user(), kMaxNameBytes);
  TruncateForReply(entry->mutable_action(), kMaxNameBytes);
  TruncateForReply(entry->mutable_detail(), kMaxShortTextBytes);
  TruncateForReply(entry->mutable_outcome(), kMaxErrorBytes);
}

bool ReplyBudget::Take(const google::protobuf::Message& message) {
  const size_t bytes = message.ByteSizeLong() + kFramingBytes;
  if (bytes > left_bytes_) return false;
  left_bytes_ -= bytes;
  return true;
}

void FillListJobsReply(std::vector<v1::Job> jobs, int limit, v1::ListJobsResponse* reply,
                       size_t budget_bytes) {
  ReplyBudget budget(budget_bytes);
  int added = 0;
  for (v1::Job& job : jobs) {
    if (added == limit) break;
    BoundJobForReply(&job);
    // The first job goes in whatever its size: an empty page with a token would send the
    // client round in circles.
    if (!budget.Take(job) && added > 0) break;
    *reply->add_jobs() = std::move(job);
    ++added;
  }
  if (added > 0 && added < static_cast<int>(jobs.size())) {
    reply->set_next_page_token(absl::StrCat(reply->jobs(added - 1).id()));
  }
}

}  // namespace megatrain::server
