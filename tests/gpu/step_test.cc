// A whole training step on the GPU against the CPU backend: loss, every unit's gradient,
// the AdamW-updated weights; and the device working set does not grow with depth.
#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/data/pair_packer.h"
#include "engine/model/lora.h"
#include "engine/optim/host_optimizer.h"
#include "engine/pipeline/pipeline.h"
#include "engine/store/model_io.h"
#include "tests/engine/pipeline/recording_sink.h"
#include "tests/engine/pipeline/sgd_sink.h"
#include "tests/engine/pipeline/tiny_model.h"
#include "tests/gpu/gpu_util.h"

namespace megatrain::testing {
namespace {

ModelConfig StepConfig(Variant v, int64_t layers) {
  ModelConfig c = TinyConfig(v);
  c.hidden_size = 256;
  c.num_heads = 8;
  c.num_kv_heads = v == Variant::kLlama3RopeMha ? 8 : 2;
  c.head_dim = c.qk_norm ? 64 : 32;
  c.intermediate_size = 704;
  c.num_layers = layers;
  c.vocab_size = 1000;
  c.max_position_embeddings = 1024;
  if (c.is_moe()) c.moe.intermediate_size = 128;
  if (c.architecture == Architecture::kGptOss) {
    // GPT-OSS's own limit, windows of 16, and every token to every expert: the near-ties
    // of a random-init router put tokens on either side of a top-k boundary under bf16
    // (transformers' own bf16 autocast moves 2% of tokens, tests/hf); the boundary is
    // the other MoE variants' and the transformers comparison's to check.
    c.moe.swiglu_limit = 7.0;
    c.sliding_window = 16;
    c.sliding_layers = {true, false, true, false};
    c.moe.experts_per_token = c.moe.num_experts;
  }
  return c;
}

struct Trained {
  std::unique_ptr<HostStore> store;
  std::unique_ptr<GradSlabPool> pool;
  std::unique_ptr<Pipeline> pipeline;
};

// `lora`: adapters of that rank on every projection, an MoE model's experts too (B drawn
// too, so that each path counts).
Trained Make(const ModelConfig& c, Backend* be, int64_t micro_batches, int64_t tokens, int64_t k,
             int64_t kept_layers = 0, int64_t weight_slots = 0, int64_t mlp_tile = 0,
             int64_t lora = 0, const ObjectiveOptions& objective = {}) {
  Trained r;
  ModelLayout layout = BuildLayout(c);
  LoraConfig adapters;
  adapters.rank = lora;
  adapters.alpha = 2.0 * lora;
  if (c.is_moe()) {
    adapters.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj",
                               "experts.down_proj"};
  }
  if (lora > 0) {
    EXPECT_TRUE(AddLoraAdapters(adapters, c, &layout).ok());
  }
  r.store = std::move(*HostStore::Create(layout));
  RandomInitWeights(c, 5, r.store.get());
  InitLoraAdapters(LoraInit::kDefault, 6, r.store.get());
  for (int64_t u = 0; u < r.store->num_units(); ++u) {
    for (const TensorSlot& t : layout.units[u].tensors) {
      if (t.role != TensorRole::kLoraB) continue;
      std::vector<float> b(t.num_elements);
      for (size_t i = 0; i < b.size(); ++i) b[i] = 0.02f * static_cast<float>(int(i % 11) - 5);
      r.store->WriteTensor(u, t, b.data());
    }
  }
  int64_t max_unit = 0;
  for (const UnitLayout& u : r.store->layout().units) max_unit = std::max(max_unit, u.num_elements);
  r.pool = std::move(*GradSlabPool::Create(r.store->num_units(), max_unit));
  EXPECT_TRUE(be->PinHostRange(r.store->transfer_base(), r.store->transfer_bytes()).ok());
  EXPECT_TRUE(be->PinHostRange(r.pool->base(), r.pool->bytes()).ok());
  PipelineOptions o;
  o.micro_batches = micro_batches;
  o.tokens_per_micro_batch = tokens;
  o.checkpoint_every = k;
  o.loss_chunk_tokens = 100;
  o.checkpoints_on_host = be->kind() != BackendKind::kCpu;  // as the trainer runs on a GPU
  o.kept_layers = kept_layers;
  o.weight_slots = weight_slots;
  o.mlp_tile_tokens = mlp_tile;
  o.objective = objective;
  absl::StatusOr<std::unique_ptr<Pipeline>> p = Pipeline::Create(c, r.store.get(), r.pool.get(), be, o);
  EXPECT_TRUE(p.ok()) << p.status();
  r.pipeline = std::move(*p);
  return r;
}

// Undoes Make's pinning of t's store and slab pool on `be`.
void Unpin(Backend* be, const Trained& t) {
  be->UnpinHostRange(t.store->transfer_base());
  be->UnpinHostRange(t.pool->base());
}

// The GPU step's loss within 0.5% of the CPU's, and every unit's gradient within 3% (each
// unit's error recorded as a test property).
void ExpectMatchesCpu(const StepResult& gpu, const RecordingSink& gpu_sink, const StepResult& cpu,
                      const RecordingSink& cpu_sink) {
  EXPECT_NEAR(gpu.loss, cpu.loss, 5e-3 * cpu.loss);
  for (size_t u = 0; u < cpu_sink.grads.size(); ++u) {
    ASSERT_EQ(gpu_sink.grads[u].size(), cpu_sink.grads[u].size()) << "unit " << u;
    if (cpu_sink.grads[u].empty()) continue;  // frozen: nothing drained
    const double e = RelErr(gpu_sink.grads[u], cpu_sink.grads[u]);
    EXPECT_LT(e, 3e-2) << "unit " << u;
    ::testing::Test::RecordProperty("grad_rel_err_unit_" + std::to_string(u), std::to_string(e));
  }
}

// One step of `batches` through the CPU's pipeline and then the GPU's, each sink
// recording its gradients.
struct StepPair {
  std::unique_ptr<RecordingSink> cpu_sink, gpu_sink;
  absl::StatusOr<StepResult> cpu, gpu;
};
StepPair StepBoth(Backend* cpu, const Trained& cr, Backend* gpu, const Trained& gr,
                  const std::vector<MicroBatch>& batches) {
  StepPair s;
  s.cpu_sink = std::make_unique<RecordingSink>(cpu, cr.pool.get(), cr.store->num_units());
  s.cpu = cr.pipeline->Step(batches, s.cpu_sink.get());
  s.gpu_sink = std::make_unique<RecordingSink>(gpu, gr.pool.get(), gr.store->num_units());
  s.gpu = gr.pipeline->Step(batches, s.gpu_sink.get());
  return s;
}

// Qwen2 (q/k/v biases, untied) of 4 layers, two micro-batches of 2 x 64 tokens, and the
// CPU's step over them with a checkpoint every layer: what the GPU's memory choices must
// give.
struct CpuReference {
  ModelConfig config = StepConfig(Variant::kQwen2UntiedBias, 4);
  std::vector<MicroBatch> batches = {RandomBatch(2, 64, config.vocab_size, 3),
                                     RandomBatch(2, 64, config.vocab_size, 4)};
  Trained trained;
  std::unique_ptr<RecordingSink> sink;
  absl::StatusOr<StepResult> step;
};

CpuReference RunCpuReference(Backend* cpu) {
  CpuReference r;
  r.trained = Make(r.config, cpu, 2, 128, 1);
  r.sink = std::make_unique<RecordingSink>(cpu, r.trained.pool.get(), r.trained.store->num_units());
  r.step = r.trained.pipeline->Step(r.batches, r.sink.get());
  return r;
}

class Step : public GpuTest, public ::testing::WithParamInterface<Variant> {};

TEST_P(Step, GpuStepMatchesCpuLossGradientsAndUpdate) {
  const ModelConfig c = StepConfig(GetParam(), 4);
  std::vector<MicroBatch> batches = {RandomBatch(2, 64, c.vocab_size, 1),
                                     RandomBatch(2, 64, c.vocab_size, 2)};
  Trained cr = Make(c, cpu_.get(), 2, 128, 2);
  Trained gr = Make(c, gpu_.get(), 2, 128, 2);
  const StepPair s = StepBoth(cpu_.get(), cr, gpu_.get(), gr, batches);
  ASSERT_TRUE(s.cpu.ok() && s.gpu.ok());
  ExpectMatchesCpu(*s.gpu, *s.gpu_sink, *s.cpu, *s.cpu_sink);
  // One AdamW step from the same weights with each backend's gradients.
  HostOptimizerOptions oo;
  oo.weight_decay = 0.1;
  oo.max_grad_norm = 1.0;
  HostOptimizer copt(cr.store.get(), cr.pool.get(), cpu_.get(), oo);
  HostOptimizer gopt(gr.store.get(), gr.pool.get(), gpu_.get(), oo);
  copt.BeginStep(1e-3, 1);
  gopt.BeginStep(1e-3, 1);
  std::vector<float> before(cr.store->master(1), cr.store->master(1) + cr.store->unit_elements(1));
  ASSERT_TRUE(cr.pipeline->Step(batches, &copt).ok());
  ASSERT_TRUE(gr.pipeline->Step(batches, &gopt).ok());
  copt.Drain();
  gopt.Drain();
  for (int64_t u = 0; u < cr.store->num_units(); ++u) {
    std::vector<float> cu, gu;
    for (int64_t i = 0; i < cr.store->unit_elements(u); ++i) {
      cu.push_back(cr.store->master(u)[i]);
      gu.push_back(gr.store->master(u)[i]);
    }
    // bf16 gradients flip the sign of Adam's first step where |g| is tiny.
    EXPECT_LT(RelErr(gu, cu), 1e-2) << "updated weights of unit " << u;
  }
  // The update itself (Adam's first step is ~lr * sign(g): tiny gradients may flip).
  std::vector<float> du_c, du_g;
  for (int64_t i = 0; i < cr.store->unit_elements(1); ++i) {
    du_c.push_back(cr.store->master(1)[i] - before[i]);
    du_g.push_back(gr.store->master(1)[i] - before[i]);
  }
  EXPECT_LT(RelErr(du_g, du_c), 0.2);
  RecordProperty("update_rel_err_unit_1", std::to_string(RelErr(du_g, du_c)));
  cpu_->UnpinHostRange(cr.store->transfer_base());
  Unpin(gpu_.get(), gr);
}

// LoRA, rank 8, kept and streamed layers: on every projection (Qwen2: q/k/v biases,
// untied), and on the attention and experts (Qwen3-MoE with a dense layer; GPT-OSS's
// input-major experts): the adapters' gradients (all a unit drains) match the CPU's, and
// the frozen base drains nothing.
TEST_F(GpuTest, LoraStepMatchesTheCpuAndDrainsTheAdaptersAlone) {
  for (const Variant v : {Variant::kQwen2UntiedBias, Variant::kQwen3MoeMixedLayers,
                          Variant::kGptOssSinksWindow}) {
    const ModelConfig c = StepConfig(v, 4);
    SCOPED_TRACE(ArchitectureModelType(c.architecture));
    const std::vector<MicroBatch> batches = {RandomBatch(2, 64, c.vocab_size, 3),
                                             RandomBatch(2, 64, c.vocab_size, 4)};
    Trained cr = Make(c, cpu_.get(), 2, 128, 1, 0, 0, 0, /*lora=*/8);
    Trained gr = Make(c, gpu_.get(), 2, 128, 1, /*kept_layers=*/2, 0, 0, /*lora=*/8);
    const StepPair s = StepBoth(cpu_.get(), cr, gpu_.get(), gr, batches);
    ASSERT_TRUE(s.cpu.ok() && s.gpu.ok());
    ExpectMatchesCpu(*s.gpu, *s.gpu_sink, *s.cpu, *s.cpu_sink);
    EXPECT_TRUE(s.gpu_sink->grads[0].empty());  // the embedding: frozen
    const int64_t u1 = gr.store->layout().DecoderUnit(1);
    EXPECT_EQ(static_cast<int64_t>(s.gpu_sink->grads[u1].size()),
              gr.store->state_begin(u1) + gr.store->state_elements(u1));
    cpu_->UnpinHostRange(cr.store->transfer_base());
    Unpin(gpu_.get(), gr);
  }
}

// Micro-batches of preference pairs (random prompts of 4-15 tokens, completions of 8-40),
// packed `rows` x `seq_len` each, with reference log-probabilities and the step's weights
// (RPO on) attached.
std::vector<MicroBatch> RandomPairBatches(int64_t vocab, int64_t micro_batches, int64_t rows,
                                          int64_t seq_len) {
  std::mt19937 rng(9);
  auto draw = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<std::pair<PreferenceSequence, PreferenceSequence>> pairs;
  for (int k = 0; k < 64; ++k) {
    std::vector<int32_t> prompt(draw(4, 15));
    for (int32_t& id : prompt) id = draw(0, static_cast<int>(vocab) - 1);
    auto completion = [&] {
      PreferenceSequence s{prompt, std::vector<uint8_t>(prompt.size(), 0)};
      for (int j = draw(8, 40); j > 0; --j) {
        s.ids.push_back(draw(0, static_cast<int>(vocab) - 1));
        s.completion.push_back(1);
      }
      return s;
    };
    pairs.emplace_back(completion(), completion());
  }
  std::vector<PairBatch> packed(micro_batches);
  int64_t first = 0, total_pairs = 0, chosen_tokens = 0;
  for (PairBatch& b : packed) {
    first += PackPairs(pairs, first, rows, seq_len, 0, &b);
    total_pairs += b.pairs();
    for (int64_t k = 0; k < b.pairs(); ++k) chosen_tokens += b.completion_tokens[2 * k];
  }
  std::vector<MicroBatch> batches;
  for (PairBatch& b : packed) {
    std::vector<double> ref(2 * b.pairs());
    for (double& r : ref) r = -7.0 * draw(8, 40);  // about what a random model gives
    AttachSequences(ref, 1.0 / total_pairs, 0.2 / chosen_tokens, &b);
    batches.push_back(b.batch);
  }
  return batches;
}

// DPO on the GPU (the head's two sweeps, the coefficients on the device): every unit's
// gradient and every token's value match the CPU's, for each loss; and a step repeats bit
// for bit.
TEST_F(GpuTest, PreferenceStepMatchesTheCpuAndRepeatsBitForBit) {
  const ModelConfig c = StepConfig(Variant::kQwen2UntiedBias, 4);
  const std::vector<MicroBatch> batches = RandomPairBatches(c.vocab_size, 2, 2, 64);
  for (const PreferenceLoss loss :
       {PreferenceLoss::kSigmoid, PreferenceLoss::kIpo, PreferenceLoss::kHinge}) {
    SCOPED_TRACE(static_cast<int>(loss));
    ObjectiveOptions objective;
    objective.kind = ObjectiveKind::kPreference;
    objective.preference_loss = loss;
    objective.label_smoothing = loss == PreferenceLoss::kSigmoid ? 0.1 : 0.0;
    Trained cr = Make(c, cpu_.get(), 2, 128, 1, 0, 0, 0, 0, objective);
    Trained gr = Make(c, gpu_.get(), 2, 128, 1, 0, 0, 0, 0, objective);
    const StepPair s = StepBoth(cpu_.get(), cr, gpu_.get(), gr, batches);
    ASSERT_TRUE(s.cpu.ok() && s.gpu.ok());
    ExpectMatchesCpu(*s.gpu, *s.gpu_sink, *s.cpu, *s.cpu_sink);
    const std::vector<float> gv(s.gpu->token_values.begin(), s.gpu->token_values.end());
    const std::vector<float> cv(s.cpu->token_values.begin(), s.cpu->token_values.end());
    EXPECT_LT(RelErr(gv, cv), 5e-3);
    RecordingSink again(gpu_.get(), gr.pool.get(), gr.store->num_units());
    ASSERT_TRUE(gr.pipeline->Step(batches, &again).ok());
    for (size_t u = 0; u < again.grads.size(); ++u) {
      EXPECT_TRUE(s.gpu_sink->grads[u] == again.grads[u]) << "unit " << u << " differs run to run";
    }
    cpu_->UnpinHostRange(cr.store->transfer_base());
    Unpin(gpu_.get(), gr);
  }
}

// The planner's memory choices on a roomy GPU: kept activations (no re-forward) and a slot
// per layer (no backward upload) give the CPU's gradients.
TEST_F(GpuTest, KeptActivationsAndResidentWeightsMatchTheCpu) {
  const CpuReference cpu = RunCpuReference(cpu_.get());
  ASSERT_TRUE(cpu.step.ok()) << cpu.step.status();
  Trained gr = Make(cpu.config, gpu_.get(), 2, 128, 1, /*kept_layers=*/3, /*weight_slots=*/4);
  RecordingSink gs(gpu_.get(), gr.pool.get(), gr.store->num_units());
  absl::StatusOr<StepResult> gl = gr.pipeline->Step(cpu.batches, &gs);
  ASSERT_TRUE(gl.ok()) << gl.status();
  ExpectMatchesCpu(*gl, gs, *cpu.step, *cpu.sink);
  // Only the forward uploads each layer: less than the CPU pipeline's two slots do.
  EXPECT_LT(gl->h2d_bytes, cpu.step->h2d_bytes);
  Unpin(gpu_.get(), gr);
}

// Sequence tiling on the GPU: the MLP half over tiles of 48 of a micro-batch's 128 tokens
// (the last tile 32), recomputed in the backward, two layers keeping their attention half:
// the CPU's untiled loss and gradients, and the same bits on a second run.
TEST_F(GpuTest, SequenceTiledMlpMatchesTheCpuAndRepeatsBitForBit) {
  const CpuReference cpu = RunCpuReference(cpu_.get());
  ASSERT_TRUE(cpu.step.ok()) << cpu.step.status();
  std::vector<std::vector<float>> first;
  for (int run = 0; run < 2; ++run) {
    Trained gr = Make(cpu.config, gpu_.get(), 2, 128, 1, /*kept_layers=*/2, /*weight_slots=*/0,
                      /*mlp_tile=*/48);
    RecordingSink gs(gpu_.get(), gr.pool.get(), gr.store->num_units());
    absl::StatusOr<StepResult> gl = gr.pipeline->Step(cpu.batches, &gs);
    ASSERT_TRUE(gl.ok()) << gl.status();
    ExpectMatchesCpu(*gl, gs, *cpu.step, *cpu.sink);
    if (run == 0) {
      first = gs.grads;
    } else {
      for (size_t u = 0; u < first.size(); ++u) EXPECT_EQ(gs.grads[u], first[u]) << "unit " << u;
    }
    Unpin(gpu_.get(), gr);
  }
}

// Resident slots on the GPU: each layer's next weights go up during the backward once the
// sink has applied its update (Pipeline::UploadUpdated); three steps give the same losses,
// bit for bit, as streaming the layers from two slots.
TEST_F(GpuTest, EarlyUploadsChangeNoBitOfThreeSteps) {
  const ModelConfig c = StepConfig(Variant::kQwen2UntiedBias, 4);
  const std::vector<MicroBatch> batches = {RandomBatch(2, 64, c.vocab_size, 5)};
  std::vector<std::vector<StepResult>> runs;
  for (const int64_t slots : {int64_t{0}, c.num_layers}) {
    Trained t = Make(c, gpu_.get(), 1, 128, 1, 0, slots);
    SgdSink sink(gpu_.get(), t.pool.get(), t.store.get(), /*at_submit=*/true);
    runs.emplace_back();
    for (int step = 0; step < 3; ++step) {
      absl::StatusOr<StepResult> r = t.pipeline->Step(batches, &sink);
      ASSERT_TRUE(r.ok()) << r.status();
      runs.back().push_back(*r);
    }
    Unpin(gpu_.get(), t);
  }
  for (int step = 0; step < 3; ++step) {
    EXPECT_EQ(runs[1][step].loss, runs[0][step].loss) << "step " << step;
    EXPECT_EQ(runs[0][step].early_uploads, 0);
    EXPECT_EQ(runs[1][step].early_uploads, c.num_layers);
  }
  EXPECT_LT(runs[0][2].loss, runs[0][0].loss);  // SGD on one batch: it learns
}

// The same step twice gives the same gradients, bit for bit: no kernel of a step adds with
// atomics in an order that varies. Four token ids over 2 x 1024 positions make long runs
// in the embedding backward; the Qwen2 variant has biases, the Llama one a tied embedding.
TEST_P(Step, GradientsAreTheSameBitsOnEveryRun) {
  const ModelConfig c = StepConfig(GetParam(), 2);
  const std::vector<MicroBatch> batches = {RandomBatch(2, 512, 4, 6), RandomBatch(2, 512, 4, 7)};
  Trained t = Make(c, gpu_.get(), 2, 1024, 1);
  std::vector<std::vector<std::vector<float>>> grads;
  for (int run = 0; run < 3; ++run) {
    RecordingSink sink(gpu_.get(), t.pool.get(), t.store->num_units());
    absl::StatusOr<StepResult> r = t.pipeline->Step(batches, &sink);
    ASSERT_TRUE(r.ok()) << r.status();
    grads.push_back(sink.grads);
  }
  for (int run = 1; run < 3; ++run) {
    for (int64_t u = 0; u < t.store->num_units(); ++u) {
      EXPECT_TRUE(grads[run][u] == grads[0][u]) << "run " << run << ", unit " << u;
    }
  }
  Unpin(gpu_.get(), t);
}

INSTANTIATE_TEST_SUITE_P(Variants, Step,
                         ::testing::Values(Variant::kLlamaTiedGqa, Variant::kQwen2UntiedBias,
                                           Variant::kQwen3QkNorm, Variant::kLlama3RopeMha,
                                           Variant::kQwen3MoeMixedLayers,
                                           Variant::kMixtralRenormalised,
                                           Variant::kGptOssSinksWindow),
                         VariantName<::testing::TestParamInfo<Variant>>);

class DeviceMemory : public GpuTest {};

TEST_F(DeviceMemory, PeakDoesNotGrowWithDepth) {
  std::vector<int64_t> peaks;
  for (int64_t layers : {8, 16, 32}) {
    absl::StatusOr<std::unique_ptr<Backend>> be = CreateBackend(BackendRequest{"cuda"});
    ASSERT_TRUE(be.ok());
    ModelConfig c = StepConfig(Variant::kLlamaTiedGqa, layers);
    c.hidden_size = 1024;
    c.intermediate_size = 2816;
    c.num_heads = 16;
    c.num_kv_heads = 4;
    c.head_dim = 64;
    Trained r = Make(c, be->get(), 2, 1024, 1);
    RecordingSink s(be->get(), r.pool.get(), r.store->num_units());
    std::vector<MicroBatch> batches = {RandomBatch(2, 512, c.vocab_size, 1),
                                       RandomBatch(2, 512, c.vocab_size, 2)};
    ASSERT_TRUE(r.pipeline->Step(batches, &s).ok());
    peaks.push_back((*be)->device_bytes_peak());
    RecordProperty("peak_bytes_" + std::to_string(layers), std::to_string(peaks.back()));
    std::printf("layers %lld: peak device memory %.1f MiB\n", static_cast<long long>(layers),
                peaks.back() / 1048576.0);
    Unpin(be->get(), r);
  }
  const int64_t lo = *std::min_element(peaks.begin(), peaks.end());
  const int64_t hi = *std::max_element(peaks.begin(), peaks.end());
  EXPECT_LT(double(hi - lo) / lo, 0.05);
}

}  // namespace
}  // namespace megatrain::testing
