// The loss head's objective seam on the CPU backend: cross-entropy through the seam runs
// the ops the head ran before it, bit for bit; the forward-only pass gives the training
// pass's loss and writes no gradient; the head hands an objective every chunk in order
// and carries back whatever dlogits it writes.
#include "engine/layers/head.h"

#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "engine/backend/cpu_backend.h"
#include "engine/layers/cross_entropy_objective.h"
#include "engine/layers/objective.h"
#include "tests/engine/pipeline/tiny_model.h"

namespace megatrain {
namespace {

using testing::TinyConfig;
using testing::Variant;

constexpr int64_t kTokens = 13;
constexpr int64_t kChunkTokens = 5;  // chunks of 5, 5 and 3 rows
constexpr float kUnwritten = 12345.0f;

// A head's inputs and outputs on the f32 CPU backend, as host vectors (its "device"
// memory is the host's).
class HeadTest : public ::testing::Test {
 protected:
  HeadTest()
      : config_(TinyConfig(Variant::kQwen2UntiedBias)),
        layout_(BuildLayout(config_)),
        be_(CreateCpuBackend(CpuBackendOptions{})) {
    const int64_t C = config_.hidden_size, V = config_.vocab_size;
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto fill = [&](std::vector<float>* v, int64_t size) {
      v->resize(size);
      for (float& x : *v) x = normal(rng);
    };
    fill(&final_norm_, C);
    fill(&lm_head_, V * C);
    fill(&x_, kTokens * C);
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(V - 1));
    for (int64_t i = 0; i < kTokens; ++i) targets_.push_back(i % 4 == 3 ? -100 : token(rng));
    batch_.num_tokens = kTokens;
    batch_.targets = targets_.data();
  }

  LossHead Head(std::unique_ptr<const Objective> objective) {
    return LossHead(config_, layout_, be_.get(), kChunkTokens, std::move(objective));
  }
  HeadTensors Weights() { return HeadTensors{final_norm_.data(), lm_head_.data()}; }

  // The training pass's outputs, every buffer first filled with kUnwritten (gradients
  // with zero, as the pipeline zeroes them).
  struct Outputs {
    std::vector<float> loss, dx, final_norm_grad, lm_head_grad;
  };
  Outputs Train(const LossHead& head) {
    const int64_t C = config_.hidden_size, V = config_.vocab_size;
    Outputs o{std::vector<float>(kTokens, kUnwritten), std::vector<float>(kTokens * C, kUnwritten),
              std::vector<float>(C, 0.0f), std::vector<float>(V * C, 0.0f)};
    std::vector<char> ws(head.WorkspaceBytes(kTokens));
    head.ForwardBackward(Weights(), HeadTensors{o.final_norm_grad.data(), o.lm_head_grad.data()},
                         x_.data(), o.dx.data(), o.loss.data(), ws.data(), batch_, kScale,
                         StreamId::kCompute);
    be_->SyncAll();
    return o;
  }

  static constexpr double kScale = 1.0 / 9;
  ModelConfig config_;
  ModelLayout layout_;
  std::unique_ptr<Backend> be_;
  std::vector<float> final_norm_, lm_head_, x_;
  std::vector<int32_t> targets_;
  DeviceBatch batch_;
};

void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what;
}

TEST_F(HeadTest, CrossEntropyThroughTheSeamRunsTheFusedOpsBitForBit) {
  ASSERT_EQ(be_->act_dtype(), DType::kF32);
  const Outputs seam = Train(Head(MakeObjective(ObjectiveKind::kNextTokenCrossEntropy,
                                                be_.get())));
  // The head as it was written before the seam: the same ops in the same order.
  Backend& be = *be_;
  const StreamId s = StreamId::kCompute;
  const int64_t n = kTokens, C = config_.hidden_size, V = config_.vocab_size;
  Outputs direct{std::vector<float>(n), std::vector<float>(n * C), std::vector<float>(C, 0.0f),
                 std::vector<float>(V * C, 0.0f)};
  std::vector<float> hf(n * C), dhf(n * C), rstd(n), logits(kChunkTokens * V);
  be.RmsNorm(hf.data(), rstd.data(), x_.data(), final_norm_.data(), n, C, config_.rms_norm_eps, s);
  for (int64_t r = 0; r < n; r += kChunkTokens) {
    const int64_t rows = std::min(kChunkTokens, n - r);
    be.Linear(logits.data(), &hf[r * C], lm_head_.data(), nullptr, rows, C, V, false, s);
    be.CrossEntropy(logits.data(), &direct.loss[r], logits.data(), targets_.data() + r, rows, V,
                    kScale, nullptr, s);
    be.LinearBackward(&dhf[r * C], false, direct.lm_head_grad.data(), nullptr, logits.data(),
                      &hf[r * C], lm_head_.data(), rows, C, V, s);
  }
  be.Zero(direct.dx.data(), n * C * sizeof(float), s);
  be.RmsNormBackward(direct.dx.data(), direct.final_norm_grad.data(), dhf.data(), x_.data(),
                     final_norm_.data(), rstd.data(), n, C, s);
  be.SyncAll();

  ExpectSameBits(seam.loss, direct.loss, "loss");
  ExpectSameBits(seam.dx, direct.dx, "dx");
  ExpectSameBits(seam.final_norm_grad, direct.final_norm_grad, "final norm gradient");
  ExpectSameBits(seam.lm_head_grad, direct.lm_head_grad, "lm_head gradient");
}

TEST_F(HeadTest, ForwardOnlyGivesTheTrainingLossAndWritesNoGradient) {
  const LossHead head =
      Head(MakeObjective(ObjectiveKind::kNextTokenCrossEntropy, be_.get()));
  const Outputs trained = Train(head);
  std::vector<float> values(kTokens, kUnwritten);
  std::vector<char> ws(head.WorkspaceBytes(kTokens));
  // Forward() has no gradient or dx to write to: the weights must come back untouched.
  const std::vector<float> final_norm = final_norm_, lm_head = lm_head_, x = x_;
  head.Forward(Weights(), x_.data(), values.data(), ws.data(), batch_, StreamId::kCompute);
  be_->SyncAll();

  ExpectSameBits(values, trained.loss, "forward-only values vs the training loss");
  for (int64_t i = 0; i < kTokens; ++i) {
    if (targets_[i] == -100) {
      EXPECT_EQ(values[i], 0.0f) << "ignored row " << i;
    } else {
      EXPECT_GT(values[i], 0.0f) << "-log p of row " << i;
    }
  }
  ExpectSameBits(final_norm_, final_norm, "final norm weights");
  ExpectSameBits(lm_head_, lm_head, "lm_head weights");
  ExpectSameBits(x_, x, "the head's input");
}

// Records what the head hands it (on the calling thread); on the stream, writes each row's
// index as its value and, in a training pass, zero dlogits.
class RecordingObjective final : public Objective {
 public:
  struct Call {
    int64_t first_row, rows, vocab;
    double scale;
    HeadPass pass;
  };
  RecordingObjective(Backend* be, std::vector<Call>* calls) : be_(be), calls_(calls) {
    for (int64_t i = 0; i < kTokens; ++i) row_index_.push_back(static_cast<float>(i));
  }
  ObjectiveKind kind() const override { return ObjectiveKind::kNextTokenCrossEntropy; }
  void Chunk(const LogitsChunk& c, HeadPass pass) const override {
    calls_->push_back(Call{c.first_row, c.rows, c.vocab, c.scale, pass});
    be_->CopyToDevice(c.values, &row_index_[c.first_row], c.rows * sizeof(float), c.stream);
    if (pass == HeadPass::kTrain) be_->Zero(c.logits, c.rows * c.vocab * sizeof(float), c.stream);
  }

 private:
  Backend* be_;
  std::vector<Call>* calls_;
  std::vector<float> row_index_;
};

TEST_F(HeadTest, HeadHandsTheObjectiveEveryChunkInRowOrder) {
  std::vector<RecordingObjective::Call> calls;
  const LossHead head = Head(std::make_unique<RecordingObjective>(be_.get(), &calls));
  Train(head);
  ASSERT_EQ(calls.size(), 3u);
  const int64_t firsts[] = {0, 5, 10}, rows[] = {5, 5, 3};
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(calls[i].first_row, firsts[i]);
    EXPECT_EQ(calls[i].rows, rows[i]);
    EXPECT_EQ(calls[i].vocab, config_.vocab_size);
    EXPECT_EQ(calls[i].scale, kScale);
    EXPECT_EQ(calls[i].pass, HeadPass::kTrain);
  }
  calls.clear();
  std::vector<float> values(kTokens, kUnwritten);
  std::vector<char> ws(head.WorkspaceBytes(kTokens));
  head.Forward(Weights(), x_.data(), values.data(), ws.data(), batch_, StreamId::kCompute);
  be_->SyncAll();
  ASSERT_EQ(calls.size(), 3u);
  for (const RecordingObjective::Call& c : calls) EXPECT_EQ(c.pass, HeadPass::kForwardOnly);
}

TEST_F(HeadTest, GradientsAreTheObjectivesDlogitsCarriedBack) {
  std::vector<RecordingObjective::Call> calls;
  const Outputs o = Train(Head(std::make_unique<RecordingObjective>(be_.get(), &calls)));
  // Zero dlogits: zero gradients everywhere, whatever cross-entropy would have given.
  for (float g : o.lm_head_grad) ASSERT_EQ(g, 0.0f);
  for (float g : o.final_norm_grad) ASSERT_EQ(g, 0.0f);
  for (float d : o.dx) ASSERT_EQ(d, 0.0f);
  for (int64_t i = 0; i < kTokens; ++i) EXPECT_EQ(o.loss[i], static_cast<float>(i));
}

}  // namespace
}  // namespace megatrain
