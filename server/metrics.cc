#include "server/metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "engine/common/check.h"

namespace megatrain::server {
namespace {

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return absl::StrFormat("%.0f", v);
  return absl::StrFormat("%.17g", v);
}

std::string EscapeLabelValue(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string EscapeHelp(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

// {a="x",b="y"} with `extra` (name, value) appended last; "" for no labels.
std::string LabelText(const MetricLabels& labels, const char* extra_name = nullptr,
                      const std::string& extra_value = "") {
  std::string out;
  for (const auto& [k, v] : labels) {
    absl::StrAppend(&out, out.empty() ? "{" : ",", k, "=\"", EscapeLabelValue(v), "\"");
  }
  if (extra_name != nullptr) {
    absl::StrAppend(&out, out.empty() ? "{" : ",", extra_name, "=\"", extra_value, "\"");
  }
  if (!out.empty()) out += "}";
  return out;
}

const char* TypeName(MetricsRegistry::Type t) {
  switch (t) {
    case MetricsRegistry::Type::kCounter: return "counter";
    case MetricsRegistry::Type::kGauge: return "gauge";
    case MetricsRegistry::Type::kHistogram: return "histogram";
  }
  return "untyped";
}

}  // namespace

void MetricsRegistry::Declare(const std::string& name, Type type, const std::string& help,
                              std::vector<double> buckets) {
  MutexLock lock(&mu_);
  MT_CHECK_MSG(families_.count(name) == 0, "metric %s declared twice", name.c_str());
  MT_CHECK_MSG(type != Type::kCounter || absl::EndsWith(name, "_total"),
               "counter %s must end in _total", name.c_str());
  families_[name] = Family{type, help, std::move(buckets), {}};
}

MetricsRegistry::Family* MetricsRegistry::Find(const std::string& name, Type type) {
  auto it = families_.find(name);
  MT_CHECK_MSG(it != families_.end() && it->second.type == type,
               "metric %s is not declared as a %s", name.c_str(), TypeName(type));
  return &it->second;
}

void MetricsRegistry::Set(const std::string& name, const MetricLabels& labels, double value) {
  MutexLock lock(&mu_);
  Find(name, Type::kGauge)->series[labels].value = value;
}

void MetricsRegistry::Add(const std::string& name, const MetricLabels& labels, double delta) {
  MutexLock lock(&mu_);
  MT_CHECK_MSG(delta >= 0, "counter %s decreased", name.c_str());
  Find(name, Type::kCounter)->series[labels].value += delta;
}

void MetricsRegistry::Observe(const std::string& name, const MetricLabels& labels,
                              double value) {
  MutexLock lock(&mu_);
  Family* f = Find(name, Type::kHistogram);
  Series& s = f->series[labels];
  s.bucket_counts.resize(f->buckets.size());
  for (size_t i = 0; i < f->buckets.size(); ++i) {
    if (value <= f->buckets[i]) {
      ++s.bucket_counts[i];
      break;
    }
  }
  s.value += value;
  ++s.count;
}

void MetricsRegistry::Clear(const std::string& name) {
  MutexLock lock(&mu_);
  auto it = families_.find(name);
  if (it != families_.end()) it->second.series.clear();
}

void MetricsRegistry::RemoveSeries(const std::string& label, const std::string& value) {
  MutexLock lock(&mu_);
  for (auto& [name, family] : families_) {
    for (auto it = family.series.begin(); it != family.series.end();) {
      const auto l = it->first.find(label);
      if (l != it->first.end() && l->second == value) {
        it = family.series.erase(it);
      } else {
        ++it;
      }
    }
  }
}

void MetricsRegistry::AddCollector(std::function<void(MetricsRegistry&)> collector) {
  MutexLock lock(&mu_);
  collectors_.push_back(std::move(collector));
}

std::string MetricsRegistry::Serialize() {
  std::vector<std::function<void(MetricsRegistry&)>> collectors;
  {
    MutexLock lock(&mu_);
    collectors = collectors_;
  }
  for (auto& c : collectors) c(*this);
  MutexLock lock(&mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    if (f.series.empty()) continue;
    absl::StrAppend(&out, "# HELP ", name, " ", EscapeHelp(f.help), "\n# TYPE ", name, " ",
                    TypeName(f.type), "\n");
    for (const auto& [labels, s] : f.series) {
      if (f.type != Type::kHistogram) {
        absl::StrAppend(&out, name, LabelText(labels), " ", FormatValue(s.value), "\n");
        continue;
      }
      uint64_t cumulative = 0;
      for (size_t i = 0; i < f.buckets.size(); ++i) {
        cumulative += i < s.bucket_counts.size() ? s.bucket_counts[i] : 0;
        absl::StrAppend(&out, name, "_bucket", LabelText(labels, "le", FormatValue(f.buckets[i])),
                        " ", cumulative, "\n");
      }
      absl::StrAppend(&out, name, "_bucket", LabelText(labels, "le", "+Inf"), " ", s.count, "\n");
      absl::StrAppend(&out, name, "_sum", LabelText(labels), " ", FormatValue(s.value), "\n");
      absl::StrAppend(&out, name, "_count", LabelText(labels), " ", s.count, "\n");
    }
  }
  return out;
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> b;
  for (int i = 0; i < count; ++i) b.push_back(start * std::pow(factor, i));
  return b;
}

void AddProcessCollector(MetricsRegistry* registry) {
  using T = MetricsRegistry::Type;
  registry->Declare("process_cpu_seconds_total", T::kCounter,
                    "User and system CPU time spent by the daemon, in seconds.");
  registry->Declare("process_resident_memory_bytes", T::kGauge, "Resident memory size in bytes.");
  registry->Declare("process_virtual_memory_bytes", T::kGauge, "Virtual memory size in bytes.");
  registry->Declare("process_open_fds", T::kGauge, "Number of open file descriptors.");
  registry->Declare("process_max_fds", T::kGauge, "Maximum number of open file descriptors.");
  registry->Declare("process_start_time_seconds", T::kGauge,
                    "Start time of the process since the Unix epoch, in seconds.");
  registry->AddCollector([](MetricsRegistry& r) {
    const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
    const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
    std::ifstream stat_in("/proc/self/stat");
    std::string stat((std::istreambuf_iterator<char>(stat_in)), {});
    // Fields after the command name (which may hold spaces) start at ") ".
    const size_t close = stat.rfind(')');
    if (close != std::string::npos) {
      std::vector<std::string> f = absl::StrSplit(stat.substr(close + 2), ' ');
      // f[0] is field 3 (state): utime is field 14, stime 15, starttime 22, vsize 23, rss 24.
      if (f.size() > 21) {
        const double utime = std::stod(f[11]), stime = std::stod(f[12]);
        const double start_ticks = std::stod(f[19]);
        r.Clear("process_cpu_seconds_total");
        r.Add("process_cpu_seconds_total", {}, (utime + stime) / ticks);
        r.Set("process_virtual_memory_bytes", {}, std::stod(f[20]));
        r.Set("process_resident_memory_bytes", {}, std::stod(f[21]) * page);
        double boot = 0;
        std::ifstream proc_stat("/proc/stat");
        for (std::string line; std::getline(proc_stat, line);) {
          if (line.rfind("btime ", 0) == 0) boot = std::stod(line.substr(6));
        }
        r.Set("process_start_time_seconds", {}, boot + start_ticks / ticks);
      }
    }
    int fds = 0;
    if (DIR* d = opendir("/proc/self/fd")) {
      while (dirent* e = readdir(d)) {
        if (e->d_name[0] != '.') ++fds;
      }
      closedir(d);
      --fds;  // the directory handle itself
    }
    r.Set("process_open_fds", {}, fds);
    rlimit lim{};
    if (getrlimit(RLIMIT_NOFILE, &lim) == 0) {
      r.Set("process_max_fds", {}, static_cast<double>(lim.rlim_cur));
    }
  });
}

}  // namespace megatrain::server
