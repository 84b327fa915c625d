#include "server/spec_convert.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "engine/common/status.h"
#include "nlohmann/json.hpp"

namespace megatrain::server {

namespace {

// Each choice of the message, where set, parsed into the spec's type.
template <typename E>
absl::Status SetEnum(const char* field, const std::string& name, E* out) {
  if (name.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(*out, ParseSpecName<E>(field, name));
  return absl::OkStatus();
}

absl::Status FromModel(const v1::JobSpec::Model& m, const std::string& base_dir, JobSpec* spec) {
  spec->model_path = ResolveSpecPath(base_dir, m.path());
  if (!m.config_json().empty()) {
    // Kept as the YAML parser keeps an inline config: compact JSON, keys sorted.
    const nlohmann::json j = nlohmann::json::parse(m.config_json(), nullptr, false);
    if (!j.is_object()) {
      return absl::InvalidArgumentError("spec.model.config_json must be a JSON object");
    }
    spec->model_config_json = j.dump();
  }
  spec->init_seed = m.init_seed();
  return absl::OkStatus();
}

absl::Status FromData(const v1::JobSpec::Data& d, const std::string& base_dir, JobSpec* spec) {
  spec->data_path = ResolveSpecPath(base_dir, d.path());
  RETURN_IF_ERROR(SetEnum("data.format", d.format(), &spec->data_format));
  if (!d.text_field().empty()) spec->text_field = d.text_field();
  if (!d.tokenizer().empty()) RETURN_IF_ERROR(SetSpecTokenizer(d.tokenizer(), base_dir, spec));
  RETURN_IF_ERROR(SetEnum("data.chat_template", d.chat_template(), &spec->chat_template));
  spec->chat_date = d.chat_date();
  RETURN_IF_ERROR(SetEnum("data.packing", d.packing(), &spec->packing));
  RETURN_IF_ERROR(SetEnum("data.truncation", d.truncation(), &spec->truncation));
  RETURN_IF_ERROR(SetEnum("data.on_bad_line", d.on_bad_line(), &spec->on_bad_line));
  spec->data_cache_dir = ResolveSpecPath(base_dir, d.cache_dir());
  spec->tokenize_threads = d.tokenize_threads();
  if (d.seq_len() != 0) spec->seq_len = d.seq_len();
  spec->data_seed = d.seed();
  return absl::OkStatus();
}

absl::Status FromEval(const v1::JobSpec::Eval& e, const std::string& base_dir, JobSpec* spec) {
  spec->eval.path = ResolveSpecPath(base_dir, e.path());
  spec->eval.format = spec->data_format;
  RETURN_IF_ERROR(SetEnum("eval.format", e.format(), &spec->eval.format));
  spec->eval.every_steps = e.every_steps();
  spec->eval.max_rows = e.max_rows();
  return absl::OkStatus();
}

absl::Status FromTrain(const v1::JobSpec::Train& t, JobSpec* spec) {
  if (t.steps() != 0) spec->steps = t.steps();
  spec->tokens_per_step = t.tokens_per_step();
  spec->micro_batch_rows = t.micro_batch_rows();
  spec->micro_batches = t.micro_batches();
  if (t.devices() != 0) spec->devices = t.devices();
  RETURN_IF_ERROR(SetEnum("train.gradient_reduce", t.gradient_reduce(), &spec->gradient_reduce));
  if (t.has_lr()) spec->schedule.lr = t.lr();
  RETURN_IF_ERROR(SetEnum("train.schedule", t.schedule(), &spec->schedule.type));
  spec->schedule.warmup_steps = t.warmup_steps();
  if (t.has_min_lr_ratio()) spec->schedule.min_lr_ratio = t.min_lr_ratio();
  if (t.has_weight_decay()) spec->weight_decay = t.weight_decay();
  if (t.has_beta1()) spec->beta1 = t.beta1();
  if (t.has_beta2()) spec->beta2 = t.beta2();
  if (t.has_eps()) spec->eps = t.eps();
  if (t.has_max_grad_norm()) spec->max_grad_norm = t.max_grad_norm();
  spec->activation_checkpoint_every = t.activation_checkpoint_every();
  if (t.loss_chunk_tokens() != 0) spec->loss_chunk_tokens = t.loss_chunk_tokens();
  if (t.has_router_aux_loss_coef()) spec->router_aux_loss_coef = t.router_aux_loss_coef();
  spec->freeze.assign(t.freeze().begin(), t.freeze().end());
  RETURN_IF_ERROR(SetEnum("train.activation_checkpoints", t.activation_checkpoints(),
                          &spec->activation_checkpoints));
  spec->schedule.total_steps = spec->steps;
  return absl::OkStatus();
}

// A training job's adapters, defaulted as the YAML's lora section is: alpha 2 * rank, and
// all-linear is every projection (an empty list).
absl::Status FromLora(const v1::JobSpec::Lora& l, const std::string& base_dir, JobSpec* spec) {
  LoraConfig& lora = spec->lora;
  lora.rank = l.rank();
  lora.alpha = l.alpha() != 0 ? l.alpha() : 2.0 * static_cast<double>(l.rank());
  lora.rslora = l.rslora();
  lora.target_modules.assign(l.target_modules().begin(), l.target_modules().end());
  if (lora.target_modules == std::vector<std::string>{"all-linear"}) lora.target_modules.clear();
  RETURN_IF_ERROR(SetEnum("lora.init", l.init(), &lora.init));
  spec->lora_adapter = ResolveSpecPath(base_dir, l.adapter());
  return absl::OkStatus();
}

// A preference job, defaulted as the YAML's dpo section is.
absl::Status FromDpo(const v1::JobSpec::Dpo& d, const std::string& base_dir, JobSpec* spec) {
  JobSpec::Dpo& dpo = spec->dpo;
  dpo.enabled = true;
  if (d.has_beta()) dpo.beta = d.beta();
  RETURN_IF_ERROR(SetEnum("dpo.loss", d.loss(), &dpo.loss));
  dpo.label_smoothing = d.label_smoothing();
  dpo.rpo_alpha = d.rpo_alpha();
  dpo.reference_free = d.reference_free();
  dpo.max_length = d.max_length();
  dpo.max_prompt_length = d.max_prompt_length();
  dpo.max_completion_length = d.max_completion_length();
  dpo.reference = ResolveSpecPath(base_dir, d.reference());
  return SetEnum("dpo.truncation", d.truncation(), &dpo.truncation);
}

void FromGenerate(const v1::JobSpec::Generate& m, const std::string& base_dir, JobSpec* spec) {
  GenerateSpec& g = spec->generate;
  g.prompts_path = ResolveSpecPath(base_dir, m.prompts());
  g.prompts.assign(m.prompt().begin(), m.prompt().end());
  g.output_path = ResolveSpecPath(base_dir, m.output());
  if (m.max_new_tokens() != 0) g.max_new_tokens = m.max_new_tokens();
  g.temperature = m.temperature();
  g.top_k = m.top_k();
  if (m.has_top_p()) g.top_p = m.top_p();
  g.seed = m.seed();
  g.stop_strings.assign(m.stop().begin(), m.stop().end());
  g.stop_ids.assign(m.stop_ids().begin(), m.stop_ids().end());
  g.ignore_eos = m.ignore_eos();
  g.chat = m.chat();
  if (!m.tokenizer().empty()) g.tokenizer = ResolveTokenizerText(base_dir, m.tokenizer());
  g.max_sequences = m.max_sequences();
  g.answer_pattern = m.answer_pattern();
}

// A generate or eval job's message: its generate section, and none of a training job's.
absl::Status FromGenerateJob(const v1::JobSpec& message, const std::string& base_dir,
                             JobSpec* spec) {
  const std::pair<const char*, bool> training[] = {{"data", message.has_data()},
                                                   {"eval", message.has_eval()},
                                                   {"train", message.has_train()},
                                                   {"lora", message.has_lora()},
                                                   {"dpo", message.has_dpo()}};
  for (const auto& [section, set] : training) {
    if (set) {
      return absl::InvalidArgumentError(absl::StrCat("a job of kind ", SpecName(spec->kind),
                                                     " has no '", section,
                                                     "' section (only training jobs do)"));
    }
  }
  FromGenerate(message.generate(), base_dir, spec);
  return absl::OkStatus();
}

void FromCheckpoint(const v1::JobSpec::Checkpoint& c, const std::string& base_dir,
                    JobSpec* spec) {
  spec->checkpoint_dir = ResolveSpecPath(base_dir, c.dir());
  spec->checkpoint_every_steps = c.every_steps();
  if (c.has_keep_last()) spec->keep_last = c.keep_last();
  if (c.max_shard_bytes() != 0) spec->max_shard_bytes = c.max_shard_bytes();
  if (c.has_background()) spec->checkpoint_background = c.background();
}

}  // namespace

absl::StatusOr<JobSpec> SpecFromMessage(const v1::JobSpec& message, const std::string& base_dir) {
  JobSpec spec;
  if (!message.name().empty()) spec.name = message.name();
  if (!message.backend().empty()) spec.backend = message.backend();
  spec.device_memory_cap_bytes = message.device_memory_cap_bytes();
  RETURN_IF_ERROR(SetEnum("kind", message.kind(), &spec.kind));
  RETURN_IF_ERROR(FromModel(message.model(), base_dir, &spec));
  if (spec.kind == JobKind::kTrain) {
    RETURN_IF_ERROR(FromData(message.data(), base_dir, &spec));
    RETURN_IF_ERROR(FromEval(message.eval(), base_dir, &spec));
    RETURN_IF_ERROR(FromTrain(message.train(), &spec));
    RETURN_IF_ERROR(FromLora(message.lora(), base_dir, &spec));
    if (message.has_dpo()) RETURN_IF_ERROR(FromDpo(message.dpo(), base_dir, &spec));
  } else {
    RETURN_IF_ERROR(FromGenerateJob(message, base_dir, &spec));
  }
  FromCheckpoint(message.checkpoint(), base_dir, &spec);
  RETURN_IF_ERROR(ValidateJobSpec(spec));
  return spec;
}

absl::StatusOr<JobSpec> SpecFromRequest(const v1::SubmitJobRequest& request) {
  if (!request.base_dir().empty() && request.base_dir()[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("base_dir must be an absolute path, got '", request.base_dir(), "'"));
  }
  switch (request.source_case()) {
    case v1::SubmitJobRequest::kSpecYaml:
      return ParseJobSpec(request.spec_yaml(), request.base_dir(), "job spec");
    case v1::SubmitJobRequest::kSpec: {
      absl::StatusOr<JobSpec> spec = SpecFromMessage(request.spec(), request.base_dir());
      if (!spec.ok()) return Annotate(spec.status(), "job spec");
      return spec;
    }
    default:
      return absl::InvalidArgumentError("the request has no spec (set spec_yaml or spec)");
  }
}

v1::JobPlan JobPlanMessage(const PlanSummary& plan) {
  v1::JobPlan out;
  out.set_micro_batch_rows(plan.micro_batch_rows);
  out.set_micro_batches(plan.micro_batches);
  out.set_checkpoint_every(plan.checkpoint_every);
  out.set_checkpoints_on_host(plan.checkpoints_on_host);
  out.set_weight_slots(plan.weight_slots);
  out.set_kept_layers(plan.kept_layers);
  out.set_eval_micro_batches(plan.eval_micro_batches);
  out.set_sequences(plan.sequences);
  out.set_mlp_tile_tokens(plan.mlp_tile_tokens);
  out.set_nvme_layers(plan.nvme_layers);
  out.set_nvme_bytes(plan.nvme_bytes);
  out.set_devices(plan.devices);
  out.set_reduce_seconds(plan.reduce_seconds);
  out.set_tokens_per_step(plan.tokens_per_step);
  out.set_step_seconds(plan.step_seconds);
  out.set_tokens_per_second(plan.tokens_per_second);
  out.set_model_tflops(plan.model_tflops);
  out.set_bound(plan.bound);
  out.set_compute_seconds(plan.compute_seconds);
  out.set_pcie_seconds(plan.pcie_seconds);
  out.set_optimizer_seconds(plan.optimizer_seconds);
  out.set_h2d_bytes(plan.h2d_bytes);
  out.set_d2h_bytes(plan.d2h_bytes);
  out.set_device_bytes(plan.device_bytes);
  out.set_host_bytes(plan.host_bytes);
  out.set_text(plan.text);
  for (const std::string& w : plan.warnings) out.add_warnings(w);
  return out;
}

void PreferenceToMessage(const PreferenceReport& report, v1::Preference* out) {
  out->set_rewards_chosen(report.rewards_chosen);
  out->set_rewards_rejected(report.rewards_rejected);
  out->set_rewards_accuracies(report.rewards_accuracies);
  out->set_rewards_margins(report.rewards_margins);
  out->set_logps_chosen(report.logps_chosen);
  out->set_logps_rejected(report.logps_rejected);
  out->set_pairs(report.pairs);
}

PreferenceReport PreferenceFromMessage(const v1::Preference& message) {
  return PreferenceReport{message.rewards_chosen(),     message.rewards_rejected(),
                          message.rewards_accuracies(), message.rewards_margins(),
                          message.logps_chosen(),       message.logps_rejected(),
                          message.pairs()};
}

absl::Status CheckJobFiles(const JobSpec& spec, const FileRoots& roots,
                           const std::string& own_dir) {
  std::vector<std::pair<const char*, std::string>> paths = {{"model.path", spec.model_path},
                                                            {"data.path", spec.data_path},
                                                            {"data.cache_dir", spec.data_cache_dir},
                                                            {"checkpoint.dir", spec.checkpoint_dir}};
  if (spec.tokenizer == TokenizerSource::kFile) paths.push_back({"data.tokenizer", spec.tokenizer_path});
  if (!spec.lora_adapter.empty()) paths.push_back({"lora.adapter", spec.lora_adapter});
  if (!spec.dpo.reference.empty()) paths.push_back({"dpo.reference", spec.dpo.reference});
  const GenerateSpec& g = spec.generate;
  if (spec.kind != JobKind::kTrain) {
    paths.push_back({"generate.prompts", g.prompts_path});
    paths.push_back({"generate.output", g.output_path});
    if (!IsTokenizerName(g.tokenizer)) paths.push_back({"generate.tokenizer", g.tokenizer});
  }
  for (const auto& [field, path] : paths) {
    if (path.empty()) continue;
    RETURN_IF_ERROR(CheckPathAllowed(field, path, roots, own_dir));
  }
  // Its inputs, and its folders (a file named as a folder is refused before any is made).
  RETURN_IF_ERROR(ValidateJobInputs(spec));
  if (!spec.checkpoint_dir.empty()) {
    RETURN_IF_ERROR(CheckWritableFolder("checkpoint.dir", spec.checkpoint_dir));
  }
  if (!spec.data_cache_dir.empty()) {
    RETURN_IF_ERROR(CheckWritableFolder("data.cache_dir", spec.data_cache_dir));
  }
  if (!g.output_path.empty()) {
    RETURN_IF_ERROR(CheckWritableFolder(
        "generate.output", std::filesystem::path(g.output_path).parent_path().string()));
  }
  return absl::OkStatus();
}

}  // namespace megatrain::server
