// The host optimizer applies PyTorch AdamW (decoupled weight decay on matrices only,
// bias correction, eps outside the sqrt) after global-norm clipping, with a warmup
// schedule, and matches a closed-form double-precision reference over several steps.
#include "engine/optim/host_optimizer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <cstring>
#include <random>

#include "gtest/gtest.h"
#include "engine/optim/held_gradients.h"
#include "engine/optim/schedule.h"
#include "engine/store/model_io.h"
#include "tests/engine/pipeline/tiny_model.h"

namespace megatrain::testing {
namespace {

struct Reference {
  std::vector<std::vector<double>> p, m, v;
};

// The tiny model's host store, seeded.
std::unique_ptr<HostStore> TinyStore() {
  const ModelConfig c = TinyConfig(Variant::kQwen2UntiedBias);
  std::unique_ptr<HostStore> store = std::move(*HostStore::Create(BuildLayout(c)));
  RandomInitWeights(c, 3, store.get());
  return store;
}

// The pieces of `piece` elements the store's units arrive in, all together.
int64_t CountPieces(const HostStore& store, int64_t piece) {
  int64_t pieces = 0;
  for (int64_t u = 0; u < store.num_units(); ++u) {
    pieces += (store.unit_elements(u) + piece - 1) / piece;
  }
  return pieces;
}

// Submits one step of seeded normal gradients in backward order (as the pipeline does), in
// pieces of `piece` elements, each ready once the D2H stream passes its event; after_each
// runs after each piece's Submit.
void SubmitRandomStep(HostOptimizer& opt, const HostStore& store, GradSlabPool& pool,
                      Backend& be, std::vector<Event>& events, int64_t piece,
                      std::mt19937_64& gen, const std::function<void()>& after_each = {}) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t u = store.num_units() - 1; u >= 0; --u) {
    for (int64_t offset = 0; offset < store.unit_elements(u); offset += piece) {
      const int64_t count = std::min<int64_t>(piece, store.unit_elements(u) - offset);
      float* slab = pool.Acquire();
      for (int64_t i = 0; i < count; ++i) slab[i] = normal(gen);
      Event& ready = events[pool.IndexOf(slab)];
      be.Record(ready.get(), StreamId::kD2H);
      opt.Submit(u, slab, ready.get(), offset, count);
      if (after_each) after_each();
    }
  }
}

// Unit u's whole gradient `g`, handed to the optimizer in pieces of `piece` elements, each
// in a slab of `pool` as the gradient drain hands them.
void SubmitUnit(HostOptimizer& opt, GradSlabPool& pool, Backend& be, std::vector<Event>& events,
                int64_t u, const std::vector<float>& g, int64_t piece) {
  for (int64_t offset = 0; offset < static_cast<int64_t>(g.size()); offset += piece) {
    const int64_t count = std::min<int64_t>(piece, g.size() - offset);
    float* slab = pool.Acquire();
    std::memcpy(slab, g.data() + offset, count * sizeof(float));
    Event& ready = events[pool.IndexOf(slab)];
    be.Record(ready.get(), StreamId::kD2H);
    opt.Submit(u, slab, ready.get(), offset, count);
  }
}

// compact: the held gradients in 16 bits (HostOptimizerOptions::compact_held), with two
// slabs (they cycle) and pieces of 300 elements (blocks of kHeldBlock, the last partial):
// the reference then reads each piece's gradient as EncodeHeld and DecodeHeld leave it,
// while the norm stays the exact gradient's.
void RunSteps(double max_grad_norm, bool compact = false) {
  std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
  std::unique_ptr<HostStore> store = TinyStore();
  const int64_t units = store->num_units();
  // Gradients arrive in pieces of 37 elements, across tensor boundaries, as a unit larger
  // than a slab does from the pipeline.
  const int64_t kPiece = compact ? 300 : 37;
  const int64_t pieces = CountPieces(*store, kPiece);
  std::unique_ptr<GradSlabPool> pool =
      std::move(*GradSlabPool::Create(compact ? 2 : pieces, kPiece));
  HostOptimizerOptions o;
  o.hyper = AdamWHyper{0.9, 0.95, 1e-8};
  o.weight_decay = 0.1;
  o.max_grad_norm = max_grad_norm;
  o.compact_held = compact;
  HostOptimizer opt(store.get(), pool.get(), be.get(), o);
  ScheduleOptions sched{ScheduleType::kCosine, 1e-2, 2, 5, 0.0};

  Reference ref;
  for (int64_t u = 0; u < units; ++u) {
    ref.p.emplace_back(store->master(u), store->master(u) + store->unit_elements(u));
    ref.m.emplace_back(store->unit_elements(u), 0.0);
    ref.v.emplace_back(store->unit_elements(u), 0.0);
  }
  std::vector<Event> events;
  for (int64_t i = 0; i < pieces; ++i) events.emplace_back(be.get());
  std::mt19937_64 gen(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t step = 1; step <= 4; ++step) {
    const double lr = LearningRate(sched, step - 1);
    opt.BeginStep(lr, step);
    std::vector<std::vector<float>> grads(units);
    double ss = 0;
    for (int64_t u = units - 1; u >= 0; --u) {  // backward order, as the pipeline does
      std::vector<float>& g = grads[u];
      g.assign(store->unit_elements(u), 0.0f);
      for (const TensorSlot& t : store->layout().units[u].tensors) {
        for (int64_t i = 0; i < t.num_elements; ++i) g[t.offset + i] = normal(gen);
      }
      for (float x : g) ss += double(x) * x;
      SubmitUnit(opt, *pool, *be, events, u, g, kPiece);
      for (int64_t offset = 0; compact && offset < static_cast<int64_t>(g.size());
           offset += kPiece) {  // what the update reads
        const int64_t n = std::min<int64_t>(kPiece, g.size() - offset);
        std::vector<uint16_t> q(n);
        std::vector<float> scales((n + kHeldBlock - 1) / kHeldBlock);
        EncodeHeld(g.data() + offset, n, q.data(), scales.data());
        DecodeHeld(q.data(), scales.data(), n, g.data() + offset);
      }
    }
    const double norm = opt.Finish();
    opt.Drain();
    EXPECT_NEAR(norm, std::sqrt(ss), 1e-9 * std::sqrt(ss));
    const double coef =
        max_grad_norm > 0 ? std::min(1.0, max_grad_norm / (std::sqrt(ss) + 1e-6)) : 1.0;
    const double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.95, step);
    for (int64_t u = 0; u < units; ++u) {
      for (const TensorSlot& t : store->layout().units[u].tensors) {
        const double wd = t.weight_decay ? 0.1 : 0.0;
        for (int64_t i = t.offset; i < t.offset + t.num_elements; ++i) {
          const double g = grads[u][i] * coef;
          double& p = ref.p[u][i];
          double& m = ref.m[u][i];
          double& v = ref.v[u][i];
          p *= 1 - lr * wd;
          m = 0.9 * m + 0.1 * g;
          v = 0.95 * v + 0.05 * g * g;
          p -= lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + 1e-8);
        }
      }
    }
  }
  for (int64_t u = 0; u < units; ++u) {
    for (const TensorSlot& t : store->layout().units[u].tensors) {
      for (int64_t i = t.offset; i < t.offset + t.num_elements; ++i) {
        ASSERT_NEAR(store->master(u)[i], ref.p[u][i], 2e-6 * std::fabs(ref.p[u][i]) + 1e-7)
            << t.name;
        ASSERT_NEAR(store->exp_avg_sq(u)[i], ref.v[u][i], 1e-5 * ref.v[u][i] + 1e-12) << t.name;
        ASSERT_EQ(store->weights(u)[i], FloatToBf16(store->master(u)[i])) << t.name;
      }
    }
  }
}

TEST(HostOptimizer, AdamWWithClippingAndWarmupMatchesClosedForm) { RunSteps(1.0); }

TEST(HostOptimizer, AdamWWithoutClippingUpdatesAsGradientsLandAndMatchesClosedForm) {
  RunSteps(0.0);
}

// Clipping with the gradients held in 16 bits: the slabs go back as each piece lands (two
// of them serve the whole step), the norm is the exact gradient's, and the update reads the
// 16-bit values.
TEST(HostOptimizer, ClippingWithCompactHeldGradientsCyclesTwoSlabsAndNormsExactly) {
  RunSteps(1.0, /*compact=*/true);
}

// The tiny store with a slab and an event for each of its pieces of kPiece elements: a whole
// step's gradients can be submitted at once.
class HostOptimizerWholeStep : public ::testing::Test {
 protected:
  HostOptimizerWholeStep() {
    for (int64_t i = 0; i < pieces; ++i) events.emplace_back(be.get());
  }
  static constexpr int64_t kPiece = 37;
  std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
  std::unique_ptr<HostStore> store = TinyStore();
  const int64_t units = store->num_units();
  const int64_t pieces = CountPieces(*store, kPiece);
  std::unique_ptr<GradSlabPool> pool = std::move(*GradSlabPool::Create(pieces, kPiece));
  std::vector<Event> events;
};

// Without clipping, with one device, the worker takes the lowest unit queued: when the
// gradients land faster than it updates them (here: all at once, behind a slow copy on the
// D2H stream, before the step's Finish()), the embedding and the bottom layers, which the
// next forward needs first, are updated first, and the head, needed last, last. (The
// order units complete is the order a capture of the step is handed them.)
TEST_F(HostOptimizerWholeStep, WithoutClippingABacklogIsUpdatedLowestUnitFirst) {
  ASSERT_GT(store->unit_elements(units - 1), kPiece);  // the head arrives in pieces
  HostOptimizerOptions o;
  o.weight_decay = 0.1;
  HostOptimizer opt(store.get(), pool.get(), be.get(), o);
  std::vector<int64_t> order;
  std::mutex mu;
  opt.BeginCapture(1, [&](int64_t u) {
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(u);
  });
  opt.BeginStep(1e-2, 1);
  // Every piece's copy completes after this one (256 MiB: tens of ms), by which time all
  // are queued.
  constexpr size_t kSlow = size_t{256} << 20;
  absl::StatusOr<DeviceBuffer> from = DeviceBuffer::Allocate(be.get(), kSlow);
  std::vector<char> to(kSlow);
  ASSERT_TRUE(from.ok());
  be->CopyToHost(to.data(), from->get(), kSlow, StreamId::kD2H);
  std::mt19937_64 gen(5);
  SubmitRandomStep(opt, *store, *pool, *be, events, kPiece, gen);
  // Finish() would turn the backlog into the next forward's leftovers (forward order
  // anyway): the order must already hold while the backward is still submitting.
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (static_cast<int64_t>(order.size()) == units) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  opt.Finish();
  opt.Drain();
  opt.EndCapture();
  std::vector<int64_t> lowest_first(units);
  for (int64_t u = 0; u < units; ++u) lowest_first[u] = u;
  EXPECT_EQ(order, lowest_first);
}

// Spans (record_spans): an update a piece, covering each unit's elements once a step (with
// clipping, each piece's squares as it lands too; without, those of the pieces still queued
// at Finish()), each after its gradient had landed; taken once, and none without the option.
TEST_F(HostOptimizerWholeStep, SpansCoverEveryPieceOnceAStep) {
  for (double clip : {0.0, 1.0}) {
    for (bool record : {true, false}) {
      HostOptimizerOptions o;
      o.max_grad_norm = clip;
      o.record_spans = record;
      HostOptimizer opt(store.get(), pool.get(), be.get(), o);
      opt.BeginStep(1e-2, 1);
      std::mt19937_64 gen(5);
      SubmitRandomStep(opt, *store, *pool, *be, events, kPiece, gen);
      opt.Finish();
      opt.Drain();
      const std::vector<OptimizerSpan> spans = opt.TakeSpans();
      EXPECT_TRUE(opt.TakeSpans().empty());
      if (!record) {
        EXPECT_TRUE(spans.empty());
        continue;
      }
      std::vector<int64_t> updated(units, 0), squared(units, 0);
      for (const OptimizerSpan& sp : spans) {
        ASSERT_GE(sp.unit, 0);
        ASSERT_LT(sp.unit, units);
        EXPECT_LE(sp.taken, sp.ready);
        EXPECT_LE(sp.ready, sp.end);
        (sp.update ? updated : squared)[sp.unit] += sp.count;
      }
      for (int64_t u = 0; u < units; ++u) {
        EXPECT_EQ(updated[u], store->unit_elements(u)) << "unit " << u << " clip " << clip;
        // Without clipping, only the pieces still queued at Finish() are squared apart.
        if (clip > 0) {
          EXPECT_EQ(squared[u], store->unit_elements(u)) << "unit " << u;
        } else {
          EXPECT_LE(squared[u], store->unit_elements(u)) << "unit " << u;
        }
      }
    }
  }
}

// A unit's master, m, v and bf16 weights, as bytes.
std::string SnapshotUnit(const HostStore& store, int64_t u) {
  const size_t n = static_cast<size_t>(store.unit_elements(u));
  std::string s;
  s.append(reinterpret_cast<const char*>(store.master(u)), n * 4);
  s.append(reinterpret_cast<const char*>(store.exp_avg(u)), n * 4);
  s.append(reinterpret_cast<const char*>(store.exp_avg_sq(u)), n * 4);
  s.append(reinterpret_cast<const char*>(store.weights(u)), n * 2);
  return s;
}

std::vector<std::string> Snapshot(const HostStore& store) {
  std::vector<std::string> out;
  for (int64_t u = 0; u < store.num_units(); ++u) out.push_back(SnapshotUnit(store, u));
  return out;
}

// Runs `steps` steps of seeded gradients through an optimizer with two slabs (as the
// pipeline has without clipping: a held-up update holds up the next gradient). After
// step `capture_after`, captures the state: a slow writer thread copies each unit it is
// handed. Returns the captured units (empty without capture) and the final state.
struct CaptureRun {
  std::vector<std::string> captured;
  std::vector<std::string> final_state;
  std::vector<int64_t> order;  // units in the order they were handed over
  double waited = 0;           // seconds updates waited for the capture
};

// early: the capture of step `capture_after` begins before that step runs.
CaptureRun RunWithCapture(double max_grad_norm, int64_t steps, int64_t capture_after,
                          bool early = false) {
  const ModelConfig c = TinyConfig(Variant::kQwen2UntiedBias);
  std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
  std::unique_ptr<HostStore> store = std::move(*HostStore::Create(BuildLayout(c)));
  RandomInitWeights(c, 3, store.get());
  const int64_t units = store->num_units();
  constexpr int64_t kPiece = 53;
  int64_t pieces = 0;
  for (int64_t u = 0; u < units; ++u) pieces += (store->unit_elements(u) + kPiece - 1) / kPiece;
  std::unique_ptr<GradSlabPool> pool =
      std::move(*GradSlabPool::Create(max_grad_norm > 0 ? pieces : 2, kPiece));
  HostOptimizerOptions o;
  o.hyper = AdamWHyper{0.9, 0.95, 1e-8};
  o.weight_decay = 0.1;
  o.max_grad_norm = max_grad_norm;
  HostOptimizer opt(store.get(), pool.get(), be.get(), o);
  std::vector<Event> events;
  for (int64_t i = 0; i < pool->num_slabs(); ++i) events.emplace_back(be.get());

  CaptureRun run;
  run.captured.resize(units);
  std::mutex mu;
  std::condition_variable cv;
  std::deque<int64_t> handed;
  std::thread writer;
  std::mt19937_64 gen(11);
  // The writer holds its first unit (and so every unit) until the step after the
  // captured one updates: without clipping, once that step has begun submitting (each
  // piece is updated as it lands); with clipping, once it calls Finish() (the updates wait
  // for the norm). That step's first update then surely finds its unit unwritten and
  // waits, whatever the machine's speed (under TSan and load, submitting a step's pieces
  // took longer than writing every unit, and nothing waited).
  std::atomic<int64_t> next_step_pieces{0};
  std::atomic<bool> next_step_finishing{false};
  const bool clipping = max_grad_norm > 0;
  auto start_capture = [&](int64_t step) {
    writer = std::thread([&] {
      for (int64_t n = 0; n < units; ++n) {
        int64_t u;
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return !handed.empty(); });
          u = handed.front();
          handed.pop_front();
        }
        while (n == 0 && (clipping ? !next_step_finishing.load() : next_step_pieces.load() == 0)) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));  // a slow disk
        run.captured[u] = SnapshotUnit(*store, u);
        opt.Captured(u);
      }
    });
    opt.BeginCapture(step, [&](int64_t u) {
      {
        std::lock_guard<std::mutex> lock(mu);
        handed.push_back(u);
        run.order.push_back(u);
      }
      cv.notify_one();
    });
  };
  for (int64_t step = 1; step <= steps; ++step) {
    if (step == capture_after && early) start_capture(step);  // before the step runs
    opt.BeginStep(1e-2, step);
    SubmitRandomStep(opt, *store, *pool, *be, events, kPiece, gen, [&] {
      if (capture_after > 0 && step == capture_after + 1) ++next_step_pieces;
    });
    if (capture_after > 0 && step == capture_after + 1) next_step_finishing = true;
    opt.Finish();
    if (step == capture_after && !early) start_capture(step);
  }
  if (writer.joinable()) writer.join();
  opt.EndCapture();
  opt.Drain();
  run.final_state = Snapshot(*store);
  run.waited = opt.capture_wait_seconds();
  return run;
}

void CaptureEqualsStoppedState(double max_grad_norm, bool early) {
  const CaptureRun stopped = RunWithCapture(max_grad_norm, 2, -1);
  const CaptureRun live = RunWithCapture(max_grad_norm, 4, 2, early);
  const CaptureRun reference = RunWithCapture(max_grad_norm, 4, -1);
  const int64_t units = static_cast<int64_t>(stopped.final_state.size());
  ASSERT_EQ(static_cast<int64_t>(live.order.size()), units);
  std::vector<int64_t> sorted = live.order;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t u = 0; u < units; ++u) EXPECT_EQ(sorted[u], u) << "each unit handed over once";
  for (int64_t u = 0; u < units; ++u) {
    EXPECT_TRUE(live.captured[u] == stopped.final_state[u])
        << "unit " << u << " captured while steps 3-4 ran differs from the state after step 2";
    // The capture does not change training.
    EXPECT_TRUE(live.final_state[u] == reference.final_state[u]) << "unit " << u;
  }
  // The writer took 5 ms a unit, slower than the updates: they must have waited for it.
  EXPECT_GT(live.waited, 0.0);
}

// Without clipping the optimizer's own thread sums the squares of the pieces still queued
// when Finish() asks (not the caller, whose OpenMP team would share the cores with the
// optimizer's). Finish() still returns the step's exact norm while every update is held by
// a checkpoint's capture that has not written its units: the worker leaves the capture
// wait to sum the squares, and the updates follow once the units are written.
TEST_F(HostOptimizerWholeStep, FinishGetsTheNormWhileACaptureHoldsTheUpdates) {
  HostOptimizer opt(store.get(), pool.get(), be.get(), HostOptimizerOptions{});
  std::mt19937_64 gen(21);
  opt.BeginStep(1e-2, 1);
  SubmitRandomStep(opt, *store, *pool, *be, events, kPiece, gen);
  opt.Finish();
  opt.Drain();
  const std::vector<std::string> after_one = Snapshot(*store);

  std::mutex mu;
  std::vector<int64_t> handed;
  opt.BeginCapture(1, [&](int64_t u) {
    std::lock_guard<std::mutex> lock(mu);
    handed.push_back(u);
  });
  opt.BeginStep(1e-2, 2);
  std::mt19937_64 replay = gen;  // the same gradients, summed here
  std::normal_distribution<float> normal(0.0f, 1.0f);
  double ss = 0;
  for (int64_t u = units - 1; u >= 0; --u) {
    for (int64_t offset = 0; offset < store->unit_elements(u); offset += kPiece) {
      double piece = 0;  // as SumOfSquares adds one piece
      const int64_t count = std::min<int64_t>(kPiece, store->unit_elements(u) - offset);
      for (int64_t i = 0; i < count; ++i) {
        const double x = normal(replay);
        piece += x * x;
      }
      ss += piece;
    }
  }
  SubmitRandomStep(opt, *store, *pool, *be, events, kPiece, gen);
  std::future<double> norm = std::async(std::launch::async, [&] { return opt.Finish(); });
  const bool returned = norm.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  EXPECT_TRUE(returned) << "Finish() waited for the capture";
  // Nothing was updated: every unit's step-2 update waits for its capture.
  EXPECT_TRUE(Snapshot(*store) == after_one);
  for (size_t written = 0; written < static_cast<size_t>(units);) {  // a writer, now
    int64_t u = -1;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (written < handed.size()) u = handed[written];
    }
    if (u < 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    opt.Captured(u);
    ++written;
  }
  EXPECT_NEAR(norm.get(), std::sqrt(ss), 1e-9 * std::sqrt(ss));
  opt.Drain();
  opt.EndCapture();
  EXPECT_FALSE(Snapshot(*store) == after_one);  // the updates ran once written
}

TEST(HostOptimizer, CaptureWithoutClippingHoldsEachUpdateUntilItsUnitIsWritten) {
  CaptureEqualsStoppedState(0.0, /*early=*/false);
}

TEST(HostOptimizer, CaptureWithClippingHoldsEachUpdateUntilItsUnitIsWritten) {
  CaptureEqualsStoppedState(1.0, /*early=*/false);
}

// Begun before the captured step runs: units are handed over as that step updates them.
TEST(HostOptimizer, CaptureBegunBeforeTheStepWithoutClipping) {
  CaptureEqualsStoppedState(0.0, /*early=*/true);
}

TEST(HostOptimizer, CaptureBegunBeforeTheStepWithClipping) {
  CaptureEqualsStoppedState(1.0, /*early=*/true);
}

// Frozen tensors (ModelLayout::SetTrainable): after steps of gradients a frozen tensor's
// master and bf16 copy are byte for byte what they were, while the tensors beside it in its
// unit move; its gradient counts in no norm. With clipping (held updates, squares as they
// land) and without, with fp32 and with quantized moments (pieces of whole moment blocks).
struct FrozenCase {
  double max_grad_norm;
  MomentDType moments;
};

class HostOptimizerFrozen : public ::testing::TestWithParam<FrozenCase> {};

TEST_P(HostOptimizerFrozen, FrozenTensorKeepsItsValuesExactlyAndCountsInNoNorm) {
  const FrozenCase param = GetParam();
  const ModelConfig c = TinyConfig(Variant::kQwen2UntiedBias);
  ModelLayout layout = BuildLayout(c);
  constexpr int64_t kUnit = 1;  // layer 0: a frozen tensor between trainable ones
  const TensorSlot frozen = layout.units[kUnit].tensors[2];
  ASSERT_TRUE(layout.SetTrainable(frozen.name, false).ok());
  StoreOptions store_options;
  store_options.moments = param.moments;
  std::unique_ptr<HostStore> store = std::move(*HostStore::Create(layout, -1, store_options));
  RandomInitWeights(c, 3, store.get());
  auto tensor_bytes = [&](const TensorSlot& t) {
    const float* master = store->master(kUnit) + t.offset;
    const uint16_t* bf16 = store->weights(kUnit) + t.offset;
    std::vector<char> bytes(t.num_elements * 6);
    std::memcpy(bytes.data(), master, t.num_elements * 4);
    std::memcpy(bytes.data() + t.num_elements * 4, bf16, t.num_elements * 2);
    return bytes;
  };
  std::vector<std::vector<char>> before;
  for (const TensorSlot& t : store->layout().units[kUnit].tensors) before.push_back(tensor_bytes(t));

  std::unique_ptr<Backend> be = CreateCpuBackend(CpuBackendOptions{});
  // Quantized moments are updated in whole blocks: pieces start on block boundaries.
  const int64_t piece = param.moments == MomentDType::kF32 ? 37 : kMomentBlock;
  const int64_t pieces = CountPieces(*store, piece);
  std::unique_ptr<GradSlabPool> pool = std::move(*GradSlabPool::Create(pieces, piece));
  std::vector<Event> events;
  for (int64_t i = 0; i < pieces; ++i) events.emplace_back(be.get());
  HostOptimizerOptions o;
  o.weight_decay = 0.1;
  o.max_grad_norm = param.max_grad_norm;
  HostOptimizer opt(store.get(), pool.get(), be.get(), o);
  std::mt19937_64 gen(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t step = 1; step <= 3; ++step) {
    opt.BeginStep(1e-2, step);
    double trainable_squares = 0;
    for (int64_t u = store->num_units() - 1; u >= 0; --u) {
      std::vector<float> g(store->unit_elements(u), 0.0f);
      for (const TensorSlot& t : store->layout().units[u].tensors) {
        for (int64_t i = t.offset; i < t.offset + t.num_elements; ++i) {
          g[i] = normal(gen);
          if (t.trainable) trainable_squares += double(g[i]) * g[i];
        }
      }
      SubmitUnit(opt, *pool, *be, events, u, g, piece);
    }
    const double norm = opt.Finish();
    opt.Drain();
    EXPECT_NEAR(norm, std::sqrt(trainable_squares), 1e-9 * std::sqrt(trainable_squares));
  }
  const std::vector<TensorSlot>& tensors = store->layout().units[kUnit].tensors;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].name == frozen.name) {
      EXPECT_TRUE(tensor_bytes(tensors[i]) == before[i]) << tensors[i].name << " moved";
    } else {
      EXPECT_FALSE(tensor_bytes(tensors[i]) == before[i]) << tensors[i].name << " stood still";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    ClippingAndMoments, HostOptimizerFrozen,
    ::testing::Values(FrozenCase{0.0, MomentDType::kF32}, FrozenCase{1.0, MomentDType::kF32},
                      FrozenCase{0.0, MomentDType::kInt8}, FrozenCase{1.0, MomentDType::kBF16}),
    [](const ::testing::TestParamInfo<FrozenCase>& info) {
      const char* moments = info.param.moments == MomentDType::kF32    ? "F32Moments"
                            : info.param.moments == MomentDType::kBF16 ? "Bf16Moments"
                                                                       : "Int8Moments";
      return std::string(info.param.max_grad_norm > 0 ? "Clipping" : "NoClipping") + moments;
    });

TEST(HostOptimizer, FreezingAnUnknownTensorIsNotFound) {
  ModelLayout layout = BuildLayout(TinyConfig(Variant::kLlamaTiedGqa));
  const absl::Status s = layout.SetTrainable("model.layers.9.mlp.up_proj.weight", false);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("model.layers.9.mlp.up_proj.weight"), std::string::npos);
}

}  // namespace
}  // namespace megatrain::testing
