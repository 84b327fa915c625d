// A micro-batch as the packer makes it and the pipeline takes it: fixed-shape arrays of
// token ids, targets and attention segments (packer.h says how they are filled).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace megatrain {

// The label of a token with no next token: the loss ignores it (PyTorch's ignore_index).
constexpr int32_t kIgnoreIndex = -100;

// rows * seq_len tokens, each array flattened row-major: element [r * seq_len + j].
struct MicroBatch {
  int64_t rows = 0;
  int64_t seq_len = 0;
  std::vector<int32_t> tokens;     // (rows*seq_len) input ids
  std::vector<int32_t> targets;    // (rows*seq_len) the next token of the same document,
                                   //   or kIgnoreIndex on a document's last token, before
                                   //   an untrained token, and on padding
  std::vector<int32_t> doc_start;  // (rows*seq_len) flat index of the first token of this
                                   //   token's segment; always in the same row
  std::vector<int32_t> positions;  // (rows*seq_len) RoPE position = flat index - doc_start
  // A preference step's (DPO; empty otherwise): each token's sequence in the micro-batch
  // (2k: pair k's chosen, 2k+1 its rejected; -1: no target), and each sequence's
  // kPrefFields doubles (common/preference_math.h: reference log-probability, token count,
  // pair weight, NLL weight).
  std::vector<int32_t> sequence;
  std::vector<double> sequence_info;

  // The number of targets that are not kIgnoreIndex: the loss's token count.
  int64_t num_targets() const {
    return static_cast<int64_t>(std::count_if(targets.begin(), targets.end(),
                                              [](int32_t t) { return t != kIgnoreIndex; }));
  }
};

}  // namespace megatrain
