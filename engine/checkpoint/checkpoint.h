// Checkpoints: a folder Hugging Face transformers loads as it is, plus what an exact
// resume needs.
//
//   <root>/checkpoint-<step>/
//     config.json, model[-0000k-of-0000n].safetensors (+ index), bf16, metadata format "pt"
//     tokenizer files copied from the model folder (when it had them)
//     optimizer/{master,exp_avg,exp_avg_sq}/model*.safetensors  Hugging Face names; master
//       f32, the moments as the job keeps them (f32, bf16, or int8 codes: I8 m, U8 v, with
//       optimizer/exp_avg{,_sq}_scales/ holding "<unit>.block_scales" f32)
//     trainer_state.json   step, data position, seeds, schedule, last loss
//
// A LoRA job's (its layout has adapters, model/lora.h) is a PEFT adapter folder instead of
// a model: adapter_config.json and adapter_model.safetensors (the adapters, f32, PEFT's
// names) in place of the model files, which peft loads over the base; the frozen base is
// the job's model folder's, and a resume reads it from there.
//
// A checkpoint is written under ".checkpoint-<step>.tmp", every file fsynced, then
// renamed and the parent fsynced: a crash never leaves a half checkpoint that looks whole
// (loaders only ever look at "checkpoint-<digits>" folders).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/data/packer.h"
#include "engine/engine.h"  // ListCheckpoints
#include "engine/model/config.h"
#include "engine/store/host_store.h"

namespace megatrain {

struct TrainerState {
  int64_t step = 0;             // optimizer steps completed
  DataPosition data;            // where the next step's data starts
  uint64_t data_seed = 0;
  uint64_t init_seed = 0;
  double last_loss = 0;
  std::string spec_fingerprint;  // the job's training-relevant settings, checked on resume
  // The plan's choices that decide a step's bits (the order its sums run in): sequences per
  // micro-batch and the MLP's token tile (0: none). A resume plans with them, so that its
  // steps repeat an uninterrupted run's bits even when the planner would now choose
  // otherwise (a profile measured again, calibrated, or edited). 0 and -1: not recorded (a
  // checkpoint written before they were).
  int64_t micro_batch_rows = 0;
  int64_t mlp_tile_tokens = -1;
  // Where clipping's gradients waited (optimizer.clip_store as planned: "fp32" or "fp16";
  // "": no clipping, or not recorded): a resume whose spec leaves it to the planner keeps
  // it, as the updates read its values.
  std::string clip_store;
};

struct CheckpointOptions {
  uint64_t max_shard_bytes = 5ull << 30;  // as transformers' default "5GB"
  // The optimizer state's shards are at most this (and max_shard_bytes): not loaded by
  // transformers, they are smaller, so that more files can be written at once.
  uint64_t optimizer_shard_bytes = 1ull << 30;
  uint64_t piece_bytes = 128ull << 20;    // CheckpointWriter::WritePiece
  std::string tokenizer_dir;              // copy tokenizer files from here ("" = none)
  // How the store keeps AdamW's moments (HostStore::moment_dtype()): they are written as
  // kept (bf16; int8 codes with their block scales), so that a resume is exact.
  MomentDType moments = MomentDType::kF32;
  // A LoRA job's adapter_config.json (PeftAdapterConfigJson, model/lora.h), "" = none.
  std::string adapter_config;
};

// A checkpoint being written. Begin() creates ".checkpoint-<step>.tmp" under `root` with
// config.json, the tokenizer files and every safetensors shard at its final size with
// its header (a full disk fails there). Each unit's bf16 weights, master, m and v are then
// written once, in any order, from any threads, as they are in the store at that moment:
// a checkpoint taken while training runs writes each unit between its update of the
// checkpointed step and its next one. Commit() writes the trainer state (which may be
// known only after the writing began: the step may still be running), fsyncs, renames
// the folder to "checkpoint-<step>". Destroyed uncommitted, it removes its folder.
class CheckpointWriter {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<CheckpointWriter>> Begin(
      const std::string& root, const ModelConfig& config, const ModelLayout& layout,
      int64_t step, const CheckpointOptions& options);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Writes `unit` as it is in `store` now. Thread-safe for distinct units.
  [[nodiscard]] absl::Status WriteUnit(const HostStore& store, int64_t unit);
  // The same in pieces of at most `piece_bytes` (each of the four parts split), so that
  // several threads can share one large unit: WritePiece(store, unit, 0 ..
  // NumPieces(unit) - 1) writes the unit. Thread-safe for distinct pieces.
  int64_t NumPieces(int64_t unit) const;
  [[nodiscard]] absl::Status WritePiece(const HostStore& store, int64_t unit, int64_t piece);
  // The file a piece is written to (an id: pieces of one file serialize in the kernel).
  int64_t PieceFile(int64_t unit, int64_t piece) const;
  // Every unit written: makes the checkpoint durable and complete. Returns its path.
  // REQUIRES: state.step == step().
  [[nodiscard]] absl::StatusOr<std::string> Commit(const TrainerState& state);

  int64_t step() const { return step_; }
  // Bytes of the finished checkpoint's files (headers, shards, indexes; not the small
  // JSON files).
  uint64_t data_bytes() const;

 private:
  struct Part;
  CheckpointWriter() = default;
  uint64_t UnitPartBytes(int64_t unit, int part) const;
  int64_t PiecesPerPart(int64_t unit, int part) const;
  // The part `piece` of `unit` belongs to, and its byte range within the unit's part.
  void Locate(int64_t unit, int64_t piece, size_t* part, uint64_t* begin, uint64_t* end) const;

  std::string root_;
  std::string tmp_;
  std::string final_;
  int64_t step_ = 0;
  ModelLayout layout_;
  uint64_t piece_bytes_ = 256ull << 20;
  MomentDType moments_ = MomentDType::kF32;
  // Model (bf16), then master, exp_avg, exp_avg_sq (and their int8 block scales).
  std::vector<std::unique_ptr<Part>> parts_;
  bool committed_ = false;
};

// Writes checkpoint-<state.step> under `root` (created if missing). Returns its path.
[[nodiscard]] absl::StatusOr<std::string> SaveCheckpoint(const std::string& root,
                                                         const ModelConfig& config,
                                                         const HostStore& store,
                                                         const TrainerState& state,
                                                         const CheckpointOptions& options);

// Restores master, m, v (and the bf16 weights derived from master) and the trainer state.
[[nodiscard]] absl::Status LoadCheckpoint(const std::string& path, HostStore* store,
                                          TrainerState* state);
// The checkpoint's trainer state alone (trainer_state.json): DataLoss when it is not one.
[[nodiscard]] absl::StatusOr<TrainerState> ReadTrainerState(const std::string& path);

// ListCheckpoints (complete checkpoints under a root, oldest first): engine.h.

// Removes all but the newest `keep_last` checkpoints (keep_last <= 0 keeps all), and any
// leftover temporary folders of interrupted saves.
[[nodiscard]] absl::Status PruneCheckpoints(const std::string& root, int64_t keep_last);

}  // namespace megatrain
