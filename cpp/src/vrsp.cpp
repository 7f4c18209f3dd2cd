#include "libra/vrsp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <queue>
#include <tuple>
#include <utility>

#include "libra/parallel.h"

namespace libra {
namespace {

// A key whose unsigned order is the order of the (finite) loads; -0.0 is +0.0.
u64 order_key(double x) {
  x += 0.0;  // -0.0 -> +0.0
  u64 b;
  std::memcpy(&b, &x, sizeof b);
  return (b >> 63) != 0 ? ~b : b | (u64(1) << 63);
}

// Indices of the loads in ascending order of key(load), ties by index. A stable radix sort on the
// keys' bytes (bytes that every key shares are skipped); a comparison sort below a few hundred
// loads, where the radix sort's counting would cost more. Either gives the same order.
template <typename Key>
std::vector<i64> ordered_indices(const std::vector<double>& loads, Key key) {
  const std::size_t n = loads.size();
  std::vector<i64> order(n);
  std::iota(order.begin(), order.end(), i64{0});
  std::vector<u64> k(n);
  for (std::size_t i = 0; i < n; ++i) k[i] = key(order_key(loads[i]));
  if (n < 512) {
    std::sort(order.begin(), order.end(), [&](i64 a, i64 b) { return k[a] != k[b] ? k[a] < k[b] : a < b; });
    return order;
  }
  std::vector<i64> next(n);
  for (int shift = 0; shift < 64; shift += 8) {
    std::size_t count[256] = {};
    for (std::size_t i = 0; i < n; ++i) ++count[(k[i] >> shift) & 255];
    if (count[(k[0] >> shift) & 255] == n) continue;  // every key has this byte
    std::size_t start = 0;
    for (std::size_t& c : count) start += std::exchange(c, start);
    for (const i64 i : order) next[count[(k[i] >> shift) & 255]++] = i;
    order.swap(next);
  }
  return order;
}

// Heaviest first, ties by lower index.
std::vector<i64> heaviest_first(const std::vector<double>& loads) {
  return ordered_indices(loads, [](u64 key) { return ~key; });
}

// Lightest first, ties by lower index.
std::vector<i64> lightest_first(const std::vector<double>& loads) {
  return ordered_indices(loads, [](u64 key) { return key; });
}

void check_cardinality(const std::vector<double>& loads, i64 n_groups, i64 cardinality) {
  require_positive(n_groups, "n_groups");
  require_positive(cardinality, "cardinality");
  const i64 n = static_cast<i64>(loads.size());
  if (n % cardinality != 0 || n / cardinality != n_groups)
    fail("exact-cardinality placement needs n_groups * cardinality = " +
         (n_groups <= std::numeric_limits<i64>::max() / cardinality
              ? std::to_string(n_groups * cardinality)
              : std::to_string(n_groups) + " * " + std::to_string(cardinality)) +
         " items, got " + std::to_string(n));
  for (std::size_t i = 0; i < loads.size(); ++i)
    if (!(std::isfinite(loads[i]) && loads[i] >= 0))
      fail(field_at("loads", static_cast<i64>(i)) + " must be a finite number >= 0, got " +
           std::to_string(loads[i]));
}

// Local search after LPT: swap one item of the heaviest group with a lighter item of another group
// while that lowers the heavier of the two below the current maximum (cardinality unchanged).
// Each round takes the swap with the lowest new pair maximum, ties to the lowest (group, item
// position, item position) - what scanning every pair of every group in index order gives.
// Faster, same result for integer-valued loads (FLOP counts): groups are visited lightest first
// and the scan stops once (heaviest + group) / 2, a bound on any swap with that group, exceeds
// the best found; inside a group, for each item of the heaviest group only the two items nearest
// to the ideal partner load (from a copy sorted by load, then position) can be best; taking the
// items of the heaviest group by load, one pointer finds them for all. A pair's best swap depends
// only on the two groups, and a round changes two groups, so each pair's best is kept (per
// heaviest group, the row allocated when that group first is the heaviest) until either of its
// groups changes.
void refine_by_swaps(const std::vector<double>& loads, std::vector<i64>& group, i64 n_groups) {
  using Entry = std::pair<double, std::size_t>;  // (load, position in members[g])
  const std::size_t G = static_cast<std::size_t>(n_groups);
  std::vector<double> gl(G, 0.0);
  std::vector<std::vector<i64>> members(G);
  for (std::size_t i = 0; i < loads.size(); ++i) {
    gl[group[i]] += loads[i];
    members[group[i]].push_back(static_cast<i64>(i));
  }
  std::vector<std::vector<Entry>> sorted(G);
  // run_start[g][i]: index in sorted[g] of the first entry with sorted[g][i]'s load (the item
  // of that load with the lowest position)
  std::vector<std::vector<std::size_t>> run_start(G);
  std::vector<u64> version(G, 1);  // bumped whenever a group changes
  auto runs = [&](i64 g) {
    const auto& v = sorted[g];
    auto& rs = run_start[g];
    rs.resize(v.size());
    for (std::size_t i = 0; i < v.size(); ++i)
      rs[i] = i > 0 && v[i].first == v[i - 1].first ? rs[i - 1] : i;
    ++version[g];
  };
  {  // each group's items by load, then position (= by index): from one order of all items
    std::vector<std::size_t> pos(loads.size());
    for (std::size_t g = 0; g < G; ++g) {
      for (std::size_t k = 0; k < members[g].size(); ++k) pos[members[g][k]] = k;
      sorted[g].reserve(members[g].size());
    }
    for (const i64 i : lightest_first(loads)) sorted[group[i]].push_back({loads[i], pos[i]});
    for (i64 g = 0; g < n_groups; ++g) runs(g);
  }
  // The item at position pos of group g was replaced: its entry moves to its new place.
  auto replaced = [&](i64 g, std::size_t pos) {
    auto& v = sorted[g];
    v.erase(std::find_if(v.begin(), v.end(), [&](const Entry& e) { return e.second == pos; }));
    const Entry e{loads[members[g][pos]], pos};
    v.insert(std::lower_bound(v.begin(), v.end(), e), e);
    runs(g);
  };
  // The best swap of the pair (hi, h): the lowest (pair maximum, a, b) below gl[hi], if any;
  // valid while both groups are at the versions it was found at.
  struct PairBest {
    u64 hi_version = 0, h_version = 0;
    bool found = false;
    double pair_max = 0;
    std::size_t a = 0, b = 0;
  };
  std::vector<std::vector<PairBest>> cache(G);
  auto pair_best = [&](i64 hi, i64 h) {
    PairBest pb{version[hi], version[h]};
    const double top = gl[hi], other = gl[h];
    const double half = (top - other) / 2.0;
    const auto& v = sorted[h];
    const auto& rs = run_start[h];
    auto consider = [&](const Entry& ea, const Entry& eb) {
      const double delta = ea.first - eb.first;
      if (!(delta > 0)) return;
      const double pair_max = std::max(top - delta, other + delta);
      if (!(pair_max < top)) return;
      if (!pb.found || pair_max < pb.pair_max ||
          (pair_max == pb.pair_max && std::make_pair(ea.second, eb.second) < std::make_pair(pb.a, pb.b))) {
        pb.found = true;
        pb.pair_max = pair_max;
        pb.a = ea.second;
        pb.b = eb.second;
      }
    };
    // items a of hi by ascending load: the ideal partner's load rises with a's, so one pointer
    // walks v once
    std::size_t up = 0;
    for (const Entry& ea : sorted[hi]) {
      const double target = ea.first - half;  // the ideal partner's load
      // lightest item at or above the target (its lowest position), and the heaviest below
      while (up < v.size() && v[up].first < target) ++up;
      if (up < v.size()) consider(ea, v[up]);
      if (up > 0) consider(ea, v[rs[up - 1]]);
    }
    return pb;
  };
  std::vector<i64> by_load(G);
  std::iota(by_load.begin(), by_load.end(), 0);
  const i64 limit = 4 * static_cast<i64>(loads.size());
  for (i64 it = 0; it < limit; ++it) {
    const i64 hi = std::max_element(gl.begin(), gl.end()) - gl.begin();
    // lightest first, ties in their previous order: a stable sort, here by insertion (only the
    // two groups of the last swap moved)
    for (std::size_t i = 1; i < by_load.size(); ++i) {
      const i64 x = by_load[i];
      std::size_t j = i;
      for (; j > 0 && gl[x] < gl[by_load[j - 1]]; --j) by_load[j] = by_load[j - 1];
      by_load[j] = x;
    }
    auto& row = cache[hi];
    if (row.empty()) row.resize(G);
    double best = gl[hi];
    i64 best_h = -1;
    std::size_t best_a = 0, best_b = 0;
    for (i64 h : by_load) {
      if (h == hi) continue;
      const double bound = (gl[hi] + gl[h]) / 2.0;
      if (best_h >= 0 && bound > best + 1e-9 * std::abs(best)) break;
      PairBest& pb = row[h];
      if (pb.hi_version != version[hi] || pb.h_version != version[h]) pb = pair_best(hi, h);
      if (pb.found && (pb.pair_max < best ||
                       (best_h >= 0 && pb.pair_max == best &&
                        std::make_tuple(h, pb.a, pb.b) < std::make_tuple(best_h, best_a, best_b)))) {
        best = pb.pair_max;
        best_h = h;
        best_a = pb.a;
        best_b = pb.b;
      }
    }
    if (best_h < 0) break;
    const i64 ia = members[hi][best_a], ib = members[best_h][best_b];
    const double delta = loads[ia] - loads[ib];
    gl[hi] -= delta;
    gl[best_h] += delta;
    std::swap(members[hi][best_a], members[best_h][best_b]);
    group[ia] = best_h;
    group[ib] = hi;
    replaced(hi, best_a);
    replaced(best_h, best_b);
  }
}

}  // namespace

std::vector<i64> exact_cardinality_lpt(const std::vector<double>& loads, i64 n_groups,
                                       i64 cardinality) {
  check_cardinality(loads, n_groups, cardinality);
  using Entry = std::pair<double, i64>;  // (group load, group index): min-heap, ties lower index
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> open;
  for (i64 g = 0; g < n_groups; ++g) open.push({0.0, g});
  std::vector<i64> count(static_cast<std::size_t>(n_groups), 0);
  std::vector<i64> group(loads.size(), -1);
  for (i64 i : heaviest_first(loads)) {
    auto [load, g] = open.top();
    open.pop();
    group[i] = g;
    if (++count[g] < cardinality) open.push({load + loads[i], g});
  }
  refine_by_swaps(loads, group, n_groups);
  return group;
}

namespace {

// The bound of exact_cardinality_lower_bound from the loads sorted heaviest first (x) and their
// prefix sums (prefix[k] = sum of the k heaviest).
double lower_bound_sorted(const std::vector<double>& x, const std::vector<double>& prefix,
                          i64 n_groups, i64 cardinality) {
  const std::size_t n = x.size();
  double bound = prefix[n] / static_cast<double>(n_groups);
  for (i64 j = 1; j <= cardinality; ++j) {
    const i64 top = (j - 1) * n_groups + 1;  // some group holds j of the `top` heaviest items
    const double j_smallest_of_top = prefix[top] - prefix[top - j];
    const i64 rest = cardinality - j;  // its other members weigh at least the lightest items
    const double lightest = prefix[n] - prefix[n - rest];
    bound = std::max(bound, j_smallest_of_top + lightest);
  }
  // The k heaviest items lie in some q groups (ceil(k/card) <= q <= k); those groups hold
  // q*card - k further items, at least the lightest ones, so their heaviest group weighs at least
  // (top k + lightest q*card - k) / q. The bound is the least of these over q.
  // (Scanning q downwards, a q whose value does not exceed the bound so far ends the scan: the
  // least over q cannot raise the bound then; the bound is the same as a full scan's.)
  for (i64 k = 2; k <= std::min<i64>(n_groups, static_cast<i64>(n)); ++k) {
    double least = std::numeric_limits<double>::infinity();
    for (i64 q = k; q >= (k + cardinality - 1) / cardinality; --q) {
      const i64 others = q * cardinality - k;
      least = std::min(least, (prefix[k] + prefix[n] - prefix[n - others]) / static_cast<double>(q));
      if (least <= bound) break;
    }
    bound = std::max(bound, least);
  }
  if (cardinality == 2)  // pairing the i-th heaviest with the i-th lightest is optimal
    for (std::size_t i = 0; i < n / 2; ++i) bound = std::max(bound, x[i] + x[n - 1 - i]);
  return bound;
}

struct SortedLoads {
  std::vector<double> x, prefix;
  explicit SortedLoads(const std::vector<double>& loads) : x(loads.size()), prefix(loads.size() + 1, 0.0) {
    const std::vector<i64> order = heaviest_first(loads);
    for (std::size_t i = 0; i < x.size(); ++i) {
      x[i] = loads[order[i]];
      prefix[i + 1] = prefix[i] + x[i];
    }
  }
};

}  // namespace

double exact_cardinality_lower_bound(const std::vector<double>& loads, i64 n_groups,
                                     i64 cardinality) {
  check_cardinality(loads, n_groups, cardinality);
  const SortedLoads sorted(loads);
  return lower_bound_sorted(sorted.x, sorted.prefix, n_groups, cardinality);
}

PlacementBounds placement_bounds(const std::vector<double>& seq_loads, i64 dp, i64 pool,
                                 i64 slots) {
  check_cardinality(seq_loads, dp / pool * slots, pool);
  const SortedLoads sorted(seq_loads);
  return {lower_bound_sorted(sorted.x, sorted.prefix, dp / pool * slots, pool),
          lower_bound_sorted(sorted.x, sorted.prefix, dp / pool, pool * slots)};
}

namespace {

VrspPlacement finish(const std::vector<double>& seq_loads, const std::vector<i64>& seq_group,
                     const std::vector<i64>& group_pool, i64 dp, i64 pool, i64 slots,
                     bool spread_members) {
  const i64 n_groups = static_cast<i64>(group_pool.size());
  std::vector<double> gload(static_cast<std::size_t>(n_groups), 0.0);
  std::vector<std::vector<i64>> members(static_cast<std::size_t>(n_groups));
  for (std::size_t s = 0; s < seq_loads.size(); ++s) {
    gload[seq_group[s]] += seq_loads[s];
    members[seq_group[s]].push_back(static_cast<i64>(s));
  }
  std::vector<std::vector<i64>> pool_groups(static_cast<std::size_t>(dp / pool));
  for (i64 g = 0; g < n_groups; ++g) pool_groups[group_pool[g]].push_back(g);
  VrspPlacement out;
  out.replica.assign(seq_loads.size(), -1);
  out.slot.assign(seq_loads.size(), -1);
  for (std::size_t k = 0; k < pool_groups.size(); ++k) {
    auto& gs = pool_groups[k];
    std::stable_sort(gs.begin(), gs.end(), [&](i64 a, i64 b) { return gload[a] > gload[b]; });
    std::vector<double> member_load(static_cast<std::size_t>(pool), 0.0);
    for (i64 slot = 0; slot < slots; ++slot) {
      auto& ms = members[gs[slot]];
      std::stable_sort(ms.begin(), ms.end(),
                       [&](i64 a, i64 b) { return seq_loads[a] > seq_loads[b]; });
      // Member i takes the i-th heaviest sequence, or - when sequences stay on their member (no
      // TAP) - the heaviest goes to the member with the least so far, so no member collects the
      // heaviest sequence of every slot.
      std::vector<i64> member(static_cast<std::size_t>(pool));
      std::iota(member.begin(), member.end(), 0);
      if (spread_members)
        std::stable_sort(member.begin(), member.end(),
                         [&](i64 a, i64 b) { return member_load[a] < member_load[b]; });
      for (i64 i = 0; i < pool; ++i) {
        out.replica[ms[i]] = static_cast<i64>(k) * pool + member[i];
        out.slot[ms[i]] = slot;
        member_load[member[i]] += seq_loads[ms[i]];
      }
    }
  }
  out.max_group = gload.empty() ? 0.0 : *std::max_element(gload.begin(), gload.end());
  std::vector<double> ptotal(pool_groups.size(), 0.0);
  for (i64 g = 0; g < n_groups; ++g) ptotal[group_pool[g]] += gload[g];
  out.max_pool = *std::max_element(ptotal.begin(), ptotal.end());
  return out;
}

}  // namespace

namespace {

// A grouping of the sequences: group of every sequence and pool of every group.
struct Grouping {
  std::vector<i64> seq_group;
  std::vector<i64> group_pool;
  double max_pool = 0;   // heaviest pool total
  double max_group = 0;  // heaviest (pool, slot) group
};

Grouping evaluate(const std::vector<double>& loads, std::vector<i64> seq_group,
                  std::vector<i64> group_pool, i64 n_pools) {
  Grouping g{std::move(seq_group), std::move(group_pool)};
  std::vector<double> gl(g.group_pool.size(), 0.0), pl(static_cast<std::size_t>(n_pools), 0.0);
  for (std::size_t s = 0; s < loads.size(); ++s) gl[g.seq_group[s]] += loads[s];
  for (std::size_t k = 0; k < gl.size(); ++k) pl[g.group_pool[k]] += gl[k];
  g.max_group = *std::max_element(gl.begin(), gl.end());
  g.max_pool = *std::max_element(pl.begin(), pl.end());
  return g;
}

// Lighter heaviest pool (beyond rounding), then lighter heaviest group.
bool better(const Grouping& a, const Grouping& b) {
  const double tol = 1e-9 * std::max(1.0, std::abs(b.max_pool));
  if (a.max_pool < b.max_pool - tol) return true;
  if (a.max_pool > b.max_pool + tol) return false;
  return a.max_group < b.max_group;
}

// Pools first: sequences -> D/P pools of exactly P*m (LPT + swaps on pool totals), then each
// pool's sequences -> m groups of P (LPT + swaps on group totals).
Grouping pools_first(const std::vector<double>& loads, i64 n_pools, i64 pool, i64 slots,
                     std::size_t workers) {
  const std::vector<i64> seq_pool = exact_cardinality_lpt(loads, n_pools, pool * slots);
  std::vector<std::vector<i64>> in_pool(static_cast<std::size_t>(n_pools));
  for (std::size_t s = 0; s < loads.size(); ++s) in_pool[seq_pool[s]].push_back(static_cast<i64>(s));
  std::vector<i64> seq_group(loads.size(), -1), group_pool(static_cast<std::size_t>(n_pools * slots));
  // pools are independent: workers take them in turn, each writing its own pool's entries
  run_workers(workers, static_cast<std::size_t>(n_pools), [&](WorkQueue& queue) {
    std::vector<double> sub;
    for (std::size_t k; queue.take(k);) {
      sub.clear();
      for (i64 s : in_pool[k]) sub.push_back(loads[s]);
      const std::vector<i64> g = exact_cardinality_lpt(sub, slots, pool);
      for (std::size_t i = 0; i < sub.size(); ++i)
        seq_group[in_pool[k][i]] = static_cast<i64>(k) * slots + g[i];
      for (i64 j = 0; j < slots; ++j) group_pool[static_cast<i64>(k) * slots + j] = static_cast<i64>(k);
    }
  });
  return evaluate(loads, std::move(seq_group), std::move(group_pool), n_pools);
}

// The production order's groups (see production_slot).
Grouping production_grouping(const std::vector<double>& loads, i64 n_pools, i64 pool, i64 slots,
                             SampleOrder order, i64 micro_batch) {
  std::vector<i64> seq_group(loads.size()), group_pool(static_cast<std::size_t>(n_pools * slots));
  for (std::size_t s = 0; s < loads.size(); ++s) {
    const auto [r, slot] =
        production_slot(static_cast<i64>(s), n_pools * pool, slots, order, micro_batch);
    seq_group[s] = (r / pool) * slots + slot;
  }
  for (std::size_t g = 0; g < group_pool.size(); ++g) group_pool[g] = static_cast<i64>(g) / slots;
  return evaluate(loads, std::move(seq_group), std::move(group_pool), n_pools);
}

}  // namespace

VrspPlacement vrsp_place(const std::vector<double>& seq_loads, i64 dp, i64 pool, i64 slots,
                         SampleOrder order, i64 micro_batch, bool spread_members,
                         std::size_t workers) {
  const i64 n_pools = dp / pool;
  // A rank's attention time without PP is its pool's total / P (TAP evens out each group), so
  // the pool totals come first, the (pool, slot) groups second. Production order is kept when it
  // is better, so VRSP is never worse than no placement.
  Grouping best = pools_first(seq_loads, n_pools, pool, slots, workers);
  Grouping prod = production_grouping(seq_loads, n_pools, pool, slots, order, micro_batch);
  if (better(prod, best)) best = std::move(prod);
  return finish(seq_loads, best.seq_group, best.group_pool, dp, pool, slots, spread_members);
}

VrspPlacement production_place(const std::vector<double>& seq_loads, i64 dp, i64 pool, i64 slots,
                               SampleOrder order, i64 micro_batch) {
  VrspPlacement out;
  const std::size_t n = seq_loads.size();
  out.replica.resize(n);
  out.slot.resize(n);
  std::vector<double> gload(static_cast<std::size_t>(dp / pool * slots), 0.0);
  std::vector<double> ptotal(static_cast<std::size_t>(dp / pool), 0.0);
  for (std::size_t s = 0; s < n; ++s) {
    const auto [r, slot] = production_slot(static_cast<i64>(s), dp, slots, order, micro_batch);
    out.replica[s] = r;
    out.slot[s] = slot;
    gload[(out.replica[s] / pool) * slots + out.slot[s]] += seq_loads[s];
    ptotal[out.replica[s] / pool] += seq_loads[s];
  }
  out.max_group = gload.empty() ? 0.0 : *std::max_element(gload.begin(), gload.end());
  out.max_pool = *std::max_element(ptotal.begin(), ptotal.end());
  return out;
}

}  // namespace libra
