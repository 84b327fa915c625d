#include "server/metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "engine/common/check.h"
#include "prometheus/check_names.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace megatrain::server {
namespace {

const char* TypeName(MetricsRegistry::Type t) {
  switch (t) {
    case MetricsRegistry::Type::kCounter: return "counter";
    case MetricsRegistry::Type::kGauge: return "gauge";
    case MetricsRegistry::Type::kHistogram: return "histogram";
  }
  return "untyped";
}

}  // namespace

MetricsRegistry::MetricsRegistry()
    : registry_(std::make_shared<prometheus::Registry>(prometheus::Registry::InsertBehavior::Throw)) {}

MetricsRegistry::~MetricsRegistry() = default;

void MetricsRegistry::Declare(const std::string& name, Type type, const std::string& help,
                              std::vector<double> buckets) {
  MutexLock lock(&mu_);
  MT_CHECK_MSG(families_.count(name) == 0, "metric %s declared twice", name.c_str());
  MT_CHECK_MSG(type != Type::kCounter || absl::EndsWith(name, "_total"),
               "counter %s must end in _total", name.c_str());
  MT_CHECK_MSG(prometheus::CheckMetricName(name), "%s is not a valid metric name", name.c_str());
  // prometheus-cpp 1.0.1 writes HELP text as it is given; the format wants \\ and \n.
  const std::string escaped_help =
      absl::StrReplaceAll(help, {{"\\", "\\\\"}, {"\n", "\\n"}});
  Family f;
  f.type = type;
  f.buckets = std::move(buckets);
  switch (type) {
    case Type::kCounter:
      f.counters = &prometheus::BuildCounter().Name(name).Help(escaped_help).Register(*registry_);
      break;
    case Type::kGauge:
      f.gauges = &prometheus::BuildGauge().Name(name).Help(escaped_help).Register(*registry_);
      break;
    case Type::kHistogram:
      f.histograms = &prometheus::BuildHistogram().Name(name).Help(escaped_help).Register(*registry_);
      break;
  }
  families_.emplace(name, std::move(f));
}

MetricsRegistry::Family* MetricsRegistry::Find(const std::string& name, Type type) {
  auto it = families_.find(name);
  MT_CHECK_MSG(it != families_.end() && it->second.type == type,
               "metric %s is not declared as a %s", name.c_str(), TypeName(type));
  return &it->second;
}

MetricsRegistry::Family::Series& MetricsRegistry::SeriesOf(Family* family,
                                                           const MetricLabels& labels) {
  auto [it, made] = family->series.try_emplace(labels);
  if (!made) return it->second;
  for (const auto& [label, value] : labels) {
    MT_CHECK_MSG(prometheus::CheckLabelName(label) && label != "le" && label != "quantile",
                 "%s is not a valid label name", label.c_str());
  }
  Family::Series& s = it->second;
  switch (family->type) {
    case Type::kCounter: s.counter = &family->counters->Add(labels); break;
    case Type::kGauge: s.gauge = &family->gauges->Add(labels); break;
    case Type::kHistogram:
      s.histogram = &family->histograms->Add(labels, prometheus::Histogram::BucketBoundaries(
                                                         family->buckets));
      break;
  }
  return s;
}

void MetricsRegistry::RemoveFromFamily(Family* family, const Family::Series& series) {
  if (series.counter != nullptr) family->counters->Remove(series.counter);
  if (series.gauge != nullptr) family->gauges->Remove(series.gauge);
  if (series.histogram != nullptr) family->histograms->Remove(series.histogram);
}

void MetricsRegistry::Set(const std::string& name, const MetricLabels& labels, double value) {
  MutexLock lock(&mu_);
  SeriesOf(Find(name, Type::kGauge), labels).gauge->Set(value);
}

void MetricsRegistry::Add(const std::string& name, const MetricLabels& labels, double delta) {
  MutexLock lock(&mu_);
  MT_CHECK_MSG(delta >= 0, "counter %s decreased", name.c_str());
  SeriesOf(Find(name, Type::kCounter), labels).counter->Increment(delta);
}

void MetricsRegistry::Observe(const std::string& name, const MetricLabels& labels,
                              double value) {
  MutexLock lock(&mu_);
  SeriesOf(Find(name, Type::kHistogram), labels).histogram->Observe(value);
}

void MetricsRegistry::Clear(const std::string& name) {
  MutexLock lock(&mu_);
  auto it = families_.find(name);
  if (it == families_.end()) return;
  for (const auto& [labels, series] : it->second.series) RemoveFromFamily(&it->second, series);
  it->second.series.clear();
}

void MetricsRegistry::RemoveSeries(const std::string& label, const std::string& value) {
  MutexLock lock(&mu_);
  for (auto& [name, family] : families_) {
    for (auto it = family.series.begin(); it != family.series.end();) {
      const auto l = it->first.find(label);
      if (l != it->first.end() && l->second == value) {
        RemoveFromFamily(&family, it->second);
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
  std::vector<prometheus::MetricFamily> families;
  {
    MutexLock lock(&mu_);  // a family is collected whole, never with half its series
    families = registry_->Collect();
  }
  // Families without a series say nothing: leave out their HELP and TYPE lines.
  families.erase(std::remove_if(families.begin(), families.end(),
                                [](const prometheus::MetricFamily& f) { return f.metric.empty(); }),
                 families.end());
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
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
