#include "engine/store/host_store.h"

#include <numa.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/common/check.h"
#include "engine/common/dtype.h"
#include "engine/common/status.h"

namespace megatrain {
namespace {

constexpr size_t kPage = 4096;
size_t RoundUp(size_t n) { return (n + kPage - 1) / kPage * kPage; }

// What a store keeps of a unit: the state range (StateRange; none in a weights-only store)
// and whether it keeps bf16 weights (the copy, or the only copy of frozen tensors).
struct UnitKeeps {
  int64_t state_begin = 0, state_elements = 0;
  bool bf16 = true;
};

UnitKeeps KeepsOf(const UnitLayout& unit, bool bf16_copy, bool weights_only) {
  if (weights_only) return UnitKeeps{};
  const auto [begin, end] = unit.StateRange();
  return UnitKeeps{begin, end - begin, HostStore::KeepsBf16(unit, bf16_copy)};
}

// A unit's share of the transfer arena: its bf16 weights, or its fp32 master.
size_t UnitTransferBytes(const UnitLayout& unit, bool bf16) {
  return RoundUp(unit.num_elements * (bf16 ? sizeof(uint16_t) : sizeof(float)));
}

size_t MomentElementBytes(MomentDType t) {
  switch (t) {
    case MomentDType::kF32: return 4;
    case MomentDType::kBF16: return 2;
    case MomentDType::kInt8: return 1;
  }
  return 4;
}

int64_t MomentBlocks(int64_t n) { return (n + kMomentBlock - 1) / kMomentBlock; }

}  // namespace

const char* MomentDTypeName(MomentDType t) {
  switch (t) {
    case MomentDType::kF32: return "fp32";
    case MomentDType::kBF16: return "bf16";
    case MomentDType::kInt8: return "int8";
  }
  return "?";
}

bool ParseMomentDType(const std::string& name, MomentDType* out) {
  for (MomentDType t : {MomentDType::kF32, MomentDType::kBF16, MomentDType::kInt8}) {
    if (name == MomentDTypeName(t)) {
      *out = t;
      return true;
    }
  }
  return false;
}

double MomentBytesPerParameter(MomentDType t) {
  const double scales = t == MomentDType::kInt8 ? 2.0 * 4 / kMomentBlock : 0.0;
  return 2.0 * MomentElementBytes(t) + scales;
}

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

size_t HostStore::TransferArenaBytes(const ModelLayout& layout, bool bf16_copy) {
  size_t bytes = 0;
  for (const UnitLayout& unit : layout.units) {
    bytes += UnitTransferBytes(unit, KeepsOf(unit, bf16_copy, false).bf16);
  }
  return bytes;
}

absl::StatusOr<std::unique_ptr<HostStore>> HostStore::Create(const ModelLayout& layout,
                                                             int numa_node,
                                                             const StoreOptions& options) {
  return Create(layout, numa_node >= 0 ? std::vector<int>{numa_node} : std::vector<int>{},
                options);
}

absl::StatusOr<std::unique_ptr<HostStore>> HostStore::Create(const ModelLayout& layout,
                                                             const std::vector<int>& nodes,
                                                             const StoreOptions& options) {
  MT_CHECK(!options.weights_only || (options.bf16_copy && options.disk_units.empty()));
  std::unique_ptr<HostStore> store(new HostStore(layout, options));
  for (const UnitLayout& unit : layout.units) {
    const UnitKeeps keeps = KeepsOf(unit, options.bf16_copy, options.weights_only);
    store->units_.push_back(UnitParts{0, 0, keeps.state_begin, keeps.state_elements, keeps.bf16});
  }
  if (!options.disk_units.empty()) {
    std::vector<int64_t> blocks;
    for (int64_t u : options.disk_units) {
      MT_CHECK(u >= 0 && u < static_cast<int64_t>(layout.units.size()));
      blocks.push_back(static_cast<int64_t>(store->moment_block_bytes(u)));
    }
    ASSIGN_OR_RETURN(store->disk_, MomentDisk::Create(options.nvme_dir, options.disk_units, blocks,
                                                      options.disk_buffers));
  }
  size_t transfer_bytes = 0, state_bytes = 0;
  for (int64_t u = 0; u < static_cast<int64_t>(layout.units.size()); ++u) {
    UnitParts& p = store->units_[u];
    p.transfer_offset = transfer_bytes;
    p.state_offset = state_bytes;
    transfer_bytes += UnitTransferBytes(layout.units[u], p.bf16);
    if (p.state_elements == 0) continue;
    state_bytes += (p.bf16 ? RoundUp(p.state_elements * sizeof(float)) : 0) +
                   (store->moments_on_disk(u) ? 0 : store->moment_block_bytes(u));
  }
  ASSIGN_OR_RETURN(store->transfer_,
                   HostArena::Map(transfer_bytes,
                                  options.bf16_copy ? "bf16 weights" : "fp32 master weights", nodes));
  const std::string state =
      absl::StrCat(options.bf16_copy ? "fp32 master weights and " : "", MomentDTypeName(options.moments),
                   " AdamW moments");
  ASSIGN_OR_RETURN(store->state_, HostArena::Map(state_bytes, state.c_str(), nodes));
  return store;
}

size_t HostStore::moment_bytes(int64_t unit) const {
  return RoundUp(state_elements(unit) * MomentElementBytes(options_.moments));
}

size_t HostStore::moment_scale_bytes(int64_t unit) const {
  return options_.moments == MomentDType::kInt8
             ? RoundUp(MomentBlocks(state_elements(unit)) * sizeof(float))
             : 0;
}

size_t HostStore::moment_block_bytes(int64_t unit) const {
  return 2 * (moment_bytes(unit) + moment_scale_bytes(unit));
}

UnitMoments HostStore::moments(int64_t unit) const {
  MT_CHECK_MSG(!options_.weights_only, "moments: this store keeps the bf16 weights alone");
  MT_CHECK_MSG(!moments_on_disk(unit), "moments: unit %lld keeps them on disk",
               static_cast<long long>(unit));
  MT_CHECK_MSG(state_elements(unit) > 0, "moments: unit %lld is frozen",
               static_cast<long long>(unit));
  const UnitParts& p = units_[unit];
  return MomentsAt(unit, state_.data() + p.state_offset +
                             (p.bf16 ? RoundUp(p.state_elements * sizeof(float)) : 0));
}

namespace {
// Where part `which` of a unit's moment block starts, and its bytes.
std::pair<uint64_t, uint64_t> MomentPart(uint64_t moment, uint64_t scales, int which) {
  switch (which) {
    case 0: return {0, moment};
    case 1: return {moment, moment};
    case 2: return {2 * moment, scales};
    default: return {2 * moment + scales, scales};
  }
}
}  // namespace

absl::Status HostStore::ReadMomentBytes(int64_t unit, int which, uint64_t offset, uint64_t bytes,
                                        char* dst) const {
  const auto [start, size] = MomentPart(moment_bytes(unit), moment_scale_bytes(unit), which);
  MT_CHECK(offset + bytes <= size);
  if (moments_on_disk(unit)) {
    return disk_->Read(unit, static_cast<int64_t>(start + offset), static_cast<int64_t>(bytes), dst);
  }
  std::memcpy(dst, static_cast<const char*>(moments(unit).m) + start + offset, bytes);
  return absl::OkStatus();
}

absl::Status HostStore::WriteMomentBytes(int64_t unit, int which, uint64_t offset, uint64_t bytes,
                                         const char* src) {
  const auto [start, size] = MomentPart(moment_bytes(unit), moment_scale_bytes(unit), which);
  MT_CHECK(offset + bytes <= size);
  if (moments_on_disk(unit)) {
    return disk_->Write(unit, static_cast<int64_t>(start + offset), static_cast<int64_t>(bytes),
                        src);
  }
  std::memcpy(static_cast<char*>(moments(unit).m) + start + offset, src, bytes);
  return absl::OkStatus();
}

UnitMoments HostStore::MomentsAt(int64_t unit, char* block) const {
  char* m = block;
  char* v = m + moment_bytes(unit);
  UnitMoments out{options_.moments, m, v, nullptr, nullptr};
  if (options_.moments == MomentDType::kInt8) {
    out.m_scales = reinterpret_cast<float*>(v + moment_bytes(unit));
    out.v_scales = reinterpret_cast<float*>(v + moment_bytes(unit) + moment_scale_bytes(unit));
  }
  return out;
}

void HostStore::ResetMoments(int64_t unit) {
  if (state_elements(unit) == 0) return;
  // m, v and the scales are contiguous; all-zero bytes are zero in every dtype.
  std::memset(moments(unit).m, 0, moment_block_bytes(unit));
}

uint16_t* HostStore::weights(int64_t unit) const {
  MT_CHECK_MSG(has_bf16(unit), "weights: unit %lld keeps no bf16 weights (its master streams)",
               static_cast<long long>(unit));
  return reinterpret_cast<uint16_t*>(transfer_.data() + units_[unit].transfer_offset);
}

float* HostStore::master(int64_t unit) const {
  MT_CHECK_MSG(!options_.weights_only, "master: this store keeps the bf16 weights alone");
  const UnitParts& p = units_[unit];
  MT_CHECK_MSG(p.state_elements > 0, "master: unit %lld is frozen", static_cast<long long>(unit));
  return reinterpret_cast<float*>(p.bf16 ? state_.data() + p.state_offset
                                         : transfer_.data() + p.transfer_offset);
}

void HostStore::ReadWeightsBf16(int64_t unit, int64_t begin, int64_t end, uint16_t* out) const {
  if (has_bf16(unit)) {
    std::memcpy(out, weights(unit) + begin, (end - begin) * sizeof(uint16_t));
    return;
  }
  const float* m = master(unit);  // the whole unit: it keeps no bf16 weights
#pragma omp parallel for schedule(static) if (end - begin > (1 << 20))
  for (int64_t i = begin; i < end; ++i) out[i - begin] = FloatToBf16(m[i]);
}

float* HostStore::exp_avg(int64_t unit) const {
  MT_CHECK_MSG(options_.moments == MomentDType::kF32, "exp_avg: the moments are %s",
               MomentDTypeName(options_.moments));
  return static_cast<float*>(moments(unit).m);
}

float* HostStore::exp_avg_sq(int64_t unit) const {
  MT_CHECK_MSG(options_.moments == MomentDType::kF32, "exp_avg_sq: the moments are %s",
               MomentDTypeName(options_.moments));
  return static_cast<float*>(moments(unit).v);
}

void HostStore::WriteTensor(int64_t unit, const TensorSlot& t, const float* values) {
  WriteTensorRange(unit, t, 0, t.num_elements, values);
}

void HostStore::WriteTensorRange(int64_t unit, const TensorSlot& t, int64_t first, int64_t count,
                                 const float* values) {
  MT_CHECK(first >= 0 && count >= 0 && first + count <= t.num_elements);
  const int64_t begin = state_begin(unit), end = begin + state_elements(unit);
  if (t.offset >= begin && t.offset + t.num_elements <= end) {
    std::memcpy(master(unit) + (t.offset - begin) + first, values, count * sizeof(float));
  }
  if (!has_bf16(unit)) return;
  uint16_t* w = weights(unit) + t.offset + first;
  for (int64_t i = 0; i < count; ++i) w[i] = FloatToBf16(values[i]);
}

void HostStore::RefreshWeightsFromMaster(int64_t unit) {
  if (!has_bf16(unit) || state_elements(unit) == 0) return;
  const float* m = master(unit);
  uint16_t* w = weights(unit) + state_begin(unit);
  const int64_t n = state_elements(unit);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) w[i] = FloatToBf16(m[i]);
}

}  // namespace megatrain
