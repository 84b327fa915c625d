// Prometheus metrics: a registry of counter, gauge and histogram families with labelled
// series, written out in the text exposition format (version 0.0.4), and the process
// metrics (CPU, memory, file descriptors) that clients conventionally export.
//
// Hand-written because prometheus-cpp is not packaged for Debian 12; the format is the
// documented one and `promtool check metrics` checks our output in the tests.
//
// Thread-safe: one mutex; updates are per step or per state change, never per token.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "server/mutex.h"

namespace megatrain::server {

// Label name -> value. Kept sorted, so one set of labels is one series.
using MetricLabels = std::map<std::string, std::string>;

class MetricsRegistry {
 public:
  enum class Type { kCounter, kGauge, kHistogram };

  // Declares a family. Counter names end in _total; histogram `buckets` are upper bounds
  // in increasing order (+Inf is implicit). Declaring a name twice is a programming error.
  void Declare(const std::string& name, Type type, const std::string& help,
               std::vector<double> buckets = {});

  void Set(const std::string& name, const MetricLabels& labels, double value);    // gauge
  void Add(const std::string& name, const MetricLabels& labels, double delta);    // counter
  void Observe(const std::string& name, const MetricLabels& labels, double value);  // histogram
  // Drops every series of `name` (a gauge re-filled by a collector).
  void Clear(const std::string& name);
  // Drops the series of every family whose label `label` equals `value` (a finished job).
  void RemoveSeries(const std::string& label, const std::string& value);

  // Runs before each Serialize(), outside the registry's lock, to refresh gauges read from
  // elsewhere (job states, process figures).
  void AddCollector(std::function<void(MetricsRegistry&)> collector);

  // The exposition text of every family with at least one series.
  std::string Serialize();

 private:
  struct Series {
    double value = 0;                  // counter, gauge; histogram: sum
    std::vector<uint64_t> bucket_counts;  // histogram: per bucket, not cumulative
    uint64_t count = 0;                // histogram
  };
  struct Family {
    Type type;
    std::string help;
    std::vector<double> buckets;
    std::map<MetricLabels, Series> series;
  };
  Family* Find(const std::string& name, Type type) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Mutex mu_;
  std::map<std::string, Family> families_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void(MetricsRegistry&)>> collectors_ ABSL_GUARDED_BY(mu_);
};

// Declares and fills process_cpu_seconds_total, process_resident_memory_bytes,
// process_virtual_memory_bytes, process_open_fds, process_max_fds and
// process_start_time_seconds from /proc/self at each scrape.
void AddProcessCollector(MetricsRegistry* registry);

// Exponential buckets: start, start*factor, ... (count of them).
std::vector<double> ExponentialBuckets(double start, double factor, int count);

}  // namespace megatrain::server
