// Data parallelism over the GPUs of one box (train.devices > 1): the devices after the
// first, each with a pipeline, gradient slabs and a share of the step's micro-batches of
// its own, all over the one host store and optimizer; and how their gradients meet. Either
// the devices reduce-scatter each unit's gradient (collectives: NCCL, or the CPU backends'
// threads) and each drains 1/N of it, or each drains whole gradients and the reducer adds
// them on the host (pipeline/grad_reducer.h).
//
// The first device's backend, slabs and pipeline are the job's (job_setup.h), not this
// class's: with one device there are no replicas and Step() is the first pipeline's step.
//
// Thread-compatible: one thread drives it; Step() runs each replica's pipeline on a thread
// of its own and returns when all have finished.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/backend/factory.h"
#include "engine/common/backend.h"
#include "engine/common/collective.h"
#include "engine/data/micro_batch.h"
#include "engine/data/packer.h"
#include "engine/job/spec.h"
#include "engine/model/layout.h"
#include "engine/optim/host_optimizer.h"
#include "engine/pipeline/grad_reducer.h"
#include "engine/pipeline/pipeline.h"
#include "engine/plan/planner.h"
#include "engine/store/grad_slab_pool.h"
#include "engine/store/host_store.h"

namespace megatrain {

class Replicas {
 public:
  // The devices after `first` (made from `first_request`): cuda:i+1 .. for cuda:i, or more
  // CPU backends; then, unless spec.gradient_reduce is host, their collectives. Where
  // those cannot be made, auto falls back to adding on the host (DescribeReduction says
  // why) and device fails. `first` stays bound to this thread.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Replicas>> Create(
      const JobSpec& spec, Backend* first, const BackendRequest& first_request);
  // Releases the pipelines (ReleasePipelines), unpins the replicas' slabs and closes their
  // devices.
  ~Replicas();

  int64_t size() const { return static_cast<int64_t>(replicas_.size()); }
  // Every device's backend, and the request that made it: the first device's first.
  const std::vector<Backend*>& backends() const { return backends_; }
  const std::vector<BackendRequest>& requests() const { return requests_; }
  // True when the devices reduce-scatter the gradients (each drains 1/N of each unit).
  bool sharded() const { return !collectives_.empty(); }
  // Device `device`'s collective (PipelineOptions::collective); null unless sharded().
  GradCollective* collective(int device) const {
    return sharded() ? collectives_[device].get() : nullptr;
  }

  // What the planner needs to know of the reduction: whether it is on the devices, and
  // between GPUs the rate of a reduce-scatter, measured here (a few ms).
  void PlanReduction(PlanRequest* request);
  // The plan's line on how the gradients meet ("" with one device, or on the host asked).
  std::string DescribeReduction() const;

  // The gradient slabs of device `device` (0: the first's, the optimizer's), on its NUMA
  // node. Sharded: slabs of 1/N of a layer; on the host, the first device's pool holds all
  // of a clipped step's gradient and the others cycle a few of a layer's size.
  [[nodiscard]] absl::StatusOr<std::unique_ptr<GradSlabPool>> MakeSlabs(
      const ModelLayout& layout, bool clipping, int device) const;

  // Each replica's slabs (pinned on its device) and pipeline (`options`, the first
  // device's, with the replica's collective), and the reducer through which their
  // gradients and `first_slabs`' reach `optimizer`. Nothing with one device.
  [[nodiscard]] absl::Status Build(const ModelConfig& config, HostStore* store,
                                   HostOptimizer* optimizer, GradSlabPool* first_slabs,
                                   const PipelineOptions& options, bool clipping);

  // Each replica's share of the next step, from `packer` after the first device's (the
  // data order one device would see).
  void NextBatches(Packer* packer, int64_t rows_per_micro_batch);
  // The same from micro-batches made for the whole step (a DPO job's pairs): `rest`, what
  // follows the first device's, in equal shares, replica after replica.
  // REQUIRES: rest.size() a multiple of size().
  void TakeBatches(std::vector<MicroBatch> rest);
  // The step on every device: the first's (`first` over `batches`) on this thread, each
  // replica's on its own; their results added up (the loss averaged over all targets;
  // token_values, a DPO step's, the first's then each replica's).
  // One device: first->Step(batches, optimizer).
  [[nodiscard]] absl::StatusOr<StepResult> Step(Pipeline* first,
                                                const std::vector<MicroBatch>& batches,
                                                HostOptimizer* optimizer);

  // Destroys the replicas' pipelines, the reducer and the collectives: before the
  // optimizer goes (the reducer hands it gradients; its updates wait on their events).
  void ReleasePipelines();

 private:
  struct Replica {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<GradSlabPool> slabs;
    std::unique_ptr<Pipeline> pipeline;
    std::vector<MicroBatch> batches;
  };
  explicit Replicas(Backend* first) : first_(first) {}
  [[nodiscard]] absl::Status CreateCollectives(GradientReduce reduce);

  Backend* first_;
  std::vector<Backend*> backends_;
  std::vector<BackendRequest> requests_;
  std::vector<Replica> replicas_;
  // One per device when the devices reduce-scatter the gradients.
  std::vector<std::unique_ptr<GradCollective>> collectives_;
  std::string reduce_note_;  // why they are added on the host instead, for the plan
  std::unique_ptr<GradReducer> reducer_;
};

}  // namespace megatrain
