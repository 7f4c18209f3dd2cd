#include "libra/cost.h"

#include <cmath>
#include <string>

#include "libra/workload.h"

namespace libra {

namespace {

void require_finite_non_negative(double v, const std::string& field) {
  if (!std::isfinite(v) || v < 0)
    fail(field + " must be finite and >= 0, got " + std::to_string(v));
}

}  // namespace

namespace {

std::vector<i64> make_bin_starts() {
  std::vector<i64> out(static_cast<std::size_t>(kCostBins + 1), 0);
  out[kCostBins] = kMaxTokens + 1;
  for (i64 bin = kCostBins - 1; bin >= 0; --bin) {  // from the top: an empty bin starts where the next does
    const i64 e = bin / 2;
    i64 l = i64(1) << e;
    if (bin % 2 == 1) {  // sqrt(2) 2^e rounded up, exact: the least l with l^2 >= 2^(2e+1)
      const i64 target = i64(1) << (2 * e + 1);
      l = static_cast<i64>(std::ceil(std::sqrt(2.0) * static_cast<double>(i64(1) << e)));
      while (l > 1 && (l - 1) * (l - 1) >= target) --l;
      while (l * l < target) ++l;
    }
    out[bin] = std::min(l, out[bin + 1]);
  }
  return out;
}

// Made once at load time (no guard on every look-up).
const std::vector<i64> kBinStarts = make_bin_starts();

}  // namespace

i64 cost_bin_start(i64 b) {
  return kBinStarts[static_cast<std::size_t>(std::min<i64>(std::max<i64>(b, 0), kCostBins))];
}

void CostModel::validate() const {
  if (!active()) {
    if (per_row != 0 || per_segment != 0 || per_rank != 0)
      fail("cost.per_pair is empty (no table) but per_row, per_segment or per_rank is set");
    return;
  }
  if (static_cast<i64>(per_pair.size()) != kCostBins)
    fail("cost.per_pair must have " + std::to_string(kCostBins) + " entries (half-octave bins of "
         "the attended length), got " + std::to_string(per_pair.size()));
  bool any = false;
  for (std::size_t i = 0; i < per_pair.size(); ++i) {
    require_finite_non_negative(per_pair[i], field_at("cost.per_pair", static_cast<i64>(i)));
    any |= per_pair[i] > 0;
  }
  if (!any) fail("cost.per_pair: at least one entry must be positive, all are 0");
  require_finite_non_negative(per_row, "cost.per_row");
  require_finite_non_negative(per_segment, "cost.per_segment");
  require_finite_non_negative(per_rank, "cost.per_rank");
}

void CostModel::prepare() {
  if (per_pair.size() != static_cast<std::size_t>(kCostBins)) {
    unprepare();
    return;
  }
  if (prepared_for == per_pair && prefix.size() == static_cast<std::size_t>(kCostBins + 1) &&
      small.size() == static_cast<std::size_t>(kSmallAttended))
    return;  // made from this table already
  small.clear();  // (attended() below reads the bins' prefix until the table is in place)
  prefix.assign(static_cast<std::size_t>(kCostBins + 1), 0.0);
  for (i64 b = 0; b <= kCostBins; ++b) bin_start[static_cast<std::size_t>(b)] = cost_bin_start(b);
  for (i64 b = 0; b < kCostBins; ++b) {
    const i64 u = cost_bin_start(b), v = cost_bin_start(b + 1) - 1;
    const double full = u <= v ? static_cast<double>((u + v) * (v - u + 1) / 2) : 0.0;
    prefix[b + 1] = prefix[b] + full * per_pair[static_cast<std::size_t>(b)];
  }
  std::vector<double> table(static_cast<std::size_t>(kSmallAttended), 0.0);
  for (i64 l = 1; l < kSmallAttended; ++l) table[static_cast<std::size_t>(l)] = attended(l);
  small = std::move(table);
  small_doc.clear();  // (doc_price() below prices without it until it is in place)
  std::vector<double> docs(static_cast<std::size_t>(kSmallAttended), 0.0);
  for (i64 l = 1; l < kSmallAttended; ++l) docs[static_cast<std::size_t>(l)] = doc_price(l);
  small_doc = std::move(docs);
  prepared_for = per_pair;
}

double CostModel::attended_walk(i64 x) const {
  double t = 0;
  for_pairs_by_bin(0, x, [&](i64 bin, i64 pairs) {
    t += static_cast<double>(pairs) * per_pair[static_cast<std::size_t>(bin)];
  });
  return t;
}

i64 CostModel::crossing(i64 lo, i64 hi, double target) const {
  // F(c) = attended(c) + c * per_row rises with c
  auto F = [&](i64 c) { return attended(c) + static_cast<double>(c) * per_row; };
  if (F(lo) >= target) return lo;
  if (F(hi) < target) return hi;
  // the crossing's bin: the last whose first row is still short of the target
  i64 bin_lo = cost_bin(lo), bin_hi = cost_bin(hi);
  while (bin_lo < bin_hi) {
    const i64 mid = bin_lo + (bin_hi - bin_lo + 1) / 2;
    if (F(cost_bin_start(mid)) < target) bin_lo = mid; else bin_hi = mid - 1;
  }
  // inside bin_lo: F(u + k) = F(u) + p (k u + k (k + 1) / 2) + k per_row, a quadratic in k
  const i64 u = std::max(lo, cost_bin_start(bin_lo));
  const double p = per_pair[static_cast<std::size_t>(bin_lo)];
  const double need = target - F(u);
  const double B = p * (static_cast<double>(u) + 0.5) + per_row;
  double k;
  if (p > 0) {
    k = (-B + std::sqrt(std::max(0.0, B * B + 2.0 * p * need))) / p;
  } else {
    k = B > 0 ? need / B : static_cast<double>(hi - u);
  }
  const i64 c = std::isfinite(k) ? u + static_cast<i64>(std::ceil(std::max(0.0, k))) : hi;
  return std::min(std::max(c, lo), hi);
}

i64 CostModel::tail_start(i64 lo, i64 hi, i64 b, i64 heads, double want) const {
  if (lo >= hi) return hi;
  // rows(c, b) <= want  <=>  F(c) = attended(c) + c * per_row >= attended(b) + b * per_row -
  // want / heads (c > 0, so no per_segment): F rises with c
  const double h = static_cast<double>(heads), Ab = attended(b);
  const double target = Ab + static_cast<double>(b) * per_row - want / h;
  // rows(c, b, heads) for c > 0, the same operations with attended(b) made once
  auto R = [&](i64 c) {
    return (h * (Ab - attended(c) + static_cast<double>(b - c) * per_row) + per_segment) -
           per_segment;
  };
  // the estimate settled on rows() itself (a row or two at most): the first c in [lo, hi]
  // that fits, hi when none does
  i64 c = crossing(lo, hi, target);
  while (c > lo && R(c - 1) <= want) --c;
  while (c < hi && R(c) > want) ++c;
  return c;
}

i64 CostModel::prefix_end(i64 lo, i64 hi, i64 heads, double want) const {
  if (lo >= hi) return hi;
  // rows(0, c) >= want  <=>  F(c) >= (want - per_segment) / heads
  const double h = static_cast<double>(heads);
  auto P = [&](i64 c) { return rows(0, c, heads) >= want; };
  i64 c = crossing(lo, hi, (want - per_segment) / h);
  while (c > lo && P(c - 1)) --c;
  while (c < hi && !P(c)) ++c;
  return c;
}

double CostModel::documents(const i64* lengths, i64 count, i64 heads) const {
  double even = 0.0, odd = 0.0;  // PriceSum's order, two documents a step
  i64 d = 0;
  for (; d + 2 <= count; d += 2) {
    even += doc_price(lengths[d]);
    odd += doc_price(lengths[d + 1]);
  }
  if (d < count) even += doc_price(lengths[d]);
  return whole_documents(even + odd, count, heads);
}

std::vector<double> CostModel::coefficients() const {
  std::vector<double> x(static_cast<std::size_t>(kCostFeatures), 0.0);
  std::copy(per_pair.begin(), per_pair.end(), x.begin());
  x[kFeatureRows] = per_row;
  x[kFeatureSegments] = per_segment;
  x[kFeatureConstant] = per_rank;
  return x;
}

CostModel CostModel::from_coefficients(const std::vector<double>& x) {
  if (static_cast<i64>(x.size()) != kCostFeatures)
    fail("coefficients must have " + std::to_string(kCostFeatures) + " entries, got " +
         std::to_string(x.size()));
  CostModel m;
  m.per_pair.assign(x.begin(), x.begin() + kCostBins);
  m.per_row = x[kFeatureRows];
  m.per_segment = x[kFeatureSegments];
  m.per_rank = x[kFeatureConstant];
  return m;
}

void add_segment_features(double* f, i64 q_len, i64 kv_len, i64 heads) {
  const double h = static_cast<double>(heads);
  for_pairs_by_bin(kv_len - q_len, kv_len,
                   [&](i64 bin, i64 pairs) { f[bin] += h * static_cast<double>(pairs); });
  f[kFeatureRows] += h * static_cast<double>(q_len);
  f[kFeatureSegments] += 1.0;
}

NnlsResult nnls_normal(const std::vector<double>& G, const std::vector<double>& b,
                       const std::vector<double>& prior, double alpha, i64 max_sweeps) {
  const std::size_t n = b.size();
  if (n == 0) fail("b must not be empty");
  if (G.size() != n * n)
    fail("G must be " + std::to_string(n) + " x " + std::to_string(n) + " (" +
         std::to_string(n * n) + " entries), got " + std::to_string(G.size()));
  if (prior.size() != n)
    fail("prior must have " + std::to_string(n) + " entries, got " + std::to_string(prior.size()));
  if (!std::isfinite(alpha) || alpha <= 0) fail("alpha must be finite and > 0, got " + std::to_string(alpha));
  if (max_sweeps <= 0) fail("max_sweeps must be positive, got " + std::to_string(max_sweeps));
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(b[i])) fail(field_at("b", static_cast<i64>(i)) + " is not finite");
    require_finite_non_negative(prior[i], field_at("prior", static_cast<i64>(i)));
    if (!std::isfinite(G[i * n + i]) || G[i * n + i] < 0)
      fail(field_at("G", static_cast<i64>(i * n + i)) + " (a diagonal entry) must be finite and >= 0");
    for (std::size_t j = 0; j < n; ++j)
      if (!std::isfinite(G[i * n + j])) fail(field_at("G", static_cast<i64>(i * n + j)) + " is not finite");
  }
  // H = G + alpha D, c = b + alpha D prior: positive definite, so every sub-system solves.
  std::vector<double> H(G), c(n);
  for (std::size_t j = 0; j < n; ++j) {
    const double d = G[j * n + j] > 0 ? G[j * n + j] : 1.0;
    H[j * n + j] += alpha * d;
    c[j] = b[j] + alpha * d * prior[j];
  }
  // Lawson-Hanson active set: the free set grows by the most negative gradient; a sub-solution
  // with a non-positive entry is met half way and that entry leaves the set.
  NnlsResult out;
  out.x.assign(n, 0.0);
  std::vector<char> free_(n, 0);
  std::vector<double> z(n), L, rhs;
  std::vector<std::size_t> F;
  double scale = 0;
  for (std::size_t j = 0; j < n; ++j) scale = std::max(scale, std::abs(c[j]));
  const double tol = 1e-12 * std::max(scale, 1e-300);
  auto solve_free = [&]() {  // z_F = H_FF^-1 c_F by Cholesky; z elsewhere 0
    F.clear();
    for (std::size_t j = 0; j < n; ++j)
      if (free_[j]) F.push_back(j);
    const std::size_t m = F.size();
    L.assign(m * m, 0.0);
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t k = 0; k <= i; ++k) {
        double v = H[F[i] * n + F[k]];
        for (std::size_t t = 0; t < k; ++t) v -= L[i * m + t] * L[k * m + t];
        L[i * m + k] = i == k ? std::sqrt(std::max(v, 1e-300)) : v / L[k * m + k];
      }
    rhs.assign(m, 0.0);
    for (std::size_t i = 0; i < m; ++i) {
      double v = c[F[i]];
      for (std::size_t t = 0; t < i; ++t) v -= L[i * m + t] * rhs[t];
      rhs[i] = v / L[i * m + i];
    }
    for (std::size_t i = m; i-- > 0;) {
      double v = rhs[i];
      for (std::size_t t = i + 1; t < m; ++t) v -= L[t * m + i] * rhs[t];
      rhs[i] = v / L[i * m + i];
    }
    std::fill(z.begin(), z.end(), 0.0);
    for (std::size_t i = 0; i < m; ++i) z[F[i]] = rhs[i];
  };
  const i64 limit = std::min<i64>(max_sweeps, 3 * static_cast<i64>(n) + 10);
  for (out.sweeps = 0; out.sweeps < limit; ++out.sweeps) {
    // gradient (negated): w = c - H x; the most positive w off the free set enters
    std::size_t enter = n;
    double best = tol;
    for (std::size_t j = 0; j < n; ++j) {
      if (free_[j]) continue;
      double w = c[j];
      for (std::size_t k = 0; k < n; ++k) w -= H[j * n + k] * out.x[k];
      if (w > best) {
        best = w;
        enter = j;
      }
    }
    if (enter == n) {
      out.converged = true;
      break;
    }
    free_[enter] = 1;
    for (i64 inner = 0; inner <= static_cast<i64>(n); ++inner) {
      solve_free();
      double step = 1.0;
      std::size_t leave = n;
      for (const std::size_t j : F)
        if (z[j] <= 0) {
          const double a = out.x[j] / (out.x[j] - z[j]);
          if (a < step) {
            step = a;
            leave = j;
          }
        }
      if (leave == n) {
        out.x = z;
        break;
      }
      for (std::size_t j = 0; j < n; ++j) out.x[j] += step * (z[j] - out.x[j]);
      for (const std::size_t j : F)
        if (j == leave || out.x[j] <= 0) {
          out.x[j] = 0;
          free_[j] = 0;
        }
    }
  }
  return out;
}

}  // namespace libra
