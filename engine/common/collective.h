// Gradient reduction on the devices of a data-parallel job: a reduce-scatter. Each device
// holds its whole gradient of a unit; after the collective, each keeps only its shard of
// the sum over devices, so each drains 1/N of the gradient over its own link and the host
// never adds. CUDA: NCCL (engine/backend/nccl.h); CPU: the D2H stream threads of the
// simulated devices meet and add, in rank order (backend/cpu_backend.cc).
//
// Created per group by CreateGradCollectives (backend/factory.h); rank r belongs to the
// r-th backend given there and is driven by that backend's host thread.
#pragma once

#include <cstdint>
#include <string>

#include "engine/common/backend.h"

namespace megatrain {

// Elements of each rank's shard of an n-element gradient over `ranks` ranks: ceil(n/ranks)
// rounded up to 256 (1 KiB pieces for the copy engines, and whole blocks of int8 moments:
// kMomentBlock, store/host_store.h). A buffer reduced this way holds ranks * shard
// elements; the tail past n is padding that no one reads.
constexpr int64_t GradShardElements(int64_t n, int ranks) {
  const int64_t per = (n + ranks - 1) / ranks;
  return (per + 255) / 256 * 256;
}

class GradCollective {
 public:
  virtual ~GradCollective() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Enqueues on `stream` of this rank's backend: `buf` (size() * shard elements of the
  // backend's grad_dtype) ends with elements [rank*shard, (rank+1)*shard) holding the sum
  // over ranks of that range; the rest of buf is undefined. Every rank calls it with the
  // same shard, in the same order (a collective); `buf` is in use until work enqueued
  // after it on `stream` runs.
  virtual void ReduceScatter(void* buf, int64_t shard, StreamId stream) = 0;
  // What reduces, for logs: "NCCL 2.27.7", "host threads".
  virtual std::string description() const = 0;
};

}  // namespace megatrain
