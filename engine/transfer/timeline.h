// Spans of stream work (two events each) recorded during a step: the timeline that
// benchmarks and the per-stream busy metrics read. Shared by the pipeline and the
// transfers it drives; a no-op unless enabled.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/common/backend.h"
#include "engine/common/status.h"

namespace megatrain {

// One piece of work on one stream, in milliseconds from the start of the step.
struct TimelineSpan {
  StreamId stream;
  std::string label;  // "fwd 3", "bwd 3", "h2d w 4", "d2h g 4", "head", ...
  double start_ms = 0;
  double end_ms = 0;
};

// Thread-compatible: the pipeline's thread records every span.
class SpanRecorder {
 public:
  SpanRecorder(Backend* backend, bool enabled) : backend_(backend), enabled_(enabled) {}

  // A new step: its spans replace the last one's; the step's zero is recorded on H2D.
  void BeginStep() {
    num_spans_ = 0;
    if (!enabled_) return;
    if (zero_.get() == nullptr) zero_ = Event(backend_);
    backend_->Record(zero_.get(), StreamId::kH2D);
  }
  // Records the start of a span on `stream`; its id for End (-1 when disabled).
  int Begin(StreamId stream, std::string label) {
    if (!enabled_) return -1;
    if (num_spans_ == static_cast<int>(spans_.size())) {
      spans_.push_back(Span{stream, "", Event(backend_), Event(backend_)});
    }
    Span& span = spans_[num_spans_];
    span.stream = stream;
    span.label = std::move(label);
    backend_->Record(span.begin.get(), stream);
    return num_spans_++;
  }
  void End(int span) {
    if (span < 0) return;
    backend_->Record(spans_[span].end.get(), spans_[span].stream);
  }
  // The step's spans. REQUIRES: every one of them has completed.
  std::vector<TimelineSpan> Collect() const {
    std::vector<TimelineSpan> out;
    for (int i = 0; i < num_spans_; ++i) {
      const Span& span = spans_[i];
      out.push_back(TimelineSpan{span.stream, span.label,
                                 1e3 * backend_->ElapsedSeconds(zero_.get(), span.begin.get()),
                                 1e3 * backend_->ElapsedSeconds(zero_.get(), span.end.get())});
    }
    return out;
  }
  bool enabled() const { return enabled_; }

 private:
  struct Span {
    StreamId stream;
    std::string label;
    Event begin, end;
  };
  Backend* backend_;
  bool enabled_;
  std::vector<Span> spans_;  // reused across steps; grows on the first
  int num_spans_ = 0;
  Event zero_;
};

// Allocates the device buffers of a pipeline and its transfers, adding up their bytes (the
// pipeline checks them against StepMemory, what the planner counted).
class DeviceAllocator {
 public:
  explicit DeviceAllocator(Backend* backend) : backend_(backend) {}
  [[nodiscard]] absl::Status Allocate(DeviceBuffer* buffer, int64_t bytes, const char* what) {
    bytes_ += bytes;
    absl::StatusOr<DeviceBuffer> made = DeviceBuffer::Allocate(backend_, bytes);
    if (!made.ok()) return Annotate(made.status(), absl::StrCat("allocating ", what));
    *buffer = *std::move(made);
    return absl::OkStatus();
  }
  Backend* backend() const { return backend_; }
  int64_t bytes() const { return bytes_; }

 private:
  Backend* backend_;
  int64_t bytes_ = 0;
};

}  // namespace megatrain
