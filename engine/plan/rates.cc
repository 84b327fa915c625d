#include "engine/plan/rates.h"

#include <algorithm>
#include <thread>

#include "engine/common/status.h"

namespace megatrain {

absl::StatusOr<double> MeasureReduceScatterGbps(
    const std::vector<Backend*>& backends,
    const std::vector<std::unique_ptr<GradCollective>>& group, int64_t bytes) {
  const int ranks = static_cast<int>(backends.size());
  if (ranks < 2 || group.size() != backends.size()) {
    return absl::InvalidArgumentError("a reduce-scatter needs a group of two or more");
  }
  const int64_t shard = GradShardElements(bytes / 4 / ranks * ranks, ranks);
  constexpr int kIterations = 4;
  // Every buffer first: a rank that failed after others entered the collective would
  // leave them waiting for it.
  std::vector<DeviceBuffer> bufs;
  for (Backend* be : backends) {
    be->BindThread();
    ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(be, 4 * shard * ranks));
    bufs.push_back(std::move(b));
  }
  std::vector<double> seconds(ranks, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      Backend* be = backends[r];
      be->BindThread();
      const StreamId s = StreamId::kD2H;
      be->Zero(bufs[r].get(), bufs[r].bytes(), s);
      group[r]->ReduceScatter(bufs[r].get(), shard, s);  // warm-up (NCCL sets up channels)
      Event start(be), end(be);
      be->Record(start.get(), s);
      for (int i = 0; i < kIterations; ++i) group[r]->ReduceScatter(bufs[r].get(), shard, s);
      be->Record(end.get(), s);
      be->EventSync(end.get());
      seconds[r] = be->ElapsedSeconds(start.get(), end.get());
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) {
    backends[r]->BindThread();
    bufs[r] = DeviceBuffer();
  }
  const double worst = *std::max_element(seconds.begin(), seconds.end());
  if (!(worst > 0)) return absl::InternalError("the reduce-scatter timing came out empty");
  // What each device moves each way: (N-1)/N of the buffer.
  return 4.0 * shard * (ranks - 1) * kIterations / worst / 1e9;
}

}  // namespace megatrain
