// KeyChainCache: the page keys of recently matched token sequences, so that a Match on a
// sequence that starts with one matched before (the next turn of a conversation: the whole
// history plus the new messages; a retried or resumed request) hashes only the pages past the
// shared prefix (issue #14: a growing conversation should not rehash what it hashed last turn).
//
// Keys are a pure function of the namespace digest and the tokens (docs/keys.md), so a cached key
// is the key: an entry holds a copy of its full pages' tokens, and a prefix is reused only as far
// as those tokens compare equal, page by page. Entries are found by the key of their first page
// (one page hashed per lookup), and a new sequence that extends an entry replaces it, so a
// conversation holds one entry however many turns it has. Least recently used entries leave
// once the tokens and keys held pass `max_bytes`.
//
// Threads: Keys from any thread; one mutex, held while comparing tokens and copying the reused
// keys, not while hashing.
#ifndef KVCELLAR_CLIENT_KEY_CHAIN_CACHE_H_
#define KVCELLAR_CLIENT_KEY_CHAIN_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <list>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/page_key.h"

namespace kvcellar::client {

class KeyChainCache {
 public:
  // `root`: the namespace digest; `max_bytes` 0 caches nothing (every call hashes every page).
  KeyChainCache(const core::PageKey& root, uint32_t page_size, size_t max_bytes);
  KeyChainCache(const KeyChainCache&) = delete;
  KeyChainCache& operator=(const KeyChainCache&) = delete;

  // The keys of the full pages of `tokens` (== core::ComputePageKeys(root, tokens, page_size));
  // *reused (optional): how many leading keys came from the cache instead of being hashed.
  std::vector<core::PageKey> Keys(absl::Span<const uint32_t> tokens, size_t* reused = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);

  struct Stats {
    uint64_t pages_reused = 0;  // Keys taken from an entry.
    uint64_t pages_hashed = 0;  // Keys computed.
    size_t entries = 0;
    size_t bytes = 0;
  };
  Stats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    uint64_t id = 0;               // Names the entry across an unlock (iterators may dangle).
    std::vector<uint32_t> tokens;  // Full pages only.
    std::vector<core::PageKey> keys;
    size_t bytes() const {
      return tokens.size() * sizeof(uint32_t) + keys.size() * sizeof(keys[0]);
    }
  };
  using EntryList = std::list<Entry>;  // Most recently used first.

  // The entry sharing the most leading pages with `tokens` among those starting with `first`,
  // and that number of pages; {end, 0} when none.
  std::pair<EntryList::iterator, size_t> LongestPrefixLocked(const core::PageKey& first,
                                                             absl::Span<const uint32_t> tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RememberLocked(uint64_t extended_id, absl::Span<const uint32_t> tokens,
                      const std::vector<core::PageKey>& keys) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnindexLocked(EntryList::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const core::PageKey root_;
  const uint32_t page_size_;
  const size_t max_bytes_;
  mutable absl::Mutex mu_;
  EntryList entries_ ABSL_GUARDED_BY(mu_);
  // Entries by the key of their first page.
  absl::flat_hash_map<core::PageKey, std::vector<EntryList::iterator>> by_first_
      ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t pages_reused_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t pages_hashed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcellar::client

#endif  // KVCELLAR_CLIENT_KEY_CHAIN_CACHE_H_
