// The planner picks plans that fit, says what bounds them, and refuses with the numbers.
// Rates come from a fixed H200-like profile, so the choices are the planner's alone.
#include "engine/plan/planner.h"

#include <chrono>
#include <memory>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "engine/backend/factory.h"
#include "engine/common/collective.h"
#include "engine/plan/step_memory.h"
#include "engine/store/grad_slab_pool.h"
#include "bench/shapes.h"
#include "engine/model/layout.h"
#include "engine/backend/planning_backend.h"

namespace megatrain {
namespace {

constexpr int64_t kGiB = 1ll << 30;


MachineProfile H200Like() {
  MachineProfile p;
  p.backend = "cuda:0";
  p.h2d_gbps = 53;
  p.d2h_gbps = 53;
  p.duplex_gbps = 95;
  p.device_gbps = 3500;
  for (int64_t rows : {2048, 8192, 32768}) {
    for (auto [ic, oc] : {std::pair<int64_t, int64_t>{1536, 1536}, {3584, 18944}, {18944, 3584}}) {
      const double rate = rows == 2048 ? 450 : rows == 8192 ? 600 : 650;
      p.gemm.push_back(GemmSample{rows, ic, oc, rate, rate * 0.9});
    }
  }
  p.gemm_peak_tflops = 650;
  p.attention = {{1024, 300, 250}, {4096, 400, 330}, {16384, 420, 350}};
  p.adamw_params_per_second = 4.58e9;  // an H200 host's machine_bench rate (0.70x of it in a step)
  p.host_gbps = 150;
  return p;
}

// A bench shape (bench/shapes.h) cut to `layers`.
ModelConfig ShapeWithLayers(const char* shape, int64_t layers) {
  ModelConfig c;
  EXPECT_TRUE(NamedShape(shape, &c)) << shape;
  SetNumLayers(layers, &c);
  return c;
}

ModelConfig Qwen7B(int64_t layers = 28) { return ShapeWithLayers("qwen2.5-7b", layers); }

ModelConfig Qwen1p5B(int64_t layers = 28) { return ShapeWithLayers("qwen2.5-1.5b", layers); }

PlanRequest Request(const ModelConfig& c, int64_t tokens, int64_t device_gib,
                    int64_t host_gib = 120) {
  PlanRequest r;
  r.config = c;
  r.seq_len = 4096;
  r.rows_per_step = tokens / 4096;
  r.clipping = false;
  r.device_budget_bytes = device_gib * kGiB;
  r.host_budget_bytes = host_gib * kGiB;
  return r;
}

// One 512K-token sequence of the 7B: no plan over whole micro-batches fits 130 GiB (the
// gate|up product alone is 40 GB), so the planner tiles the MLP half and the job fits; told
// never to tile, it is refused naming the device memory. The plan says so, and keeps the
// attention half of the layers it has room for.
TEST(Planner, LongSequenceTilesTheMlpWhenNothingElseFits) {
  PlanningBackend be;
  PlanRequest r = Request(Qwen7B(), 524288, 130, 400);
  r.seq_len = 524288;
  r.rows_per_step = 1;
  absl::StatusOr<Plan> plan = MakePlan(r, H200Like(), &be);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_GT(plan->mlp_tile_tokens, 0);
  EXPECT_LT(plan->mlp_tile_tokens, 524288);
  // Room left keeps the top layers' attention half (its recompute is the costly part at
  // 512K; the MLP is recomputed anyway).
  EXPECT_GT(plan->kept_layers, 0);
  EXPECT_LE(plan->device_bytes, 130 * kGiB);
  const std::string text = DescribePlan(*plan, r, H200Like());
  EXPECT_NE(text.find("sequence tiles"), std::string::npos) << text;
  EXPECT_NE(text.find("keep their attention for backward"), std::string::npos) << text;
  r.mlp_tile_tokens = 0;
  absl::StatusOr<Plan> whole = MakePlan(r, H200Like(), &be);
  ASSERT_FALSE(whole.ok());
  EXPECT_NE(whole.status().message().find("does not fit in device memory"), std::string::npos)
      << whole.status();
  // At 4K tokens nothing changes: no tile.
  absl::StatusOr<Plan> short_plan = MakePlan(Request(Qwen7B(), 65536, 130), H200Like(), &be);
  ASSERT_TRUE(short_plan.ok());
  EXPECT_EQ(short_plan->mlp_tile_tokens, 0);
}

// The pipeline a job builds from its plan is the one the planner sized: every choice
// carried, and the device bytes counted for it.
TEST(Planner, APlansPipelineOptionsCarryItsChoicesAndAllocateWhatItCounted) {
  PlanningBackend be;
  const PlanRequest r = Request(Qwen7B(6), 65536, 40);
  absl::StatusOr<Plan> plan = MakePlan(r, H200Like(), &be);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const PipelineOptions o = PipelineOptionsOf(*plan, r.seq_len);
  EXPECT_EQ(o.micro_batches, plan->micro_batches);
  EXPECT_EQ(o.tokens_per_micro_batch, plan->micro_batch_rows * r.seq_len);
  EXPECT_EQ(o.checkpoint_every, plan->checkpoint_every);
  EXPECT_EQ(o.checkpoints_on_host, plan->checkpoints_on_host);
  EXPECT_EQ(o.weight_slots, plan->weight_slots);
  EXPECT_EQ(o.kept_layers, plan->kept_layers);
  EXPECT_EQ(o.mlp_tile_tokens, plan->mlp_tile_tokens);
  EXPECT_EQ(o.loss_chunk_tokens, plan->loss_chunk_tokens);
  EXPECT_EQ(StepDeviceBytes(r.config, BuildLayout(r.config), &be, o) +
                (plan->bf16_copy ? 0 : be.f32_upload_staging_bytes()),
            plan->device_bytes);
}

TEST(Planner, SevenBAtSixtyFourKTokensIsComputeBoundAndFitsTheDevice) {
  PlanningBackend be;
  absl::StatusOr<Plan> plan = MakePlan(Request(Qwen7B(), 65536, 130), H200Like(), &be);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->step.bound, "GPU compute");
  EXPECT_LE(plan->device_bytes, 130 * kGiB);
  EXPECT_EQ(plan->micro_batch_rows * plan->micro_batches, 16);
  // Room to spare on an H200: no recomputation beyond the per-layer one, nothing on the host.
  EXPECT_EQ(plan->checkpoint_every, 1);
  EXPECT_FALSE(plan->checkpoints_on_host);
  // The step is at least its largest floor, and not far above it when compute-bound.
  EXPECT_GE(plan->step.seconds, plan->step.compute_seconds);
  EXPECT_LE(plan->step.seconds, 1.15 * plan->step.compute_seconds);
  // Host: 14 bytes per parameter and two gradient slabs of a layer's size (the embedding
  // and lm_head gradients cross in layer-sized pieces).
  EXPECT_LE(plan->host_bytes, 14 * plan->num_parameters + 2 * kGiB);
}

// Frozen tensors are bf16 alone in the host store (2 bytes a parameter) and add nothing to
// the gradient download or the optimizer: freezing all but the top four layers of the 7B
// shrinks the store to its frozen bytes plus the rest's full state, and the optimizer's
// time in proportion.
TEST(Planner, FrozenTensorsCountTwoBytesAndNoOptimizerWork) {
  PlanningBackend be;
  const PlanRequest full = Request(Qwen7B(), 65536, 130);
  PlanRequest frozen = full;
  frozen.freeze = {"layers.0-23", "embed_tokens", "lm_head"};
  absl::StatusOr<Plan> a = MakePlan(full, H200Like(), &be);
  absl::StatusOr<Plan> b = MakePlan(frozen, H200Like(), &be);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  const ModelLayout layout = BuildLayout(full.config);
  int64_t top = 0;  // layers 24-27 and the final norm
  for (int64_t l = 24; l < 28; ++l) top += layout.units[layout.DecoderUnit(l)].num_elements;
  top += full.config.hidden_size;
  const double total = static_cast<double>(a->num_parameters);
  const double state = 4.0 + 8.0;  // fp32 master and moments
  // The trained layers keep the bf16 copy only where the plan streams it.
  const double bf16 = 2.0 * (b->bf16_copy ? total : total - top);
  EXPECT_NEAR(b->host_store_bytes, bf16 + state * top, 0.001 * total);
  EXPECT_LT(b->host_store_bytes, a->host_store_bytes / 3);
  EXPECT_NEAR(b->step.optimizer_seconds / a->step.optimizer_seconds, top / total, 0.01);
  EXPECT_LT(b->step.d2h_bytes, a->step.d2h_bytes / 5);
}

// LoRA on GPT-OSS-120B's attention (r 16): the frozen base is 2 bytes a parameter and the
// gradient slabs hold the adapters' gradients alone, so the plan needs at most 2.2 bytes
// a parameter of host memory (a full fine-tune: 12-14), and no CPU AdamW bound. (At 64K
// tokens a step the layer inputs stay on the device; more tokens may keep them in host
// memory, which the plan adds.)
TEST(Planner, LoraOnTheLargestMoeNeedsLittleMoreThanItsBf16Base) {
  PlanningBackend be;
  PlanRequest r = Request(ShapeWithLayers("gpt-oss-120b", 36), 65536, 130, 4096);
  r.lora.rank = 16;
  r.lora.alpha = 32;
  r.lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
  absl::StatusOr<Plan> plan = MakePlan(r, H200Like(), &be);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_LE(plan->host_bytes, 2.2 * plan->num_parameters)
      << plan->host_store_bytes << " " << plan->host_slab_bytes << " " << plan->host_checkpoint_bytes;
  EXPECT_GE(plan->host_bytes, 2.0 * plan->num_parameters);
  EXPECT_LT(plan->step.optimizer_seconds, 0.01 * plan->step.seconds);
  EXPECT_NE(plan->step.bound, "host memory bandwidth (CPU AdamW)");
}

TEST(Planner, KeepsActivationsInTheDeviceMemoryLeftOver) {
  PlanningBackend be;
  absl::StatusOr<Plan> roomy = MakePlan(Request(Qwen1p5B(), 65536, 130), H200Like(), &be);
  absl::StatusOr<Plan> tight = MakePlan(Request(Qwen1p5B(), 65536, 40), H200Like(), &be);
  ASSERT_TRUE(roomy.ok() && tight.ok()) << tight.status();
  EXPECT_GT(roomy->kept_layers, tight->kept_layers);
  EXPECT_GT(roomy->kept_layers, 0);
  EXPECT_LE(roomy->device_bytes, 130 * kGiB);
  EXPECT_LE(tight->device_bytes, 40 * kGiB);
  EXPECT_LT(roomy->step.seconds, tight->step.seconds);
  EXPECT_LT(roomy->step.hardware_flops, tight->step.hardware_flops);
}

TEST(Planner, TheSameJobInTwentyFourGigabytesStillPlans) {
  PlanningBackend be;
  absl::StatusOr<Plan> big = MakePlan(Request(Qwen7B(), 65536, 130), H200Like(), &be);
  absl::StatusOr<Plan> small = MakePlan(Request(Qwen7B(), 65536, 22), H200Like(), &be);
  ASSERT_TRUE(big.ok() && small.ok()) << small.status();
  EXPECT_LE(small->device_bytes, 22 * kGiB);
  EXPECT_TRUE(small->checkpoints_on_host || small->checkpoint_every > 1);
  EXPECT_GE(small->step.seconds, big->step.seconds);
}

// An eval set never changes how a job trains: the step's plan is chosen first, and the
// evaluation takes what the step's activations hold, fewer micro-batches where the device
// budget is tight (never fewer than the step's own, which cost nothing more).
TEST(Planner, AskingForAnEvaluationNeverChangesTheTrainingPlan) {
  PlanningBackend be;
  for (int64_t gib : {130, 22}) {
    PlanRequest r = Request(Qwen7B(), 65536, gib);
    absl::StatusOr<Plan> plain = MakePlan(r, H200Like(), &be);
    r.eval_rows = -1;  // the whole set: as many as fit
    absl::StatusOr<Plan> with_eval = MakePlan(r, H200Like(), &be);
    ASSERT_TRUE(plain.ok() && with_eval.ok()) << with_eval.status();
    EXPECT_EQ(plain->eval_micro_batches, 0);
    EXPECT_EQ(with_eval->micro_batch_rows, plain->micro_batch_rows) << gib << " GiB";
    EXPECT_EQ(with_eval->micro_batches, plain->micro_batches);
    EXPECT_EQ(with_eval->checkpoint_every, plain->checkpoint_every);
    EXPECT_EQ(with_eval->checkpoints_on_host, plain->checkpoints_on_host);
    EXPECT_EQ(with_eval->weight_slots, plain->weight_slots);
    EXPECT_EQ(with_eval->kept_layers, plain->kept_layers);
    EXPECT_GE(with_eval->eval_micro_batches, plain->micro_batches);
    EXPECT_LE(with_eval->eval_micro_batches,
              EvalCapacity(r.config, PipelineOptionsOf(*with_eval, r.seq_len)));
    EXPECT_LE(with_eval->device_bytes, gib * kGiB);
    r.eval_rows = 3;  // fewer rows than a micro-batch holds: one
    absl::StatusOr<Plan> few = MakePlan(r, H200Like(), &be);
    ASSERT_TRUE(few.ok());
    EXPECT_EQ(few->eval_micro_batches, (3 + few->micro_batch_rows - 1) / few->micro_batch_rows);
    EXPECT_EQ(few->device_bytes, plain->device_bytes);
  }
}

TEST(Planner, ResidentLayersWhenTheyFitAndTransfersMatter) {
  PlanningBackend be;
  MachineProfile fast_cpu = H200Like();
  fast_cpu.adamw_params_per_second = 1e11;  // so that PCIe binds
  fast_cpu.h2d_gbps = 5;  // a slow link in, as through a PCIe switch shared with a NIC
  fast_cpu.duplex_gbps = 55;
  absl::StatusOr<Plan> plan = MakePlan(Request(Qwen1p5B(), 4096, 130), fast_cpu, &be);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->step.bound, "PCIe");
  EXPECT_EQ(plan->weight_slots, 28);
  // Only the forward upload crosses: about one bf16 copy of the model per step.
  EXPECT_LT(plan->step.h2d_bytes, 2 * plan->num_parameters * 1.1);
  // Without room for them, the layers stream twice.
  absl::StatusOr<Plan> tight = MakePlan(Request(Qwen1p5B(), 4096, 4), fast_cpu, &be);
  ASSERT_TRUE(tight.ok()) << tight.status();
  EXPECT_LT(tight->weight_slots, 28);
  EXPECT_GT(tight->step.seconds, plan->step.seconds);
}

TEST(Planner, SmallBatchOnASmallModelIsBoundByTheHost) {
  PlanningBackend be;
  absl::StatusOr<Plan> plan = MakePlan(Request(Qwen1p5B(), 4096, 130), H200Like(), &be);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // 1.5B parameters of AdamW against 4K tokens of compute: the H200 measured this one
  // 1.14x its optimizer floor.
  EXPECT_EQ(plan->step.bound, "CPU optimizer");
  EXPECT_GE(plan->step.seconds, plan->step.optimizer_seconds);
  EXPECT_LE(plan->step.seconds, 1.3 * plan->step.optimizer_seconds);
}

// AdamW plans at the profile's in-step fraction of its measured rate, one device's DMA
// included (14 MoE steps on H200s ran it at 0.65-0.77 of machine_bench's rate alone, and not
// in proportion to their DMA): half the fraction, twice the optimizer's time. Without the
// bf16 copy it moves 28 bytes a parameter, not the 30 machine_bench's rate moved.
TEST(Planner, AdamWPlansAtItsInStepFractionOfTheMeasuredRate) {
  PlanningBackend be;
  MachineProfile p = H200Like();
  p.adamw_in_step_fraction = 1.0;
  absl::StatusOr<Plan> alone = MakePlan(Request(Qwen1p5B(), 4096, 130), p, &be);
  p.adamw_in_step_fraction = 0.5;
  absl::StatusOr<Plan> half = MakePlan(Request(Qwen1p5B(), 4096, 130), p, &be);
  ASSERT_TRUE(alone.ok() && half.ok()) << half.status();
  EXPECT_DOUBLE_EQ(alone->step.optimizer_seconds,
                   alone->num_parameters / p.adamw_params_per_second *
                       (alone->bf16_copy ? 1.0 : 28.0 / 30.0));
  EXPECT_NEAR(half->step.optimizer_seconds, 2 * alone->step.optimizer_seconds,
              1e-9 * alone->step.optimizer_seconds);
  EXPECT_GT(half->step.seconds, alone->step.seconds);
  PlanRequest no_copy = Request(Qwen1p5B(), 4096, 130);
  no_copy.bf16_copy = Bf16Copy::kNo;
  absl::StatusOr<Plan> without = MakePlan(no_copy, p, &be);
  ASSERT_TRUE(without.ok()) << without.status();
  EXPECT_FALSE(without->bf16_copy);
  EXPECT_NEAR(without->step.optimizer_seconds,
              without->num_parameters / (0.5 * p.adamw_params_per_second) * 28.0 / 30.0,
              1e-9 * without->step.optimizer_seconds);
}

TEST(Planner, DeviceMemoryFlatInDepthWithHostCheckpoints) {
  PlanningBackend be;
  PlanRequest shallow = Request(Qwen1p5B(28), 65536, 130);
  PlanRequest deep = Request(Qwen1p5B(84), 65536, 130);
  for (PlanRequest* r : {&shallow, &deep}) {
    r->checkpoints = ActivationPlacement::kHost;
    r->checkpoint_every = 1;
    r->micro_batch_rows = 4;
  }
  absl::StatusOr<Plan> a = MakePlan(shallow, H200Like(), &be);
  absl::StatusOr<Plan> b = MakePlan(deep, H200Like(), &be);
  ASSERT_TRUE(a.ok() && b.ok());
  // Only the weight slots and kept activations grow (they fill the room there is); with
  // streaming slots and nothing kept, nothing does.
  Plan sa = *a, sb = *b;
  sa.weight_slots = sb.weight_slots = 2;
  sa.kept_layers = sb.kept_layers = 0;
  PredictPlan(shallow, H200Like(), &be, &sa);
  PredictPlan(deep, H200Like(), &be, &sb);
  EXPECT_EQ(sa.device_bytes, sb.device_bytes);
  // Model TFLOP/s is about the same (the head's share shrinks with depth).
  const double tflops_a = sa.step.model_flops / sa.step.seconds;
  const double tflops_b = sb.step.model_flops / sb.step.seconds;
  EXPECT_NEAR(tflops_b / tflops_a, 1.0, 0.05);
}

TEST(Planner, FixedChoicesAreKept) {
  PlanningBackend be;
  PlanRequest r = Request(Qwen1p5B(), 65536, 130);
  r.micro_batch_rows = 2;
  r.checkpoint_every = 4;
  r.checkpoints = ActivationPlacement::kHost;
  absl::StatusOr<Plan> plan = MakePlan(r, H200Like(), &be);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->micro_batch_rows, 2);
  EXPECT_EQ(plan->micro_batches, 8);
  EXPECT_EQ(plan->checkpoint_every, 4);
  EXPECT_TRUE(plan->checkpoints_on_host);
}

TEST(Planner, ClippingHoldsEveryGradientAndCostsHostMemory) {
  PlanningBackend be;
  PlanRequest r = Request(Qwen1p5B(), 65536, 130);
  absl::StatusOr<Plan> free_running = MakePlan(r, H200Like(), &be);
  r.clipping = true;
  absl::StatusOr<Plan> clipped = MakePlan(r, H200Like(), &be);
  ASSERT_TRUE(free_running.ok() && clipped.ok());
  EXPECT_GT(clipped->host_slab_bytes, 8 * free_running->host_slab_bytes);
}

// Clipping's waiting gradients: exact fp32 (every slab of the step held) where the job fits,
// else (clip_store auto) in 16 bits: the 7B at 4K and 64K tokens on a box of 113 GiB fits
// only so, at under 14.5 bytes a parameter all told. Asked for fp32 there, the planner refuses
// naming the 16-bit store.
TEST(Planner, ClippingKeepsItsGradientsIn16BitsWhereFp32DoesNotFit) {
  PlanningBackend be;
  PlanRequest r = Request(Qwen7B(), 65536, 130, 113);
  r.clipping = true;
  r.clip_store = ClipStore::kFp32;
  absl::StatusOr<Plan> exact = MakePlan(r, H200Like(), &be);
  ASSERT_FALSE(exact.ok());
  EXPECT_NE(exact.status().message().find("optimizer.clip_store: fp16"), std::string::npos)
      << exact.status();
  r.clip_store = ClipStore::kAuto;
  absl::StatusOr<Plan> compact = MakePlan(r, H200Like(), &be);
  ASSERT_TRUE(compact.ok()) << compact.status();
  EXPECT_TRUE(compact->compact_held);
  EXPECT_LE(compact->host_bytes, r.host_budget_bytes);
  const double per_parameter =
      static_cast<double>(compact->host_bytes) / static_cast<double>(compact->num_parameters);
  EXPECT_LE(per_parameter, 14.5);
  EXPECT_NE(DescribePlan(*compact, r, H200Like()).find("in 16 bits"), std::string::npos);

  r.host_budget_bytes = 200 * kGiB;  // room for the exact store: auto takes it
  absl::StatusOr<Plan> roomy = MakePlan(r, H200Like(), &be);
  ASSERT_TRUE(roomy.ok()) << roomy.status();
  EXPECT_FALSE(roomy->compact_held);
  r.clip_store = ClipStore::kFp16;
  absl::StatusOr<Plan> asked = MakePlan(r, H200Like(), &be);
  ASSERT_TRUE(asked.ok()) << asked.status();
  EXPECT_TRUE(asked->compact_held);
  // About 2 bytes a trained parameter fewer: 4 in fp32 slabs, 2.03 in 16 bits, and a slab's
  // worth of the slabs that cycle and the fp32 piece an update reads (1.76 on the 7B).
  const double saved = static_cast<double>(roomy->host_bytes - asked->host_bytes) /
                       static_cast<double>(asked->num_parameters);
  EXPECT_GT(saved, 1.7);
  EXPECT_LT(saved, 1.97);
  EXPECT_GT(asked->step.optimizer_seconds, roomy->step.optimizer_seconds);
}

// With clipping the updates wait for the norm and then race the next forward, which needs
// layer 0 first: the plan counts how long the forward waits for them and, where that is 5%
// of the step or more, names it as what bounds the step.
TEST(Planner, ClippingsWaitForTheUpdatesIsPredictedAndNamed) {
  PlanningBackend be;
  PlanRequest r = Request(Qwen7B(), 65536, 130, 200);
  absl::StatusOr<Plan> free_running = MakePlan(r, H200Like(), &be);
  r.clipping = true;
  absl::StatusOr<Plan> clipped = MakePlan(r, H200Like(), &be);
  ASSERT_TRUE(free_running.ok() && clipped.ok());
  EXPECT_EQ(free_running->step.clip_wait_seconds, 0);
  EXPECT_GT(clipped->step.clip_wait_seconds, 0);
  EXPECT_GT(clipped->step.seconds, free_running->step.seconds);
  std::printf("7B 64K: unclipped %.3f s, clipped %.3f s (the forward waits %.3f s), bound %s\n",
              free_running->step.seconds, clipped->step.seconds,
              clipped->step.clip_wait_seconds, clipped->step.bound.c_str());
  const bool named = clipped->step.bound.find("clipping") != std::string::npos;
  EXPECT_TRUE(named) << clipped->step.bound;  // 0.69 s of 7.05 on this profile
  EXPECT_EQ(named, clipped->step.clip_wait_seconds >= 0.05 * clipped->step.seconds)
      << clipped->step.bound;
}

TEST(Planner, RefusesWithTheNumbersWhenTheDeviceIsTooSmall) {
  PlanningBackend be;
  absl::StatusOr<Plan> plan = MakePlan(Request(Qwen7B(), 65536, 1), H200Like(), &be);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(plan.status().message().find("device memory"), std::string::npos) << plan.status();
  EXPECT_NE(plan.status().message().find("device_memory_cap_bytes"), std::string::npos);
}

TEST(Planner, RefusesWithTheNumbersWhenTheHostIsTooSmall) {
  PlanningBackend be;
  absl::StatusOr<Plan> plan = MakePlan(Request(Qwen7B(), 65536, 130, 64), H200Like(), &be);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("host memory"), std::string::npos) << plan.status();
  // optimizer.bf16_copy auto: the smallest store drops the copy.
  EXPECT_NE(plan.status().message().find("12 bytes"), std::string::npos) << plan.status();
  EXPECT_NE(plan.status().message().find("optimizer.state_dtype: int8"), std::string::npos);
  EXPECT_NE(plan.status().message().find("optimizer.nvme_dir"), std::string::npos);
}

TEST(Planner, TheNvmeTierBoundsTheStepAtTheDisksRate) {
  PlanningBackend be;
  MachineProfile profile = H200Like();
  profile.nvme_gbps = 1.0;  // each way, reads and writes together (machine_bench)
  PlanRequest r = Request(Qwen7B(), 65536, 130, 82);
  r.bf16_copy = Bf16Copy::kNo;
  r.nvme_dir = "/scratch";
  r.nvme_layers = -1;  // as many as the 82 GiB need
  absl::StatusOr<Plan> plan = MakePlan(r, profile, &be);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_GT(plan->nvme_layers, 0);
  EXPECT_LE(plan->host_bytes, r.host_budget_bytes);
  // Every disk layer's moments are read and written once a step (H200: 14 layers, 26 GB
  // each way at 1.08 GB/s, a 28.5 s step), plus one layer's read before the first update.
  const double each_way = plan->disk_bytes / 1e9;
  EXPECT_NEAR(plan->step.disk_seconds, each_way * (1.0 + 1.0 / plan->nvme_layers), 1e-6);
  EXPECT_GE(plan->step.seconds, plan->step.disk_seconds);
  EXPECT_NE(plan->step.bound.find("NVMe"), std::string::npos) << plan->step.bound;
  r.nvme_dir.clear();
  r.host_budget_bytes = 120 * kGiB;
  absl::StatusOr<Plan> in_ram = MakePlan(r, profile, &be);
  ASSERT_TRUE(in_ram.ok()) << in_ram.status();
  EXPECT_LT(in_ram->step.seconds, plan->step.seconds / 2);
}

// optimizer.bf16_copy auto (the default) drops the copy unless the step is then 5% slower:
// where compute hides the fp32 master's upload, and not where PCIe bounds the step.
TEST(Planner, AutoDropsTheBf16CopyWherePcieHasRoom) {
  PlanningBackend be;
  PlanRequest r = Request(Qwen7B(), 65536, 130);
  ASSERT_EQ(r.bf16_copy, Bf16Copy::kAuto);
  absl::StatusOr<Plan> plan = MakePlan(r, H200Like(), &be);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // 64K tokens: compute-bound (the H200: 6.499 s without the copy, 6.478 s with it).
  EXPECT_FALSE(plan->bf16_copy);
  EXPECT_GT(plan->other_copy_step_seconds, 0);
  EXPECT_LE(plan->step.seconds, 1.05 * plan->other_copy_step_seconds);
  EXPECT_NE(DescribePlan(*plan, r, H200Like()).find("optimizer.bf16_copy"), std::string::npos);
  // 4K tokens with AdamW out of the way (so PCIe binds, not the optimizer, which the copy
  // slows by its 2 bytes a parameter): the weights' upload is the forward; streaming the
  // master would cost more than 5% (its upload runs at 22 GB/s beside compute,
  // kF32UploadCost).
  MachineProfile fast_cpu = H200Like();
  fast_cpu.adamw_params_per_second = 1e11;
  r = Request(Qwen7B(), 4096, 130);
  plan = MakePlan(r, fast_cpu, &be);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->bf16_copy);
  EXPECT_GT(plan->other_copy_step_seconds, 1.05 * plan->step.seconds);
}

TEST(Planner, MoreTokensTakeLongerAndRefusesNonsense) {
  PlanningBackend be;
  absl::StatusOr<Plan> a = MakePlan(Request(Qwen1p5B(), 16384, 130), H200Like(), &be);
  absl::StatusOr<Plan> b = MakePlan(Request(Qwen1p5B(), 65536, 130), H200Like(), &be);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_GT(b->step.seconds, a->step.seconds);
  PlanRequest bad = Request(Qwen1p5B(), 16384, 130);
  bad.micro_batch_rows = 3;  // does not divide 4 sequences
  EXPECT_EQ(MakePlan(bad, H200Like(), &be).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Planner, StepThatCanNeverFitIsRefusedAtOnceWithTheNumbers) {
  // 2147483584 tokens passed the spec's < 2^31 check; counting its plans sized per-token
  // host buffers until the OOM killer came.
  PlanningBackend be;
  PlanRequest r = Request(Qwen7B(), 4096, 130);
  r.seq_len = 64;
  r.rows_per_step = 33554431;  // 2147483584 tokens
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<Plan> plan = MakePlan(r, H200Like(), &be);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 1.0);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string message(plan.status().message());
  EXPECT_NE(message.find("train.tokens_per_step 2147483584 needs at least"), std::string::npos)
      << message;
  EXPECT_NE(message.find("of device memory"), std::string::npos) << message;
  EXPECT_NE(message.find("130.0 GiB"), std::string::npos) << message;

  absl::StatusOr<std::unique_ptr<Backend>> cpu = CreateBackend(BackendRequest{"cpu"});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  plan = MakePlan(r, H200Like(), cpu->get());
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("of host memory"), std::string::npos) << plan.status();
}

TEST(Planner, LargeStepsAreCountedWithoutPerTokenHostBuffers) {
  // 2^26 tokens of a small model fit the device; counting its ~1000 candidate plans used
  // to take 20 s, sizing the pipeline's per-token host vectors for each.
  ModelConfig c = Qwen1p5B(2);
  c.hidden_size = 256;
  c.intermediate_size = 512;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.vocab_size = 1024;
  PlanningBackend be;
  PlanRequest r = Request(c, 4096, 1000, 1000);
  r.rows_per_step = (int64_t{1} << 26) / 4096;
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<Plan> plan = MakePlan(r, H200Like(), &be);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_LT(seconds, 2.0);
}

TEST(Planner, MinDeviceBytesPerTokenIsAFloorUnderEveryPlan) {
  PlanningBackend be;
  const ModelConfig c = Qwen1p5B(4);
  const ModelLayout layout = BuildLayout(c);
  for (int64_t k : {1, 2, 4}) {
    for (bool host : {false, true}) {
      for (int64_t m : {1, 3}) {
        PipelineOptions o;
        o.micro_batches = m;
        o.tokens_per_micro_batch = 4096;
        o.checkpoint_every = k;
        o.checkpoints_on_host = host;
        const int64_t tokens = m * o.tokens_per_micro_batch;
        EXPECT_LE(tokens * MinDeviceBytesPerToken(c, be), StepDeviceBytes(c, layout, &be, o))
            << "k " << k << " host " << host << " m " << m;
      }
    }
  }
}

TEST(Planner, DescribesThePlanInWords) {
  PlanningBackend be;
  const PlanRequest r = Request(Qwen7B(), 65536, 130);
  absl::StatusOr<Plan> plan = MakePlan(r, H200Like(), &be);
  ASSERT_TRUE(plan.ok());
  const std::string text = DescribePlan(*plan, r, H200Like());
  for (const char* want : {"65536 tokens per step", "predicted", "bound      GPU compute",
                           "device", "host", "7.62 B parameters",
                           "CPU AdamW 4.58 G params/s (x 0.70 in a step)"}) {
    EXPECT_NE(text.find(want), std::string::npos) << want << "\n" << text;
  }
}

// The plan's placement table: each decoder layer's input, intermediates, weights and
// moments, runs of layers alike on one line (a run of checkpoint intervals by position).
TEST(Planner, PlacementSaysWhereEachLayersTensorsLive) {
  PlanningBackend be;
  PlanRequest r = Request(Qwen7B(), 65536, 130);
  r.checkpoint_every = 2;
  r.kept_layers = 0;
  r.weight_slots = 2;
  absl::StatusOr<Plan> plan = MakePlan(r, H200Like(), &be);
  ASSERT_TRUE(plan.ok()) << plan.status();
  Plan p = *plan;
  p.kept_layers = 3;  // as if the planner kept the top three
  p.nvme_layers = 1;
  const std::string text = DescribePlan(p, r, H200Like());
  const std::string where = p.checkpoints_on_host ? "host" : "device";
  auto line = [](const std::string& layers, const std::string& input,
                 const std::string& intermediates, const std::string& moments) {
    return absl::StrFormat("           %-10s %-34s %-35s %-9s %s\n", layers, input,
                           intermediates, "streamed", moments);
  };
  for (const std::string& want :
       {line("0,2..22", "kept (" + where + ")", "recomputed", "RAM"),
        line("1,3..23", "recomputed from the kept one below", "recomputed", "RAM"),
        line("24", "kept (" + where + ")", "recomputed", "RAM"),
        line("25", "recomputed from the kept one below", "kept", "RAM"),
        line("26", "kept (" + where + ")", "kept", "RAM"),
        line("27", "recomputed from the kept one below", "kept", "NVMe")}) {
    EXPECT_NE(text.find(want), std::string::npos) << want << "\n" << text;
  }
}

// A bench shape cut to 2 layers and a 32000-token vocabulary, planned at 64K tokens a step
// in 16 rows of 4096 on a 130 GiB device.
PlanRequest TwoLayersOf(const char* shape) {
  ModelConfig c = ShapeWithLayers(shape, 2);
  c.vocab_size = 32000;
  PlanRequest r = Request(c, 65536, 130);
  r.seq_len = 4096;
  r.rows_per_step = 16;
  return r;
}

// GPT-OSS-120B's shape, one layer per kind: the plan names its sliding and full layers,
// and a sliding layer's attention costs its window, not the sequence.
TEST(Planner, GptOssPlanNamesItsWindowsAndSlidingLayersCostLess) {
  PlanningBackend be;
  const PlanRequest r = TwoLayersOf("gpt-oss-120b");
  const ModelConfig& c = r.config;
  absl::StatusOr<Plan> plan = MakePlan(r, H200Like(), &be);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::string text = DescribePlan(*plan, r, H200Like());
  for (const char* want : {"attention  1 sliding layer(s) (window 128 tokens), 1 full; a "
                           "learned sink per head",
                           "experts    2 MoE layer(s) of 128 experts (I 2880), top-4 "
                           "renormalised"}) {
    EXPECT_NE(text.find(want), std::string::npos) << want << "\n" << text;
  }
  ModelConfig full = c;
  full.sliding_layers = {false, false};
  PlanRequest rf = r;
  rf.config = full;
  absl::StatusOr<Plan> full_plan = MakePlan(rf, H200Like(), &be);
  ASSERT_TRUE(full_plan.ok()) << full_plan.status();
  EXPECT_LT(plan->step.model_flops, full_plan->step.model_flops);
  EXPECT_LT(plan->step.compute_seconds, full_plan->step.compute_seconds);
}

// r's GPU time under `after` is over `factor` times that under `before`, and a dense 7B's
// (head_dim 128, no experts) the same under both.
void ExpectSlowerWithOnlyFor(const PlanRequest& r, const MachineProfile& before,
                             const MachineProfile& after, double factor) {
  PlanningBackend be;
  absl::StatusOr<Plan> a = MakePlan(r, before, &be);
  absl::StatusOr<Plan> b = MakePlan(r, after, &be);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_GT(b->step.compute_seconds, a->step.compute_seconds * factor);
  const PlanRequest d = Request(Qwen7B(), 65536, 130);
  absl::StatusOr<Plan> da = MakePlan(d, before, &be);
  absl::StatusOr<Plan> db = MakePlan(d, after, &be);
  ASSERT_TRUE(da.ok() && db.ok());
  EXPECT_DOUBLE_EQ(da->step.compute_seconds, db->step.compute_seconds);
}

// The experts' GEMMs are timed at the grouped rate machine_bench measured at the MoE shape:
// with grouped samples at half the dense grid's rate, an MoE layer's kernels take longer,
// by about the experts' share; a dense model's plan does not change.
TEST(Planner, ExpertGemmsPlanAtTheMeasuredGroupedRate) {
  const PlanRequest r = TwoLayersOf("qwen3-30b-a3b");
  MachineProfile dense = H200Like();
  dense.gemm.push_back(GemmSample{2048, 2048, 1536, 450, 405});
  dense.gemm.push_back(GemmSample{32768, 2048, 1536, 650, 585});
  dense.gemm.push_back(GemmSample{2048, 768, 2048, 450, 405});
  dense.gemm.push_back(GemmSample{32768, 768, 2048, 650, 585});
  MachineProfile grouped = dense;
  for (int64_t rows : {1024, 16384}) {
    grouped.grouped_gemm.push_back({128, rows, 2048, 1536, rows == 1024 ? 200.0 : 300.0, 250});
    grouped.grouped_gemm.push_back({128, rows, 768, 2048, rows == 1024 ? 200.0 : 300.0, 250});
  }
  ExpectSlowerWithOnlyFor(r, dense, grouped, 1.1);
}

// A model of head_dim 64 (GPT-OSS) plans its attention at the rates measured at 64, where
// the profile has them; a head_dim-128 model's plan is unchanged by them.
TEST(Planner, AttentionPlansAtItsHeadDimsMeasuredRate) {
  PlanRequest r = TwoLayersOf("gpt-oss-120b");
  r.seq_len = 65536;  // one long sequence: attention matters
  r.rows_per_step = 1;
  ASSERT_EQ(r.config.head_dim, 64);
  const MachineProfile only_128 = H200Like();
  MachineProfile with_64 = only_128;
  std::vector<AttentionSample> slow_64;
  for (const AttentionSample& a : only_128.attention) {
    slow_64.push_back({a.seq_len, a.forward_tflops / 2, a.backward_tflops / 2, 64});
  }
  with_64.AddAttentionSamples(slow_64);
  ExpectSlowerWithOnlyFor(r, only_128, with_64, 1.05);
}

// A 7B layer's gradient (233 M elements) drains in slabs of 32 M elements, so that the
// optimizer updates its first piece while the rest are still being copied out; without
// clipping the pool holds two layers' worth, as two whole-layer slabs did; with clipping,
// every piece of every unit.
TEST(Planner, GradSlabsOfALargeLayerAreCappedAndHoldTwoLayers) {
  const ModelLayout layout = BuildLayout(Qwen7B());
  const int64_t layer = layout.MaxDecoderElements();
  ASSERT_GT(layer, kGradSlabMaxElements);
  EXPECT_EQ(GradSlabElements(layout), kGradSlabMaxElements);
  const int64_t per_layer = (layer + kGradSlabMaxElements - 1) / kGradSlabMaxElements;
  EXPECT_EQ(GradSlabsNeeded(layout, false), 2 * per_layer);
  int64_t pieces = 0;
  for (const UnitLayout& u : layout.units) {
    pieces += (u.num_elements + kGradSlabMaxElements - 1) / kGradSlabMaxElements;
  }
  EXPECT_EQ(GradSlabsNeeded(layout, true), pieces);
  // Sharded over two devices: each its half of a slab, as many as cover its half of two
  // layers.
  const int64_t shard_slab = GradShardSlabElements(layout, 2);
  EXPECT_EQ(shard_slab, GradShardElements(kGradSlabMaxElements, 2));
  EXPECT_GE(GradShardSlabsNeeded(layout, false, 2) * shard_slab, 2 * GradShardElements(layer, 2));
  EXPECT_LT((GradShardSlabsNeeded(layout, false, 2) - 2) * shard_slab,
            2 * GradShardElements(layer, 2));
  // A small model keeps one slab per layer.
  ModelConfig tiny = Qwen7B(2);
  tiny.hidden_size = 256;
  tiny.intermediate_size = 512;
  tiny.num_heads = 4;
  tiny.num_kv_heads = 2;
  tiny.head_dim = 64;
  const ModelLayout tiny_layout = BuildLayout(tiny);
  EXPECT_EQ(GradSlabElements(tiny_layout), tiny_layout.MaxDecoderElements());
  EXPECT_EQ(GradSlabsNeeded(tiny_layout, false), 2);
}

// Several devices: each takes its share of the step's micro-batches, the step's work
// divides, each device drains 1/N of the gradient when they reduce-scatter (and all of it
// when the host adds), and the host holds no more gradient slabs than with one device.
TEST(Planner, DataParallelDividesTheStepAndNotTheHostState) {
  PlanningBackend be;
  const PlanRequest one_r = Request(Qwen7B(), 65536, 130);
  PlanRequest two_r = one_r;
  two_r.devices = 2;
  two_r.peer_gbps = 300;
  PlanRequest host_r = two_r;
  host_r.reduce_on_devices = false;
  absl::StatusOr<Plan> one = MakePlan(one_r, H200Like(), &be);
  absl::StatusOr<Plan> two = MakePlan(two_r, H200Like(), &be);
  absl::StatusOr<Plan> host = MakePlan(host_r, H200Like(), &be);
  ASSERT_TRUE(one.ok() && two.ok() && host.ok()) << two.status() << host.status();
  EXPECT_EQ(two->devices, 2);
  EXPECT_EQ(two->micro_batch_rows * two->micro_batches, 8);  // its share of 16 sequences
  EXPECT_DOUBLE_EQ(two->step.model_flops, one->step.model_flops);  // the whole step's
  // Gradients land as fp32: all of them on one device, half on each of two.
  const int64_t grads = 4 * one->num_parameters;
  EXPECT_NEAR(two->step.d2h_bytes, one->step.d2h_bytes - grads / 2, 1e6);
  EXPECT_NEAR(host->step.d2h_bytes, one->step.d2h_bytes, 1e6);  // less: its half of the losses
  EXPECT_NEAR(two->step.reduce_seconds, grads / 2 / 300e9, 1e-3);
  EXPECT_EQ(host->step.reduce_seconds, 0);
  // Compute-bound: two devices take a little over half the time.
  EXPECT_LT(two->step.seconds, 0.6 * one->step.seconds);
  EXPECT_GT(two->step.seconds, 0.45 * one->step.seconds);
  // Host memory: sharded slabs add up to one device's (up to rounding to slabs); added on
  // the host, the second device cycles two layers' worth of slabs (fp32).
  const ModelLayout layout = BuildLayout(Qwen7B());
  const int64_t layer = layout.MaxDecoderElements();
  const int64_t slab = GradSlabElements(layout);
  EXPECT_LE(two->host_slab_bytes, one->host_slab_bytes + 4 * 2 * (slab / 2 + 64))
      << one->host_slab_bytes;
  EXPECT_EQ(host->host_slab_bytes,
            one->host_slab_bytes + 4 * slab * GradSlabsNeeded(layout, false));
  EXPECT_GE(4 * slab * GradSlabsNeeded(layout, false), 2 * 4 * layer);
  EXPECT_LT(4 * slab * GradSlabsNeeded(layout, false), 2 * 4 * (layer + slab));
  const std::string text = DescribePlan(*two, two_r, H200Like());
  for (const char* want : {"65536 tokens per step = 16 sequence(s)", "on each device",
                           "devices    2", "each drains 1/2 over its own PCIe link"}) {
    EXPECT_NE(text.find(want), std::string::npos) << want << "\n" << text;
  }
  // Every device an equal share, or a clear refusal.
  PlanRequest odd = one_r;
  odd.devices = 3;
  absl::StatusOr<Plan> refused = MakePlan(odd, H200Like(), &be);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("train.devices (3) must divide the step's 16 sequences"),
            std::string::npos)
      << refused.status();
}

}  // namespace
}  // namespace megatrain
