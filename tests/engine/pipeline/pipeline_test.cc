// The streaming pipeline computes the same gradients as the layers run directly, for any
// recompute interval and any split of the step into micro-batches.
#include "engine/pipeline/pipeline.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "gtest/gtest.h"
#include "engine/model/freeze.h"
#include "engine/store/model_io.h"
#include "engine/transfer/weight_slots.h"
#include "tests/engine/pipeline/direct_model.h"
#include "tests/engine/pipeline/preference_batch.h"
#include "tests/engine/pipeline/recording_sink.h"
#include "tests/engine/pipeline/sgd_sink.h"
#include "engine/backend/forwarding_backend.h"

namespace megatrain::testing {
namespace {

struct Harness {
  Harness(const ModelConfig& c, int64_t micro_batches, int64_t tokens, int64_t k,
          bool host_checkpoints = false, int64_t weight_slots = 0, int64_t kept_layers = 0,
          int64_t slab_elements = 0, int64_t mlp_tile = 0,
          std::unique_ptr<Backend> backend = nullptr,
          const std::vector<std::string>& freeze = {}) {
    be = backend != nullptr ? std::move(backend) : CreateCpuBackend(CpuBackendOptions{});
    ModelLayout layout = BuildLayout(c);
    EXPECT_TRUE(FreezeTensors(freeze, &layout).ok());
    PipelineOptions o;
    o.micro_batches = micro_batches;
    o.tokens_per_micro_batch = tokens;
    o.checkpoint_every = k;
    o.loss_chunk_tokens = 7;
    o.checkpoints_on_host = host_checkpoints;
    o.weight_slots = weight_slots;
    o.kept_layers = kept_layers;
    o.mlp_tile_tokens = mlp_tile;
    Build(c, layout, o, slab_elements);
  }
  // A pipeline of `o` over c's randomly drawn store, on the f32 CPU backend.
  Harness(const ModelConfig& c, const PipelineOptions& o) {
    be = CreateCpuBackend(CpuBackendOptions{});
    Build(c, BuildLayout(c), o, 0);
  }
  void Build(const ModelConfig& c, const ModelLayout& layout, const PipelineOptions& o,
             int64_t slab_elements) {
    store = std::move(*HostStore::Create(layout));
    RandomInitWeights(c, 11, store.get());
    int64_t max_unit = 0;
    for (const UnitLayout& u : store->layout().units) max_unit = std::max(max_unit, u.num_elements);
    pool = std::move(*GradSlabPool::Create(2, slab_elements > 0 ? slab_elements : max_unit));
    options = o;
    absl::StatusOr<std::unique_ptr<Pipeline>> p =
        Pipeline::Create(c, store.get(), pool.get(), be.get(), o);
    EXPECT_TRUE(p.ok()) << p.status();
    if (p.ok()) pipeline = *std::move(p);
  }
  StepResult Run(const std::vector<MicroBatch>& batches, RecordingSink* sink) {
    absl::StatusOr<StepResult> r = pipeline->Step(batches, sink);
    EXPECT_TRUE(r.ok()) << r.status();
    return *r;
  }
  std::unique_ptr<Backend> be;
  std::unique_ptr<HostStore> store;
  std::unique_ptr<GradSlabPool> pool;
  std::unique_ptr<Pipeline> pipeline;
  PipelineOptions options;
};

double MaxAbs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

TEST(Pipeline, GradientsMatchTheLayersRunDirectlyInDouble) {
  for (Variant variant : {Variant::kQwen2UntiedBias, Variant::kQwen3MoeMixedLayers,
                          Variant::kMixtralRenormalised}) {
    const ModelConfig c = TinyConfig(variant);
    Harness h(c, 1, 24, 2);
    const MicroBatch b = RandomBatch(2, 12, c.vocab_size, 5);
    RecordingSink sink(h.be.get(), h.pool.get(), h.store->num_units());
    const StepResult r = h.Run({b}, &sink);

    std::unique_ptr<Backend> f64 =
        CreateCpuBackend(CpuBackendOptions{CpuBackendOptions::Precision::kF64});
    DirectModel direct(c, f64.get(), 24);
    for (int64_t u = 0; u < h.store->num_units(); ++u) {
      for (int64_t i = 0; i < h.store->unit_elements(u); ++i) {
        direct.Set(u, i, Bf16ToFloat(h.store->weights(u)[i]));  // what the device saw
      }
    }
    std::vector<std::vector<double>> want;
    const double loss = direct.Run(b, &want);
    const std::string name = ArchitectureModelType(c.architecture);
    EXPECT_NEAR(r.loss + r.aux_loss_coef * r.aux_loss, loss, 1e-5 * loss) << name;
    EXPECT_NEAR(r.aux_loss, direct.last_aux_loss(), 1e-5 * direct.last_aux_loss()) << name;
    if (c.is_moe()) {
      EXPECT_GT(r.aux_loss, 0.9) << name;  // E * sum f p: 1 when perfectly balanced
      EXPECT_EQ(r.aux_loss_coef, c.moe.router_aux_loss_coef) << name;
    }
    EXPECT_EQ(r.num_targets, b.num_targets());
    for (int64_t u = 0; u < h.store->num_units(); ++u) {
      const double scale = MaxAbs(sink.grads[u]);
      ASSERT_GT(scale, 0) << name << " unit " << u << " got no gradient";
      for (int64_t i = 0; i < h.store->unit_elements(u); ++i) {
        ASSERT_NEAR(sink.grads[u][i], want[u][i], 1e-4 * scale)
            << name << " unit " << u << " element " << i;
      }
    }
  }
}

// A DPO step through the pipeline (two micro-batches of two pairs each, checkpoints every
// second layer, the head's chunks across pairs) gives the gradients of the layers run
// directly on each micro-batch, summed, and every token's value (the pair metrics' input).
TEST(Pipeline, PreferenceStepMatchesTheLayersRunDirectlyOnEachMicroBatch) {
  const ModelConfig c = TinyConfig(Variant::kQwen2UntiedBias);
  PipelineOptions o;
  o.micro_batches = 2;
  o.tokens_per_micro_batch = 24;
  o.checkpoint_every = 2;
  o.loss_chunk_tokens = 7;
  o.objective.kind = ObjectiveKind::kPreference;
  o.objective.preference_loss = PreferenceLoss::kSigmoid;
  o.objective.beta = 0.2;
  o.objective.label_smoothing = 0.1;
  Harness h(c, o);
  ASSERT_NE(h.pipeline, nullptr);
  Backend* be = h.be.get();
  HostStore* store = h.store.get();
  GradSlabPool* pool = h.pool.get();
  Pipeline* p = h.pipeline.get();

  std::vector<PairBatch> pairs = {TwoPackedPairs(c.vocab_size, 0),
                                  TwoPackedPairs(c.vocab_size, 17)};
  const double chosen_tokens = static_cast<double>(ChosenTokens(pairs[0]) + ChosenTokens(pairs[1]));
  AttachSequences({-9.5, -7.0, -11.0, -12.5}, 0.25, 0.4 / chosen_tokens, &pairs[0]);
  AttachSequences({-8.0, -9.0, -10.0, -6.5}, 0.25, 0.4 / chosen_tokens, &pairs[1]);
  RecordingSink sink(be, pool, store->num_units());
  absl::StatusOr<StepResult> r = p->Step({pairs[0].batch, pairs[1].batch}, &sink);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->token_values.size(), 48u);

  std::unique_ptr<Backend> f64 =
      CreateCpuBackend(CpuBackendOptions{CpuBackendOptions::Precision::kF64});
  DirectModel direct(c, f64.get(), 24, BuildLayout(c), o.objective);
  for (int64_t u = 0; u < store->num_units(); ++u) {
    for (int64_t i = 0; i < store->unit_elements(u); ++i) {
      direct.Set(u, i, Bf16ToFloat(store->weights(u)[i]));  // what the device saw
    }
  }
  std::vector<std::vector<double>> want(store->num_units());
  for (int m = 0; m < 2; ++m) {
    std::vector<std::vector<double>> grads;
    direct.Run(pairs[m].batch, &grads);
    for (int64_t i = 0; i < 24; ++i) {
      EXPECT_NEAR(r->token_values[m * 24 + i], direct.last_token_values()[i], 1e-5)
          << "micro-batch " << m << " token " << i;
    }
    for (int64_t u = 0; u < store->num_units(); ++u) {
      want[u].resize(grads[u].size());
      for (size_t i = 0; i < grads[u].size(); ++i) want[u][i] += grads[u][i];
    }
  }
  for (int64_t u = 0; u < store->num_units(); ++u) {
    const double scale = MaxAbs(sink.grads[u]);
    ASSERT_GT(scale, 0) << "unit " << u << " got no gradient";
    for (int64_t i = 0; i < store->unit_elements(u); ++i) {
      ASSERT_NEAR(sink.grads[u][i], want[u][i], 1e-4 * scale) << "unit " << u << " element " << i;
    }
  }
}

// A preference step's micro-batch must carry its sequences: one without them, or naming a
// sequence it lacks, is refused before anything runs.
TEST(Pipeline, PreferenceStepRefusesMicroBatchesWithoutTheirSequences) {
  const ModelConfig c = TinyConfig(Variant::kQwen2UntiedBias);
  PipelineOptions o;
  o.tokens_per_micro_batch = 24;
  o.objective.kind = ObjectiveKind::kPreference;
  Harness h(c, o);
  ASSERT_NE(h.pipeline, nullptr);
  PairBatch b = TwoPackedPairs(c.vocab_size, 0);
  RecordingSink sink(h.be.get(), h.pool.get(), h.store->num_units());
  absl::StatusOr<StepResult> r = h.pipeline->Step({b.batch}, &sink);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  AttachSequences({0, 0, 0, 0}, 0.5, 0, &b);
  b.batch.sequence[5] = 4;  // pairs 0 and 1 only: sequences 0..3
  r = h.pipeline->Step({b.batch}, &sink);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("names sequence 4"), std::string::npos) << r.status();
}

bool IsMatrix(TensorRole r) {
  switch (r) {
    case TensorRole::kQ: case TensorRole::kK: case TensorRole::kV: case TensorRole::kOProj:
    case TensorRole::kGate: case TensorRole::kUp: case TensorRole::kDown:
    case TensorRole::kRouter: case TensorRole::kExpertGate: case TensorRole::kExpertUp:
    case TensorRole::kExpertDown: case TensorRole::kExpertGateUpT: case TensorRole::kExpertDownT:
    case TensorRole::kLmHead: case TensorRole::kEmbedding:
      return true;
    default:
      return false;
  }
}

// Frozen tensors: a unit drains the range of its trainable tensors alone (nothing when it
// has none), a frozen matrix's gradient is never computed (zero where it lies inside that
// range), and every trainable tensor's gradient is the same bits as without the freeze.
TEST(Pipeline, FrozenTensorsDrainNoGradientAndChangeNoOtherBit) {
  const std::vector<std::pair<Variant, std::vector<std::string>>> cases = {
      {Variant::kQwen2UntiedBias, {"layers.0", "layers.1.mlp", "embed_tokens"}},
      {Variant::kQwen3MoeMixedLayers, {"layers.0.self_attn", "router", "lm_head"}},
      {Variant::kGptOssSinksWindow, {"mlp.experts", "layers.1"}},
  };
  for (const auto& [variant, freeze] : cases) {
    const ModelConfig c = TinyConfig(variant);
    const std::string name = ArchitectureModelType(c.architecture);
    const MicroBatch b = RandomBatch(2, 12, c.vocab_size, 5);
    std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
    std::vector<std::vector<float>> grads[2];
    ModelLayout layout = BuildLayout(c);
    for (const bool frozen : {false, true}) {
      if (frozen) {
        ASSERT_TRUE(FreezeTensors(freeze, &layout).ok()) << name;
      }
      std::unique_ptr<HostStore> store = std::move(*HostStore::Create(layout));
      RandomInitWeights(c, 11, store.get());
      std::unique_ptr<GradSlabPool> pool =
          std::move(*GradSlabPool::Create(2, layout.units[0].num_elements));
      PipelineOptions o;
      o.micro_batches = 1;
      o.tokens_per_micro_batch = 24;
      o.checkpoint_every = 2;
      o.loss_chunk_tokens = 7;
      absl::StatusOr<std::unique_ptr<Pipeline>> p =
          Pipeline::Create(c, store.get(), pool.get(), be.get(), o);
      ASSERT_TRUE(p.ok()) << p.status();
      RecordingSink sink(be.get(), pool.get(), store->num_units());
      ASSERT_TRUE((*p)->Step({b}, &sink).ok()) << name;
      for (int64_t u = 0; u < store->num_units() && frozen; ++u) {
        EXPECT_LE(static_cast<int64_t>(sink.grads[u].size()),
                  store->state_begin(u) + store->state_elements(u))
            << name << " unit " << u << " drained frozen tensors";
      }
      grads[frozen] = std::move(sink.grads);
    }
    int frozen_matrices = 0;
    for (int64_t u = 0; u < static_cast<int64_t>(layout.units.size()); ++u) {
      for (const TensorSlot& t : layout.units[u].tensors) {
        const std::vector<float>& g = grads[1][u];
        const int64_t end = std::min<int64_t>(t.offset + t.num_elements, g.size());
        if (t.trainable) {
          ASSERT_GE(static_cast<int64_t>(g.size()), t.offset + t.num_elements) << t.name;
          EXPECT_TRUE(std::equal(g.begin() + t.offset, g.begin() + end,
                                 grads[0][u].begin() + t.offset))
              << name << ": " << t.name << " changed";
        } else if (IsMatrix(t.role)) {
          ++frozen_matrices;
          for (int64_t i = t.offset; i < end; ++i) {
            ASSERT_EQ(g[i], 0.0f) << name << ": " << t.name << " got a gradient";
          }
        }
      }
    }
    EXPECT_GE(frozen_matrices, 3) << name;
  }
}

TEST(Pipeline, GradientsAreHandedOverInBackwardOrder) {
  const ModelConfig c = TinyConfig(Variant::kLlamaTiedGqa);
  Harness h(c, 1, 12, 1);
  RecordingSink sink(h.be.get(), h.pool.get(), h.store->num_units());
  h.Run({RandomBatch(1, 12, c.vocab_size, 1)}, &sink);
  // head, layers top-down, embedding last.
  const std::vector<int64_t> want = {4, 3, 2, 1, 0};
  EXPECT_EQ(sink.order, want);
}

// A layer's gradient drain is enqueued after the next layer's backward: the drain can
// block the pipeline's thread on gradient slabs the optimizer still holds, and the device
// must have that backward queued meanwhile (on the H200 it idled 57-80 ms a layer).
// Spans are recorded in the order the thread enqueues them.
TEST(Pipeline, TheNextBackwardIsQueuedBeforeALayersGradientDrains) {
  for (int64_t k : {1, 3}) {
    const ModelConfig c = TinyConfig(Variant::kQwen2UntiedBias);
    Harness h(c, 2, 10, k);
    PipelineOptions o = h.options;
    o.record_timeline = true;
    absl::StatusOr<std::unique_ptr<Pipeline>> p =
        Pipeline::Create(c, h.store.get(), h.pool.get(), h.be.get(), o);
    ASSERT_TRUE(p.ok()) << p.status();
    RecordingSink sink(h.be.get(), h.pool.get(), h.store->num_units());
    absl::StatusOr<StepResult> r = (*p)->Step(
        {RandomBatch(1, 10, c.vocab_size, 1), RandomBatch(1, 10, c.vocab_size, 2)}, &sink);
    ASSERT_TRUE(r.ok()) << r.status();
    auto index = [&](const std::string& label) {
      for (size_t i = 0; i < r->timeline.size(); ++i) {
        if (r->timeline[i].label == label) return static_cast<int64_t>(i);
      }
      ADD_FAILURE() << "no span " << label;
      return int64_t{-1};
    };
    const ModelLayout layout = BuildLayout(c);
    // The head's gradient, then each layer's but the lowest, after the layer below's
    // backward; layer 0's after the embedding's backward is queued, before its drain.
    EXPECT_GT(index("d2h g " + std::to_string(layout.HeadUnit())),
              index("bwd " + std::to_string(c.num_layers - 1)))
        << "K=" << k;
    for (int64_t l = 1; l < c.num_layers; ++l) {
      EXPECT_GT(index("d2h g " + std::to_string(layout.DecoderUnit(l))),
                index("bwd " + std::to_string(l - 1)))
          << "K=" << k << " layer " << l;
    }
    EXPECT_LT(index("d2h g " + std::to_string(layout.DecoderUnit(0))),
              index("d2h g " + std::to_string(ModelLayout::EmbeddingUnit())));
  }
}

TEST(Pipeline, RecomputeIntervalAndCheckpointPlacementDoNotChangeAnyBit) {
 for (Variant variant : {Variant::kQwen3QkNorm, Variant::kQwen3MoeMixedLayers}) {
  const ModelConfig c = TinyConfig(variant);
  const std::vector<MicroBatch> batches = {RandomBatch(1, 10, c.vocab_size, 1),
                                           RandomBatch(1, 10, c.vocab_size, 2)};
  std::vector<std::vector<float>> reference;
  double reference_loss = 0;
  for (int64_t k : {1, 2, 3, -1, -2, -3}) {  // negative: checkpoints kept on the host
    Harness h(c, 2, 10, std::abs(k), k < 0);
    RecordingSink sink(h.be.get(), h.pool.get(), h.store->num_units());
    const StepResult r = h.Run(batches, &sink);
    if (k == 1) {  // the reference: K=1, checkpoints on the device
      reference = sink.grads;
      reference_loss = r.loss;
      continue;
    }
    EXPECT_EQ(r.loss, reference_loss) << "K=" << k;
    for (size_t u = 0; u < reference.size(); ++u) {
      EXPECT_EQ(sink.grads[u], reference[u]) << "K=" << k << " unit " << u;
    }
  }
 }
}

// Sequence tiling: the MLP half over tiles of 7 of a micro-batch's 24 tokens (the last
// tile 3), recomputed in the backward, gives the untiled step's loss and gradients: the
// rows are computed alike, and only the weight gradients' sums are split by tile. With K
// of 1 and 2, and with every layer kept (its attention half only, then). The tiled
// workspace is smaller.
TEST(Pipeline, SequenceTiledMlpMatchesTheUntiledStep) {
  for (Variant variant : {Variant::kQwen2UntiedBias, Variant::kQwen3QkNorm}) {
    const ModelConfig c = TinyConfig(variant);
    const std::vector<MicroBatch> batches = {RandomBatch(2, 12, c.vocab_size, 3),
                                             RandomBatch(2, 12, c.vocab_size, 4)};
    for (const auto& [k, kept] : {std::pair<int64_t, int64_t>{1, 0}, {2, 0}, {1, c.num_layers}}) {
      SCOPED_TRACE(::testing::Message() << ArchitectureModelType(c.architecture) << " K=" << k
                                        << " kept=" << kept);
      Harness whole(c, 2, 24, k, false, 0, kept);
      Harness tiled(c, 2, 24, k, false, 0, kept, 0, /*mlp_tile=*/7);
      RecordingSink a(whole.be.get(), whole.pool.get(), whole.store->num_units());
      RecordingSink b(tiled.be.get(), tiled.pool.get(), tiled.store->num_units());
      const StepResult ra = whole.Run(batches, &a);
      const StepResult rb = tiled.Run(batches, &b);
      EXPECT_NEAR(rb.loss, ra.loss, 1e-6 * ra.loss);
      for (size_t u = 0; u < a.grads.size(); ++u) {
        const double scale = MaxAbs(a.grads[u]);
        ASSERT_GT(scale, 0) << "unit " << u;
        for (size_t i = 0; i < a.grads[u].size(); ++i) {
          ASSERT_NEAR(b.grads[u][i], a.grads[u][i], 1e-5 * scale) << "unit " << u << " at " << i;
        }
      }
    }
    PipelineOptions o;
    o.tokens_per_micro_batch = 24;
    const ModelLayout layout = BuildLayout(c);
    std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
    const int64_t untiled = StepDeviceBytes(c, layout, be.get(), o);
    o.mlp_tile_tokens = 7;
    EXPECT_LT(StepDeviceBytes(c, layout, be.get(), o), untiled);
  }
}

TEST(Pipeline, ResidentLayersSkipTheBackwardUploadAndChangeNoBit) {
  const ModelConfig c = TinyConfig(Variant::kQwen3QkNorm);
  const std::vector<MicroBatch> batches = {RandomBatch(1, 10, c.vocab_size, 1)};
  Harness streamed(c, 1, 10, 1);
  Harness resident(c, 1, 10, 1, false, c.num_layers);
  RecordingSink a(streamed.be.get(), streamed.pool.get(), streamed.store->num_units());
  RecordingSink b(resident.be.get(), resident.pool.get(), resident.store->num_units());
  const StepResult ra = streamed.Run(batches, &a);
  const StepResult rb = resident.Run(batches, &b);
  EXPECT_EQ(ra.loss, rb.loss);
  for (size_t u = 0; u < a.grads.size(); ++u) EXPECT_EQ(a.grads[u], b.grads[u]) << "unit " << u;
  // Two slots: backward finds the top two layers still loaded and re-uploads the rest.
  const int64_t layer_bytes = 2 * streamed.store->layout().MaxDecoderElements();  // bf16
  EXPECT_EQ(ra.h2d_bytes - rb.h2d_bytes, (c.num_layers - 2) * layer_bytes);
  EXPECT_EQ(NumWeightSlots(c, resident.options), c.num_layers);
}

// Frozen tensors cross once: a resident layer's slot gets only its state range again (what
// the optimizer changes), a frozen embedding nothing; the steps are the bits of a run that
// streams every layer whole.
TEST(Pipeline, FrozenPartsOfResidentLayersCrossOnceAndChangeNoBit) {
  const ModelConfig c = TinyConfig(Variant::kQwen2UntiedBias);
  const std::vector<MicroBatch> batches = {RandomBatch(1, 10, c.vocab_size, 3)};
  const std::vector<std::string> freeze = {"layers.0", "layers.1.mlp", "embed_tokens"};
  Harness streamed(c, 1, 10, 1, false, 1, 0, 0, 0, nullptr, freeze);
  Harness resident(c, 1, 10, 1, false, c.num_layers, 0, 0, 0, nullptr, freeze);
  Harness trained(c, 1, 10, 1, false, c.num_layers);  // nothing frozen
  SgdSink a(streamed.be.get(), streamed.pool.get(), streamed.store.get(), true);
  SgdSink b(resident.be.get(), resident.pool.get(), resident.store.get(), true);
  SgdSink d(trained.be.get(), trained.pool.get(), trained.store.get(), true);
  int64_t frozen_bytes = 0;  // what the resident run need not send again
  const HostStore& store = *resident.store;
  for (int64_t u = 0; u < store.num_units(); ++u) {
    frozen_bytes += 2 * (store.unit_elements(u) - store.state_elements(u));
  }
  for (int step = 0; step < 3; ++step) {
    const StepResult ra = streamed.Run(batches, &a);
    const StepResult rb = resident.Run(batches, &b);
    const StepResult rd = trained.Run(batches, &d);
    EXPECT_EQ(ra.loss, rb.loss) << "step " << step;
    for (size_t u = 0; u < a.grads.size(); ++u) {
      EXPECT_EQ(a.grads[u], b.grads[u]) << "step " << step << " unit " << u;
    }
    if (step > 0) {
      EXPECT_EQ(rd.h2d_bytes - rb.h2d_bytes, frozen_bytes) << "step " << step;
    }
  }
  EXPECT_GT(frozen_bytes, 2 * store.unit_elements(ModelLayout::EmbeddingUnit()));
}

TEST(Pipeline, LayersUpdatedDuringBackwardAreUploadedEarlyAndChangeNoBit) {
  const ModelConfig c = TinyConfig(Variant::kQwen2UntiedBias);
  const std::vector<MicroBatch> batches = {RandomBatch(1, 10, c.vocab_size, 3)};
  struct Case {
    int64_t slots;
    bool at_submit;
  };
  std::vector<std::vector<StepResult>> results;
  for (const Case& k : {Case{0, true}, Case{c.num_layers, false}, Case{c.num_layers, true}}) {
    Harness h(c, 1, 10, 1, false, k.slots);
    SgdSink sink(h.be.get(), h.pool.get(), h.store.get(), k.at_submit);
    results.emplace_back();
    for (int step = 0; step < 3; ++step) results.back().push_back(h.Run(batches, &sink));
  }
  for (int step = 0; step < 3; ++step) {
    // The same weights reach every forward, whenever they were uploaded.
    EXPECT_EQ(results[1][step].loss, results[0][step].loss) << "step " << step;
    EXPECT_EQ(results[2][step].loss, results[0][step].loss) << "step " << step;
    if (step > 0) {
      EXPECT_NE(results[0][step].loss, results[0][step - 1].loss);
    }
    // Streamed slots are reused: nothing early. Resident slots: every layer whose update
    // is applied by the time its gradient is drained goes up during the backward, and no
    // other; past the first step (whose forward loaded them all) the bytes are the same.
    EXPECT_EQ(results[0][step].early_uploads, 0);
    EXPECT_EQ(results[1][step].early_uploads, 0);
    EXPECT_EQ(results[2][step].early_uploads, c.num_layers);
    if (step > 0) {
      EXPECT_EQ(results[2][step].h2d_bytes, results[1][step].h2d_bytes);
    }
  }
}

TEST(Pipeline, KeptActivationsSkipTheReforwardAndChangeNoBit) {
  // With QK-norm the unnormalised qkv is kept; without, it is not. Either way a kept layer
  // rebuilds h, h2 and a, and its gradients are the recomputed ones, bit for bit.
  for (Variant variant :
       {Variant::kQwen3QkNorm, Variant::kQwen2UntiedBias, Variant::kMixtralRenormalised}) {
    const ModelConfig c = TinyConfig(variant);
    const std::vector<MicroBatch> batches = {RandomBatch(1, 10, c.vocab_size, 1),
                                             RandomBatch(1, 10, c.vocab_size, 2)};
    std::vector<std::vector<float>> reference;
    double reference_loss = 0;
    for (int64_t kept = 0; kept <= c.num_layers; ++kept) {
      for (bool host : {false, true}) {
        Harness h(c, 2, 10, 1, host, 0, kept);
        RecordingSink sink(h.be.get(), h.pool.get(), h.store->num_units());
        const StepResult r = h.Run(batches, &sink);
        if (kept == 0 && !host) {
          reference = sink.grads;
          reference_loss = r.loss;
          continue;
        }
        EXPECT_EQ(r.loss, reference_loss) << "kept " << kept << " qk_norm " << c.qk_norm;
        for (size_t u = 0; u < reference.size(); ++u) {
          EXPECT_EQ(sink.grads[u], reference[u])
              << "kept " << kept << " unit " << u << " qk_norm " << c.qk_norm;
        }
      }
    }
  }
  {
    // What a kept layer holds per token: q, k, v, o, x2, gu and the stats, plus qkv only
    // with QK-norm; not h, h2 or a.
    std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
    for (Variant variant : {Variant::kQwen3QkNorm, Variant::kQwen2UntiedBias}) {
      const ModelConfig c = TinyConfig(variant);
      const ModelLayout layout = BuildLayout(c);
      const DecoderLayer layer(c, layout.units[layout.DecoderUnit(0)], be.get());
      const int64_t H = c.num_heads, KV = c.num_kv_heads, D = c.head_dim;
      const int64_t act = DTypeSize(be->act_dtype()), stat = DTypeSize(be->stat_dtype());
      int64_t per_token = act * ((2 * H + 2 * KV) * D + c.hidden_size + 2 * c.intermediate_size) +
                          stat * (2 + 2 * H + KV);
      if (c.qk_norm) per_token += act * (H + 2 * KV) * D;
      EXPECT_EQ(layer.SavedBytes(256), 256 * per_token) << "qk_norm " << c.qk_norm;
      EXPECT_LT(layer.SavedBytes(256), layer.WorkspaceBytes(256));  // 256: no rounding
    }
  }
  // Kept layers need K = 1.
  const ModelConfig c = TinyConfig(Variant::kQwen3QkNorm);
  std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
  std::unique_ptr<HostStore> store = std::move(*HostStore::Create(BuildLayout(c)));
  std::unique_ptr<GradSlabPool> pool =
      std::move(*GradSlabPool::Create(2, store->layout().TotalElements()));
  PipelineOptions o;
  o.tokens_per_micro_batch = 10;
  o.checkpoint_every = 2;
  o.kept_layers = 1;
  EXPECT_EQ(Pipeline::Create(c, store.get(), pool.get(), be.get(), o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Pipeline, GradientsInSlabSizedPiecesAreTheSame) {
  const ModelConfig c = TinyConfig(Variant::kQwen2UntiedBias);
  const std::vector<MicroBatch> batches = {RandomBatch(2, 10, c.vocab_size, 5)};
  Harness whole(c, 1, 20, 1);
  Harness pieces(c, 1, 20, 1, false, 0, 0, /*slab_elements=*/50);  // < every unit
  RecordingSink a(whole.be.get(), whole.pool.get(), whole.store->num_units());
  RecordingSink b(pieces.be.get(), pieces.pool.get(), pieces.store->num_units());
  ASSERT_GT(whole.store->unit_elements(0), 150);
  const StepResult ra = whole.Run(batches, &a);
  const StepResult rb = pieces.Run(batches, &b);
  EXPECT_EQ(ra.loss, rb.loss);
  EXPECT_EQ(ra.d2h_bytes, rb.d2h_bytes);
  for (size_t u = 0; u < a.grads.size(); ++u) EXPECT_EQ(a.grads[u], b.grads[u]) << "unit " << u;
  EXPECT_EQ(a.order, b.order);
}

// The planner's count (plan/step_memory.h) is what a pipeline allocates.
TEST(Pipeline, StepDeviceBytesIsWhatCreateAllocates) {
  const ModelConfig c = TinyConfig(Variant::kQwen2UntiedBias);
  for (int64_t k : {1, 2, 3}) {
    for (bool host : {false, true}) {
      for (int64_t slots : {int64_t{0}, c.num_layers}) {
        for (int64_t mb : {1, 3}) {
          Harness h(c, mb, 10, k, host, slots, k == 1 ? 2 : 0);
          EXPECT_EQ(StepDeviceBytes(c, h.store->layout(), h.be.get(), h.options),
                    h.pipeline->device_bytes())
              << "K=" << k << " host=" << host << " slots=" << slots << " M=" << mb;
        }
      }
    }
  }
}

TEST(Pipeline, FourMicroBatchesEqualOneBatchOfTheSameTokens) {
 // MoE: the load-balancing loss is over the step's tokens, whatever the split.
 for (Variant variant : {Variant::kLlama3RopeMha, Variant::kQwen3MoeMixedLayers}) {
  const ModelConfig c = TinyConfig(variant);
  std::vector<MicroBatch> parts;
  for (int i = 0; i < 4; ++i) parts.push_back(RandomBatch(1, 9, c.vocab_size, 40 + i));
  // Unequal target counts per micro-batch: a mean of means would differ.
  for (int i = 0; i < 4; ++i) parts[0].targets[i] = -100;

  Harness four(c, 4, 9, 2);
  RecordingSink sink4(four.be.get(), four.pool.get(), four.store->num_units());
  const StepResult r4 = four.Run(parts, &sink4);
  Harness one(c, 1, 36, 2);
  RecordingSink sink1(one.be.get(), one.pool.get(), one.store->num_units());
  const StepResult r1 = one.Run({Concat(parts)}, &sink1);

  EXPECT_EQ(r4.num_targets, r1.num_targets);
  EXPECT_NEAR(r4.loss, r1.loss, 1e-6 * r1.loss);
  EXPECT_NEAR(r4.aux_loss, r1.aux_loss, 1e-6 * r1.aux_loss);
  EXPECT_NEAR(r4.grad_norm, r1.grad_norm, 1e-5 * r1.grad_norm);
  for (size_t u = 0; u < sink1.grads.size(); ++u) {
    const double scale = MaxAbs(sink1.grads[u]);
    for (size_t i = 0; i < sink1.grads[u].size(); ++i) {
      ASSERT_NEAR(sink4.grads[u][i], sink1.grads[u][i], 1e-5 * scale) << "unit " << u;
    }
  }
 }
}

// The CPU backend, counting the waits for the experts' row offsets, and checking that every
// grouped matmul is given the host's copy of them, equal to the device's when it runs.
class RoutingProbe final : public ForwardingBackend {
 public:
  RoutingProbe() : ForwardingBackend(CreateCpuBackend(CpuBackendOptions{})) {}
  void ReadOffsets(int32_t* host, const int32_t* offsets, int64_t E, StreamId s) override {
    ++reads;
    ForwardingBackend::ReadOffsets(host, offsets, E, s);
  }
  void GroupedLinear(void* out, const void* in, const void* W, const void* bias,
                     const ExpertOffsets& offsets, int64_t E, int64_t IC, int64_t OC,
                     bool w_in_major, StreamId s) override {
    Check(offsets, E);
    ForwardingBackend::GroupedLinear(out, in, W, bias, offsets, E, IC, OC, w_in_major, s);
  }
  void GroupedLinearBackward(void* din, void* dW, void* dbias, const void* dout, const void* in,
                             const void* W, const ExpertOffsets& offsets, int64_t E, int64_t IC,
                             int64_t OC, bool w_in_major, StreamId s) override {
    Check(offsets, E);
    ForwardingBackend::GroupedLinearBackward(din, dW, dbias, dout, in, W, offsets, E, IC, OC,
                                             w_in_major, s);
  }
  int reads = 0, grouped_calls = 0, without_host = 0, stale = 0;

 private:
  void Check(const ExpertOffsets& offsets, int64_t E) {
    ++grouped_calls;
    if (offsets.host == nullptr) {
      ++without_host;
      return;
    }
    SyncAll();  // the sort that wrote the device's offsets has run
    if (!std::equal(offsets.host, offsets.host + E + 1, offsets.device)) ++stale;
  }
};

// An MoE layer waits for its routing once a step per micro-batch, in its forward; the
// recompute (K = 2) and the backward reuse the host's copy, which still equals the routing
// they compute. Dense layers among the MoE ones wait for nothing.
TEST(Pipeline, MoeLayersWaitForTheirRoutingOnceAStepAndReuseIt) {
  const ModelConfig c = TinyConfig(Variant::kQwen3MoeMixedLayers);
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) moe_layers += c.IsMoeLayer(l) ? 1 : 0;
  ASSERT_GT(moe_layers, 0);
  ASSERT_LT(moe_layers, c.num_layers);
  for (int64_t k : {1, 2}) {
    auto probe = std::make_unique<RoutingProbe>();
    RoutingProbe* seen = probe.get();
    const int64_t M = 3;
    Harness h(c, M, 9, k, false, 0, 0, 0, 0, std::move(probe));
    std::vector<MicroBatch> parts;
    for (int i = 0; i < M; ++i) parts.push_back(RandomBatch(1, 9, c.vocab_size, 60 + i));
    for (int step = 0; step < 2; ++step) {
      RecordingSink sink(h.be.get(), h.pool.get(), h.store->num_units());
      h.Run(parts, &sink);
    }
    EXPECT_EQ(seen->reads, 2 * moe_layers * M) << "K=" << k;
    // two steps of 2 forward and 2 backward grouped matmuls per MoE layer and micro-batch,
    // and those of the recomputes
    EXPECT_GE(seen->grouped_calls, 2 * 4 * moe_layers * M) << "K=" << k;
    EXPECT_EQ(seen->without_host, 0) << "K=" << k;
    EXPECT_EQ(seen->stale, 0) << "K=" << k;
  }
}

TEST(Pipeline, StepRejectsMicroBatchesThatDoNotMatchThePlan) {
  const ModelConfig c = TinyConfig(Variant::kLlamaTiedGqa);
  Harness h(c, 2, 8, 1);
  RecordingSink sink(h.be.get(), h.pool.get(), h.store->num_units());
  absl::StatusOr<StepResult> r = h.pipeline->Step({RandomBatch(1, 8, c.vocab_size, 1)}, &sink);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("micro-batches"), std::string::npos) << r.status();
}

// A sink that reports a fixed set of units updated.
class UpdatedUnitsSink final : public GradSink {
 public:
  void Submit(int64_t, float*, void*, int64_t, int64_t) override {}
  double Finish() override { return 0; }
  bool UnitUpdated(int64_t unit) override { return updated.count(unit) > 0; }
  std::set<int64_t> updated;
};

// With a slot per layer, a layer's next weights go up during the backward once its update
// is applied, whatever order the updates land in (with one device the optimizer takes the
// lowest layer queued, so a lower layer may be updated while a higher one is not), and the
// next step's forward finds them loaded.
TEST(WeightSlots, UploadsEachUpdatedLayerWhateverOrderTheUpdatesLandIn) {
  const ModelConfig c = TinyConfig(Variant::kQwen2UntiedBias);
  ASSERT_GE(c.num_layers, 3);
  std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
  std::unique_ptr<HostStore> store = std::move(*HostStore::Create(BuildLayout(c)));
  const ModelLayout& layout = store->layout();
  SpanRecorder spans(be.get(), false);
  WeightSlots slots(be.get(), store.get(), layout, c.num_layers, &spans);
  DeviceAllocator alloc(be.get());
  ASSERT_TRUE(slots.Allocate(&alloc).ok());
  UpdatedUnitsSink sink;
  slots.BeginStep(&sink);
  for (int64_t l = 0; l < c.num_layers; ++l) slots.EnsureLoaded(l);
  sink.updated = {layout.DecoderUnit(0), layout.DecoderUnit(1)};  // the top layer not yet
  slots.UploadUpdated(0);
  EXPECT_EQ(slots.early_uploads(), 2);
  for (int64_t l = 0; l < c.num_layers; ++l) sink.updated.insert(layout.DecoderUnit(l));
  slots.UploadUpdated(0);
  EXPECT_EQ(slots.early_uploads(), c.num_layers);
  const int64_t early_bytes = slots.h2d_bytes();
  UpdatedUnitsSink next;
  slots.BeginStep(&next);
  for (int64_t l = 0; l < c.num_layers; ++l) slots.EnsureLoaded(l);
  EXPECT_EQ(slots.h2d_bytes(), 0);  // each layer's slot holds its next weights
  EXPECT_GT(early_bytes, 0);
  be->SyncAll();
}

}  // namespace
}  // namespace megatrain::testing
