// Deterministic document-length generators (platform independent: own RNG and distributions).
#pragma once

#include <string>
#include <vector>

#include "libra/common.h"

namespace libra {

// xoshiro256** seeded through splitmix64; the same seed gives the same stream everywhere.
class Rng {
 public:
  explicit Rng(u64 seed);
  u64 next();
  double uniform();  // in (0, 1)
  double normal();   // standard normal, Box-Muller
  i64 below(i64 n);  // uniform integer in [0, n)

 private:
  u64 s_[4];
};

// A length distribution. kind: "lognormal" (median, sigma), "mixture" (lognormal body plus a
// Pareto tail with probability tail_weight), "empirical" (draw from `values` with replacement).
struct LengthDist {
  std::string kind = "lognormal";
  double median = 644.0;
  double sigma = 1.0;
  double tail_weight = 0.0;
  double tail_xm = 8192.0;
  double tail_alpha = 1.0;
  i64 min_len = 1;
  i64 cap = 1 << 20;
  std::vector<i64> values;

  void validate() const;
  i64 draw(Rng& rng) const;
};

// Named presets; see generators.cpp for the source of every number.
LengthDist preset(const std::string& name);
std::vector<std::string> preset_names();

std::vector<i64> sample_lengths(const LengthDist& dist, i64 n, u64 seed);

// The B packed sequences of one step: draw documents from a stream seeded by (seed, step) until
// B*S tokens are filled, then production-pack them.
std::vector<std::vector<i64>> step_sequences(const LengthDist& dist, i64 gbs, i64 context, u64 seed,
                                             i64 step);

}  // namespace libra
