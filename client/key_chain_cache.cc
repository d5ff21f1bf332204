#include "client/key_chain_cache.h"

#include <algorithm>
#include <utility>

namespace kvcellar::client {

KeyChainCache::KeyChainCache(const core::PageKey& root, uint32_t page_size, size_t max_bytes)
    : root_(root), page_size_(page_size), max_bytes_(max_bytes) {}

std::vector<core::PageKey> KeyChainCache::Keys(absl::Span<const uint32_t> tokens,
                                               size_t* reused_out) {
  const size_t pages = core::FullPages(tokens.size(), page_size_);
  if (reused_out != nullptr) *reused_out = 0;
  std::vector<core::PageKey> keys(pages);
  if (pages == 0) return keys;
  tokens = tokens.first(pages * page_size_);
  if (max_bytes_ == 0) {
    core::ComputePageKeys(root_, tokens, page_size_, absl::MakeSpan(keys));
    absl::MutexLock lock(&mu_);
    pages_hashed_ += pages;
    return keys;
  }
  // The first page's key finds the candidates; it is the chain's first key either way.
  keys[0] = core::ChainPageKey(root_, tokens.first(page_size_));
  size_t reused = 1;
  uint64_t extended_id = 0;  // The entry the new sequence wholly extends (the previous turn).
  {
    absl::MutexLock lock(&mu_);
    auto [best, common] = LongestPrefixLocked(keys[0], tokens);
    pages_reused_ += common;
    pages_hashed_ += pages - common;
    if (common > 0) {
      std::copy(best->keys.begin(), best->keys.begin() + common, keys.begin());
      reused = common;
      if (reused_out != nullptr) *reused_out = common;
      entries_.splice(entries_.begin(), entries_, best);  // Most recently used.
      if (common == pages) return keys;  // A prefix of what the entry holds: nothing to add.
      if (common == best->keys.size()) extended_id = best->id;
    }
  }
  core::ComputePageKeys(keys[reused - 1], tokens.subspan(reused * page_size_), page_size_,
                        absl::MakeSpan(keys).subspan(reused));
  absl::MutexLock lock(&mu_);
  RememberLocked(extended_id, tokens, keys);
  return keys;
}

std::pair<KeyChainCache::EntryList::iterator, size_t> KeyChainCache::LongestPrefixLocked(
    const core::PageKey& first, absl::Span<const uint32_t> tokens) {
  auto it = by_first_.find(first);
  if (it == by_first_.end()) return {entries_.end(), 0};
  EntryList::iterator best = entries_.end();
  size_t best_pages = 0;
  for (EntryList::iterator e : it->second) {
    const size_t n = std::min(e->tokens.size(), tokens.size());
    const size_t same =
        std::mismatch(e->tokens.begin(), e->tokens.begin() + n, tokens.begin()).first -
        e->tokens.begin();
    const size_t pages = same / page_size_;
    if (pages > best_pages) {
      best = e;
      best_pages = pages;
    }
  }
  return {best, best_pages};
}

void KeyChainCache::RememberLocked(uint64_t extended_id, absl::Span<const uint32_t> tokens,
                                   const std::vector<core::PageKey>& keys) {
  // Another thread may have evicted or replaced the extended entry since the lookup: it is
  // found again by id, under this first key, or the sequence gets an entry of its own.
  EntryList::iterator extended = entries_.end();
  if (auto it = by_first_.find(keys[0]); extended_id != 0 && it != by_first_.end()) {
    for (EntryList::iterator e : it->second) {
      if (e->id == extended_id && e->keys.size() <= keys.size()) extended = e;
    }
  }
  if (extended != entries_.end()) {
    bytes_ -= extended->bytes();
    extended->tokens.assign(tokens.begin(), tokens.end());
    extended->keys = keys;
    bytes_ += extended->bytes();
    entries_.splice(entries_.begin(), entries_, extended);
  } else {
    entries_.push_front(
        Entry{next_id_++, std::vector<uint32_t>(tokens.begin(), tokens.end()), keys});
    by_first_[keys[0]].push_back(entries_.begin());
    bytes_ += entries_.front().bytes();
  }
  // Oldest first; a single sequence larger than the whole budget is not kept at all.
  while (bytes_ > max_bytes_ && !entries_.empty()) {
    EntryList::iterator last = std::prev(entries_.end());
    UnindexLocked(last);
    bytes_ -= last->bytes();
    entries_.erase(last);
  }
}

void KeyChainCache::UnindexLocked(EntryList::iterator it) {
  auto found = by_first_.find(it->keys[0]);
  if (found == by_first_.end()) return;
  std::vector<EntryList::iterator>& list = found->second;
  list.erase(std::remove(list.begin(), list.end(), it), list.end());
  if (list.empty()) by_first_.erase(found);
}

KeyChainCache::Stats KeyChainCache::stats() const {
  absl::MutexLock lock(&mu_);
  return Stats{pages_reused_, pages_hashed_, entries_.size(), bytes_};
}

}  // namespace kvcellar::client
