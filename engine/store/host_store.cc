#include "engine/store/host_store.h"

#include <numa.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/common/dtype.h"
#include "engine/common/status.h"

namespace megatrain {
namespace {

constexpr size_t kPage = 4096;
size_t RoundUp(size_t n) { return (n + kPage - 1) / kPage * kPage; }

}  // namespace

std::vector<int> StoreNodes(const std::vector<int>& device_nodes) {
  std::vector<int> nodes;
  for (int n : device_nodes) {
    if (n >= 0 && std::find(nodes.begin(), nodes.end(), n) == nodes.end()) nodes.push_back(n);
  }
  return nodes;
}

absl::StatusOr<HostArena> HostArena::Map(size_t bytes, const char* what,
                                         const std::vector<int>& nodes) {
  std::vector<int> known;
  if (numa_available() >= 0) {
    for (int n : nodes) {
      if (n >= 0 && n <= numa_max_node()) known.push_back(n);
    }
  }
  if (known.size() <= 1) return Map(bytes, what, known.empty() ? -1 : known[0]);
  ASSIGN_OR_RETURN(HostArena arena, Map(bytes, what, -1));
  if (arena.data_ != nullptr) {
    struct bitmask* mask = numa_allocate_nodemask();
    for (int n : known) numa_bitmask_setbit(mask, n);
    numa_interleave_memory(arena.data_, arena.bytes_, mask);  // before the pages are touched
    numa_free_nodemask(mask);
  }
  return arena;
}

absl::StatusOr<HostArena> HostArena::Map(size_t bytes, const char* what, int numa_node) {
  HostArena arena;
  if (bytes == 0) return arena;
  bytes = RoundUp(bytes);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot map ", bytes / double(1 << 30), " GiB of host memory for the ", what, ": ",
        std::strerror(errno)));
  }
  if (numa_node >= 0 && numa_available() >= 0 && numa_node <= numa_max_node()) {
    numa_tonode_memory(p, bytes, numa_node);
  }
  arena.data_ = static_cast<char*>(p);
  arena.bytes_ = bytes;
  return arena;
}

HostArena::~HostArena() {
  if (data_ != nullptr) munmap(data_, bytes_);
}

HostArena::HostArena(HostArena&& o) noexcept : data_(o.data_), bytes_(o.bytes_) {
  o.data_ = nullptr;
}

HostArena& HostArena::operator=(HostArena&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) munmap(data_, bytes_);
    data_ = o.data_;
    bytes_ = o.bytes_;
    o.data_ = nullptr;
  }
  return *this;
}

absl::StatusOr<std::unique_ptr<HostStore>> HostStore::Create(const ModelLayout& layout,
                                                             int numa_node) {
  return Create(layout, numa_node >= 0 ? std::vector<int>{numa_node} : std::vector<int>{});
}

absl::StatusOr<std::unique_ptr<HostStore>> HostStore::Create(const ModelLayout& layout,
                                                             const std::vector<int>& nodes) {
  std::unique_ptr<HostStore> store(new HostStore(layout));
  size_t transfer_bytes = 0, state_bytes = 0;
  for (const UnitLayout& u : layout.units) {
    store->transfer_offset_.push_back(transfer_bytes);
    store->state_offset_.push_back(state_bytes);
    transfer_bytes += RoundUp(u.num_elements * sizeof(uint16_t));
    state_bytes += 3 * RoundUp(u.num_elements * sizeof(float));
  }
  ASSIGN_OR_RETURN(store->transfer_, HostArena::Map(transfer_bytes, "bf16 weights", nodes));
  ASSIGN_OR_RETURN(store->state_, HostArena::Map(state_bytes, "fp32 master weights and AdamW moments", nodes));
  return store;
}

uint16_t* HostStore::weights(int64_t unit) const {
  return reinterpret_cast<uint16_t*>(transfer_.data() + transfer_offset_[unit]);
}

float* HostStore::master(int64_t unit) const {
  return reinterpret_cast<float*>(state_.data() + state_offset_[unit]);
}

float* HostStore::exp_avg(int64_t unit) const {
  return reinterpret_cast<float*>(state_.data() + state_offset_[unit] +
                                  RoundUp(unit_elements(unit) * sizeof(float)));
}

float* HostStore::exp_avg_sq(int64_t unit) const {
  return reinterpret_cast<float*>(state_.data() + state_offset_[unit] +
                                  2 * RoundUp(unit_elements(unit) * sizeof(float)));
}

void HostStore::RefreshWeightsFromMaster(int64_t unit) {
  const float* m = master(unit);
  uint16_t* w = weights(unit);
  const int64_t n = unit_elements(unit);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) w[i] = FloatToBf16(m[i]);
}

}  // namespace megatrain
