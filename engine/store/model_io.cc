#include "engine/store/model_io.h"

#include "engine/common/check.h"

#include <cmath>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

#include "engine/common/status.h"
#include "engine/model/mxfp4.h"

namespace megatrain {
namespace {

uint64_t Fnv1a(const std::string& s, uint64_t seed) {
  uint64_t h = 1469598103934665603ull ^ seed;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
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

// A unit's fp32 weights as they are loaded or drawn, zeroed first: the store's master when
// it covers the whole unit, else a buffer of its own (a weights-only store, a unit with
// frozen tensors kept as bf16 alone). Commit() makes them the unit's state: the bf16
// weights from them, the master's range, and zero moments (units whose moments are on disk
// need nothing: a store's scratch file starts as zeros).
class UnitMaster {
 public:
  UnitMaster(HostStore* store, int64_t unit) : store_(store), unit_(unit) {
    const int64_t n = store->unit_elements(unit);
    if (store->state_elements(unit) == n) {
      data_ = store->master(unit);
      std::memset(data_, 0, n * sizeof(float));
    } else {
      own_.assign(n, 0.0f);
      data_ = own_.data();
    }
  }
  float* data() { return data_; }
  void Commit() {
    if (!own_.empty()) {
      uint16_t* w = store_->weights(unit_);
      for (size_t i = 0; i < own_.size(); ++i) w[i] = FloatToBf16(own_[i]);
      const int64_t begin = store_->state_begin(unit_), count = store_->state_elements(unit_);
      if (count > 0) std::memcpy(store_->master(unit_), own_.data() + begin, count * sizeof(float));
    }
    if (store_->state_elements(unit_) > 0 && !store_->moments_on_disk(unit_)) {
      store_->ResetMoments(unit_);
    }
    store_->RefreshWeightsFromMaster(unit_);
  }

 private:
  HostStore* store_;
  int64_t unit_;
  float* data_;
  std::vector<float> own_;
};

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
  // Units in parallel: each read is a pread into disjoint memory.
  absl::Status first_error;
  std::mutex mu;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t u = 0; u < store->num_units(); ++u) {
    UnitMaster master(store, u);
    for (const TensorSlot& t : layout.units[u].tensors) {
      if (IsLora(t)) continue;  // zero: InitLoraAdapters draws them
      float* dst = master.data() + t.offset;
      absl::Status s = StoredAsMxfp4(reader, t) ? ReadMxfp4AsFloat(reader, t.name, t.shape, dst)
                                                : reader.ReadAsFloat(t.name, t.shape, dst);
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.ok()) first_error = s;
        break;
      }
    }
    master.Commit();
  }
  return first_error;
}

void RandomInitWeights(const ModelConfig& config, uint64_t seed, HostStore* store) {
  const ModelLayout& layout = store->layout();
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t u = 0; u < store->num_units(); ++u) {
    UnitMaster master(store, u);
    for (const TensorSlot& t : layout.units[u].tensors) {
      float* p = master.data() + t.offset;
      if (IsLora(t)) continue;  // zero: InitLoraAdapters draws them
      if (IsNorm(t.role)) {
        for (int64_t i = 0; i < t.num_elements; ++i) p[i] = 1.0f;
      } else if (!IsBias(t.role)) {
        // Box-Muller written out: std::normal_distribution differs between libraries.
        std::mt19937_64 gen(Fnv1a(t.name, seed));
        const double kTwoPi = 6.283185307179586;
        for (int64_t i = 0; i < t.num_elements; i += 2) {
          const double u1 = ((gen() >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
          const double u2 = (gen() >> 11) * 0x1.0p-53;
          const double r = std::sqrt(-2.0 * std::log(u1)) * config.initializer_range;
          p[i] = static_cast<float>(r * std::cos(kTwoPi * u2));
          if (i + 1 < t.num_elements) p[i + 1] = static_cast<float>(r * std::sin(kTwoPi * u2));
        }
      }
    }
    master.Commit();
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
      std::mt19937_64 gen(Fnv1a(t.name, seed));
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
