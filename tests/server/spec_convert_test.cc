// The API's structured spec becomes the same JobSpec as the YAML that says the same, with
// no YAML in between; its choices are checked by name, as the YAML parser checks them.
#include "server/spec_convert.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace megatrain::server {
namespace {

using ::testing::HasSubstr;

constexpr char kConfig[] =
    R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,)"
    R"( "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,)"
    R"( "vocab_size": 300, "rms_norm_eps": 1e-05, "rope_theta": 10000.0})";

v1::JobSpec Structured() {
  v1::JobSpec m;
  m.set_name("structured");
  m.set_backend("cpu");
  m.mutable_model()->set_config_json(kConfig);
  m.mutable_model()->set_init_seed(7);
  v1::JobSpec::Data* d = m.mutable_data();
  d->set_path("data/d.jsonl");
  d->set_format("sharegpt");
  d->set_tokenizer("tok/tokenizer.json");
  d->set_chat_template("qwen2.5");
  d->set_packing("pad");
  d->set_truncation("split");
  d->set_on_bad_line("skip");
  d->set_seq_len(128);
  v1::JobSpec::Train* t = m.mutable_train();
  t->set_steps(12);
  t->set_tokens_per_step(512);
  t->set_lr(3e-4);
  t->set_schedule("cosine");
  t->set_warmup_steps(2);
  t->set_max_grad_norm(0);
  t->set_activation_checkpoints("host");
  t->set_gradient_reduce("host");
  t->add_freeze("embed_tokens");
  t->add_freeze("layers.0");
  m.mutable_checkpoint()->set_dir("ckpt");
  m.mutable_checkpoint()->set_keep_last(0);
  m.mutable_checkpoint()->set_background(false);
  return m;
}

constexpr char kSameAsYaml[] = R"(name: structured
backend: cpu
model:
  config: {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 300, "rms_norm_eps": 1e-05, "rope_theta": 10000.0}
  init_seed: 7
data: {path: data/d.jsonl, format: sharegpt, tokenizer: tok/tokenizer.json,
       chat_template: qwen2.5, packing: pad, truncation: split, on_bad_line: skip, seq_len: 128}
train: {steps: 12, tokens_per_step: 512, lr: 0.0003, schedule: cosine, warmup_steps: 2,
        max_grad_norm: 0, activation_checkpoints: host, gradient_reduce: host,
        freeze: [embed_tokens, layers.0]}
checkpoint: {dir: ckpt, keep_last: 0, background: false}
)";

TEST(SpecFromMessage, IsTheJobSpecOfTheSameYaml) {
  absl::StatusOr<JobSpec> structured = SpecFromMessage(Structured(), "/base");
  ASSERT_TRUE(structured.ok()) << structured.status();
  absl::StatusOr<JobSpec> parsed = ParseJobSpec(kSameAsYaml, "/base");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(JobSpecToYaml(*structured), JobSpecToYaml(*parsed));
  EXPECT_EQ(structured->Fingerprint(), parsed->Fingerprint());
  EXPECT_EQ(structured->data_path, "/base/data/d.jsonl");
  EXPECT_EQ(structured->tokenizer, TokenizerSource::kFile);
  EXPECT_EQ(structured->tokenizer_path, "/base/tok/tokenizer.json");
  EXPECT_EQ(structured->chat_template, ChatTemplate::kQwen25);
  EXPECT_EQ(structured->schedule.total_steps, 12);
}

TEST(SpecFromMessage, UnsetFieldsKeepTheSpecsDefaults) {
  v1::JobSpec m;
  m.mutable_model()->set_path("/models/tiny");
  m.mutable_data()->set_path("/data/d.jsonl");
  absl::StatusOr<JobSpec> spec = SpecFromMessage(m, "");
  ASSERT_TRUE(spec.ok()) << spec.status();
  const JobSpec defaults;
  EXPECT_EQ(spec->steps, defaults.steps);
  EXPECT_EQ(spec->seq_len, defaults.seq_len);
  EXPECT_EQ(spec->max_grad_norm, defaults.max_grad_norm);
  EXPECT_EQ(spec->keep_last, defaults.keep_last);
  EXPECT_EQ(spec->tokenizer, TokenizerSource::kAuto);
  EXPECT_EQ(spec->packing, Packing::kPack);
}

TEST(SpecFromMessage, AnUnknownChoiceIsRefusedNamingTheFieldAndWhatItAllows) {
  v1::JobSpec m = Structured();
  m.mutable_data()->set_packing("diagonal");
  absl::StatusOr<JobSpec> spec = SpecFromMessage(m, "/base");
  ASSERT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()),
              HasSubstr("data.packing must be one of pack, pad; got 'diagonal'"));
}

TEST(SpecFromMessage, PassesTheOneValidationStage) {
  v1::JobSpec m = Structured();
  m.mutable_train()->set_beta1(1.5);
  EXPECT_THAT(std::string(SpecFromMessage(m, "/base").status().message()),
              HasSubstr("train.beta1 must be in [0, 0.999999], got 1.5"));
  m = Structured();
  m.mutable_model()->set_config_json("not json");
  EXPECT_THAT(std::string(SpecFromMessage(m, "/base").status().message()),
              HasSubstr("spec.model.config_json must be a JSON object"));
}

TEST(SpecFromMessage, AGenerateJobIsTheJobSpecOfTheSameYaml) {
  v1::JobSpec m;
  m.set_kind("eval");
  m.mutable_model()->set_path("ckpt");
  v1::JobSpec::Generate* g = m.mutable_generate();
  g->set_prompts("p.jsonl");
  g->add_prompt("Hi");
  g->set_output("o.jsonl");
  g->set_max_new_tokens(9);
  g->set_temperature(0.5);
  g->set_top_k(4);
  g->set_top_p(0.8);
  g->set_seed(3);
  g->add_stop("\n");
  g->add_stop_ids(2);
  g->set_ignore_eos(true);
  g->set_tokenizer("byte");
  g->set_max_sequences(6);
  g->set_answer_pattern("#### (\\d+)");
  absl::StatusOr<JobSpec> got = SpecFromMessage(m, "/base");
  ASSERT_TRUE(got.ok()) << got.status();
  absl::StatusOr<JobSpec> want = ParseJobSpec(
      "kind: eval\nmodel: {path: ckpt}\ngenerate: {prompts: p.jsonl, prompt: [Hi], output: "
      "o.jsonl, max_new_tokens: 9, temperature: 0.5, top_k: 4, top_p: 0.8, seed: 3, stop: "
      "[\"\\n\"], stop_ids: [2], ignore_eos: true, tokenizer: byte, max_sequences: 6, "
      "answer_pattern: \"#### (\\\\d+)\"}\n",
      "/base", "yaml");
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(JobSpecToYaml(*got), JobSpecToYaml(*want));
  m.mutable_train()->set_steps(5);
  absl::StatusOr<JobSpec> with_train = SpecFromMessage(m, "/base");
  ASSERT_FALSE(with_train.ok());
  EXPECT_THAT(with_train.status().message(), HasSubstr("'train' section"));
}

TEST(SpecFromMessage, LoraIsTheJobSpecOfTheSameYaml) {
  v1::JobSpec m = Structured();
  v1::JobSpec::Lora* l = m.mutable_lora();
  l->set_rank(8);
  l->set_alpha(12.5);
  l->set_rslora(true);
  l->add_target_modules("q_proj");
  l->add_target_modules("v_proj");
  l->set_init("gaussian");
  l->set_adapter("adapters/run1");
  absl::StatusOr<JobSpec> structured = SpecFromMessage(m, "/base");
  ASSERT_TRUE(structured.ok()) << structured.status();
  absl::StatusOr<JobSpec> parsed = ParseJobSpec(
      std::string(kSameAsYaml) +
          "lora: {rank: 8, alpha: 12.5, rslora: true, target_modules: [q_proj, v_proj], "
          "init: gaussian, adapter: adapters/run1}\n",
      "/base");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(JobSpecToYaml(*structured), JobSpecToYaml(*parsed));
  EXPECT_EQ(structured->Fingerprint(), parsed->Fingerprint());
  EXPECT_EQ(structured->lora_adapter, "/base/adapters/run1");
  EXPECT_EQ(structured->lora.init, LoraInit::kGaussian);
}

TEST(SpecFromMessage, LoraTakesThePeftDefaultsAsTheYamlDoes) {
  v1::JobSpec m = Structured();
  m.mutable_lora()->set_rank(16);
  absl::StatusOr<JobSpec> structured = SpecFromMessage(m, "/base");
  ASSERT_TRUE(structured.ok()) << structured.status();
  EXPECT_EQ(structured->lora.alpha, 32);  // 2 * rank
  EXPECT_TRUE(structured->lora.target_modules.empty());
  absl::StatusOr<JobSpec> parsed =
      ParseJobSpec(std::string(kSameAsYaml) + "lora: {rank: 16}\n", "/base");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(JobSpecToYaml(*structured), JobSpecToYaml(*parsed));
  absl::StatusOr<JobSpec> none = SpecFromMessage(Structured(), "/base");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->lora.rank, 0);
}

TEST(SpecFromMessage, DpoIsTheJobSpecOfTheSameYamlWithItsDefaults) {
  v1::JobSpec m = Structured();
  m.mutable_data()->set_format("");  // a dpo job's data are pairs
  std::string same = kSameAsYaml;
  same.replace(same.find("format: sharegpt, "), std::string("format: sharegpt, ").size(), "");
  m.mutable_dpo();  // the section alone: every default
  absl::StatusOr<JobSpec> defaults = SpecFromMessage(m, "/base");
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  absl::StatusOr<JobSpec> parsed = ParseJobSpec(same + "dpo: {}\n", "/base");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(JobSpecToYaml(*defaults), JobSpecToYaml(*parsed));
  EXPECT_EQ(defaults->dpo.beta, 0.1);

  v1::JobSpec::Dpo* d = m.mutable_dpo();
  d->set_beta(0.3);
  d->set_loss("ipo");
  d->set_rpo_alpha(0.5);
  d->set_max_length(16);
  d->set_truncation("keep_end");
  d->set_max_prompt_length(6);
  d->set_max_completion_length(8);
  d->set_reference("sft");
  absl::StatusOr<JobSpec> structured = SpecFromMessage(m, "/base");
  ASSERT_TRUE(structured.ok()) << structured.status();
  EXPECT_EQ(structured->dpo.reference, "/base/sft");
  parsed = ParseJobSpec(same +
                            "dpo: {beta: 0.3, loss: ipo, rpo_alpha: 0.5, max_length: 16, "
                            "truncation: keep_end, max_prompt_length: 6, "
                            "max_completion_length: 8, reference: sft}\n",
                        "/base");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(JobSpecToYaml(*structured), JobSpecToYaml(*parsed));
  EXPECT_EQ(structured->Fingerprint(), parsed->Fingerprint());
  d->set_loss("kto");
  EXPECT_THAT(std::string(SpecFromMessage(m, "/base").status().message()),
              HasSubstr("dpo.loss must be one of sigmoid, ipo, hinge; got 'kto'"));
}

TEST(SpecFromMessage, BadLoraFieldsAreRefusedAsTheYamlRefusesThem) {
  v1::JobSpec m = Structured();
  m.mutable_lora()->set_rank(8);
  m.mutable_lora()->set_init("x");
  EXPECT_THAT(std::string(SpecFromMessage(m, "/base").status().message()),
              HasSubstr("lora.init must be one of default, gaussian; got 'x'"));
  m = Structured();
  m.mutable_lora()->set_rank(8);
  m.mutable_lora()->add_target_modules("foo");
  EXPECT_THAT(std::string(SpecFromMessage(m, "/base").status().message()),
              HasSubstr("lora.target_modules[0] 'foo' is not a projection"));
  m = Structured();
  m.mutable_lora()->set_adapter("adapters/run1");  // no rank
  EXPECT_THAT(std::string(SpecFromMessage(m, "/base").status().message()),
              HasSubstr("lora.rank must be positive, got 0"));
  m = v1::JobSpec();
  m.set_kind("generate");
  m.mutable_model()->set_path("ckpt");
  m.mutable_generate()->add_prompt("Hi");
  m.mutable_lora()->set_rank(8);
  EXPECT_THAT(std::string(SpecFromMessage(m, "/base").status().message()),
              HasSubstr("'lora' section"));
}

TEST(SpecFromRequest, TheStructuredSpecNeedsAnAbsoluteBaseDir) {
  v1::SubmitJobRequest request;
  *request.mutable_spec() = Structured();
  request.set_base_dir("relative");
  EXPECT_THAT(std::string(SpecFromRequest(request).status().message()),
              HasSubstr("base_dir must be an absolute path"));
  request.set_base_dir("/base");
  EXPECT_TRUE(SpecFromRequest(request).ok());
}

}  // namespace
}  // namespace megatrain::server
