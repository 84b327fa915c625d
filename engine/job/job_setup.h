// A training job's setup: from a spec to the parts a step runs on, in stages. The data
// first (a broken dataset fails before minutes of model loading), then the devices, the
// plan, the host store, the pipelines and the optimizer, and last the weights and trainer
// state (a checkpoint resumed, the model folder's, or random). JobParts owns what the
// stages built and takes it down in the order its users need.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/common/backend.h"
#include "engine/data/dataset.h"
#include "engine/data/packer.h"
#include "engine/data/pair_stream.h"
#include "engine/job/replicas.h"
#include "engine/job/spec.h"
#include "engine/model/config.h"
#include "engine/optim/host_optimizer.h"
#include "engine/pipeline/pipeline.h"
#include "engine/plan/machine_profile.h"
#include "engine/plan/planner.h"
#include "engine/store/grad_slab_pool.h"
#include "engine/store/host_store.h"

namespace megatrain {

// What a job's steps run on. The destructor takes it down in dependency order: the
// pipelines (they drain their streams), the reducer and collectives, the optimizer, the
// replicas' devices, then the page-locked ranges and the store. REQUIRES before it: no
// optimizer update still running that reads a pipeline's events (HostOptimizer::Drain;
// after a failed step, its held gradients are never applied and need no drain).
struct JobParts {
  ~JobParts();

  ModelConfig config;
  int64_t num_parameters = 0;
  std::unique_ptr<Backend> backend;    // the first device's
  std::unique_ptr<Replicas> replicas;  // the devices after it, and how gradients meet
  std::unique_ptr<HostStore> store;
  std::unique_ptr<GradSlabPool> slabs;  // the first device's: the optimizer's
  std::unique_ptr<Pipeline> pipeline;   // the first device's
  std::unique_ptr<HostOptimizer> optimizer;
  std::unique_ptr<Packer> packer;       // a training job's data (null for a DPO job)
  // A DPO job's (JobSpec::dpo; null otherwise): its pairs in training order, and what the
  // reference cache is tied to (the pairs' fingerprint).
  std::unique_ptr<PairStream> pair_stream;
  std::shared_ptr<const std::vector<SequencePair>> pairs;
  uint64_t pairs_fingerprint = 0;
  int32_t pair_pad_id = 0;  // the input id of a pair micro-batch's padding
  // Its eval set's pairs (eval.path; null without one) and their fingerprint.
  std::shared_ptr<const std::vector<SequencePair>> eval_pairs;
  uint64_t eval_pairs_fingerprint = 0;
  Plan plan;
  std::string plan_text;     // the plan in words, with the resume, NUMA and reduce notes
  MachineProfile profile;    // what the plan was made with
  DatasetStats dataset_stats;  // what building (or reusing) the tokenized data found
  // The eval set's documents (null without one), what tokenizing them found, and how they
  // pack (eval_set.h).
  std::shared_ptr<const TokenDocs> eval_docs;
  DatasetStats eval_stats;
  PackOptions eval_pack;
  std::string tokenizer_dir;   // tokenizer files to copy into checkpoints
  std::vector<void*> pinned;   // host ranges page-locked on `backend` for this job
  int optimizer_numa_node = -1;  // where the optimizer's threads run

  // The state the job starts from: the checkpoint's it resumed from, else step 0's.
  TrainerState state;
  int64_t resumed_from_step = 0;
  std::string restored_from;     // the checkpoint folder its weights came from ("": none)
  int64_t last_saved_step = -1;  // the checkpoint resumed from (-1: none)
};

// Builds a job's parts from `spec`, stage by stage. `profile`: the machine's rates for the
// planner; null = LoadMachineProfile()'s for the job's backend.
[[nodiscard]] absl::StatusOr<std::unique_ptr<JobParts>> SetUpJob(const JobSpec& spec,
                                                                 const MachineProfile* profile);

// Loads the weights the job started from again (what SetUpJob loaded: the checkpoint it
// resumed from, else the model's or random, with a LoRA job's adapters), the moments with
// them. For a DPO job whose reference pass ran on dpo.reference's weights.
[[nodiscard]] absl::Status LoadStartWeights(const JobSpec& spec, JobParts* p);
// Loads dpo.reference's weights in place of the job's (a LoRA job's adapters zeroed: the
// reference is the model alone); the moments are zeroed. Errors name dpo.reference.
// REQUIRES: spec.dpo.reference set.
[[nodiscard]] absl::Status LoadReferenceWeights(const JobSpec& spec, JobParts* p);

// The trainer state of the checkpoint `spec` resumes from: its checkpoint.dir's newest
// (none without one). FailedPrecondition when that is another job's (another Fingerprint:
// the daemon refuses the job at submit, the trainer at start); DataLoss naming the file for
// a corrupt state. `newest`, unless null, gets the folder read, which the trainer then
// loads. Reads files: call it as the job's user.
[[nodiscard]] absl::StatusOr<std::optional<TrainerState>> ResumeState(
    const JobSpec& spec, std::string* newest = nullptr);

// The plan's line for the tensors train.freeze names ("" without any); InvalidArgument
// naming the pattern that names no tensor (FreezeTensors).
[[nodiscard]] absl::StatusOr<std::string> DescribeFrozen(const JobSpec& spec,
                                                        const ModelConfig& config);

// The plan of `*request` for `spec`, keeping a resumed job's split of a step and MLP tile
// (TrainerState::micro_batch_rows, mlp_tile_tokens: they decide a step's bits) when the spec
// leaves the split to the planner, and its clipping store (TrainerState::clip_store) when
// the spec's is auto, if they still fit; *request then asks for them. `*note` is a line for
// the plan's text saying which ("" without anything to keep).
[[nodiscard]] absl::StatusOr<Plan> PlanKeepingSplit(const JobSpec& spec,
                                                    const std::optional<TrainerState>& resume,
                                                    const MachineProfile& profile,
                                                    Backend* backend, PlanRequest* request,
                                                    std::string* note);

// What the planner needs to know of a job: the model, the batch, clipping and the choices
// the spec fixes; the budgets are the caller's (the device's, the node's).
PlanRequest JobPlanRequest(const JobSpec& spec, const ModelConfig& config,
                           int64_t device_budget_bytes, int64_t host_budget_bytes);

}  // namespace megatrain
