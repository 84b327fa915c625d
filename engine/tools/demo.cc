#include "engine/tools/demo.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace megatrain {
namespace {

// Short paragraphs on the subject at hand; the model should learn to recite them.
constexpr const char* kDemoTexts[] = {
    "A layer of a large model streams from host memory into the GPU, computes, and leaves "
    "again. Only one or two layers live on the device at any time.",
    "Host memory holds the master weights in fp32 together with the first and second "
    "moments of AdamW. The GPU only ever sees bf16 copies of the weights.",
    "While layer n computes, the weights of layer n+1 arrive over PCIe and the gradients of "
    "layer n-1 drain back to the host, so the copy engines and the math units work at once.",
    "Activations are checkpointed every few layers and recomputed in the backward pass, "
    "trading a little compute for a great deal of memory.",
    "The optimizer runs on the CPU: as soon as the gradient of a layer lands in host "
    "memory, its AdamW update begins, overlapped with the rest of the backward pass.",
    "Checkpoints are ordinary Hugging Face folders: config.json, safetensors shards and an "
    "index, so the trained model loads in transformers as it is.",
    "A lab shares one big machine. Each member submits jobs, watches their loss fall, and "
    "trusts the daemon to keep their files and runs safe.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
};

}  // namespace

absl::StatusOr<std::string> WriteDemoJob(const std::string& dir, int64_t steps) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  {
    std::ofstream data(fs::path(dir) / "data.jsonl");
    for (const char* text : kDemoTexts) data << nlohmann::json{{"text", text}}.dump() << "\n";
    if (!data) return absl::InternalError(absl::StrCat("cannot write ", dir, "/data.jsonl"));
  }
  const std::string spec_path = (fs::path(dir) / "demo.yaml").string();
  std::ofstream spec(spec_path);
  spec << "# The embedded demo: a 4-layer Llama-style model, random init, byte tokenizer.\n"
          "name: demo\n"
          "model:\n"
          "  config:\n"
          "    architectures: [LlamaForCausalLM]\n"
          "    model_type: llama\n"
          "    hidden_size: 128\n"
          "    intermediate_size: 352\n"
          "    num_hidden_layers: 4\n"
          "    num_attention_heads: 4\n"
          "    num_key_value_heads: 2\n"
          "    vocab_size: 258\n"
          "    max_position_embeddings: 1024\n"
          "    rms_norm_eps: 1.0e-5\n"
          "    rope_theta: 10000.0\n"
          "    tie_word_embeddings: true\n"
          "    bos_token_id: 256\n"
          "    eos_token_id: 257\n"
          "  init_seed: 1\n"
          "data:\n"
          "  path: data.jsonl\n"
          "  seq_len: 128\n"
          "  seed: 7\n"
          "train:\n"
       << "  steps: " << steps << "\n"
       << "  tokens_per_step: 1024   # 8 sequences of 128; the planner splits them\n"
          "  lr: 3.0e-3\n"
          "  schedule: cosine\n"
          "  warmup_steps: 10\n"
          "  weight_decay: 0.01\n"
          "  max_grad_norm: 1.0\n"
          "checkpoint:\n"
          "  dir: checkpoints\n"
          "  every_steps: 50\n"
          "  keep_last: 2\n";
  if (!spec) return absl::InternalError(absl::StrCat("cannot write ", spec_path));
  return spec_path;
}

}  // namespace megatrain
