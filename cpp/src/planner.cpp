#include <algorithm>
#include <array>
#include <atomic>
#if defined(__x86_64__) && defined(__SSE2__)
#include <immintrin.h>
#endif
#include <chrono>
#include <mutex>
#include <numeric>
#include <optional>
#include <sstream>
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
  require_at_most(dp, kMaxReplicas, "dp", "2^24");
  require_at_most(cp, kMaxSplit, "cp", "2^16");
  require_at_most(tp, kMaxSplit, "tp", "2^16");
  if (context > kMaxTokens)
    fail("context = " + std::to_string(context) + " exceeds " + std::to_string(kMaxTokens));
  if (dp % pool != 0)
    fail("pool_size (P=" + std::to_string(pool) + ") must divide dp (D=" + std::to_string(dp) + ")");
}

namespace {
std::string number(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}
}  // namespace

void PlanOptions::validate() const {
  if (block < 0) fail("block must be positive (or 0 for context / 16), got " + std::to_string(block));
  require_at_most(block, kMaxTokens, "block", "2^30");
  if (head_group < 0)
    fail("head_group must be >= 0 (0 = all heads of the slice), got " + std::to_string(head_group));
  if (!(epsilon >= 0)) fail("epsilon must be >= 0, got " + number(epsilon));
  if (!(max_tile_share >= 0))
    fail("max_tile_share must be >= 0 (0 = never split), got " + number(max_tile_share));
  if (max_refine_moves < 0)
    fail("max_refine_moves must be >= 0, got " + std::to_string(max_refine_moves));
  if (!(distca_tolerance >= 0)) fail("distca_tolerance must be >= 0, got " + number(distca_tolerance));
  require_positive(dtype_bytes, "dtype_bytes");
  require_at_most(dtype_bytes, 64, "dtype_bytes", "64");
  if (wlb_outlier_len < 0) fail("wlb_outlier_len must be >= 0, got " + std::to_string(wlb_outlier_len));
  if (wlb_max_delay < 0) fail("wlb_max_delay must be >= 0, got " + std::to_string(wlb_max_delay));
  require_at_most(wlb_max_delay, kMaxTokens, "wlb_max_delay", "2^30");
  if (wlb_release_count < 0)
    fail("wlb_release_count must be >= 0, got " + std::to_string(wlb_release_count));
  require_positive(micro_batch, "micro_batch_size");
  if (threads < 0 || threads > 1024)
    fail("threads must be in [0, 1024] (0 = the machine's cores), got " + std::to_string(threads));
  cost.validate();
}

std::size_t plan_workers(const PlanOptions& options, std::size_t n_docs) {
  if (options.threads > 0) return static_cast<std::size_t>(options.threads);
  return auto_workers(n_docs, kDocsPerPlanWorker, kMaxPlanThreads);
}

std::vector<i64> PlannerState::serialize() const {
  std::vector<i64> out{2, next_doc_id, steps, static_cast<i64>(queue.size()),
                       static_cast<i64>(spill.size())};
  for (const auto* list : {&queue, &spill})
    for (const Doc& d : *list) out.insert(out.end(), {d.id, d.len, d.age, d.origin});
  return out;
}

PlannerState PlannerState::deserialize(const std::vector<i64>& flat) {
  // version 1: (id, len, age) per document; version 2 adds the origin sequence. A state comes
  // from a checkpoint on disk: every count is checked against the length before it is used,
  // without overflow, and every entry before it is taken.
  if (flat.size() < 5)
    fail("planner state holds " + std::to_string(flat.size()) +
         " entries; a state starts with 5 (version, next_doc_id, steps, queued, spilled)");
  if (flat[0] != 1 && flat[0] != 2)
    fail("planner state[0] (version) must be 1 or 2 (unknown format), got " + std::to_string(flat[0]));
  const std::size_t width = flat[0] == 1 ? 3 : 4;
  const i64 nq = flat[3], ns = flat[4];
  const std::size_t rest = flat.size() - 5, room = rest / width;
  if (nq < 0 || ns < 0 || static_cast<u64>(nq) > room || static_cast<u64>(ns) > room - static_cast<u64>(nq) ||
      (static_cast<std::size_t>(nq) + static_cast<std::size_t>(ns)) * width != rest)
    fail("planner state: length does not match its queue and spill counts: " +
         std::to_string(flat.size()) + " entries for (" + std::to_string(nq) + ", " +
         std::to_string(ns) + "), where a version-" + std::to_string(flat[0]) + " state holds 5 + " +
         std::to_string(width) + " x (queued + spilled)");
  PlannerState st;
  st.next_doc_id = flat[1];
  st.steps = flat[2];
  if (st.next_doc_id < 0 || st.next_doc_id > kMaxDocId)
    fail("planner state[1] (next_doc_id) must be in [0, 2^62], got " + std::to_string(st.next_doc_id));
  if (st.steps < 0 || st.steps > kMaxDocId)
    fail("planner state[2] (steps) must be in [0, 2^62], got " + std::to_string(st.steps));
  st.queue.reserve(static_cast<std::size_t>(nq));
  st.spill.reserve(static_cast<std::size_t>(ns));
  std::vector<i64> ids;
  ids.reserve(static_cast<std::size_t>(nq + ns));
  std::size_t k = 5;
  for (i64 i = 0; i < nq + ns; ++i, k += width) {
    const Doc d{flat[k], flat[k + 1], flat[k + 2], width == 4 ? flat[k + 3] : -1};
    const std::string entry = field_at("planner state entry", i) + " (" +
                              field_at(i < nq ? "queue" : "spill", i < nq ? i : i - nq) + ")";
    if (d.id < 0 || d.id >= st.next_doc_id)
      fail(entry + ": id " + std::to_string(d.id) + " must be in [0, next_doc_id = " +
           std::to_string(st.next_doc_id) + ")");
    if (d.len <= 0 || d.len > kMaxTokens)
      fail(entry + ": length " + std::to_string(d.len) + " must be in [1, 2^30]");
    if (d.age < 0 || d.age > kMaxDocId)
      fail(entry + ": steps waited " + std::to_string(d.age) + " must be >= 0");
    if (d.origin < -1)
      fail(entry + ": input sequence " + std::to_string(d.origin) + " must be >= 0 (-1: unknown)");
    (i < nq ? st.queue : st.spill).push_back(d);
    ids.push_back(d.id);
  }
  std::sort(ids.begin(), ids.end());
  const auto dup = std::adjacent_find(ids.begin(), ids.end());
  if (dup != ids.end())
    fail("planner state: document id " + std::to_string(*dup) + " is held twice");
  return st;
}

void PlannerState::validate(const Layout& layout, const PlanOptions& options) const {
  if (options.system != System::Wlb) {
    if (pending() > 0)
      fail("planner state holds " + std::to_string(pending()) + " documents, but only wlb carries "
           "any (system is " + system_name(options.system) + ")");
    return;
  }
  // Held documents have waited 1 to wlb_max_delay steps (0 too in a version-1 state, which
  // does not know their input sequences). Those of one (arrival step, input sequence) are a
  // part of that sequence: at most context tokens together, which is what lets due documents
  // always fit as their input held them.
  std::vector<std::tuple<i64, i64, i64>> groups;  // (age, origin, length)
  i64 i = 0;
  for (const auto* list : {&queue, &spill})
    for (const Doc& d : *list) {
      const std::string entry = field_at("planner state entry", i++);
      if (d.len > layout.context)
        fail(entry + ": length " + std::to_string(d.len) + " exceeds context " +
             std::to_string(layout.context) + " (a document longer than a sequence never trains)");
      if (d.age < (d.origin >= 0 ? 1 : 0) || d.age > options.wlb_max_delay)
        fail(entry + ": waited " + std::to_string(d.age) + " steps; a held document has waited "
             "at least 1 and at most wlb_max_delay = " + std::to_string(options.wlb_max_delay));
      if (d.origin >= 0) groups.emplace_back(d.age, d.origin, d.len);
    }
  std::sort(groups.begin(), groups.end());
  for (std::size_t a = 0; a < groups.size();) {
    std::size_t b = a;
    i64 tokens = 0;
    for (; b < groups.size() && std::get<0>(groups[b]) == std::get<0>(groups[a]) &&
           std::get<1>(groups[b]) == std::get<1>(groups[a]);
         ++b)
      tokens += std::get<2>(groups[b]);  // each <= context <= 2^30, at most 2^62 entries
    if (tokens > layout.context)
      fail("planner state: the documents held from input sequence " +
           std::to_string(std::get<1>(groups[a])) + " of " + std::to_string(std::get<0>(groups[a])) +
           " steps ago hold " + std::to_string(tokens) + " tokens, more than context " +
           std::to_string(layout.context));
    a = b;
  }
}

u64 StepPlan::compute_hash(std::size_t workers, const KnownDigests& known) const {
  // Each array is hashed on its own (side by side on `workers` threads) and its digest enters the
  // plan's hash in a fixed order, so the hash does not depend on the worker count.
  const PlanArray* ints[] = {
      &seq_doc_offsets, &doc_lengths, &doc_ids, &seq_replica, &seq_slot, &tile_seq, &tile_doc,
      &tile_doc_count, &tile_q_start, &tile_q_len, &tile_head_start, &tile_head_count,
      &tile_kv_start, &tile_kv_len, &tile_owner, &tile_executor, &tile_cp, &tile_pairs, &xchg_q,
      &xchg_kv, &xchg_o, &send_order, &send_group_offsets, &kv_group, &kv_src, &kv_dst, &kv_seq,
      &kv_start, &kv_len, &kv_head};
  const std::vector<double>* reals[] = {&rank_load, &rank_load_before, &group_load, &rank_bytes_sent};
  constexpr std::size_t n_ints = std::size(ints), n_arrays = n_ints + std::size(reals);
  std::array<u64, n_arrays> digests{};
  std::vector<std::size_t> todo;
  for (std::size_t a = 0; a < n_arrays; ++a) {
    const void* address = a < n_ints ? static_cast<const void*>(ints[a])
                                     : static_cast<const void*>(reals[a - n_ints]);
    const auto it = std::find_if(known.begin(), known.end(),
                                 [&](const auto& k) { return k.first == address; });
    if (it != known.end()) {
      digests[a] = it->second;
    } else {
      todo.push_back(a);
    }
  }
  run_workers(workers, todo.size(), [&](WorkQueue& queue) {
    for (std::size_t i; queue.take(i);) {
      const std::size_t a = todo[i];
      digests[a] = a < n_ints ? array_digest(*ints[a]) : array_digest(*reals[a - n_ints]);
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

namespace {

// Writes n values to out. The plan's arrays are written once here and read much later (by the
// runtime, from Python), so on x86-64 the stores bypass the cache (no read of the lines before
// they are overwritten); store_fence() then orders them before what the thread does next.
inline void write_once(i64* out, const i64* values, std::size_t n) {
#if defined(__x86_64__) && defined(__SSE2__)
  for (std::size_t i = 0; i < n; ++i)
    _mm_stream_si64(reinterpret_cast<long long*>(out + i), static_cast<long long>(values[i]));
#else
  std::copy(values, values + n, out);
#endif
}

inline void store_fence() {
#if defined(__x86_64__) && defined(__SSE2__)
  _mm_sfence();
#endif
}

// Writes value(0), ..., value(n - 1) to out with write_once, in chunks, feeding each chunk to
// `hasher` (when given) on the way; the caller fences.
template <typename Value>
void write_hashed(i64* out, std::size_t n, PlanHasher* hasher, Value&& value) {
  constexpr std::size_t kChunk = 64;
  i64 chunk[kChunk];
  for (std::size_t i0 = 0; i0 < n; i0 += kChunk) {
    const std::size_t m = std::min(kChunk, n - i0);
    for (std::size_t j = 0; j < m; ++j) chunk[j] = value(i0 + j);
    write_once(out + i0, chunk, m);
    if (hasher != nullptr) hasher->words(chunk, m);
  }
}

}  // namespace

void StepPlan::set_tiles(std::size_t first, const std::vector<Tile>& tiles, PlanHasher* hashers) {
  for (std::size_t k = 0; k < kTileColumns; ++k) {
    const TileColumn& c = tile_columns()[k];
    write_hashed((this->*c.array).data() + first, tiles.size(),
                 hashers != nullptr ? &hashers[k] : nullptr,
                 [&](std::size_t i) { return tiles[i].*c.field; });
  }
  store_fence();
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
std::vector<i64> pairs_of(const SequencesView& sequences) {
  std::vector<i64> out(sequences.size(), 0);
  for (std::size_t s = 0; s < sequences.size(); ++s)
    for (const i64* l = sequences.begin(s); l != sequences.end(s); ++l) out[s] += causal_pairs(*l);
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

// The work of each sequence over the slice's heads that TAP and DistCA balance: pairs x heads,
// or with a cost model the predicted time of its documents (one segment each).
std::vector<double> sequence_work(const StepPlan& p, const std::vector<i64>& seq_pairs,
                                  const CostModel& m) {
  std::vector<double> out(seq_pairs.size());
  for (std::size_t s = 0; s < seq_pairs.size(); ++s) {
    if (!m.active()) {
      out[s] = static_cast<double>(seq_pairs[s]) * static_cast<double>(p.heads_local);
      continue;
    }
    const i64 first = p.seq_doc_offsets[s], count = p.seq_doc_offsets[s + 1] - first;
    out[s] = m.documents(p.doc_lengths.data() + first, count, p.heads_local);
  }
  return out;
}

// Causal pairs of each input sequence, validating the input in the same pass (an invalid entry
// is reported as validate_sequences words it) and copying the documents into the plan's CSR
// arrays (seq_doc_offsets already holds the input's offsets; doc_lengths is sized for them), on
// `workers` threads, each a range of sequences; adds the step's tokens and sets the longest
// document. With a table, each sequence's work (sequence_work's) into seq_work (sized B), its
// documents priced as they are read.
std::vector<i64> read_sequences(StepPlan& p, const SequencesView& sequences, i64 context,
                                std::size_t workers, i64& total_tokens, i64& longest,
                                const CostModel& cost, std::vector<double>& seq_work) {
  std::vector<i64> seq_pairs(sequences.size());
  const std::size_t pieces = std::min<std::size_t>(workers, sequences.size());
  struct Piece {
    i64 tokens = 0, longest = 0;
    bool bad = false;
  };
  std::vector<Piece> out(pieces);
  run_workers(workers, pieces, [&](WorkQueue& queue) {
    for (std::size_t k; queue.take(k);) {
      Piece& piece = out[k];
      const std::size_t first = sequences.size() * k / pieces;
      const std::size_t last = sequences.size() * (k + 1) / pieces;
      for (std::size_t s = first; s < last; ++s) {
        // more documents than tokens is a bad sequence (each holds at least one), and below
        // that the sum of lengths each <= context <= 2^30 cannot overflow
        if (sequences.docs(s) > static_cast<std::size_t>(context)) {
          piece.bad = true;
          break;
        }
        i64 tokens = 0, pairs = 0, most = 0;
        i64* len = p.doc_lengths.data() + p.seq_doc_offsets[s];
        const i64* it = sequences.begin(s);
        const i64* const end = sequences.end(s);
        auto read = [&](i64 x) {  // one document: checked, counted, copied; its length
          piece.bad |= x <= 0 || x > context;
          const i64 l = std::min(std::max(x, i64{0}), context);  // no overflow on bad input
          tokens += l;
          pairs += causal_pairs(l);
          most = std::max(most, l);
          *len++ = l;
          return l;
        };
        if (!cost.active()) {
          for (; it != end; ++it) read(*it);
        } else {  // the same, and the prices summed in PriceSum's order, two documents a step
          double even = 0.0, odd = 0.0;
          for (; it + 2 <= end; it += 2) {
            even += cost.doc_price(read(it[0]));
            odd += cost.doc_price(read(it[1]));
          }
          if (it != end) even += cost.doc_price(read(*it));
          seq_work[s] = cost.whole_documents(even + odd, static_cast<i64>(sequences.docs(s)),
                                             p.heads_local);
        }
        piece.bad |= tokens > context;
        if (piece.bad) break;
        seq_pairs[s] = pairs;
        piece.tokens += tokens;
        piece.longest = std::max(piece.longest, most);
      }
    }
  });
  for (const Piece& piece : out) {
    if (piece.bad) validate_sequences(sequences, context);  // throws, naming the entry
    total_tokens += piece.tokens;
    longest = std::max(longest, piece.longest);
  }
  return seq_pairs;
}

// The rest of the documents' arrays once their lengths are in: the ids (input order), and the
// digests of the three arrays (appended to `digests`).
void finish_documents(StepPlan& p, StepPlan::KnownDigests& digests) {
  const std::size_t n_docs = p.doc_lengths.size();
  p.doc_ids.resize(n_docs);
  PlanHasher ids;
  // The ids are not read while planning: written past the cache, which keeps room for the
  // lengths TAP reads.
  write_hashed(p.doc_ids.data(), n_docs, &ids, [](std::size_t i) { return static_cast<i64>(i); });
  store_fence();
  ids.value(static_cast<i64>(n_docs));
  digests.push_back({&p.doc_lengths, StepPlan::array_digest(p.doc_lengths)});
  digests.push_back({&p.doc_ids, ids.digest()});
  digests.push_back({&p.seq_doc_offsets, StepPlan::array_digest(p.seq_doc_offsets)});
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

// One exchange group's share of the exchange tables (see group_exchange).
struct GroupExchange {
  struct KvNeed {
    i64 key, len, seq, start;
  };
  std::vector<KvNeed> kv;       // KV prefixes to ship, by cell, then key; one per key
  std::vector<i64> kv_cell;     // cell of each (local to the group: src * Px + dst)
  std::vector<i64> send;        // positions in the group's tile list by (owner, executor member, position)
  i64 moved_tokens = 0, all_tokens = 0;  // query rows x heads moved / all
};

// What one worker reuses from group to group.
struct ExchangeScratch {
  std::vector<i64> tile_count, kv_count;  // per cell, then running offsets
  std::vector<GroupExchange::KvNeed> need;
};

// A group's tiles read from the plan's arrays: tile index[i] is the list's i-th.
struct PlanTileList {
  const StepPlan& p;
  const i64* index;
  std::size_t n;
  std::size_t size() const { return n; }
  StepPlan::Tile operator[](std::size_t i) const { return p.tile(static_cast<std::size_t>(index[i])); }
};

// The exchange of group g, whose tiles (in their order in the plan) are `tiles`: writes the
// group's own cells of xchg_q / xchg_o / xchg_kv (no other group touches them) and fills `out`.
template <typename TileList>
void group_exchange(StepPlan& p, i64 g, const TileList& tiles, ExchangeScratch& scratch,
                    GroupExchange& result) {
  // built here and moved into `result` once: neighbouring groups' results share cache lines
  // and are filled on other threads
  GroupExchange out;
  const i64 Px = p.exchange_pool, kvh = p.kv_heads_local, d = p.head_dim;
  const std::size_t cells = static_cast<std::size_t>(Px * Px), n = tiles.size();
  const i64 base = g * Px * Px;
  const i64 first_replica = (g / p.slots) * Px;
  i64* xq = p.xchg_q.data() + base;
  i64* xo = p.xchg_o.data() + base;
  i64* xkv = p.xchg_kv.data() + base;
  auto& tile_count = scratch.tile_count;
  auto& kv_count = scratch.kv_count;
  tile_count.assign(cells + 1, 0);
  kv_count.assign(cells + 1, 0);
  i64* tc = tile_count.data() + 1;
  i64* kc = kv_count.data() + 1;
  i64 all = 0, moved = 0, n_need = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const auto& t = tiles[i];
    const i64 qh = t.q_len * t.head_count;
    const i64 src = t.owner - first_replica, dst = t.executor - first_replica;
    all += qh;
    ++tc[src * Px + dst];
    if (src == dst) continue;
    if (dst < 0 || dst >= Px)
      fail("internal: tile " + std::to_string(i) + " of group " + std::to_string(g) +
           " leaves its exchange pool");
    moved += qh;
    xq[src * Px + dst] += qh * d;
    xo[dst * Px + src] += qh * d;
    const auto [kv0, kv1] = kv_heads_of(p, t.head_start, t.head_count);
    const i64 needs = (kv1 - kv0 + 1) * t.doc_count;  // one per (document, KV head)
    kc[src * Px + dst] += needs;
    n_need += needs;
  }
  out.all_tokens = all;
  out.moved_tokens = moved;
  out.send.resize(n);
  i64* send = out.send.data();
  auto& need = scratch.need;
  need.resize(static_cast<std::size_t>(n_need));
  for (std::size_t c = 0; c < cells; ++c) {
    tile_count[c + 1] += tile_count[c];
    kv_count[c + 1] += kv_count[c];
  }
  // Send order by cell (counting sort), position inside; KV needs by cell, then inside each
  // cell by key, the longest prefix of each key kept.
  for (std::size_t i = 0; i < n; ++i) {
    const auto& t = tiles[i];
    const i64 dst = t.executor - first_replica;
    const i64 cell = (t.owner - first_replica) * Px + dst;
    send[tile_count[cell]++] = static_cast<i64>(i);
    if (t.owner == t.executor) continue;
    const auto [kv0, kv1] = kv_heads_of(p, t.head_start, t.head_count);
    // a tile of one document needs the prefix [0, kv_len) of it; a run of whole documents
    // needs each of them whole (what the operator ships: one stream per document and KV head,
    // so runs of different heads that share documents share their KV)
    for (i64 k = 0, start = t.kv_start; k < t.doc_count; ++k) {
      const i64 doc = t.doc + k;
      const i64 len = t.doc_count == 1 ? t.kv_len : p.doc_lengths[static_cast<std::size_t>(doc)];
      for (i64 kh = kv0; kh <= kv1; ++kh)
        need[kv_count[cell]++] = {(doc * kvh + kh) * Px + dst, len, t.seq, start};
      start += len;
    }
  }
  for (std::size_t c = 0, begin = 0; c < cells; ++c) {  // kv_count[c] is now cell c's end
    const std::size_t end = static_cast<std::size_t>(kv_count[c]);
    if (end == begin) continue;
    const auto first = need.begin() + static_cast<std::ptrdiff_t>(begin);
    const auto last = need.begin() + static_cast<std::ptrdiff_t>(end);
    std::sort(first, last, [](const GroupExchange::KvNeed& x, const GroupExchange::KvNeed& y) {
      return x.key != y.key ? x.key < y.key : x.len < y.len;
    });
    for (auto it = first; it != last; ++it) {
      if (it + 1 != last && (it + 1)->key == it->key) continue;
      xkv[c] += 2 * it->len * d;
      out.kv.push_back(*it);
      out.kv_cell.push_back(static_cast<i64>(c));
    }
    begin = end;
  }
  result = std::move(out);
}

// The arrays of one entry per shipped KV prefix.
std::array<PlanArray*, 7> kv_arrays(StepPlan& p) {
  return {&p.kv_group, &p.kv_src, &p.kv_dst, &p.kv_seq, &p.kv_start, &p.kv_len, &p.kv_head};
}

// Zeroed exchange cells for `groups` exchange groups.
void start_exchange(StepPlan& p, i64 groups) {
  const std::size_t cells = static_cast<std::size_t>(groups * p.exchange_pool * p.exchange_pool);
  p.xchg_q.assign(cells, 0);
  p.xchg_kv.assign(cells, 0);
  p.xchg_o.assign(cells, 0);
}

// Group g's KV entries, at entries kv0.. of the kv arrays, and its send order, at send_order
// entries first..: the tile index of list position k is first + k, or index[k] if given.
void put_group_exchange(StepPlan& p, std::size_t g, const GroupExchange& part, std::size_t kv0,
                        i64 first, const i64* index) {
  const i64 Px = p.exchange_pool;
  for (std::size_t k = 0, i = kv0; k < part.kv.size(); ++k, ++i) {
    const auto& e = part.kv[k];
    p.kv_group[i] = static_cast<i64>(g);
    p.kv_src[i] = part.kv_cell[k] / Px;
    p.kv_dst[i] = part.kv_cell[k] % Px;
    p.kv_seq[i] = e.seq;
    p.kv_start[i] = e.start;
    p.kv_head[i] = (e.key / Px) % p.kv_heads_local;
    p.kv_len[i] = e.len;
  }
  i64* send = p.send_order.data() + first;
  for (std::size_t k = 0; k < part.send.size(); ++k)
    send[k] = index != nullptr ? index[part.send[k]] : first + part.send[k];
}

// The exchange's totals once every group's cells are in: moved_token_fraction and the bytes
// each rank sends, forward + backward: as owner Q, KV (fwd) and dO (bwd); as executor O (fwd)
// and dQ, dKV (bwd). Identical for every cp rank of a replica (own head slice). The softmax LSE
// stays on the executor (its kernel backward uses it), so it is not sent.
void finish_exchange(StepPlan& p, i64 moved_tokens, i64 all_tokens) {
  p.moved_token_fraction =
      all_tokens > 0 ? static_cast<double>(moved_tokens) / static_cast<double>(all_tokens) : 0.0;
  const i64 Px = p.exchange_pool;
  const i64 G = p.dp / Px * p.slots;
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

// TAP's groups laid out into the plan in group order while the workers place them: whichever
// worker finds the next group placed copies its tiles, send order and KV entries in (the tiles
// are then still in cache), while the others go on placing. Arrays are sized ahead from an
// estimate of the step's tiles (entries stay unset until written, so unused room costs no
// memory traffic), grown if a step needs more, and cut to size at the end.
class OrderedLayout {
 public:
  OrderedLayout(StepPlan& p, std::size_t groups, std::size_t tile_estimate)
      : p_(p), lists_(groups), parts_(groups), ready_(groups) {
    for (auto& r : ready_) r.store(false, std::memory_order_relaxed);
    p_.send_group_offsets.assign(groups + 1, 0);
    reserve_tiles(tile_estimate);
    reserve_kv(tile_estimate / 8);
  }

  GroupExchange& part(std::size_t g) { return parts_[g]; }

  // Group g is placed (its exchange in part(g)): takes its tiles, then lays out the groups that
  // are next in order and placed, unless another worker is doing so.
  void placed(std::size_t g, GroupTileList& tiles) {
    lists_[g].swap(tiles);
    ready_[g].store(true, std::memory_order_release);
    if (!mutex_.try_lock()) return;  // that worker, or finish(), lays it out
    drain();
    mutex_.unlock();
  }

  // After every group is placed: the groups still waiting, the arrays cut to size, the totals;
  // the digests of the tile arrays and the send order (hashed as they were laid out) appended
  // to `digests`.
  void finish(StepPlan::KnownDigests& digests) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      drain();
      if (next_ != lists_.size()) fail("internal: a TAP group was not placed");
    }
    p_.resize_tiles(static_cast<std::size_t>(tiles_));
    p_.send_order.resize(static_cast<std::size_t>(tiles_));
    for (PlanArray* a : kv_arrays(p_)) a->resize(kv_);
    const auto hashed = hashed_list();
    for (std::size_t k = 0; k < hashed.size(); ++k) {
      hashers_[k].value(tiles_);
      digests.push_back({hashed[k], hashers_[k].digest()});
    }
    finish_exchange(p_, moved_, all_);
  }

 private:
  // The arrays of one entry per tile, hashed as groups are laid out: the tile arrays (in
  // tile_columns() order), then the send order.
  std::array<PlanArray*, StepPlan::kTileColumns + 1> hashed_list() {
    std::array<PlanArray*, StepPlan::kTileColumns + 1> out{};
    for (std::size_t k = 0; k < StepPlan::kTileColumns; ++k)
      out[k] = &(p_.*StepPlan::tile_columns()[k].array);
    out[StepPlan::kTileColumns] = &p_.send_order;
    return out;
  }
  void reserve_tiles(std::size_t n) {
    p_.resize_tiles(n);
    p_.send_order.resize(n);
  }
  void reserve_kv(std::size_t n) {
    for (PlanArray* a : kv_arrays(p_)) a->resize(n);
  }
  // Lays out placed groups in order (the caller holds the mutex).
  void drain() {
    for (; next_ < lists_.size() && ready_[next_].load(std::memory_order_acquire); ++next_) {
      const std::size_t g = next_;
      GroupTileList& tiles = lists_[g];
      GroupExchange& part = parts_[g];
      const std::size_t n = tiles.size(), end = static_cast<std::size_t>(tiles_) + n;
      if (end > p_.send_order.size()) reserve_tiles(std::max(end, 2 * p_.send_order.size()));
      if (kv_ + part.kv.size() > p_.kv_len.size())
        reserve_kv(std::max(kv_ + part.kv.size(), 2 * p_.kv_len.size()));
      p_.set_tiles(static_cast<std::size_t>(tiles_), tiles, hashers_.data());
      put_group_exchange(p_, g, part, kv_, tiles_, nullptr);
      hashers_[StepPlan::kTileColumns].words(p_.send_order.data() + tiles_, n);
      tiles_ += static_cast<i64>(n);
      kv_ += part.kv.size();
      p_.send_group_offsets[g + 1] = tiles_;
      moved_ += part.moved_tokens;
      all_ += part.all_tokens;
      GroupTileList().swap(tiles);  // freed here, so the next group's list reuses warm memory
      part = GroupExchange();
    }
  }

  StepPlan& p_;
  std::vector<GroupTileList> lists_;
  std::vector<GroupExchange> parts_;
  std::vector<std::atomic<bool>> ready_;
  std::mutex mutex_;
  std::array<PlanHasher, StepPlan::kTileColumns + 1> hashers_;  // of hashed_list()
  std::size_t next_ = 0;  // the next group to lay out
  i64 tiles_ = 0;
  std::size_t kv_ = 0;
  i64 moved_ = 0, all_ = 0;
};

// Send order, KV entries and totals of the groups' exchanges on `workers` threads; group g's
// tiles are index[first[g] .. first[g + 1]).
void lay_out_exchange(StepPlan& p, const std::vector<GroupExchange>& parts,
                      const std::vector<i64>& first, const i64* index, std::size_t workers) {
  const std::size_t G = parts.size();
  std::vector<std::size_t> kv_first(G + 1, 0);
  i64 moved_tokens = 0, all_tokens = 0;
  for (std::size_t g = 0; g < G; ++g) {
    kv_first[g + 1] = kv_first[g] + parts[g].kv.size();
    moved_tokens += parts[g].moved_tokens;
    all_tokens += parts[g].all_tokens;
  }
  for (PlanArray* a : kv_arrays(p)) a->resize(kv_first[G]);
  p.send_group_offsets.assign(first.begin(), first.end());
  p.send_order.resize(static_cast<std::size_t>(first[G]));
  run_workers(workers, G, [&](WorkQueue& queue) {
    for (std::size_t g; queue.take(g);)
      put_group_exchange(p, g, parts[g], kv_first[g], first[g], index + first[g]);
  });
  finish_exchange(p, moved_tokens, all_tokens);
}

// Exchange tables of the plan's tiles, group by group on `workers` threads (groups are
// independent; the tables do not depend on the worker count). Tiles of a group are usually
// contiguous; otherwise they are bucketed by group first.
void build_exchange(StepPlan& p, std::size_t workers) {
  const i64 Px = p.exchange_pool;
  const i64 G = p.dp / Px * p.slots;
  start_exchange(p, G);
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
      group_exchange(p, static_cast<i64>(g),
                     PlanTileList{p, by_group.data() + first[g],
                                  static_cast<std::size_t>(first[g + 1] - first[g])},
                     scratch, parts[g]);
  });
  lay_out_exchange(p, parts, first, by_group.data(), workers);
}

// Loads of the (layout pool, slot) groups: each group's total and, per member, the work of the
// group's tiles with cp == -1 that it executes (on each of its C ranks), each summed in tile
// order.
struct GroupLoads {
  std::vector<double> group;   // [D/P * m]
  std::vector<double> member;  // [D/P * m * P]
  explicit GroupLoads(const StepPlan& p)
      : group(static_cast<std::size_t>(p.dp / p.pool * p.slots), 0.0),
        member(static_cast<std::size_t>(p.dp * p.slots), 0.0) {}
};

// Attention FLOPs (forward + backward) of a tile.
inline double tile_flops(const StepPlan& p, i64 pairs, i64 heads) {
  return attn_fwd_flops(static_cast<double>(pairs), heads, p.head_dim) * (1.0 + kAttnBwdFactor);
}

// A tile's load in the metrics: its FLOPs, or with a cost model its predicted time.
inline double tile_load(const StepPlan& p, const CostModel& m, const StepPlan::Tile& t) {
  return m.active() ? tile_work(p, m, t) : tile_flops(p, t.pairs, t.head_count);
}

// The loads of layout group g from its tiles (all with cp == -1), in tile order.
void add_group_loads(const StepPlan& p, const CostModel& m, std::size_t g, const GroupTileList& tiles,
                     const std::vector<double>& work, GroupLoads& loads) {
  const i64 first_replica = static_cast<i64>(g) / p.slots * p.pool;
  // summed here, then stored once: neighbouring groups' entries share cache lines and are
  // summed on other threads
  thread_local std::vector<double> member;
  member.assign(static_cast<std::size_t>(p.pool), 0.0);
  double total = 0;
  for (std::size_t i = 0; i < tiles.size(); ++i) {
    const StepPlan::Tile& t = tiles[i];
    // a table's price as TAP balanced it (the same number); FLOPs without one
    const double f = m.active() ? work[i] : tile_load(p, m, t);
    member[t.executor - first_replica] += f;
    total += f * static_cast<double>(p.cp);
  }
  std::copy(member.begin(), member.end(), loads.member.begin() + g * static_cast<std::size_t>(p.pool));
  loads.group[g] = total;
}

// The metrics (`longest`: the longest executed document); `known` holds the group loads when
// the tiles' groups already summed them (TAP), else they are summed here from the tile arrays,
// the same way.
void compute_metrics(StepPlan& p, const CostModel& cost, const std::vector<i64>& input_pairs,
                     SampleOrder order, i64 micro_batch, i64 longest, GroupLoads* known,
                     const std::vector<double>* input_work = nullptr) {
  const i64 C = p.cp, m = p.slots, P = p.pool;
  p.rank_load.assign(static_cast<std::size_t>(p.dp * C), 0.0);
  std::optional<GroupLoads> own;
  if (known == nullptr) {
    own.emplace(p);
    known = &*own;
    // A tile with cp == -1 loads every cp rank of its executor alike: summed once per (group,
    // executor) (the same additions in the same order as per rank), spread over its C ranks
    // after; one with cp >= 0 loads that rank only.
    std::vector<i64> group_base(static_cast<std::size_t>(p.dp));
    for (i64 r = 0; r < p.dp; ++r) group_base[r] = (r / P) * m;
    for (i64 t = 0; t < p.n_tiles(); ++t) {
      const double f = cost.active() ? tile_work(p, cost, p.tile(static_cast<std::size_t>(t)))
                                     : tile_flops(p, p.tile_pairs[t], p.tile_head_count[t]);
      const i64 e = p.tile_executor[t];
      const i64 g = group_base[e] + p.seq_slot[p.tile_seq[t]];
      if (p.tile_cp[t] < 0) {
        known->member[g * P + e % P] += f;
        known->group[g] += f * static_cast<double>(C);
      } else {
        p.rank_load[e * C + p.tile_cp[t]] += f;
        known->group[g] += f;
      }
    }
  }
  p.group_load = std::move(known->group);
  // each executor's work over its pool's slots, in slot order, on each of its C ranks
  for (i64 e = 0; e < p.dp; ++e) {
    double exec = 0;
    for (i64 slot = 0; slot < m; ++slot) exec += known->member[((e / P) * m + slot) * P + e % P];
    if (exec != 0.0)
      for (i64 c = 0; c < C; ++c) p.rank_load[e * C + c] += exec;
  }
  const double bwd = 1.0 + kAttnBwdFactor;
  // Before: the input in Megatron's production order under Ulysses (no balancing, no moves).
  p.rank_load_before.assign(static_cast<std::size_t>(p.dp * C), 0.0);
  std::vector<double> group_before(p.group_load.size(), 0.0);
  // with a cost model, the input priced: given where the plan repacked it (wlb), else the
  // executed sequences are the input (libra, distca)
  const std::vector<double> before_work =
      !cost.active() ? std::vector<double>()
      : input_work != nullptr ? *input_work : sequence_work(p, input_pairs, cost);
  for (std::size_t s = 0; s < input_pairs.size(); ++s) {
    const double f =
        cost.active() ? before_work[s]
                      : attn_fwd_flops(static_cast<double>(input_pairs[s]), p.heads_local, p.head_dim) * bwd;
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
  const i64 rows = std::min(longest, min_split_rows(p.context));
  const double unit =
      cost.active() ? cost.segment(rows, longest, 1)
                    : attn_fwd_flops(static_cast<double>(block_pairs(longest - rows, longest)), 1,
                                     p.head_dim) * bwd;
  const double mean_rank =
      std::accumulate(p.rank_load.begin(), p.rank_load.end(), 0.0) / static_cast<double>(p.rank_load.size());
  // Pools of the layout hold the sequences; DistCA moves tiles between any replicas (one global
  // pool), so its figure is over all of them.
  std::vector<double> totals = pool_totals(p.group_load, m);
  i64 members = P;
  if (p.system == System::Distca) {
    totals.assign(1, std::accumulate(totals.begin(), totals.end(), 0.0));
    members = p.dp;
  }
  double worst = 0;
  for (const double total : totals)
    worst = std::max(worst, std::max(total / static_cast<double>(members * C), unit));
  p.achievable_max_over_mean = mean_rank > 0 ? worst / mean_rank : 1.0;
}

// Every element and byte count of a plan fits in 64 bits: an exchange cell counts at most a
// sequence's tokens x heads x head_dim elements, a few times over.
void check_sizes(const ModelDims& model, const Layout& layout, const PlanOptions& options) {
  const double elements = static_cast<double>(layout.context) * static_cast<double>(model.heads) *
                          static_cast<double>(model.head_dim);
  if (elements * static_cast<double>(options.dtype_bytes) > 0x1p56)
    fail("context x model.heads x model.head_dim x dtype_bytes = " +
         std::to_string(layout.context) + " x " + std::to_string(model.heads) + " x " +
         std::to_string(model.head_dim) + " x " + std::to_string(options.dtype_bytes) +
         " exceeds 2^56: a plan's byte counts must fit in 64 bits");
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
  const PackedBatch batch = PackedBatch::from_nested(sequences);
  return plan_step(batch.view(), layout, model, options, state, flush);
}

namespace {

// Refuse a step its layout, model and options cannot plan, before anything is made.
void check_step(const SequencesView& sequences, const Layout& layout, const ModelDims& model,
                const PlanOptions& options, const PlannerState* state) {
  layout.validate();
  model.validate();
  options.validate();
  check_heads(model, layout, options.system);
  check_sizes(model, layout, options);
  sequences.validate_offsets();
  const i64 B = static_cast<i64>(sequences.size());
  if (B == 0) fail("sequences is empty: a step needs at least dp packed sequences");
  if (B % layout.dp != 0)
    fail("gbs (B=" + std::to_string(B) + ") must be divisible by dp (D=" +
         std::to_string(layout.dp) + ")");
  if ((B / layout.dp) % options.micro_batch != 0)
    fail("micro_batch_size (" + std::to_string(options.micro_batch) +
         ") must divide the sequences per replica (m = gbs / dp = " + std::to_string(B / layout.dp) +
         ")");
  if (options.system == System::Distca && options.distca_gpu && layout.cp != 1)
    fail("distca_server = gpu (every GPU an attention server) is planned where a GPU is a "
         "replica (cp 1), got cp " + std::to_string(layout.cp) +
         ": with cp > 1 DistCA cuts documents at GPU boundaries inside a replica, a layout the "
         "operator's Ulysses ranks do not hold (libra simulate models it at any cp)");
  if (options.system == System::Wlb && state == nullptr)
    fail("state: the wlb system carries a delay queue and needs a PlannerState");
  if (state != nullptr) state->validate(layout, options);
}

// One step being planned: the plan, what its phases share, and the phase timer.
struct StepBuilder {
  const SequencesView& sequences;
  const Layout& layout;
  const PlanOptions& options;
  PlanOptions opt;  // options with the block resolved
  i64 hg = 0;       // heads per tile
  StepPlan p;
  std::vector<i64> input_pairs;  // causal pairs of each input sequence
  std::vector<double> input_work;  // with a cost model: the input sequences as they came, priced
  VrspPlacement placement;
  PlacementBounds bounds;
  i64 longest = 0;                      // the longest executed document
  std::size_t workers = 1;              // set once the step's documents are known
  StepPlan::KnownDigests digests;       // arrays hashed as they were written
  std::optional<GroupLoads> tap_loads;  // TAP: the groups' loads, summed as they are placed
  std::chrono::steady_clock::time_point t0, lap;

  StepBuilder(const SequencesView& seqs, const Layout& lay, const ModelDims& model,
              const PlanOptions& options_)
      : sequences(seqs), layout(lay), options(options_), opt(options_) {
    t0 = lap = std::chrono::steady_clock::now();
    const i64 B = static_cast<i64>(sequences.size());
    p.system = options.system;
    p.dp = layout.dp; p.cp = layout.cp; p.tp = layout.tp; p.pool = layout.pool;
    p.context = layout.context; p.slots = B / layout.dp;
    p.heads_local = model.heads / (layout.cp * layout.tp);
    const i64 g = model.heads / model.kv_heads;
    p.kv_heads_local = std::max<i64>(1, p.heads_local / g);
    p.head_dim = model.head_dim;
    p.dtype_bytes = options.dtype_bytes;
    if (opt.block == 0) opt.block = std::max<i64>(1024, layout.context / 16);
    // only the systems that balance attention work take a cost model
    if (options.system == System::Ulysses) opt.cost = CostModel{};
    opt.cost.prepare();  // O(1) segment prices for this step
    hg = opt.head_group > 0 ? std::min(opt.head_group, p.heads_local) : p.heads_local;
  }

  void phase_done(PlanPhase phase) {
    const auto now = std::chrono::steady_clock::now();
    p.phase_ms[static_cast<std::size_t>(phase)] =
        std::chrono::duration<double, std::milli>(now - lap).count();
    lap = now;
  }

  // Refuse plans whose tiles would not fit the memory budget rather than failing mid-way.
  void check_budget(double est) const {
    if (est > kMaxPlanTiles)
      fail("this step would make about " + std::to_string(static_cast<i64>(est)) + " tiles (" +
           std::to_string(static_cast<i64>(est * kBytesPerTile / 1e9)) +
           " GB of plan), more than the budget of " + std::to_string(static_cast<i64>(kMaxPlanTiles)) +
           (options.system == System::Wlb
                ? " tiles: per-document CP makes 2C tiles per document; plan fewer documents or a smaller cp"
                : " tiles; raise block (" + std::to_string(opt.block) + ") or head_group (" +
                      std::to_string(hg) + ")"));
  }

  // WLB-LLM: repack the step's documents (and those it holds) into the buckets, then per-document
  // CP tiles.
  void plan_wlb(PlannerState& state, bool flush) {
    validate_sequences(sequences, layout.context);
    // per-document CP: up to 2C chunks of every document (queued ones included)
    double docs = static_cast<double>(state.pending()) * 2.0 * layout.cp;
    for (std::size_t i = 0; i < sequences.n_lengths; ++i)
      docs += static_cast<double>(std::min<i64>(sequences.lengths[i], 2 * layout.cp));
    check_budget(docs);
    input_pairs = pairs_of(sequences);
    phase_done(PlanPhase::Input);
    if (opt.cost.active()) {  // the input as Ulysses would run it, priced (the metrics' before)
      input_work.assign(sequences.size(), 0.0);
      for (std::size_t q = 0; q < sequences.size(); ++q)
        input_work[q] = opt.cost.documents(sequences.begin(q), static_cast<i64>(sequences.docs(q)),
                                           p.heads_local);
    }
    wlb_pack(p, sequences, opt, state, flush);
    workers = plan_workers(options, p.doc_lengths.size());
    std::vector<i64> executed(static_cast<std::size_t>(p.n_seq()), 0);
    for (i64 s = 0; s < p.n_seq(); ++s)
      for (i64 d = p.seq_doc_offsets[s]; d < p.seq_doc_offsets[s + 1]; ++d)
        executed[s] += causal_pairs(p.doc_lengths[d]);
    const std::vector<double> loads =
        opt.cost.active() ? sequence_work(p, executed, opt.cost) : sequence_flops(p, executed);
    placement = production_place(loads, p.dp, p.pool, p.slots, SampleOrder::Megatron,
                                 1);  // wlb_pack's round robin
    bounds = placement_bounds(loads, p.dp, p.pool, p.slots);
    for (const i64 l : p.doc_lengths) longest = std::max(longest, l);
    phase_done(PlanPhase::Placement);
    wlb_tiles(p);
  }

  // The other systems: the input sequences as they are, placed (VRSP or production order),
  // then tiled and, for libra and distca, their tiles placed.
  void plan_placed() {
    const i64 B = static_cast<i64>(sequences.size());
    i64 tokens = 0;
    const std::size_t n_docs = sequences.n_lengths;
    p.seq_doc_offsets.assign(sequences.offsets, sequences.offsets + sequences.size() + 1);
    p.doc_lengths.resize(n_docs);
    workers = plan_workers(options, n_docs);  // the input is read on them too
    std::vector<double> seq_work(opt.cost.active() ? sequences.size() : 0);
    input_pairs = read_sequences(p, sequences, layout.context, workers, tokens, longest, opt.cost,
                                 seq_work);
    // per sequence: a document of l >= block tokens makes at most l / block + 1 query blocks
    // and ends a run; two consecutive runs of shorter documents hold more than a block; so at
    // most 5 * tokens / block + 1 tiles per head group
    const double tile_estimate = (5.0 * static_cast<double>(tokens) / static_cast<double>(opt.block) +
                                  static_cast<double>(B)) *
                                 static_cast<double>((p.heads_local + hg - 1) / hg);
    check_budget(tile_estimate);
    phase_done(PlanPhase::Input);
    if (opt.cost.active())
      input_work = seq_work;  // the metrics' before: the input as it came, priced
    else
      seq_work = sequence_work(p, input_pairs, opt.cost);
    const std::vector<double> loads =
        opt.cost.active() ? seq_work : sequence_flops(p, input_pairs);
    // While the sequences are placed, a second thread finishes the documents' arrays (and
    // hashes them) and computes the placement's lower bounds, which only the metrics need.
    SideTask side(workers > 1, [&] {
      finish_documents(p, digests);
      bounds = placement_bounds(loads, p.dp, p.pool, p.slots);
    });
    const bool vrsp = options.system == System::Libra && options.vrsp;
    const bool spread = options.system == System::Libra && !options.tap;
    placement = vrsp ? vrsp_place(loads, p.dp, p.pool, p.slots, options.order,
                                  options.micro_batch, spread, workers)
                     : production_place(loads, p.dp, p.pool, p.slots, options.order,
                                        options.micro_batch);
    side.join();
    phase_done(PlanPhase::Placement);
    p.seq_replica.assign(placement.replica.begin(), placement.replica.end());
    p.seq_slot.assign(placement.slot.begin(), placement.slot.end());
    place_tiles(tile_estimate, seq_work);
  }

  void place_tiles(double tile_estimate, const std::vector<double>& seq_work) {
    if (options.system == System::Libra && options.tap) {
      // The worker that places a group also builds its exchange and sums its loads while its
      // tiles are in cache; groups are laid out into the plan in order as they are placed.
      p.exchange_pool = p.pool;
      const std::size_t G = static_cast<std::size_t>(p.dp / p.pool * p.slots);
      start_exchange(p, static_cast<i64>(G));
      tap_loads.emplace(p);
      OrderedLayout ordered(p, G, static_cast<std::size_t>(std::min(tile_estimate, kMaxPlanTiles)));
      tap_place(p, opt, groups_of(p, p.pool), seq_work, workers,
                [&](std::size_t g, GroupTileList& tiles, const std::vector<double>& work) {
                  thread_local ExchangeScratch scratch;
                  group_exchange(p, static_cast<i64>(g), tiles, scratch, ordered.part(g));
                  add_group_loads(p, opt.cost, g, tiles, work, *tap_loads);
                  ordered.placed(g, tiles);
                });
      ordered.finish(digests);
    } else if (options.system == System::Distca) {
      p.exchange_pool = p.dp;
      if (options.distca_gpu)
        distca_gpu_place(p, opt, groups_of(p, p.dp));
      else
        distca_place(p, opt, groups_of(p, p.dp));
    } else {
      owner_tiles(p, opt.block);
    }
  }

  // Exchange tables, metrics and the hash, after the tiles.
  void finish() {
    phase_done(PlanPhase::Tiles);
    p.vrsp_max_group = placement.max_group;
    p.vrsp_lower_bound = bounds.group;
    p.vrsp_max_pool = placement.max_pool;
    p.vrsp_pool_lower_bound = bounds.pool;
    if (!tap_loads) build_exchange(p, workers);
    phase_done(PlanPhase::Exchange);
    compute_metrics(p, opt.cost, input_pairs, options.order, options.micro_batch, longest,
                    tap_loads ? &*tap_loads : nullptr, input_work.empty() ? nullptr : &input_work);
    phase_done(PlanPhase::Metrics);
    p.hash = p.compute_hash(workers, digests);
    phase_done(PlanPhase::Hash);
    p.plan_ms = std::chrono::duration<double, std::milli>(lap - t0).count();
  }
};

}  // namespace

StepPlan plan_step(const SequencesView& sequences, const Layout& layout, const ModelDims& model,
                   const PlanOptions& options, PlannerState* state, bool flush) {
  const auto t0 = std::chrono::steady_clock::now();
  check_step(sequences, layout, model, options, state);
  StepBuilder step(sequences, layout, model, options);
  step.t0 = step.lap = t0;  // the checks count towards the input phase
  if (options.system == System::Wlb) {
    step.plan_wlb(*state, flush);
  } else {
    step.plan_placed();
  }
  step.finish();
  return std::move(step.p);
}

}  // namespace libra
