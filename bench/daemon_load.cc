// Daemon responsiveness under load: starts a real megatraind, queues 1,000 jobs, opens
// 200 concurrent WatchJob streams, and measures GetJob / ListJobs latency and the
// daemon's memory while they run. Prints one JSON object. Not a test: it never fails on
// a slow machine.
//
//   daemon_load --megatraind build/server/megatraind [--jobs 1000] [--watchers 200]
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "grpcpp/grpcpp.h"
#include "megatrain/v1/jobs.grpc.pb.h"
#include "megatrain/v1/node.grpc.pb.h"
#include "nlohmann/json.hpp"

namespace {

using Clock = std::chrono::steady_clock;
namespace v1 = megatrain::v1;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

nlohmann::json Summary(const std::vector<double>& ms) {
  return {{"count", ms.size()}, {"p50_ms", Percentile(ms, 0.5)}, {"p99_ms", Percentile(ms, 0.99)},
          {"max_ms", ms.empty() ? 0 : *std::max_element(ms.begin(), ms.end())}};
}

int64_t ReadStatusKb(pid_t pid, const std::string& key) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string k;
  int64_t v = 0;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1));
  }
  return v;
}

std::string JobYaml(const std::string& data, int steps) {
  return "name: load\n"
         "model:\n  config: {architectures: [LlamaForCausalLM], hidden_size: 32, "
         "intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2, vocab_size: 258}\n"
         "data: {path: " + data + ", seq_len: 16}\n"
         "train: {steps: " + std::to_string(steps) + ", lr: 1.0e-3}\n";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"daemon_load: megatraind latency and memory under 200 watchers and 1000 queued jobs"};
  std::string daemon_bin;
  int num_jobs = 1000, num_watchers = 200, num_gets = 2000;
  app.add_option("--megatraind", daemon_bin, "path to megatraind")->required();
  app.add_option("--jobs", num_jobs, "jobs to queue")->capture_default_str();
  app.add_option("--watchers", num_watchers, "concurrent WatchJob streams")->capture_default_str();
  app.add_option("--gets", num_gets, "GetJob calls to time")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("megatrain_load_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string data = (dir / "data.jsonl").string();
  std::ofstream(data) << "{\"text\": \"a small document for the load benchmark\"}\n";
  const std::string addr = "unix:" + (dir / "sock").string();

  pid_t pid = fork();
  if (pid == 0) {
    const std::string state = (dir / "state").string();
    std::freopen((dir / "daemon.log").c_str(), "w", stdout);
    execl(daemon_bin.c_str(), daemon_bin.c_str(), "--listen", addr.c_str(), "--state-dir",
          state.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  auto channel = grpc::CreateChannel(addr, grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(20))) {
    std::fprintf(stderr, "daemon_load: megatraind did not come up on %s\n", addr.c_str());
    kill(pid, SIGKILL);
    return 1;
  }
  auto jobs = v1::JobService::NewStub(channel);
  const int64_t rss_idle_kb = ReadStatusKb(pid, "VmRSS");

  // Queue the jobs: the first one runs (long), the rest wait behind it.
  std::vector<double> submit_ms;
  std::vector<int64_t> ids;
  for (int i = 0; i < num_jobs; ++i) {
    v1::SubmitJobRequest req;
    req.set_spec_yaml(JobYaml(data, i == 0 ? 1000000 : 10));
    req.set_base_dir(dir.string());
    v1::Job job;
    grpc::ClientContext ctx;
    const auto t0 = Clock::now();
    grpc::Status s = jobs->SubmitJob(&ctx, req, &job);
    submit_ms.push_back(Ms(Clock::now() - t0));
    if (!s.ok()) {
      std::fprintf(stderr, "submit failed: %s\n", s.error_message().c_str());
      kill(pid, SIGKILL);
      return 1;
    }
    ids.push_back(job.id());
  }

  // Watchers: half on the running job (a stream of progress events), half on queued ones.
  std::atomic<bool> stop{false};
  std::atomic<int64_t> events{0};
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts(num_watchers);
  std::vector<std::thread> watchers;
  for (int w = 0; w < num_watchers; ++w) {
    contexts[w] = std::make_unique<grpc::ClientContext>();
    watchers.emplace_back([&, w] {
      v1::WatchJobRequest req;
      req.set_id(w % 2 == 0 ? ids[0] : ids[1 + (w * 7) % (ids.size() - 1)]);
      auto reader = jobs->WatchJob(contexts[w].get(), req);
      v1::JobEvent e;
      while (reader->Read(&e)) events++;
      reader->Finish();
    });
  }
  std::this_thread::sleep_for(std::chrono::seconds(2));

  std::vector<double> get_ms, list_ms;
  for (int i = 0; i < num_gets; ++i) {
    v1::GetJobRequest req;
    req.set_id(ids[(i * 13) % ids.size()]);
    v1::Job job;
    grpc::ClientContext ctx;
    const auto t0 = Clock::now();
    grpc::Status s = jobs->GetJob(&ctx, req, &job);
    get_ms.push_back(Ms(Clock::now() - t0));
    if (i % 20 == 0) {
      v1::ListJobsRequest lreq;
      lreq.set_page_size(100);
      v1::ListJobsResponse lresp;
      grpc::ClientContext lctx;
      const auto t1 = Clock::now();
      jobs->ListJobs(&lctx, lreq, &lresp);
      list_ms.push_back(Ms(Clock::now() - t1));
    }
  }
  const int64_t rss_kb = ReadStatusKb(pid, "VmRSS");
  const int64_t hwm_kb = ReadStatusKb(pid, "VmHWM");
  const int64_t threads = ReadStatusKb(pid, "Threads");

  stop = true;
  for (auto& c : contexts) c->TryCancel();
  for (auto& t : watchers) t.join();
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  fs::remove_all(dir);

  nlohmann::json out = {
      {"benchmark", "daemon_load"},
      {"jobs_queued", num_jobs},
      {"watchers", num_watchers},
      {"watch_events_received", events.load()},
      {"submit", Summary(submit_ms)},
      {"get_job", Summary(get_ms)},
      {"list_jobs_page_100", Summary(list_ms)},
      {"daemon_rss_idle_mib", rss_idle_kb / 1024.0},
      {"daemon_rss_mib", rss_kb / 1024.0},
      {"daemon_rss_peak_mib", hwm_kb / 1024.0},
      {"daemon_threads", threads},
      {"daemon_exit_clean", WIFEXITED(status) && WEXITSTATUS(status) == 0},
  };
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
