// Tokenizer throughput: loads a Hugging Face tokenizer.json and encodes a text file (or a
// built-in mix of English, code, CJK and numbers) on one thread; prints one JSON line.
// Throughput is given per wall second and per CPU second of the encoding thread.
//
// With --runs N the encoding is timed N times and the fastest run (by CPU time) reported:
// on a machine shared with builds, the slower runs measure the neighbours.
//
//   tokenizer_bench --tokenizer DIR/tokenizer.json [--config DIR/tokenizer_config.json]
//                   [--input FILE] [--min_bytes 33554432] [--runs 1]
#include <time.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "engine/data/hf_tokenizer.h"
#include "nlohmann/json.hpp"

namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// CPU time of the calling thread: on a shared machine, what the throughput per core is
// computed from (wall time also counts the time other processes held the core).
double ThreadCpuSeconds() {
  timespec now;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

// Documents of about 1 KiB each, varied enough that a word cache would not hide the merges.
std::vector<std::string> BuiltInDocuments() {
  const std::vector<std::string> parts = {
      "The quick brown fox jumps over the lazy dog. It's 2024 and we'll train at 3.5e-4. ",
      "def forward(self, x):\n    return self.proj(torch.relu(x)) + 12345\n\n",
      "大型语言模型的训练需要大量的数据和计算资源。",
      "  Numbers: 3141592653589793238462643 ",
      "Привет, мир! Καλημέρα κόσμε. 😀👍🏽 ",
      "\t\tindented\r\n"};
  std::vector<std::string> docs;
  for (int d = 0; d < 64; ++d) {
    std::string doc;
    for (int i = 0; doc.size() < 1024; ++i) doc += parts[(d * 7 + i * 3) % parts.size()];
    docs.push_back(doc + std::to_string(d));
  }
  return docs;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Encodes text with an HF tokenizer and prints the throughput as JSON"};
  std::string tokenizer_path, config_path, input_path;
  int64_t min_bytes = 32 << 20;
  int runs = 1;
  app.add_option("--tokenizer", tokenizer_path, "tokenizer.json")->required();
  app.add_option("--config", config_path, "tokenizer_config.json");
  app.add_option("--input", input_path, "a text file; one document per line");
  app.add_option("--min_bytes", min_bytes, "encode at least this many bytes");
  app.add_option("--runs", runs, "time the encoding this many times; report the fastest")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  auto start = std::chrono::steady_clock::now();
  auto tokenizer = megatrain::HfTokenizer::Load(tokenizer_path, config_path);
  if (!tokenizer.ok()) {
    std::cerr << tokenizer.status() << "\n";
    return 1;
  }
  const double load_s = SecondsSince(start);

  std::vector<std::string> docs;
  if (input_path.empty()) {
    docs = BuiltInDocuments();
  } else {
    std::ifstream in(input_path);
    if (!in) {
      std::cerr << input_path << ": cannot open\n";
      return 1;
    }
    for (std::string line; std::getline(in, line);) docs.push_back(line + "\n");
  }
  int64_t bytes = 0, tokens = 0;
  double encode_s = 0, encode_cpu_s = 0;
  std::vector<double> run_cpu_mb_per_s;
  for (int run = 0; run < runs; ++run) {
    int64_t run_bytes = 0, run_tokens = 0;
    start = std::chrono::steady_clock::now();
    const double cpu_start = ThreadCpuSeconds();
    while (run_bytes < min_bytes) {
      for (const std::string& doc : docs) {
        run_tokens += static_cast<int64_t>((*tokenizer)->Encode(doc).value().size());
        run_bytes += static_cast<int64_t>(doc.size());
      }
      if (run_bytes == 0) break;
    }
    const double run_s = SecondsSince(start);
    const double run_cpu_s = ThreadCpuSeconds() - cpu_start;
    run_cpu_mb_per_s.push_back(run_bytes / run_cpu_s / 1e6);
    if (run == 0 || run_cpu_s < encode_cpu_s) {
      bytes = run_bytes;
      tokens = run_tokens;
      encode_s = run_s;
      encode_cpu_s = run_cpu_s;
    }
  }
  nlohmann::json out = {{"benchmark", "tokenizer_bench"},
                        {"tokenizer", tokenizer_path},
                        {"input", input_path.empty() ? "built-in" : input_path},
                        {"vocab_size", (*tokenizer)->vocab_size()},
                        {"bos_id", (*tokenizer)->bos_id()},
                        {"eos_id", (*tokenizer)->eos_id()},
                        {"load_s", load_s},
                        {"bytes", bytes},
                        {"tokens", tokens},
                        {"encode_s", encode_s},
                        {"encode_cpu_s", encode_cpu_s},
                        {"encode_mib_per_s", bytes / encode_s / (1 << 20)},
                        {"encode_mb_per_s", bytes / encode_s / 1e6},
                        {"encode_cpu_mb_per_s", bytes / encode_cpu_s / 1e6},
                        {"tokens_per_s", tokens / encode_s},
                        {"runs_cpu_mb_per_s", run_cpu_mb_per_s}};
  std::cout << out.dump() << "\n";
  return 0;
}
