// Gradients held while they wait for the global norm (clipping), in 16 bits: each block of
// kHeldBlock elements of a piece keeps its largest magnitude as a float and every element
// as a signed 16-bit multiple of it / 32767 (round to nearest). An element then carries an
// absolute error of at most its block's largest magnitude / 65534: 2.03 bytes an element
// instead of fp32's 4, so clipping costs host memory of about half a gradient.
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
// kHeldBlock elements). A block whose largest magnitude is not finite decodes as NaN.
void EncodeHeld(const float* x, int64_t n, int16_t* q, float* scales);
void DecodeHeld(const int16_t* q, const float* scales, int64_t n, float* x);

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
    std::unique_ptr<int16_t[]> values;          // the state range's elements
    std::map<int64_t, std::vector<float>> scales;  // per piece (by offset): its blocks'
  };
  std::vector<int64_t> state_elements_;
  std::vector<Unit> units_;
};

}  // namespace megatrain
