// The sampler: validation of the options, then per row a scan, a log-softmax and a draw.
//
// Candidates are ordered by (logit descending, id ascending), a strict total order, so
// the top-k set, the nucleus and the order the draw walks them in are the same on every
// standard library (std::nth_element and std::sort only ever see a total order) and the
// draw depends on the logits, the options and the key alone. Without top_k the nucleus
// is found without sorting the whole vocabulary: a histogram of the probability mass
// bounds the candidates, then the most probable of them are partitioned off and sorted in growing
// chunks until their mass reaches top_p, which for a trained model is a few hundred tokens of 152K.
#include "engine/generate/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "engine/common/check.h"
#include "engine/common/status.h"
#include "engine/generate/philox.h"

namespace megatrain {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view rule, absl::string_view got) {
  return absl::InvalidArgumentError(absl::StrCat("sampling.", field, " ", rule, "; got ", got));
}

struct Candidate {
  float logit;
  int32_t id;
};

// Higher logit first, the lower id first among equal logits.
bool Before(const Candidate& a, const Candidate& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

// exp((logit - max_logit) / T): the unnormalised probability after temperature scaling,
// 1 at the maximum; divided rather than multiplied by 1/T so a tiny T gives 0 and 1,
// never inf * 0.
struct Weight {
  // Buckets of (max_logit - logit) / T, kBucketWidth wide, the last one open-ended: a
  // histogram of the mass that bounds the nucleus before anything is sorted.
  static constexpr int kBuckets = 64;
  static constexpr double kBucketWidth = 0.5;

  double max_logit;
  double temperature;
  double operator()(float logit) const {
    return std::exp((static_cast<double>(logit) - max_logit) / temperature);
  }
  // Never increases with the logit (IEEE arithmetic is monotonic).
  int Bucket(float logit) const {
    const double z = (max_logit - static_cast<double>(logit)) / (temperature * kBucketWidth);
    return static_cast<int>(std::min(z, kBuckets - 1.0));
  }
};

// A row's maximum, the lowest id holding it (-1 when every logit is -inf), and the first
// id whose logit is NaN or +inf (-1 when none is).
struct RowScan {
  float max_logit = -std::numeric_limits<float>::infinity();
  int64_t argmax = -1;
  int64_t bad_id = -1;
};

RowScan ScanRow(const float* logits, int64_t vocab_size) {
  RowScan scan;
  for (int64_t i = 0; i < vocab_size; ++i) {
    const float x = logits[i];
    if (!(x < std::numeric_limits<float>::infinity())) {
      scan.bad_id = i;
      return scan;
    }
    if (x > scan.max_logit) {
      scan.max_logit = x;
      scan.argmax = i;
    }
  }
  return scan;
}

// log sum_i exp(logits[i] - max_logit), in double.
double LogSumExp(const float* logits, int64_t vocab_size, float max_logit) {
  double sum = 0;
  for (int64_t i = 0; i < vocab_size; ++i) {
    sum += std::exp(static_cast<double>(logits[i]) - max_logit);
  }
  return std::log(sum);
}

// Index into the n weights of the token that uniform * (their sum) falls on, walking in
// order; a zero weight is never picked.
int64_t Pick(const double* weights, int64_t n, double uniform) {
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += weights[i];
  const double r = uniform * total;
  double cumulative = 0;
  int64_t last_positive = 0;
  for (int64_t i = 0; i < n; ++i) {
    cumulative += weights[i];
    if (r < cumulative) return i;
    if (weights[i] > 0) last_positive = i;
  }
  return last_positive;  // r rounded up to the total
}

// Sorts candidates[begin, end) into place, given that [begin, n) holds the rest of the
// candidates in any order: partitions the best end - begin of them off first.
void SortNext(Candidate* candidates, int64_t begin, int64_t end, int64_t n) {
  if (end < n) std::nth_element(candidates + begin, candidates + end, candidates + n, Before);
  std::sort(candidates + begin, candidates + end, Before);
}

// The nucleus of n candidates: the length of the smallest prefix, in sorted order, whose
// weight reaches `target` (all n if rounding keeps it short). [0, sorted) is sorted with
// its weights filled; the rest is sorted and weighed chunk by chunk as far as needed.
int64_t Nucleus(Candidate* candidates, double* weights, int64_t n, int64_t sorted, double target,
                const Weight& weight) {
  double cumulative = 0;
  for (int64_t i = 0; i < sorted; ++i) {
    cumulative += weights[i];
    if (cumulative >= target) return i + 1;
  }
  for (int64_t chunk = 256; sorted < n; chunk *= 4) {
    const int64_t end = std::min(n, sorted + chunk);
    SortNext(candidates, sorted, end, n);
    for (int64_t i = sorted; i < end; ++i) {
      weights[i] = weight(candidates[i].logit);
      cumulative += weights[i];
      if (cumulative >= target) return i + 1;
    }
    sorted = end;
  }
  return n;
}

// The k best finite logits into candidates[0, n), sorted, their weights into weights[0, n),
// and their total weight into *total; returns n (k, or fewer when fewer are finite).
int64_t TopK(const float* logits, int64_t vocab_size, int64_t k, const Weight& weight,
             Candidate* candidates, double* weights, double* total) {
  int64_t finite = 0;
  for (int64_t i = 0; i < vocab_size; ++i) {
    if (logits[i] == -std::numeric_limits<float>::infinity()) continue;  // masked
    candidates[finite++] = {logits[i], static_cast<int32_t>(i)};
  }
  const int64_t n = std::min(finite, k);
  SortNext(candidates, 0, n, finite);
  *total = 0;
  for (int64_t i = 0; i < n; ++i) {
    weights[i] = weight(candidates[i].logit);
    *total += weights[i];
  }
  return n;
}

// The only logits the nucleus can hold, into candidates (unsorted), and the whole row's
// weight (in id order) into *total; returns how many. A histogram of the mass by bucket
// finds the highest buckets that already hold top_p of it: every logit in a lower bucket
// is smaller than all of theirs, so it comes after a prefix that reaches top_p and is out.
// The margin covers the rounding of sums taken in another order than Nucleus() takes them.
int64_t NucleusCandidates(const float* logits, int64_t vocab_size, double top_p,
                          const Weight& weight, Candidate* candidates, double* total) {
  double mass[Weight::kBuckets] = {};
  *total = 0;
  for (int64_t i = 0; i < vocab_size; ++i) {
    if (logits[i] == -std::numeric_limits<float>::infinity()) continue;  // masked
    const double w = weight(logits[i]);
    *total += w;
    mass[weight.Bucket(logits[i])] += w;
  }
  int last_bucket = Weight::kBuckets - 1;
  double cumulative = 0;
  for (int b = 0; b < Weight::kBuckets; ++b) {
    cumulative += mass[b];
    if (cumulative >= top_p * *total * (1 + 1e-9)) {
      last_bucket = b;
      break;
    }
  }
  int64_t n = 0;
  for (int64_t i = 0; i < vocab_size; ++i) {
    if (logits[i] == -std::numeric_limits<float>::infinity()) continue;
    if (weight.Bucket(logits[i]) <= last_bucket) {
      candidates[n++] = {logits[i], static_cast<int32_t>(i)};
    }
  }
  return n;
}

}  // namespace

absl::Status ValidateSamplingOptions(const SamplingOptions& options, int64_t vocab_size) {
  MT_CHECK(vocab_size >= 1);
  if (!(std::isfinite(options.temperature) && options.temperature >= 0)) {
    return Invalid("temperature", "must be finite and >= 0 (0 = greedy)",
                   absl::StrCat(options.temperature));
  }
  if (options.top_k < 0) {
    return Invalid("top_k", "must be >= 0 (0 = off)", absl::StrCat(options.top_k));
  }
  if (!(options.top_p > 0 && options.top_p <= 1)) {
    return Invalid("top_p", "must be in (0, 1]", absl::StrCat(options.top_p));
  }
  if (options.max_new_tokens < 1) {
    return Invalid("max_new_tokens", "must be >= 1", absl::StrCat(options.max_new_tokens));
  }
  for (size_t i = 0; i < options.stop_ids.size(); ++i) {
    const int32_t id = options.stop_ids[i];
    if (id < 0 || id >= vocab_size) {
      return Invalid(absl::StrCat("stop_ids[", i, "]"),
                     absl::StrCat("must be a token id in [0, ", vocab_size, ")"), absl::StrCat(id));
    }
  }
  for (size_t i = 0; i < options.stop_strings.size(); ++i) {
    if (options.stop_strings[i].empty()) {
      return Invalid(absl::StrCat("stop_strings[", i, "]"), "must not be empty",
                     "\"\"; drop it or give the text that ends generation");
    }
  }
  return absl::OkStatus();
}

struct Sampler::Scratch {
  std::vector<Candidate> candidates;  // (V) or fewer: the finite logits
  std::vector<double> weights;        // (V) the unnormalised probabilities being drawn from
};

Sampler::Sampler(const SamplingOptions& options, int64_t vocab_size)
    : temperature_(options.temperature),
      top_k_(options.top_k >= vocab_size ? 0 : options.top_k),
      top_p_(options.top_p),
      seed_(options.seed),
      vocab_size_(vocab_size) {
  MT_CHECK(ValidateSamplingOptions(options, vocab_size).ok());
}

absl::Status Sampler::Sample(absl::Span<const float> logits, absl::Span<const SampleKey> keys,
                             absl::Span<SampledToken> out) const {
  const int64_t rows = static_cast<int64_t>(keys.size());
  MT_CHECK(static_cast<int64_t>(logits.size()) == rows * vocab_size_);
  MT_CHECK(out.size() == keys.size());
  std::vector<absl::Status> row_status(rows);
#pragma omp parallel if (rows > 1)
  {
    Scratch scratch;  // grown by the first row that needs it, reused by the rest
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < rows; ++b) {
      row_status[b] = SampleRow(logits.data() + b * vocab_size_, keys[b], &scratch, &out[b]);
    }
  }
  for (int64_t b = 0; b < rows; ++b) {
    if (!row_status[b].ok()) {
      return Annotate(row_status[b],
                      absl::StrCat("sampling row ", b, " (sequence ", keys[b].sequence_index,
                                   ", step ", keys[b].step, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status Sampler::SampleRow(const float* logits, SampleKey key, Scratch* scratch,
                                SampledToken* out) const {
  MT_CHECK(key.sequence_index >= 0 && key.step >= 0);
  const RowScan scan = ScanRow(logits, vocab_size_);
  if (scan.bad_id >= 0) {
    return absl::InvalidArgumentError(absl::StrCat("the logit of token ", scan.bad_id, " is ",
                                                   logits[scan.bad_id],
                                                   "; the model's output is not finite"));
  }
  if (scan.argmax < 0) {
    return absl::InvalidArgumentError("every logit is -inf; no token can be sampled");
  }
  int32_t id = static_cast<int32_t>(scan.argmax);
  if (temperature_ > 0) {
    const double uniform = PhiloxUniform(seed_, static_cast<uint64_t>(key.sequence_index),
                                         static_cast<uint64_t>(key.step));
    id = Draw(logits, scan.max_logit, uniform, scratch);
  }
  out->id = id;
  out->logprob = static_cast<double>(logits[id]) - scan.max_logit -
                 LogSumExp(logits, vocab_size_, scan.max_logit);
  return absl::OkStatus();
}

int32_t Sampler::Draw(const float* logits, float max_logit, double uniform,
                      Scratch* scratch) const {
  const Weight weight{max_logit, temperature_};
  std::vector<double>& weights = scratch->weights;
  std::vector<Candidate>& candidates = scratch->candidates;
  weights.resize(vocab_size_);
  candidates.resize(vocab_size_);
  if (top_k_ == 0 && top_p_ >= 1) {  // the whole distribution, in id order
    for (int64_t i = 0; i < vocab_size_; ++i) weights[i] = weight(logits[i]);
    return static_cast<int32_t>(Pick(weights.data(), vocab_size_, uniform));
  }
  double total = 0;
  int64_t n = 0, sorted = 0;
  if (top_k_ > 0) {
    // The nucleus is then taken of the k best's renormalised distribution.
    n = TopK(logits, vocab_size_, top_k_, weight, candidates.data(), weights.data(), &total);
    sorted = n;
  } else {
    n = NucleusCandidates(logits, vocab_size_, top_p_, weight, candidates.data(), &total);
  }
  if (top_p_ < 1) {
    n = Nucleus(candidates.data(), weights.data(), n, sorted, top_p_ * total, weight);
  }
  return candidates[Pick(weights.data(), n, uniform)].id;
}

}  // namespace megatrain
