// Gradients held while they wait for the global norm (clipping), in 16 bits: each block of
// kHeldBlock elements of a piece is scaled by a power of two that brings its largest
// magnitude into [2^14, 2^15), and each element is kept as an IEEE half (fp16, rounded to
// nearest even). The scaling is exact, so an element keeps 11 significant bits: a relative
// error of at most 2^-11, down to 2^-28 of its block's largest (below that, fp16's
// subnormals: an absolute error of at most 2^-40 of it). AdamW normalises each element by
// its own history, so a relative error per element matters, not one relative to the block.
// 2.03 bytes an element instead of fp32's 4: clipping costs host memory of about half a
// gradient.
//
// The norm itself is summed from the exact fp32 gradient before it is stored here; only the
// update reads the 16-bit values back (host_optimizer.h). Deterministic: the encoding of a
// piece depends on its values alone.
//
// Thread-compatible: the optimizer's worker thread alone stores and loads (each call runs
// on its OpenMP team).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

namespace megatrain {

constexpr int64_t kHeldBlock = 128;

// One piece's encoding, and back (REQUIRES: n >= 0; q has n, scales (n + kHeldBlock - 1) /
// kHeldBlock elements: each block's power of two). A block holding a NaN or an infinity
// decodes as NaN; an all-zero block as zeros.
void EncodeHeld(const float* x, int64_t n, uint16_t* q, float* scales);
void DecodeHeld(const uint16_t* q, const float* scales, int64_t n, float* x);

class HeldGradients {
 public:
  // Room for every unit's state range: `state_elements[u]` elements of unit u. Memory is
  // taken as each unit's first piece is stored.
  explicit HeldGradients(std::vector<int64_t> state_elements);

  // Keeps `count` elements of `grad` as unit `unit`'s piece starting at `offset` (in its
  // state range). REQUIRES: the piece inside the range; pieces of a unit do not overlap.
  void Store(int64_t unit, int64_t offset, int64_t count, const float* grad);
  // Writes the piece stored at (unit, offset) to `out` (`count` elements, as stored).
  void Load(int64_t unit, int64_t offset, int64_t count, float* out) const;

  // Bytes an element costs (its 16 bits and its share of a block's scale).
  static double BytesPerElement() { return 2.0 + 4.0 / kHeldBlock; }

 private:
  struct Unit {
    std::unique_ptr<uint16_t[]> values;            // the state range's elements
    std::map<int64_t, std::vector<float>> scales;  // per piece (by offset): its blocks'
  };
  std::vector<int64_t> state_elements_;
  std::vector<Unit> units_;
};

}  // namespace megatrain
