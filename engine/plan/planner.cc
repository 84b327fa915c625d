#include "engine/plan/planner.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/common/check.h"
#include "engine/common/status.h"
#include "engine/layers/layer_kind.h"
#include "engine/model/lora.h"
#include "engine/model/layout.h"
#include "engine/optim/held_gradients.h"
#include "engine/plan/step_memory.h"
#include "engine/store/grad_slab_pool.h"

namespace megatrain {

int64_t PlannableDeviceBytes(int64_t budget) {
  return std::max<int64_t>(0, budget - std::min<int64_t>(budget / 16, int64_t{1} << 30));
}

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// The fp32 master's upload (no bf16 copy) per byte against the copy's, beside compute.
constexpr double kF32UploadCost = 52.0 / 40.0;

// The per-layer kernels' times for a micro-batch of n tokens.
struct LayerTimes {
  double forward = 0;   // one forward pass
  double backward = 0;  // one backward pass (after its re-forward)
  double rebuild = 0;   // a kept layer's rebuild of what it did not keep (LayerKind::Rebuild)
};

// A layer kind's work (layers/layer_kind.h) for a micro-batch of n tokens, timed with
// the machine's rates.
LayerTimes LayerKernelSeconds(const LayerKind& kind, const MachineProfile& p, int64_t n,
                              int64_t seq, int64_t act) {
  const LayerWork work = kind.Work(n, seq, act);
  LayerTimes t;
  for (const MatmulShape& m : work.matmuls) {
    const int64_t rows = n * m.rows_per_token;
    const int64_t group_rows = std::max<int64_t>(1, rows / m.groups);  // one GEMM's
    const double flops = 2.0 * rows * m.in * m.out;
    auto rate = [&](bool backward) {  // the experts' GEMMs at their measured grouped rate
      const double r = m.groups > 1 ? p.GroupedGemmTflops(group_rows, m.in, m.out, backward)
                                    : p.GemmTflops(group_rows, m.in, m.out, backward);
      return 1e12 * std::max(1e-6, r);
    };
    const double fwd = flops / rate(false);
    t.forward += fwd;
    if (m.rebuilt) t.rebuild += fwd;
    t.backward += (m.frozen ? 1 : 2) * flops / rate(true);
  }
  const double attn = work.attention_flops;
  const int64_t D = work.attention_head_dim;
  t.forward += attn / (1e12 * std::max(1e-6, p.AttentionTflops(seq, false, D)));
  t.backward += 2.5 * attn / (1e12 * std::max(1e-6, p.AttentionTflops(seq, true, D)));
  // Elementwise kernels at device bandwidth; backward moves about twice as much.
  const double bytes = work.elementwise_bytes;
  t.forward += bytes / (1e9 * std::max(1e-6, p.device_gbps));
  t.backward += 2 * bytes / (1e9 * std::max(1e-6, p.device_gbps));
  t.rebuild += work.rebuild_bytes / (1e9 * std::max(1e-6, p.device_gbps));
  return t;
}

// The kernels' times of every decoder layer, asked of each layer's kind: summed over
// the layers (forward, and backward after its re-forward with `recompute` of a segment's
// recomputation), and those of the bottom layer (the first the next forward needs) and
// the top one (the first backward, and the kept layers').
struct ModelLayerTimes {
  double forward_all = 0;   // sum over layers of one forward
  double backward_all = 0;  // sum over layers of forward * (1 + recompute) + backward
  LayerTimes bottom, top;
};

ModelLayerTimes AllLayerSeconds(const LayerKinds& kinds, const MachineProfile& p, int64_t n,
                                int64_t seq, int64_t act, double recompute) {
  ModelLayerTimes out;
  for (size_t k = 0; k < kinds.kinds.size(); ++k) {
    const int64_t count = std::count(kinds.of_layer.begin(), kinds.of_layer.end(),
                                     static_cast<int>(k));
    const LayerTimes lt = LayerKernelSeconds(*kinds.kinds[k], p, n, seq, act);
    out.forward_all += count * lt.forward;
    out.backward_all += count * (lt.forward * (1 + recompute) + lt.backward);
    if (kinds.of_layer.front() == static_cast<int>(k)) out.bottom = lt;
    if (kinds.of_layer.back() == static_cast<int>(k)) out.top = lt;
  }
  return out;
}

std::string Bytes(double b) {
  if (b >= 1e9) return absl::StrFormat("%.1f GB", b / 1e9);
  return absl::StrFormat("%.0f MB", b / 1e6);
}

std::string GiB(double b) { return absl::StrFormat("%.1f GiB", b / kGiB); }

std::string Params(double n) {
  if (n >= 1e9) return absl::StrFormat("%.2f B", n / 1e9);
  return absl::StrFormat("%.0f M", n / 1e6);
}

}  // namespace

namespace {

// The request's model as the job lays it out: its frozen tensors marked.
ModelLayout LayoutOf(const PlanRequest& r) {
  absl::StatusOr<ModelLayout> layout = TrainingLayout(r.config, r.lora, r.freeze);
  MT_CHECK_MSG(layout.ok(), "plan: train.freeze or lora was not checked");
  return *std::move(layout);
}

// What every stage of a prediction reads: the model's and the plan's sizes.
struct PlanShape {
  bool cpu = false;
  int64_t L = 0, C = 0, V = 0;  // layers, hidden size, vocabulary
  int64_t M = 0, n = 0, K = 0;  // micro-batches, tokens in one, checkpoint interval
  int64_t N = 1;                // devices
  bool sharded = false;         // gradients reduce-scattered on the devices
  int64_t act = 0, gsize = 0;   // bytes of an activation, of a gradient element
  int64_t total = 0;            // parameters: every unit's elements
  int64_t trained = 0;          // of them, those with optimizer state (StateRange): the
                                // gradients drained and updated
  int64_t store_bytes = 0;      // the host store: bf16 weights where kept, master, moments
  // Of the matmul parameters a token passes through (MoE: the active ones), the frozen
  // (no weight gradient: 4 FLOPs a parameter and token, not 6) and the adapters'.
  double frozen_matmul = 0, adapter_matmul = 0;
  int64_t layer_n = 0, embed_n = 0, head_n = 0;  // the largest layer's, the embedding's, the head's
  int64_t num_ckpt = 0;         // layer-input checkpoints
  int64_t ckpt_bytes = 0;       // one checkpoint, all micro-batches
};

// The shape's parameter counts: every unit's, those with state and what the store keeps
// of them, and the frozen and adapter matmul parameters a token passes through.
void CountParameters(const PlanRequest& r, const ModelLayout& layout, bool bf16_copy,
                     PlanShape* x) {
  const ModelConfig& c = r.config;
  const double active = c.is_moe() ? static_cast<double>(c.moe.experts_per_token) /
                                         static_cast<double>(c.moe.num_experts)
                                   : 1.0;
  for (const UnitLayout& u : layout.units) {
    for (const TensorSlot& t : u.tensors) {
      const bool expert = t.expert >= 0 || t.role == TensorRole::kExpertGateUpT ||
                          t.role == TensorRole::kExpertDownT;
      const bool matrix = t.shape.size() >= 2 && t.role != TensorRole::kEmbedding;
      if (IsLora(t)) {  // an experts' adapter: each token's k of them
        x->adapter_matmul += t.num_elements * (LoraExperts(t) > 0 ? active : 1.0);
      } else if (matrix && !t.trainable) {
        x->frozen_matmul += t.num_elements * (expert ? active : 1.0);
      } else if (t.role == TensorRole::kEmbedding && !t.trainable && c.tie_word_embeddings) {
        x->frozen_matmul += t.num_elements;  // the tied lm_head
      }
    }
    const int64_t state = u.StateElements();
    x->total += u.num_elements;
    x->trained += state;
    x->store_bytes += static_cast<int64_t>(
        (HostStore::KeepsBf16(u, bf16_copy) ? 2.0 * u.num_elements : 0.0) +
        state * (4.0 + MomentBytesPerParameter(r.moments)));
  }
}

PlanShape ShapeOf(const PlanRequest& r, Backend* backend, const ModelLayout& layout,
                  const Plan& plan) {
  const ModelConfig& c = r.config;
  PlanShape x;
  x.cpu = backend->kind() == BackendKind::kCpu;
  x.L = c.num_layers;
  x.C = c.hidden_size;
  x.V = c.vocab_size;
  x.M = plan.micro_batches;
  x.n = plan.micro_batch_rows * r.seq_len;
  x.K = plan.checkpoint_every;
  x.N = std::max<int64_t>(1, plan.devices);
  x.sharded = x.N > 1 && r.reduce_on_devices;
  x.act = DTypeSize(backend->act_dtype());
  x.gsize = DTypeSize(backend->grad_dtype());
  CountParameters(r, layout, plan.bf16_copy, &x);
  x.layer_n = layout.MaxDecoderElements();
  x.embed_n = layout.units[ModelLayout::EmbeddingUnit()].num_elements;
  x.head_n = layout.units[layout.HeadUnit()].num_elements;
  x.num_ckpt = (x.L + x.K - 1) / x.K;
  x.ckpt_bytes = x.M * x.n * x.C * x.act;
  return x;
}

// The plan's device memory, as the pipeline will allocate it (StepMemory), and its weight
// slots as the pipeline resolves them; without the bf16 copy, the fp32 upload's staging.
void SizeDeviceMemory(const PlanRequest& r, Backend* backend, const ModelLayout& layout,
                      Plan* plan) {
  const ModelConfig& c = r.config;
  const PipelineOptions po = PipelineOptionsOf(*plan, r.seq_len);
  plan->weight_slots = NumWeightSlots(c, po);
  plan->device_bytes = StepDeviceBytes(c, layout, backend, po) +
                       (plan->bf16_copy ? 0 : backend->f32_upload_staging_bytes());
}

// The evaluation's micro-batches at once (PlanRequest::eval_rows), fitted once the step's
// plan is chosen, so that asking for an evaluation never changes how a job trains: as many
// as asked, at most what the step's activations hold (EvalCapacity), fewer while the token
// arrays and losses they add do not fit the device budget (never fewer than the step's
// micro-batches, which add nothing).
void FitEvaluation(const PlanRequest& r, Backend* backend, Plan* plan) {
  if (r.eval_rows == 0) return;
  const ModelLayout layout = LayoutOf(r);
  const int64_t capacity = EvalCapacity(r.config, PipelineOptionsOf(*plan, r.seq_len));
  const int64_t rows = plan->micro_batch_rows;
  int64_t wanted = r.eval_rows < 0 ? capacity
                                   : std::min(capacity, (r.eval_rows + rows - 1) / rows);
  const int64_t free_share = std::min(wanted, plan->micro_batches);  // in the step's arrays
  // The CPU backend's buffers are host memory: what the pass adds counts against the host.
  const bool cpu = backend->kind() == BackendKind::kCpu;
  const int64_t step_bytes = plan->device_bytes, host_bytes = plan->host_bytes;
  for (;;) {
    plan->eval_micro_batches = wanted;
    SizeDeviceMemory(r, backend, layout, plan);
    const int64_t added = plan->device_bytes - step_bytes;
    if (cpu) plan->host_bytes = host_bytes + added;
    const bool fits = cpu ? plan->host_bytes <= r.host_budget_bytes
                          : plan->device_bytes <= r.device_budget_bytes;
    if (wanted <= free_share || fits) return;
    wanted = std::max(free_share, wanted / 2);
  }
}

// Host memory: the store (bf16 weights + fp32 master, m, v), the gradient slabs (every
// unit's with clipping), pinned checkpoints; the CPU backend's buffers are host memory.
void SizeHostMemory(const PlanRequest& r, const ModelLayout& layout, const PlanShape& x,
                    Plan* plan) {
  plan->host_store_bytes = x.store_bytes;
  // Clipping holds every piece in its slab, unless the pieces wait in 16 bits.
  const bool holds_slabs = r.clipping && !plan->compact_held;
  if (x.sharded) {  // every device its shard: together as much as one device's
    const int ranks = static_cast<int>(x.N);
    plan->host_slab_bytes = 4 * x.N * GradShardSlabElements(layout, ranks) *
                            GradShardSlabsNeeded(layout, holds_slabs, ranks);
  } else {  // added on the host: the others cycle two layers' worth each
    plan->host_slab_bytes =
        4 * GradSlabElements(layout) *
        (GradSlabsNeeded(layout, holds_slabs) + (x.N - 1) * GradSlabsNeeded(layout, false));
  }
  plan->host_held_bytes =
      r.clipping && plan->compact_held
          ? static_cast<int64_t>(HeldGradients::BytesPerElement() * x.trained) +
                4 * GradSlabElements(layout)
          : 0;
  plan->host_checkpoint_bytes = plan->checkpoints_on_host ? (x.num_ckpt + 1) * x.ckpt_bytes : 0;
  plan->host_bytes = plan->host_store_bytes + plan->host_slab_bytes + plan->host_held_bytes +
                     x.N * plan->host_checkpoint_bytes + (x.cpu ? x.N * plan->device_bytes : 0);
}

// The NVMe tier: the top layers' moments on disk, as many as the host budget needs (each
// saves its moments; the kDiskBuffers buffers they cycle through are paid once).
void PlaceMomentsOnDisk(const PlanRequest& r, const PlanShape& x, Plan* plan) {
  plan->nvme_layers = 0;
  plan->disk_bytes = plan->host_disk_buffer_bytes = 0;
  if (r.nvme_dir.empty()) return;
  constexpr int64_t kDiskBuffers = 3;  // StoreOptions::disk_buffers
  const int64_t layer_moments =
      static_cast<int64_t>(MomentBytesPerParameter(r.moments) * static_cast<double>(x.layer_n));
  int64_t k = r.nvme_layers;
  if (k < 0) {
    const int64_t over = plan->host_bytes - r.host_budget_bytes;
    k = over > 0 ? (over + kDiskBuffers * layer_moments + layer_moments - 1) / layer_moments : 0;
  }
  k = std::min(k, x.L);
  if (k > 0) {
    plan->nvme_layers = k;
    plan->disk_bytes = k * layer_moments;
    plan->host_disk_buffer_bytes = std::min(k, kDiskBuffers) * layer_moments;
    plan->host_store_bytes -= plan->disk_bytes;
    plan->host_bytes += plan->host_disk_buffer_bytes - plan->disk_bytes;
  }
}

// The kernels on the compute stream: every layer's, the embedding's and the head's.
struct ComputeTimes {
  ModelLayerTimes layers;
  double forward = 0;   // forward: embedding and layers, every micro-batch
  double backward = 0;  // backward with its recomputation, and zeroing the gradients
};

// Sets the step's forward, head and compute seconds.
ComputeTimes PredictCompute(const PlanRequest& r, const MachineProfile& p, Backend* backend,
                            const ModelLayout& layout, const PlanShape& x, Plan* plan) {
  StepPrediction& s = plan->step;
  const double recompute = static_cast<double>(x.K - 1) / x.K;
  ComputeTimes t;
  t.layers = AllLayerSeconds(MakeLayerKinds(r.config, layout, backend, plan->mlp_tile_tokens), p,
                             x.n, r.seq_len, x.act, recompute);
  const double bw = 1e9 * std::max(1e-6, p.device_gbps);
  const int64_t chunk = std::min(x.n, plan->loss_chunk_tokens);
  const double head_flops = 2.0 * x.n * x.C * x.V;
  const double head =
      head_flops / (1e12 * std::max(1e-6, p.GemmTflops(chunk, x.C, x.V, false))) +
      2 * head_flops / (1e12 * std::max(1e-6, p.GemmTflops(chunk, x.C, x.V, true))) +
      4.0 * x.n * x.V * x.act / bw;
  const double embed = 3.0 * x.n * x.C * x.act / bw;
  const double zero_grads = (x.gsize * (x.layer_n * x.L + x.embed_n + x.head_n)) / bw;
  t.forward = x.M * (t.layers.forward_all + embed);
  t.backward = x.M * (t.layers.backward_all -
                      plan->kept_layers * (t.layers.top.forward - t.layers.top.rebuild) + embed) +
               zero_grads;
  s.forward_seconds = t.forward;
  s.head_seconds = x.M * head;
  s.compute_seconds = t.forward + s.head_seconds + t.backward;
  return t;
}

// What crosses PCIe each way, forward and backward, and at what rates.
struct Transfers {
  int64_t up = 0;       // bytes a parameter crossing: bf16, or the fp32 master (no copy)
  int64_t w_layer = 0;  // a layer's weights crossing
  int64_t weights_fwd = 0, weights_bwd = 0;
  int64_t h2d_fwd = 0, h2d_bwd = 0, d2h_fwd = 0, d2h_bwd = 0;
  double h2d_rate = 0, d2h_rate = 0, duplex_rate = 0;  // bytes per second
  double weight_extra = 0;  // the fp32 master's extra cost per weight byte, in time
  double h2d_fwd_time = 0, h2d_bwd_time = 0;  // H2D bytes, weighted by that cost
};

// Sets the step's PCIe bytes and seconds and the data-parallel reduce-scatter's.
Transfers PredictTransfers(const PlanRequest& r, const MachineProfile& p, const PlanShape& x,
                           Plan* plan) {
  StepPrediction& s = plan->step;
  Transfers t;
  // bf16 from the host store whatever the slot type, or the fp32 master without the copy.
  t.up = plan->bf16_copy ? 2 : 4;
  t.w_layer = t.up * x.layer_n;
  const int64_t slots = plan->weight_slots;
  const int64_t reuploads = std::max<int64_t>(0, x.L - slots);  // backward finds the top S
  const int64_t ckpt_total = plan->checkpoints_on_host ? x.num_ckpt * x.ckpt_bytes : 0;
  // With a slot per layer (and one device), a layer's next weights go up in the backward,
  // once the optimizer has applied its update (Pipeline::UploadUpdated), not in the next
  // forward.
  const bool early = slots >= x.L && plan->devices <= 1;
  t.weights_fwd = (early ? 0 : x.L * t.w_layer) + t.up * (x.embed_n + x.head_n);
  t.weights_bwd = early ? x.L * t.w_layer : reuploads * t.w_layer;
  t.h2d_fwd = t.weights_fwd + StepMemory::kBatchArrays * 4 * x.n * x.M;
  t.h2d_bwd = t.weights_bwd + ckpt_total;
  t.d2h_fwd = ckpt_total;
  // Gradients land as fp32; reduce-scattered first, each device drains its shard.
  t.d2h_bwd = 4 * x.trained / (x.sharded ? x.N : 1);
  s.h2d_bytes = t.h2d_fwd + t.h2d_bwd;
  s.d2h_bytes = t.d2h_fwd + t.d2h_bwd + 4 * x.n * x.M;
  t.h2d_rate = 1e9 * std::max(1e-6, p.h2d_gbps);
  t.d2h_rate = 1e9 * std::max(1e-6, p.d2h_gbps);
  t.duplex_rate = 1e9 * std::max(1e-6, std::max(p.duplex_gbps, std::max(p.h2d_gbps, p.d2h_gbps)));
  // Without the copy the master goes up through a staging buffer, each piece rounded by a
  // kernel on a stream of its own that waits for SMs beside the compute stream's: measured
  // at 40 GB/s (median of a step's layers; 49 in the forward, down to 32 in the backward)
  // against the copy's 52 beside compute (H200; 22 when copy and
  // rounding took turns on one stream), so its weight bytes cost kF32UploadCost times
  // theirs. (Counted in time, not in the bytes reported.)
  t.weight_extra = plan->bf16_copy ? 0.0 : kF32UploadCost - 1.0;
  t.h2d_fwd_time = t.h2d_fwd + t.weight_extra * t.weights_fwd;
  t.h2d_bwd_time = t.h2d_bwd + t.weight_extra * t.weights_bwd;
  s.h2d_seconds = (t.h2d_fwd_time + t.h2d_bwd_time) / t.h2d_rate;
  s.d2h_seconds = s.d2h_bytes / t.d2h_rate;
  s.pcie_seconds = std::max({s.h2d_seconds, s.d2h_seconds,
                             (t.h2d_fwd_time + t.h2d_bwd_time + s.d2h_bytes) / t.duplex_rate});
  if (x.cpu) s.pcie_seconds = 0;  // copies on the CPU are memcpy, counted as compute
  // The reduce-scatter moves (N-1)/N of the gradient in and out of each device, on the
  // D2H stream ahead of the copies.
  s.peer_gbps = r.peer_gbps > 0 ? r.peer_gbps : std::max(1e-6, p.d2h_gbps);
  s.reduce_seconds = x.sharded ? 4.0 * x.trained * (x.N - 1) / x.N / (1e9 * s.peer_gbps) : 0;
  return t;
}

// The CPU optimizer's work in the step.
struct OptimizerTimes {
  double adamw = 0;    // parameters a second, in the step
  double norm = 0;     // the clipping norm over every gradient (0 without clipping)
  double updates = 0;  // every unit's update, or the disk if it is slower
};

// Sets the step's optimizer and disk seconds.
OptimizerTimes PredictOptimizer(const PlanRequest& r, const MachineProfile& p, const PlanShape& x,
                                Plan* plan) {
  StepPrediction& s = plan->step;
  OptimizerTimes t;
  // The optimizer: AdamW of every parameter (+ the clipping norm over every gradient), at
  // the profile's in-step fraction of its rate alone (one device's DMA under way included:
  // measured so, it did not follow the DMA's bytes). AdamW moves its bytes (30 a parameter
  // with fp32 moments and the bf16 copy, which machine_bench writes; 28 without the copy) at
  // memory bandwidth; each further device's DMA (weights in, gradients out) shares that
  // bandwidth while it runs.
  t.adamw = std::max(1.0, p.AdamWParamsPerSecond(r.moments, plan->bf16_copy)) *
            p.adamw_in_step_fraction /
            (1.0 + (x.N - 1) * (s.h2d_bytes + s.d2h_bytes) /
                       (AdamWBytesPerParameter(r.moments, plan->bf16_copy) *
                        std::max<int64_t>(1, x.trained)));
  // Clipping reads every gradient for the norm as it lands; held in 16 bits, it also writes
  // them so (2 bytes), and each update first reads them back into an fp32 piece (2 + 4).
  const double host_rate = 1e9 * std::max(1e-6, p.host_gbps);
  const bool compact = r.clipping && plan->compact_held;
  t.norm = r.clipping ? (compact ? 6.0 : 4.0) * x.trained / host_rate : 0;
  const double unpack = compact ? 6.0 * x.trained / host_rate : 0;
  s.optimizer_seconds = x.trained / t.adamw + t.norm + unpack;
  // Its layers' moments are read and written once a step, in the optimizer's order, ahead
  // of it: the optimizer goes no faster than the disk (profile rate, else 2 GB/s each way).
  // Reads and writes run together (machine_bench measures the rate so), and the first
  // layer's block is read before its update can start.
  const double disk_gbps = p.nvme_gbps > 0 ? p.nvme_gbps : 2.0;
  const double disk_layer =
      plan->nvme_layers > 0 ? static_cast<double>(plan->disk_bytes) / plan->nvme_layers : 0;
  s.disk_seconds = (plan->disk_bytes + disk_layer) / (1e9 * disk_gbps);
  s.optimizer_seconds = std::max(s.optimizer_seconds, s.disk_seconds);
  t.updates = std::max(x.trained / t.adamw + unpack, s.disk_seconds);  // every unit's
  return t;
}

// The step's seconds: overlap, phase by phase (pipeline.h). Forward streams weights in
// under compute; the head; backward streams gradients out (and re-uploads evicted layers)
// under compute; the optimizer's updates overlap as clipping allows (step->clip_wait_seconds:
// how long they hold up the next forward).
double OverlapStep(const PlanRequest& r, const PlanShape& x, const ComputeTimes& compute,
                   const Transfers& io, const OptimizerTimes& optimizer, StepPrediction* step) {
  StepPrediction& s = *step;
  const ModelLayerTimes& lt = compute.layers;
  const double fill = io.w_layer * (1.0 + io.weight_extra) / io.h2d_rate;
  const double t_fwd =
      x.cpu ? compute.forward
            : std::max({compute.forward, io.h2d_fwd_time / io.h2d_rate, io.d2h_fwd / io.d2h_rate}) +
                  fill;
  const double t_bwd =
      x.cpu ? compute.backward
            : std::max({compute.backward, io.h2d_bwd_time / io.h2d_rate,
                        io.d2h_bwd / io.d2h_rate + s.reduce_seconds,
                        (io.h2d_bwd_time + io.d2h_bwd) / io.duplex_rate});
  const double head_d2h = x.cpu ? 0 : 4.0 * x.head_n / io.d2h_rate;
  if (r.clipping) {
    // Updates wait for the norm, then run in forward order under the next forward.
    const double forward = std::max(t_fwd, optimizer.updates + lt.bottom.forward * x.M);
    s.clip_wait_seconds = forward - t_fwd;
    return forward + s.head_seconds + std::max(t_bwd, optimizer.norm);
  }
  // Each unit is updated as its gradient lands; the next step needs the embedding and
  // layer 0, which land last, and uploads the embedding once it is updated.
  const double embed_up = x.cpu ? 0 : static_cast<double>(io.up) * x.embed_n / io.h2d_rate;
  const double tail = (x.cpu ? 0 : 4.0 * x.embed_n / io.d2h_rate) +
                      (x.embed_n + x.layer_n) / optimizer.adamw + embed_up;
  // The optimizer's first piece: the lm_head's gradient, or (tied, the head holding only
  // its norm) the top layer's after its backward.
  const double first = x.head_n >= x.layer_n
                           ? head_d2h
                           : x.M * lt.top.backward + (x.cpu ? 0 : 4.0 * x.layer_n / io.d2h_rate);
  return t_fwd + s.head_seconds + std::max(t_bwd + tail, first + optimizer.updates + embed_up);
}

// The step's model FLOPs (6 N T + attention) and what the kernels execute, recomputation
// included.
void CountFlops(const PlanRequest& r, const PlanShape& x, Plan* plan) {
  const ModelConfig& c = r.config;
  StepPrediction& s = plan->step;
  const double recompute = static_cast<double>(x.K - 1) / x.K;
  const double tokens = static_cast<double>(x.M) * x.n * x.N;  // the whole step's
  // Attention's span over the layers: seq per causal layer (its queries see seq/2 keys on
  // average), 2 (W - W^2 / (2 seq)) under a sliding window of W < seq tokens (GPT-OSS).
  double span = 0;
  for (int64_t l = 0; l < x.L; ++l) {
    const double seq = static_cast<double>(r.seq_len);
    const double W = static_cast<double>(c.AttentionWindow(l));
    span += W > 0 && W < seq ? 2 * (W - W * W / (2 * seq)) : seq;
  }
  s.model_flops = (6.0 * MatmulParameters(c) - 2.0 * x.frozen_matmul + 6.0 * x.adapter_matmul) *
                      tokens +
                  6.0 * span * c.num_heads * c.head_dim * tokens;
  // Hardware: the forward runs (2 + (K-1)/K) times per layer, the head once.
  // A layer's matmul parameters one token passes through (MoE: the active ones).
  const double active_layer_n =
      static_cast<double>(MatmulParameters(c) - c.vocab_size * c.hidden_size) / x.L;
  const double layer_fwd =
      2.0 * tokens * active_layer_n + 2.0 * tokens * (span / x.L) * c.num_heads * c.head_dim;
  // forward, re-forward, segment recompute, backward (twice a forward)
  s.hardware_flops = x.L * layer_fwd * (1 + 1 + recompute + 2) -
                     plan->kept_layers * layer_fwd + 6.0 * tokens * x.C * x.V;
}

// What bounds the step: the largest of its compute, PCIe and optimizer floors; with
// clipping, the updates after the norm when the next forward waits for them 5% of the step
// or more.
std::string NameBound(const MachineProfile& p, const PlanShape& x,
                      const OptimizerTimes& optimizer, const StepPrediction& s) {
  if (s.clip_wait_seconds >= 0.05 * s.seconds) {
    return "clipping (the next forward waits for the updates after the norm)";
  }
  const double floors[] = {s.compute_seconds, s.pcie_seconds, s.optimizer_seconds};
  const int which = static_cast<int>(std::max_element(floors, floors + 3) - floors);
  if (which == 0) return x.cpu ? "CPU compute" : "GPU compute";
  if (which == 1) return "PCIe";
  // AdamW moves 30 bytes per parameter; near the memory bandwidth, that is the limit.
  const bool memory = 30.0 * optimizer.adamw >= 0.8 * 1e9 * p.host_gbps;
  return s.disk_seconds >= s.optimizer_seconds && s.disk_seconds > 0
             ? "NVMe (the optimizer state on disk)"
         : memory ? "host memory bandwidth (CPU AdamW)"
                  : "CPU optimizer";
}

}  // namespace

// The prediction, stage by stage: memory on the device and the host (and the NVMe tier's
// share), then the step's kernels, transfers and optimizer, how they overlap, its FLOPs and
// what bounds it.
void PredictPlan(const PlanRequest& r, const MachineProfile& p, Backend* backend, Plan* plan) {
  const ModelLayout layout = LayoutOf(r);
  const PlanShape x = ShapeOf(r, backend, layout, *plan);
  plan->num_parameters = NumParameters(r.config);
  SizeDeviceMemory(r, backend, layout, plan);
  SizeHostMemory(r, layout, x, plan);
  PlaceMomentsOnDisk(r, x, plan);
  plan->step = StepPrediction{};
  const ComputeTimes compute = PredictCompute(r, p, backend, layout, x, plan);
  const Transfers transfers = PredictTransfers(r, p, x, plan);
  const OptimizerTimes optimizer = PredictOptimizer(r, p, x, plan);
  plan->step.seconds = OverlapStep(r, x, compute, transfers, optimizer, &plan->step);
  CountFlops(r, x, plan);
  plan->step.bound = NameBound(p, x, optimizer, plan->step);
}

namespace {

// The top layers to keep (k == 1 only): the request's number, or as many as the device
// memory left over holds. (A tiled layer keeps its attention half only: keeping it saves
// the attention's recompute, the MLP is recomputed anyway.)
void ChooseKeptLayers(const PlanRequest& r, const MachineProfile& profile, Backend* backend,
                      Plan* plan) {
  const ModelConfig& c = r.config;
  const bool cpu = backend->kind() == BackendKind::kCpu;
  if (r.kept_layers >= 0) {
    plan->kept_layers = plan->checkpoint_every == 1 ? std::min(r.kept_layers, c.num_layers) : 0;
    if (plan->kept_layers > 0) PredictPlan(r, profile, backend, plan);
  } else if (plan->checkpoint_every == 1 && !cpu) {
    // Keep as many layers' intermediates as the device memory left over holds. (On the
    // CPU backend that memory is the box's shared RAM: not taken for speed.)
    Plan one = *plan;
    one.kept_layers = 1;
    PredictPlan(r, profile, backend, &one);
    const int64_t per_layer = one.device_bytes - plan->device_bytes;
    const int64_t room = r.device_budget_bytes - plan->device_bytes;
    const int64_t fit = per_layer > 0 ? std::max<int64_t>(0, room / per_layer) : 0;
    plan->kept_layers = std::min(c.num_layers, fit);
    if (plan->kept_layers > 0) PredictPlan(r, profile, backend, plan);
  }
}

// The best plan that fits, and the smallest of all (for the refusal's numbers).
struct PlanSearch {
  Plan best, smallest;
  bool have_best = false, have_smallest = false;
  int candidates = 0, fitting = 0;

  void Consider(const Plan& plan, const PlanRequest& r, bool cpu) {
    ++candidates;
    const int64_t device_need = cpu ? 0 : plan.device_bytes;
    if (!have_smallest ||
        plan.device_bytes + plan.host_bytes < smallest.device_bytes + smallest.host_bytes) {
      smallest = plan;
      have_smallest = true;
    }
    if (device_need > r.device_budget_bytes || plan.host_bytes > r.host_budget_bytes) return;
    ++fitting;
    // Host memory is the box's shared resource: a plan that holds more of it (pinned
    // checkpoints) must be 5% faster to be chosen, and one that holds less wins unless
    // 5% slower. Otherwise: faster by 1%, or as fast and recomputing less, then taking
    // less device memory.
    bool better;
    if (!have_best) {
      better = true;
    } else if (plan.host_bytes != best.host_bytes) {
      better = plan.host_bytes < best.host_bytes ? plan.step.seconds <= best.step.seconds * 1.05
                                                 : plan.step.seconds < best.step.seconds * 0.95;
    } else {
      const auto cost = [](const Plan& x) {
        return std::make_tuple(x.checkpoint_every, x.device_bytes);
      };
      better = plan.step.seconds < best.step.seconds * 0.99 ||
               (plan.step.seconds <= best.step.seconds * 1.01 && cost(plan) < cost(best));
    }
    if (better) {
      best = plan;
      have_best = true;
    }
  }
};

// Refuses, before any plan is counted, a step whose tokens alone need more memory than
// the job may take: every plan holds MinDeviceBytesPerToken (step_memory.h) per token of a
// device's share on the device (on the CPU backend, in host memory, for each device).
absl::Status CheckStepCanFit(const PlanRequest& r, Backend* backend, int64_t device_tokens) {
  const bool cpu = backend->kind() == BackendKind::kCpu;
  const int64_t devices = std::max<int64_t>(1, r.devices);
  const int64_t per_token = MinDeviceBytesPerToken(r.config, *backend);
  const int64_t budget = cpu ? r.host_budget_bytes / devices : r.device_budget_bytes;
  const double need = static_cast<double>(device_tokens) * per_token;
  if (need <= static_cast<double>(budget)) return absl::OkStatus();
  const int64_t tokens = r.rows_per_step * r.seq_len;
  const int64_t most = std::max<int64_t>(0, budget / per_token) * devices;
  return absl::FailedPreconditionError(absl::StrFormat(
      "train.tokens_per_step %d%s needs at least %s of %s for its activations alone (%d bytes a "
      "token: layer inputs kept for backward and their gradient, %d wide, and the token ids "
      "and losses), and the job may take %s%s; lower train.tokens_per_step (at most about %d "
      "tokens could fit, before the model and the layers' work)%s",
      tokens, devices > 1 ? absl::StrFormat(" (%d on each of %d devices)", device_tokens, devices)
                          : std::string(),
      GiB(need), cpu ? "host memory (the CPU backend's buffers)" : "device memory", per_token,
      r.config.hidden_size, GiB(static_cast<double>(budget)),
      devices > 1 ? (cpu ? " per device" : " on each") : "", most,
      cpu ? "" : ", or raise device_memory_cap_bytes where the device has more"));
}

// A request the planner can plan for: a model with layers, a batch of positive size, and
// micro-batches and devices that divide it. InvalidArgument naming the field otherwise.
absl::Status CheckRequest(const PlanRequest& r) {
  const ModelConfig& c = r.config;
  if (c.num_layers < 1 || r.seq_len < 1 || r.rows_per_step < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan: the model needs layers (", c.num_layers, "), and the batch a positive seq_len (",
        r.seq_len, ") and sequences per step (", r.rows_per_step, ")"));
  }
  if (r.micro_batch_rows > 0 && r.rows_per_step % r.micro_batch_rows != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.micro_batch_rows (", r.micro_batch_rows, ") must divide the sequences per step (",
        r.rows_per_step, ")"));
  }
  const int64_t devices = std::max<int64_t>(1, r.devices);
  if (r.rows_per_step % devices != 0 ||
      (r.micro_batch_rows > 0 && (r.rows_per_step / r.micro_batch_rows) % devices != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.devices (", devices, ") must divide the step's ",
        r.micro_batch_rows > 0 ? r.rows_per_step / r.micro_batch_rows : r.rows_per_step,
        r.micro_batch_rows > 0 ? " micro-batches" : " sequences",
        ": each device takes an equal share"));
  }
  return absl::OkStatus();
}

// The values each choice of a plan may take: the request's where it fixes one, else every
// one worth counting on this backend.
struct PlanChoices {
  std::vector<int64_t> rows;          // sequences per micro-batch: the divisors of a share
  std::vector<int64_t> ks;            // checkpoint intervals
  std::vector<bool> places;           // checkpoints in host memory?
  std::vector<int64_t> slot_choices;  // weight slots (0: the fewest)
  std::vector<bool> copies;           // the bf16 copy kept?
  bool compact_held = false;          // clipping's gradients in 16 bits
};

PlanChoices ChoicesFor(const PlanRequest& r, int64_t share, bool cpu) {
  const ModelConfig& c = r.config;
  PlanChoices choices;
  choices.compact_held = r.clipping && r.clip_store == ClipStore::kFp16;
  if (r.micro_batch_rows > 0) {
    choices.rows = {r.micro_batch_rows};
  } else {  // the divisors of share, in order
    std::vector<int64_t> large;
    for (int64_t d = 1; d * d <= share; ++d) {
      if (share % d != 0) continue;
      choices.rows.push_back(d);
      if (d != share / d) large.push_back(share / d);
    }
    choices.rows.insert(choices.rows.end(), large.rbegin(), large.rend());
  }
  if (r.checkpoint_every > 0) {
    choices.ks = {std::min(r.checkpoint_every, c.num_layers)};
  } else {
    for (int64_t k : {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64}) {
      if (k <= c.num_layers) choices.ks.push_back(k);
    }
  }
  if (cpu || r.checkpoints == ActivationPlacement::kDevice) {
    choices.places = {false};
  } else if (r.checkpoints == ActivationPlacement::kHost) {
    choices.places = {true};
  } else {
    choices.places = {false, true};
  }
  choices.slot_choices = {0};
  if (r.weight_slots >= 0) {
    choices.slot_choices = {r.weight_slots};
  } else if (!cpu) {
    choices.slot_choices.push_back(c.num_layers);
  }
  if (r.bf16_copy == Bf16Copy::kYes) {
    choices.copies = {true};
  } else if (r.bf16_copy == Bf16Copy::kNo) {
    choices.copies = {false};
  } else {
    choices.copies = {true, false};
  }
  return choices;
}

// Every combination of `choices` for a device's `share` of sequences, predicted and
// considered; MLP tiles only when no plan over whole micro-batches fits (long sequences)
// and the request leaves the tile to the planner.
PlanSearch SearchPlans(const PlanRequest& r, const MachineProfile& profile, Backend* backend,
                       const PlanChoices& choices, int64_t share, int64_t devices, bool cpu) {
  PlanSearch search;
  std::vector<int64_t> tiles = {r.mlp_tile_tokens > 0 ? r.mlp_tile_tokens : 0};
  for (size_t pass = 0; pass < tiles.size(); ++pass) {
    for (int64_t mb : choices.rows) {
      for (int64_t k : choices.ks) {
        for (bool host : choices.places) {
          for (int64_t slots : choices.slot_choices) {
            for (bool copy : choices.copies) {
              Plan plan;
              plan.bf16_copy = copy;
              plan.compact_held = choices.compact_held;
              plan.micro_batch_rows = mb;
              plan.micro_batches = share / mb;
              plan.devices = devices;
              plan.checkpoint_every = k;
              plan.checkpoints_on_host = host;
              plan.weight_slots = slots;
              plan.loss_chunk_tokens = r.loss_chunk_tokens;
              plan.mlp_tile_tokens = tiles[pass] < mb * r.seq_len ? tiles[pass] : 0;
              PredictPlan(r, profile, backend, &plan);
              ChooseKeptLayers(r, profile, backend, &plan);
              search.Consider(plan, r, cpu);
            }
          }
        }
      }
    }
    if (pass == 0 && !search.have_best && r.mlp_tile_tokens < 0) {
      for (int64_t tile : {32768, 16384, 8192, 4096}) {
        if (tile < choices.rows.front() * r.seq_len) tiles.push_back(tile);
      }
    }
  }
  return search;
}

// Why no plan fits, with the smallest plan's figures: the device memory it needs, or the
// host memory, and what to change.
absl::Status NoPlanFits(const PlanRequest& r, const Plan& smallest, bool cpu) {
  if (!cpu && smallest.device_bytes > r.device_budget_bytes) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the job does not fit in device memory: its smallest plan (%d sequence(s) of %d tokens "
        "per micro-batch, checkpoints every %d layer(s) %s) needs %s on the device, and it "
        "may take %s; lower data.seq_len, or raise device_memory_cap_bytes",
        smallest.micro_batch_rows, r.seq_len, smallest.checkpoint_every,
        smallest.checkpoints_on_host ? "in host memory" : "on the device",
        GiB(smallest.device_bytes), GiB(r.device_budget_bytes)));
  }
  // Frozen tensors are 2 bytes a parameter: the moments' dtype and disk help only where the
  // state is most of it.
  const double per_parameter = static_cast<double>(smallest.host_store_bytes) /
                               std::max<double>(1, static_cast<double>(smallest.num_parameters));
  const bool mostly_state = per_parameter > 4;
  return absl::FailedPreconditionError(absl::StrFormat(
      "the job does not fit in host memory: it needs %s (training state %s for %s parameters "
      "at %.4g bytes each, gradients %s%s), and %s is available; use a smaller model%s%s%s",
      GiB(smallest.host_bytes), GiB(smallest.host_store_bytes), Params(smallest.num_parameters),
      per_parameter, GiB(smallest.host_slab_bytes + smallest.host_held_bytes),
      smallest.host_checkpoint_bytes > 0
          ? absl::StrCat(", checkpoints ", GiB(smallest.host_checkpoint_bytes))
          : std::string(cpu ? absl::StrCat(", CPU buffers ", GiB(smallest.device_bytes)) : ""),
      GiB(r.host_budget_bytes),
      r.moments != MomentDType::kInt8 && mostly_state
          ? absl::StrFormat(", or keep AdamW's moments in int8 (optimizer.state_dtype: int8, "
                            "%.4g bytes a parameter)",
                            StoreBytesPerParameter(MomentDType::kInt8, smallest.bf16_copy))
          : std::string(),
      !mostly_state ? ", or a box with more memory (a frozen tensor takes 2 bytes a parameter)"
      : r.nvme_dir.empty() ? ", or keep the top layers' moments on a local disk "
                             "(optimizer.nvme_dir)"
                           : "",
      !r.clipping ? ""
      : smallest.compact_held
          ? ", or turn clipping off (train.max_grad_norm: 0 holds no gradient for the norm)"
          : ", or keep clipping's gradients in 16 bits (optimizer.clip_store: fp16, 2 bytes "
            "a parameter instead of 4), or turn clipping off (train.max_grad_norm: 0)"));
}

}  // namespace

PipelineOptions PipelineOptionsOf(const Plan& plan, int64_t seq_len) {
  PipelineOptions o;
  o.micro_batches = plan.micro_batches;
  o.tokens_per_micro_batch = plan.micro_batch_rows * seq_len;
  o.checkpoint_every = plan.checkpoint_every;
  o.loss_chunk_tokens = plan.loss_chunk_tokens;
  o.checkpoints_on_host = plan.checkpoints_on_host;
  o.weight_slots = plan.weight_slots;
  o.kept_layers = plan.kept_layers;
  o.mlp_tile_tokens = plan.mlp_tile_tokens;
  o.eval_micro_batches = plan.eval_micro_batches;
  return o;
}

// The search, stage by stage: the request checked, the choices each knob may take, every
// combination predicted, then the best that fits (or why none does).
absl::StatusOr<Plan> MakePlan(const PlanRequest& r, const MachineProfile& profile,
                              Backend* backend) {
  RETURN_IF_ERROR(CheckRequest(r));
  const int64_t devices = std::max<int64_t>(1, r.devices);
  const int64_t share = r.rows_per_step / devices;  // each device's sequences
  const bool cpu = backend->kind() == BackendKind::kCpu;
  RETURN_IF_ERROR(CheckStepCanFit(r, backend, share * r.seq_len));
  PlanChoices choices = ChoicesFor(r, share, cpu);
  PlanSearch search = SearchPlans(r, profile, backend, choices, share, devices, cpu);
  if (!search.have_best && r.clipping && r.clip_store == ClipStore::kAuto) {
    choices.compact_held = true;  // exact clipping does not fit: its gradients in 16 bits
    search = SearchPlans(r, profile, backend, choices, share, devices, cpu);
  }
  if (!search.have_best) return NoPlanFits(r, search.smallest, cpu);
  Plan& best = search.best;
  if (choices.copies.size() == 2) {  // what the other choice would cost, for the plan's reason
    Plan other = best;
    other.bf16_copy = !best.bf16_copy;
    PredictPlan(r, profile, backend, &other);
    best.other_copy_step_seconds = other.step.seconds;
  }
  best.candidates = search.candidates;
  best.fitting = search.fitting;
  FitEvaluation(r, backend, &best);
  return best;
}

namespace {

// The model: its size, its experts, its attention windows.
void DescribeModel(const Plan& plan, const PlanRequest& r, std::string* out) {
  const ModelConfig& c = r.config;
  absl::StrAppendFormat(out, "model      %s parameters, %d layers, hidden %d, vocab %d\n",
                        Params(plan.num_parameters), c.num_layers, c.hidden_size, c.vocab_size);
  if (c.is_moe()) {
    absl::StrAppendFormat(
        out, "experts    %d MoE layer(s) of %d experts (I %d), top-%d%s: %s active parameters "
              "per token (model FLOPs count these); load-balancing loss x%g\n",
        c.NumMoeLayers(), c.moe.num_experts, c.moe.intermediate_size, c.moe.experts_per_token,
        c.moe.norm_topk_prob ? " renormalised" : "",
        Params(MatmulParameters(c) + (c.tie_word_embeddings ? 0 : c.vocab_size * c.hidden_size)),
        c.moe.TrainedAuxLossCoef(r.router_aux_loss_coef));
  }
  int64_t sliding = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) sliding += c.AttentionWindow(l) > 0 ? 1 : 0;
  if (sliding > 0) {
    absl::StrAppendFormat(out,
                          "attention  %d sliding layer(s) (window %d tokens), %d full; %s\n",
                          sliding, c.sliding_window, c.num_layers - sliding,
                          c.attention_sinks ? "a learned sink per head" : "no sinks");
  }
}

// The machine's rates the plan is made with, and the batch and devices it splits.
void DescribeMachineAndBatch(const Plan& plan, const PlanRequest& r,
                             const MachineProfile& profile, std::string* out) {
  const StepPrediction& s = plan.step;
  const int64_t tokens = r.rows_per_step * r.seq_len;
  absl::StrAppendFormat(out, "machine    %s; PCIe %.0f GB/s in, %.0f GB/s out; matmul %.0f TFLOP/s; "
                             "CPU AdamW %.2f G params/s (x %.2f in a step)\n",
                        profile.backend, profile.h2d_gbps, profile.d2h_gbps,
                        profile.gemm_peak_tflops, profile.adamw_params_per_second / 1e9,
                        profile.adamw_in_step_fraction);
  // The rates behind every choice below: a spec plans alike wherever this profile is used.
  absl::StrAppendFormat(out, "profile    %s, measured %s\n",
                        profile.source.empty() ? "not cached" : profile.source,
                        profile.measured_at.empty() ? "-" : profile.measured_at);
  absl::StrAppendFormat(out, "batch      %d tokens per step = %d sequence(s) of %d; %d micro-batch(es) "
                             "of %d sequence(s)%s\n",
                        tokens, r.rows_per_step, r.seq_len, plan.micro_batches,
                        plan.micro_batch_rows, plan.devices > 1 ? " on each device" : "");
  if (plan.eval_micro_batches > 0) {
    absl::StrAppendFormat(out, "eval       forward only, %d micro-batch(es) through each layer "
                               "at once, in the step's activation memory\n",
                          plan.eval_micro_batches);
  }
  if (plan.devices > 1) {
    absl::StrAppendFormat(
        out, "devices    %d, data parallel over one host copy of the state; gradients %s\n",
        plan.devices,
        r.reduce_on_devices
            ? absl::StrFormat("reduce-scattered device to device (%.3f s at %.0f GB/s), each "
                              "drains 1/%d over its own PCIe link",
                              s.reduce_seconds, s.peer_gbps, plan.devices)
            : std::string("drained whole by every device and added on the host"));
  }
}

// Where the memory goes: checkpoints, slots, kept layers, tiles, the device's and the
// host's totals, the training state, the NVMe tier and what crosses PCIe.
void DescribeMemory(const Plan& plan, const PlanRequest& r, const MachineProfile& profile,
                    std::string* out) {
  const StepPrediction& s = plan.step;
  const ModelConfig& c = r.config;
  absl::StrAppendFormat(
      out, "memory     layer inputs kept every %d layer(s) %s%s; %d weight slot(s)%s\n",
      plan.checkpoint_every, plan.checkpoints_on_host ? "in pinned host memory" : "on the device",
      plan.checkpoint_every > 1 ? " (the layers between are recomputed in backward)" : "",
      plan.weight_slots,
      plan.weight_slots >= c.num_layers ? " (every layer stays on the device from forward to backward)"
                                        : "");
  if (plan.kept_layers > 0) {
    absl::StrAppendFormat(out, "           the top %d layer(s) keep their %s for backward "
                               "(not recomputed)\n",
                          plan.kept_layers,
                          plan.mlp_tile_tokens > 0 ? "attention" : "activations");
  }
  if (plan.mlp_tile_tokens > 0) {
    absl::StrAppendFormat(out, "           sequence tiles: each layer's MLP runs over %d tokens at "
                               "a time (recomputed in backward); attention over the whole "
                               "sequence\n",
                          plan.mlp_tile_tokens);
  }
  absl::StrAppendFormat(out, "           device %s of %s%s; host %s of %s (training state %s, "
                             "gradients %s, checkpoints %s): %.4g bytes a parameter\n",
                        GiB(plan.device_bytes), GiB(r.device_budget_bytes),
                        plan.devices > 1 ? " on each" : "", GiB(plan.host_bytes),
                        GiB(r.host_budget_bytes), GiB(plan.host_store_bytes),
                        GiB(plan.host_slab_bytes + plan.host_held_bytes),
                        GiB(plan.host_checkpoint_bytes),
                        static_cast<double>(plan.host_bytes) /
                            std::max<double>(1, static_cast<double>(plan.num_parameters)));
  const double trained = StoreBytesPerParameter(r.moments, plan.bf16_copy);
  const double overall = static_cast<double>(plan.host_store_bytes) /
                         std::max<double>(1, static_cast<double>(plan.num_parameters));
  absl::StrAppendFormat(out,
                        "state      %sfp32 master, %s AdamW moments: %.4g bytes a parameter%s\n",
                        plan.bf16_copy ? "bf16 weights, " : "", MomentDTypeName(r.moments),
                        trained,
                        std::fabs(overall - trained) > 0.01
                            ? absl::StrFormat(" trained; %.3g over the model (frozen tensors: "
                                              "bf16 alone)", overall)
                            : std::string());
  if (plan.nvme_layers > 0) {
    absl::StrAppendFormat(out, "nvme       the moments of the top %d layer(s) on disk in %s: %s "
                               "(%s of RAM buffers), read and written every step: %.2f s "
                               "at %.3g GB/s each way\n",
                          plan.nvme_layers, r.nvme_dir, GiB(plan.disk_bytes),
                          GiB(plan.host_disk_buffer_bytes), s.disk_seconds,
                          profile.nvme_gbps > 0 ? profile.nvme_gbps : 2.0);
  }
  const double other = plan.other_copy_step_seconds;
  const double change = other > 0 ? 100.0 * (other / std::max(1e-12, s.seconds) - 1.0) : 0.0;
  if (plan.bf16_copy) {
    absl::StrAppendFormat(out, "           the bf16 copy crosses PCIe%s\n",
                          other > 0 ? absl::StrFormat(" (kept by optimizer.bf16_copy auto: "
                                                      "without it, streaming the fp32 master, "
                                                      "the step is %+.1f%%)", change)
                                    : std::string(" (optimizer.bf16_copy: yes)"));
  } else {
    absl::StrAppendFormat(out, "           the fp32 master crosses PCIe, rounded to bf16 on the "
                               "device (no bf16 copy: %s)\n",
                          other > 0 ? absl::StrFormat("optimizer.bf16_copy auto; with one the "
                                                      "step is %+.1f%%", change)
                                    : std::string("optimizer.bf16_copy: no"));
  }
}

// The predicted step, what bounds it and its parts.
void DescribeStep(const Plan& plan, const PlanRequest& r, const MachineProfile& profile,
                  std::string* out) {
  const StepPrediction& s = plan.step;
  const int64_t tokens = r.rows_per_step * r.seq_len;
  const double tps = tokens / std::max(1e-12, s.seconds);
  absl::StrAppendFormat(out, "step       %.3f s predicted: %.0f tokens/s, %.0f model TFLOP/s (MFU %.2f)\n",
                        s.seconds, tps, s.model_flops / s.seconds / 1e12,
                        profile.gemm_peak_tflops > 0
                            ? s.model_flops / s.seconds / 1e12 / profile.gemm_peak_tflops
                            : 0.0);
  absl::StrAppendFormat(out, "bound      %s\n", s.bound);
  absl::StrAppendFormat(out, "           kernels %.3f s (forward %.3f, loss %.3f); PCIe %.3f s (%s in, "
                             "%s out%s); CPU AdamW %.3f s\n",
                        s.compute_seconds, s.forward_seconds, s.head_seconds, s.pcie_seconds,
                        Bytes(s.h2d_bytes), Bytes(s.d2h_bytes),
                        plan.devices > 1 ? ", each device" : "", s.optimizer_seconds);
  if (r.clipping) {
    absl::StrAppendFormat(out, "clipping   on: updates wait for the global norm and run during "
                               "the next forward (train.max_grad_norm: 0 overlaps them with "
                               "backward); the waiting gradients %s\n",
                          plan.compact_held
                              ? absl::StrCat("in 16 bits, ", GiB(plan.host_held_bytes),
                                             " (optimizer.clip_store: fp16)")
                              : absl::StrCat("in fp32 slabs, ", GiB(plan.host_slab_bytes)));
  }
}

}  // namespace

namespace {

// Where layer l's tensors live between its forward and its backward, in words: its input,
// its intermediates, its bf16 weights and its AdamW moments.
std::string LayerPlacement(const Plan& plan, int64_t L, int64_t l) {
  const int64_t K = std::max<int64_t>(1, plan.checkpoint_every);
  const std::string input =
      l % K != 0 ? "recomputed from the kept one below"
                 : absl::StrCat("kept (", plan.checkpoints_on_host ? "host" : "device", ")");
  const std::string intermediates =
      l >= L - plan.kept_layers
          ? (plan.mlp_tile_tokens > 0 ? "attention's kept, MLP's recomputed" : "kept")
          : "recomputed";
  const std::string weights = plan.weight_slots >= L ? "resident" : "streamed";
  const std::string moments = l >= L - plan.nvme_layers ? "NVMe" : "RAM";
  return absl::StrFormat("%-34s %-35s %-9s %s", input, intermediates, weights, moments);
}

// The decoder layers' placements (`megatrain plan`), runs of layers alike on one line each.
// A run of checkpoint intervals alike shows each position in the interval once: "1,3..27".
void DescribePlacement(const Plan& plan, const PlanRequest& r, std::string* out) {
  const int64_t L = r.config.num_layers;
  const int64_t K = std::max<int64_t>(1, plan.checkpoint_every);
  absl::StrAppendFormat(out, "placement  %-10s %-34s %-35s %-9s %s\n", "layers", "input",
                        "intermediates", "weights", "moments");
  auto interval = [&](int64_t start) {  // its layers' placements, one a line
    std::string text;
    for (int64_t l = start; l < std::min(L, start + K); ++l) {
      absl::StrAppend(&text, LayerPlacement(plan, L, l), "\n");
    }
    return text;
  };
  for (int64_t first = 0; first < L;) {
    const std::string pattern = interval(first);
    int64_t end = std::min(L, first + K);  // the run: whole intervals alike
    while (end + K <= L && interval(end) == pattern) end += K;
    for (int64_t l = first; l < std::min(L, first + K); ++l) {
      const int64_t last = end - K + (l - first);
      const std::string layers =
          last <= l ? absl::StrCat(l)
          : K == 1  ? absl::StrCat(l, "-", last)
                    : absl::StrCat(l, ",", l + K, "..", last);
      absl::StrAppendFormat(out, "           %-10s %s\n", layers, LayerPlacement(plan, L, l));
    }
    first = end;
  }
}

}  // namespace

std::string DescribePlan(const Plan& plan, const PlanRequest& r, const MachineProfile& profile) {
  std::string out;
  DescribeModel(plan, r, &out);
  DescribeMachineAndBatch(plan, r, profile, &out);
  DescribeMemory(plan, r, profile, &out);
  DescribePlacement(plan, r, &out);
  DescribeStep(plan, r, profile, &out);
  return out;
}

}  // namespace megatrain
