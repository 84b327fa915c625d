// megatrain-merge BASE ADAPTER OUT: a LoRA adapter merged into its base, a Hugging Face
// model folder (checkpoint/merge.h). `megatrain merge` runs it.
#include <cstdio>
#include <string>

#include "CLI/CLI.hpp"
#include "engine/checkpoint/merge.h"

int main(int argc, char** argv) {
  CLI::App app{"Merge a PEFT LoRA adapter into its base model (bf16 Hugging Face folder)"};
  std::string base, adapter, out;
  app.add_option("base", base, "the base model folder (config.json, *.safetensors)")->required();
  app.add_option("adapter", adapter, "the PEFT adapter folder (a LoRA job's checkpoint is one)")
      ->required();
  app.add_option("out", out, "the merged model's folder (new, or empty)")->required();
  CLI11_PARSE(app, argc, argv);
  const absl::Status s = megatrain::MergeLoraAdapter(base, adapter, out);
  if (!s.ok()) {
    std::fprintf(stderr, "megatrain-merge: %s\n", std::string(s.message()).c_str());
    return s.code() == absl::StatusCode::kInvalidArgument ||
                   s.code() == absl::StatusCode::kNotFound ||
                   s.code() == absl::StatusCode::kAlreadyExists
               ? 2
               : 1;
  }
  std::printf("merged %s into %s: %s\n", adapter.c_str(), base.c_str(), out.c_str());
  return 0;
}
