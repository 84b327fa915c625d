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

// W (out, in) += scale B (out, r) A (r, in), summed in double.
void AddLowRank(float* w, const std::vector<float>& a, const std::vector<float>& b, int64_t out,
                int64_t in, int64_t r, double scale) {
#pragma omp parallel for schedule(static)
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      double sum = 0;
      for (int64_t j = 0; j < r; ++j) {
        sum += static_cast<double>(b[o * r + j]) * static_cast<double>(a[j * in + i]);
      }
      w[o * in + i] = static_cast<float>(w[o * in + i] + scale * sum);
    }
  }
}

// The base's tensors into `writer`, the adapted ones merged.
absl::Status WriteMerged(const ModelLayout& layout, double scale, const ModelTensorReader& base,
                         const ModelTensorReader& adapter, ShardedSafetensorsWriter* writer) {
  size_t index = 0;
  for (const UnitLayout& unit : layout.units) {
    for (const TensorSlot& t : unit.tensors) {
      if (IsLora(t)) continue;
      std::vector<float> w(t.num_elements);
      RETURN_IF_ERROR(Annotate(base.ReadAsFloat(t.name, t.shape, w.data()), "merge: the base"));
      const TensorSlot* a = unit.FindLora(t.role, TensorRole::kLoraA);
      if (a != nullptr) {
        const TensorSlot* b = unit.FindLora(t.role, TensorRole::kLoraB);
        std::vector<float> av(a->num_elements), bv(b->num_elements);
        RETURN_IF_ERROR(Annotate(adapter.ReadAsFloat(kPeftPrefix + a->name, a->shape, av.data()),
                                 "merge: the adapter"));
        RETURN_IF_ERROR(Annotate(adapter.ReadAsFloat(kPeftPrefix + b->name, b->shape, bv.data()),
                                 "merge: the adapter"));
        AddLowRank(w.data(), av, bv, t.shape[0], t.shape[1], a->shape[0], scale);
      }
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
