// Formatting rules of format.h. Widths count UTF-8 code points, not bytes, so that a job
// name like "müller-7b" does not push its row out of line.
#include "client/format.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/common/printable.h"

namespace megatrain::client {
namespace {

constexpr v1::JobState kStates[] = {
    v1::JOB_STATE_QUEUED,    v1::JOB_STATE_HELD,   v1::JOB_STATE_RUNNING,
    v1::JOB_STATE_SUCCEEDED, v1::JOB_STATE_FAILED, v1::JOB_STATE_CANCELLED,
};

// The code point of the valid UTF-8 sequence of `n` bytes at text[i].
uint32_t CodePoint(absl::string_view text, size_t i, size_t n) {
  static constexpr uint8_t kLeadMask[] = {0, 0x7F, 0x1F, 0x0F, 0x07};
  uint32_t cp = static_cast<uint8_t>(text[i]) & kLeadMask[n];
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<uint8_t>(text[i + k]) & 0x3F);
  return cp;
}

// Code points that Printable() lets through but a terminal obeys or that reorder a line.
bool HiddenControl(uint32_t cp) {
  return (cp >= 0x80 && cp <= 0x9F) || cp == 0x2028 || cp == 0x2029 ||
         (cp >= 0x202A && cp <= 0x202E) || (cp >= 0x2066 && cp <= 0x2069);
}

// `printable` (Printable()'s output: valid UTF-8) with each HiddenControl() as \uNNNN.
std::string EscapeHiddenControls(absl::string_view printable) {
  std::string out;
  out.reserve(printable.size());
  for (size_t i = 0; i < printable.size();) {
    const size_t n = std::max<size_t>(Utf8SequenceLength(printable, i), 1);
    const uint32_t cp = CodePoint(printable, i, n);
    if (n > 1 && HiddenControl(cp)) {
      absl::StrAppendFormat(&out, "\\u%04x", cp);
    } else {
      out.append(printable.data() + i, n);
    }
    i += n;
  }
  return out;
}

// "0:01:23" left; "0:00:00" once `done` reaches `total`; "-" while unknown.
std::string Eta(const v1::Progress& p, int64_t done, int64_t total) {
  if (total > 0 && done >= total) return FormatDuration(0);
  if (p.eta_seconds() > 0) return FormatDuration(p.eta_seconds());
  return "-";
}

std::string Rate(const v1::Progress& p) {
  return p.tokens_per_second() > 0 ? FormatHumanNumber(p.tokens_per_second()) : "-";
}

// A generate or eval job's progress line (format.h's FormatProgressLine).
std::string PromptsLine(const v1::Progress& p, bool scored) {
  const std::string accuracy =
      scored && p.prompts_done() > 0
          ? absl::StrFormat("  accuracy %.4f (%d/%d)", p.accuracy(), p.correct(), p.prompts_done())
          : "";
  return absl::StrCat("prompts ", p.prompts_done(), "/", p.prompts_total(), accuracy, "  ", Rate(p),
                      " tok/s  ETA ", Eta(p, p.prompts_done(), p.prompts_total()));
}

size_t DisplayWidth(absl::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

void AppendPadded(std::string* out, absl::string_view cell, size_t width, bool right) {
  const std::string pad(width - std::min(width, DisplayWidth(cell)), ' ');
  absl::StrAppend(out, right ? pad : "", cell, right ? "" : pad);
}

}  // namespace

std::string TerminalText(absl::string_view text) { return EscapeHiddenControls(Printable(text)); }

std::string TerminalLines(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t begin = 0; begin <= text.size();) {
    const size_t end = std::min(text.find_first_of("\n\t", begin), text.size());
    absl::StrAppend(&out, TerminalText(text.substr(begin, end - begin)));
    if (end < text.size()) out += text[end];
    begin = end + 1;
  }
  return out;
}

std::string StateName(v1::JobState state) {
  switch (state) {
    case v1::JOB_STATE_QUEUED:
      return "queued";
    case v1::JOB_STATE_HELD:
      return "held";
    case v1::JOB_STATE_RUNNING:
      return "running";
    case v1::JOB_STATE_SUCCEEDED:
      return "succeeded";
    case v1::JOB_STATE_FAILED:
      return "failed";
    case v1::JOB_STATE_CANCELLED:
      return "cancelled";
    default:
      return "unknown";
  }
}

bool ParseStateName(absl::string_view name, v1::JobState* state) {
  for (v1::JobState s : kStates) {
    if (name == StateName(s)) {
      *state = s;
      return true;
    }
  }
  return false;
}

std::vector<std::string> StateNames() {
  std::vector<std::string> names;
  for (v1::JobState s : kStates) names.push_back(StateName(s));
  return names;
}

bool IsTerminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

std::string FormatHumanNumber(double value) {
  if (!(value >= 0) || std::isinf(value)) return "-";
  if (value < 999.5) return absl::StrFormat("%.0f", value);
  constexpr char kUnits[] = "kMGT";
  double scaled = value;
  for (int i = 0; i < 4; ++i) {
    scaled /= 1000;
    // Three significant digits at most; 999.96k rounds up into the next unit.
    if (scaled < 99.95) return absl::StrFormat("%.1f%c", scaled, kUnits[i]);
    if (scaled < 999.5 || i == 3) return absl::StrFormat("%.0f%c", scaled, kUnits[i]);
  }
  return "-";  // not reached
}

std::string FormatGiB(int64_t bytes) {
  return absl::StrFormat("%.1f GiB", static_cast<double>(bytes) / (1024.0 * 1024 * 1024));
}

std::string FormatDuration(double seconds) {
  // 1e12 s keeps llround in range; an ETA that large is noise anyway.
  if (!(seconds >= 0) || seconds > 1e12) return "-";
  const long long total = std::llround(seconds);
  return absl::StrFormat("%d:%02d:%02d", total / 3600, total / 60 % 60, total % 60);
}

std::string FormatAge(int64_t age_ms) {
  const int64_t s = std::max<int64_t>(age_ms, 0) / 1000;
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrCat(s / 60, "m");
  if (s < 86400) return absl::StrCat(s / 3600, "h");
  return absl::StrCat(s / 86400, "d");
}

std::string FormatLocalTime(int64_t unix_ms, absl::TimeZone tz) {
  if (unix_ms == 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMillis(unix_ms), tz);
}

std::string FormatCpuList(std::vector<int> cpus) {
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  std::vector<std::string> ranges;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    ranges.push_back(j == i ? absl::StrCat(cpus[i]) : absl::StrCat(cpus[i], "-", cpus[j]));
    i = j + 1;
  }
  return absl::StrJoin(ranges, ",");
}

std::string FormatStep(const v1::Progress& p) {
  if (p.total_steps() > 0) return absl::StrCat(p.step(), "/", p.total_steps());
  if (p.step() > 0) return absl::StrCat(p.step());
  return "-";
}

std::string FormatLoss(const v1::Progress& p) {
  if (!p.has_loss() || !std::isfinite(p.loss())) return "-";
  return absl::StrFormat("%.4f", p.loss());
}

std::string FormatProgressLine(const v1::Progress& p, bool scored) {
  if (p.prompts_total() > 0) return PromptsLine(p, scored);
  const std::string eta = Eta(p, p.step(), p.total_steps());
  const std::string rate = Rate(p);
  // MoE models: the load-balancing loss beside the LM loss.
  const std::string aux = p.has_aux_loss() && std::isfinite(p.aux_loss())
                              ? absl::StrFormat("  aux %.4f", p.aux_loss())
                              : "";
  // The newest evaluation of the held-out set, and the step it measured.
  const std::string eval =
      p.has_eval_loss() && std::isfinite(p.eval_loss())
          ? absl::StrFormat("  eval %.4f@%d", p.eval_loss(), p.eval_step())
          : "";
  // A DPO job: the share of pairs it ranks right and the reward margin.
  const std::string dpo =
      p.has_preference() ? absl::StrFormat("  acc %.2f  margin %.3f",
                                           p.preference().rewards_accuracies(),
                                           p.preference().rewards_margins())
                         : "";
  return absl::StrCat("step ", FormatStep(p), "  loss ", FormatLoss(p), aux, dpo, eval, "  ",
                      rate, " tok/s  ETA ", eta);
}

std::string FormatProgressBar(const v1::Progress& p, int width, bool scored) {
  width = std::max(width, 1);
  const bool prompts = p.prompts_total() > 0;
  const int64_t done = prompts ? p.prompts_done() : p.step();
  const int64_t total = prompts ? p.prompts_total() : p.total_steps();
  double fraction = total > 0 ? static_cast<double>(done) / static_cast<double>(total) : 0.0;
  fraction = std::clamp(fraction, 0.0, 1.0);
  const int filled = static_cast<int>(fraction * width);
  return absl::StrCat("[", std::string(filled, '#'), std::string(width - filled, '.'), "] ",
                      FormatProgressLine(p, scored));
}

std::string FormatTable(const std::vector<Column>& columns,
                        const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::vector<std::string>> cells;  // rows with each cell on one line
  for (const auto& row : rows) {
    std::vector<std::string>& line_cells = cells.emplace_back();
    for (const std::string& cell : row) line_cells.push_back(TerminalText(cell));
  }
  std::vector<size_t> widths;
  for (const Column& c : columns) widths.push_back(DisplayWidth(c.title));
  for (const auto& row : cells) {
    for (size_t i = 0; i < row.size() && i < widths.size(); ++i) {
      widths[i] = std::max(widths[i], DisplayWidth(row[i]));
    }
  }
  std::string out;
  auto append_line = [&](auto cell_at) {
    std::string line;
    for (size_t i = 0; i < columns.size(); ++i) {
      if (i > 0) line += "  ";
      AppendPadded(&line, cell_at(i), widths[i], columns[i].right_aligned);
    }
    line.erase(line.find_last_not_of(' ') + 1);
    absl::StrAppend(&out, line, "\n");
  };
  append_line([&](size_t i) -> absl::string_view { return columns[i].title; });
  for (const auto& row : cells) {
    append_line([&](size_t i) -> absl::string_view {
      return i < row.size() ? absl::string_view(row[i]) : absl::string_view();
    });
  }
  return out;
}

std::string FormatKeyValues(const std::vector<std::pair<std::string, std::string>>& items) {
  size_t width = 0;
  for (const auto& [key, value] : items) width = std::max(width, DisplayWidth(key));
  std::string out;
  for (const auto& [key, value] : items) {
    std::string line = absl::StrCat(key, ":");
    AppendPadded(&line, "", width - DisplayWidth(key) + 2, false);
    absl::StrAppend(&line, value.empty() ? "-" : TerminalText(value), "\n");
    out += line;
  }
  return out;
}

}  // namespace megatrain::client
