#include "engine/generate/generation.h"

#include <algorithm>
#include <deque>
#include <list>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "engine/common/check.h"
#include "engine/common/status.h"
#include "engine/data/text_stream.h"
#include "engine/generate/stop_matcher.h"

namespace megatrain {
namespace {

// A sequence in flight: its prompt's index, its slot, what it has made so far.
struct Live {
  int64_t index = 0;
  int64_t key = 0;   // its draws' key
  int32_t slot = 0;
  int32_t next = 0;  // the token sampled last, fed at the next decode step
  Completion completion;
  std::optional<TextStream> text;  // with a tokenizer
  StopMatcher stop;
  bool retired = false;
};

absl::Status CheckPrompts(const Generator& g, const std::vector<std::vector<int32_t>>& prompts) {
  const GeneratorOptions& o = g.options();
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t len = static_cast<int64_t>(prompts[i].size());
    if (len == 0) return absl::InvalidArgumentError(absl::StrCat("prompt ", i, " is empty"));
    if (len >= o.max_len || len > o.prefill_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt ", i, " is ", len, " tokens long; this generation takes prompts of at most ",
          std::min(o.max_len - 1, o.prefill_tokens), " tokens (max_len ", o.max_len,
          " with the new tokens, prefill_tokens ", o.prefill_tokens, ")"));
    }
  }
  return absl::OkStatus();
}

class Loop {
 public:
  Loop(Generator* g, const Tokenizer* tokenizer, const std::vector<std::vector<int32_t>>& prompts,
       const SamplingOptions& options, const CompletionCallback& on_done,
       const std::vector<int64_t>& keys)
      : g_(g), tokenizer_(tokenizer), prompts_(prompts), keys_(keys), options_(options),
        sampler_(options, g->vocab_size()), on_done_(on_done), out_(prompts.size()),
        greedy_(options.temperature == 0) {
    for (int32_t s = 0; s < g->options().max_sequences; ++s) free_.push_back(s);
  }

  absl::StatusOr<std::vector<Completion>> Run() {
    while (next_prompt_ < static_cast<int64_t>(prompts_.size()) || !live_.empty()) {
      RETURN_IF_ERROR(Admit());
      if (!live_.empty()) RETURN_IF_ERROR(DecodeStep());
    }
    return std::move(out_);
  }

 private:
  // Prefills as many waiting prompts as there are free slots and a pass takes.
  absl::Status Admit() {
    std::vector<std::vector<int32_t>> prompts;
    std::vector<int32_t> slots;
    std::vector<int64_t> indices;
    int64_t tokens = 0;
    while (!free_.empty() && next_prompt_ < static_cast<int64_t>(prompts_.size())) {
      const std::vector<int32_t>& p = prompts_[next_prompt_];
      if (tokens + static_cast<int64_t>(p.size()) > g_->options().prefill_tokens) break;
      tokens += static_cast<int64_t>(p.size());
      prompts.push_back(p);
      slots.push_back(free_.front());
      free_.pop_front();
      indices.push_back(next_prompt_++);
    }
    if (prompts.empty()) return absl::OkStatus();
    RETURN_IF_ERROR(g_->Prefill(prompts, slots, output()));
    std::vector<Live*> admitted;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const int64_t key = keys_.empty() ? indices[i] : keys_[indices[i]];
      Live& s = live_.emplace_back(Live{indices[i], key, slots[i], 0, Completion{}, std::nullopt,
                                        StopMatcher(options_.stop_strings, options_.stop_ids)});
      if (tokenizer_ != nullptr) s.text.emplace(*tokenizer_);
      admitted.push_back(&s);
    }
    return Take(admitted);
  }

  absl::Status DecodeStep() {
    std::vector<int32_t> tokens, slots;
    std::vector<Live*> all;
    for (Live& s : live_) {
      tokens.push_back(s.next);
      slots.push_back(s.slot);
      all.push_back(&s);
    }
    RETURN_IF_ERROR(g_->Decode(tokens, slots, output()));
    return Take(all);
  }

  // Greedy picks on the device; anything else samples the logits here.
  Generator::Output output() {
    return greedy_ ? Generator::Output{nullptr, &picked_} : Generator::Output{&logits_, nullptr};
  }

  // Each sequence's next token (the device's greedy pick, or sampled from its row of the
  // logits), fed to its stop conditions; the sequences that are done retire.
  absl::Status Take(const std::vector<Live*>& seqs) {
    if (!greedy_) {
      std::vector<SampleKey> keys;
      for (const Live* s : seqs) {
        keys.push_back(SampleKey{s->key, static_cast<int64_t>(s->completion.ids.size())});
      }
      picked_.resize(seqs.size());
      RETURN_IF_ERROR(sampler_.Sample(logits_, keys, absl::MakeSpan(picked_)));
    }
    std::vector<SampledToken>& picked = picked_;
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (picked[i].id < 0) {
        return absl::InternalError(absl::StrCat("the logits of prompt ", seqs[i]->index,
                                                " hold a NaN: the model's output is broken"));
      }
      Live& s = *seqs[i];
      s.completion.ids.push_back(picked[i].id);
      s.completion.logprobs.push_back(picked[i].logprob);
      s.next = picked[i].id;
      const std::string piece = s.text.has_value() ? s.text->Next(picked[i].id) : std::string();
      const bool stopped = s.stop.Feed(picked[i].id, piece);
      // The token just picked goes into the cache at the next step, at position length().
      const bool full = static_cast<int64_t>(s.completion.ids.size()) >= options_.max_new_tokens ||
                        g_->length(s.slot) >= g_->options().max_len;
      if (stopped || full) Retire(&s, stopped ? FinishReason::kStop : FinishReason::kLength);
    }
    live_.remove_if([](const Live& s) { return s.retired; });
    return absl::OkStatus();
  }

  void Retire(Live* s, FinishReason reason) {
    // The decoder's held-back bytes end the text; a stop string may end in them.
    if (reason == FinishReason::kLength && s->text.has_value() &&
        s->stop.FeedText(s->text->Flush())) {
      reason = FinishReason::kStop;
    }
    s->completion.text = s->stop.text();
    s->completion.finish = reason;
    s->retired = true;
    free_.push_back(s->slot);
    if (on_done_) on_done_(s->index, s->completion);
    out_[s->index] = std::move(s->completion);
  }

  Generator* g_;
  const Tokenizer* tokenizer_;
  const std::vector<std::vector<int32_t>>& prompts_;
  const std::vector<int64_t>& keys_;  // empty: each prompt's index
  SamplingOptions options_;
  Sampler sampler_;
  CompletionCallback on_done_;
  std::vector<Completion> out_;
  std::deque<int32_t> free_;  // slots
  std::list<Live> live_;      // in admission order
  int64_t next_prompt_ = 0;
  bool greedy_;                          // temperature 0
  std::vector<float> logits_;            // the last pass's, when sampling here
  std::vector<SampledToken> picked_;     // its sequences' next tokens
};

}  // namespace

const char* FinishReasonName(FinishReason reason) {
  return reason == FinishReason::kStop ? "stop" : "length";
}

absl::StatusOr<std::vector<Completion>> Generate(Generator* generator, const Tokenizer* tokenizer,
                                                 const std::vector<std::vector<int32_t>>& prompts,
                                                 const SamplingOptions& options,
                                                 const CompletionCallback& on_done,
                                                 const std::vector<int64_t>& sample_keys) {
  RETURN_IF_ERROR(ValidateSamplingOptions(options, generator->vocab_size()));
  if (tokenizer == nullptr && !options.stop_strings.empty()) {
    return absl::InvalidArgumentError("sampling.stop_strings need a tokenizer to decode the text");
  }
  RETURN_IF_ERROR(CheckPrompts(*generator, prompts));
  MT_CHECK(sample_keys.empty() || sample_keys.size() == prompts.size());
  Loop loop(generator, tokenizer, prompts, options, on_done, sample_keys);
  return loop.Run();
}

}  // namespace megatrain
