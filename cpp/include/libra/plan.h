// Layout, planner options and the StepPlan contract (DESIGN.md section 5).
#pragma once

#include <array>
#include <string>
#include <utility>
#include <vector>

#include "libra/batch.h"
#include "libra/common.h"
#include "libra/cost.h"
#include "libra/order.h"
#include "libra/workload.h"

namespace libra {

enum class System { Ulysses = 0, Libra = 1, Wlb = 2, Distca = 3 };

System parse_system(const std::string& name);
std::string system_name(System s);


// Parallel layout of one optimizer step.
struct Layout {
  i64 dp = 1;        // D: data-parallel replicas
  i64 cp = 1;        // C: context-parallel ranks per replica
  i64 tp = 1;        // T: tensor-parallel ranks
  i64 pool = 1;      // P: pool size (replicas per pool); must divide dp
  i64 context = 0;   // S: tokens per packed sequence

  void validate() const;
};

struct PlanOptions {
  System system = System::Libra;
  i64 block = 0;             // query tokens per SH-tile; 0 = context / 16 (at least 1024)
  i64 head_group = 0;        // heads per SH-tile; 0 = all heads of the rank's slice
  double epsilon = 0.02;     // TAP soft cap: (1 + epsilon) * mean
  double max_tile_share = 0.25;  // TAP: split tiles heavier than this share of the member mean
  bool vrsp = true;          // libra: VRSP placement (false: production order)
  bool tap = true;           // libra: tile moves inside the pool (false: owners execute all)
  bool refine = true;        // libra: refinement pass after the greedy
  i64 max_refine_moves = 0;  // 0 = 64 * pool size per group
  double distca_tolerance = 0.05;  // distca: stop when every replica is within tol * mean
  bool distca_gpu = false;   // distca: every GPU a server (DistCA as deployed; needs cp 1), not
                             // one per replica
  i64 dtype_bytes = 2;       // bytes per element of Q/K/V/O (bf16)
  i64 wlb_outlier_len = 0;   // wlb: documents at least this long are delayed; 0 = context / 4
  i64 wlb_max_delay = 4;     // wlb: steps an outlier may wait at most
  i64 wlb_release_count = 0; // wlb: release an outlier level when it holds this many; 0 = dp
  SampleOrder order = SampleOrder::Megatron;  // production order of the input sequences
  i64 micro_batch = 1;       // sequences per micro-batch and replica (Megatron order); divides m
  i64 threads = 0;           // worker threads for TAP's groups; 0 = automatic (see plan_workers);
                             // the plan is the same for every count
  CostModel cost;            // libra, distca and wlb's packing balance its predicted time when it has a table,
                             // causal pairs x heads otherwise (see cost.h)


  void validate() const;
};

constexpr i64 kMaxPlanThreads = 8;
// Worker threads for a step of n_docs documents: options.threads if set, else one per
// kDocsPerPlanWorker documents (a thread costs tens of microseconds to start), at most the
// cores no other runnable thread holds (idle_cores) and kMaxPlanThreads.
constexpr std::size_t kDocsPerPlanWorker = 16384;
std::size_t plan_workers(const PlanOptions& options, std::size_t n_docs);

// Largest document id and step count a planner state may hold: far below 2^63, so a run can
// keep adding documents.
constexpr i64 kMaxDocId = i64(1) << 62;

// Carried planner state across steps (WLB-LLM's delay queue and overflow). Plain data, so it can
// be checkpointed as a flat integer list.
struct PlannerState {
  struct Doc {
    i64 id;
    i64 len;
    i64 age;         // steps waited since the step that brought it
    i64 origin = -1; // index of its input sequence in that step (-1: unknown, v1 state)
  };
  i64 next_doc_id = 0;
  i64 steps = 0;
  std::vector<Doc> queue;  // delayed outliers
  std::vector<Doc> spill;  // documents that did not fit the step's token cap

  std::vector<i64> serialize() const;
  // A state from serialize(), or refused naming the entry: counts that match the length, ids
  // unique and below next_doc_id, lengths in [1, 2^30], waits >= 0, next_doc_id <= 2^62.
  static PlannerState deserialize(const std::vector<i64>& flat);
  // What the layout and options must allow of a state before it is planned with (plan_step
  // checks it, and that every held document's input sequence is below the step's count): only
  // wlb holds documents; each at most context tokens, having waited 1 to wlb_max_delay steps;
  // the documents held from one input sequence of one step at most context tokens together.
  void validate(const Layout& layout, const PlanOptions& options) const;
  i64 pending() const { return static_cast<i64>(queue.size() + spill.size()); }
};

// Phases of plan_step, timed into StepPlan::phase_ms: reading, validating and copying the input
// (WLB-LLM: also its checks), placing sequences on replicas (VRSP, production order, WLB-LLM's
// packing; meanwhile a second thread finishes the document arrays and the placement bounds),
// making and placing tiles (libra: also each group's exchange tables and loads, and the arrays'
// layout), the other systems' exchange tables, the metrics, the hash.
enum class PlanPhase { Input = 0, Placement, Tiles, Exchange, Metrics, Hash };
constexpr std::size_t kPlanPhases = 6;

// One step's plan, struct of arrays. Indices:
//   sequences s in [0, n_seq); documents in CSR (seq_doc_offsets, doc_lengths) over sequences;
//   replicas r in [0, D); slots in [0, m); groups g = pool * m + slot of the exchange pools;
//   ranks (r, c) flattened r * C + c (all tp ranks of a (r, c) pair see the same plan).
struct StepPlan {
  System system = System::Libra;
  i64 dp = 0, cp = 0, tp = 0, pool = 0, context = 0, slots = 0;
  i64 exchange_pool = 1;  // replicas per exchange pool (P for libra, D for distca, 1 otherwise)
  i64 heads_local = 0;    // heads of the coordinate space of tiles with tile_cp == -1: h/(T*C)
  i64 kv_heads_local = 0; // KV heads of that slice (>= 1)
  i64 head_dim = 0, dtype_bytes = 2;

  // Sequences executed this step (the input, except for wlb which repacks).
  PlanArray seq_doc_offsets{0};  // [n_seq + 1]
  PlanArray doc_lengths;      // [n_doc]
  PlanArray doc_ids;          // [n_doc] input order index (wlb: global id across steps)
  PlanArray seq_replica;      // [n_seq]
  PlanArray seq_slot;         // [n_seq]

  // Tiles. q_start / kv_start are token offsets inside the packed sequence. Heads are local to the
  // rank's head slice: tiles with cp == -1 are executed by every cp rank on its own Ulysses slice of
  // heads_local heads; tiles with cp >= 0 (wlb) by that cp rank over the h/T heads of its tp rank.
  // A tile covers either query rows of one document against their causal prefix (doc_count == 1,
  // kv range = [document start, last query row]) or doc_count whole consecutive documents, each
  // attending causally inside itself (kv range == query range; short documents coalesced).
  PlanArray tile_seq, tile_doc, tile_doc_count, tile_q_start, tile_q_len, tile_head_start,
      tile_head_count, tile_kv_start, tile_kv_len, tile_owner, tile_executor, tile_cp, tile_pairs;

  // Exchange per group, [G][P][P] row = sender, column = receiver, element counts per rank of the
  // pool communicator (one head slice). Forward: Q and KV flow owner -> executor, O back.
  PlanArray xchg_q, xchg_kv, xchg_o;
  // Tiles in send order: sorted by (group, owner, executor, tile index); offsets per group [G+1].
  PlanArray send_order, send_group_offsets;
  // KV prefixes shipped: one entry per (group, src, dst, seq, doc, kv head), longest prefix needed.
  PlanArray kv_group, kv_src, kv_dst, kv_seq, kv_start, kv_len, kv_head;

  // Metrics (loads in attention FLOPs, forward + backward; with a cost model, its predicted time
  // of the rank's segments, forward + backward, without the per-rank constant).
  std::vector<double> rank_load;          // [D*C]
  std::vector<double> rank_load_before;   // [D*C] production order, no moves
  std::vector<double> group_load;         // [D/P * m] per (layout pool, slot)
  std::vector<double> rank_bytes_sent;    // [D*C] pool-exchange bytes sent, fwd + bwd
  double max_over_mean = 0, max_over_mean_before = 0;
  double inter_pool_imbalance = 0, inter_pool_imbalance_before = 0;  // per (pool, slot) groups
  double pool_total_imbalance = 0, pool_total_imbalance_before = 0;  // per pool, all slots
  double vrsp_max_group = 0, vrsp_lower_bound = 0;
  double vrsp_max_pool = 0, vrsp_pool_lower_bound = 0;  // pool totals (all slots)
  // The lowest per-rank attention load reachable with tiles kept inside their layout pool:
  // max over pools of max(pool work / P, the largest piece of work TAP cannot cut), over the
  // mean rank load.
  double achievable_max_over_mean = 0;
  double moved_token_fraction = 0;
  double total_bytes = 0;
  double plan_ms = 0;  // not part of the hash
  // Wall time of each PlanPhase (ms), summing to plan_ms; not part of the hash.
  std::vector<double> phase_ms = std::vector<double>(kPlanPhases, 0.0);
  u64 hash = 0;

  struct Tile {
    i64 seq, doc, doc_count, q_start, q_len, head_start, head_count, kv_start, kv_len, owner,
        executor, cp, pairs;
  };
  // The tile arrays, each with the Tile field it holds, in Tile's field order.
  struct TileColumn {
    PlanArray StepPlan::*array;
    i64 Tile::*field;
  };
  static constexpr std::size_t kTileColumns = 13;
  static const std::array<TileColumn, kTileColumns>& tile_columns();
  Tile tile(std::size_t i) const;
  void add_tile(const Tile& t);
  // Every tile array to n entries, new entries left unset (set_tiles writes them).
  void resize_tiles(std::size_t n);
  // Tiles [first, first + tiles.size()) from `tiles`, one array after the other; each array's
  // new entries are fed to hashers[k] (the k-th array in Tile's field order) when given.
  void set_tiles(std::size_t first, const std::vector<Tile>& tiles, PlanHasher* hashers = nullptr);
  i64 n_seq() const { return static_cast<i64>(seq_doc_offsets.size()) - 1; }
  i64 n_tiles() const { return static_cast<i64>(tile_seq.size()); }
  // The plan's hash: each array's digest (arrays hashed side by side on `workers` threads), then
  // the scalars; the same for any worker count. `known` gives digests (array_digest) of arrays
  // already hashed as they were written, by the array's address.
  using KnownDigests = std::vector<std::pair<const void*, u64>>;
  u64 compute_hash(std::size_t workers = 1, const KnownDigests& known = {}) const;
  template <typename V>
  static u64 array_digest(const V& v) {
    PlanHasher h;
    h.vec(v);
    return h.digest();
  }
};

// Plan one step. `sequences` are the step's B packed sequences (document lengths). `state` carries
// WLB-LLM's queue between steps (ignored by other systems); `flush` releases everything queued.
StepPlan plan_step(const SequencesView& sequences, const Layout& layout, const ModelDims& model,
                   const PlanOptions& options, PlannerState* state, bool flush = false);
// The same from nested lists (copied into CSR form first).
StepPlan plan_step(const std::vector<std::vector<i64>>& sequences, const Layout& layout,
                   const ModelDims& model, const PlanOptions& options, PlannerState* state,
                   bool flush = false);

}  // namespace libra
