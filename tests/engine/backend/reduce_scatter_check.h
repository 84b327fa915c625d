// The reduce-scatter contract (common/collective.h), checked on any group: each rank
// drives its own backend from its own thread, as the pipelines do; after the collective
// each rank's shard holds the sum over ranks of that range, in rank order, for gradients
// whose length does not divide evenly, twice in a row (the group is reusable).
#pragma once

#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "engine/common/backend.h"
#include "engine/common/collective.h"
#include "engine/common/dtype.h"
#include "gtest/gtest.h"

namespace megatrain::testing {

inline void CheckReduceScatter(const std::vector<Backend*>& backends,
                               const std::vector<std::unique_ptr<GradCollective>>& group) {
  const int ranks = static_cast<int>(backends.size());
  ASSERT_EQ(group.size(), backends.size());
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(group[r]->rank(), r);
    EXPECT_EQ(group[r]->size(), ranks);
  }
  // value(rank, round, i), exact in f32 so that any summation order gives the same bits.
  auto value = [](int r, int round, int64_t i) {
    return static_cast<float>((i % 97) * (r + 1) + round * 1000 + r);
  };
  for (const int64_t n : {int64_t{1000}, int64_t{7}, int64_t{4096 * 3 + 5}}) {
    const int64_t shard = GradShardElements(n, ranks);
    ASSERT_GE(shard * ranks, n);
    for (int round = 0; round < 2; ++round) {
      std::vector<std::vector<float>> got(ranks);
      std::vector<std::thread> threads;
      for (int r = 0; r < ranks; ++r) {
        threads.emplace_back([&, r] {
          Backend* be = backends[r];
          be->BindThread();
          ASSERT_EQ(be->grad_dtype(), DType::kF32);
          absl::StatusOr<DeviceBuffer> buf = DeviceBuffer::Allocate(be, shard * ranks * 4);
          ASSERT_TRUE(buf.ok()) << buf.status();
          std::vector<float> host(shard * ranks, -1.0f);  // padding: anything
          for (int64_t i = 0; i < n; ++i) host[i] = value(r, round, i);
          be->CopyToDevice(buf->get(), host.data(), host.size() * 4, StreamId::kD2H);
          group[r]->ReduceScatter(buf->get(), shard, StreamId::kD2H);
          got[r].resize(shard);
          be->CopyToHost(got[r].data(), static_cast<char*>(buf->get()) + r * shard * 4,
                         shard * 4, StreamId::kD2H);
          be->SyncAll();
        });
      }
      for (std::thread& t : threads) t.join();
      for (int r = 0; r < ranks; ++r) {
        for (int64_t j = 0; j < shard && r * shard + j < n; ++j) {
          const int64_t i = r * shard + j;
          float want = 0;
          for (int q = 0; q < ranks; ++q) want += value(q, round, i);
          ASSERT_EQ(got[r][j], want) << "n " << n << " rank " << r << " element " << i;
        }
      }
    }
  }
}

}  // namespace megatrain::testing
