// Prefix index of the tiered KV pool: which tiers hold a copy of each block, keyed by the
// chained block hash (block_hash.h), with per-tier reference counts, per-tier LRU order and an
// event stream for schedulers and routers.
//
// Thread safety: every public method may be called from any thread (one internal mutex).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "block_hash.h"

namespace kvtier {

// Tiers, fastest first. The slot of a block in a tier is an opaque id owned by that tier
// (device page id, host slot, disk slot); -1 means "no copy in this tier".
enum Tier : int { kDevice = 0, kHost = 1, kDisk = 2, kRemote = 3 };
constexpr int kNumTiers = 4;
using Slots = std::array<std::int64_t, kNumTiers>;

struct BlockHashHasher {
  std::size_t operator()(const BlockHash& h) const noexcept {
    std::uint64_t v;  // SHA-256 output is uniform: its first 8 bytes are a good bucket hash
    std::memcpy(&v, h.data(), sizeof(v));
    return static_cast<std::size_t>(v);
  }
};

enum class EventKind : std::uint8_t { kAdded = 0, kRemoved = 1 };

struct Event {
  EventKind kind;
  int tier;
  BlockHash hash;
  std::int64_t slot;  // the slot added or removed
};

enum class RemoveResult : int { kRemoved = 0, kAbsent = 1, kLocked = 2 };

class PrefixIndex {
 public:
  // max_events: the event queue keeps at most this many undrained events; older ones are
  // dropped (and counted) so memory stays bounded when nobody drains.
  explicit PrefixIndex(std::size_t max_events = 1 << 16);

  // Records a copy of block `hash` at `slot` in `tier` (most recently used). Returns false and
  // changes nothing when the block already has a copy in that tier (never overwritten).
  bool insert(const BlockHash& hash, int tier, std::int64_t slot);

  // Drops the copy in `tier`; its slot goes to *removed_slot (may be nullptr). kLocked: the copy
  // is referenced and nothing changes.
  RemoveResult remove(const BlockHash& hash, int tier, std::int64_t* removed_slot = nullptr);

  // insert() for each of hashes[0..n) at slots[i], under one lock; inserted[i] says which
  // were recorded (false: that tier already had a copy).
  void insert_many(const BlockHash* hashes, const std::int64_t* slots, std::size_t n, int tier, bool* inserted);

  // remove() for each of hashes[0..n), under one lock: results[i] and removed_slots[i] (-1
  // unless removed).
  void remove_many(const BlockHash* hashes, std::size_t n, int tier, RemoveResult* results,
                   std::int64_t* removed_slots);

  // held[i]: whether block hashes[i] has a copy in `tier` (any block, not only a prefix run).
  void held_in(const BlockHash* hashes, std::size_t n, int tier, bool* held) const;

  // Longest run hashes[0..m) of blocks having a copy in at least one tier of `tier_mask`
  // (bit t = tier t). Writes the slots of each matched block to out_slots (may be nullptr)
  // and returns m.
  std::size_t match(const BlockHash* hashes, std::size_t n, std::uint32_t tier_mask, Slots* out_slots) const;

  // Marks blocks as most recently used in every tier of `tier_mask` holding them (bit t = tier
  // t); absent ones are skipped.
  void touch(const BlockHash* hashes, std::size_t n, std::uint32_t tier_mask = 0xFu);

  // Adds one reference to the copy in `tier` of each block hashes[0..n). All-or-nothing:
  // returns false and changes nothing if any block has no copy in that tier.
  bool lock(const BlockHash* hashes, std::size_t n, int tier);

  // Drops one reference per block. Returns false and changes nothing if any copy is absent
  // or unreferenced.
  bool unlock(const BlockHash* hashes, std::size_t n, int tier);

  // Up to max_n unreferenced copies in `tier`, least recently used first.
  std::vector<std::pair<BlockHash, std::int64_t>> eviction_candidates(int tier, std::size_t max_n) const;

  // Removes and returns up to max_n oldest events.
  std::vector<Event> drain_events(std::size_t max_n);
  std::uint64_t dropped_events() const;

  std::size_t num_blocks() const;              // blocks with a copy in any tier
  std::size_t num_copies(int tier) const;      // copies held in `tier`
  std::int32_t ref_count(const BlockHash& hash, int tier) const;  // 0 when absent

  // Empty when every internal invariant holds (LRU lists <-> map, counts, no empty entries),
  // else a description of the first violation. For tests.
  std::string check_invariants() const;

 private:
  struct Entry {
    Slots slots;
    std::array<std::int32_t, kNumTiers> refs{};
    std::array<std::list<BlockHash>::iterator, kNumTiers> lru_pos;
  };
  using Map = std::unordered_map<BlockHash, Entry, BlockHashHasher>;

  static void check_tier(int tier);
  static void check_slot(std::int64_t slot);
  bool insert_locked(const BlockHash& hash, int tier, std::int64_t slot);        // under mu_
  RemoveResult remove_locked(const BlockHash& hash, int tier, std::int64_t* removed_slot);  // under mu_
  bool copies_in(const BlockHash* hashes, std::size_t n, int tier, std::vector<Entry*>* out);
  void push_event(EventKind kind, int tier, const BlockHash& hash, std::int64_t slot);

  mutable std::mutex mu_;
  Map map_;
  std::array<std::list<BlockHash>, kNumTiers> lru_;  // front = least recently used
  std::deque<Event> events_;
  std::size_t max_events_;
  std::uint64_t dropped_events_ = 0;
};

}  // namespace kvtier
