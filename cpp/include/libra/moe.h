// Expert-load balancing of one MoE layer under expert parallelism: which EP ranks hold a copy of
// each expert (replicas of hot experts, under a per-rank budget of extra expert slots) and how
// every source rank's tokens of an expert are sharded over the expert's hosts.
#pragma once

#include <vector>

#include "libra/common.h"

namespace libra {

struct MoeOptions {
  i64 ep = 1;              // expert-parallel ranks
  i64 experts = 1;         // routed experts; rank r owns experts [r * E/ep, (r + 1) * E/ep)
  i64 replica_slots = 0;   // extra expert slots per rank (N)
  i64 local_slots = -1;    // of those, how many phase 1 may use (-1: N / 4, so that at small
                           // budgets every slot serves balance)
  double expert_bytes = 0; // bytes of one expert's weights (what a replica moves)
  void validate() const;
};

struct MoePlan {
  i64 ep = 0, experts = 0;
  // hosts of expert e: hosts[host_offsets[e] .. host_offsets[e + 1]), the owner first, then its
  // replicas in the order they were placed
  std::vector<i64> host_offsets, hosts;
  // tokens of source rank s routed to expert e that host h computes: [(s * experts + e) * ep + h]
  std::vector<i64> assign;
  std::vector<i64> rank_tokens_before, rank_tokens_after;  // expert tokens computed per rank
  i64 replicas_local = 0;    // replicas placed by phase 1 (locality)
  i64 replicas_balance = 0;  // replicas placed by phase 2 (balance)
  i64 remote_tokens_before = 0, remote_tokens_after = 0;  // computed away from their source
  double max_over_mean_before = 1, max_over_mean_after = 1;
  double bytes_moved = 0;  // replicas x expert_bytes
  double plan_ms = 0;
};

// counts[s * experts + e]: tokens of source rank s routed to expert e (top-k assignments).
MoePlan moe_plan(const std::vector<i64>& counts, const MoeOptions& options);

// The tokens of `counts` sharded over given hosts (a plan's host_offsets / hosts, e.g. one made
// one layer early from predicted counts): what a layer does once its actual routing is known.
// A copy that would raise the heaviest rank is left without tokens (the result's hosts are a
// subset of the given ones), so the result is never worse than the owners alone.
MoePlan moe_shard(const std::vector<i64>& counts, const MoeOptions& options,
                  const std::vector<i64>& host_offsets, const std::vector<i64>& hosts);

}  // namespace libra
