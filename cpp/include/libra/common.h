// Shared helpers for the Libra planner core: integer type, input validation, hashing.
#pragma once

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

// An allocator whose resize() leaves new elements uninitialised (other constructions as usual):
// for the plan's large arrays, which are written in full right after they are sized, so they are
// not zero-filled first.
template <typename T>
struct UninitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = UninitAllocator<U>;
  };
  UninitAllocator() noexcept = default;
  template <typename U>
  UninitAllocator(const UninitAllocator<U>&) noexcept {}
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

// 64-bit hash over 64-bit words for the StepPlan hash that ranks compare: FNV-1a steps on four
// interleaved lanes (word i feeds lane i mod 4, so the multiplies do not wait on each other),
// folded and finished with a splitmix64 mix. Deterministic and platform independent. An array
// is hashed as its elements, then its length, so it can be fed in pieces as it is written.
class PlanHasher {
 public:
  void value(i64 v) { word(static_cast<u64>(v)); }
  void value(double v) { word(bits(v)); }
  // The same steps as value() on each element, four at a time on local copies of the lanes.
  template <typename T>
  void words(const T* v, std::size_t n) {
    static_assert(sizeof(T) == 8, "hash 64-bit elements");
    std::size_t i = 0;
    for (; i < n && (n_ & 3) != 0; ++i) value(v[i]);
    u64 h0 = h_[0], h1 = h_[1], h2 = h_[2], h3 = h_[3];
    const std::size_t quads = (n - i) / 4;
    for (std::size_t q = 0; q < quads; ++q, i += 4) {
      h0 = (h0 ^ bits(v[i])) * kPrime;
      h1 = (h1 ^ bits(v[i + 1])) * kPrime;
      h2 = (h2 ^ bits(v[i + 2])) * kPrime;
      h3 = (h3 ^ bits(v[i + 3])) * kPrime;
    }
    h_[0] = h0; h_[1] = h1; h_[2] = h2; h_[3] = h3;
    n_ += 4 * quads;
    for (; i < n; ++i) value(v[i]);
  }
  template <typename T, typename A>
  void vec(const std::vector<T, A>& v) {
    words(v.data(), v.size());
    value(static_cast<i64>(v.size()));
  }
  u64 digest() const {
    u64 z = 0;
    for (u64 h : h_) z = (z ^ h) * kPrime;
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }

 private:
  static constexpr u64 kPrime = 1099511628211ULL;
  static u64 bits(i64 v) { return static_cast<u64>(v); }
  static u64 bits(double v) {
    u64 w;
    static_assert(sizeof(w) == sizeof(v), "double must be 64-bit");
    std::memcpy(&w, &v, sizeof(w));
    return w;
  }
  void word(u64 w) {
    u64& h = h_[n_++ & 3];
    h = (h ^ w) * kPrime;
  }
  u64 h_[4] = {1469598103934665603ULL, 1469598103934665604ULL, 1469598103934665605ULL,
               1469598103934665606ULL};
  u64 n_ = 0;
};

}  // namespace libra
