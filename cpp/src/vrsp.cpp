#include "libra/vrsp.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <queue>
#include <utility>

namespace libra {
namespace {

std::vector<i64> heaviest_first(const std::vector<double>& loads) {
  std::vector<i64> order(loads.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](i64 a, i64 b) { return loads[a] > loads[b]; });
  return order;
}

void check_cardinality(std::size_t n, i64 n_groups, i64 cardinality) {
  require_positive(n_groups, "n_groups");
  require_positive(cardinality, "cardinality");
  if (static_cast<i64>(n) != n_groups * cardinality)
    fail("exact-cardinality placement needs n_groups * cardinality = " +
         std::to_string(n_groups * cardinality) + " items, got " + std::to_string(n));
}

// Local search after LPT: swap one item of the heaviest group with a lighter item of another group
// while that lowers the heavier of the two below the current maximum (cardinality unchanged).
void refine_by_swaps(const std::vector<double>& loads, std::vector<i64>& group, i64 n_groups) {
  std::vector<double> gl(static_cast<std::size_t>(n_groups), 0.0);
  std::vector<std::vector<i64>> members(static_cast<std::size_t>(n_groups));
  for (std::size_t i = 0; i < loads.size(); ++i) {
    gl[group[i]] += loads[i];
    members[group[i]].push_back(static_cast<i64>(i));
  }
  const i64 limit = 4 * static_cast<i64>(loads.size());
  for (i64 it = 0; it < limit; ++it) {
    const i64 hi = std::max_element(gl.begin(), gl.end()) - gl.begin();
    double best = gl[hi];
    i64 best_h = -1;
    std::size_t best_a = 0, best_b = 0;
    for (i64 h = 0; h < n_groups; ++h) {
      if (h == hi) continue;
      for (std::size_t a = 0; a < members[hi].size(); ++a)
        for (std::size_t b = 0; b < members[h].size(); ++b) {
          const double delta = loads[members[hi][a]] - loads[members[h][b]];
          if (!(delta > 0)) continue;
          const double pair_max = std::max(gl[hi] - delta, gl[h] + delta);
          if (pair_max < best) {
            best = pair_max;
            best_h = h;
            best_a = a;
            best_b = b;
          }
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
  }
}

}  // namespace

std::vector<i64> exact_cardinality_lpt(const std::vector<double>& loads, i64 n_groups,
                                       i64 cardinality) {
  check_cardinality(loads.size(), n_groups, cardinality);
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

double exact_cardinality_lower_bound(const std::vector<double>& loads, i64 n_groups,
                                     i64 cardinality) {
  check_cardinality(loads.size(), n_groups, cardinality);
  std::vector<double> x(loads);
  std::sort(x.begin(), x.end(), std::greater<double>());
  const std::size_t n = x.size();
  std::vector<double> prefix(n + 1, 0.0);  // prefix[k] = sum of the k heaviest
  for (std::size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + x[i];
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
  for (i64 k = 2; k <= std::min<i64>(n_groups, static_cast<i64>(n)); ++k) {
    double least = std::numeric_limits<double>::infinity();
    for (i64 q = (k + cardinality - 1) / cardinality; q <= k; ++q) {
      const i64 others = q * cardinality - k;
      least = std::min(least, (prefix[k] + prefix[n] - prefix[n - others]) / static_cast<double>(q));
    }
    bound = std::max(bound, least);
  }
  return bound;
}

namespace {

VrspPlacement finish(const std::vector<double>& seq_loads, const std::vector<i64>& seq_group,
                     const std::vector<i64>& group_pool, i64 dp, i64 pool, i64 slots) {
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
    for (i64 slot = 0; slot < slots; ++slot) {
      auto& ms = members[gs[slot]];
      std::stable_sort(ms.begin(), ms.end(),
                       [&](i64 a, i64 b) { return seq_loads[a] > seq_loads[b]; });
      for (i64 i = 0; i < pool; ++i) {
        out.replica[ms[i]] = static_cast<i64>(k) * pool + i;
        out.slot[ms[i]] = slot;
      }
    }
  }
  out.max_group = gload.empty() ? 0.0 : *std::max_element(gload.begin(), gload.end());
  out.lower_bound = exact_cardinality_lower_bound(seq_loads, n_groups, pool);
  return out;
}

}  // namespace

VrspPlacement vrsp_place(const std::vector<double>& seq_loads, i64 dp, i64 pool, i64 slots) {
  const i64 n_groups = static_cast<i64>(seq_loads.size()) / pool;
  const i64 n_pools = dp / pool;
  std::vector<i64> seq_group = exact_cardinality_lpt(seq_loads, n_groups, pool);
  // LPT is a heuristic: if Megatron's production grouping happens to have a lighter heaviest
  // group, keep it, so VRSP never does worse than production order.
  std::vector<i64> from_production(seq_loads.size());
  for (std::size_t s = 0; s < seq_loads.size(); ++s) {
    const i64 r = static_cast<i64>(s) / slots;
    from_production[s] = (r / pool) * slots + static_cast<i64>(s) % slots;
  }
  auto max_group_of = [&](const std::vector<i64>& grouping) {
    std::vector<double> gl(static_cast<std::size_t>(n_groups), 0.0);
    for (std::size_t s = 0; s < seq_loads.size(); ++s) gl[grouping[s]] += seq_loads[s];
    return *std::max_element(gl.begin(), gl.end());
  };
  if (max_group_of(from_production) < max_group_of(seq_group)) seq_group = from_production;
  std::vector<double> gload(static_cast<std::size_t>(n_groups), 0.0);
  for (std::size_t s = 0; s < seq_loads.size(); ++s) gload[seq_group[s]] += seq_loads[s];
  const std::vector<i64> group_pool = exact_cardinality_lpt(gload, n_pools, slots);
  // A rank's attention time without PP is its pool's total / P, so balance the pool totals too:
  // swap a sequence of the heaviest pool with a lighter one of the lightest pool while that lowers
  // the heavier pool's total and no group grows past the current heaviest group.
  std::vector<double> ptotal(static_cast<std::size_t>(n_pools), 0.0);
  for (i64 g = 0; g < n_groups; ++g) ptotal[group_pool[g]] += gload[g];
  const double max_group = *std::max_element(gload.begin(), gload.end());
  std::vector<std::vector<i64>> pool_seqs(static_cast<std::size_t>(n_pools));
  for (std::size_t s = 0; s < seq_loads.size(); ++s)
    pool_seqs[group_pool[seq_group[s]]].push_back(static_cast<i64>(s));
  const i64 limit = 4 * static_cast<i64>(seq_loads.size());
  for (i64 it = 0; it < limit && n_pools > 1; ++it) {
    const i64 hi = std::max_element(ptotal.begin(), ptotal.end()) - ptotal.begin();
    const i64 lo = std::min_element(ptotal.begin(), ptotal.end()) - ptotal.begin();
    double best = ptotal[hi];
    i64 best_a = -1, best_b = -1;
    for (i64 a : pool_seqs[hi])
      for (i64 b : pool_seqs[lo]) {
        const double delta = seq_loads[a] - seq_loads[b];
        if (!(delta > 0) || gload[seq_group[b]] + delta > max_group) continue;
        const double pair_max = std::max(ptotal[hi] - delta, ptotal[lo] + delta);
        if (pair_max < best) {
          best = pair_max;
          best_a = a;
          best_b = b;
        }
      }
    if (best_a < 0) break;
    const double delta = seq_loads[best_a] - seq_loads[best_b];
    const i64 ga = seq_group[best_a], gb = seq_group[best_b];
    gload[ga] -= delta;
    gload[gb] += delta;
    ptotal[hi] -= delta;
    ptotal[lo] += delta;
    seq_group[best_a] = gb;
    seq_group[best_b] = ga;
    std::replace(pool_seqs[hi].begin(), pool_seqs[hi].end(), best_a, best_b);
    std::replace(pool_seqs[lo].begin(), pool_seqs[lo].end(), best_b, best_a);
  }
  return finish(seq_loads, seq_group, group_pool, dp, pool, slots);
}

VrspPlacement production_place(const std::vector<double>& seq_loads, i64 dp, i64 pool, i64 slots) {
  VrspPlacement out;
  const std::size_t n = seq_loads.size();
  out.replica.resize(n);
  out.slot.resize(n);
  std::vector<double> gload(static_cast<std::size_t>(dp / pool * slots), 0.0);
  for (std::size_t s = 0; s < n; ++s) {
    out.replica[s] = static_cast<i64>(s) / slots;
    out.slot[s] = static_cast<i64>(s) % slots;
    gload[(out.replica[s] / pool) * slots + out.slot[s]] += seq_loads[s];
  }
  out.max_group = gload.empty() ? 0.0 : *std::max_element(gload.begin(), gload.end());
  out.lower_bound = exact_cardinality_lower_bound(seq_loads, static_cast<i64>(gload.size()), pool);
  return out;
}

}  // namespace libra
