// Which cached expert to evict. One interface, one small class per policy (like llama.cpp's
// samplers): a policy sees uses and insertions and names a victim; it never touches slots or I/O.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

// A cached expert: (layer, expert) packed into one key.
using expert_key = uint64_t;
inline expert_key make_expert_key(int layer, int expert) { return ((uint64_t) (uint32_t) layer << 32) | (uint32_t) expert; }

struct cache_policy {
    virtual ~cache_policy() = default;
    virtual const char * name() const = 0;
    // key was requested and is cached (a hit), or was just loaded (after on_insert)
    virtual void on_use(expert_key key) = 0;
    virtual void on_insert(expert_key key) = 0;
    virtual void on_evict(expert_key key) = 0;
    // the cached key to evict next among those for which evictable(key) is true; false if none
    virtual bool victim(const std::function<bool(expert_key)> & evictable, expert_key * out) const = 0;
};

// "lru" or "lfu"; throws std::invalid_argument for another name
std::unique_ptr<cache_policy> make_cache_policy(const std::string & name);
