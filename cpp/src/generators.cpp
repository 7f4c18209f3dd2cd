#include "libra/generators.h"

#include <algorithm>
#include <cmath>

#include "libra/packing.h"
#include "libra/workload.h"

namespace libra {
namespace {

u64 splitmix64(u64& x) {
  u64 z = (x += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

u64 rotl(u64 x, int k) { return (x << k) | (x >> (64 - k)); }

}  // namespace

Rng::Rng(u64 seed) {
  u64 x = seed;
  for (auto& s : s_) s = splitmix64(x);
}

u64 Rng::next() {
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

double Rng::uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }

double Rng::normal() {
  const double u1 = uniform();
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

i64 Rng::below(i64 n) { return static_cast<i64>(next() % static_cast<u64>(n)); }

void LengthDist::validate() const {
  if (kind != "lognormal" && kind != "mixture" && kind != "empirical")
    fail("length distribution kind must be lognormal, mixture or empirical, got '" + kind + "'");
  require_positive(min_len, "dist.min_len");
  require_positive(cap, "dist.cap");
  if (cap > kMaxTokens) fail("dist.cap exceeds " + std::to_string(kMaxTokens));
  if (min_len > cap) fail("dist.min_len must be <= dist.cap");
  if (kind == "empirical") {
    if (values.empty()) fail("dist.values is empty: an empirical distribution needs lengths");
    validate_lengths(values, kMaxTokens, "dist.values");
    return;
  }
  if (!(median > 0)) fail("dist.median must be positive");
  if (!(sigma >= 0)) fail("dist.sigma must be >= 0");
  if (kind == "mixture") {
    if (!(tail_weight >= 0 && tail_weight <= 1)) fail("dist.tail_weight must be in [0, 1]");
    if (!(tail_xm > 0)) fail("dist.tail_xm must be positive");
    if (!(tail_alpha > 0)) fail("dist.tail_alpha must be positive");
  }
}

i64 LengthDist::draw(Rng& rng) const {
  if (kind == "empirical") return values[static_cast<std::size_t>(rng.below(static_cast<i64>(values.size())))];
  double x;
  if (kind == "mixture" && rng.uniform() < tail_weight) {
    x = tail_xm * std::pow(rng.uniform(), -1.0 / tail_alpha);  // Pareto(xm, alpha)
  } else {
    x = median * std::exp(sigma * rng.normal());  // lognormal with the given median
  }
  const double clipped = std::min(std::max(std::round(x), static_cast<double>(min_len)),
                                  static_cast<double>(cap));
  return static_cast<i64>(clipped);
}

// Presets calibrated to the published statistics of the Libra paper's corpora (arXiv 2607.23250,
// workload section): document-length median 644 tokens; for the 1M set a p99 of about 71K tokens
// and a long tail to about 1M tokens; production-order inter-pool imbalance (max/mean - 1 over
// (pool, slot) groups) of about 1.08 at 256K context, GBS 128, D = 16, P = 8 and about 0.52 at 1M
// context, GBS 32, D = 16, P = 8. Shape: lognormal body (sigma 1.3) plus a Pareto tail, clipped
// to [16, 2^20]. Tail weight, scale and index were chosen with tools/calibrate_presets.py (grid
// over weight and index, bisection for the p99); the body median was then bisected so the
// document median is 644 on 10^6 draws. What each preset reproduces (150 steps, seed 99):
//   libra-256k: median 644, p99 ~23K (no p99 is published for this set);
//               imbalance 1.10 +- 0.03 before, 0.12 after VRSP (the paper: 1.08 -> 0.005). At this
//               spread some packed sequences hold one 256K document and outweigh a whole group's
//               mean, so no placement can reach 0.005 (the exact-cardinality lower bound is higher).
//   libra-1m:   median 643, p99 ~71K, imbalance 0.40 +- 0.02 before, 0.004 after VRSP (the paper:
//               0.52 -> 0.007). With the p99 held at 71K this family tops out near 0.42 before;
//               heavier single sequences raise it only by also raising the after-VRSP figure.
LengthDist preset(const std::string& name) {
  LengthDist d;
  d.kind = "mixture";
  d.sigma = 1.3;
  d.min_len = 16;
  d.cap = 1 << 20;
  if (name == "libra-256k") {
    d.median = 557.2;
    d.tail_weight = 0.08;
    d.tail_xm = 4096.0;
    d.tail_alpha = 1.3;
  } else if (name == "libra-1m") {
    d.median = 621.5;
    d.tail_weight = 0.02;
    d.tail_xm = 38493.0;
    d.tail_alpha = 1.2;
  } else {
    std::string names;
    for (const auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    fail("unknown workload preset '" + name + "' (known: " + names + ")");
  }
  return d;
}

std::vector<std::string> preset_names() { return {"libra-256k", "libra-1m"}; }

std::vector<i64> sample_lengths(const LengthDist& dist, i64 n, u64 seed) {
  dist.validate();
  if (n < 0) fail("n must be >= 0");
  Rng rng(seed);
  std::vector<i64> out(static_cast<std::size_t>(n));
  for (auto& v : out) v = dist.draw(rng);
  return out;
}

std::vector<std::vector<i64>> step_sequences(const LengthDist& dist, i64 gbs, i64 context, u64 seed,
                                             i64 step) {
  dist.validate();
  require_positive(gbs, "gbs");
  require_positive(context, "context");
  if (context > kMaxTokens) fail("context exceeds " + std::to_string(kMaxTokens));
  if (step < 0) fail("step must be >= 0");
  u64 mix = seed ^ (0xD1B54A32D192ED03ULL * static_cast<u64>(step + 1));
  Rng rng(splitmix64(mix));
  const i64 need = gbs * context;
  std::vector<i64> docs;
  i64 total = 0;
  while (total < need) {
    const i64 l = dist.draw(rng);
    docs.push_back(l);
    total += l;
  }
  return pack_production(docs, context, gbs);
}

}  // namespace libra
