// Prometheus metrics: the daemon's counter, gauge and histogram families with labelled
// series, kept in a prometheus-cpp registry and written out by its TextSerializer (the
// text exposition format, version 0.0.4), and the process metrics (CPU, memory, file
// descriptors) that clients conventionally export.
//
// A thin layer over prometheus-cpp core: families are declared once by name and series
// are addressed by a label map, so the callers (daemon_metrics.cc) stay free of family
// handles; it also remembers each family's series, which prometheus-cpp cannot list,
// so that a finished job's series can be dropped (RemoveSeries) and a collector can
// re-fill a gauge (Clear). The exposition is served by metrics_http.h.
//
// Thread-safe: one mutex; updates are per step or per state change, never per token.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/common/mutex.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace megatrain::server {

// Label name -> value. Kept sorted, so one set of labels is one series.
using MetricLabels = std::map<std::string, std::string>;

class MetricsRegistry {
 public:
  enum class Type { kCounter, kGauge, kHistogram };

  MetricsRegistry();
  ~MetricsRegistry();

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
  // One declared family: its prometheus-cpp family (owned by registry_) and the series
  // made in it, by labels.
  struct Family {
    Type type;
    std::vector<double> buckets;
    prometheus::Family<prometheus::Counter>* counters = nullptr;
    prometheus::Family<prometheus::Gauge>* gauges = nullptr;
    prometheus::Family<prometheus::Histogram>* histograms = nullptr;
    // The series made in it, by labels: the one pointer of its type is set.
    struct Series {
      prometheus::Counter* counter = nullptr;
      prometheus::Gauge* gauge = nullptr;
      prometheus::Histogram* histogram = nullptr;
    };
    std::map<MetricLabels, Series> series;
  };
  Family* Find(const std::string& name, Type type) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The series of `family` with `labels`, made if new.
  Family::Series& SeriesOf(Family* family, const MetricLabels& labels)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes one series from its prometheus-cpp family.
  static void RemoveFromFamily(Family* family, const Family::Series& series);

  Mutex mu_;
  std::shared_ptr<prometheus::Registry> registry_;
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
