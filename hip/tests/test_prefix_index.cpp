// Host tests of the prefix index: semantics, then a multi-threaded stress test whose slot
// accounting detects lost or doubly freed blocks.
#include <atomic>
#include <cstdio>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "block_hash.h"
#include "check.h"
#include "prefix_index.h"

using kvtier::BlockHash;
using kvtier::PrefixIndex;
using kvtier::RemoveResult;

namespace {

std::vector<BlockHash> chain(std::int64_t first_token, std::size_t blocks) {
  std::vector<std::int64_t> tokens(blocks * 4);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = first_token + static_cast<std::int64_t>(i);
  return kvtier::block_hashes(tokens.data(), tokens.size(), 4, kvtier::block_hash_root(), nullptr, 0);
}

void test_semantics() {
  PrefixIndex idx(8);
  auto h = chain(100, 5);
  CHECK(idx.insert(h[0], kvtier::kDevice, 10));
  CHECK(idx.insert(h[1], kvtier::kHost, 11));
  CHECK(idx.insert(h[2], kvtier::kDisk, 12));
  CHECK(!idx.insert(h[0], kvtier::kDevice, 99));  // never overwritten
  kvtier::Slots slots[5];
  CHECK(idx.match(h.data(), 5, 0xF, slots) == 3);
  CHECK(slots[0][kvtier::kDevice] == 10 && slots[0][kvtier::kHost] == -1 && slots[2][kvtier::kDisk] == 12);
  CHECK(idx.match(h.data(), 5, 1u << kvtier::kDevice, nullptr) == 1);  // device-only view
  // Locks block removal and eviction of that tier's copy only.
  CHECK(idx.lock(h.data(), 1, kvtier::kDevice));
  CHECK(!idx.lock(h.data(), 2, kvtier::kDevice));  // h[1] has no device copy: all-or-nothing
  CHECK(idx.ref_count(h[0], kvtier::kDevice) == 1 && idx.ref_count(h[1], kvtier::kDevice) == 0);
  CHECK(idx.remove(h[0], kvtier::kDevice) == RemoveResult::kLocked);
  CHECK(idx.eviction_candidates(kvtier::kDevice, 10).empty());
  CHECK(idx.unlock(h.data(), 1, kvtier::kDevice));
  CHECK(!idx.unlock(h.data(), 1, kvtier::kDevice));
  // LRU order and touch.
  CHECK(idx.insert(h[3], kvtier::kDevice, 13));
  auto c = idx.eviction_candidates(kvtier::kDevice, 10);
  CHECK(c.size() == 2 && c[0].first == h[0] && c[1].first == h[3]);
  idx.touch(h.data(), 1, 1u << kvtier::kHost);  // no host copy: the device order stays
  CHECK(idx.eviction_candidates(kvtier::kDevice, 1)[0].first == h[0]);
  idx.touch(h.data(), 1);
  c = idx.eviction_candidates(kvtier::kDevice, 1);
  CHECK(c.size() == 1 && c[0].first == h[3] && c[0].second == 13);
  std::int64_t slot = -1;
  CHECK(idx.remove(h[0], kvtier::kDevice, &slot) == RemoveResult::kRemoved && slot == 10);
  CHECK(idx.remove(h[0], kvtier::kDevice) == RemoveResult::kAbsent);
  CHECK(idx.num_blocks() == 3 && idx.num_copies(kvtier::kDevice) == 1);
  CHECK(idx.match(h.data(), 5, 0xF, nullptr) == 0);  // the chain now starts with a missing block
  // Events: bounded queue of 8; 6 events so far (4 added... 1 removed + 1 refused insert = none).
  auto ev = idx.drain_events(100);
  CHECK(ev.size() == 5 && ev.back().kind == kvtier::EventKind::kRemoved && ev.back().slot == 10);
  for (int i = 0; i < 20; ++i) idx.insert(chain(1000 + i * 100, 1)[0], kvtier::kHost, i);
  CHECK(idx.drain_events(100).size() == 8 && idx.dropped_events() == 12);
  CHECK(idx.check_invariants().empty());
}

// The batch forms do what their one-block forms do, block by block, under one lock.
void test_batches() {
  PrefixIndex idx(64);
  auto h = chain(300, 4);
  const std::int64_t slots[4] = {5, 6, 7, 8};
  bool inserted[4];
  CHECK(idx.insert(h[1], kvtier::kHost, 1));
  idx.insert_many(h.data(), slots, 4, kvtier::kHost, inserted);
  CHECK(inserted[0] && !inserted[1] && inserted[2] && inserted[3]);  // h[1] kept its slot 1
  bool held[4];
  CHECK(idx.insert(h[2], kvtier::kDisk, 0));
  idx.held_in(h.data(), 4, kvtier::kDisk, held);
  CHECK(!held[0] && !held[1] && held[2] && !held[3]);
  CHECK(idx.lock(&h[3], 1, kvtier::kHost));
  RemoveResult res[4];
  std::int64_t removed[4];
  idx.remove_many(h.data(), 4, kvtier::kHost, res, removed);
  CHECK(res[0] == RemoveResult::kRemoved && removed[0] == 5);
  CHECK(res[1] == RemoveResult::kRemoved && removed[1] == 1);
  CHECK(res[2] == RemoveResult::kRemoved && removed[2] == 7);
  CHECK(res[3] == RemoveResult::kLocked && removed[3] == -1);
  idx.remove_many(h.data(), 1, kvtier::kHost, res, removed);
  CHECK(res[0] == RemoveResult::kAbsent && removed[0] == -1);
  CHECK(idx.num_copies(kvtier::kHost) == 1 && idx.num_blocks() == 2);  // h[2] on disk, h[3] on host
  const std::int64_t bad[2] = {9, -1};
  bool threw = false;
  try {
    idx.insert_many(h.data(), bad, 2, kvtier::kDevice, inserted);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw && idx.num_copies(kvtier::kDevice) == 0);  // a bad slot: nothing inserted
  CHECK(idx.check_invariants().empty());
}

// Threads insert, lock, touch, match, evict and remove on a shared key space. Slots come from
// per-tier pools; a slot returned twice, or missing at the end, is a lost/doubly freed block.
void test_concurrent_stress() {
  constexpr int kThreads = 8, kOps = 20000, kKeys = 512, kSlots = 256, kTiers = 3;
  PrefixIndex idx(1024);
  auto keys = chain(5, kKeys);
  std::mutex pool_mu;
  std::vector<std::vector<std::int64_t>> free_slots(kTiers);
  std::vector<std::vector<int>> in_use(kTiers, std::vector<int>(kSlots, 0));
  for (int t = 0; t < kTiers; ++t)
    for (int s = 0; s < kSlots; ++s) free_slots[t].push_back(s);
  std::atomic<int> errors{0};
  auto take = [&](int t) -> std::int64_t {
    std::lock_guard<std::mutex> g(pool_mu);
    if (free_slots[t].empty()) return -1;
    std::int64_t s = free_slots[t].back();
    free_slots[t].pop_back();
    if (in_use[t][s]++ != 0) ++errors;
    return s;
  };
  auto give = [&](int t, std::int64_t s) {
    std::lock_guard<std::mutex> g(pool_mu);
    if (in_use[t][s]-- != 1) ++errors;  // double free
    free_slots[t].push_back(s);
  };
  auto worker = [&](unsigned seed) {
    std::mt19937 rng(seed);
    std::vector<std::pair<BlockHash, int>> held;
    for (int op = 0; op < kOps; ++op) {
      const int t = static_cast<int>(rng() % kTiers);
      const BlockHash& k = keys[rng() % kKeys];
      switch (rng() % 6) {
        case 0:
        case 1: {
          std::int64_t s = take(t);
          if (s >= 0 && !idx.insert(k, t, s)) give(t, s);
          break;
        }
        case 2:
          if (idx.lock(&k, 1, t)) held.emplace_back(k, t);
          break;
        case 3:
          if (!held.empty()) {
            auto [hk, ht] = held.back();
            held.pop_back();
            if (!idx.unlock(&hk, 1, ht)) ++errors;
          }
          break;
        case 4: {
          for (auto& [hash, slot] : idx.eviction_candidates(t, 4)) {
            std::int64_t removed = -1;
            if (idx.remove(hash, t, &removed) == RemoveResult::kRemoved) give(t, removed);
          }
          break;
        }
        default: {
          std::size_t start = rng() % kKeys, n = std::min<std::size_t>(16, kKeys - start);
          idx.match(keys.data() + start, n, 0xF, nullptr);
          idx.touch(keys.data() + start, n);
        }
      }
    }
    for (auto& [hk, ht] : held)
      if (!idx.unlock(&hk, 1, ht)) ++errors;
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, 1234u + static_cast<unsigned>(i));
  for (auto& th : threads) th.join();
  CHECK(errors.load() == 0);
  CHECK(idx.check_invariants().empty());
  for (int t = 0; t < kTiers; ++t) {
    auto all = idx.eviction_candidates(t, kSlots + 1);  // every copy: nothing is locked now
    CHECK(all.size() == idx.num_copies(t));
    std::vector<int> seen(kSlots, 0);
    for (auto& [h, s] : all) {
      CHECK(in_use[t][s] == 1);
      ++seen[s];
    }
    for (std::int64_t s : free_slots[t]) ++seen[s];
    for (int s = 0; s < kSlots; ++s) CHECK(seen[s] == 1);  // each slot either indexed or free, once
  }
}

}  // namespace

int main() {
  test_batches();
  test_semantics();
  test_concurrent_stress();
  std::printf("prefix_index: ok\n");
  return 0;
}
