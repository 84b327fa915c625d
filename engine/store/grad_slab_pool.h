// Gradient slab pool: a fixed set of host buffers that per-unit gradients land in.
//
// Slabs are allocated once, when the job's plan is known (a GPU backend pins them), and
// lent out per unit. A slab is returned by the optimizer after it has consumed the
// gradient, never by the copy engine.
//
// Thread-safe. Acquire() blocks only when every slab is lent out.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/store/host_store.h"

namespace megatrain {

class GradSlabPool {
 public:
  // `num_slabs` slabs of `slab_elements` f32 each.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<GradSlabPool>> Create(
      int64_t num_slabs, int64_t slab_elements, int numa_node = -1);

  float* Acquire();
  void Release(float* slab);

  int64_t num_slabs() const { return static_cast<int64_t>(slabs_.size()); }
  int64_t slab_elements() const { return slab_elements_; }
  void* base() const { return arena_.data(); }
  size_t bytes() const { return arena_.bytes(); }

 private:
  GradSlabPool() = default;

  HostArena arena_;
  int64_t slab_elements_ = 0;
  std::vector<float*> slabs_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<float*> free_;
};

}  // namespace megatrain
