// The engine's side of the DPO comparison with a PyTorch reference (compare_dpo_with_torch.py):
// a DPO job's passes, run on the pairs of a file as a job runs them (job/preference_pass.h),
// with every value the comparison needs written out. On the chosen backend it
//   a. computes every pair's reference log-probabilities (RunReferencePass) with the
//      weights of REF_DIR (default: POLICY_DIR, the standard DPO setup) and writes
//      OUT/reference_logps.json ([{"chosen", "rejected"}, ...], summed over each completion);
//      then loads POLICY_DIR's weights (when REF_DIR is another folder);
//   b. one step on the first pairs_per_step pairs: OUT/step.json (the DPO loss, TRL's
//      metrics under TRL's names, the MoE aux loss, each pair's log-probabilities) and
//      OUT/grads.safetensors (f32, every trainable tensor's gradient under its HF name);
//   c. `steps` AdamW steps: OUT/curve.json ("losses" and each step's metrics);
//   d. every pair's log-probabilities under the trained weights, by the same forward-only
//      pass: OUT/policy_logps_final.json; and the trained model as OUT/checkpoint-<steps>.
// Step s takes pairs_per_step pairs from pair s * pairs_per_step on (wrapping around), packed
// in order with PackPairs into micro-batches of rows x seq_len; every step must pack into
// as many micro-batches as the first (a job's micro-batch count is fixed): the file is
// refused otherwise, naming the step. (b)'s step is (c)'s first, run with a recording sink
// in place of the optimizer: the weights are unchanged by it.
// Usage: dpo_reference POLICY_DIR PAIRS_JSON OUT [--reference REF_DIR] [--backend cpu|cuda]
//          [--steps N]
// PAIRS_JSON: {"seq_len": S, "rows": R, "pairs_per_step": P, "pad_id": 0 (optional),
//   "beta": .., "loss": "sigmoid"|"ipo"|"hinge", "label_smoothing": .., "rpo_alpha": ..,
//   "lr": .., "warmup": .., "weight_decay": .., "max_grad_norm": ..,
//   "pairs": [{"prompt": [ids], "chosen": [ids], "rejected": [ids]}, ...]}
//   (chosen and rejected: the completions' ids, after the prompt's).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/backend/factory.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/common/check.h"
#include "engine/common/engine_settings.h"
#include "engine/common/status.h"
#include "engine/job/preference_pass.h"
#include "engine/model/layout.h"
#include "engine/model/safetensors.h"
#include "engine/optim/host_optimizer.h"
#include "engine/optim/schedule.h"
#include "engine/pipeline/pipeline.h"
#include "engine/store/grad_slab_pool.h"
#include "engine/store/model_io.h"
#include "nlohmann/json.hpp"
#include "tests/engine/pipeline/recording_sink.h"

namespace megatrain::testing {
namespace {

constexpr char kUsage[] =
    "usage: dpo_reference POLICY_DIR PAIRS_JSON OUT [--reference REF_DIR] "
    "[--backend cpu|cuda] [--steps N]\n";

struct Options {
  std::string policy_dir, pairs_json, out;
  std::string reference_dir;  // "": the policy's folder
  std::string backend = "cuda";
  int64_t steps = 50;
};

// False (after printing why) on a malformed command line.
bool ParseOptions(int argc, char** argv, Options* o) {
  if (argc < 4) return false;
  o->policy_dir = argv[1];
  o->pairs_json = argv[2];
  o->out = argv[3];
  for (int i = 4; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", flag.c_str());
      return false;
    }
    const char* value = argv[i + 1];
    if (flag == "--reference") {
      o->reference_dir = value;
    } else if (flag == "--backend") {
      o->backend = value;
    } else if (flag == "--steps") {
      if (!absl::SimpleAtoi(value, &o->steps)) o->steps = -1;
    } else {
      std::fprintf(stderr, "unknown option %s\n", flag.c_str());
      return false;
    }
  }
  if (o->steps < 0 || (o->backend != "cpu" && o->backend != "cuda")) {
    std::fprintf(stderr, "--steps must be >= 0 and --backend cpu or cuda\n");
    return false;
  }
  return true;
}

// PAIRS_JSON, read.
struct PairsSpec {
  int64_t seq_len = 0, rows = 0, pairs_per_step = 0;
  int32_t pad_id = 0;
  PreferenceOptions preference;
  double lr = 0, weight_decay = 0, max_grad_norm = 0;
  int64_t warmup = 0;
  std::vector<SequencePair> pairs;  // prompt + completion each, as a job trains them
};

// A pair of the file as a job's two training sequences.
SequencePair ToSequences(const nlohmann::json& pair) {
  const auto sequence = [&](const char* completion) {
    PreferenceSequence s;
    for (const nlohmann::json& id : pair.at("prompt")) s.ids.push_back(id.get<int32_t>());
    s.completion.assign(s.ids.size(), 0);
    for (const nlohmann::json& id : pair.at(completion)) {
      s.ids.push_back(id.get<int32_t>());
      s.completion.push_back(1);
    }
    return s;
  };
  return {sequence("chosen"), sequence("rejected")};
}

// The problem with a parsed spec, or OK.
absl::Status CheckSpec(const PairsSpec& s) {
  const PreferenceOptions& p = s.preference;
  if (s.seq_len < 1 || s.rows < 1 || s.pairs_per_step < 1 || s.pairs.empty()) {
    return absl::InvalidArgumentError(
        "seq_len, rows and pairs_per_step must be >= 1, and "
        "pairs not empty");
  }
  if (!(p.beta > 0) || !(p.label_smoothing >= 0 && p.label_smoothing < 0.5) ||
      !(p.rpo_alpha >= 0)) {
    return absl::InvalidArgumentError(
        "beta must be > 0, label_smoothing in [0, 0.5), "
        "rpo_alpha >= 0");
  }
  for (size_t k = 0; k < s.pairs.size(); ++k) {
    const auto& [chosen, rejected] = s.pairs[k];
    const size_t prompt = std::count(chosen.completion.begin(), chosen.completion.end(), 0);
    const int64_t c = static_cast<int64_t>(chosen.ids.size());
    const int64_t r = static_cast<int64_t>(rejected.ids.size());
    if (prompt == 0 || prompt == chosen.ids.size() || prompt == rejected.ids.size() ||
        std::max(c, r) > s.seq_len || (s.rows == 1 && c + r > s.seq_len)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pair ", k, ": needs a prompt, two completions, and at most seq_len (", s.seq_len,
          ") tokens in each of prompt + completion (in both together with one row)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<PairsSpec> ReadPairsSpec(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  PairsSpec s;
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    s.seq_len = j.at("seq_len").get<int64_t>();
    s.rows = j.at("rows").get<int64_t>();
    s.pairs_per_step = j.at("pairs_per_step").get<int64_t>();
    s.pad_id = j.value("pad_id", 0);
    s.preference.beta = j.at("beta").get<double>();
    const std::string loss = j.at("loss").get<std::string>();
    if (!ParsePreferenceLoss(loss, &s.preference.loss)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": loss \"", loss, "\" is none of sigmoid, ipo, hinge"));
    }
    s.preference.label_smoothing = j.value("label_smoothing", 0.0);
    s.preference.rpo_alpha = j.value("rpo_alpha", 0.0);
    s.lr = j.at("lr").get<double>();
    s.warmup = j.at("warmup").get<int64_t>();
    s.weight_decay = j.at("weight_decay").get<double>();
    s.max_grad_norm = j.at("max_grad_norm").get<double>();
    for (const nlohmann::json& pair : j.at("pairs")) s.pairs.push_back(ToSequences(pair));
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
  RETURN_IF_ERROR(Annotate(CheckSpec(s), path));
  return s;
}

// Step `step`'s micro-batches: pairs_per_step pairs from pair step * pairs_per_step on
// (wrapping around), packed in order; pair_index names the spec's pairs.
absl::StatusOr<std::vector<PairBatch>> PackStep(const PairsSpec& s, int64_t step) {
  const int64_t n = static_cast<int64_t>(s.pairs.size()), P = s.pairs_per_step;
  std::vector<SequencePair> pairs;
  std::vector<int64_t> index;
  for (int64_t k = 0; k < P; ++k) {
    index.push_back((step * P + k) % n);
    pairs.push_back(s.pairs[index.back()]);
  }
  std::vector<PairBatch> batches;
  for (int64_t first = 0; first < P;) {
    PairBatch& b = batches.emplace_back();
    const int64_t taken = PackPairs(pairs, first, s.rows, s.seq_len, s.pad_id, &b);
    if (taken == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pair ", index[first], " does not fit a micro-batch of ", s.rows, " x ", s.seq_len));
    }
    for (int64_t& p : b.pair_index) p = index[p];
    first += taken;
  }
  return batches;
}

// The micro-batches every step packs into (the first step's); InvalidArgument naming a
// step of `steps` that packs into another count.
absl::StatusOr<int64_t> MicroBatchesPerStep(const PairsSpec& s, int64_t steps) {
  ASSIGN_OR_RETURN(const std::vector<PairBatch> first, PackStep(s, 0));
  const int64_t M = static_cast<int64_t>(first.size());
  for (int64_t step = 1; step < steps; ++step) {
    ASSIGN_OR_RETURN(const std::vector<PairBatch> b, PackStep(s, step));
    if (static_cast<int64_t>(b.size()) != M) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", step + 1, " packs into ", b.size(), " micro-batches, step 1 into ", M,
          ": a job's steps all have the same count; make the pairs' lengths pack alike"));
    }
  }
  return M;
}

// The model, its store and a pipeline over it. Destroyed pipeline first, then unpinned.
struct Engine {
  ModelConfig config;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<HostStore> store;
  std::unique_ptr<GradSlabPool> pool;
  std::unique_ptr<Pipeline> pipeline;
  bool pinned = false;
  ~Engine() {
    pipeline.reset();
    if (pinned) {
      backend->UnpinHostRange(store->transfer_base());
      backend->UnpinHostRange(pool->base());
    }
  }
};

absl::Status LoadFolder(const std::string& dir, HostStore* store) {
  ASSIGN_OR_RETURN(const ModelTensorReader reader, ModelTensorReader::OpenFolder(dir));
  return Annotate(LoadWeights(reader, store), absl::StrCat("loading ", dir));
}

// A DPO job's pipeline for steps of M micro-batches of the spec's rows x seq_len, whose
// forward-only pass takes the M micro-batches of a step at once.
absl::StatusOr<std::unique_ptr<Pipeline>> MakePipeline(const Engine& e, const PairsSpec& s,
                                                       int64_t M, bool cuda) {
  PipelineOptions po;
  po.micro_batches = M;
  po.tokens_per_micro_batch = s.rows * s.seq_len;
  po.checkpoint_every = 2;
  po.loss_chunk_tokens = 256;
  po.checkpoints_on_host = cuda;
  po.eval_micro_batches = M;
  po.objective.kind = ObjectiveKind::kPreference;
  po.objective.preference_loss = s.preference.loss;
  po.objective.beta = s.preference.beta;
  po.objective.label_smoothing = s.preference.label_smoothing;
  return Pipeline::Create(e.config, e.store.get(), e.pool.get(), e.backend.get(), po);
}

// POLICY_DIR's config and layout in a store (no weights yet), its slabs, pinned.
absl::StatusOr<std::unique_ptr<Engine>> MakeEngine(const Options& o, const PairsSpec& s) {
  auto e = std::make_unique<Engine>();
  ASSIGN_OR_RETURN(e->config, LoadModelConfig(o.policy_dir + "/config.json"));
  e->config.rope_scaling.dynamic_seq_len = s.seq_len;  // as a job of that seq_len
  ASSIGN_OR_RETURN(e->backend, CreateBackend(BackendRequest{o.backend}));
  const ModelLayout layout = BuildLayout(e->config);
  ASSIGN_OR_RETURN(e->store, HostStore::Create(layout));
  // Slabs as a job sizes them with clipping (every piece held until the norm is known).
  ASSIGN_OR_RETURN(e->pool, GradSlabPool::Create(GradSlabsNeeded(layout, /*clipping=*/true),
                                                 GradSlabElements(layout)));
  RETURN_IF_ERROR(e->backend->PinHostRange(e->store->transfer_base(), e->store->transfer_bytes()));
  if (absl::Status st = e->backend->PinHostRange(e->pool->base(), e->pool->bytes()); !st.ok()) {
    e->backend->UnpinHostRange(e->store->transfer_base());
    return st;
  }
  e->pinned = true;
  return e;
}

absl::Status WriteJson(const std::string& path, const nlohmann::json& j) {
  std::ofstream f(path);
  f << j.dump() << "\n";
  f.close();
  if (!f) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

// Every pair's (chosen, rejected) log-probabilities under the store's weights now, by the
// reference pass (its file in `out`, removed after).
absl::StatusOr<ReferenceLogps> PairLogps(Engine& e, const PairsSpec& s, int64_t M,
                                         const std::string& out) {
  const std::string cache = out + "/.pair_logps.json";
  std::filesystem::remove(cache);
  ASSIGN_OR_RETURN(
      ReferenceLogps logps,
      ReferenceLogps::Open(cache, "dpo_reference", static_cast<int64_t>(s.pairs.size())));
  RETURN_IF_ERROR(
      RunReferencePass(e.pipeline.get(), s.pairs, s.rows, s.seq_len, s.pad_id, M, &logps));
  std::filesystem::remove(cache);
  return logps;
}

nlohmann::json LogpsJson(const ReferenceLogps& logps) {
  nlohmann::json j = nlohmann::json::array();
  for (int64_t k = 0; k < logps.done(); ++k) {
    const auto [chosen, rejected] = logps.Get(k);
    j.push_back({{"chosen", chosen}, {"rejected", rejected}});
  }
  return j;
}

// A step's loss and TRL's metrics (TRL's names), its aux loss (MoE) and gradient norm.
nlohmann::json MetricsJson(const PreferenceMetrics& m, const StepResult& r) {
  return {{"loss", m.loss},
          {"rewards/chosen", m.rewards_chosen},
          {"rewards/rejected", m.rewards_rejected},
          {"rewards/accuracies", m.rewards_accuracies},
          {"rewards/margins", m.rewards_margins},
          {"logps/chosen", m.logps_chosen},
          {"logps/rejected", m.logps_rejected},
          {"pairs", m.pairs},
          {"aux_loss", r.aux_loss},
          {"aux_loss_coef", r.aux_loss_coef},
          {"total", m.loss + r.aux_loss_coef * r.aux_loss},  // what was differentiated
          {"completion_nll", r.loss},  // mean -log p over the step's completion tokens
          {"grad_norm", r.grad_norm}};
}

// Each of the step's pairs' values in step order: {"pair", "chosen", "rejected"}.
nlohmann::json StepPairsJson(const std::vector<PairBatch>& step,
                             const std::vector<double>& token_values) {
  nlohmann::json j = nlohmann::json::array();
  size_t offset = 0;
  for (const PairBatch& b : step) {
    const std::vector<double> logps = SequenceLogps(b, &token_values[offset]);
    offset += b.batch.tokens.size();
    for (int64_t k = 0; k < b.pairs(); ++k) {
      j.push_back(
          {{"pair", b.pair_index[k]}, {"chosen", logps[2 * k]}, {"rejected", logps[2 * k + 1]}});
    }
  }
  return j;
}

// The trainable tensors' gradients, f32 under their HF names, from a recorded step.
absl::Status WriteGradients(const std::string& path, const HostStore& store,
                            const RecordingSink& sink) {
  std::vector<TensorToWrite> grads;
  for (int64_t u = 0; u < store.num_units(); ++u) {
    for (const TensorSlot& t : store.layout().units[u].tensors) {
      if (!t.trainable) continue;
      const int64_t have = static_cast<int64_t>(sink.grads[u].size());
      MT_CHECK_MSG(t.offset + t.num_elements <= have, "no gradient for trainable %s",
                   t.name.c_str());
      grads.push_back({t.name, DType::kF32, t.shape, sink.grads[u].data() + t.offset});
    }
  }
  return WriteSafetensors(path, grads, {{"format", "pt"}});
}

// (b): the first step's values and gradients, the weights unchanged.
absl::Status FirstStep(Engine& e, const PairsSpec& s, const ReferenceLogps& ref,
                       const std::string& out) {
  ASSIGN_OR_RETURN(std::vector<PairBatch> step, PackStep(s, 0));
  const std::vector<MicroBatch> batches = PreferenceStepBatches(&step, &ref, s.preference);
  RecordingSink sink(e.backend.get(), e.pool.get(), e.store->num_units());
  ASSIGN_OR_RETURN(const StepResult r, e.pipeline->Step(batches, &sink));
  const PreferenceStep dpo = PreferenceStepMetrics(step, r.token_values, &ref, s.preference);
  RETURN_IF_ERROR(WriteGradients(out + "/grads.safetensors", *e.store, sink));
  int64_t sequence_tokens = 0;
  for (const PairBatch& b : step) {
    for (const int64_t k : b.pair_index) {
      sequence_tokens +=
          static_cast<int64_t>(s.pairs[k].first.ids.size() + s.pairs[k].second.ids.size());
    }
  }
  nlohmann::json j = MetricsJson(dpo.metrics, r);
  j["micro_batches"] = step.size();
  j["rows"] = s.rows;
  j["seq_len"] = s.seq_len;
  j["pad_id"] = s.pad_id;
  // The rows' tokens outside every sequence (each its own segment of one pad_id).
  j["padding_tokens"] = static_cast<int64_t>(step.size()) * s.rows * s.seq_len - sequence_tokens;
  j["pair_logps"] = StepPairsJson(step, r.token_values);
  std::printf(
      "step 1: loss %.6f, rewards/chosen %.3g, rewards/accuracies %.3f, %lld pairs in "
      "%zu micro-batches\n",
      dpo.metrics.loss, dpo.metrics.rewards_chosen, dpo.metrics.rewards_accuracies,
      static_cast<long long>(dpo.metrics.pairs), step.size());
  return WriteJson(out + "/step.json", j);
}

// (c): `steps` AdamW steps by `opt`; returns curve.json's contents.
absl::StatusOr<nlohmann::json> Train(Engine& e, const PairsSpec& s, const ReferenceLogps& ref,
                                     int64_t steps, HostOptimizer* opt) {
  const ScheduleOptions schedule{ScheduleType::kConstant, s.lr, s.warmup, steps, 0};
  nlohmann::json losses = nlohmann::json::array(), metrics = nlohmann::json::array();
  for (int64_t step = 0; step < steps; ++step) {
    ASSIGN_OR_RETURN(std::vector<PairBatch> pairs, PackStep(s, step));
    const std::vector<MicroBatch> batches = PreferenceStepBatches(&pairs, &ref, s.preference);
    const double lr = LearningRate(schedule, step);
    opt->BeginStep(lr, step + 1);
    ASSIGN_OR_RETURN(const StepResult r, e.pipeline->Step(batches, opt));
    const PreferenceMetrics m =
        PreferenceStepMetrics(pairs, r.token_values, &ref, s.preference).metrics;
    nlohmann::json j = MetricsJson(m, r);
    j["lr"] = lr;
    losses.push_back(m.loss);
    metrics.push_back(std::move(j));
    std::printf("step %lld: loss %.6f, rewards/accuracies %.3f, rewards/margins %.4g\n",
                static_cast<long long>(step + 1), m.loss, m.rewards_accuracies, m.rewards_margins);
  }
  opt->Drain();
  RETURN_IF_ERROR(opt->status());
  return nlohmann::json{{"losses", losses}, {"steps", metrics}};
}

absl::Status Run(const Options& o) {
  std::filesystem::create_directories(o.out);
  ASSIGN_OR_RETURN(const PairsSpec s, ReadPairsSpec(o.pairs_json));
  ASSIGN_OR_RETURN(const int64_t M, MicroBatchesPerStep(s, std::max<int64_t>(o.steps, 1)));
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, MakeEngine(o, s));
  const bool cuda = o.backend == "cuda";
  const std::string ref_dir = o.reference_dir.empty() ? o.policy_dir : o.reference_dir;
  std::error_code error;
  const bool own_reference = !std::filesystem::equivalent(ref_dir, o.policy_dir, error);

  // (a) The reference's values; then the policy's weights, in a fresh pipeline (none of the
  // reference's weights left in its slots).
  RETURN_IF_ERROR(LoadFolder(ref_dir, e->store.get()));
  ASSIGN_OR_RETURN(e->pipeline, MakePipeline(*e, s, M, cuda));
  ASSIGN_OR_RETURN(const ReferenceLogps ref, PairLogps(*e, s, M, o.out));
  RETURN_IF_ERROR(WriteJson(o.out + "/reference_logps.json", LogpsJson(ref)));
  if (own_reference) {
    e->pipeline.reset();
    RETURN_IF_ERROR(LoadFolder(o.policy_dir, e->store.get()));
    ASSIGN_OR_RETURN(e->pipeline, MakePipeline(*e, s, M, cuda));
  }

  // (b), (c)
  RETURN_IF_ERROR(FirstStep(*e, s, ref, o.out));
  HostOptimizerOptions oo;
  oo.weight_decay = s.weight_decay;
  oo.max_grad_norm = s.max_grad_norm;
  HostOptimizer opt(e->store.get(), e->pool.get(), e->backend.get(), oo);
  ASSIGN_OR_RETURN(const nlohmann::json curve, Train(*e, s, ref, o.steps, &opt));
  RETURN_IF_ERROR(WriteJson(o.out + "/curve.json", curve));

  // (d) The trained weights' values, and the checkpoint.
  ASSIGN_OR_RETURN(const ReferenceLogps final_logps, PairLogps(*e, s, M, o.out));
  RETURN_IF_ERROR(WriteJson(o.out + "/policy_logps_final.json", LogpsJson(final_logps)));
  TrainerState state;
  state.step = o.steps;
  ASSIGN_OR_RETURN(const std::string ck,
                   SaveCheckpoint(o.out, e->config, *e->store, state, CheckpointOptions{}));
  std::printf(
      "%s: %lld pairs, %lld a step in %lld micro-batches of %lld x %lld; after %lld "
      "steps loss %s; checkpoint %s\n",
      o.backend.c_str(), static_cast<long long>(s.pairs.size()),
      static_cast<long long>(s.pairs_per_step), static_cast<long long>(M),
      static_cast<long long>(s.rows), static_cast<long long>(s.seq_len),
      static_cast<long long>(o.steps),
      curve["losses"].empty() ? "-" : curve["losses"].back().dump().c_str(), ck.c_str());
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  Options o;
  if (!ParseOptions(argc, argv, &o)) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  if (absl::Status s = Run(o); !s.ok()) {
    std::fprintf(stderr, "dpo_reference: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace megatrain::testing

int main(int argc, char** argv) {
  megatrain::SetEngineSettings(
      megatrain::EngineSettingsFromEnvironment([](const char* name) { return std::getenv(name); }));
  return megatrain::testing::Main(argc, argv);
}
