// Gradient slab pool: a fixed set of host buffers that per-unit gradients land in.
//
// Slabs are allocated once, when the job's plan is known (a GPU backend pins them), and
// lent out per unit. A slab is returned by the optimizer after it has consumed the
// gradient, never by the copy engine.
//
// Thread-safe. Acquire() blocks only when every slab is lent out.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/common/mutex.h"
#include "engine/store/host_store.h"

namespace megatrain {

// The slab size for a model: the most a decoder layer drains (its state range: all of it
// unless tensors are frozen), up to kGradSlabMaxElements (128 MiB of f32); larger units go
// in pieces. Pieces of a large layer overlap: the optimizer
// updates the first while the rest are still being copied out.
constexpr int64_t kGradSlabMaxElements = int64_t{1} << 25;
int64_t GradSlabElements(const ModelLayout& layout);
// Slabs a job needs. Clipping holds every piece of every unit until the global norm is
// known; otherwise two layers' worth cycle (one being read by the optimizer, one being
// filled).
int64_t GradSlabsNeeded(const ModelLayout& layout, bool clipping);

// The same for one of `ranks` devices that reduce-scatter on the device
// (common/collective.h): each drains only its shard of every unit, so its slabs are
// 1/ranks of a layer and it needs as many of them as a whole job: the host holds no more
// gradient than with one device.
int64_t GradShardSlabElements(const ModelLayout& layout, int ranks);
int64_t GradShardSlabsNeeded(const ModelLayout& layout, bool clipping, int ranks);

class GradSlabPool {
 public:
  // `num_slabs` slabs of `slab_elements` f32 each.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<GradSlabPool>> Create(
      int64_t num_slabs, int64_t slab_elements, int numa_node = -1);

  float* Acquire();
  void Release(float* slab);
  // 0 .. num_slabs()-1: which slab `slab` is (for per-slab state such as events).
  int64_t IndexOf(const float* slab) const;
  // Whether `slab` is one of this pool's.
  bool Holds(const float* slab) const {
    const char* p = reinterpret_cast<const char*>(slab);
    return p >= arena_.data() && p < arena_.data() + arena_.bytes();
  }

  int64_t num_slabs() const { return static_cast<int64_t>(slabs_.size()); }
  int64_t slab_elements() const { return slab_elements_; }
  void* base() const { return arena_.data(); }
  size_t bytes() const { return arena_.bytes(); }

 private:
  GradSlabPool() = default;

  HostArena arena_;
  int64_t slab_elements_ = 0;
  size_t slab_bytes_ = 0;
  std::vector<float*> slabs_;  // fixed after Create()
  Mutex mu_;
  std::vector<float*> free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace megatrain
