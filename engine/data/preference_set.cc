#include "engine/data/preference_set.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/common/fnv1a.h"
#include "engine/common/status.h"
#include "engine/data/line_reader.h"

namespace megatrain {
namespace {

void HashSequence(uint64_t* h, const PreferenceSequence& s) {
  const uint64_t n = s.ids.size();
  *h = Fnv1a(&n, sizeof(n), *h);
  *h = Fnv1a(s.ids.data(), s.ids.size() * sizeof(int32_t), *h);
  *h = Fnv1a(s.completion.data(), s.completion.size(), *h);
}

// One line's two sequences, or its problem.
absl::StatusOr<SequencePair> PairOf(const std::string& line, const PreferenceSetOptions& o,
                                    const Tokenizer& tokenizer, bool* prefix_mismatch) {
  ASSIGN_OR_RETURN(const PreferencePair pair,
                   PreferencePairFromLine(line, o.chat, o.chat_options, tokenizer));
  *prefix_mismatch = pair.prefix_mismatch;
  return PreferenceSequences(pair, o.cut);
}

}  // namespace

absl::StatusOr<PreferenceSet> LoadPreferenceSet(const PreferenceSetOptions& options,
                                                const Tokenizer& tokenizer) {
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(LineReader reader,
                   LineReader::Open(options.path, options.field, options.max_line_bytes));
  auto pairs = std::make_shared<std::vector<SequencePair>>();
  PreferenceSet set;
  DatasetStats& stats = set.stats;
  uint64_t fingerprint = kFnv1aOffset;
  std::string line;
  while (options.max_lines <= 0 || stats.lines < options.max_lines) {
    ASSIGN_OR_RETURN(const bool more, reader.Next(&line));
    if (!more) break;
    if (IsBlankLine(line)) continue;
    ++stats.lines;
    bool mismatch = false;
    absl::StatusOr<SequencePair> pair = PairOf(line, options, tokenizer, &mismatch);
    if (!pair.ok()) {
      const std::string where = absl::StrCat(options.path, ":", reader.line_number(), ": ");
      if (!options.skip_bad_lines) {
        return absl::InvalidArgumentError(
            absl::StrCat(options.field, ": ", where, pair.status().message()));
      }
      ++stats.bad_lines;
      if (stats.first_errors.size() < 5) {
        stats.first_errors.push_back(where + std::string(pair.status().message()));
      }
      continue;
    }
    set.prefix_mismatches += mismatch ? 1 : 0;
    for (const PreferenceSequence* s : {&pair->first, &pair->second}) {
      stats.tokens += static_cast<int64_t>(s->ids.size());
      for (const uint8_t c : s->completion) stats.trained_tokens += c;
      HashSequence(&fingerprint, *s);
    }
    pairs->push_back(*std::move(pair));
  }
  stats.examples = static_cast<int64_t>(pairs->size());
  stats.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (pairs->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        options.field, ": ", options.path, " holds no preference pair to train on (",
        stats.lines, " lines, ", stats.bad_lines, " left out",
        stats.first_errors.empty() ? "" : absl::StrCat("; first: ", stats.first_errors[0]),
        ")"));
  }
  set.pairs = std::move(pairs);
  set.fingerprint = fingerprint;
  return set;
}

}  // namespace megatrain
