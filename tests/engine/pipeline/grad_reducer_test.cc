// GradReducer: the N copies of each gradient piece are added (in replica order), the sum
// reaches the target once per piece and in each unit's order, every replica's slabs go
// back to its own pool, and Finish is a barrier whose norm every replica gets.
#include "engine/pipeline/grad_reducer.h"

#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "engine/backend/cpu_backend.h"
#include "gtest/gtest.h"

namespace megatrain {
namespace {

// Records what reaches the optimizer's place; returns slabs to replica 0's pool.
class Recorder final : public GradSink {
 public:
  explicit Recorder(GradSlabPool* pool) : pool_(pool) {}
  void Submit(int64_t unit, float* slab, void* ready, int64_t offset, int64_t count) override {
    std::lock_guard<std::mutex> lock(mu_);
    pieces.push_back({unit, offset, std::vector<float>(slab, slab + count)});
    pool_->Release(slab);
  }
  double Finish() override {
    std::lock_guard<std::mutex> lock(mu_);
    ++finishes;
    return 42.0;
  }
  struct Piece {
    int64_t unit, offset;
    std::vector<float> values;
  };
  std::vector<Piece> pieces;
  int finishes = 0;

 private:
  GradSlabPool* pool_;
  std::mutex mu_;
};

TEST(GradReducer, AddsEveryReplicasPieceInOrderAndReturnsTheSlabs) {
  constexpr int kReplicas = 3, kUnits = 4, kPiecesPerUnit = 3, kPiece = 17;
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<std::unique_ptr<GradSlabPool>> pools;
  std::vector<Backend*> bs;
  std::vector<GradSlabPool*> ps;
  for (int r = 0; r < kReplicas; ++r) {
    backends.push_back(CreateCpuBackend(CpuBackendOptions{}));
    pools.push_back(std::move(*GradSlabPool::Create(2, kPiece)));
    bs.push_back(backends.back().get());
    ps.push_back(pools.back().get());
  }
  Recorder target(ps[0]);
  // One event per slab (a slab is reused only after the reducer waited on its event).
  std::vector<std::vector<Event>> events(kReplicas);
  for (int r = 0; r < kReplicas; ++r) {
    for (int i = 0; i < ps[r]->num_slabs(); ++i) events[r].emplace_back(bs[r]);
  }
  // value(r, unit, piece, i): what replica r's gradient holds there.
  auto value = [](int r, int u, int p, int i) { return 0.5f * r + u + 0.25f * p + 0.001f * i; };
  for (int round = 0; round < 2; ++round) {
    target.pieces.clear();
    GradReducer reducer(&target, bs, ps);
    std::vector<double> norms(kReplicas);
    std::vector<std::thread> threads;
    for (int r = 0; r < kReplicas; ++r) {
      threads.emplace_back([&, r] {
        std::mt19937 jitter(r + 10 * round);
        GradSink* sink = reducer.replica(r);
        for (int u = kUnits - 1; u >= 0; --u) {  // backward order, as a pipeline
          for (int p = 0; p < kPiecesPerUnit; ++p) {
            float* slab = ps[r]->Acquire();  // blocks until the reducer gave one back
            for (int i = 0; i < kPiece; ++i) slab[i] = value(r, u, p, i);
            void* ready = events[r][ps[r]->IndexOf(slab)].get();
            bs[r]->Record(ready, StreamId::kD2H);
            if (jitter() % 3 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
            sink->Submit(u, slab, ready, p * kPiece, kPiece);
          }
        }
        norms[r] = sink->Finish();
      });
    }
    for (std::thread& t : threads) t.join();
    for (double n : norms) EXPECT_EQ(n, 42.0);  // everyone gets the one Finish's norm
    EXPECT_EQ(target.finishes, round + 1);
    ASSERT_EQ(target.pieces.size(), static_cast<size_t>(kUnits * kPiecesPerUnit));
    int64_t last_offset = -1, last_unit = kUnits;
    for (const Recorder::Piece& piece : target.pieces) {
      // Each unit's pieces in order; units in the order the replicas produced them.
      if (piece.unit != last_unit) {
        EXPECT_LT(piece.unit, last_unit);
        last_unit = piece.unit;
        last_offset = -1;
      }
      EXPECT_GT(piece.offset, last_offset);
      last_offset = piece.offset;
      const int p = static_cast<int>(piece.offset / kPiece);
      for (int i = 0; i < kPiece; ++i) {
        float want = value(0, piece.unit, p, i);
        for (int r = 1; r < kReplicas; ++r) want += value(r, piece.unit, p, i);
        ASSERT_EQ(piece.values[i], want) << "unit " << piece.unit << " piece " << p << " " << i;
      }
    }
  }
  // Every slab is back where it came from: each pool hands out both of its slabs again.
  for (auto& pool : pools) {
    float* a = pool->Acquire();
    float* b = pool->Acquire();
    EXPECT_NE(a, b);
    pool->Release(a);
    pool->Release(b);
  }
}

}  // namespace
}  // namespace megatrain
