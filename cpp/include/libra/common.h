// Shared helpers for the Libra planner core: integer type, input validation, hashing.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace libra {

using i64 = std::int64_t;
using u64 = std::uint64_t;

// Largest packed-sequence / document length accepted. Keeps l*(l+1)/2 far below 2^63.
constexpr i64 kMaxTokens = i64(1) << 30;

// The plan's large arrays come from a pool of blocks kept for reuse once freed (by the next
// plan, in this process): a fresh block from the system is a run of page faults on first write,
// and whether glibc hands one back or gives a fresh one depends on every allocation the process
// made before (its dynamic mmap and trim thresholds) - measured at D = 512, the same plan took
// 11.5 or 22.6 ms depending on it. Blocks of at least kPooledBytes are rounded up to eight size
// classes per octave and kept up to kPoolBytes in all (a full pool gives back other size classes
// first); smaller ones come from operator new.
constexpr std::size_t kPooledBytes = std::size_t(1) << 16;
constexpr std::size_t kPoolBytes = std::size_t(1) << 28;
void* pool_allocate(std::size_t bytes);
void pool_deallocate(void* block, std::size_t bytes) noexcept;
struct PoolStats {
  // blocks of at least kPooledBytes: bytes kept, blocks handed out again, taken from the
  // system, and given back to it to make room for another size class
  std::size_t kept_bytes = 0, reused = 0, fresh = 0, evicted = 0;
};
PoolStats pool_stats();

// An allocator whose resize() leaves new elements uninitialised (other constructions as usual):
// for the plan's large arrays, which are written in full right after they are sized, so they are
// not zero-filled first; their memory comes from the block pool above.
template <typename T>
struct UninitAllocator : std::allocator<T> {
  using value_type = T;
  template <typename U>
  struct rebind {
    using other = UninitAllocator<U>;
  };
  UninitAllocator() noexcept = default;
  template <typename U>
  UninitAllocator(const UninitAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    if (n > static_cast<std::size_t>(-1) / sizeof(T)) throw std::bad_array_new_length();
    return static_cast<T*>(pool_allocate(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept { pool_deallocate(p, n * sizeof(T)); }
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible<U>::value) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

// The plan's integer arrays.
using PlanArray = std::vector<i64, UninitAllocator<i64>>;

// Every invalid input raises std::invalid_argument naming the field (and index where there is one).
[[noreturn]] inline void fail(const std::string& msg) { throw std::invalid_argument(msg); }

inline std::string field_at(const std::string& field, i64 index) {
  return field + "[" + std::to_string(index) + "]";
}

inline void require_positive(i64 value, const std::string& field) {
  if (value <= 0) fail(field + " must be positive, got " + std::to_string(value));
}

inline void require_at_most(i64 value, i64 limit, const std::string& field, const std::string& shown) {
  if (value > limit) fail(field + " must be at most " + shown + ", got " + std::to_string(value));
}

// Largest replica count and cp / tp size accepted (products of them stay far below 2^63).
constexpr i64 kMaxReplicas = i64(1) << 24;
constexpr i64 kMaxSplit = i64(1) << 16;

// 64-bit hash over 64-bit words for the StepPlan hash that ranks compare. Words are taken in
// rounds of eight, two per lane of four: lane = mix(a ^ lane ^ k0, b ^ k1), where mix folds the
// 128-bit product of its arguments (one multiply per two words; the lanes do not wait on each
// other). The last partial round is padded with zeros, the word count mixed in, and the lanes
// folded and finished with a splitmix64 mix. Deterministic and platform independent; a stream
// may be fed in pieces (`words` as it is written) with the same result as at once.
class PlanHasher {
 public:
  void value(i64 v) { words(&v, 1); }
  void value(double v) {
    const u64 w = bits(v);
    words(&w, 1);
  }
  template <typename T>
  void words(const T* v, std::size_t n) {
    static_assert(sizeof(T) == 8, "hash 64-bit elements");
    std::size_t i = 0;
    while (i < n && pending_ != 0) {  // complete a started round first
      buf_[pending_++] = bits(v[i++]);
      if (pending_ == kRound) {
        round(buf_);
        pending_ = 0;
      }
    }
    u64 w[kRound];
    for (; i + kRound <= n; i += kRound) {
      for (std::size_t j = 0; j < kRound; ++j) w[j] = bits(v[i + j]);
      round(w);
    }
    for (; i < n; ++i) buf_[pending_++] = bits(v[i]);
    count_ += n;
  }
  template <typename T, typename A>
  void vec(const std::vector<T, A>& v) {
    words(v.data(), v.size());
    value(static_cast<i64>(v.size()));
  }
  u64 digest() const {
    u64 h[4] = {h_[0], h_[1], h_[2], h_[3]};
    if (pending_ != 0) {
      u64 w[kRound] = {};
      std::copy(buf_, buf_ + pending_, w);
      for (std::size_t l = 0; l < 4; ++l) h[l] = mix(w[2 * l] ^ h[l] ^ kK0, w[2 * l + 1] ^ kK1);
    }
    u64 z = count_;
    for (u64 x : h) z = mix(z ^ x ^ kK0, kK1 ^ 0x9E3779B97F4A7C15ULL);
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }

 private:
  static constexpr std::size_t kRound = 8;
  static constexpr u64 kK0 = 0xA0761D6478BD642FULL, kK1 = 0xE7037ED1A0B428DBULL;
  static u64 mix(u64 a, u64 b) {
    const unsigned __int128 r = static_cast<unsigned __int128>(a) * b;
    return static_cast<u64>(r) ^ static_cast<u64>(r >> 64);
  }
  void round(const u64* w) {
    h_[0] = mix(w[0] ^ h_[0] ^ kK0, w[1] ^ kK1);
    h_[1] = mix(w[2] ^ h_[1] ^ kK0, w[3] ^ kK1);
    h_[2] = mix(w[4] ^ h_[2] ^ kK0, w[5] ^ kK1);
    h_[3] = mix(w[6] ^ h_[3] ^ kK0, w[7] ^ kK1);
  }
  static u64 bits(i64 v) { return static_cast<u64>(v); }
  static u64 bits(u64 v) { return v; }
  static u64 bits(double v) {
    u64 w;
    static_assert(sizeof(w) == sizeof(v), "double must be 64-bit");
    std::memcpy(&w, &v, sizeof(w));
    return w;
  }
  u64 h_[4] = {0x243F6A8885A308D3ULL, 0x13198A2E03707344ULL, 0xA4093822299F31D0ULL,
               0x082EFA98EC4E6C89ULL};
  u64 buf_[kRound] = {};
  std::size_t pending_ = 0;
  u64 count_ = 0;
};

}  // namespace libra
