// VRSP: variance-reduction sequence placement by exact-cardinality LPT.
#pragma once

#include <vector>

#include "libra/common.h"
#include "libra/order.h"

namespace libra {

// Place items (loads) into n_groups groups of exactly `cardinality` items each (items.size() must
// equal n_groups * cardinality): heaviest first (ties: lower index), into the lightest group that
// still has room (ties: lower group index), then pairwise swaps between the heaviest group and
// another while they lower the maximum. Returns the group of each item. Loads must be finite and
// >= 0 (std::invalid_argument names the first that is not).
std::vector<i64> exact_cardinality_lpt(const std::vector<double>& loads, i64 n_groups,
                                       i64 cardinality);

// Lower bound on the max group load of any exact-cardinality placement: the mean; for each
// j = 1..cardinality, the j smallest of the (j-1)*G+1 heaviest items (some group holds j of them)
// plus the cardinality-j smallest items overall; and for each k <= G, the least over q of the
// average of q groups holding the k heaviest items and the q*cardinality-k lightest items. For
// pairs (cardinality 2) it is the optimum itself: the i-th heaviest with the i-th lightest.
double exact_cardinality_lower_bound(const std::vector<double>& loads, i64 n_groups,
                                     i64 cardinality);

// Lower bounds on any placement of these sequences (exact_cardinality_lower_bound, from one
// sorted copy): on the heaviest (pool, slot) group of P and on the heaviest pool total of P*m.
struct PlacementBounds {
  double group = 0, pool = 0;
};
PlacementBounds placement_bounds(const std::vector<double>& seq_loads, i64 dp, i64 pool, i64 slots);

struct VrspPlacement {
  std::vector<i64> replica;  // per sequence
  std::vector<i64> slot;     // per sequence
  double max_group = 0;      // heaviest (pool, slot) group
  double max_pool = 0;       // heaviest pool total (all slots)
};

// Sequences -> D/P pools of exactly P*m (LPT + swaps on pool totals), then inside each pool
// -> m groups of P (LPT + swaps on group totals); Megatron's production grouping instead when its
// heaviest pool (then group) is lighter. Slots inside a pool heaviest group first; inside a group
// the heaviest sequence to member 0, or with `spread_members` to the member with the least load
// over the earlier slots. The production grouping follows `order` (see production_slot).
// `workers` threads split the pools' second stage (same result).
VrspPlacement vrsp_place(const std::vector<double>& seq_loads, i64 dp, i64 pool, i64 slots,
                         SampleOrder order, i64 micro_batch, bool spread_members = false,
                         std::size_t workers = 1);

// The production order: sequence q on production_slot(q, ...).
VrspPlacement production_place(const std::vector<double>& seq_loads, i64 dp, i64 pool, i64 slots,
                               SampleOrder order, i64 micro_batch);

}  // namespace libra
