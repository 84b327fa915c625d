#include "engine/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"
#include "engine/common/check.h"
#include "engine/common/durable_file.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"
#include "engine/model/lora.h"
#include "engine/model/safetensors.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace fs = std::filesystem;
namespace {

constexpr const char* kTokenizerFiles[] = {"tokenizer.json", "tokenizer_config.json",
                                           "special_tokens_map.json", "tokenizer.model",
                                           "generation_config.json", "chat_template.jinja"};

// A FIFO or a device by that name is refused without blocking (ReadWholeFile).
absl::StatusOr<std::string> ReadFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadWholeFile(path);
  if (!text.ok()) return Annotate(text.status(), "cannot read");
  return text;
}

// A part's tensors within one unit: (name, shape, element offset in the unit's buffer).
struct PartTensor {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;
  int64_t num_elements = 0;
  // An experts' LoRA B in the adapter file: PEFT's order is not the layout's
  // (LoraLayoutIndex), so its bytes are gathered; null for every other tensor.
  std::shared_ptr<const TensorSlot> peft_order;
};

// The parts of a checkpoint: the model as transformers loads it (bf16), and the optimizer
// state in one folder of safetensors each, Hugging Face tensor names; int8 moments add
// their block scales, one tensor per unit ("<unit>.block_scales").
struct PartInfo {
  std::string dir;  // under the checkpoint folder
  DType dtype;
  void* (*base)(const HostStore&, int64_t unit);
  bool block_scales = false;  // one (blocks) tensor per unit, not the model's tensors
  int moment = -1;            // 0 m, 1 v, 2 m's scales, 3 v's (HostStore::ReadMomentBytes)
  // The model part of a job with LoRA adapters: the adapters alone as PEFT saves them
  // (adapter_model.safetensors, PEFT's names, f32 from the master), not the frozen base.
  bool adapters = false;
};

// A unit's moments in RAM; null pointers when they are on disk or it has none.
UnitMoments MomentsIn(const HostStore& s, int64_t u) {
  return s.state_elements(u) == 0 || s.moments_on_disk(u) ? UnitMoments{} : s.moments(u);
}

void* MasterOf(const HostStore& s, int64_t u) {
  return s.state_elements(u) > 0 ? s.master(u) : nullptr;
}

std::vector<PartInfo> PartsFor(MomentDType moments, bool adapters) {
  const bool f32 = moments == MomentDType::kF32, bf16 = moments == MomentDType::kBF16;
  std::vector<PartInfo> parts = {
      // Without a bf16 copy the model is rounded from the master as it is written.
      {"", DType::kBF16,
       [](const HostStore& s, int64_t u) -> void* {
         return s.has_bf16(u) ? s.weights(u) : nullptr;
       }},
      // The optimizer parts cover each unit's state range (HostStore::state_begin); a unit
      // without state has no tensors there.
      {"optimizer/master", DType::kF32, MasterOf},
      // Moments kept on disk (the NVMe tier) have no pointer: read through the store.
      {"optimizer/exp_avg", f32 ? DType::kF32 : bf16 ? DType::kBF16 : DType::kI8,
       [](const HostStore& s, int64_t u) -> void* { return MomentsIn(s, u).m; }, false, 0},
      {"optimizer/exp_avg_sq", f32 ? DType::kF32 : bf16 ? DType::kBF16 : DType::kU8,
       [](const HostStore& s, int64_t u) -> void* { return MomentsIn(s, u).v; }, false, 1},
  };
  if (moments == MomentDType::kInt8) {
    parts.push_back({"optimizer/exp_avg_scales", DType::kF32,
                     [](const HostStore& s, int64_t u) -> void* {
                       return MomentsIn(s, u).m_scales;
                     },
                     true, 2});
    parts.push_back({"optimizer/exp_avg_sq_scales", DType::kF32,
                     [](const HostStore& s, int64_t u) -> void* {
                       return MomentsIn(s, u).v_scales;
                     },
                     true, 3});
  }
  if (adapters) parts[0] = PartInfo{"", DType::kF32, MasterOf, false, -1, true};
  return parts;
}

const char* FilePrefix(const PartInfo& part) { return part.adapters ? "adapter_model" : "model"; }

// The unit's elements in a part: the model's all of them; an optimizer part's its state
// range (elements, or their blocks' scales).
int64_t UnitPartElements(const UnitLayout& unit, const PartInfo& part) {
  if (part.dir.empty() && !part.adapters) return unit.num_elements;
  const auto [begin, end] = unit.StateRange();
  return part.block_scales ? (end - begin + kMomentBlock - 1) / kMomentBlock : end - begin;
}

// The unit's tensors in a part, offsets into its buffer there: the model's every tensor;
// an optimizer part's the tensors in the state range, from the range's start (or its
// blocks' scales).
std::vector<PartTensor> UnitTensors(const UnitLayout& unit, const PartInfo& part) {
  std::vector<PartTensor> out;
  const int64_t elements = UnitPartElements(unit, part);
  if (elements == 0) return out;
  if (part.block_scales) {
    out.push_back(PartTensor{unit.name + ".block_scales", {elements}, 0, elements, nullptr});
    return out;
  }
  const bool whole = part.dir.empty() && !part.adapters;  // the model's every tensor
  const int64_t begin = whole ? 0 : unit.StateRange().first;
  for (const TensorSlot& t : unit.tensors) {
    if (!whole && !unit.HasState(t)) continue;
    if (part.adapters && !IsLora(t)) continue;
    if (part.adapters) {
      PartTensor p{kPeftPrefix + t.name, PeftShape(t), t.offset - begin, t.num_elements, nullptr};
      if (LoraExperts(t) > 0 && t.role == TensorRole::kLoraB) {
        p.peft_order = std::make_shared<const TensorSlot>(t);
      }
      out.push_back(std::move(p));
      continue;
    }
    out.push_back(PartTensor{t.name, t.shape, t.offset - begin, t.num_elements, nullptr});
  }
  return out;
}

int64_t StepOf(const std::string& name) {
  const std::string prefix = "checkpoint-";
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size()) return -1;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
  }
  if (name.size() - prefix.size() > 18) return -1;  // beyond int64: not one of ours
  return std::stoll(name.substr(prefix.size()));
}

}  // namespace

struct CheckpointWriter::Part {
  PartInfo info;
  std::vector<std::vector<PartTensor>> units;  // per unit, its tensors in this part
  std::vector<int64_t> first_tensor;           // per unit: its first tensor's index
  std::unique_ptr<ShardedSafetensorsWriter> writer;
};

absl::StatusOr<std::unique_ptr<CheckpointWriter>> CheckpointWriter::Begin(
    const std::string& root, const ModelConfig& config, const ModelLayout& layout,
    int64_t step, const CheckpointOptions& options) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", root, ": ", ec.message()));
  std::unique_ptr<CheckpointWriter> w(new CheckpointWriter());
  w->root_ = root;
  w->step_ = step;
  w->layout_ = layout;
  w->piece_bytes_ = std::max<uint64_t>(options.piece_bytes, 1);
  const std::string name = absl::StrCat("checkpoint-", step);
  w->final_ = (fs::path(root) / name).string();
  w->tmp_ = (fs::path(root) / absl::StrCat(".", name, ".tmp")).string();
  fs::remove_all(w->tmp_, ec);
  const std::vector<PartInfo> parts = PartsFor(options.moments, HasLora(layout));
  for (const PartInfo& part : parts) {
    fs::create_directories(fs::path(w->tmp_) / part.dir, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot create ", w->tmp_, ": ", ec.message()));
  }
  RETURN_IF_ERROR(WriteFileSynced((fs::path(w->tmp_) / "config.json").string(),
                                  ModelConfigToJson(config)));
  if (!options.tokenizer_dir.empty()) {
    for (const char* file : kTokenizerFiles) {
      fs::path src = fs::path(options.tokenizer_dir) / file;
      if (!fs::exists(src, ec)) continue;  // the overload that cannot throw (a symlink loop)
      fs::copy_file(src, fs::path(w->tmp_) / file, fs::copy_options::overwrite_existing, ec);
      if (ec) return absl::InternalError(absl::StrCat("copying ", src.string(), ": ", ec.message()));
      RETURN_IF_ERROR(FsyncPath((fs::path(w->tmp_) / file).string()));
    }
  }
  if (!options.adapter_config.empty()) {
    RETURN_IF_ERROR(WriteFileSynced((fs::path(w->tmp_) / "adapter_config.json").string(),
                                    options.adapter_config));
  }
  w->moments_ = options.moments;
  const std::map<std::string, std::string> pt = {{"format", "pt"}};
  for (const PartInfo& part : parts) {
    auto p = std::make_unique<Part>();
    p->info = part;
    std::vector<TensorToWrite> tensors;
    for (const UnitLayout& unit : layout.units) {
      p->first_tensor.push_back(static_cast<int64_t>(tensors.size()));
      p->units.push_back(UnitTensors(unit, part));
      for (const PartTensor& t : p->units.back()) {
        tensors.push_back(TensorToWrite{t.name, part.dtype, t.shape, nullptr});
      }
    }
    ASSIGN_OR_RETURN(p->writer, ShardedSafetensorsWriter::Open(
                                    (fs::path(w->tmp_) / part.dir).string(), FilePrefix(part),
                                    tensors,
                                    part.dir.empty() ? options.max_shard_bytes
                                                     : std::min(options.max_shard_bytes,
                                                                options.optimizer_shard_bytes),
                                    pt));
    w->parts_.push_back(std::move(p));
  }
  return w;
}

CheckpointWriter::~CheckpointWriter() {
  if (committed_) return;
  // An abandoned or failed save leaves no half checkpoint behind and gives the space it
  // took back; the checkpoints before it are untouched.
  parts_.clear();  // closes the files first
  std::error_code ec;
  fs::remove_all(tmp_, ec);
}

absl::Status CheckpointWriter::WriteUnit(const HostStore& store, int64_t unit) {
  for (int64_t piece = 0; piece < NumPieces(unit); ++piece) {
    RETURN_IF_ERROR(WritePiece(store, unit, piece));
  }
  return absl::OkStatus();
}

// A unit's buffer in a part: the unit's elements, or its blocks' scales.
uint64_t CheckpointWriter::UnitPartBytes(int64_t unit, int part) const {
  const Part& p = *parts_[part];
  return static_cast<uint64_t>(UnitPartElements(layout_.units[unit], p.info)) *
         DTypeSize(p.info.dtype);
}

int64_t CheckpointWriter::PiecesPerPart(int64_t unit, int part) const {
  const uint64_t bytes = UnitPartBytes(unit, part);
  return static_cast<int64_t>(std::max<uint64_t>(1, (bytes + piece_bytes_ - 1) / piece_bytes_));
}

int64_t CheckpointWriter::NumPieces(int64_t unit) const {
  int64_t n = 0;
  for (size_t part = 0; part < parts_.size(); ++part) n += PiecesPerPart(unit, static_cast<int>(part));
  return n;
}

void CheckpointWriter::Locate(int64_t unit, int64_t piece, size_t* part, uint64_t* begin,
                              uint64_t* end) const {
  *part = 0;
  while (piece >= PiecesPerPart(unit, static_cast<int>(*part))) {
    piece -= PiecesPerPart(unit, static_cast<int>(*part));
    ++*part;
  }
  MT_CHECK(*part < parts_.size());
  // The unit's part split evenly, at element boundaries: a piece of the model rounded from
  // the master must hold whole bf16 elements.
  const uint64_t element = DTypeSize(parts_[*part]->info.dtype);
  const uint64_t elements = UnitPartBytes(unit, static_cast<int>(*part)) / element;
  const uint64_t pieces = static_cast<uint64_t>(PiecesPerPart(unit, static_cast<int>(*part)));
  *begin = elements * piece / pieces * element;
  *end = elements * (piece + 1) / pieces * element;
}

int64_t CheckpointWriter::PieceFile(int64_t unit, int64_t piece) const {
  size_t part;
  uint64_t begin, end;
  Locate(unit, piece, &part, &begin, &end);
  const Part& p = *parts_[part];
  const uint64_t element = DTypeSize(p.info.dtype);
  const std::vector<PartTensor>& tensors = p.units[unit];
  if (tensors.empty()) return static_cast<int64_t>(part) * (int64_t{1} << 32);  // nothing to write
  size_t i = 0;  // the tensor holding the piece's first byte
  while (i + 1 < tensors.size() &&
         static_cast<uint64_t>(tensors[i + 1].offset) * element <= begin) {
    ++i;
  }
  const size_t shard = p.writer->ShardOf(static_cast<size_t>(p.first_tensor[unit]) + i);
  return static_cast<int64_t>(part) * (int64_t{1} << 32) + static_cast<int64_t>(shard);
}

absl::Status CheckpointWriter::WritePiece(const HostStore& store, int64_t unit, int64_t piece) {
  size_t part;
  uint64_t begin, end;
  Locate(unit, piece, &part, &begin, &end);
  const Part& p = *parts_[part];
  MT_CHECK_MSG(store.moment_dtype() == moments_,
               "checkpoint: begun for %s moments, written from a store of %s",
               MomentDTypeName(moments_), MomentDTypeName(store.moment_dtype()));
  const uint64_t element = DTypeSize(p.info.dtype);
  // Each tensor the piece meets, its share.
  const std::vector<PartTensor>& tensors = p.units[unit];
  if (tensors.empty()) return absl::OkStatus();  // a unit without state, in an optimizer part
  const char* base = static_cast<const char*>(p.info.base(store, unit));
  MT_CHECK(base != nullptr || (p.info.dir.empty() && !p.info.adapters) || p.info.moment >= 0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t t_begin = static_cast<uint64_t>(tensors[i].offset) * element;
    const uint64_t t_end = t_begin + static_cast<uint64_t>(tensors[i].num_elements) * element;
    const uint64_t b = std::max(begin, t_begin), e = std::min(end, t_end);
    if (b >= e) continue;
    const char* bytes = base + b;
    std::vector<uint16_t> rounded;
    std::vector<char> read;
    std::vector<float> gathered;
    if (tensors[i].peft_order != nullptr) {  // an experts' LoRA B, f32 from the master
      MT_CHECK(element == sizeof(float) && base != nullptr);
      const float* values = reinterpret_cast<const float*>(base) + tensors[i].offset;
      for (uint64_t f = (b - t_begin) / element; f < (e - t_begin) / element; ++f) {
        gathered.push_back(
            values[LoraLayoutIndex(*tensors[i].peft_order, static_cast<int64_t>(f))]);
      }
      bytes = reinterpret_cast<const char*>(gathered.data());
    } else if (base == nullptr && p.info.moment >= 0) {  // moments on disk
      read.resize(e - b);
      RETURN_IF_ERROR(store.ReadMomentBytes(unit, p.info.moment, b, e - b, read.data()));
      bytes = read.data();
    } else if (base == nullptr) {  // the model of a store without a bf16 copy: from the master
      rounded.resize((e - b) / 2);
      store.ReadWeightsBf16(unit, static_cast<int64_t>(b / 2), static_cast<int64_t>(e / 2),
                            rounded.data());
      bytes = reinterpret_cast<const char*>(rounded.data());
    }
    RETURN_IF_ERROR(p.writer->WriteBytes(static_cast<size_t>(p.first_tensor[unit]) + i,
                                         b - t_begin, bytes, e - b));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> CheckpointWriter::Commit(const TrainerState& state) {
  MT_CHECK(!committed_);
  MT_CHECK(state.step == step_);
  for (const std::unique_ptr<Part>& part : parts_) {
    RETURN_IF_ERROR(part->writer->Commit());
  }
  nlohmann::json js = {{"step", state.step},
                       {"data_position", DataPositionToJson(state.data)},
                       {"data_seed", state.data_seed},
                       {"init_seed", state.init_seed},
                       {"last_loss", state.last_loss},
                       {"spec_fingerprint", state.spec_fingerprint},
                       {"optimizer_state_dtype", MomentDTypeName(moments_)}};
  if (state.micro_batch_rows > 0) {
    js["plan"] = {{"micro_batch_rows", state.micro_batch_rows},
                  {"mlp_tile_tokens", state.mlp_tile_tokens}};
    if (!state.clip_store.empty()) js["plan"]["clip_store"] = state.clip_store;
  }
  RETURN_IF_ERROR(WriteFileSynced((fs::path(tmp_) / "trainer_state.json").string(), js.dump(2)));
  RETURN_IF_ERROR(FsyncPath((fs::path(tmp_) / "optimizer").string()));
  RETURN_IF_ERROR(FsyncPath(tmp_));
  std::error_code ec;
  fs::remove_all(final_, ec);  // a re-save of the same step replaces it
  fs::rename(tmp_, final_, ec);
  if (ec) return absl::InternalError(absl::StrCat("rename to ", final_, ": ", ec.message()));
  RETURN_IF_ERROR(FsyncPath(root_));
  committed_ = true;
  return final_;
}

uint64_t CheckpointWriter::data_bytes() const {
  uint64_t n = 0;
  for (const std::unique_ptr<Part>& part : parts_) n += part->writer->total_file_bytes();
  return n;
}

absl::StatusOr<std::string> SaveCheckpoint(const std::string& root, const ModelConfig& config,
                                           const HostStore& store, const TrainerState& state,
                                           const CheckpointOptions& options) {
  CheckpointOptions with_moments = options;
  with_moments.moments = store.moment_dtype();
  ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                   CheckpointWriter::Begin(root, config, store.layout(), state.step,
                                           with_moments));
  for (int64_t u = 0; u < store.num_units(); ++u) RETURN_IF_ERROR(writer->WriteUnit(store, u));
  return writer->Commit(state);
}

namespace {

absl::StatusOr<nlohmann::json> ReadTrainerStateJson(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFile((fs::path(path) / "trainer_state.json").string()));
  nlohmann::json js = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (js.is_discarded() || !js.is_object()) {
    return absl::DataLossError(absl::StrCat(path, "/trainer_state.json is not valid JSON"));
  }
  return js;
}

absl::StatusOr<TrainerState> TrainerStateFromJson(const std::string& path,
                                                  const nlohmann::json& js) {
  TrainerState state;
  try {
    state.step = js.at("step").get<int64_t>();
    ASSIGN_OR_RETURN(state.data, DataPositionFromJson(js.at("data_position")));
    state.data_seed = js.at("data_seed").get<uint64_t>();
    state.init_seed = js.at("init_seed").get<uint64_t>();
    // JSON has no NaN: a diverged loss is written as null.
    const nlohmann::json& loss = js.at("last_loss");
    state.last_loss = loss.is_null() ? std::nan("") : loss.get<double>();
    state.spec_fingerprint = js.value("spec_fingerprint", "");
    if (js.contains("plan")) {
      const nlohmann::json& plan = js.at("plan");
      state.micro_batch_rows = plan.at("micro_batch_rows").get<int64_t>();
      state.mlp_tile_tokens = plan.at("mlp_tile_tokens").get<int64_t>();
      if (state.micro_batch_rows < 1 || state.mlp_tile_tokens < 0) {
        return absl::DataLossError(absl::StrCat(
            path, "/trainer_state.json: plan.micro_batch_rows must be positive and "
            "plan.mlp_tile_tokens not negative, got ", state.micro_batch_rows, " and ",
            state.mlp_tile_tokens));
      }
      state.clip_store = plan.value("clip_store", "");
      if (!state.clip_store.empty() && state.clip_store != "fp32" && state.clip_store != "fp16") {
        return absl::DataLossError(absl::StrCat(
            path, "/trainer_state.json: plan.clip_store must be fp32 or fp16, got '",
            Printable(state.clip_store), "'"));
      }
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(absl::StrCat(path, "/trainer_state.json: ", Printable(e.what())));
  }
  return state;
}

}  // namespace

absl::StatusOr<TrainerState> ReadTrainerState(const std::string& path) {
  ASSIGN_OR_RETURN(const nlohmann::json js, ReadTrainerStateJson(path));
  return TrainerStateFromJson(path, js);
}

absl::Status LoadCheckpoint(const std::string& path, HostStore* store, TrainerState* state) {
  ASSIGN_OR_RETURN(const nlohmann::json js, ReadTrainerStateJson(path));
  ASSIGN_OR_RETURN(*state, TrainerStateFromJson(path, js));
  // Moments as they were kept (fp32 when the checkpoint does not say: written before
  // the choice existed); they must match the job's.
  MomentDType saved = MomentDType::kF32;
  const std::string saved_name = js.value("optimizer_state_dtype", "fp32");
  if (!ParseMomentDType(saved_name, &saved)) {
    return absl::DataLossError(absl::StrCat(path, "/trainer_state.json: optimizer_state_dtype \"",
                                            Printable(saved_name), "\" is not fp32, bf16 or int8"));
  }
  if (saved != store->moment_dtype()) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " keeps its AdamW moments in ", MomentDTypeName(saved), "; this job asks for ",
        MomentDTypeName(store->moment_dtype()),
        " (optimizer.state_dtype): resume with the same, or start from the checkpoint's model "
        "files as a new run"));
  }
  // Zeroed first: alignment padding between tensors is not in the files, and int8 blocks
  // that cover it read its codes as zeros, as training left them. Units whose moments are
  // on disk are assembled in RAM, then written there at once.
  for (int64_t u = 0; u < store->num_units(); ++u) {
    if (!store->moments_on_disk(u)) store->ResetMoments(u);
  }
  std::map<int64_t, std::vector<char>> disk_blocks;
  for (int64_t u = 0; u < store->num_units(); ++u) {
    if (store->moments_on_disk(u)) disk_blocks[u].assign(store->moment_block_bytes(u), 0);
  }
  for (const PartInfo& part : PartsFor(saved, HasLora(store->layout()))) {
    if (part.adapters) continue;  // optimizer/master holds them; the base is the model's
    ASSIGN_OR_RETURN(ModelTensorReader reader,
                     ModelTensorReader::OpenFolder((fs::path(path) / part.dir).string()));
    for (int64_t u = 0; u < store->num_units(); ++u) {
      const UnitLayout& unit = store->layout().units[u];
      if (part.dir.empty()) {  // the model: the frozen tensors without state (bf16 alone)
        for (const TensorSlot& t : unit.tensors) {
          if (unit.HasState(t)) continue;  // its bf16 weights follow from the master
          RETURN_IF_ERROR(reader.ReadRaw(t.name, t.shape, DType::kBF16,
                                         store->weights(u) + t.offset));
        }
        continue;
      }
      const std::vector<PartTensor> tensors = UnitTensors(unit, part);
      if (tensors.empty()) continue;
      char* base = static_cast<char*>(part.base(*store, u));
      if (base == nullptr) {  // on disk: this part's place in the unit's block
        const UnitMoments at = store->MomentsAt(u, disk_blocks.at(u).data());
        void* const starts[] = {at.m, at.v, at.m_scales, at.v_scales};
        base = static_cast<char*>(starts[part.moment]);
      }
      for (const PartTensor& t : tensors) {
        char* dst = base + t.offset * DTypeSize(part.dtype);
        RETURN_IF_ERROR(part.dtype == DType::kF32
                            ? reader.ReadAsFloat(t.name, t.shape, reinterpret_cast<float*>(dst))
                            : reader.ReadRaw(t.name, t.shape, part.dtype, dst));
      }
    }
  }
  for (auto& [u, block] : disk_blocks) {
    RETURN_IF_ERROR(store->moment_disk()->Write(u, 0, static_cast<int64_t>(block.size()),
                                                block.data()));
  }
  for (int64_t u = 0; u < store->num_units(); ++u) store->RefreshWeightsFromMaster(u);
  return absl::OkStatus();
}

std::vector<std::string> ListCheckpoints(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> found;
  // Overloads that cannot throw: checkpoint.dir is the user's, and may hold anything (a
  // "checkpoint-5" that is a symlink loop, a folder that cannot be read).
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::directory_entry& e = *it;
    const int64_t step = StepOf(e.path().filename().string());
    std::error_code entry_ec;
    if (step >= 0 && e.is_directory(entry_ec) &&
        fs::exists(e.path() / "trainer_state.json", entry_ec)) {
      found.emplace_back(step, e.path().string());
    }
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

absl::Status PruneCheckpoints(const std::string& root, int64_t keep_last) {
  std::error_code ec;
  std::vector<fs::path> unfinished;  // collected first: removing while iterating is unspecified
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.size() > 4 && n[0] == '.' && n.substr(n.size() - 4) == ".tmp") {
      unfinished.push_back(it->path());
    }
  }
  for (const fs::path& path : unfinished) fs::remove_all(path, ec);
  if (keep_last <= 0) return absl::OkStatus();
  std::vector<std::string> all = ListCheckpoints(root);
  for (size_t i = 0; i + keep_last < all.size(); ++i) {
    fs::remove_all(all[i], ec);
    if (ec) return absl::InternalError(absl::StrCat("removing ", all[i], ": ", ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace megatrain
