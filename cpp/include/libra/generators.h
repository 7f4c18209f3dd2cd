// Deterministic document-length generators (platform independent: own RNG and distributions).
#pragma once

#include <array>
#include <mutex>
#include <string>
#include <vector>

#include "libra/batch.h"
#include "libra/common.h"

namespace libra {

// xoshiro256** seeded through splitmix64; the same seed gives the same stream everywhere.
class Rng {
 public:
  explicit Rng(u64 seed);
  u64 next() {
    const u64 result = rotl(s_[1] * 5, 7) * 9;
    const u64 t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }  // in (0, 1)
  double normal();   // standard normal, Box-Muller
  i64 below(i64 n) { return static_cast<i64>(next() % static_cast<u64>(n)); }  // in [0, n)

 private:
  static u64 rotl(u64 x, int k) { return (x << k) | (x >> (64 - k)); }
  u64 s_[4];
};

// A length distribution. kind: "lognormal" (median, sigma), "mixture" (lognormal body, plus a
// Pareto tail with probability tail_weight clipped to `cap`, plus long documents with probability
// long_weight: lognormal(long_median, long_sigma) clipped to `long_cap`, which may exceed any
// context; production packing cuts them at sequence boundaries into context-length pieces),
// "empirical" (draw from `values` with replacement).
struct LengthDist {
  std::string kind = "lognormal";
  double median = 644.0;
  double sigma = 1.0;
  double tail_weight = 0.0;
  double tail_xm = 8192.0;
  double tail_alpha = 1.0;
  double long_weight = 0.0;
  double long_median = 4194304.0;
  double long_sigma = 0.5;
  i64 long_cap = i64(1) << 26;
  i64 min_len = 1;
  i64 cap = 1 << 20;
  std::vector<i64> values;

  void validate() const;
  i64 draw(Rng& rng) const;
  // n draws into out, the same values as n calls of draw(rng) (and rng left as they leave it):
  // the uniforms are taken in order on this thread, the lengths made from them on `workers`.
  void draw_many(Rng& rng, i64* out, std::size_t n, std::size_t workers = 1) const;
};

// The check of draw_many's fast lengths (polynomial log / cos / exp, libm only near a rounding
// boundary) against their definition (libm for every draw): n draws of the stream `seed` plus
// edge draws (uniforms at 0, 1 and the reductions' boundaries) for every component.
struct FastLengthCheck {
  std::size_t draws = 0;       // draws compared
  std::size_t mismatches = 0;  // lengths that differ from the definition's (must be 0)
  std::size_t exact = 0;       // draws the fast path handed to libm
};
FastLengthCheck check_fast_lengths(const LengthDist& dist, u64 seed, std::size_t n);

// Automatic workers of draw_many's lengths (threads = 0): one per kDrawsPerWorker draws, at most
// kMaxDrawThreads and the idle cores (auto_workers).
constexpr std::size_t kDrawsPerWorker = 32768;
constexpr std::size_t kMaxDrawThreads = 8;

// Named presets; see generators.cpp for the source of every number.
LengthDist preset(const std::string& name);
std::vector<std::string> preset_names();

std::vector<i64> sample_lengths(const LengthDist& dist, i64 n, u64 seed);

// The B packed sequences of one step. With shuffle_window = 1: draw documents from a stream
// seeded by (seed, step) until B*S tokens are filled, then production-pack them. With W > 1 the
// step is one slice of a shuffled window (window_sequences of step / W): Megatron's GPTDataset
// packs its document stream into samples and then serves them through a random shuffle index, so
// the pieces of one long document land in different steps and a step's sequences are a random
// draw from the packed stream rather than neighbours in it. `threads`: 0 = automatic
// (auto_workers); the sequences do not depend on it.
PackedBatch step_sequences(const LengthDist& dist, i64 gbs, i64 context, u64 seed, i64 step,
                           i64 shuffle_window = 1, i64 threads = 0);

// The W*B packed sequences of steps [window*W, (window+1)*W): the packed stream in stream order,
// and `order`, the stream sequence at each shuffled position (step k of the window takes the
// positions [k*B, (k+1)*B)).
struct ShuffledWindow {
  PackedBatch stream;
  std::vector<i64> order;
};
ShuffledWindow window_stream(const LengthDist& dist, i64 gbs, i64 context, u64 seed, i64 window,
                             i64 shuffle_window, i64 threads = 0);
// The same window made into `out`, whose buffers' capacity is reused.
void window_stream(const LengthDist& dist, i64 gbs, i64 context, u64 seed, i64 window,
                   i64 shuffle_window, i64 threads, ShuffledWindow& out);

// A source's current window and the steps served from it (step_sequences' steps, the window
// made once for its W steps). The window's buffers are reused from one window to the next: at
// D = 512 a window is ~35 MB, and fresh pages (faulted and zeroed) for each would cost more
// than the copy of a step out of it. Calls from several threads are serialized.
class WindowCache {
 public:
  WindowCache(LengthDist dist, i64 shuffle_window);
  PackedBatch step(i64 gbs, i64 context, u64 seed, i64 step, i64 threads = 0);
  const LengthDist& dist() const { return dist_; }
  i64 shuffle_window() const { return shuffle_window_; }

 private:
  LengthDist dist_;
  i64 shuffle_window_;
  std::mutex mutex_;
  bool valid_ = false;
  std::array<i64, 4> key_{};  // gbs, context, seed, window
  ShuffledWindow window_;
};

// Sequences order[0], ..., order[n-1] of `from`, in that order (each order entry checked),
// copied on `threads` threads (0 = automatic: one per kGatherPerWorker documents, at most
// kMaxDrawThreads and the idle cores; the result does not depend on it).
constexpr std::size_t kGatherPerWorker = 131072;
PackedBatch gather_sequences(const SequencesView& from, const i64* order, std::size_t n,
                             i64 threads = 1);

// The W*B packed sequences of steps [window*W, (window+1)*W) in their shuffled order.
PackedBatch window_sequences(const LengthDist& dist, i64 gbs, i64 context, u64 seed, i64 window,
                             i64 shuffle_window, i64 threads = 0);

}  // namespace libra
