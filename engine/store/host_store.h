// The host store: the authoritative copy of every parameter and optimizer state.
//
// Per unit (embedding, each decoder layer, head) it holds
//   transfer part: bf16 weights, the only bytes that cross to the device, and
//   state part:    fp32 master, m (exp_avg), v (exp_avg_sq), which never cross.
// All transfer parts live in one 4 KiB-aligned arena so a GPU backend can pin it with a
// single registration; every unit's part starts on a 4 KiB boundary. The state parts live
// in a second arena (ordinary pageable memory; NUMA placement is the allocator's job).
// Cost: 2 + 12 bytes per parameter, plus gradient slabs (grad_slab_pool.h).
//
// Thread-compatible: the pipeline reads a unit's transfer part only after the optimizer
// has finished writing it (the pipeline orders this with the optimizer's completions).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model/layout.h"

namespace megatrain {

// The NUMA nodes a data-parallel job's host store spreads over: the distinct known nodes
// (>= 0) of its devices, in device order. Empty: the default policy.
std::vector<int> StoreNodes(const std::vector<int>& device_nodes);

// Page-aligned anonymous memory; move-only.
class HostArena {
 public:
  HostArena() = default;
  // numa_node >= 0 binds the pages to that node (libnuma), before they are touched.
  [[nodiscard]] static absl::StatusOr<HostArena> Map(size_t bytes, const char* what,
                                                     int numa_node = -1);
  // The same over a set of nodes: one binds, several interleave the pages across them
  // (nodes this machine lacks are left out; none: the default policy).
  [[nodiscard]] static absl::StatusOr<HostArena> Map(size_t bytes, const char* what,
                                                     const std::vector<int>& nodes);
  ~HostArena();
  HostArena(HostArena&& o) noexcept;
  HostArena& operator=(HostArena&& o) noexcept;
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;
  char* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  char* data_ = nullptr;
  size_t bytes_ = 0;
};

class HostStore {
 public:
  // numa_node: where both arenas live (the node nearest the GPU), -1 = default policy.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HostStore>> Create(
      const ModelLayout& layout, int numa_node = -1);
  // Over the nodes of several GPUs (StoreNodes): interleaved across them, so that every
  // GPU streams from its own node's memory as much as from the others'.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HostStore>> Create(
      const ModelLayout& layout, const std::vector<int>& nodes);

  const ModelLayout& layout() const { return layout_; }
  int64_t num_units() const { return static_cast<int64_t>(layout_.units.size()); }
  int64_t unit_elements(int64_t unit) const { return layout_.units[unit].num_elements; }

  uint16_t* weights(int64_t unit) const;  // bf16 (n)
  float* master(int64_t unit) const;      // f32 (n)
  float* exp_avg(int64_t unit) const;     // f32 (n)
  float* exp_avg_sq(int64_t unit) const;  // f32 (n)

  // The transfer arena, for pinning.
  void* transfer_base() const { return transfer_.data(); }
  size_t transfer_bytes() const { return transfer_.bytes(); }
  size_t state_bytes() const { return state_.bytes(); }

  // Rewrites unit's bf16 weights from its fp32 master (round to nearest even).
  void RefreshWeightsFromMaster(int64_t unit);

 private:
  explicit HostStore(const ModelLayout& layout) : layout_(layout) {}

  ModelLayout layout_;
  HostArena transfer_;
  HostArena state_;
  std::vector<size_t> transfer_offset_;  // bytes, per unit
  std::vector<size_t> state_offset_;     // bytes, per unit (master; m and v follow)
};

}  // namespace megatrain
