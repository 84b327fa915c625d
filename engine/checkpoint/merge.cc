#include "engine/checkpoint/merge.h"

#include <filesystem>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/common/dtype.h"
#include "engine/common/durable_file.h"
#include "engine/common/status.h"
#include "engine/model/config.h"
#include "engine/model/lora.h"
#include "engine/model/safetensors.h"

namespace megatrain {
namespace fs = std::filesystem;
namespace {

constexpr const char* kCopiedFiles[] = {"config.json", "generation_config.json",
                                        "tokenizer.json", "tokenizer_config.json",
                                        "special_tokens_map.json", "tokenizer.model",
                                        "chat_template.jinja"};

// W += scale B (out, r) A (r, in), summed in double: W (out, in), or (in, out) when
// `transposed` (GPT-OSS's input-major experts).
void AddLowRank(float* w, const float* a, const float* b, int64_t out, int64_t in, int64_t r,
                double scale, bool transposed) {
#pragma omp parallel for schedule(static)
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      double sum = 0;
      for (int64_t j = 0; j < r; ++j) {
        sum += static_cast<double>(b[o * r + j]) * static_cast<double>(a[j * in + i]);
      }
      float& x = transposed ? w[i * out + o] : w[o * in + i];
      x = static_cast<float>(x + scale * sum);
    }
  }
}

// A unit's adapters from the adapter folder, in the layout's order.
absl::StatusOr<std::map<const TensorSlot*, std::vector<float>>> ReadAdapters(
    const UnitLayout& unit, const ModelTensorReader& adapter) {
  std::map<const TensorSlot*, std::vector<float>> out;
  for (const TensorSlot& t : unit.tensors) {
    if (!IsLora(t)) continue;
    std::vector<float> file(t.num_elements);
    RETURN_IF_ERROR(Annotate(adapter.ReadAsFloat(kPeftPrefix + t.name, PeftShape(t), file.data()),
                             "merge: the adapter"));
    std::vector<float>& values = out[&t];
    values.resize(t.num_elements);
    LoraFromPeftOrder(t, file.data(), values.data());
  }
  return out;
}

// Adds the adapter's product to the base tensor `t` (W as the model file holds it): a
// projection's whole; an expert's share of its experts' adapter (Qwen3-MoE's and Mixtral's
// per-expert gate, up or down: its rows of expert e's product); GPT-OSS's experts, each
// expert's product transposed into its input-major slice.
void MergeInto(const UnitLayout& unit, const TensorSlot& t,
               const std::map<const TensorSlot*, std::vector<float>>& adapters, double scale,
               float* w) {
  const TensorRole base = t.role == TensorRole::kExpertUp ? TensorRole::kExpertGate : t.role;
  const TensorSlot* a = unit.FindLora(base, TensorRole::kLoraA);
  if (a == nullptr) return;
  const TensorSlot* b = unit.FindLora(base, TensorRole::kLoraB);
  const float* av = adapters.at(a).data();
  const float* bv = adapters.at(b).data();
  const int64_t r = LoraRank(*a), in = a->shape.back();
  const int64_t E = LoraExperts(*a);
  if (E == 0) {
    AddLowRank(w, av, bv, t.shape[0], t.shape[1], r, scale, false);
    return;
  }
  const int64_t out = b->shape[1];
  if (t.expert < 0) {  // GPT-OSS: (E, in, out)
    for (int64_t e = 0; e < E; ++e) {
      AddLowRank(w + e * in * out, av + e * r * in, bv + e * out * r, out, in, r, scale, true);
    }
    return;
  }
  const int64_t rows = t.shape[0];  // this expert's gate (rows 0..I), up (I..2I) or down
  const int64_t first = t.role == TensorRole::kExpertUp ? out - rows : 0;
  AddLowRank(w, av + t.expert * r * in, bv + (t.expert * out + first) * r, rows, in, r, scale,
             false);
}

// The base's tensors into `writer`, the adapted ones merged.
absl::Status WriteMerged(const ModelLayout& layout, double scale, const ModelTensorReader& base,
                         const ModelTensorReader& adapter, ShardedSafetensorsWriter* writer) {
  size_t index = 0;
  for (const UnitLayout& unit : layout.units) {
    ASSIGN_OR_RETURN(const auto adapters, ReadAdapters(unit, adapter));
    for (const TensorSlot& t : unit.tensors) {
      if (IsLora(t)) continue;
      std::vector<float> w(t.num_elements);
      RETURN_IF_ERROR(Annotate(base.ReadAsFloat(t.name, t.shape, w.data()), "merge: the base"));
      MergeInto(unit, t, adapters, scale, w.data());
      std::vector<uint16_t> bf16(t.num_elements);
      for (int64_t i = 0; i < t.num_elements; ++i) bf16[i] = FloatToBf16(w[i]);
      RETURN_IF_ERROR(writer->WriteBytes(index++, 0, bf16.data(), bf16.size() * 2));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status MergeLoraAdapter(const std::string& base, const std::string& adapter,
                              const std::string& out) {
  std::error_code ec;
  if (fs::exists(out, ec) && !fs::is_empty(out, ec)) {
    return absl::AlreadyExistsError(
        absl::StrCat("merge: ", out, " exists and is not empty; name a new folder"));
  }
  ASSIGN_OR_RETURN(const ModelConfig config, LoadModelConfig(base + "/config.json"));
  ASSIGN_OR_RETURN(const LoraConfig lora, ReadPeftAdapterConfig(adapter));
  ModelLayout layout = BuildLayout(config);
  RETURN_IF_ERROR(Annotate(AddLoraAdapters(lora, config, &layout),
                           absl::StrCat("merge: the adapter ", adapter)));
  ASSIGN_OR_RETURN(ModelTensorReader base_reader, ModelTensorReader::OpenFolder(base));
  ASSIGN_OR_RETURN(ModelTensorReader adapter_reader, ModelTensorReader::OpenFolder(adapter));
  RETURN_IF_ERROR(
      CheckAdapterHoldsOnlyLayouts(layout, adapter_reader, "merge: the adapter", adapter));

  const std::string tmp = out + ".tmp";
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("merge: cannot create ", tmp, ": ", ec.message()));
  }
  std::vector<TensorToWrite> tensors;
  for (const UnitLayout& unit : layout.units) {
    for (const TensorSlot& t : unit.tensors) {
      if (!IsLora(t)) tensors.push_back(TensorToWrite{t.name, DType::kBF16, t.shape, nullptr});
    }
  }
  {
    ASSIGN_OR_RETURN(std::unique_ptr<ShardedSafetensorsWriter> writer,
                     ShardedSafetensorsWriter::Open(tmp, "model", tensors, 5ull << 30,
                                                    {{"format", "pt"}}));
    RETURN_IF_ERROR(WriteMerged(layout, lora.Scale(), base_reader, adapter_reader, writer.get()));
    RETURN_IF_ERROR(writer->Commit());
  }
  for (const char* file : kCopiedFiles) {
    const fs::path src = fs::path(base) / file;
    if (!fs::exists(src, ec)) continue;
    fs::copy_file(src, fs::path(tmp) / file, fs::copy_options::overwrite_existing, ec);
    if (ec) {
      return absl::InternalError(
          absl::StrCat("merge: copying ", src.string(), ": ", ec.message()));
    }
    RETURN_IF_ERROR(FsyncPath((fs::path(tmp) / file).string()));
  }
  RETURN_IF_ERROR(FsyncPath(tmp));
  fs::remove(out, ec);  // empty, if there
  fs::rename(tmp, out, ec);
  if (ec) return absl::InternalError(absl::StrCat("merge: rename to ", out, ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace megatrain
