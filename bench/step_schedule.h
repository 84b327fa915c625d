// The steady-state step of the ideal schedule of a step's stages, with exact AdamW: a
// unit's update needs this step's gradient of it, and the next step's forward of it needs
// that update. The train step's dependencies, with every resource as busy as they allow:
//
//   GPU        the forward of every unit in order (embedding, layers, head: the head's
//              stage is its forward and backward), then the backward from the top layer
//              down to the embedding; a unit's forward waits for its weights
//   D2H        each gradient once its backward ends, in that order
//   optimizer  one CPU team, preemptive, always on the lowest unit whose gradient has
//              landed (the next forward needs the lowest first: the earliest deadline);
//              with clipping, only once every gradient has landed and the norm is summed
//   H2D        each unit's weights once updated, in the order updates finish
//
// train_bench's schedule floor, where the three floors (GPU, PCIe, optimizer) are too
// optimistic: with few, large layers (MoE cuts of 4 layers) a step cannot overlap the
// optimizer's work on its top layers with anything, since the head's gradient, the first
// to land, comes only after the whole forward, and the next forward needs the last
// update. (The planner's phase sum, planner.cc, came out above it, or within 3% below, on
// the plans tried: 1-12 layers of Mixtral, Qwen3-MoE, GPT-OSS and Qwen2.5-7B at 16K-256K
// tokens; so it does not use it.) With `slabs`, a gradient crosses in pieces (a slab's
// elements each) only into a free slab, which the piece's update frees; with
// `device_grad_buffers`, a unit's backward waits until the gradient that many units above it
// has crossed (the pipeline alternates two buffers). Not modelled: weight slots (uploads go
// ahead as soon as a unit is updated), and data parallelism.
#pragma once

#include <cstdint>
#include <vector>

namespace megatrain {

struct ScheduleUnit {
  double forward = 0;    // GPU seconds of its forward (the head: forward and backward)
  double backward = 0;   // GPU seconds of its backward (recompute included)
  double download = 0;   // its gradient over D2H
  double optimizer = 0;  // its AdamW update
  double upload = 0;     // its weights over H2D
  int64_t pieces = 1;    // its gradient's pieces (slabs), each a share of its download and update
};

struct StepStages {
  std::vector<ScheduleUnit> units;  // forward order: embedding, layers, head
  bool clipping = false;            // updates start only once every gradient has landed
  double norm = 0;                  // clipping: summing the norm, before the first update
  int64_t slabs = 0;                // the host's gradient slabs (0: as many as wanted)
  int64_t device_grad_buffers = 0;  // the device's layer gradient buffers (0: as many as wanted)
};

// A stack's stages from its totals: the layers share their GPU seconds evenly (the
// embedding's gather takes none), and each unit's transfers and update take their
// per-element rates.
struct StackTimes {
  double layers_forward = 0, layers_backward = 0;  // all layers together
  double head = 0;                                 // forward and backward
  double optimizer_per_element = 0, download_per_element = 0, upload_per_element = 0;
  int64_t slab_elements = 0;  // a gradient slab's (0: a unit's gradient is one piece)
};
// unit_elements: the embedding's, each layer's, the head's (ModelLayout's units).
StepStages StackStages(const std::vector<int64_t>& unit_elements, const StackTimes& times);

// Seconds between the starts of consecutive steps once they repeat (from all weights
// ready at the first step).
double ScheduleStepSeconds(const StepStages& stages);

}  // namespace megatrain
