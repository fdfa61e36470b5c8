#include "prefix_index.h"

#include <stdexcept>

namespace kvtier {

PrefixIndex::PrefixIndex(std::size_t max_events) : max_events_(max_events) {}

void PrefixIndex::check_tier(int tier) {
  if (tier < 0 || tier >= kNumTiers)
    throw std::invalid_argument("tier must be in [0, " + std::to_string(kNumTiers) + "), got " + std::to_string(tier));
}

void PrefixIndex::push_event(EventKind kind, int tier, const BlockHash& hash, std::int64_t slot) {
  if (max_events_ == 0) {
    ++dropped_events_;
    return;
  }
  if (events_.size() >= max_events_) {
    events_.pop_front();
    ++dropped_events_;
  }
  events_.push_back(Event{kind, tier, hash, slot});
}

void PrefixIndex::check_slot(std::int64_t slot) {
  if (slot < 0) throw std::invalid_argument("slot must be >= 0, got " + std::to_string(slot));
}

bool PrefixIndex::insert(const BlockHash& hash, int tier, std::int64_t slot) {
  check_tier(tier);
  check_slot(slot);
  std::lock_guard<std::mutex> g(mu_);
  return insert_locked(hash, tier, slot);
}

void PrefixIndex::insert_many(const BlockHash* hashes, const std::int64_t* slots, std::size_t n, int tier,
                              bool* inserted) {
  check_tier(tier);
  for (std::size_t i = 0; i < n; ++i) check_slot(slots[i]);
  std::lock_guard<std::mutex> g(mu_);
  for (std::size_t i = 0; i < n; ++i) inserted[i] = insert_locked(hashes[i], tier, slots[i]);
}

bool PrefixIndex::insert_locked(const BlockHash& hash, int tier, std::int64_t slot) {
  auto [it, fresh] = map_.try_emplace(hash);
  Entry& e = it->second;
  if (fresh) e.slots.fill(-1);
  if (e.slots[tier] >= 0) return false;
  e.slots[tier] = slot;
  e.lru_pos[tier] = lru_[tier].insert(lru_[tier].end(), hash);
  push_event(EventKind::kAdded, tier, hash, slot);
  return true;
}

RemoveResult PrefixIndex::remove(const BlockHash& hash, int tier, std::int64_t* removed_slot) {
  check_tier(tier);
  std::lock_guard<std::mutex> g(mu_);
  return remove_locked(hash, tier, removed_slot);
}

void PrefixIndex::remove_many(const BlockHash* hashes, std::size_t n, int tier, RemoveResult* results,
                              std::int64_t* removed_slots) {
  check_tier(tier);
  std::lock_guard<std::mutex> g(mu_);
  for (std::size_t i = 0; i < n; ++i) {
    removed_slots[i] = -1;
    results[i] = remove_locked(hashes[i], tier, &removed_slots[i]);
  }
}

RemoveResult PrefixIndex::remove_locked(const BlockHash& hash, int tier, std::int64_t* removed_slot) {
  auto it = map_.find(hash);
  if (it == map_.end() || it->second.slots[tier] < 0) return RemoveResult::kAbsent;
  Entry& e = it->second;
  if (e.refs[tier] > 0) return RemoveResult::kLocked;
  const std::int64_t slot = e.slots[tier];
  lru_[tier].erase(e.lru_pos[tier]);
  e.slots[tier] = -1;
  bool empty = true;
  for (int t = 0; t < kNumTiers; ++t) empty = empty && e.slots[t] < 0;
  if (empty) map_.erase(it);
  push_event(EventKind::kRemoved, tier, hash, slot);
  if (removed_slot) *removed_slot = slot;
  return RemoveResult::kRemoved;
}

void PrefixIndex::held_in(const BlockHash* hashes, std::size_t n, int tier, bool* held) const {
  check_tier(tier);
  std::lock_guard<std::mutex> g(mu_);
  for (std::size_t i = 0; i < n; ++i) {
    auto it = map_.find(hashes[i]);
    held[i] = it != map_.end() && it->second.slots[tier] >= 0;
  }
}

std::size_t PrefixIndex::match(const BlockHash* hashes, std::size_t n, std::uint32_t tier_mask,
                               Slots* out_slots) const {
  std::lock_guard<std::mutex> g(mu_);
  std::size_t m = 0;
  for (; m < n; ++m) {
    auto it = map_.find(hashes[m]);
    if (it == map_.end()) break;
    bool any = false;
    for (int t = 0; t < kNumTiers; ++t) any = any || ((tier_mask >> t) & 1u && it->second.slots[t] >= 0);
    if (!any) break;
    if (out_slots) out_slots[m] = it->second.slots;
  }
  return m;
}

void PrefixIndex::touch(const BlockHash* hashes, std::size_t n, std::uint32_t tier_mask) {
  std::lock_guard<std::mutex> g(mu_);
  for (std::size_t i = 0; i < n; ++i) {
    auto it = map_.find(hashes[i]);
    if (it == map_.end()) continue;
    for (int t = 0; t < kNumTiers; ++t) {
      if ((tier_mask >> t) & 1u && it->second.slots[t] >= 0)
        lru_[t].splice(lru_[t].end(), lru_[t], it->second.lru_pos[t]);
    }
  }
}

// Under mu_: the entries of hashes[0..n) that have a copy in `tier`; false if one has none.
bool PrefixIndex::copies_in(const BlockHash* hashes, std::size_t n, int tier, std::vector<Entry*>* out) {
  out->reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    auto it = map_.find(hashes[i]);
    if (it == map_.end() || it->second.slots[tier] < 0) return false;
    out->push_back(&it->second);
  }
  return true;
}

bool PrefixIndex::lock(const BlockHash* hashes, std::size_t n, int tier) {
  check_tier(tier);
  std::lock_guard<std::mutex> g(mu_);
  std::vector<Entry*> entries;
  if (!copies_in(hashes, n, tier, &entries)) return false;
  for (Entry* e : entries) ++e->refs[tier];
  return true;
}

bool PrefixIndex::unlock(const BlockHash* hashes, std::size_t n, int tier) {
  check_tier(tier);
  std::lock_guard<std::mutex> g(mu_);
  std::vector<Entry*> entries;
  if (!copies_in(hashes, n, tier, &entries)) return false;
  // The same block may appear several times: check the total per entry first.
  std::unordered_map<Entry*, std::int32_t> need;
  for (Entry* e : entries) ++need[e];
  for (auto& [e, k] : need)
    if (e->refs[tier] < k) return false;
  for (Entry* e : entries) --e->refs[tier];
  return true;
}

std::vector<std::pair<BlockHash, std::int64_t>> PrefixIndex::eviction_candidates(int tier, std::size_t max_n) const {
  check_tier(tier);
  std::lock_guard<std::mutex> g(mu_);
  std::vector<std::pair<BlockHash, std::int64_t>> out;
  for (const BlockHash& h : lru_[tier]) {
    if (out.size() >= max_n) break;
    const Entry& e = map_.at(h);
    if (e.refs[tier] == 0) out.emplace_back(h, e.slots[tier]);
  }
  return out;
}

std::vector<Event> PrefixIndex::drain_events(std::size_t max_n) {
  std::lock_guard<std::mutex> g(mu_);
  const std::size_t k = std::min(max_n, events_.size());
  std::vector<Event> out(events_.begin(), events_.begin() + static_cast<std::ptrdiff_t>(k));
  events_.erase(events_.begin(), events_.begin() + static_cast<std::ptrdiff_t>(k));
  return out;
}

std::uint64_t PrefixIndex::dropped_events() const {
  std::lock_guard<std::mutex> g(mu_);
  return dropped_events_;
}

std::size_t PrefixIndex::num_blocks() const {
  std::lock_guard<std::mutex> g(mu_);
  return map_.size();
}

std::size_t PrefixIndex::num_copies(int tier) const {
  check_tier(tier);
  std::lock_guard<std::mutex> g(mu_);
  return lru_[tier].size();
}

std::int32_t PrefixIndex::ref_count(const BlockHash& hash, int tier) const {
  check_tier(tier);
  std::lock_guard<std::mutex> g(mu_);
  auto it = map_.find(hash);
  return it == map_.end() ? 0 : it->second.refs[tier];
}

std::string PrefixIndex::check_invariants() const {
  std::lock_guard<std::mutex> g(mu_);
  std::array<std::size_t, kNumTiers> copies{};
  for (const auto& [h, e] : map_) {
    bool any = false;
    for (int t = 0; t < kNumTiers; ++t) {
      if (e.slots[t] >= 0) {
        any = true;
        ++copies[t];
        if (*e.lru_pos[t] != h) return "LRU position of a block points at another block";
      } else if (e.refs[t] != 0) {
        return "a tier without a copy holds references";
      }
      if (e.refs[t] < 0) return "negative reference count";
    }
    if (!any) return "an entry without any copy";
  }
  for (int t = 0; t < kNumTiers; ++t) {
    if (copies[t] != lru_[t].size()) return "tier " + std::to_string(t) + " LRU size differs from its copies";
    for (const BlockHash& h : lru_[t]) {
      auto it = map_.find(h);
      if (it == map_.end() || it->second.slots[t] < 0) return "LRU list holds a block without a copy";
    }
  }
  return "";
}

}  // namespace kvtier
