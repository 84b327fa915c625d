// Text views of jobs and the node. Missing values print as "-" so that columns and
// "key: value" lines stay aligned and greppable.
#include "client/views.h"

#include <map>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/format.h"

namespace megatrain::client {
namespace {

// "2025-11-29 11:30:05 (5m ago)", or "-".
std::string TimeWithAge(int64_t unix_ms, int64_t now_unix_ms, absl::TimeZone tz) {
  if (unix_ms == 0) return "-";
  return absl::StrCat(FormatLocalTime(unix_ms, tz), " (", FormatAge(now_unix_ms - unix_ms),
                      " ago)");
}

std::string LastStepStats(const v1::Progress& p) {
  // A generate or eval job's steps decode tokens: no learning rate or gradient to show.
  if (p.step() == 0 || p.prompts_total() > 0) return "";
  return absl::StrFormat("lr %.3e  grad norm %.3f  %.2f TFLOP/s  %.2f s/step", p.learning_rate(),
                         p.grad_norm(), p.tflops(), p.step_seconds());
}

std::string Indented(const std::string& text) {
  std::string out;
  for (absl::string_view line : absl::StrSplit(TerminalLines(text), '\n')) {
    if (!line.empty()) absl::StrAppend(&out, "  ", line, "\n");
  }
  return out;
}

// The last evaluation: its loss and perplexity, a DPO job's loss and pairs' metrics.
std::string LastEvalStats(const v1::Progress& p) {
  if (!p.has_eval_loss()) return "";
  if (p.has_eval_preference()) {
    const v1::Preference& e = p.eval_preference();
    return absl::StrFormat("step %d: loss %.4f, rewards/accuracies %.3f, rewards/margins %.4f, "
                           "rewards/chosen %.4f, rewards/rejected %.4f (%d pairs)",
                           p.eval_step(), p.eval_loss(), e.rewards_accuracies(),
                           e.rewards_margins(), e.rewards_chosen(), e.rewards_rejected(),
                           e.pairs());
  }
  return absl::StrFormat("step %d: loss %.4f, perplexity %.3f", p.eval_step(), p.eval_loss(),
                         p.eval_perplexity());
}

}  // namespace

std::string FormatJobTable(const std::vector<v1::Job>& jobs, int64_t now_unix_ms) {
  const std::vector<Column> columns = {
      {"ID", true},   {"NAME"},       {"OWNER"},       {"STATE"},
      {"STEP", true}, {"LOSS", true}, {"TOK/S", true}, {"AGE", true},
  };
  std::vector<std::vector<std::string>> rows;
  for (const v1::Job& job : jobs) {
    const v1::Progress& p = job.progress();
    rows.push_back(
        {absl::StrCat(job.id()), job.name().empty() ? "-" : job.name(),
         job.owner().empty() ? "-" : job.owner(), StateName(job.state()), FormatStep(p),
         FormatLoss(p), p.tokens_per_second() > 0 ? FormatHumanNumber(p.tokens_per_second()) : "-",
         job.created_unix_ms() == 0 ? "-" : FormatAge(now_unix_ms - job.created_unix_ms())});
  }
  return FormatTable(columns, rows);
}

std::string FormatJobStatus(const v1::Job& job, int64_t now_unix_ms, absl::TimeZone tz) {
  const v1::Progress& p = job.progress();
  std::vector<std::pair<std::string, std::string>> items = {
      {"id", absl::StrCat(job.id())},
      {"name", job.name()},
      {"owner", job.owner()},
      {"state", StateName(job.state())},
      {"priority", absl::StrCat(job.priority())},
      {"device", job.device()},
      {"progress", FormatProgressLine(p, ScoresAnswers(job))},
      {"last step", LastStepStats(p)},
      {"last eval", LastEvalStats(p)},
      {"host memory", job.host_bytes_estimate() > 0 ? FormatGiB(job.host_bytes_estimate()) : ""},
      {"checkpoint_dir", job.checkpoint_dir()},
      {"last_checkpoint", job.last_checkpoint()},
  };
  if (!job.waiting().empty()) items.insert(items.begin() + 4, {"waiting", job.waiting()});
  if (job.resumed_from_step() > 0) {
    const bool final_step = p.total_steps() > 0 && job.resumed_from_step() >= p.total_steps();
    items.emplace_back("resumed from",
                       absl::StrCat("step ", job.resumed_from_step(),
                                    final_step ? " (its final checkpoint: nothing left to do)" : ""));
  }
  if (job.preemptions() > 0) {
    items.emplace_back("preempted", absl::StrCat(job.preemptions(), " time(s), resumed each time"));
  }
  items.emplace_back("error", job.error());
  items.emplace_back("created", TimeWithAge(job.created_unix_ms(), now_unix_ms, tz));
  items.emplace_back("started", TimeWithAge(job.started_unix_ms(), now_unix_ms, tz));
  items.emplace_back("finished", TimeWithAge(job.finished_unix_ms(), now_unix_ms, tz));
  items.emplace_back("spec", job.spec_yaml().empty() ? "" : "(as the daemon runs it)");
  return FormatKeyValues(items) + Indented(job.spec_yaml());
}

bool ScoresAnswers(const v1::Job& job) { return job.kind() == "eval"; }

std::string FormatJobState(const v1::Job& job) {
  std::string line = absl::StrCat(JobLabel(job), ": ", StateName(job.state()));
  if (job.state() == v1::JOB_STATE_RUNNING && !job.device().empty()) {
    absl::StrAppend(&line, " on ", TerminalText(job.device()));
  }
  return line;
}

std::string JobLabel(const v1::Job& job) {
  if (job.name().empty()) return absl::StrCat("job ", job.id());
  return absl::StrCat("job ", job.id(), " (", TerminalText(job.name()), ")");
}

std::string FormatSubmitted(const v1::Job& job) {
  return absl::StrCat("submitted ", JobLabel(job), ", ", StateName(job.state()));
}

std::string FormatNode(const v1::Node& node) {
  const std::map<std::string, std::string> sorted(node.versions().begin(), node.versions().end());
  std::vector<std::string> libs;
  for (const auto& [lib, version] : sorted) libs.push_back(absl::StrCat(lib, " ", version));
  std::string version = node.version();
  if (!libs.empty()) absl::StrAppend(&version, " (", absl::StrJoin(libs, ", "), ")");
  std::vector<std::pair<std::string, std::string>> items = {
      {"hostname", node.hostname()},
      {"backend", node.backend()},
      {"version", version},
      {"cpus", node.cpu_count() > 0 ? absl::StrCat(node.cpu_count()) : ""},
      {"host memory",
       absl::StrCat(FormatGiB(node.host_memory_total_bytes()), " total, ",
                    FormatGiB(node.host_memory_reserved_bytes()), " reserved by jobs, ",
                    FormatGiB(node.host_memory_free_bytes()), " free")},
  };
  if (node.nvme_reserved_bytes() > 0) {
    items.push_back({"nvme", absl::StrCat(FormatGiB(node.nvme_reserved_bytes()),
                                          " of jobs' optimizer state on disk")});
  }
  std::string out = FormatKeyValues(items);

  out += "\n";
  if (node.gpus().empty()) {
    out += "GPUs: none\n";
  } else {
    std::vector<std::vector<std::string>> rows;
    for (const v1::Gpu& g : node.gpus()) {
      rows.push_back({absl::StrCat(g.index()), g.name(), FormatGiB(g.memory_bytes()),
                      g.numa_node() < 0 ? "-" : absl::StrCat(g.numa_node()),
                      g.pcie_link().empty() ? "-" : g.pcie_link(),
                      g.pci_bus_id().empty() ? "-" : g.pci_bus_id(),
                      g.running_job() == 0 ? "-" : absl::StrCat(g.running_job())});
    }
    out += FormatTable({{"GPU", true},
                        {"NAME"},
                        {"MEMORY", true},
                        {"NUMA", true},
                        {"PCIE LINK"},
                        {"PCI BUS ID"},
                        {"JOB", true}},
                       rows);
  }

  if (!node.numa_nodes().empty()) {
    std::vector<std::vector<std::string>> rows;
    for (const v1::NumaNode& n : node.numa_nodes()) {
      rows.push_back({absl::StrCat(n.id()), FormatGiB(n.memory_total_bytes()),
                      FormatGiB(n.memory_free_bytes()),
                      FormatCpuList({n.cpus().begin(), n.cpus().end()})});
    }
    out += "\n";
    out += FormatTable({{"NUMA", true}, {"MEMORY", true}, {"FREE", true}, {"CPUS"}}, rows);
  }
  return out;
}

}  // namespace megatrain::client
