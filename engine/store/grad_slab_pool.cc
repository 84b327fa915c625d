#include "engine/store/grad_slab_pool.h"

#include <algorithm>

#include "engine/common/check.h"
#include "engine/common/collective.h"
#include "engine/common/status.h"

namespace megatrain {

absl::StatusOr<std::unique_ptr<GradSlabPool>> GradSlabPool::Create(int64_t num_slabs,
                                                                  int64_t slab_elements,
                                                                  int numa_node) {
  std::unique_ptr<GradSlabPool> pool(new GradSlabPool);
  const size_t slab_bytes = (slab_elements * sizeof(float) + 4095) / 4096 * 4096;
  ASSIGN_OR_RETURN(pool->arena_, HostArena::Map(slab_bytes * num_slabs, "gradient slabs", numa_node));
  pool->slab_elements_ = slab_elements;
  pool->slab_bytes_ = slab_bytes;
  {
    MutexLock lock(&pool->mu_);  // not shared yet: for the analysis only
    for (int64_t i = 0; i < num_slabs; ++i) {
      float* slab = reinterpret_cast<float*>(pool->arena_.data() + i * slab_bytes);
      pool->slabs_.push_back(slab);
      pool->free_.push_back(slab);
    }
  }
  return pool;
}

float* GradSlabPool::Acquire() {
  MutexLock lock(&mu_);
  mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !free_.empty(); });
  float* slab = free_.back();
  free_.pop_back();
  return slab;
}

// Pieces of a unit start at multiples of the slab size: whole blocks of int8 moments.
static_assert(kGradSlabMaxElements % kMomentBlock == 0 &&
              GradShardElements(kMomentBlock + 1, 3) % kMomentBlock == 0);

namespace {
// What a unit drains is its state range (frozen tensors outside it have no gradient).
int64_t MaxDrainedLayer(const ModelLayout& layout) {
  int64_t m = 0;
  for (const UnitLayout& u : layout.units) {
    if (u.kind == UnitKind::kDecoder) m = std::max(m, u.StateElements());
  }
  return m;
}
}  // namespace

int64_t GradSlabElements(const ModelLayout& layout) {
  // A layer's, or (every layer frozen) the largest unit's, in pieces of at most the cap.
  int64_t unit = MaxDrainedLayer(layout);
  if (unit == 0) {
    for (const UnitLayout& u : layout.units) unit = std::max(unit, u.StateElements());
  }
  const int64_t elements = (std::max<int64_t>(1, unit) + kMomentBlock - 1) / kMomentBlock;
  return std::min(elements * kMomentBlock, kGradSlabMaxElements);
}

int64_t GradSlabsNeeded(const ModelLayout& layout, bool clipping) {
  const int64_t slab = GradSlabElements(layout);
  if (!clipping) return std::max<int64_t>(2, 2 * ((MaxDrainedLayer(layout) + slab - 1) / slab));
  int64_t pieces = 0;
  for (const UnitLayout& u : layout.units) pieces += (u.StateElements() + slab - 1) / slab;
  return std::max<int64_t>(1, pieces);
}

int64_t GradShardSlabElements(const ModelLayout& layout, int ranks) {
  return GradShardElements(GradSlabElements(layout), ranks);
}

int64_t GradShardSlabsNeeded(const ModelLayout& layout, bool clipping, int ranks) {
  const int64_t slab = GradShardSlabElements(layout, ranks);
  if (!clipping) {
    const int64_t layer = MaxDrainedLayer(layout);
    const int64_t shard = std::min(layer, GradShardElements(layer, ranks));
    return std::max<int64_t>(2, 2 * ((shard + slab - 1) / slab));
  }
  // The pieces of this rank's shard of each unit (the same count for every rank, up to
  // the last rank's shorter tail: count the first rank's).
  int64_t pieces = 0;
  for (const UnitLayout& u : layout.units) {
    const int64_t n = u.StateElements();
    const int64_t shard = std::min(n, GradShardElements(n, ranks));
    pieces += (shard + slab - 1) / slab;
  }
  return std::max<int64_t>(1, pieces);
}

int64_t GradSlabPool::IndexOf(const float* slab) const {
  const int64_t i = (reinterpret_cast<const char*>(slab) - arena_.data()) /
                    static_cast<int64_t>(slab_bytes_);
  MT_CHECK(i >= 0 && i < num_slabs() && slabs_[i] == slab);
  return i;
}

void GradSlabPool::Release(float* slab) {
  MT_CHECK(std::find(slabs_.begin(), slabs_.end(), slab) != slabs_.end());
  // Unlock() wakes every waiter where this woke one: the same, as one thread (its pipeline's
  // gradient drain) takes slabs from a pool.
  MutexLock lock(&mu_);
  free_.push_back(slab);
}

}  // namespace megatrain
