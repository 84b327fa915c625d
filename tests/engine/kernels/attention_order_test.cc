// The Hopper attention backward's iteration (engine/kernels/cuda/attention_order.h, what the
// dk/dv kernel visits) on the CPU, over packed documents, windows and GQA: every visible
// (query, key) pair is visited by the consumer that holds the key; and the one-pass
// backward's fixed order of dq sums is a total order per query tile that the blocks, started
// in the kernel's ticket order with few resident at once, always finish (a wait that no
// block can end would hang the GPU).
#include "engine/kernels/cuda/attention_order.h"

#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace megatrain::cuda::order {
namespace {

constexpr int kKeyBlock = 128, kKeys = 64, kTile = 64;  // DkDvTiles: kN, a consumer's, kM

struct Batch {
  int n = 0;
  int window = 0;  // 0: none
  int group = 1;   // query heads per kv head
  std::vector<int32_t> doc_start;
};

Batch RandomBatch(std::mt19937* rng, int n, int window, int group, int docs) {
  Batch b;
  b.n = n;
  b.window = window;
  b.group = group;
  std::vector<int> starts = {0};
  for (int d = 1; d < docs && n > 1; ++d) starts.push_back(1 + static_cast<int>((*rng)() % (n - 1)));
  std::sort(starts.begin(), starts.end());
  b.doc_start.resize(n);
  size_t s = 0;
  for (int i = 0; i < n; ++i) {
    while (s + 1 < starts.size() && starts[s + 1] <= i) ++s;
    b.doc_start[i] = starts[s];
  }
  return b;
}

int First(const Batch& b, int i) {
  return b.window > 0 ? FirstKey<true>(b.doc_start.data(), i, b.window)
                      : FirstKey<false>(b.doc_start.data(), i, b.window);
}

// One consumer's items: (head, tile start) in the kernel's order, and whether it meets each.
struct Item {
  int head = 0, i0 = 0, i_last = 0;
  bool active = false;
};

std::vector<Item> ConsumerItems(const Batch& b, int block, int cw) {
  const int j0 = block * kKeyBlock, j_last = std::min(j0 + kKeyBlock, b.n) - 1;
  const int* ds = b.doc_start.data();
  const int i_end = b.window > 0 ? KeyBlockQueryEnd<true>(ds, j_last, b.window, b.n)
                                 : KeyBlockQueryEnd<false>(ds, j_last, b.window, b.n);
  const int tiles = (i_end - j0 + kTile - 1) / kTile;
  const int ka = j0 + kKeys * cw, kb = std::min(ka + kKeys - 1, b.n - 1);
  std::vector<Item> items;
  for (int it = 0; it < b.group * tiles; ++it) {
    Item item;
    DkDvItem(it, b.group, tiles, j0, kTile, &item.head, &item.i0);
    item.i_last = std::min(item.i0 + kTile, b.n) - 1;
    item.active = ka < b.n && (b.window > 0 ? TileMeetsKeys<true>(ds, item.i0, item.i_last, ka, kb,
                                                                   b.window)
                                            : TileMeetsKeys<false>(ds, item.i0, item.i_last, ka,
                                                                   kb, b.window));
    items.push_back(item);
  }
  return items;
}

int Blocks(const Batch& b) { return (b.n + kKeyBlock - 1) / kKeyBlock; }

// Every visible pair (FirstKey(i) <= j <= i) is in an active item of the consumer of j.
void ExpectEveryPairVisited(const Batch& b) {
  std::map<std::pair<int, int>, bool> active;  // (consumer c, tile start) -> active
  for (int block = 0; block < Blocks(b); ++block) {
    for (int cw = 0; cw < 2; ++cw) {
      for (const Item& item : ConsumerItems(b, block, cw)) {
        if (item.head == 0) active[{2 * block + cw, item.i0}] = item.active;
      }
    }
  }
  for (int i = 0; i < b.n; ++i) {
    for (int j = First(b, i); j <= i; ++j) {
      const auto it = active.find({j / kKeys, i / kTile * kTile});
      ASSERT_TRUE(it != active.end() && it->second)
          << "n " << b.n << " window " << b.window << ": query " << i << ", key " << j;
    }
  }
}

// A query tile's active consumers add in ascending order of their keys: their counts
// before them are 0, 1, ... m - 1.
void ExpectATotalOrderPerTile(const Batch& b) {
  std::map<std::pair<int, int>, std::vector<std::pair<int, int>>> adds;  // tile -> (c, before)
  for (int block = 0; block < Blocks(b); ++block) {
    for (int cw = 0; cw < 2; ++cw) {
      const int c = 2 * block + cw;
      for (const Item& item : ConsumerItems(b, block, cw)) {
        if (item.active) {
          adds[{item.head, item.i0}].push_back({c, DqAddsBefore(First(b, item.i0), c * kKeys)});
        }
      }
    }
  }
  for (auto& [tile, list] : adds) {
    std::sort(list.begin(), list.end(), [](auto& x, auto& y) { return x.first < y.first; });
    for (size_t k = 0; k < list.size(); ++k) {
      ASSERT_EQ(list[k].second, static_cast<int>(k))
          << "n " << b.n << " window " << b.window << " tile " << tile.second << " consumer "
          << list[k].first;
    }
  }
}

// The blocks in the order they start (the kernel's tickets: the lowest keys first; or the
// highest first), at most `resident` at once, each consumer through its items: an active one waits for the
// tile's count, adds, and raises the count when it starts its next item (or ends); a
// consumer starts item t only once the other has finished item t - 2 (the two-stage ring
// both release). Whether every block finishes.
bool OrderFinishes(const Batch& b, int resident, bool highest_first = false) {
  struct Consumer {
    std::vector<Item> items;
    size_t next = 0;           // the item it is at
    bool started = false;      // past the ring's wait for `next`
    std::pair<int, int> pending{-1, -1};  // the tile whose count it raises next
    bool pending_set = false;
  };
  struct Block {
    int index = 0;
    Consumer c[2];
  };
  std::map<std::pair<int, int>, int> count;
  std::vector<Block> running;
  int launched = 0;
  const int blocks = Blocks(b);
  auto launch = [&] {
    Block block;
    int kv_head = 0;
    FusedBlock(highest_first ? blocks - 1 - launched : launched, 1, &block.index, &kv_head);
    ++launched;
    for (int cw = 0; cw < 2; ++cw) block.c[cw].items = ConsumerItems(b, block.index, cw);
    running.push_back(std::move(block));
  };
  auto release = [&](Consumer& c) {
    if (c.pending_set) ++count[c.pending];
    c.pending_set = false;
  };
  while (launched < blocks && static_cast<int>(running.size()) < resident) launch();
  while (!running.empty()) {
    bool progress = false;
    for (size_t r = 0; r < running.size(); ++r) {
      Block& block = running[r];
      for (int cw = 0; cw < 2; ++cw) {
        Consumer& c = block.c[cw];
        const Consumer& other = block.c[1 - cw];
        if (c.next == c.items.size()) {
          if (c.pending_set) {
            release(c);
            progress = true;
          }
          continue;
        }
        if (!c.started) {
          if (c.next >= 2 && other.next < c.next - 1) continue;  // its stage is not loaded
          c.started = true;
          release(c);
          progress = true;
        }
        const Item& item = c.items[c.next];
        if (item.active) {
          const int ka = (2 * block.index + cw) * kKeys;
          const std::pair<int, int> tile{item.head, item.i0};
          if (count[tile] != DqAddsBefore(First(b, item.i0), ka)) continue;  // waits
          c.pending = tile;
          c.pending_set = true;
        }
        ++c.next;
        c.started = false;
        progress = true;
      }
    }
    for (size_t r = 0; r < running.size();) {
      const Block& block = running[r];
      const bool done = block.c[0].next == block.c[0].items.size() && !block.c[0].pending_set &&
                        block.c[1].next == block.c[1].items.size() && !block.c[1].pending_set;
      if (done) {
        running.erase(running.begin() + r);
        progress = true;
      } else {
        ++r;
      }
    }
    while (launched < blocks && static_cast<int>(running.size()) < resident) launch();
    if (!progress) return false;  // no block can go on
  }
  return true;
}

TEST(AttentionOrder, EveryPairIsVisitedAndTheDqOrderIsTotalAndAlwaysFinishes) {
  std::mt19937 rng(7);
  for (int n : {1, 63, 64, 65, 127, 128, 129, 300, 777, 1000, 1531}) {
    for (int window : {0, 37, 128, 200}) {
      for (int docs : {1, 2, 5}) {
        for (int group : {1, 3}) {
          const Batch b = RandomBatch(&rng, n, window, group, docs);
          ExpectEveryPairVisited(b);
          ExpectATotalOrderPerTile(b);
          for (int resident : {1, 2, 5}) {
            EXPECT_TRUE(OrderFinishes(b, resident))
                << "n " << n << " window " << window << " docs " << docs << " group " << group
                << " resident " << resident << ": no block can go on";
          }
        }
      }
    }
  }
}

// The forward's tiles without the mask (ForwardUnmaskedTiles): exactly those that
// ForwardTileMasked says need none, and in them every query of the consumer sees every key,
// so skipping the mask's tests changes nothing.
// Blocks of 128 queries (two consumers) and of 192 (three, head_dim 64): ForwardTiles.
TEST(AttentionOrder, ForwardTilesWithoutTheMaskNeedNone) {
  constexpr int kConsumerRows = 64, kKeyTile = 128;
  std::mt19937 rng(11);
  int unmasked_tiles = 0;
  for (int query_block : {128, 192}) {
    for (int n : {1, 64, 127, 129, 300, 1000, 1531}) {
      for (int window : {0, 37, 128, 200}) {
        for (int docs : {1, 2, 5}) {
          const Batch b = RandomBatch(&rng, n, window, 1, docs);
          auto first_key = [&](int i) { return First(b, i); };
          for (int q0 = 0; q0 < n; q0 += query_block) {
            const int q_last = std::min(q0 + query_block, n) - 1, j_first = first_key(q0);
            const int tiles = (q_last - j_first + kKeyTile) / kKeyTile;
            for (int qa = q0; qa < std::min(q0 + query_block, n); qa += kConsumerRows) {
              const int qb = std::min(qa + kConsumerRows - 1, n - 1), last_lo = first_key(qb);
              int lo = 0, hi = 0;
              ForwardUnmaskedTiles(j_first, last_lo, qa, kKeyTile, &lo, &hi);
              for (int t = 0; t < tiles; ++t) {
                const bool unmasked = t >= lo && t < hi;
                ASSERT_EQ(unmasked, !ForwardTileMasked(j_first, t, last_lo, qa, kKeyTile))
                    << "n " << n << " window " << window << " block " << q0 << " tile " << t;
                if (!unmasked) continue;
                ++unmasked_tiles;
                for (int i = qa; i <= qb; ++i) {
                  for (int j = j_first + t * kKeyTile; j < j_first + (t + 1) * kKeyTile; ++j) {
                    ASSERT_TRUE(j >= first_key(i) && j <= i)
                        << "query " << i << " key " << j << " in an unmasked tile, n " << n;
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(unmasked_tiles, 0);  // the case is exercised
}

// Started highest keys first, a block waits for the adds of blocks that start after it: with
// few resident, none can go on (the simulation above can fail).
TEST(AttentionOrder, HighestKeysFirstWouldHang) {
  std::mt19937 rng(3);
  const Batch b = RandomBatch(&rng, 1000, 0, 1, 1);
  EXPECT_TRUE(OrderFinishes(b, 1));
  EXPECT_FALSE(OrderFinishes(b, 1, /*highest_first=*/true));
  EXPECT_FALSE(OrderFinishes(b, 2, /*highest_first=*/true));
}

// The tickets: the lowest keys first, each key block's kv heads in turn.
TEST(AttentionOrder, TicketsTakeTheLowestKeysFirstAcrossKvHeads) {
  int key_block = -1, kv_head = -1;
  FusedBlock(0, 4, &key_block, &kv_head);
  EXPECT_EQ(key_block, 0);
  EXPECT_EQ(kv_head, 0);
  FusedBlock(5, 4, &key_block, &kv_head);
  EXPECT_EQ(key_block, 1);
  EXPECT_EQ(kv_head, 1);
}

// The items: the tiles from the last down, the group's heads in turn at each; so two blocks
// of a kv head whose queries end at the same tile are at the same tile at the same item.
TEST(AttentionOrder, ItemsRunTheTilesDownwardTheHeadsInTurn) {
  int head = -1, i0 = -1;
  DkDvItem(0, 4, 3, 128, 64, &head, &i0);
  EXPECT_EQ(head, 0);
  EXPECT_EQ(i0, 128 + 2 * 64);
  DkDvItem(5, 4, 3, 128, 64, &head, &i0);
  EXPECT_EQ(head, 1);
  EXPECT_EQ(i0, 128 + 64);
  DkDvItem(11, 4, 3, 128, 64, &head, &i0);
  EXPECT_EQ(head, 3);
  EXPECT_EQ(i0, 128);
}

}  // namespace
}  // namespace megatrain::cuda::order
