#include "engine/model/freeze.h"

#include <cstdint>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace megatrain {
namespace {

// Whether one pattern component matches one name component: equal, "*", or "A-B" around a
// number.
bool ComponentMatches(absl::string_view pattern, absl::string_view name) {
  if (pattern == "*" || pattern == name) return true;
  const std::vector<absl::string_view> range = absl::StrSplit(pattern, '-');
  int64_t lo = 0, hi = 0, n = 0;
  return range.size() == 2 && absl::SimpleAtoi(range[0], &lo) && absl::SimpleAtoi(range[1], &hi) &&
         absl::SimpleAtoi(name, &n) && lo <= n && n <= hi;
}

// A pattern that cannot match: an empty component, or a range backwards or not numbers.
bool Malformed(absl::string_view pattern) {
  for (absl::string_view part : absl::StrSplit(pattern, '.')) {
    if (part.empty()) return true;
    const std::vector<absl::string_view> range = absl::StrSplit(part, '-');
    if (range.size() == 1) continue;
    int64_t lo = 0, hi = 0;
    if (range.size() != 2 || !absl::SimpleAtoi(range[0], &lo) || !absl::SimpleAtoi(range[1], &hi) ||
        lo > hi) {
      return true;
    }
  }
  return false;
}

}  // namespace

bool FreezePatternMatches(absl::string_view pattern, const TensorSlot& slot) {
  if (pattern == "router") return slot.role == TensorRole::kRouter || slot.role == TensorRole::kRouterBias;
  if (pattern == "embeddings") return slot.role == TensorRole::kEmbedding;
  const std::vector<absl::string_view> want = absl::StrSplit(pattern, '.');
  const std::vector<absl::string_view> name = absl::StrSplit(slot.name, '.');
  for (size_t start = 0; start + want.size() <= name.size(); ++start) {
    size_t k = 0;
    while (k < want.size() && ComponentMatches(want[k], name[start + k])) ++k;
    if (k == want.size()) return true;
  }
  return false;
}

absl::Status FreezeTensors(const std::vector<std::string>& patterns, ModelLayout* layout) {
  for (size_t i = 0; i < patterns.size(); ++i) {
    const std::string field = absl::StrCat("train.freeze[", i, "] '", patterns[i], "'");
    if (patterns[i].empty() || Malformed(patterns[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " is not a pattern: dot-separated names, '*' or a layer range 'A-B' (A <= B)"));
    }
    bool any = false;
    for (UnitLayout& unit : layout->units) {
      for (TensorSlot& t : unit.tensors) {
        if (!FreezePatternMatches(patterns[i], t)) continue;
        t.trainable = false;
        any = true;
      }
    }
    if (!any) {
      const bool tied_head = patterns[i] == "lm_head";
      return absl::InvalidArgumentError(absl::StrCat(
          field, " names no tensor of this model",
          tied_head ? " (its lm_head is tied to embed_tokens: freeze embed_tokens)"
                    : " (tensors are named like model.layers.0.self_attn.q_proj.weight)"));
    }
  }
  for (const UnitLayout& unit : layout->units) {
    for (const TensorSlot& t : unit.tensors) {
      if (t.trainable) return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError("train.freeze freezes every tensor: nothing is left to train");
}

}  // namespace megatrain
