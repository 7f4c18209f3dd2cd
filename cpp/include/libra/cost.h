// The planner's time model of attention work, and its fit from measured times.
//
// Without a table (CostModel::active() false) the planner balances causal pairs x heads, as it
// always has. With one, the work of a segment - q_len query rows of one document against their
// causal prefix of kv_len keys, over `heads` heads - is its predicted time:
//
//     heads * (sum over its rows i of (i + 1) * per_pair[bin(i + 1)] + q_len * per_row)
//       + per_segment
//
// (rows i in [kv_len - q_len, kv_len)): each row's pairs priced at the rate of its attended
// length, bin() putting lengths into half-octave bins. Pairs add up over any cut of the rows,
// so a tile's price does not depend on how its document was cut into tiles. A tile of one document is priced as one segment, without per_segment unless
// its rows start the document (CostModel::rows); a tile of several whole documents is one
// segment per document. The per-rank constant (per_rank) is part of a rank's predicted time
// but the same on every rank, so it never changes a placement.
#pragma once

#include <array>
#include <vector>

#include "libra/common.h"

namespace libra {

// Half-octave bins of the attended length over [1, 2^30]: bin(l) = 2 floor(log2 l) + (l >=
// sqrt(2) 2^floor(log2 l)), so bin(1) = 0, bin(2) = 2, bin(3) = 3, ..., bin(2^30) = 60.
constexpr i64 kCostBins = 61;

inline i64 cost_bin(i64 kv_len) {
  if (kv_len <= 1) return 0;
  i64 e = 63 - __builtin_clzll(static_cast<unsigned long long>(kv_len));
  // l >= sqrt(2) * 2^e  <=>  l^2 >= 2^(2e+1); l <= 2^30 so l^2 fits
  const i64 half = (kv_len * kv_len >= (i64(1) << (2 * e + 1))) ? 1 : 0;
  return std::min<i64>(kCostBins - 1, 2 * e + half);
}

// The smallest attended length of bin b (bins are contiguous ranges; bin 1 is empty: it starts
// where bin 2 does), and one past the largest of the last bin for b = kCostBins.
i64 cost_bin_start(i64 b);

// Calls f(bin, pairs) for each bin holding some of the rows [a, b) of a document against their
// causal prefix: row i attends i + 1 keys, so its i + 1 pairs fall in bin(i + 1).
template <typename F>
void for_pairs_by_bin(i64 a, i64 b, F&& f) {
  if (b <= a) return;
  const i64 x = a + 1, y = b;  // attended lengths of the rows
  for (i64 bin = cost_bin(x), last = cost_bin(y); bin <= last; ++bin) {
    const i64 u = std::max(x, cost_bin_start(bin)), v = std::min(y, cost_bin_start(bin + 1) - 1);
    if (u <= v) f(bin, (u + v) * (v - u + 1) / 2);
  }
}

// Features of one segment, and of a rank's work (sums of them): per bin, the pairs x heads of
// the rows whose attended length falls in it; then
// query rows x heads, segments, and 1 (the per-rank constant). The predicted time is their dot
// product with CostModel::coefficients().
constexpr i64 kCostFeatures = kCostBins + 3;
constexpr i64 kFeatureRows = kCostBins, kFeatureSegments = kCostBins + 1,
              kFeatureConstant = kCostBins + 2;

// How the planner sums a run of documents' prices: those at even positions into one sum, those
// at odd positions into another, then the two added - a fixed order (the same bits wherever a
// run is summed) whose two chains of additions overlap.
struct PriceSum {
  double even = 0.0, odd = 0.0;
  bool at_odd = false;
  void add(double x) {
    (at_odd ? odd : even) += x;
    at_odd = !at_odd;
  }
  double total() const { return even + odd; }
};

struct CostModel {
  std::vector<double> per_pair;  // [kCostBins] time per causal pair and head; empty = no table
  double per_row = 0;            // time per query row and head
  double per_segment = 0;        // time per segment (a document's rows in one kernel call)
  double per_rank = 0;           // a rank's fixed time per step (not used in placement)

  // [kCostBins + 1], set by prepare(): the price of the rows attending 1 .. start(b) - 1 keys;
  // with it a segment costs O(1) (two look-ups) instead of a walk over its bins.
  std::vector<double> prefix;
  // attended(l) for l < kSmallAttended, set by prepare(): most documents are short, and a
  // step prices each of them - the runs TAP coalesces hold documents shorter than its block
  // (context / 16: 16384 at 256K), so up to there a price is one look-up (two tables of 128
  // KiB, made once per table: the planner at D = 512 priced 1.20x -> 1.16x pairs' time).
  static constexpr i64 kSmallAttended = 16384;
  std::vector<double> small;
  std::vector<double> small_doc;  // doc_price(l) for l < kSmallAttended, set by prepare()
  // cost_bin_start(b) for b <= kCostBins, set by prepare() (a look-up without the clamps).
  std::array<i64, kCostBins + 1> bin_start{};
  // The per_pair table prefix and small were made from (prepare() is a no-op while it matches).
  std::vector<double> prepared_for;

  bool active() const { return !per_pair.empty(); }
  // Makes prefix and small from per_pair (O(1) prices); nothing while they were made from the
  // same entries, and nothing for a model without a table or with a per_pair of the wrong size
  // (prices then walk the bins).
  void prepare();
  void unprepare() {
    prefix.clear();
    small.clear();
    small_doc.clear();
    prepared_for.clear();
  }
  // A whole document of l tokens over one head, without per_segment.
  double doc_price(i64 l) const {
    if (l >= 0 && l < static_cast<i64>(small_doc.size())) return small_doc[static_cast<std::size_t>(l)];
    return attended(l) + static_cast<double>(l) * per_row;
  }
  // Whole documents of these lengths over `heads` heads, the price of a tile of several whole
  // documents and of a sequence: heads * (their doc_price summed as PriceSum sums them) +
  // count * per_segment.
  double documents(const i64* lengths, i64 count, i64 heads) const;
  double whole_documents(double price_sum, i64 count, i64 heads) const {
    return static_cast<double>(heads) * price_sum + static_cast<double>(count) * per_segment;
  }
  // sum over l = 1 .. x of l * per_pair[bin(l)]: the pairs of rows [0, x) of a document priced
  // (O(1) after prepare(): a look-up below kSmallAttended, two above).
  double attended(i64 x) const {
    if (x <= 0) return 0.0;
    if (x < static_cast<i64>(small.size())) return small[static_cast<std::size_t>(x)];
    if (prefix.empty()) return attended_walk(x);
    const i64 b = cost_bin(x), u = bin_start[static_cast<std::size_t>(b)];
    return prefix[static_cast<std::size_t>(b)] +
           static_cast<double>((u + x) * (x - u + 1) / 2) * per_pair[static_cast<std::size_t>(b)];
  }
  // Sizes, finite and non-negative entries, at least one positive per_pair entry; names the
  // field and index of the first that is not.
  void validate() const;
  double segment(i64 q_len, i64 kv_len, i64 heads) const {
    return static_cast<double>(heads) *
               (attended(kv_len) - attended(kv_len - q_len) + static_cast<double>(q_len) * per_row) +
           per_segment;
  }
  // Rows [a, b) of a document against their prefix [0, b), as the planner prices a tile: the
  // segment's time, per_segment only where the rows start the document (a == 0) - the operator
  // runs a document's consecutive rows on one rank as one segment, so later row blocks
  // continue the segment of the rows before them.
  double rows(i64 a, i64 b, i64 heads) const {
    return segment(b - a, b, heads) - (a > 0 ? per_segment : 0.0);
  }
  // The smallest c in [lo, hi] (0 < lo) whose rows [c, b) weigh at most `want` over `heads`
  // heads (rows(c, b, heads) <= want), hi when none does; rows(c, b) falls as c rises. O(log
  // bins) after prepare(): the crossing's bin found among the bins' prefix sums, the quadratic
  // inside it solved, the estimate settled on rows() itself.
  i64 tail_start(i64 lo, i64 hi, i64 b, i64 heads, double want) const;
  // The smallest c in [lo, hi] (0 < lo) whose rows [0, c) weigh at least `want` over `heads`
  // heads (rows(0, c, heads) >= want), hi when none before it does; rows(0, c) rises with c.
  // The same search as tail_start's: a binary search over the rows finds the same c.
  i64 prefix_end(i64 lo, i64 hi, i64 heads, double want) const;
  // [kCostFeatures] in the order of the features.
  std::vector<double> coefficients() const;
  static CostModel from_coefficients(const std::vector<double>& x);

 private:
  double attended_walk(i64 x) const;  // without prepare(): a walk over the bins
  // An estimate of the first c in [lo, hi] with attended(c) + c * per_row >= target: lo or hi
  // where the crossing is not inside, else the crossing's bin among the bins' prefix sums and
  // the quadratic inside it solved (off by a row or two at most: callers settle it).
  i64 crossing(i64 lo, i64 hi, double target) const;
};

// Adds one segment's features to f ([kCostFeatures]); the constant is not touched.
void add_segment_features(double* f, i64 q_len, i64 kv_len, i64 heads);

// Non-negative least squares on normal equations: the x >= 0 minimising
//   x' G x - 2 b' x + alpha * sum_j d_j (x_j - prior_j)^2,   d_j = G_jj (1 where G_jj = 0),
// i.e. a fit pulled towards `prior` where the data says little (a feature never seen keeps its
// prior value). G is n x n row-major, symmetric positive semi-definite. Lawson-Hanson's active
// set on the regularised system (positive definite: every sub-system solves by Cholesky), at
// most min(max_sweeps, 3n + 10) outer steps; deterministic (plain loops in a fixed order), so
// every rank that solves the same G, b gets the same bits.
struct NnlsResult {
  std::vector<double> x;
  i64 sweeps = 0;
  bool converged = false;
};
NnlsResult nnls_normal(const std::vector<double>& G, const std::vector<double>& b,
                       const std::vector<double>& prior, double alpha, i64 max_sweeps = 20000);

}  // namespace libra
