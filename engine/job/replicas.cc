#include "engine/job/replicas.h"

#include <algorithm>
#include <iterator>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/backend/devices.h"
#include "engine/common/check.h"
#include "engine/common/status.h"
#include "engine/plan/rates.h"

namespace megatrain {

absl::StatusOr<std::unique_ptr<Replicas>> Replicas::Create(const JobSpec& spec, Backend* first,
                                                           const BackendRequest& first_request) {
  std::unique_ptr<Replicas> r(new Replicas(first));
  r->backends_ = {first};
  r->requests_ = {first_request};
  const int64_t count = std::max<int64_t>(1, spec.devices);
  if (count == 1) return r;
  const bool cpu = first->kind() == BackendKind::kCpu;
  const int first_index = cpu ? 0 : CudaDeviceIndexOf(first_request.kind);
  for (int64_t d = 1; d < count; ++d) {
    Replica replica;
    const BackendRequest request{cpu ? "cpu" : absl::StrCat("cuda:", first_index + d),
                                 spec.device_memory_cap_bytes};
    absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(request);
    if (!backend.ok()) {
      return Annotate(backend.status(),
                      absl::StrCat("train.devices: device ", d, " (", request.kind, ")"));
    }
    replica.backend = *std::move(backend);
    r->backends_.push_back(replica.backend.get());
    r->requests_.push_back(request);
    r->replicas_.push_back(std::move(replica));
  }
  first->BindThread();  // creating the others made theirs current here
  if (spec.gradient_reduce != GradientReduce::kHost) {
    RETURN_IF_ERROR(r->CreateCollectives(spec.gradient_reduce));
  }
  return r;
}

absl::Status Replicas::CreateCollectives(GradientReduce reduce) {
  absl::StatusOr<std::vector<std::unique_ptr<GradCollective>>> group =
      CreateGradCollectives(backends_);
  if (group.ok()) {
    collectives_ = *std::move(group);
  } else if (reduce == GradientReduce::kDevice) {
    return Annotate(group.status(), "train.gradient_reduce: device");
  } else {
    reduce_note_ = absl::StrCat(" (", group.status().message(), ")");
  }
  first_->BindThread();
  return absl::OkStatus();
}

Replicas::~Replicas() {
  ReleasePipelines();
  for (Replica& r : replicas_) {
    if (r.slabs != nullptr) r.backend->UnpinHostRange(r.slabs->base());
  }
  replicas_.clear();
}

void Replicas::ReleasePipelines() {
  for (Replica& r : replicas_) r.pipeline.reset();
  reducer_.reset();
  collectives_.clear();
}

void Replicas::PlanReduction(PlanRequest* request) {
  request->reduce_on_devices = sharded();
  if (sharded() && first_->kind() != BackendKind::kCpu) {
    // NVLink or PCIe between the GPUs: measured here, once per job (a few ms).
    absl::StatusOr<double> peer = MeasureReduceScatterGbps(backends_, collectives_);
    first_->BindThread();
    if (peer.ok()) request->peer_gbps = *peer;
  }
}

std::string Replicas::DescribeReduction() const {
  if (sharded()) return absl::StrCat("reduce     ", collectives_[0]->description(), "\n");
  if (!reduce_note_.empty()) return absl::StrCat("reduce     on the host", reduce_note_, "\n");
  return "";
}

absl::StatusOr<std::unique_ptr<GradSlabPool>> Replicas::MakeSlabs(const ModelLayout& layout,
                                                                  bool clipping,
                                                                  int device) const {
  const int node = BackendNumaNode(requests_[device]);
  if (sharded()) {
    const int ranks = static_cast<int>(backends_.size());
    return GradSlabPool::Create(GradShardSlabsNeeded(layout, clipping, ranks),
                                GradShardSlabElements(layout, ranks), node);
  }
  return GradSlabPool::Create(GradSlabsNeeded(layout, device == 0 && clipping),
                              GradSlabElements(layout), node);
}

absl::Status Replicas::Build(const ModelConfig& config, HostStore* store,
                             HostOptimizer* optimizer, GradSlabPool* first_slabs,
                             const PipelineOptions& options, bool clipping) {
  if (replicas_.empty()) return absl::OkStatus();
  std::vector<GradSlabPool*> pools = {first_slabs};
  for (size_t d = 1; d < backends_.size(); ++d) {
    Replica& replica = replicas_[d - 1];
    ASSIGN_OR_RETURN(replica.slabs, MakeSlabs(store->layout(), clipping, static_cast<int>(d)));
    RETURN_IF_ERROR(replica.backend->PinHostRange(replica.slabs->base(), replica.slabs->bytes()));
    PipelineOptions replica_options = options;
    replica_options.collective = collective(static_cast<int>(d));
    ASSIGN_OR_RETURN(replica.pipeline, Pipeline::Create(config, store, replica.slabs.get(),
                                                        replica.backend.get(), replica_options));
    replica.batches.resize(options.micro_batches);
    pools.push_back(replica.slabs.get());
    if (sharded()) optimizer->AddSlabPool(replica.slabs.get());
  }
  reducer_ = std::make_unique<GradReducer>(
      optimizer, backends_, pools,
      sharded() ? GradReducer::Mode::kSharded : GradReducer::Mode::kHostSum);
  first_->BindThread();
  return absl::OkStatus();
}

void Replicas::NextBatches(Packer* packer, int64_t rows_per_micro_batch) {
  for (Replica& r : replicas_) {
    for (MicroBatch& b : r.batches) packer->Next(rows_per_micro_batch, &b);
  }
}

void Replicas::TakeBatches(std::vector<MicroBatch> rest) {
  if (replicas_.empty()) return;
  MT_CHECK(rest.size() % replicas_.size() == 0);
  const size_t share = rest.size() / replicas_.size();
  for (size_t i = 0; i < replicas_.size(); ++i) {
    std::vector<MicroBatch>& mine = replicas_[i].batches;
    mine.assign(std::make_move_iterator(rest.begin() + i * share),
                std::make_move_iterator(rest.begin() + (i + 1) * share));
  }
}

absl::StatusOr<StepResult> Replicas::Step(Pipeline* first, const std::vector<MicroBatch>& batches,
                                          HostOptimizer* optimizer) {
  if (replicas_.empty()) return first->Step(batches, optimizer);
  int64_t targets = 0;
  for (const MicroBatch& b : batches) targets += b.num_targets();
  for (const Replica& r : replicas_) {
    for (const MicroBatch& b : r.batches) targets += b.num_targets();
  }
  std::vector<absl::StatusOr<StepResult>> results(replicas_.size(),
                                                  absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < replicas_.size(); ++i) {
    threads.emplace_back([this, i, targets, &results] {
      results[i] = replicas_[i].pipeline->Step(replicas_[i].batches,
                                               reducer_->replica(static_cast<int>(i) + 1), targets);
    });
  }
  absl::StatusOr<StepResult> own = first->Step(batches, reducer_->replica(0), targets);
  for (std::thread& t : threads) t.join();
  if (!own.ok()) return own.status();
  StepResult total = *std::move(own);
  double loss_sum = total.loss * total.num_targets;
  for (absl::StatusOr<StepResult>& r : results) {
    if (!r.ok()) return r.status();
    loss_sum += r->loss * r->num_targets;
    total.aux_loss += r->aux_loss;  // averaged below: each replica's over its own tokens
    total.num_targets += r->num_targets;
    total.seconds = std::max(total.seconds, r->seconds);
    total.h2d_bytes += r->h2d_bytes;
    total.d2h_bytes += r->d2h_bytes;
    total.token_values.insert(total.token_values.end(), r->token_values.begin(),
                              r->token_values.end());
  }
  total.loss = total.num_targets > 0 ? loss_sum / total.num_targets : 0.0;
  total.aux_loss /= static_cast<double>(results.size() + 1);
  return total;
}

}  // namespace megatrain
