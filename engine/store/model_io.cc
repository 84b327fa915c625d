#include "engine/store/model_io.h"

#include "engine/common/check.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

#include "engine/common/fnv1a.h"
#include "engine/common/status.h"
#include "engine/model/mxfp4.h"

namespace megatrain {
namespace {

// A tensor's generator seed: its name hashed by FNV-1a from this basis mixed with `seed`
// (a basis of its own, not FNV's: every random init so far drew from these seeds).
uint64_t NameSeed(const std::string& name, uint64_t seed) {
  return Fnv1a(name, 1469598103934665603ull ^ seed);
}

bool IsNorm(TensorRole r) {
  return r == TensorRole::kInputNorm || r == TensorRole::kPostNorm ||
         r == TensorRole::kQNorm || r == TensorRole::kKNorm || r == TensorRole::kFinalNorm;
}

bool IsBias(TensorRole r) {
  // transformers initialises these to zero (GPT-OSS's router bias and sinks are drawn).
  return r == TensorRole::kQBias || r == TensorRole::kKBias || r == TensorRole::kVBias ||
         r == TensorRole::kOBias || r == TensorRole::kExpertGateUpBias ||
         r == TensorRole::kExpertDownBias;
}

// A unit's fp32 weights as they are loaded or drawn. Where the store's master covers the
// whole unit they go there in place (zeroed first: a tensor nobody writes, an adapter, is
// zero). Elsewhere (a weights-only store, a unit whose frozen tensors keep bf16 alone) they
// go a range at a time into its bf16 weights and, for the tensors with state, its master
// (HostStore::WriteTensorRange), zeroed first too: never a fp32 copy of the whole unit, which
// for a layer of GPT-OSS-120B is 13 GB a thread. Commit() makes them the unit's state: the
// bf16 weights from the master, and zero moments (units whose moments are on disk need
// nothing: a store's scratch file starts as zeros).
class UnitWriter {
 public:
  UnitWriter(HostStore* store, int64_t unit) : store_(store), unit_(unit) {
    const int64_t n = store->unit_elements(unit), state = store->state_elements(unit);
    if (state > 0) std::memset(store->master(unit), 0, state * sizeof(float));
    if (state != n) std::memset(store->weights(unit), 0, n * sizeof(uint16_t));
    in_place_ = state == n;
  }
  // Where tensor t's fp32 values go directly, or nullptr where they go through Write.
  float* InPlace(const TensorSlot& t) {
    return in_place_ ? store_->master(unit_) + t.offset : nullptr;
  }
  void Write(const TensorSlot& t, int64_t first, int64_t count, const float* values) {
    store_->WriteTensorRange(unit_, t, first, count, values);
  }
  void Commit() {
    if (store_->state_elements(unit_) > 0 && !store_->moments_on_disk(unit_)) {
      store_->ResetMoments(unit_);
    }
    store_->RefreshWeightsFromMaster(unit_);
  }

 private:
  HostStore* store_;
  int64_t unit_;
  bool in_place_ = false;
};

// Bounds the fp32 bytes that a load's threads hold at once for tensors read whole before
// their rounding to bf16 (UnitWriter::Write): a thread waits while the others hold more
// than the budget beside its tensor; a tensor over the budget goes alone.
class StagingGate {
 public:
  explicit StagingGate(int64_t budget) : budget_(budget) {}
  void Acquire(int64_t bytes) {
    std::unique_lock<std::mutex> lock(mu_);
    freed_.wait(lock, [&] { return held_ == 0 || held_ + bytes <= budget_; });
    held_ += bytes;
  }
  void Release(int64_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_ -= bytes;
    }
    freed_.notify_all();
  }

 private:
  const int64_t budget_;
  int64_t held_ = 0;
  std::mutex mu_;
  std::condition_variable freed_;
};

// A quarter of the memory the system has free now: what a load may stage beside the store.
int64_t StagingBudget() {
  const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page / 4 : int64_t{1} << 30;
}

// GPT-OSS's experts stored as MXFP4 (`name`_blocks and `name`_scales, no `name`).
bool StoredAsMxfp4(const ModelTensorReader& reader, const TensorSlot& t) {
  return (t.role == TensorRole::kExpertGateUpT || t.role == TensorRole::kExpertDownT) &&
         !reader.Has(t.name) && HasMxfp4(reader, t.name);
}

}  // namespace

absl::Status CheckModelTensors(const ModelTensorReader& reader, const ModelLayout& layout) {
  for (const UnitLayout& u : layout.units) {
    for (const TensorSlot& t : u.tensors) {
      if (IsLora(t)) continue;  // the adapters are the job's, not the model's
      RETURN_IF_ERROR(StoredAsMxfp4(reader, t) ? CheckMxfp4(reader, t.name, t.shape)
                                               : reader.CheckTensor(t.name, t.shape));
    }
  }
  return absl::OkStatus();
}

absl::Status LoadWeights(const ModelTensorReader& reader, HostStore* store) {
  const ModelLayout& layout = store->layout();
  StagingGate gate(StagingBudget());
  // Units in parallel: each read is a pread into disjoint memory.
  absl::Status first_error;
  std::mutex mu;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t u = 0; u < store->num_units(); ++u) {
    UnitWriter unit(store, u);
    for (const TensorSlot& t : layout.units[u].tensors) {
      if (IsLora(t)) continue;  // zero: InitLoraAdapters draws them
      float* dst = unit.InPlace(t);
      std::vector<float> staged;
      const int64_t staged_bytes = dst == nullptr ? t.num_elements * int64_t{sizeof(float)} : 0;
      if (dst == nullptr) {
        gate.Acquire(staged_bytes);
        staged.resize(t.num_elements);
        dst = staged.data();
      }
      absl::Status s = StoredAsMxfp4(reader, t) ? ReadMxfp4AsFloat(reader, t.name, t.shape, dst)
                                                : reader.ReadAsFloat(t.name, t.shape, dst);
      if (s.ok() && !staged.empty()) unit.Write(t, 0, t.num_elements, dst);
      if (staged_bytes > 0) {
        std::vector<float>().swap(staged);
        gate.Release(staged_bytes);
      }
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.ok()) first_error = s;
        break;
      }
    }
    unit.Commit();
  }
  return first_error;
}

namespace {

// Draws tensor t's initial values (norms 1, biases 0, the rest N(0, range^2) from a
// generator seeded by its name and `seed`) into buf a chunk of `chunk` (even) at a time,
// handing each to emit(first, count, values): the same values for any chunk.
template <typename Emit>
void DrawTensor(const TensorSlot& t, double range, uint64_t seed, float* buf, int64_t chunk,
                Emit emit) {
  std::mt19937_64 gen(NameSeed(t.name, seed));
  for (int64_t first = 0; first < t.num_elements; first += chunk) {
    const int64_t n = std::min(chunk, t.num_elements - first);
    if (IsNorm(t.role) || IsBias(t.role)) {
      std::fill(buf, buf + n, IsNorm(t.role) ? 1.0f : 0.0f);
    } else {
      // Box-Muller written out: std::normal_distribution differs between libraries.
      const double kTwoPi = 6.283185307179586;
      for (int64_t i = 0; i < n; i += 2) {
        const double u1 = ((gen() >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
        const double u2 = (gen() >> 11) * 0x1.0p-53;
        const double r = std::sqrt(-2.0 * std::log(u1)) * range;
        buf[i] = static_cast<float>(r * std::cos(kTwoPi * u2));
        if (i + 1 < n) buf[i + 1] = static_cast<float>(r * std::sin(kTwoPi * u2));
      }
    }
    emit(first, n, buf);
  }
}

}  // namespace

void RandomInitWeights(const ModelConfig& config, uint64_t seed, HostStore* store) {
  const ModelLayout& layout = store->layout();
  constexpr int64_t kChunk = int64_t{1} << 16;  // floats drawn at a time where not in place
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t u = 0; u < store->num_units(); ++u) {
    UnitWriter unit(store, u);
    std::vector<float> chunk;
    for (const TensorSlot& t : layout.units[u].tensors) {
      if (IsLora(t)) continue;  // zero: InitLoraAdapters draws them
      if (float* dst = unit.InPlace(t)) {
        DrawTensor(t, config.initializer_range, seed, dst, std::max<int64_t>(t.num_elements, 2),
                   [](int64_t, int64_t, const float*) {});
      } else {
        chunk.resize(kChunk);
        DrawTensor(t, config.initializer_range, seed, chunk.data(), kChunk,
                   [&](int64_t first, int64_t n, const float* v) { unit.Write(t, first, n, v); });
      }
    }
    unit.Commit();
  }
}

void InitLoraAdapters(LoraInit init, uint64_t seed, HostStore* store) {
  const ModelLayout& layout = store->layout();
  constexpr double kTwoPi = 6.283185307179586;
  for (int64_t u = 0; u < store->num_units(); ++u) {
    for (const TensorSlot& t : layout.units[u].tensors) {
      if (t.role != TensorRole::kLoraA) continue;  // B stays zero
      const double rank = static_cast<double>(LoraRank(t));
      const double in = static_cast<double>(t.shape.back());
      std::vector<float> a(t.num_elements);
      std::mt19937_64 gen(NameSeed(t.name, seed));
      auto uniform = [&] { return ((gen() >> 11) + 0.5) * 0x1.0p-53; };  // (0, 1)
      for (int64_t i = 0; i < t.num_elements; ++i) {
        if (init == LoraInit::kGaussian) {  // N(0, 1/r): Box-Muller, one value a draw pair
          const double r = std::sqrt(-2.0 * std::log(uniform())) / rank;
          a[i] = static_cast<float>(r * std::cos(kTwoPi * uniform()));
        } else {  // U(-1/sqrt(in), 1/sqrt(in)): kaiming-uniform with a = sqrt(5)
          a[i] = static_cast<float>((2.0 * uniform() - 1.0) / std::sqrt(in));
        }
      }
      store->WriteTensor(u, t, a.data());
    }
  }
}

absl::Status LoadLoraAdapter(const std::string& folder, const LoraConfig& lora,
                             HostStore* store) {
  ASSIGN_OR_RETURN(const LoraConfig saved, ReadPeftAdapterConfig(folder));
  if (saved.rank != lora.rank) {
    return absl::InvalidArgumentError(absl::StrCat("lora.adapter ", folder, " has r ", saved.rank,
                                                   "; lora.rank is ", lora.rank));
  }
  ASSIGN_OR_RETURN(ModelTensorReader reader, ModelTensorReader::OpenFolder(folder));
  const ModelLayout& layout = store->layout();
  RETURN_IF_ERROR(CheckAdapterHoldsOnlyLayouts(layout, reader, "lora.adapter", folder));
  for (int64_t u = 0; u < store->num_units(); ++u) {
    for (const TensorSlot& t : layout.units[u].tensors) {
      if (!IsLora(t)) continue;
      const std::string name = kPeftPrefix + t.name;
      std::vector<float> file(t.num_elements), values(t.num_elements);
      RETURN_IF_ERROR(
          Annotate(reader.ReadAsFloat(name, PeftShape(t), file.data()), "lora.adapter"));
      LoraFromPeftOrder(t, file.data(), values.data());
      store->WriteTensor(u, t, values.data());
    }
  }
  return absl::OkStatus();
}

}  // namespace megatrain
