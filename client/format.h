// Pure text formatting for the CLI: numbers, durations, times, tables, progress.
//
// Nothing here does I/O or reads a clock: callers pass "now" and the time zone, so every
// function is a deterministic string function that tests can pin down.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "megatrain/v1/jobs.pb.h"

namespace megatrain::client {

// Text from the daemon made safe for a terminal. Any field that came from a user or the
// store (a job name, an error, a path, a log line) can hold ESC, CR or LF: printed raw it
// would drive the terminal or forge lines of `list`. Printable() (engine/common/printable.h)
// shows C0 controls, DEL and invalid UTF-8 as \n, \r, \t, \xNN; these add the code points
// a UTF-8 terminal also obeys or that reorder a line, shown as \uNNNN: C1 controls
// (U+0080-U+009F: U+009B is CSI), the line and paragraph separators and the bidirectional
// overrides and isolates (U+202A-U+202E, U+2066-U+2069). Text without them is unchanged.
//
// One line: "a\x1b[2Jb\nc" for "a<ESC>[2Jb<LF>c".
std::string TerminalText(absl::string_view text);

// Text that is legitimately several lines (a plan, a log line, a spec): as TerminalText(),
// but LF and TAB are kept. CR is still shown as \r: it would overwrite the line.
std::string TerminalLines(absl::string_view text);

// "queued", "held", "running", "succeeded", "failed", "cancelled"; "unknown" otherwise.
std::string StateName(v1::JobState state);

// The inverse of StateName() for the six real states; false for anything else.
bool ParseStateName(absl::string_view name, v1::JobState* state);

// The six names ParseStateName() accepts, in enum order.
std::vector<std::string> StateNames();

// SUCCEEDED, FAILED or CANCELLED.
bool IsTerminal(v1::JobState state);

// Compact counts: 950 -> "950", 1234 -> "1.2k", 12345 -> "12.3k", 123456 -> "123k",
// 1.5e6 -> "1.5M" (k, M, G, T; powers of 1000). Negative and NaN values give "-".
std::string FormatHumanNumber(double value);

// Bytes in GiB with one decimal: "71.2 GiB".
std::string FormatGiB(int64_t bytes);

// H:MM:SS, hours unbounded: 83 -> "0:01:23", 100000 -> "27:46:40". Rounds to the
// nearest second. Negative and NaN values give "-".
std::string FormatDuration(double seconds);

// A short age for tables, in the largest whole unit: "42s", "5m", "3h", "2d".
// Negative ages (clock skew) give "0s".
std::string FormatAge(int64_t age_ms);

// "2025-11-29 11:30:05" in `tz`; "-" for 0 (the API's "not yet").
std::string FormatLocalTime(int64_t unix_ms, absl::TimeZone tz);

// CPU ids as ranges: {0,1,2,3,8,10,11} -> "0-3,8,10-11". Input order does not matter.
std::string FormatCpuList(std::vector<int> cpus);

// "120/200"; "120" when total_steps is 0; "-" before anything is known.
std::string FormatStep(const v1::Progress& progress);

// "2.3412", or "-" before the first step.
std::string FormatLoss(const v1::Progress& progress);

// "step 120/200  loss 2.3412  1.2k tok/s  ETA 0:01:23" (one line per event, not a TTY).
// A generate or eval job's (prompts_total > 0) counts prompts instead of steps:
// "prompts 3/10  52 tok/s  ETA 0:00:07", and with `scored` (an eval job, see views.h's
// ScoresAnswers) "prompts 3/10  accuracy 0.6667 (2/3)  52 tok/s  ETA 0:00:07".
std::string FormatProgressLine(const v1::Progress& progress, bool scored = false);

// "[######....] " + FormatProgressLine(): the live TTY line. `width` = bar cells, filled
// in proportion to the steps (prompts, for a generate or eval job).
std::string FormatProgressBar(const v1::Progress& progress, int width, bool scored = false);

struct Column {
  std::string title;
  bool right_aligned = false;  // numbers
};

// A text table: a header row, then `rows` (each as long as `columns`), columns separated
// by two spaces and padded to their widest cell (in UTF-8 code points). Every cell is one
// line: cells pass through TerminalText(). No trailing spaces; every line ends in '\n'.
std::string FormatTable(const std::vector<Column>& columns,
                        const std::vector<std::vector<std::string>>& rows);

// "key:  value" lines with the values aligned; an empty value prints as "-". Values pass
// through TerminalText(): each stays on its line.
std::string FormatKeyValues(const std::vector<std::pair<std::string, std::string>>& items);

}  // namespace megatrain::client
