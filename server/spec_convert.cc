#include "server/spec_convert.h"

#include "absl/strings/str_cat.h"
#include "engine/common/printable.h"
#include "engine/common/status.h"
#include "yaml-cpp/yaml.h"

namespace megatrain::server {

std::string SpecMessageToYaml(const v1::JobSpec& s) {
  YAML::Emitter out;
  out.SetDoublePrecision(15);
  out << YAML::BeginMap;
  auto str = [&](const char* key, const std::string& v) {
    if (!v.empty()) out << YAML::Key << key << YAML::Value << YAML::DoubleQuoted << v;
  };
  auto num = [&](const char* key, int64_t v) {
    if (v != 0) out << YAML::Key << key << YAML::Value << v;
  };
  str("name", s.name());
  str("backend", s.backend());
  num("device_memory_cap_bytes", s.device_memory_cap_bytes());
  if (s.has_model()) {
    out << YAML::Key << "model" << YAML::Value << YAML::BeginMap;
    str("path", s.model().path());
    if (!s.model().config_json().empty()) {
      out << YAML::Key << "config" << YAML::Value << YAML::Load(s.model().config_json());
    }
    num("init_seed", static_cast<int64_t>(s.model().init_seed()));
    out << YAML::EndMap;
  }
  if (s.has_data()) {
    const v1::JobSpec::Data& d = s.data();
    out << YAML::Key << "data" << YAML::Value << YAML::BeginMap;
    str("path", d.path());
    str("format", d.format());
    str("text_field", d.text_field());
    str("tokenizer", d.tokenizer());
    str("chat_template", d.chat_template());
    str("chat_date", d.chat_date());
    str("packing", d.packing());
    str("truncation", d.truncation());
    str("on_bad_line", d.on_bad_line());
    str("cache_dir", d.cache_dir());
    num("tokenize_threads", d.tokenize_threads());
    num("seq_len", d.seq_len());
    num("seed", static_cast<int64_t>(d.seed()));
    out << YAML::EndMap;
  }
  if (s.has_train()) {
    const v1::JobSpec::Train& t = s.train();
    out << YAML::Key << "train" << YAML::Value << YAML::BeginMap;
    num("steps", t.steps());
    num("tokens_per_step", t.tokens_per_step());
    num("micro_batch_rows", t.micro_batch_rows());
    num("micro_batches", t.micro_batches());
    if (t.has_lr()) out << YAML::Key << "lr" << YAML::Value << t.lr();
    str("schedule", t.schedule());
    num("warmup_steps", t.warmup_steps());
    if (t.has_min_lr_ratio()) out << YAML::Key << "min_lr_ratio" << YAML::Value << t.min_lr_ratio();
    if (t.has_weight_decay()) out << YAML::Key << "weight_decay" << YAML::Value << t.weight_decay();
    if (t.has_beta1()) out << YAML::Key << "beta1" << YAML::Value << t.beta1();
    if (t.has_beta2()) out << YAML::Key << "beta2" << YAML::Value << t.beta2();
    if (t.has_eps()) out << YAML::Key << "eps" << YAML::Value << t.eps();
    if (t.has_max_grad_norm()) out << YAML::Key << "max_grad_norm" << YAML::Value << t.max_grad_norm();
    num("activation_checkpoint_every", t.activation_checkpoint_every());
    num("loss_chunk_tokens", t.loss_chunk_tokens());
    if (t.has_router_aux_loss_coef()) {
      out << YAML::Key << "router_aux_loss_coef" << YAML::Value << t.router_aux_loss_coef();
    }
    str("activation_checkpoints", t.activation_checkpoints());
    num("devices", t.devices());
    str("gradient_reduce", t.gradient_reduce());
    out << YAML::EndMap;
  }
  if (s.has_checkpoint()) {
    const v1::JobSpec::Checkpoint& c = s.checkpoint();
    out << YAML::Key << "checkpoint" << YAML::Value << YAML::BeginMap;
    str("dir", c.dir());
    num("every_steps", c.every_steps());
    if (c.has_keep_last()) out << YAML::Key << "keep_last" << YAML::Value << c.keep_last();
    num("max_shard_bytes", c.max_shard_bytes());
    if (c.has_background()) out << YAML::Key << "background" << YAML::Value << c.background();
    out << YAML::EndMap;
  }
  out << YAML::EndMap;
  return out.c_str();
}

absl::StatusOr<JobSpec> SpecFromRequest(const v1::SubmitJobRequest& request) {
  if (!request.base_dir().empty() && request.base_dir()[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("base_dir must be an absolute path, got '", request.base_dir(), "'"));
  }
  std::string yaml;
  switch (request.source_case()) {
    case v1::SubmitJobRequest::kSpecYaml:
      yaml = request.spec_yaml();
      break;
    case v1::SubmitJobRequest::kSpec:
      try {
        yaml = SpecMessageToYaml(request.spec());
      } catch (const YAML::Exception& e) {
        return absl::InvalidArgumentError(absl::StrCat("spec.model.config_json: ", Printable(e.what())));
      }
      break;
    default:
      return absl::InvalidArgumentError("the request has no spec (set spec_yaml or spec)");
  }
  return ParseJobSpec(yaml, request.base_dir(), "job spec");
}

absl::Status CheckJobFiles(const JobSpec& spec, const FileRoots& roots,
                           const std::string& own_dir) {
  std::vector<std::pair<const char*, std::string>> paths = {{"model.path", spec.model_path},
                                                            {"data.path", spec.data_path},
                                                            {"data.cache_dir", spec.data_cache_dir},
                                                            {"checkpoint.dir", spec.checkpoint_dir}};
  if (spec.tokenizer != "auto" && spec.tokenizer != "byte" && spec.tokenizer != "model") {
    paths.push_back({"data.tokenizer", spec.tokenizer});
  }
  for (const auto& [field, path] : paths) {
    if (path.empty()) continue;
    RETURN_IF_ERROR(CheckPathAllowed(field, path, roots, own_dir));
  }
  RETURN_IF_ERROR(CheckJobFolders(spec));  // a file named as a folder, before making them
  if (!spec.checkpoint_dir.empty()) {
    RETURN_IF_ERROR(CheckWritableFolder("checkpoint.dir", spec.checkpoint_dir));
  }
  if (!spec.data_cache_dir.empty()) {
    RETURN_IF_ERROR(CheckWritableFolder("data.cache_dir", spec.data_cache_dir));
  }
  return ValidateJobInputs(spec);
}

}  // namespace megatrain::server
