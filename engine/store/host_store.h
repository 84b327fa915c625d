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
// The moments may instead be kept in bf16 (2 + 4 + 2 + 2 bytes per parameter) or int8
// (2 + 4 + 1 + 1, plus one fp32 scale per moment per kMomentBlock elements of the unit):
// MomentDType, chosen per job (optimizer.state_dtype). The master is always fp32.
// Without the bf16 copy (StoreOptions::bf16_copy false: 2 bytes less per parameter) the
// fp32 master is the transfer part: it crosses PCIe and is rounded on the device
// (Backend::UploadWeightsFromF32), which gives the kernels the same bf16 values.
//
// Frozen tensors (TensorSlot::trainable) need no state: a unit's master and moments cover
// only its StateRange() (layout.h), from its first trainable tensor to its last, and a
// unit with frozen tensors outside that range keeps its bf16 weights whatever bf16_copy
// says (they are the only copy of those tensors): a frozen tensor costs 2 bytes a
// parameter.
//
// Thread-compatible: the pipeline reads a unit's transfer part only after the optimizer
// has finished writing it (the pipeline orders this with the optimizer's completions).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"  // MomentDType
#include "engine/model/layout.h"
#include "engine/store/moment_disk.h"

namespace megatrain {

// How AdamW's moments are stored (MomentDType, engine.h; adamw.h says how they are rounded).
const char* MomentDTypeName(MomentDType t);  // "fp32", "bf16", "int8"
// Parses a name MomentDTypeName gives; false for anything else.
[[nodiscard]] bool ParseMomentDType(const std::string& name, MomentDType* out);
// Bytes of state per parameter beyond the fp32 master: m and v (and the int8 scales).
double MomentBytesPerParameter(MomentDType t);

// int8 moments share one scale per block of this many elements of a unit (the block of
// element i is i / kMomentBlock). Optimizer pieces start on block boundaries.
constexpr int64_t kMomentBlock = 256;

// A unit's moments as stored: m and v (n elements of `dtype`: float, bf16 bits, or int8
// codes for m and uint8 codes for v), and for int8 the block scales (ceil(n / kMomentBlock)
// floats each; null otherwise).
struct UnitMoments {
  MomentDType dtype = MomentDType::kF32;
  void* m = nullptr;
  void* v = nullptr;
  float* m_scales = nullptr;
  float* v_scales = nullptr;
};

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

struct StoreOptions {
  MomentDType moments = MomentDType::kF32;
  bool bf16_copy = true;  // keep the bf16 weights the device streams (else the master streams)
  // A model that only runs forward (generation, evaluation of a checkpoint): its bf16
  // weights alone, 2 bytes a parameter; no fp32 master, no moments (master() and the
  // moments' accessors must not be called). REQUIRES bf16_copy and no disk_units.
  bool weights_only = false;
  // The NVMe tier (moment_disk.h): the units (by index) whose moments live in a scratch file
  // under nvme_dir instead of RAM, and the RAM buffers they cycle through.
  std::vector<int64_t> disk_units;
  std::string nvme_dir;
  int disk_buffers = 3;
};

class HostStore {
 public:
  // numa_node: where both arenas live (the node nearest the GPU), -1 = default policy.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HostStore>> Create(
      const ModelLayout& layout, int numa_node = -1, const StoreOptions& options = {});
  // Over the nodes of several GPUs (StoreNodes): interleaved across them, so that every
  // GPU streams from its own node's memory as much as from the others'.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HostStore>> Create(
      const ModelLayout& layout, const std::vector<int>& nodes, const StoreOptions& options);

  // The bytes of the transfer arena Create maps for `layout`: each unit's bf16 weights (or,
  // without the copy, its fp32 master when the unit has no frozen tensor outside its
  // state) from a page boundary. A weights-only store is this with the copy.
  static size_t TransferArenaBytes(const ModelLayout& layout, bool bf16_copy);
  // Whether a store keeps `unit`'s bf16 weights: with the copy, and always for a unit with
  // frozen tensors outside its state range (the only copy of those).
  static bool KeepsBf16(const UnitLayout& unit, bool bf16_copy) {
    return bf16_copy || unit.StateElements() != unit.num_elements;
  }

  const ModelLayout& layout() const { return layout_; }
  int64_t num_units() const { return static_cast<int64_t>(layout_.units.size()); }
  int64_t unit_elements(int64_t unit) const { return layout_.units[unit].num_elements; }

  MomentDType moment_dtype() const { return options_.moments; }
  bool weights_only() const { return options_.weights_only; }
  // The unit's elements with a master and moments: [state_begin, state_begin +
  // state_elements), its layout's StateRange() (0 elements: all frozen, or weights_only).
  int64_t state_begin(int64_t unit) const { return units_[unit].state_begin; }
  int64_t state_elements(int64_t unit) const { return units_[unit].state_elements; }
  // The unit keeps bf16 weights (else its master streams and is rounded on the device).
  bool has_bf16(int64_t unit) const { return units_[unit].bf16; }
  uint16_t* weights(int64_t unit) const;  // bf16 (n). REQUIRES: has_bf16(unit)
  // f32 (state_elements): element i is the unit's element state_begin + i. REQUIRES:
  // state_elements(unit) > 0.
  float* master(int64_t unit) const;
  // f32 (state_elements), as master(). REQUIRES: moment_dtype() == kF32.
  float* exp_avg(int64_t unit) const;
  float* exp_avg_sq(int64_t unit) const;
  // Any dtype. REQUIRES: !moments_on_disk(unit) (those are in moment_disk()'s buffers).
  UnitMoments moments(int64_t unit) const;
  bool moments_on_disk(int64_t unit) const { return disk_ != nullptr && disk_->Has(unit); }
  MomentDisk* moment_disk() const { return disk_.get(); }
  // The unit's moments (m, v, scales) as one block of this many bytes, and a view of them in
  // a block at `block` (a MomentDisk buffer).
  size_t moment_block_bytes(int64_t unit) const;
  UnitMoments MomentsAt(int64_t unit, char* block) const;
  // Bytes [offset, offset + bytes) of part `which` (0 m, 1 v, 2 m's scales, 3 v's) of the
  // unit's moments, wherever they are; and written there (checkpoints).
  [[nodiscard]] absl::Status ReadMomentBytes(int64_t unit, int which, uint64_t offset,
                                             uint64_t bytes, char* dst) const;
  [[nodiscard]] absl::Status WriteMomentBytes(int64_t unit, int which, uint64_t offset,
                                              uint64_t bytes, const char* src);
  // Bytes of moments kept on disk.
  int64_t disk_moment_bytes() const { return disk_ != nullptr ? disk_->file_bytes() : 0; }
  // Bytes of one moment of `unit` as stored (m's; v's are the same), and of its scales.
  size_t moment_bytes(int64_t unit) const;
  size_t moment_scale_bytes(int64_t unit) const;
  // Zeroes m and v (and their scales): the state before the first step (nothing to do
  // without state). REQUIRES: !moments_on_disk(unit) (a unit on disk is zero until
  // written: its file is new).
  void ResetMoments(int64_t unit);

  // The transfer arena (the bf16 weights, or the master without them), for pinning.
  void* transfer_base() const { return transfer_.data(); }
  size_t transfer_bytes() const { return transfer_.bytes(); }
  size_t state_bytes() const { return state_.bytes(); }

  // Sets tensor `t` of `unit` to `values` (f32, t.num_elements): its master where it has
  // state, and its bf16 weights (rounded) where the unit keeps them.
  void WriteTensor(int64_t unit, const TensorSlot& t, const float* values);
  // The same for the tensor's elements [first, first + count) (values holds count floats).
  void WriteTensorRange(int64_t unit, const TensorSlot& t, int64_t first, int64_t count,
                        const float* values);
  // Rewrites the unit's bf16 weights over its state range from its fp32 master (round to
  // nearest even); nothing to do when it keeps no bf16 weights or has no state.
  void RefreshWeightsFromMaster(int64_t unit);
  // Elements [begin, end) of the unit's bf16 weights into out: the copy's, or the master
  // rounded as the copy would hold it (checkpoints write the model this way).
  void ReadWeightsBf16(int64_t unit, int64_t begin, int64_t end, uint16_t* out) const;

 private:
  HostStore(const ModelLayout& layout, const StoreOptions& options)
      : layout_(layout), options_(options) {}

  ModelLayout layout_;
  StoreOptions options_;
  HostArena transfer_;
  HostArena state_;
  std::unique_ptr<MomentDisk> disk_;
  struct UnitParts {
    size_t transfer_offset = 0;  // bytes into transfer_
    size_t state_offset = 0;     // bytes into state_: the master when it is not the
                                 // transfer part; m, v, their scales follow
    int64_t state_begin = 0, state_elements = 0;
    bool bf16 = true;
  };
  std::vector<UnitParts> units_;
};

}  // namespace megatrain
