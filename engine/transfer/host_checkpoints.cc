#include "engine/transfer/host_checkpoints.h"

#include <string>

#include "engine/common/status.h"

namespace megatrain {

HostCheckpoints::HostCheckpoints(Backend* backend, int64_t checkpoint_every, int64_t num_layers,
                                 int64_t checkpoint_bytes, int64_t micro_batch_bytes,
                                 SpanRecorder* spans)
    : backend_(backend),
      checkpoint_every_(checkpoint_every),
      num_layers_(num_layers),
      checkpoint_bytes_(checkpoint_bytes),
      micro_batch_bytes_(micro_batch_bytes),
      spans_(spans) {}

HostCheckpoints::~HostCheckpoints() {
  if (host_.data() != nullptr) backend_->UnpinHostRange(host_.data());
}

absl::Status HostCheckpoints::Allocate(DeviceAllocator* alloc) {
  const int64_t num_checkpoints = (num_layers_ + checkpoint_every_ - 1) / checkpoint_every_ + 1;
  ASSIGN_OR_RETURN(host_, HostArena::Map(num_checkpoints * checkpoint_bytes_,
                                         "layer-input checkpoints"));
  RETURN_IF_ERROR(backend_->PinHostRange(host_.data(), host_.bytes()));
  on_host_.clear();
  for (int64_t c = 0; c < num_layers_; c += checkpoint_every_) on_host_.emplace_back(backend_);
  for (int i = 0; i < 2; ++i) {
    RETURN_IF_ERROR(alloc->Allocate(&staging_[i], checkpoint_bytes_, "checkpoint staging"));
    saved_[i] = Event(backend_);
    loaded_[i] = Event(backend_);
    free_[i] = Event(backend_);
  }
  return absl::OkStatus();
}

void HostCheckpoints::BeginStep() {
  staged_[0] = staged_[1] = -1;
  h2d_bytes_ = d2h_bytes_ = 0;
}

void* HostCheckpoints::HostCheckpoint(int64_t layer) const {
  return host_.data() + (layer / checkpoint_every_) * checkpoint_bytes_;
}

void HostCheckpoints::Save(int64_t layer, const DeviceBuffer& activations) {
  if (layer % checkpoint_every_ != 0 || layer == num_layers_) return;
  const Event& saved = saved_[layer % 2];
  backend_->Record(saved.get(), StreamId::kCompute);  // x_layer is complete
  backend_->StreamWait(StreamId::kD2H, saved.get());
  const int span = spans_->Begin(StreamId::kD2H, "d2h x " + std::to_string(layer));
  d2h_bytes_ += static_cast<int64_t>(activations.bytes());
  backend_->CopyToHost(HostCheckpoint(layer), activations.get(), activations.bytes(),
                       StreamId::kD2H);
  spans_->End(span);
  backend_->Record(saved.get(), StreamId::kD2H);  // the forward buffer may be overwritten
  backend_->Record(on_host_[layer / checkpoint_every_].get(), StreamId::kD2H);
}

void HostCheckpoints::Load(int64_t c) {
  if (c < 0) return;
  const int i = Staging(c);
  if (staged_[i] == c) return;
  backend_->StreamWait(StreamId::kH2D, free_[i].get());
  // The host thread runs ahead of the device: the forward's copy of x_c may still be on
  // its way to the host.
  backend_->StreamWait(StreamId::kH2D, on_host_[c / checkpoint_every_].get());
  const int span = spans_->Begin(StreamId::kH2D, "h2d x " + std::to_string(c));
  h2d_bytes_ += static_cast<int64_t>(staging_[i].bytes());
  backend_->CopyToDevice(staging_[i].get(), HostCheckpoint(c), staging_[i].bytes(),
                         StreamId::kH2D);
  spans_->End(span);
  backend_->Record(loaded_[i].get(), StreamId::kH2D);
  staged_[i] = c;
}

void* HostCheckpoints::Input(int64_t c, int64_t m) const {
  return static_cast<char*>(staging_[Staging(c)].get()) + m * micro_batch_bytes_;
}

}  // namespace megatrain
