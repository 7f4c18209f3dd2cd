#include <algorithm>
#include <array>
#include <chrono>
#include <numeric>
#include <thread>
#include <tuple>

#include "libra/plan.h"
#include "libra/parallel.h"
#include "libra/tap.h"
#include "libra/vrsp.h"
#include "libra/wlb.h"
#include "libra/workload.h"

namespace libra {
System parse_system(const std::string& name) {
  if (name == "ulysses") return System::Ulysses;
  if (name == "libra") return System::Libra;
  if (name == "wlb") return System::Wlb;
  if (name == "distca") return System::Distca;
  fail("system must be one of libra, ulysses, wlb, distca; got '" + name + "'");
}

SampleOrder parse_order(const std::string& name) {
  if (name == "megatron") return SampleOrder::Megatron;
  if (name == "contiguous") return SampleOrder::Contiguous;
  fail("order must be megatron or contiguous; got '" + name + "'");
}

std::string order_name(SampleOrder o) {
  return o == SampleOrder::Megatron ? "megatron" : "contiguous";
}

std::string system_name(System s) {
  switch (s) {
    case System::Ulysses: return "ulysses";
    case System::Libra: return "libra";
    case System::Wlb: return "wlb";
    case System::Distca: return "distca";
  }
  return "unknown";
}

void Layout::validate() const {
  require_positive(dp, "dp");
  require_positive(cp, "cp");
  require_positive(tp, "tp");
  require_positive(pool, "pool_size");
  require_positive(context, "context");
  if (context > kMaxTokens)
    fail("context = " + std::to_string(context) + " exceeds " + std::to_string(kMaxTokens));
  if (dp % pool != 0)
    fail("pool_size (P=" + std::to_string(pool) + ") must divide dp (D=" + std::to_string(dp) + ")");
}

void PlanOptions::validate() const {
  if (block < 0) fail("block must be positive (or 0 for context / 16), got " + std::to_string(block));
  if (head_group < 0) fail("head_group must be >= 0 (0 = all heads of the slice)");
  if (!(epsilon >= 0)) fail("epsilon must be >= 0");
  if (!(max_tile_share >= 0)) fail("max_tile_share must be >= 0 (0 = never split)");
  if (max_refine_moves < 0) fail("max_refine_moves must be >= 0");
  if (!(distca_tolerance >= 0)) fail("distca_tolerance must be >= 0");
  require_positive(dtype_bytes, "dtype_bytes");
  if (wlb_outlier_len < 0) fail("wlb_outlier_len must be >= 0");
  if (wlb_max_delay < 0) fail("wlb_max_delay must be >= 0");
  if (wlb_release_count < 0) fail("wlb_release_count must be >= 0");
  require_positive(micro_batch, "micro_batch_size");
  if (threads < 0 || threads > 1024)
    fail("threads must be in [0, 1024] (0 = the machine's cores), got " + std::to_string(threads));
}

std::size_t plan_workers(const PlanOptions& options, std::size_t n_docs) {
  if (options.threads > 0) return static_cast<std::size_t>(options.threads);
  const std::size_t cores = std::max(1u, std::thread::hardware_concurrency());
  return std::max<std::size_t>(
      1, std::min({cores, static_cast<std::size_t>(kMaxPlanThreads), n_docs / kDocsPerPlanWorker}));
}

std::vector<i64> PlannerState::serialize() const {
  std::vector<i64> out{2, next_doc_id, steps, static_cast<i64>(queue.size()),
                       static_cast<i64>(spill.size())};
  for (const auto* list : {&queue, &spill})
    for (const Doc& d : *list) out.insert(out.end(), {d.id, d.len, d.age, d.origin});
  return out;
}

PlannerState PlannerState::deserialize(const std::vector<i64>& flat) {
  // version 1: (id, len, age) per document; version 2 adds the origin sequence
  if (flat.size() < 5 || (flat[0] != 1 && flat[0] != 2))
    fail("planner state: unknown format (version field)");
  const i64 width = flat[0] == 1 ? 3 : 4;
  PlannerState st;
  st.next_doc_id = flat[1];
  st.steps = flat[2];
  const i64 nq = flat[3], ns = flat[4];
  if (nq < 0 || ns < 0 || static_cast<i64>(flat.size()) != 5 + width * (nq + ns))
    fail("planner state: length does not match its queue and spill counts");
  std::size_t k = 5;
  for (i64 i = 0; i < nq + ns; ++i, k += static_cast<std::size_t>(width)) {
    const Doc d{flat[k], flat[k + 1], flat[k + 2], width == 4 ? flat[k + 3] : -1};
    if (d.len <= 0 || d.id < 0 || d.age < 0 || d.origin < -1)
      fail(field_at("planner state entry", i) + " is invalid");
    (i < nq ? st.queue : st.spill).push_back(d);
  }
  return st;
}

u64 StepPlan::compute_hash(std::size_t workers) const {
  // Each array is hashed on its own (side by side on `workers` threads) and its digest enters the
  // plan's hash in a fixed order, so the hash does not depend on the worker count.
  const std::vector<i64>* ints[] = {
      &seq_doc_offsets, &doc_lengths, &doc_ids, &seq_replica, &seq_slot, &tile_seq, &tile_doc,
      &tile_doc_count, &tile_q_start, &tile_q_len, &tile_head_start, &tile_head_count,
      &tile_kv_start, &tile_kv_len, &tile_owner, &tile_executor, &tile_cp, &tile_pairs, &xchg_q,
      &xchg_kv, &xchg_o, &send_order, &send_group_offsets, &kv_group, &kv_src, &kv_dst, &kv_seq,
      &kv_start, &kv_len, &kv_head};
  const std::vector<double>* reals[] = {&rank_load, &rank_load_before, &group_load, &rank_bytes_sent};
  constexpr std::size_t n_ints = std::size(ints), n_arrays = n_ints + std::size(reals);
  std::array<u64, n_arrays> digests{};
  run_workers(workers, n_arrays, [&](WorkQueue& queue) {
    for (std::size_t a; queue.take(a);) {
      PlanHasher h;
      if (a < n_ints) {
        h.vec(*ints[a]);
      } else {
        h.vec(*reals[a - n_ints]);
      }
      digests[a] = h.digest();
    }
  });
  PlanHasher h;
  for (i64 v : {static_cast<i64>(system), dp, cp, tp, pool, context, slots, exchange_pool,
                heads_local, kv_heads_local, head_dim, dtype_bytes})
    h.value(v);
  for (const u64 d : digests) h.value(static_cast<i64>(d));
  for (double v : {max_over_mean, max_over_mean_before, inter_pool_imbalance,
                   inter_pool_imbalance_before, pool_total_imbalance, pool_total_imbalance_before,
                   vrsp_max_group, vrsp_lower_bound, vrsp_max_pool, vrsp_pool_lower_bound,
                   achievable_max_over_mean, moved_token_fraction, total_bytes})
    h.value(v);
  return h.digest();
}

void StepPlan::add_tile(const Tile& t) {
  tile_seq.push_back(t.seq);
  tile_doc.push_back(t.doc);
  tile_doc_count.push_back(t.doc_count);
  tile_q_start.push_back(t.q_start);
  tile_q_len.push_back(t.q_len);
  tile_head_start.push_back(t.head_start);
  tile_head_count.push_back(t.head_count);
  tile_kv_start.push_back(t.kv_start);
  tile_kv_len.push_back(t.kv_len);
  tile_owner.push_back(t.owner);
  tile_executor.push_back(t.executor);
  tile_cp.push_back(t.cp);
  tile_pairs.push_back(t.pairs);
}

void StepPlan::resize_tiles(std::size_t n, std::size_t workers) {
  std::vector<i64>* arrays[] = {&tile_seq,       &tile_doc,        &tile_doc_count, &tile_q_start,
                                &tile_q_len,     &tile_head_start, &tile_head_count, &tile_kv_start,
                                &tile_kv_len,    &tile_owner,      &tile_executor,  &tile_cp,
                                &tile_pairs};
  run_workers(workers, std::size(arrays), [&](WorkQueue& queue) {
    for (std::size_t a; queue.take(a);) arrays[a]->resize(n);
  });
}

namespace {

// Memory budget of one plan: about this many bytes per tile (13 tile arrays, send order,
// exchange entries), at most kMaxPlanTiles tiles (about 2 GB).
constexpr double kBytesPerTile = 128.0;
constexpr double kMaxPlanTiles = static_cast<double>(i64(1) << 24);

double max_over_mean_of(const std::vector<double>& v) {
  if (v.empty()) return 1.0;
  const double mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  return mean > 0 ? *std::max_element(v.begin(), v.end()) / mean : 1.0;
}

std::vector<double> pool_totals(const std::vector<double>& group_load, i64 slots) {
  std::vector<double> out(group_load.size() / static_cast<std::size_t>(slots), 0.0);
  for (std::size_t g = 0; g < group_load.size(); ++g) out[g / slots] += group_load[g];
  return out;
}

// Causal pairs of each sequence: one integer sum per sequence (exact below 2^63).
std::vector<i64> pairs_of(const std::vector<std::vector<i64>>& sequences) {
  std::vector<i64> out(sequences.size(), 0);
  for (std::size_t s = 0; s < sequences.size(); ++s)
    for (i64 l : sequences[s]) out[s] += causal_pairs(l);
  return out;
}

// Attention FLOPs (forward + backward) over one rank's head slice of sequences of these pairs.
std::vector<double> sequence_flops(const StepPlan& p, const std::vector<i64>& seq_pairs) {
  std::vector<double> out(seq_pairs.size());
  for (std::size_t s = 0; s < seq_pairs.size(); ++s)
    out[s] = attn_fwd_flops(static_cast<double>(seq_pairs[s]), p.heads_local, p.head_dim) *
             (1.0 + kAttnBwdFactor);
  return out;
}

// The input's documents into the plan's CSR arrays, validating them in the same pass; returns
// the causal pairs of each sequence. Any invalid entry is reported as validate_sequences words it.
std::vector<i64> copy_sequences(StepPlan& p, const std::vector<std::vector<i64>>& sequences,
                                i64 context, i64& total_tokens) {
  std::size_t n_docs = 0;
  for (const auto& seq : sequences) n_docs += seq.size();
  p.doc_lengths.resize(n_docs);
  p.seq_doc_offsets.assign(1, 0);
  p.seq_doc_offsets.reserve(sequences.size() + 1);
  std::vector<i64> seq_pairs(sequences.size());
  i64* out = p.doc_lengths.data();
  bool bad = false;
  for (std::size_t s = 0; s < sequences.size(); ++s) {
    i64 tokens = 0, pairs = 0;
    for (const i64 l : sequences[s]) {
      bad |= l <= 0 || l > context;
      tokens += l;
      pairs += causal_pairs(l);
      *out++ = l;
    }
    bad |= tokens > context;
    if (bad) validate_sequences(sequences, context);  // throws, naming the entry
    seq_pairs[s] = pairs;
    total_tokens += tokens;
    p.seq_doc_offsets.push_back(out - p.doc_lengths.data());
  }
  p.doc_ids.resize(n_docs);
  std::iota(p.doc_ids.begin(), p.doc_ids.end(), i64{0});
  return seq_pairs;
}

std::vector<std::vector<i64>> groups_of(const StepPlan& p, i64 pool) {
  const i64 G = p.dp / pool * p.slots;
  std::vector<std::vector<i64>> groups(static_cast<std::size_t>(G),
                                       std::vector<i64>(static_cast<std::size_t>(pool), -1));
  for (i64 s = 0; s < p.n_seq(); ++s) {
    const i64 r = p.seq_replica[s];
    groups[(r / pool) * p.slots + p.seq_slot[s]][r % pool] = s;
  }
  return groups;
}

// One exchange group's share of the exchange tables (see build_exchange).
struct GroupExchange {
  struct KvNeed {
    i64 key, len, seq, start;
  };
  std::vector<KvNeed> kv;       // KV prefixes to ship, by cell, then key; one per key
  std::vector<i64> kv_cell;     // cell of each (local to the group: src * Px + dst)
  std::vector<i64> send;        // the group's tiles by (owner, executor member, tile index)
  i64 moved_tokens = 0, all_tokens = 0;  // query rows x heads moved / all
};

// What one worker reuses from group to group.
struct ExchangeScratch {
  std::vector<i64> tile_count, kv_count;  // per cell, then running offsets
  std::vector<GroupExchange::KvNeed> need;
};

// The exchange of group g, whose tiles are `tiles` (ascending): writes the group's own cells of
// xchg_q / xchg_o / xchg_kv (no other group touches them) and fills `out`.
void group_exchange(StepPlan& p, i64 g, const i64* tiles, std::size_t n, ExchangeScratch& scratch,
                    GroupExchange& out) {
  const i64 Px = p.exchange_pool, kvh = p.kv_heads_local, d = p.head_dim;
  const std::size_t cells = static_cast<std::size_t>(Px * Px);
  const i64 base = g * Px * Px;
  const i64 first_replica = (g / p.slots) * Px;
  auto& tile_count = scratch.tile_count;
  auto& kv_count = scratch.kv_count;
  tile_count.assign(cells + 1, 0);
  kv_count.assign(cells + 1, 0);
  out.moved_tokens = out.all_tokens = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const i64 t = tiles[i];
    const i64 qh = p.tile_q_len[t] * p.tile_head_count[t];
    const i64 src = p.tile_owner[t] - first_replica, dst = p.tile_executor[t] - first_replica;
    out.all_tokens += qh;
    ++tile_count[src * Px + dst + 1];
    if (src == dst) continue;
    if (dst < 0 || dst >= Px)
      fail("internal: tile " + std::to_string(t) + " leaves its exchange pool");
    out.moved_tokens += qh;
    p.xchg_q[base + src * Px + dst] += qh * d;
    p.xchg_o[base + dst * Px + src] += qh * d;
    const auto [kv0, kv1] = kv_heads_of(p, p.tile_head_start[t], p.tile_head_count[t]);
    kv_count[src * Px + dst + 1] += kv1 - kv0 + 1;
  }
  for (std::size_t c = 0; c < cells; ++c) {
    tile_count[c + 1] += tile_count[c];
    kv_count[c + 1] += kv_count[c];
  }
  // KV needs by cell (counting sort), then inside each cell by key, the longest prefix of each
  // key kept.
  auto& need = scratch.need;
  need.resize(static_cast<std::size_t>(kv_count[cells]));
  for (std::size_t i = 0; i < n; ++i) {
    const i64 t = tiles[i];
    const i64 src = p.tile_owner[t] - first_replica, dst = p.tile_executor[t] - first_replica;
    if (src == dst) continue;
    const auto [kv0, kv1] = kv_heads_of(p, p.tile_head_start[t], p.tile_head_count[t]);
    for (i64 kh = kv0; kh <= kv1; ++kh)
      need[kv_count[src * Px + dst]++] = {(p.tile_doc[t] * kvh + kh) * Px + dst, p.tile_kv_len[t],
                                           p.tile_seq[t], p.tile_kv_start[t]};
  }
  out.kv.clear();
  out.kv_cell.clear();
  for (std::size_t c = 0, begin = 0; c < cells; ++c) {  // kv_count[c] is now cell c's end
    const auto first = need.begin() + static_cast<std::ptrdiff_t>(begin);
    const auto last = need.begin() + kv_count[c];
    std::sort(first, last, [](const GroupExchange::KvNeed& x, const GroupExchange::KvNeed& y) {
      return x.key != y.key ? x.key < y.key : x.len < y.len;
    });
    for (auto it = first; it != last; ++it) {
      if (it + 1 != last && (it + 1)->key == it->key) continue;
      p.xchg_kv[base + static_cast<i64>(c)] += 2 * it->len * d;
      out.kv.push_back(*it);
      out.kv_cell.push_back(static_cast<i64>(c));
    }
    begin = static_cast<std::size_t>(kv_count[c]);
  }
  // Send order: by cell (counting sort), tile index inside.
  out.send.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const i64 t = tiles[i];
    const i64 cell = (p.tile_owner[t] - first_replica) * Px + (p.tile_executor[t] - first_replica);
    out.send[tile_count[cell]++] = t;
  }
}

// Exchange tables of the plan's tiles, group by group on `workers` threads (groups are
// independent; the tables do not depend on the worker count). Tiles of a group are usually
// contiguous (TAP emits them so); otherwise they are bucketed by group first.
void build_exchange(StepPlan& p, std::size_t workers) {
  const i64 Px = p.exchange_pool;
  const i64 G = p.dp / Px * p.slots;
  const std::size_t cells = static_cast<std::size_t>(G * Px * Px);
  p.xchg_q.assign(cells, 0);
  p.xchg_kv.assign(cells, 0);
  p.xchg_o.assign(cells, 0);
  const i64 n_tiles = p.n_tiles();
  // tiles of each group: by_group[first[g] .. first[g + 1])
  std::vector<i64> first(static_cast<std::size_t>(G + 1), 0), by_group(static_cast<std::size_t>(n_tiles));
  {
    std::vector<i64> group(static_cast<std::size_t>(n_tiles));
    std::vector<i64> slot0(static_cast<std::size_t>(p.dp));  // first group of each replica's pool
    for (i64 r = 0; r < p.dp; ++r) slot0[r] = (r / Px) * p.slots;  // (no division per tile)
    bool sorted = true;
    for (i64 t = 0; t < n_tiles; ++t) {
      group[t] = slot0[p.tile_owner[t]] + p.seq_slot[p.tile_seq[t]];
      ++first[group[t] + 1];
    }
    for (i64 t = 1; t < n_tiles && sorted; ++t) sorted = group[t] >= group[t - 1];
    for (i64 g = 0; g < G; ++g) first[g + 1] += first[g];
    if (sorted) {
      std::iota(by_group.begin(), by_group.end(), i64{0});
    } else {
      std::vector<i64> fill(first.begin(), first.end() - 1);
      for (i64 t = 0; t < n_tiles; ++t) by_group[fill[group[t]]++] = t;
    }
  }
  std::vector<GroupExchange> parts(static_cast<std::size_t>(G));
  run_workers(workers, static_cast<std::size_t>(G), [&](WorkQueue& queue) {
    ExchangeScratch scratch;
    for (std::size_t g; queue.take(g);)
      group_exchange(p, static_cast<i64>(g), by_group.data() + first[g],
                     static_cast<std::size_t>(first[g + 1] - first[g]), scratch, parts[g]);
  });
  // The groups' entries, in group order.
  std::vector<std::size_t> kv_first(static_cast<std::size_t>(G + 1), 0);
  i64 moved_tokens = 0, all_tokens = 0;
  for (i64 g = 0; g < G; ++g) {
    kv_first[g + 1] = kv_first[g] + parts[g].kv.size();
    moved_tokens += parts[g].moved_tokens;
    all_tokens += parts[g].all_tokens;
  }
  for (auto* v : {&p.kv_group, &p.kv_src, &p.kv_dst, &p.kv_seq, &p.kv_start, &p.kv_len, &p.kv_head})
    v->resize(kv_first[G]);
  p.send_group_offsets.assign(first.begin(), first.end());
  p.send_order.resize(static_cast<std::size_t>(n_tiles));
  run_workers(workers, static_cast<std::size_t>(G), [&](WorkQueue& queue) {
    for (std::size_t g; queue.take(g);) {
      std::size_t i = kv_first[g];
      const GroupExchange& part = parts[g];
      for (std::size_t k = 0; k < part.kv.size(); ++k, ++i) {
        const auto& e = part.kv[k];
        p.kv_group[i] = static_cast<i64>(g);
        p.kv_src[i] = part.kv_cell[k] / Px;
        p.kv_dst[i] = part.kv_cell[k] % Px;
        p.kv_seq[i] = e.seq;
        p.kv_start[i] = e.start;
        p.kv_head[i] = (e.key / Px) % p.kv_heads_local;
        p.kv_len[i] = e.len;
      }
      std::copy(parts[g].send.begin(), parts[g].send.end(), p.send_order.begin() + first[g]);
    }
  });
  p.moved_token_fraction =
      all_tokens > 0 ? static_cast<double>(moved_tokens) / static_cast<double>(all_tokens) : 0.0;

  // Bytes each rank sends, forward + backward: as owner Q, KV (fwd) and dO (bwd); as executor
  // O (fwd) and dQ, dKV (bwd). Identical for every cp rank of a replica (own head slice). The
  // softmax LSE stays on the executor (its kernel backward uses it), so it is not sent.
  p.rank_bytes_sent.assign(static_cast<std::size_t>(p.dp * p.cp), 0.0);
  const double eb = static_cast<double>(p.dtype_bytes);
  for (i64 g = 0; g < G; ++g)
    for (i64 a = 0; a < Px; ++a) {
      double sent = 0;
      for (i64 b = 0; b < Px; ++b) {
        const i64 ab = (g * Px + a) * Px + b, ba = (g * Px + b) * Px + a;
        sent += eb * static_cast<double>(p.xchg_q[ab] + p.xchg_kv[ab] + p.xchg_o[ab] +
                                         p.xchg_o[ba] + p.xchg_q[ba] + p.xchg_kv[ba]);
      }
      const i64 r = (g / p.slots) * Px + a;
      for (i64 c = 0; c < p.cp; ++c) p.rank_bytes_sent[r * p.cp + c] += sent;
    }
  p.total_bytes = std::accumulate(p.rank_bytes_sent.begin(), p.rank_bytes_sent.end(), 0.0);
}

void compute_metrics(StepPlan& p, const std::vector<i64>& input_pairs, SampleOrder order,
                     i64 micro_batch) {
  const i64 C = p.cp, m = p.slots, P = p.pool;
  p.rank_load.assign(static_cast<std::size_t>(p.dp * C), 0.0);
  p.group_load.assign(static_cast<std::size_t>(p.dp / P * m), 0.0);
  const double bwd = 1.0 + kAttnBwdFactor;
  // A tile with cp == -1 loads every cp rank of its executor alike: summed once per executor
  // (the same additions in the same order as per rank), spread over its C ranks after.
  std::vector<double> exec_load(static_cast<std::size_t>(p.dp), 0.0);
  std::vector<i64> group_base(static_cast<std::size_t>(p.dp));
  for (i64 r = 0; r < p.dp; ++r) group_base[r] = (r / P) * m;
  for (i64 t = 0; t < p.n_tiles(); ++t) {
    const double f =
        attn_fwd_flops(static_cast<double>(p.tile_pairs[t]), p.tile_head_count[t], p.head_dim) * bwd;
    const i64 e = p.tile_executor[t];
    const i64 g = group_base[e] + p.seq_slot[p.tile_seq[t]];
    if (p.tile_cp[t] < 0) {
      exec_load[e] += f;
      p.group_load[g] += f * static_cast<double>(C);
    } else {
      p.rank_load[e * C + p.tile_cp[t]] += f;
      p.group_load[g] += f;
    }
  }
  for (i64 e = 0; e < p.dp; ++e)
    if (exec_load[e] != 0.0)
      for (i64 c = 0; c < C; ++c) p.rank_load[e * C + c] += exec_load[e];
  // Before: the input in Megatron's production order under Ulysses (no balancing, no moves).
  p.rank_load_before.assign(static_cast<std::size_t>(p.dp * C), 0.0);
  std::vector<double> group_before(p.group_load.size(), 0.0);
  for (std::size_t s = 0; s < input_pairs.size(); ++s) {
    const double f = attn_fwd_flops(static_cast<double>(input_pairs[s]), p.heads_local, p.head_dim) * bwd;
    const auto [r, slot] = production_slot(static_cast<i64>(s), p.dp, m, order, micro_batch);
    for (i64 c = 0; c < C; ++c) p.rank_load_before[r * C + c] += f;
    group_before[(r / P) * m + slot] += f * static_cast<double>(C);
  }
  p.max_over_mean = max_over_mean_of(p.rank_load);
  p.max_over_mean_before = max_over_mean_of(p.rank_load_before);
  p.inter_pool_imbalance = max_over_mean_of(p.group_load) - 1.0;
  p.inter_pool_imbalance_before = max_over_mean_of(group_before) - 1.0;
  p.pool_total_imbalance = max_over_mean_of(pool_totals(p.group_load, m)) - 1.0;
  p.pool_total_imbalance_before = max_over_mean_of(pool_totals(group_before, m)) - 1.0;
  // Lowest achievable per-rank load with tiles inside layout pools: pool work / P (per cp rank),
  // or the largest piece TAP cannot cut (the last min-split rows of the longest document, one
  // head), whichever is larger.
  i64 longest = 0;
  for (i64 l : p.doc_lengths) longest = std::max(longest, l);
  const i64 rows = std::min(longest, min_split_rows(p.context));
  const double unit = attn_fwd_flops(static_cast<double>(block_pairs(longest - rows, longest)), 1,
                                     p.head_dim) * bwd;
  const double mean_rank =
      std::accumulate(p.rank_load.begin(), p.rank_load.end(), 0.0) / static_cast<double>(p.rank_load.size());
  double worst = 0;
  for (const double total : pool_totals(p.group_load, m))
    worst = std::max(worst, std::max(total / static_cast<double>(P * C), unit));
  p.achievable_max_over_mean = mean_rank > 0 ? worst / mean_rank : 1.0;
}

void check_heads(const ModelDims& model, const Layout& layout, System system) {
  const i64 ct = layout.cp * layout.tp;
  if (model.heads % ct != 0)
    fail("model.heads (h=" + std::to_string(model.heads) + ") must be divisible by cp*tp (" +
         std::to_string(ct) + ")");
  const i64 g = model.heads / model.kv_heads;
  const i64 slice = system == System::Wlb ? model.heads / layout.tp : model.heads / ct;
  if (slice % g != 0 && g % slice != 0)
    fail("model.kv_heads (" + std::to_string(model.kv_heads) + "): the " + std::to_string(slice) +
         " query heads of a rank's slice must hold whole KV-head groups of " + std::to_string(g) +
         " or lie inside one");
}

}  // namespace

StepPlan plan_step(const std::vector<std::vector<i64>>& sequences, const Layout& layout,
                   const ModelDims& model, const PlanOptions& options, PlannerState* state,
                   bool flush) {
  const auto t0 = std::chrono::steady_clock::now();
  auto lap = t0;  // end of the previous phase
  auto phase_done = [&](StepPlan& p, PlanPhase phase) {
    const auto now = std::chrono::steady_clock::now();
    p.phase_ms[static_cast<std::size_t>(phase)] =
        std::chrono::duration<double, std::milli>(now - lap).count();
    lap = now;
  };
  layout.validate();
  model.validate();
  options.validate();
  check_heads(model, layout, options.system);
  const i64 B = static_cast<i64>(sequences.size());
  if (B == 0) fail("sequences is empty: a step needs at least dp packed sequences");
  if (B % layout.dp != 0)
    fail("gbs (B=" + std::to_string(B) + ") must be divisible by dp (D=" +
         std::to_string(layout.dp) + ")");
  if ((B / layout.dp) % options.micro_batch != 0)
    fail("micro_batch_size (" + std::to_string(options.micro_batch) +
         ") must divide the sequences per replica (m = gbs / dp = " + std::to_string(B / layout.dp) +
         ")");
  if (options.system == System::Wlb && state == nullptr)
    fail("state: the wlb system carries a delay queue and needs a PlannerState");

  StepPlan p;
  p.system = options.system;
  p.dp = layout.dp; p.cp = layout.cp; p.tp = layout.tp; p.pool = layout.pool;
  p.context = layout.context; p.slots = B / layout.dp;
  p.heads_local = model.heads / (layout.cp * layout.tp);
  const i64 g = model.heads / model.kv_heads;
  p.kv_heads_local = std::max<i64>(1, p.heads_local / g);
  p.head_dim = model.head_dim;
  p.dtype_bytes = options.dtype_bytes;

  PlanOptions opt = options;
  if (opt.block == 0) opt.block = std::max<i64>(1024, layout.context / 16);
  const i64 hg = opt.head_group > 0 ? std::min(opt.head_group, p.heads_local) : p.heads_local;
  // Refuse plans whose tiles would not fit the memory budget rather than failing mid-way.
  auto check_budget = [&](double est) {
    if (est > kMaxPlanTiles)
      fail("this step would make about " + std::to_string(static_cast<i64>(est)) + " tiles (" +
           std::to_string(static_cast<i64>(est * kBytesPerTile / 1e9)) +
           " GB of plan), more than the budget of " + std::to_string(static_cast<i64>(kMaxPlanTiles)) +
           (options.system == System::Wlb
                ? " tiles: per-document CP makes 2C tiles per document; plan fewer documents or a smaller cp"
                : " tiles; raise block (" + std::to_string(opt.block) + ") or head_group (" +
                      std::to_string(hg) + ")"));
  };
  std::vector<i64> input_pairs;  // causal pairs of each input sequence
  VrspPlacement placement;
  if (options.system == System::Wlb) {
    validate_sequences(sequences, layout.context);
    // per-document CP: up to 2C chunks of every document (queued ones included)
    double docs = state != nullptr ? static_cast<double>(state->pending()) * 2.0 * layout.cp : 0.0;
    for (const auto& seq : sequences)
      for (i64 l : seq) docs += static_cast<double>(std::min<i64>(l, 2 * layout.cp));
    check_budget(docs);
    input_pairs = pairs_of(sequences);
    phase_done(p, PlanPhase::Input);
    wlb_pack(p, sequences, opt, *state, flush);
    std::vector<i64> executed(static_cast<std::size_t>(p.n_seq()), 0);
    for (i64 s = 0; s < p.n_seq(); ++s)
      for (i64 d = p.seq_doc_offsets[s]; d < p.seq_doc_offsets[s + 1]; ++d)
        executed[s] += causal_pairs(p.doc_lengths[d]);
    placement = production_place(sequence_flops(p, executed), p.dp, p.pool, p.slots,
                                 SampleOrder::Megatron, 1);  // wlb_pack's round robin
    phase_done(p, PlanPhase::Placement);
    wlb_tiles(p);
  } else {
    i64 tokens = 0;
    input_pairs = copy_sequences(p, sequences, layout.context, tokens);
    // per sequence: a document of l >= block tokens makes at most l / block + 1 query blocks
    // and ends a run; two consecutive runs of shorter documents hold more than a block; so at
    // most 5 * tokens / block + 1 tiles per head group
    check_budget((5.0 * static_cast<double>(tokens) / static_cast<double>(opt.block) +
                  static_cast<double>(B)) *
                 static_cast<double>((p.heads_local + hg - 1) / hg));
    phase_done(p, PlanPhase::Input);
    const std::vector<double> loads = sequence_flops(p, input_pairs);
    const bool vrsp = options.system == System::Libra && options.vrsp;
    const bool spread = options.system == System::Libra && !options.tap;
    placement = vrsp ? vrsp_place(loads, p.dp, p.pool, p.slots, options.order,
                                  options.micro_batch, spread,
                                  plan_workers(options, p.doc_lengths.size()))
                     : production_place(loads, p.dp, p.pool, p.slots, options.order,
                                        options.micro_batch);
    phase_done(p, PlanPhase::Placement);
    p.seq_replica = placement.replica;
    p.seq_slot = placement.slot;
    if (options.system == System::Libra && options.tap) {
      p.exchange_pool = p.pool;
      tap_place(p, opt, groups_of(p, p.pool), input_pairs);
    } else if (options.system == System::Distca) {
      p.exchange_pool = p.dp;
      distca_place(p, opt, groups_of(p, p.dp));
    } else {
      owner_tiles(p, opt.block);
    }
  }
  phase_done(p, PlanPhase::Tiles);
  p.vrsp_max_group = placement.max_group;
  p.vrsp_lower_bound = placement.lower_bound;
  p.vrsp_max_pool = placement.max_pool;
  p.vrsp_pool_lower_bound = placement.pool_lower_bound;
  build_exchange(p, plan_workers(options, p.doc_lengths.size()));
  phase_done(p, PlanPhase::Exchange);
  compute_metrics(p, input_pairs, options.order, options.micro_batch);
  phase_done(p, PlanPhase::Metrics);
  p.hash = p.compute_hash(plan_workers(options, p.doc_lengths.size()));
  phase_done(p, PlanPhase::Hash);
  p.plan_ms = std::chrono::duration<double, std::milli>(lap - t0).count();
  return p;
}

}  // namespace libra
