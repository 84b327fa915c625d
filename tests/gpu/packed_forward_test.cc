// A packed micro-batch's forward equals the forward of each of its examples alone:
// positions restart at every document and attention never crosses one. On the CPU
// backend (f32, runs everywhere) and on the CUDA backend (bf16, skipped without a GPU).
#include <algorithm>
#include <random>

#include "engine/data/packer.h"
#include "engine/store/model_io.h"
#include "tests/engine/pipeline/tiny_model.h"
#include "tests/gpu/gpu_util.h"
#include "tests/util/forward_logits.h"

namespace megatrain::testing {
namespace {

struct Case {
  const char* backend;
  Variant variant;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  ::testing::TestParamInfo<Variant> v(info.param.variant, info.index);
  return std::string(info.param.backend) + "_" + VariantName(v);
}

class PackedForward : public ::testing::TestWithParam<Case> {};

TEST_P(PackedForward, EachDocumentsLogitsEqualItsForwardAlone) {
  const Case param = GetParam();
  const bool gpu = std::string(param.backend) == "cuda";
  if (gpu && !CudaAvailable()) GTEST_SKIP() << "no CUDA device (or no CUDA backend in this build)";
  absl::StatusOr<std::unique_ptr<Backend>> be = CreateBackend(BackendRequest{param.backend});
  ASSERT_TRUE(be.ok()) << be.status();

  ModelConfig c = TinyConfig(param.variant);
  c.hidden_size = 128;
  c.num_heads = 4;
  c.num_kv_heads = param.variant == Variant::kLlama3RopeMha ? 4 : 2;
  c.head_dim = c.qk_norm ? 64 : 32;
  c.intermediate_size = 256;
  c.num_layers = 3;
  c.vocab_size = 300;
  c.max_position_embeddings = 512;
  std::unique_ptr<HostStore> store = std::move(*HostStore::Create(BuildLayout(c)));
  RandomInitWeights(c, 11, store.get());

  // Documents of uneven lengths, each kept whole in one row of 64 (kTruncate), with
  // padding where the next one does not fit.
  std::mt19937 rng(3);
  std::vector<std::vector<int32_t>> docs;
  for (int len : {17, 40, 9, 64, 23, 31, 5, 50}) {
    std::vector<int32_t> d(len);
    for (int32_t& t : d) t = static_cast<int32_t>(rng() % c.vocab_size);
    docs.push_back(std::move(d));
  }
  PackOptions options;
  options.truncation = PackOptions::Truncation::kTruncate;
  options.pad_id = 1;
  Packer packer(TokenDocs::FromVectors(docs), /*seq_len=*/64, /*seed=*/9, options);
  MicroBatch packed;
  packer.Next(/*rows=*/4, &packed);
  const std::vector<float> all = Logits(c, *store, be->get(), packed);

  const int64_t V = c.vocab_size, n = static_cast<int64_t>(packed.tokens.size());
  int documents = 0;
  for (int64_t i = 0; i < n;) {
    // A segment: tokens sharing doc_start; padding is a segment of one with position 0.
    int64_t j = i + 1;
    while (j < n && packed.doc_start[j] == packed.doc_start[i]) ++j;
    const std::vector<int32_t> ids(packed.tokens.begin() + i, packed.tokens.begin() + j);
    const auto it = std::find(docs.begin(), docs.end(), ids);
    if (it != docs.end()) {
      MicroBatch alone;
      alone.rows = 1;
      alone.seq_len = j - i;
      alone.tokens = ids;
      alone.targets.assign(ids.size(), kIgnoreIndex);
      alone.doc_start.assign(ids.size(), 0);
      for (int64_t k = 0; k < j - i; ++k) alone.positions.push_back(static_cast<int32_t>(k));
      const std::vector<float> want = Logits(c, *store, be->get(), alone);
      const std::vector<float> got(all.begin() + i * V, all.begin() + j * V);
      EXPECT_LT(RelErr(got, want), gpu ? 1e-2 : 1e-5)
          << "document of " << ids.size() << " tokens at flat index " << i;
      ++documents;
    }
    i = j;
  }
  EXPECT_GE(documents, 4) << "the packed batch should hold several whole documents";
}

INSTANTIATE_TEST_SUITE_P(
    Backends, PackedForward,
    ::testing::Values(Case{"cpu", Variant::kLlamaTiedGqa}, Case{"cpu", Variant::kQwen3QkNorm},
                      Case{"cuda", Variant::kLlamaTiedGqa}, Case{"cuda", Variant::kQwen2UntiedBias},
                      Case{"cuda", Variant::kQwen3QkNorm}),
    CaseName);

}  // namespace
}  // namespace megatrain::testing
