// TAP: SH-tiles and their communication-aware placement inside a pool; DistCA's token shards.
#pragma once

#include <algorithm>
#include <functional>
#include <vector>

#include "libra/common.h"
#include "libra/plan.h"

namespace libra {

// Byte model of moving a tile (forward + backward): Q and dQ, O and dO, and K/V plus dK/dV for
// the part of the KV prefix not already resident on the destination. (The softmax LSE stays on
// the executor, whose kernel backward uses it.)
struct TileBytes {
  i64 head_dim;
  i64 dtype_bytes;
  i64 qo_bytes(i64 q_len, i64 heads) const { return 4 * q_len * heads * head_dim * dtype_bytes; }
  i64 kv_bytes(i64 kv_tokens) const { return 4 * kv_tokens * head_dim * dtype_bytes; }
};

// The work TAP balances for tile t: causal pairs x heads, or with a cost model its predicted
// time (one segment per document of the tile; see cost.h).
double tile_work(const StepPlan& p, const CostModel& m, const StepPlan::Tile& t);

// Makes the tiles of the plan's sequences and places them (sets their executors), group by group
// on `workers` threads; `groups[g]` lists the sequences of group g, member i = index;
// `seq_work[s]` is sequence s's work over the slice's heads (pairs x heads_local, or the cost
// model's time of its documents). The worker that placed group g then calls
// placed(g, tiles) with the group's tiles in their final order (still in its cache); the callee
// may take them. The plan's tile arrays are not touched.
using GroupTileList = std::vector<StepPlan::Tile>;
// placed(g, tiles, work): work[i] is tiles[i]'s tile_work as TAP balanced it.
using GroupPlaced =
    std::function<void(std::size_t, GroupTileList&, const std::vector<double>&)>;
void tap_place(const StepPlan& plan, const PlanOptions& opt,
               const std::vector<std::vector<i64>>& groups, const std::vector<double>& seq_work,
               std::size_t workers, const GroupPlaced& placed);

// DistCA: token-level shards on a global pool, greedy on work per byte, per slot.
void distca_place(StepPlan& plan, const PlanOptions& opt, const std::vector<std::vector<i64>>& groups);
// DistCA as deployed (every GPU a server) where a GPU is a replica (cp 1): DistCA's own planner's
// decisions per slot (see tap.cpp).
void distca_gpu_place(StepPlan& plan, const PlanOptions& opt,
                      const std::vector<std::vector<i64>>& groups);

// Tiles of every sequence on its owner, all heads of the slice (Ulysses; libra with tap = false).
void owner_tiles(StepPlan& plan, i64 block);

// Local KV heads [first, last] that local query heads [head_start, head_start + head_count)
// read (GQA: plan.heads_local / plan.kv_heads_local query heads per KV head).
struct KvHeads {
  i64 first, last;
};
inline KvHeads kv_heads_of(const StepPlan& plan, i64 head_start, i64 head_count) {
  if (plan.kv_heads_local == 1) return {0, 0};
  const i64 q_per_kv = plan.heads_local / plan.kv_heads_local;
  return {head_start / q_per_kv, (head_start + head_count - 1) / q_per_kv};
}

// Rows below which TAP does not cut a tile: 128, or context / 32 for short contexts.
inline i64 min_split_rows(i64 context) { return std::max<i64>(1, std::min<i64>(128, context / 32)); }

}  // namespace libra
