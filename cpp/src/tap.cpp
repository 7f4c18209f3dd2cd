#include "libra/tap.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>
#include <unordered_map>

#include "libra/parallel.h"
#include "libra/workload.h"

namespace libra {


namespace {

void push_tile(StepPlan& p, i64 seq, i64 doc, i64 doc_off, i64 a, i64 b, i64 h0, i64 hc, i64 owner,
               i64 executor) {
  p.add_tile({seq, doc, 1, doc_off + a, b - a, h0, hc, doc_off, b, owner, executor, -1,
              block_pairs(a, b)});
}

// TAP's refinement stops when a move would lower the pair's maximum by less than this share of
// the member mean (see place_group).
constexpr double kRefineMinGain = 5e-4;

// The work handed with a tile that was not priced (no max_load to compare against).
constexpr double kUnpriced = -1.0;

// The work of query rows [a, b) of a document against their causal prefix, over hc heads:
// pairs x heads, or the cost model's predicted time.
inline double rows_work(const CostModel& m, i64 a, i64 b, i64 hc) {
  if (!m.active()) return static_cast<double>(block_pairs(a, b)) * static_cast<double>(hc);
  return m.rows(a, b, hc);
}

// The work of a whole document of l tokens over hc heads.
inline double doc_work(const CostModel& m, i64 l, i64 hc) {
  if (!m.active()) return static_cast<double>(causal_pairs(l)) * static_cast<double>(hc);
  return m.whole_documents(m.doc_price(l), 1, hc);  // = m.segment(l, l, hc), one look-up
}

}  // namespace

double tile_work(const StepPlan& p, const CostModel& m, const StepPlan::Tile& t) {
  if (!m.active()) return static_cast<double>(t.pairs) * static_cast<double>(t.head_count);
  if (t.doc_count == 1) return m.rows(t.kv_len - t.q_len, t.kv_len, t.head_count);
  return m.documents(p.doc_lengths.data() + t.doc, t.doc_count, t.head_count);
}

namespace {

// One-document tile t (rows of the document starting at doc_off against their causal prefix):
// emitted as it is while its load is within max_load; else cut by rows at the midpoint of work
// (pieces of at least min_rows rows), then by heads in halves.
template <typename Emit>
void split_tile(const CostModel& m, StepPlan::Tile t, i64 doc_off, double max_load, i64 min_rows,
                Emit& emit, double known = kUnpriced) {
  // (known: the tile's work where the caller has just priced it)
  const double load = max_load <= 0      ? kUnpriced
                      : known != kUnpriced ? known
                                           : rows_work(m, t.q_start - doc_off,
                                                       t.q_start - doc_off + t.q_len, t.head_count);
  if (max_load <= 0 || load <= max_load || (t.head_count == 1 && t.q_len < 2 * min_rows)) {
    emit(t, load);
    return;
  }
  if (t.q_len < 2 * min_rows) {  // too few rows to cut: halve the heads
    StepPlan::Tile lo = t, hi = t;
    lo.head_count = t.head_count / 2;
    hi.head_start = t.head_start + lo.head_count;
    hi.head_count = t.head_count - lo.head_count;
    split_tile(m, lo, doc_off, max_load, min_rows, emit);
    split_tile(m, hi, doc_off, max_load, min_rows, emit);
    return;
  }
  const i64 a = t.q_start - doc_off, b = a + t.q_len;
  // c with pairs(a, c) ~ pairs(c, b): c(c+1) ~ (a(a+1) + b(b+1)) / 2.
  const double mid = std::sqrt((static_cast<double>(a) * (a + 1) + static_cast<double>(b) * (b + 1)) / 2.0);
  const i64 c = std::min(b - min_rows, std::max(a + min_rows, static_cast<i64>(mid)));
  StepPlan::Tile lo = t, hi = t;
  lo.q_len = c - a;
  lo.kv_len = c;
  lo.pairs = block_pairs(a, c);
  hi.q_start = doc_off + c;
  hi.q_len = b - c;
  hi.pairs = block_pairs(c, b);
  split_tile(m, lo, doc_off, max_load, min_rows, emit);
  split_tile(m, hi, doc_off, max_load, min_rows, emit);
}

// A run of t.doc_count whole documents (plan documents t.doc, ...): split at the document
// boundary that best halves its work while heavier than max_load; one document is a one-document
// tile (its own prefix), split further by split_tile.
template <typename Emit>
void split_run(const StepPlan& p, const CostModel& m, StepPlan::Tile t, double max_load,
               i64 min_rows, Emit& emit, double known = kUnpriced) {
  if (t.doc_count == 1) {
    split_tile(m, t, t.q_start, max_load, min_rows, emit, known);
    return;
  }
  const double load = max_load <= 0        ? kUnpriced
                      : known != kUnpriced ? known
                                           : tile_work(p, m, t);
  if (max_load <= 0 || load <= max_load) {
    emit(t, load);
    return;
  }
  i64 k = 1, left = 0, left_len = 0, best_k = 1, best_pairs = 0, best_len = 0;
  i64 best_max = t.pairs + 1;
  for (; k < t.doc_count; ++k) {
    const i64 l = p.doc_lengths[t.doc + k - 1];
    left += causal_pairs(l);
    left_len += l;
    const i64 worst = std::max(left, t.pairs - left);
    if (worst < best_max) {
      best_max = worst;
      best_k = k;
      best_pairs = left;
      best_len = left_len;
    }
  }
  StepPlan::Tile lo = t, hi = t;
  lo.doc_count = best_k;
  lo.q_len = lo.kv_len = best_len;
  lo.pairs = best_pairs;
  hi.doc = t.doc + best_k;
  hi.doc_count = t.doc_count - best_k;
  hi.q_start = hi.kv_start = t.q_start + best_len;
  hi.q_len = hi.kv_len = t.q_len - best_len;
  hi.pairs = t.pairs - best_pairs;
  split_run(p, m, lo, max_load, min_rows, emit);
  split_run(p, m, hi, max_load, min_rows, emit);
}

// A run of short documents: len[doc] (shorter than `block`) and the next ones while the run
// stays within `block` tokens; its end (one past its last document), tokens, pairs and, when
// Priced, its documents' doc_price summed in PriceSum's order (tile_work's).
struct ShortRun {
  i64 end, len, pairs;
  double price;
};

// (a function of its own, its sums in registers: inlined into sequence_tiles' loop they were
// kept in memory, a store-to-load chain per document)
template <bool Priced>
__attribute__((noinline)) ShortRun short_run(const CostModel& m, const i64* len, i64 doc, i64 end,
                                             i64 block) {
  i64 run_len = len[doc], run_pairs = causal_pairs(len[doc]);
  PriceSum price;
  if (Priced) price.add(m.doc_price(len[doc]));
  for (++doc; doc < end; ++doc) {
    const i64 n = len[doc];
    if (n >= block || run_len + n > block) break;
    run_len += n;
    run_pairs += causal_pairs(n);
    if (Priced) price.add(m.doc_price(n));
  }
  return {doc, run_len, run_pairs, price.total()};
}

// Cut sequence s into SH-tiles: documents of at least `block` tokens into query blocks of `block`
// rows against their causal prefix; runs of shorter consecutive documents coalesced into tiles of
// at most `block` tokens; every tile split into head groups of `head_group` heads. A tile whose
// load (pairs x heads) exceeds `max_load` (> 0) is split further: a run of several documents at
// the document boundary that best halves its work (a single document becomes a one-document
// tile); a one-document tile by rows at the midpoint of work while it has at least 2 * min_rows
// rows, then by heads in halves. Calls emit(tile, work) for each, executor = owner; work is the
// tile's tile_work where it was priced (max_load > 0), kUnpriced otherwise.
template <typename Emit>
void sequence_tiles(const StepPlan& p, const CostModel& m, i64 s, i64 block, i64 head_group,
                    double max_load, Emit&& emit) {
  const i64 owner = p.seq_replica[s];
  // (priced: the tile's work over all the slice's heads where the caller has it)
  auto heads = [&](StepPlan::Tile t, i64 doc_off, double priced) {
    double whole = kUnpriced;  // the tile's work over all the slice's heads, once priced
    if (head_group >= p.heads_local) {
      t.head_start = 0;  // the common case: one head group, light enough to stay whole
      t.head_count = p.heads_local;
      whole = max_load <= 0 ? kUnpriced : priced != kUnpriced ? priced : tile_work(p, m, t);
      if (max_load <= 0 || whole <= max_load) {
        emit(t, whole);
        return;
      }
    }
    for (i64 h0 = 0; h0 < p.heads_local; h0 += head_group) {
      t.head_start = h0;
      t.head_count = std::min(head_group, p.heads_local - h0);
      const double known = t.head_count == p.heads_local ? whole : kUnpriced;
      if (t.doc_count == 1) {
        split_tile(m, t, doc_off, max_load, min_split_rows(p.context), emit, known);
      } else {
        split_run(p, m, t, max_load, min_split_rows(p.context), emit, known);
      }
    }
  };
  const i64* len = p.doc_lengths.data();
  const i64 end = p.seq_doc_offsets[s + 1];
  const bool priced = m.active() && max_load > 0;
  i64 off = 0;
  for (i64 doc = p.seq_doc_offsets[s]; doc < end;) {
    const i64 l = len[doc];
    if (l >= block) {
      for (i64 a = 0; a < l; a += block) {
        const i64 b = std::min(l, a + block);
        heads({s, doc, 1, off + a, b - a, 0, 0, off, b, owner, owner, -1, block_pairs(a, b)}, off,
              kUnpriced);
      }
      off += l;
      ++doc;
      continue;
    }
    // a run: this short document and the next ones while the run stays within `block` tokens
    const i64 run_doc = doc;
    const ShortRun run = priced ? short_run<true>(m, len, doc, end, block)
                                : short_run<false>(m, len, doc, end, block);
    doc = run.end;
    const i64 count = doc - run_doc;
    heads({s, run_doc, count, off, run.len, 0, 0, off, run.len, owner, owner, -1, run.pairs}, off,
          priced && count > 1 ? m.whole_documents(run.price, count, p.heads_local) : kUnpriced);
    off += run.len;
  }
}

// KV residency of one group: the prefix length of (local document, KV head) already shipped to
// a member (0 if none; the owner holds every prefix of its own documents). A document gets a
// row of [members x KV heads] entries the first time a prefix of it is shipped, so a group of
// many short documents costs nothing here; `slot` (document -> row) is shared by the groups one
// worker places and reset after each.
struct Residency {
  i64 members, kv_heads;
  std::vector<i64>& slot;
  std::vector<i64> touched;  // documents with a row
  std::vector<i64> have;     // [rows][members][kv_heads]
  Residency(i64 n_members, i64 kvh, std::vector<i64>& doc_slot)
      : members(n_members), kv_heads(kvh), slot(doc_slot) {}
  ~Residency() {
    for (i64 d : touched) slot[d] = -1;
  }
  i64 get(i64 member, i64 local_doc, i64 kh) const {
    const i64 s = slot[local_doc];
    return s < 0 ? 0 : have[(s * members + member) * kv_heads + kh];
  }
  i64& at(i64 member, i64 local_doc, i64 kh) {
    i64& s = slot[local_doc];
    if (s < 0) {
      s = static_cast<i64>(touched.size());
      touched.push_back(local_doc);
      have.resize(have.size() + static_cast<std::size_t>(members * kv_heads), 0);
    }
    return have[(s * members + member) * kv_heads + kh];
  }
};

// The tiles of one (pool, slot) group, built and placed without touching the plan (groups are
// independent, so workers place them concurrently); appended to the plan in group order.
struct GroupTiles {
  std::vector<StepPlan::Tile> tile;
  std::vector<i64> owner;      // member index
  std::vector<i64> local_doc;  // document index inside the group
  std::vector<double> load;    // work (tile_work)
  // As made (before any cut): member i's tiles are [first[i], first[i + 1]), their loads summed
  // in tile order own[i]; all loads summed in tile order, total.
  std::vector<std::size_t> first;
  std::vector<double> own;
  double total = 0;
  std::size_t size() const { return tile.size(); }
  void clear() {
    tile.clear();
    owner.clear();
    local_doc.clear();
    load.clear();
    first.clear();
    own.clear();
    total = 0;
  }
  void push(const StepPlan::Tile& t, i64 member, i64 doc, double work) {
    tile.push_back(t);
    owner.push_back(member);
    local_doc.push_back(doc);
    load.push_back(work);
  }
};

// Local KV heads tile t's query heads read.
inline KvHeads kv_heads_of(const StepPlan& plan, const StepPlan::Tile& t) {
  return kv_heads_of(plan, t.head_start, t.head_count);
}

class Placer {
 public:
  Placer(const StepPlan& plan, const TileBytes& bytes, const GroupTiles& gt, i64 members,
         std::vector<i64>& doc_slot)
      : plan_(plan), bytes_(bytes), gt_(gt), res_(members, plan.kv_heads_local, doc_slot),
        load_(static_cast<std::size_t>(members), 0.0),
        exec_(gt.size(), -1) {}

  // Bytes that executing tile k on member j adds, given what is resident there.
  i64 increment(std::size_t k, i64 j) const {
    return increment_at(k, j, gt_.local_doc[k], gt_.tile[k].q_len, gt_.tile[k].kv_len);
  }

  // The same for q_len query rows of tile k's heads against a kv_len prefix of the owner's
  // document local_doc.
  i64 increment_at(std::size_t k, i64 j, i64 local_doc, i64 q_len, i64 kv_len) const {
    if (gt_.owner[k] == j) return 0;
    const StepPlan::Tile& t = gt_.tile[k];
    i64 inc = bytes_.qo_bytes(q_len, t.head_count);
    const KvHeads kv = kv_heads_of(plan_, t);
    for (i64 kh = kv.first; kh <= kv.last; ++kh) {
      const i64 r = res_.get(j, local_doc, kh);
      if (kv_len > r) inc += bytes_.kv_bytes(kv_len - r);
    }
    return inc;
  }

  // A tile appended to the group (a tail cut off another tile), executed nowhere yet.
  void add_tile() { exec_.push_back(-1); }

  // Tile k executed where it is (if anywhere), `w` lighter (its tail was cut off).
  void shrink(std::size_t k, double w) {
    if (exec_[k] >= 0) load_[exec_[k]] -= w;
  }

  // Member j, with nothing assigned yet, executes tiles [first, last), its own, whose loads sum
  // (in order) to `own`: the same as assigning them one by one.
  void keep(std::size_t first, std::size_t last, i64 j, double own) {
    std::fill(exec_.begin() + static_cast<std::ptrdiff_t>(first),
              exec_.begin() + static_cast<std::ptrdiff_t>(last), j);
    load_[j] = own;
  }

  void assign(std::size_t k, i64 j) {
    if (exec_[k] >= 0) load_[exec_[k]] -= gt_.load[k];
    exec_[k] = j;
    load_[j] += gt_.load[k];
    if (gt_.owner[k] == j) return;
    const StepPlan::Tile& t = gt_.tile[k];
    const KvHeads kv = kv_heads_of(plan_, t);
    for (i64 kh = kv.first; kh <= kv.last; ++kh) {
      i64& r = res_.at(j, gt_.local_doc[k], kh);
      r = std::max(r, t.kv_len);
    }
  }

  std::vector<double>& load() { return load_; }
  std::vector<i64>& exec() { return exec_; }

 private:
  const StepPlan& plan_;
  TileBytes bytes_;
  const GroupTiles& gt_;
  Residency res_;
  std::vector<double> load_;
  std::vector<i64> exec_;
};

struct Cut {
  std::size_t k;  // tile (local index); gt.size() when there is none
  i64 c = 0;      // one document: first row (document coordinates) of the piece cut off; several
                  // documents: how many leading documents the tile keeps
  double w = 0;   // the piece's load
  double new_max = 0;
  i64 bytes = 0;
};

// Tile k gives up its tail - the documents from index `at` on of a multi-document tile, or the
// rows [at, b) of a one-document tile - as a new tile appended to the group, executed nowhere
// yet; tile k's executor (if any) loses the tail's load. Returns its index.
std::size_t split_tail(const StepPlan& plan, const CostModel& m, GroupTiles& gt, Placer& placer,
                       std::size_t k, i64 at) {
  StepPlan::Tile& t = gt.tile[k];
  StepPlan::Tile tail{t.seq, t.doc, 1, 0, 0, t.head_start, t.head_count, 0, 0, t.owner, t.owner,
                      -1, 0};
  i64 tail_doc = gt.local_doc[k];
  if (t.doc_count > 1) {  // whole documents [at, count), each its own prefix
    i64 tokens = 0, pairs = 0;
    for (i64 d = at; d < t.doc_count; ++d) {
      tokens += plan.doc_lengths[t.doc + d];
      pairs += causal_pairs(plan.doc_lengths[t.doc + d]);
    }
    tail.doc += at;
    tail.doc_count = t.doc_count - at;
    tail.q_start = tail.kv_start = t.q_start + t.q_len - tokens;
    tail.q_len = tail.kv_len = tokens;
    tail.pairs = pairs;
    tail_doc += at;
    t.doc_count = at;
    t.q_len -= tokens;
    t.kv_len -= tokens;
    t.pairs -= pairs;
  } else {  // rows [at, b) of the document against its prefix [0, b)
    const i64 a = t.q_start - t.kv_start, b = a + t.q_len;
    tail.q_start = t.kv_start + at;
    tail.q_len = b - at;
    tail.kv_start = t.kv_start;
    tail.kv_len = b;
    tail.pairs = block_pairs(at, b);
    t.q_len = at - a;
    t.kv_len = at;
    t.pairs = block_pairs(a, at);
  }
  const double w = tile_work(plan, m, tail);
  if (m.active()) {  // the head keeps its own fixed costs: its work anew
    const double head = tile_work(plan, m, t);
    placer.shrink(k, gt.load[k] - head);
    gt.load[k] = head;
  } else {
    gt.load[k] -= w;
    placer.shrink(k, w);
  }
  const i64 owner = gt.owner[k];
  gt.push(tail, owner, tail_doc, w);  // (t is not used after this: push may move the tiles)
  placer.add_tile();
  return gt.size() - 1;
}

// Best tail cut of a tile on member hi towards member lo (see the refinement): the last rows of
// a one-document tile, or the last documents of a multi-document tile.
Cut best_cut(const StepPlan& plan, const CostModel& m, const GroupTiles& gt, const Placer& placer,
             const std::vector<std::size_t>& on_hi, i64 hi, i64 lo, const std::vector<double>& load,
             double min_gain, i64 min_rows) {
  Cut best{gt.size()};
  const double want = (load[hi] - load[lo]) / 2.0;
  auto consider = [&](std::size_t k, i64 c, double w, i64 bytes_doc, i64 q_len, i64 kv_len) {
    const double new_max = std::max(load[hi] - w, load[lo] + w);
    if (!(new_max < load[hi] - min_gain)) return;
    if (best.k != gt.size() && new_max > best.new_max) return;
    const i64 bytes = placer.increment_at(k, lo, bytes_doc, q_len, kv_len);
    if (best.k == gt.size() || new_max < best.new_max || bytes < best.bytes)
      best = Cut{k, c, w, new_max, bytes};
  };
  for (std::size_t k : on_hi) {
    // a tile no heavier than half the gap would have moved whole: only heavier ones are cut
    if (!(gt.load[k] > want)) continue;
    const StepPlan::Tile& t = gt.tile[k];
    const double hc = static_cast<double>(t.head_count);
    if (t.doc_count > 1) {  // whole documents from the end until half the gap is reached
      double acc = 0;
      i64 tail = 0;
      for (i64 i = t.doc_count - 1; i >= 1; --i) {
        const i64 l = plan.doc_lengths[t.doc + i];
        const double prev = acc;
        acc += doc_work(m, l, t.head_count);
        tail += l;
        if (acc >= want || i == 1) {
          consider(k, i, acc, gt.local_doc[k] + i, tail, tail);
          if (i + 1 <= t.doc_count - 1)
            consider(k, i + 1, prev, gt.local_doc[k] + i + 1, tail - l, tail - l);
          break;
        }
      }
      continue;
    }
    if (t.q_len < 2 * min_rows) continue;
    const i64 a = t.q_start - t.kv_start, b = a + t.q_len;
    const i64 h = t.head_count;
    i64 c;
    if (m.active()) {
      c = m.tail_start(a + min_rows, b - min_rows, b, h, want);
    } else {
      // smallest c with pairs(c, b) * hc <= want: c(c+1) >= b(b+1) - 2 want / hc
      const double x = static_cast<double>(b) * static_cast<double>(b + 1) - 2.0 * want / hc;
      c = static_cast<i64>(std::ceil((-1.0 + std::sqrt(1.0 + 4.0 * std::max(0.0, x))) / 2.0));
      c = std::min(std::max(c, a + min_rows), b - min_rows);
      while (c > a + min_rows && rows_work(m, c - 1, b, h) <= want) --c;
      while (c < b - min_rows && rows_work(m, c, b, h) > want) ++c;
    }
    for (i64 cc : {c, c - 1}) {  // just under and just over half the gap
      if (cc < a + min_rows || cc > b - min_rows) continue;
      consider(k, cc, rows_work(m, cc, b, h), gt.local_doc[k], b - cc, b);
    }
  }
  return best;
}

void make_group_tiles(const StepPlan& plan, const CostModel& m, const std::vector<i64>& members,
                      const std::vector<double>& seq_work, i64 block, i64 head_group,
                      double max_tile_share, GroupTiles& gt, i64& n_docs) {
  gt.clear();
  n_docs = 0;
  double total = 0;  // the group's load, to size the largest tile against the member mean
  for (i64 s : members) total += seq_work[s];
  const double max_load = max_tile_share * total / static_cast<double>(members.size());
  double all = 0;
  for (std::size_t i = 0; i < members.size(); ++i) {
    const i64 first_doc = plan.seq_doc_offsets[members[i]];
    double own = 0;
    gt.first.push_back(gt.size());
    sequence_tiles(plan, m, members[i], block, head_group, max_load,
                   [&](const StepPlan::Tile& t, double w) {
      // (a table's price as sequence_tiles made it; pairs always anew, as before)
      gt.push(t, static_cast<i64>(i), n_docs + t.doc - first_doc,
              m.active() && w != kUnpriced ? w : tile_work(plan, m, t));
      own += gt.load.back();
      all += gt.load.back();
    });
    gt.own.push_back(own);
    n_docs += plan.seq_doc_offsets[members[i] + 1] - first_doc;
  }
  gt.first.push_back(gt.size());
  gt.total = all;
}

// What one worker reuses from group to group (capacity kept, contents reset per group).
struct GroupScratch {
  GroupTiles gt;
  std::vector<i64> doc_slot;  // residency rows (see Residency)
  std::vector<std::pair<double, std::size_t>> order;
  std::vector<std::size_t> rest;
  std::vector<std::vector<std::size_t>> on;
  std::vector<std::size_t> pieces;  // contiguous_pieces: tiles of documents with a moved tile
  std::vector<i64> moved_docs;
  std::vector<char> dead;
  std::vector<i64> runs, members, ends, cut;  // contiguous_pieces: one document's re-cut
  std::vector<double> work;
  std::size_t last_count = 0;  // tiles of the previous group
};

// Pass 1: owners keep their own tiles while under the soft cap, least work per byte first
// (early query blocks and short documents stay; late blocks of long documents, the cheapest
// work to ship, are the ones left over). Only a member's own tiles count against its cap here,
// so each member's tiles (contiguous, as make_group_tiles emits them) are taken on their own;
// a member whose tiles all fit keeps them without ordering them. The tiles left over go to
// scratch.rest.
void keep_own_tiles(const StepPlan& plan, const TileBytes& bytes, i64 P, double cap,
                    GroupScratch& scratch, Placer& placer) {
  GroupTiles& gt = scratch.gt;
  auto& load = placer.load();
  auto& order = scratch.order;  // (work per byte, tile)
  auto& rest = scratch.rest;
  rest.clear();
  for (i64 i = 0; i < P; ++i) {
    const std::size_t first = gt.first[i], last = gt.first[i + 1];
    if (gt.own[i] <= cap) {
      placer.keep(first, last, i, gt.own[i]);
      continue;
    }
    order.clear();
    for (std::size_t k = first; k < last; ++k) {
      const StepPlan::Tile& t = gt.tile[k];
      const KvHeads kv = kv_heads_of(plan, t);
      order.push_back({gt.load[k] / static_cast<double>(
                                        bytes.qo_bytes(t.q_len, t.head_count) +
                                        (kv.last - kv.first + 1) * bytes.kv_bytes(t.kv_len)),
                       k});
    }
    std::sort(order.begin(), order.end());
    for (const auto& [per_byte, k] : order) {
      if (load[gt.owner[k]] + gt.load[k] <= cap) {
        placer.assign(k, gt.owner[k]);
      } else {
        rest.push_back(k);
      }
    }
  }
}

// Pass 2, heaviest first: among members that stay under the cap, the smallest byte increment
// (KV prefixes already shipped there are not sent twice), then the lightest; if none stays
// under, the lightest member.
void place_rest(i64 P, double cap, GroupScratch& scratch, Placer& placer) {
  GroupTiles& gt = scratch.gt;
  auto& load = placer.load();
  auto& rest = scratch.rest;
  std::sort(rest.begin(), rest.end(), [&](std::size_t a, std::size_t b) {
    return gt.load[a] != gt.load[b] ? gt.load[a] > gt.load[b] : a < b;
  });
  for (std::size_t k : rest) {
    const double w = gt.load[k];
    i64 best = -1;
    i64 best_inc = 0;
    for (i64 j = 0; j < P; ++j) {
      if (load[j] + w > cap) continue;
      const i64 inc = placer.increment(k, j);
      if (best < 0 || inc < best_inc || (inc == best_inc && load[j] < load[best])) {
        best = j;
        best_inc = inc;
      }
    }
    if (best < 0) {
      for (i64 j = 0; j < P; ++j) {
        if (best < 0 || load[j] < load[best]) {
          best = j;
          best_inc = placer.increment(k, j);
        } else if (load[j] == load[best]) {
          const i64 inc = placer.increment(k, j);
          if (inc < best_inc) {
            best = j;
            best_inc = inc;
          }
        }
      }
    }
    placer.assign(k, best);
  }
}

// Whole documents are too coarse to move: give the heaviest document of a multi-document tile
// on hi that is heavier than half the gap (and long enough to cut) a tile of its own, so that
// the next refinement round can cut its rows. Returns false when there is none.
bool isolate_heavy_document(const StepPlan& plan, const CostModel& m, GroupTiles& gt, Placer& placer,
                            std::vector<std::size_t>& on_hi, i64 hi, double want, i64 min_rows) {
  const std::size_t n = gt.size();
  std::size_t pk = n;
  i64 pi = 0;
  double pw = 0;
  for (std::size_t k : on_hi) {
    const StepPlan::Tile& t = gt.tile[k];
    if (t.doc_count < 2 || !(gt.load[k] > want)) continue;
    for (i64 i = 0; i < t.doc_count; ++i) {
      const i64 l = plan.doc_lengths[t.doc + i];
      const double w = doc_work(m, l, t.head_count);
      if (l >= 2 * min_rows && w > want && w > pw) {
        pk = k;
        pi = i;
        pw = w;
      }
    }
  }
  if (pk == n) return false;
  // tile pk keeps the documents before pi (or document pi alone when pi == 0); new tiles take
  // document pi and the documents after it, all still on hi
  std::vector<std::size_t> fresh;
  if (pi > 0) fresh.push_back(split_tail(plan, m, gt, placer, pk, pi));
  const std::size_t single = pi > 0 ? fresh.back() : pk;
  if (gt.tile[single].doc_count > 1) fresh.push_back(split_tail(plan, m, gt, placer, single, 1));
  for (const std::size_t k : fresh) {
    placer.assign(k, hi);
    on_hi.push_back(k);
  }
  return true;
}

// Refinement: move one tile from the most loaded member to the least loaded one while that
// lowers the pair's maximum by more than kRefineMinGain of the mean (a move that gains less is
// not worth its bytes); among such tiles the lowest new maximum, then fewest bytes. When no
// whole tile helps, cut rows off one (best_cut), or isolate a heavy document for the next
// round.
void refine_group(const StepPlan& plan, const PlanOptions& opt, i64 P, double total,
                  GroupScratch& scratch, Placer& placer) {
  GroupTiles& gt = scratch.gt;
  auto& load = placer.load();
  const i64 limit = opt.max_refine_moves > 0 ? opt.max_refine_moves : 64 * P;
  const double min_gain = kRefineMinGain * total / static_cast<double>(P);
  const i64 min_rows = min_split_rows(plan.context);
  auto& exec = placer.exec();
  auto& on = scratch.on;
  std::size_t n = gt.size();
  on.resize(static_cast<std::size_t>(P));
  for (auto& tiles : on) tiles.clear();
  for (std::size_t k = 0; k < n; ++k) on[exec[k]].push_back(k);  // ascending tile order
  for (i64 moves = 0; moves < limit; ++moves) {
    const i64 hi = std::max_element(load.begin(), load.end()) - load.begin();
    const i64 lo = std::min_element(load.begin(), load.end()) - load.begin();
    // any move leaves the pair's maximum at least half the gap below load[hi]: when that is
    // no gain worth a move, nothing (whole tile, cut or isolated document) can help
    if (hi == lo || !((load[hi] - load[lo]) / 2.0 > min_gain)) break;
    std::size_t pick = n, pick_pos = 0;
    double pick_max = 0.0;
    i64 pick_inc = 0;
    for (std::size_t pos = 0; pos < on[hi].size(); ++pos) {
      const std::size_t k = on[hi][pos];
      const double w = gt.load[k];
      const double new_max = std::max(load[hi] - w, load[lo] + w);
      if (!(new_max < load[hi] - min_gain) || (pick != n && new_max > pick_max)) continue;
      const i64 inc = placer.increment(k, lo);  // only for a new best or a tie
      if (pick == n || new_max < pick_max || inc < pick_inc) {
        pick = k;
        pick_pos = pos;
        pick_max = new_max;
        pick_inc = inc;
      }
    }
    if (pick != n) {
      placer.assign(pick, lo);
      on[hi].erase(on[hi].begin() + static_cast<std::ptrdiff_t>(pick_pos));
      on[lo].insert(std::upper_bound(on[lo].begin(), on[lo].end(), pick), pick);
      continue;
    }
    // No whole tile lowers the maximum: cut the tail rows [c, b) off a one-document tile on
    // hi so that about half the gap moves to lo (pieces keep min_rows rows); the lowest new
    // maximum, then fewest bytes, then the earliest tile.
    const Cut cut = best_cut(plan, opt.cost, gt, placer, on[hi], hi, lo, load, min_gain, min_rows);
    if (cut.k == n) {
      if (!isolate_heavy_document(plan, opt.cost, gt, placer, on[hi], hi,
                                  (load[hi] - load[lo]) / 2.0, min_rows))
        break;
      n = gt.size();
      continue;
    }
    const std::size_t piece = split_tail(plan, opt.cost, gt, placer, cut.k, cut.c);
    placer.assign(piece, lo);
    on[lo].push_back(piece);  // the newest tile: the highest index
    n = gt.size();
  }
}

// Contiguous pieces: where the placement left a document's rows (one head range) fragmented -
// the owner keeping rows after moved ones, or a member running several separate blocks - the
// document's rows are re-cut so that each member runs one contiguous piece with the same work
// it had: the owner the first rows [0, c1), then the executors in order of the longest prefix
// they read (ties by member). Loads stay as placed up to whole rows; the owner's kept rows run
// in place (no local pack) and each executor's piece is one unit (its stream goes direct).
// Applied only where the document's tiles cover all its rows in that head range and the
// re-cut ships no more bytes (Q/O of the moved rows, K/V of each executor's prefix).
// Only documents with a moved tile can be fragmented: their tiles are taken in (local document,
// head start, head count, first row, tile index) order.
void contiguous_pieces(const StepPlan& plan, const CostModel& m, const TileBytes& bytes,
                       GroupScratch& scratch, Placer& placer) {
  GroupTiles& gt = scratch.gt;
  const std::size_t n = gt.size();
  auto& exec = placer.exec();
  auto& load = placer.load();
  auto& docs = scratch.moved_docs;  // the local documents with a moved tile, ascending
  docs.clear();
  for (std::size_t k = 0; k < n; ++k)
    if (gt.tile[k].doc_count == 1 && exec[k] != gt.owner[k]) docs.push_back(gt.local_doc[k]);
  if (docs.empty()) return;
  std::sort(docs.begin(), docs.end());
  docs.erase(std::unique(docs.begin(), docs.end()), docs.end());
  auto& idx = scratch.pieces;  // their one-document tiles
  idx.clear();
  for (std::size_t k = 0; k < n; ++k)
    if (gt.tile[k].doc_count == 1 &&
        std::binary_search(docs.begin(), docs.end(), gt.local_doc[k]))
      idx.push_back(k);
  std::sort(idx.begin(), idx.end(), [&](std::size_t x, std::size_t y) {
    const StepPlan::Tile &a = gt.tile[x], &b = gt.tile[y];
    return std::tie(gt.local_doc[x], a.head_start, a.head_count, a.q_start, x) <
           std::tie(gt.local_doc[y], b.head_start, b.head_count, b.q_start, y);
  });
  auto& dead = scratch.dead;
  dead.assign(n, 0);
  bool any = false;
  auto &runs = scratch.runs, &order = scratch.members, &ends = scratch.ends, &cut = scratch.cut;
  auto& work = scratch.work;
  for (std::size_t i = 0; i < idx.size();) {
    const StepPlan::Tile& t0 = gt.tile[idx[i]];
    std::size_t j = i + 1;
    while (j < idx.size() && gt.local_doc[idx[j]] == gt.local_doc[idx[i]] &&
           gt.tile[idx[j]].head_start == t0.head_start &&
           gt.tile[idx[j]].head_count == t0.head_count)
      ++j;
    const std::size_t first = i;
    i = j;
    if (j - first < 2) continue;
    // the tiles must cover the document's rows [0, l) in order
    const i64 l = plan.doc_lengths[t0.doc];
    i64 row = 0;
    bool covers = true;
    for (std::size_t r = first; r < j && covers; ++r) {
      const StepPlan::Tile& t = gt.tile[idx[r]];
      covers = t.q_start - t.kv_start == row && t.q_len > 0;
      row += t.q_len;
    }
    if (!covers || row != l) continue;
    // members along the rows, as runs; fragmented: a member in two runs, or the owner's run
    // not first
    const i64 owner = gt.owner[idx[first]];
    runs.clear();
    for (std::size_t r = first; r < j; ++r)
      if (runs.empty() || runs.back() != exec[idx[r]]) runs.push_back(exec[idx[r]]);
    bool fragmented = false;
    for (std::size_t a = 0; a < runs.size() && !fragmented; ++a) {
      if (runs[a] == owner && a > 0) fragmented = true;
      for (std::size_t b = a + 1; b < runs.size() && !fragmented; ++b)
        fragmented = runs[a] == runs[b];
    }
    if (!fragmented) continue;
    // each member's work (summed in row order) and the longest prefix it reads
    const i64 P = static_cast<i64>(load.size());
    work.assign(static_cast<std::size_t>(P), 0.0);
    ends.assign(static_cast<std::size_t>(P), -1);
    i64 before = 0;
    const KvHeads kv = kv_heads_of(plan, t0);
    const i64 kv_n = kv.last - kv.first + 1;
    for (std::size_t r = first; r < j; ++r) {
      const std::size_t k = idx[r];
      const StepPlan::Tile& t = gt.tile[k];
      work[exec[k]] += gt.load[k];
      ends[exec[k]] = std::max(ends[exec[k]], t.kv_len);
      if (exec[k] != owner) before += bytes.qo_bytes(t.q_len, t.head_count);
    }
    order.clear();
    if (ends[owner] >= 0) order.push_back(owner);
    for (i64 e = 0; e < P; ++e)
      if (e != owner && ends[e] >= 0) {
        before += kv_n * bytes.kv_bytes(ends[e]);
        order.push_back(e);
      }
    std::stable_sort(order.begin() + (ends[owner] >= 0 ? 1 : 0), order.end(),
                     [&](i64 x, i64 y) { return ends[x] < ends[y]; });
    // piece boundaries: the row whose prefix work is nearest each cumulative target
    const i64 hc = t0.head_count;
    auto prefix = [&](i64 c) { return rows_work(m, 0, c, hc); };
    double total = 0;
    for (const i64 e : order) total += work[e];
    const double scale = m.active() ? prefix(l) / total : 1.0;
    cut.assign(order.size() + 1, 0);
    cut.back() = l;
    double target = 0;
    bool ok = true;
    for (std::size_t p = 0; p + 1 < order.size() && ok; ++p) {
      target += work[order[p]];
      const double want = target * scale;
      i64 lo = cut[p] + 1, hi = l - static_cast<i64>(order.size() - 1 - p);
      if (lo > hi) {
        ok = false;
        break;
      }
      // the smallest c with prefix(c) >= want (hi if none): a table's inverted in O(log bins)
      if (m.active()) {
        lo = m.prefix_end(lo, hi, hc, want);
      } else {
        while (lo < hi) {
          const i64 mid = lo + (hi - lo) / 2;
          if (prefix(mid) >= want) hi = mid; else lo = mid + 1;
        }
      }
      i64 c = lo;
      if (c > cut[p] + 1 && want - prefix(c - 1) <= prefix(c) - want) --c;
      cut[p + 1] = c;
    }
    if (!ok) continue;
    i64 after = 0;
    for (std::size_t p = 0; p < order.size(); ++p)
      if (order[p] != owner)
        after += bytes.qo_bytes(cut[p + 1] - cut[p], hc) + kv_n * bytes.kv_bytes(cut[p + 1]);
    if (after > before) continue;
    // the first tiles (in row order) become the pieces, the rest are dropped
    for (std::size_t r = first; r < j; ++r) load[exec[idx[r]]] -= gt.load[idx[r]];
    for (std::size_t p = 0; p < order.size(); ++p) {
      const std::size_t k = idx[first + p];
      StepPlan::Tile& t = gt.tile[k];
      t.q_start = t.kv_start + cut[p];
      t.q_len = cut[p + 1] - cut[p];
      t.kv_len = cut[p + 1];
      t.pairs = block_pairs(cut[p], cut[p + 1]);
      gt.load[k] = tile_work(plan, m, t);
      exec[k] = order[p];
      load[order[p]] += gt.load[k];
    }
    for (std::size_t r = first + order.size(); r < j; ++r) dead[idx[r]] = 1;
    any = true;
  }
  if (!any) return;
  std::size_t w = static_cast<std::size_t>(std::find(dead.begin(), dead.end(), 1) - dead.begin());
  for (std::size_t k = w; k < n; ++k) {
    if (dead[k]) continue;
    gt.tile[w] = gt.tile[k];
    gt.owner[w] = gt.owner[k];
    gt.local_doc[w] = gt.local_doc[k];
    gt.load[w] = gt.load[k];
    exec[w] = exec[k];
    ++w;
  }
  gt.tile.resize(w);
  gt.owner.resize(w);
  gt.local_doc.resize(w);
  gt.load.resize(w);
  exec.resize(w);
}

// Each tile's executor, as a replica id: the placement's, or, when the owners' own loads have a
// lighter maximum (never worse than no moves), every tile on its owner.
void settle_executors(const StepPlan& plan, const std::vector<i64>& members, i64 P,
                      GroupTiles& gt, Placer& placer) {
  const std::size_t n = gt.size();
  std::vector<double> own(static_cast<std::size_t>(P), 0.0);
  for (std::size_t k = 0; k < n;) {  // each owner's loads in tile order (its tiles come in runs)
    const i64 m = gt.owner[k];
    double sum = own[m];
    for (; k < n && gt.owner[k] == m; ++k) sum += gt.load[k];
    own[m] = sum;
  }
  auto& load = placer.load();
  const bool keep_owners = *std::max_element(own.begin(), own.end()) <
                           *std::max_element(load.begin(), load.end());
  for (std::size_t k = 0; k < n; ++k) {
    const i64 member = keep_owners ? gt.owner[k] : placer.exec()[k];
    gt.tile[k].executor = plan.seq_replica[members[member]];
  }
}

// TAP on one group: the tiles of its members' sequences with their executors set, into `out`
// (empty on entry). The tiles are built in `out`'s own buffer, reserved a quarter above the
// previous group's count, so that they are never copied out of the scratch.
void place_group(const StepPlan& plan, const PlanOptions& opt, i64 head_group,
                 const std::vector<i64>& members, const std::vector<double>& seq_work,
                 GroupScratch& scratch, std::vector<StepPlan::Tile>& out) {
  const TileBytes bytes{plan.head_dim, plan.dtype_bytes};
  const i64 P = static_cast<i64>(members.size());
  i64 n_docs = 0;
  GroupTiles& gt = scratch.gt;
  std::vector<i64>& doc_slot = scratch.doc_slot;
  out.reserve(scratch.last_count + scratch.last_count / 4 + 16);
  gt.tile.swap(out);
  struct GiveBack {  // the tiles go to `out` however this returns
    std::vector<StepPlan::Tile>& a;
    std::vector<StepPlan::Tile>& b;
    std::size_t& count;
    ~GiveBack() {
      count = b.size();
      a.swap(b);
    }
  } give_back{out, gt.tile, scratch.last_count};
  make_group_tiles(plan, opt.cost, members, seq_work, opt.block, head_group, opt.max_tile_share, gt,
                   n_docs);
  if (gt.size() == 0) return;
  const double total = gt.total;
  const double cap = (1.0 + opt.epsilon) * total / static_cast<double>(P);
  if (static_cast<i64>(doc_slot.size()) < n_docs) doc_slot.resize(static_cast<std::size_t>(n_docs), -1);
  Placer placer(plan, bytes, gt, P, doc_slot);
  keep_own_tiles(plan, bytes, P, cap, scratch, placer);
  place_rest(P, cap, scratch, placer);
  if (opt.refine && P > 1) refine_group(plan, opt, P, total, scratch, placer);
  if (P > 1) contiguous_pieces(plan, opt.cost, bytes, scratch, placer);
  settle_executors(plan, members, P, gt, placer);
}

}  // namespace

void owner_tiles(StepPlan& plan, i64 block) {
  for (i64 s = 0; s < plan.n_seq(); ++s)
    sequence_tiles(plan, CostModel{}, s, block, plan.heads_local, 0.0,
                   [&](const StepPlan::Tile& t, double) { plan.add_tile(t); });
}

void tap_place(const StepPlan& plan, const PlanOptions& opt,
               const std::vector<std::vector<i64>>& groups, const std::vector<double>& seq_work,
               std::size_t workers, const GroupPlaced& placed) {
  const i64 head_group = opt.head_group > 0 ? std::min(opt.head_group, plan.heads_local)
                                            : plan.heads_local;
  // Groups are independent: workers take them in turn; what a group gets does not depend on
  // which worker places it.
  run_workers(workers, groups.size(), [&](WorkQueue& queue) {
    GroupScratch scratch;
    GroupTileList tiles;
    for (std::size_t g; queue.take(g);) {
      tiles.clear();
      place_group(plan, opt, head_group, groups[g], seq_work, scratch, tiles);
      placed(g, tiles, scratch.gt.load);
    }
  });
}

namespace {

// Query rows [a, b) of a document (first token `off` in its sequence) that member `owner` holds
// and member `exec` runs: a DistCA shard.
struct RowShard {
  i64 seq, doc, off, a, b, owner, exec;
};

// A slot's shards as tiles (all heads of the slice), in (sequence, document, first row) order.
void push_row_shards(StepPlan& plan, const std::vector<i64>& members, std::vector<RowShard>& shards) {
  std::stable_sort(shards.begin(), shards.end(), [](const RowShard& x, const RowShard& y) {
    return x.seq != y.seq ? x.seq < y.seq : (x.doc != y.doc ? x.doc < y.doc : x.a < y.a);
  });
  for (const RowShard& sh : shards)
    push_tile(plan, sh.seq, sh.doc, sh.off, sh.a, sh.b, 0, plan.heads_local,
              plan.seq_replica[members[sh.owner]], plan.seq_replica[members[sh.exec]]);
}

// DistCA's recipients: the members below the mean (negative surplus), largest deficit first,
// ties by member.
std::vector<i64> recipients_by_deficit(const std::vector<double>& surplus) {
  std::vector<i64> recipients;
  for (std::size_t i = 0; i < surplus.size(); ++i)
    if (surplus[i] < 0) recipients.push_back(static_cast<i64>(i));
  std::stable_sort(recipients.begin(), recipients.end(),
                   [&](i64 x, i64 y) { return surplus[x] < surplus[y]; });
  return recipients;
}

}  // namespace

void distca_place(StepPlan& plan, const PlanOptions& opt,
                  const std::vector<std::vector<i64>>& groups) {
  const TileBytes bytes{plan.head_dim, plan.dtype_bytes};
  const double hl = static_cast<double>(plan.heads_local);
  for (const auto& members : groups) {
    const i64 P = static_cast<i64>(members.size());
    // Shards: one per document to start with; split on demand.
    using Shard = RowShard;
    std::vector<Shard> shards;
    std::vector<double> load(static_cast<std::size_t>(P), 0.0);
    for (i64 i = 0; i < P; ++i) {
      const i64 s = members[i];
      i64 off = 0;
      for (i64 doc = plan.seq_doc_offsets[s]; doc < plan.seq_doc_offsets[s + 1]; ++doc) {
        const i64 l = plan.doc_lengths[doc];
        shards.push_back({s, doc, off, 0, l, i, i});
        load[i] += doc_work(opt.cost, l, plan.heads_local);
        off += l;
      }
    }
    const double mean = std::accumulate(load.begin(), load.end(), 0.0) / static_cast<double>(P);
    // Residency of KV prefixes shipped to each member: document -> longest prefix (only the
    // documents shipped there have an entry).
    std::vector<std::unordered_map<i64, i64>> resident(static_cast<std::size_t>(P));
    auto kv_have = [&](i64 member, i64 doc) -> i64 {
      const auto it = resident[member].find(doc);
      return it == resident[member].end() ? 0 : it->second;
    };
    // Rows [c, b) of a shard hold at most `amount` of work: the smallest such c (b if not even
    // the last row fits).
    const CostModel& m = opt.cost;
    const i64 H = plan.heads_local;
    auto cut_for = [&](const Shard& sh, double amount) {
      i64 c;
      if (!m.active()) {
        const double x = static_cast<double>(sh.b) * static_cast<double>(sh.b + 1) - 2.0 * amount / hl;
        c = static_cast<i64>(std::ceil((-1.0 + std::sqrt(1.0 + 4.0 * std::max(0.0, x))) / 2.0));
        c = std::min(std::max(c, sh.a), sh.b);
      } else {  // the smallest c in [a, b - 1] whose rows [c, b) are within amount, by halving
        i64 lo_c = sh.a, hi_c = sh.b;
        while (lo_c < hi_c) {
          const i64 mid = lo_c + (hi_c - lo_c) / 2;
          if (mid < sh.b && rows_work(m, mid, sh.b, H) <= amount) hi_c = mid; else lo_c = mid + 1;
        }
        c = lo_c;
      }
      while (c < sh.b && rows_work(m, c, sh.b, H) > amount) ++c;
      while (c > sh.a && rows_work(m, c - 1, sh.b, H) <= amount) --c;
      return c;
    };
    // Bytes of sending rows [c, b) of a shard to dst: Q/O of the rows, K/V of the prefix [0, b)
    // not yet resident there.
    auto move_bytes = [&](const Shard& sh, i64 c, i64 dst) -> i64 {
      if (dst == sh.owner) return 0;
      const i64 kv_missing = std::max<i64>(0, sh.b - kv_have(dst, sh.doc));
      return bytes.qo_bytes(sh.b - c, plan.heads_local) +
             bytes.kv_bytes(kv_missing) * plan.kv_heads_local;
    };
    // DistCA's communication-aware greedy: recipients in order of deficit (largest first); each
    // takes work while its deficit exceeds tolerance * mean, from the shard on a member with
    // surplus whose move costs the fewest bytes per unit of work, split to exactly what the
    // recipient still needs and the donor can spare (whole rows). When the best candidate
    // cannot give even one row, that recipient is done and the next one is served.
    std::vector<double> surplus(static_cast<std::size_t>(P));
    for (i64 i = 0; i < P; ++i) surplus[i] = load[i] - mean;
    const std::vector<i64> recipients = recipients_by_deficit(surplus);
    const double threshold = opt.distca_tolerance * mean;
    for (const i64 lo : recipients) {
      double need = -surplus[lo];
      for (i64 guard = 0; need > threshold && guard < 4 * static_cast<i64>(shards.size()) + 8 * P;
           ++guard) {
        std::size_t pick = shards.size();
        double pick_cost = 0, pick_amount = 0;
        i64 pick_cut = 0;
        for (std::size_t k = 0; k < shards.size(); ++k) {
          const Shard& sh = shards[k];
          if (sh.a >= sh.b || !(surplus[sh.exec] > 0)) continue;
          const double work = rows_work(m, sh.a, sh.b, H);
          const double amount = std::min({surplus[sh.exec], need, work});
          const i64 c = cut_for(sh, amount);
          const double moved = c < sh.b ? rows_work(m, c, sh.b, H) : 0.0;
          // bytes per unit of work the recipient can get (a shard that cannot give a row
          // ranks last: the greedy stops for this recipient if it is the best there is)
          const double cost = moved > 0 ? static_cast<double>(move_bytes(sh, c, lo)) / moved
                                        : std::numeric_limits<double>::infinity();
          if (pick == shards.size() || cost < pick_cost) {
            pick = k;
            pick_cost = cost;
            pick_amount = moved;
            pick_cut = c;
          }
        }
        if (pick == shards.size() || !(pick_amount > 0)) break;
        const Shard sh = shards[pick];
        const i64 from = sh.exec;
        load[from] -= pick_amount;
        load[lo] += pick_amount;
        surplus[from] -= pick_amount;
        surplus[lo] += pick_amount;
        need -= pick_amount;
        if (lo != sh.owner) {
          i64& have = resident[lo][sh.doc];
          have = std::max(have, sh.b);
        }
        if (pick_cut == sh.a) {
          shards[pick].exec = lo;
        } else {
          shards[pick].b = pick_cut;
          Shard tail = sh;
          tail.a = pick_cut;
          tail.exec = lo;
          shards.push_back(tail);
        }
      }
    }
    push_row_shards(plan, members, shards);
  }
}

// DistCA as deployed (`distca_server = gpu`): every GPU an attention server, DistCA's planner's
// decisions (hao-ai-lab/distca, `Planner.plan_items`), for layouts where a GPU is a replica
// (cp 1; checked by the caller). Each slot on its own: pieces start as whole documents on their
// owners, in replica order; recipients are the GPUs below the mean, largest deficit first (ties
// by GPU); a recipient takes work while its deficit exceeds tolerance * mean, from the piece on
// a GPU with surplus (list order, pieces split off appended) with the lowest priority - the
// bytes of its share of query rows and its document's whole KV per unit of work it can give,
// min(donor's surplus, need, its work) - which moves whole if it can, else gives
// m = floor(amount / (l + 1)) rows from each end of its head and tail (a whole document first
// becomes its two halves); no row: that recipient is done. Work per part: causal pairs.
void distca_gpu_place(StepPlan& plan, const PlanOptions& opt,
                      const std::vector<std::vector<i64>>& groups) {
  const double hidden = static_cast<double>(plan.heads_local * plan.head_dim);
  const i64 kv_hidden = plan.kv_heads_local * plan.head_dim;
  auto pairs = [](i64 q, i64 kv) { return block_pairs(kv - q, kv); };  // q rows ending at kv
  struct Piece {
    i64 seq, doc, off, len, owner, exec;  // owner / exec: member index
    i64 hq, hk, tq, tk;                   // head rows [hk - hq, hk), tail rows [tk - tq, tk)
    bool whole;
    double work;
  };
  for (const auto& members : groups) {
    const i64 P = static_cast<i64>(members.size());
    std::vector<Piece> pieces;
    std::vector<double> load(static_cast<std::size_t>(P), 0.0);
    for (i64 i = 0; i < P; ++i) {
      const i64 s = members[i];
      i64 off = 0;
      for (i64 doc = plan.seq_doc_offsets[s]; doc < plan.seq_doc_offsets[s + 1]; ++doc) {
        const i64 l = plan.doc_lengths[doc];
        const double w = static_cast<double>(causal_pairs(l));
        pieces.push_back({s, doc, off, l, i, i, l, l, 0, 0, true, w});
        load[i] += w;
        off += l;
      }
    }
    const double mean = std::accumulate(load.begin(), load.end(), 0.0) / static_cast<double>(P);
    std::vector<double> surplus(static_cast<std::size_t>(P));
    for (i64 i = 0; i < P; ++i) surplus[i] = load[i] - mean;
    const std::vector<i64> recipients = recipients_by_deficit(surplus);
    const double threshold = mean * opt.distca_tolerance;
    for (const i64 r : recipients) {
      double need = -surplus[r];
      while (need > threshold) {
        if (std::none_of(surplus.begin(), surplus.end(), [](double x) { return x > 0; })) break;
        std::size_t pick = pieces.size();
        double pick_prio = 0;
        for (std::size_t k = 0; k < pieces.size(); ++k) {
          const Piece& pc = pieces[k];
          if (!(surplus[pc.exec] > 0) || !(pc.work > 0)) continue;
          const double best = std::min(std::min(surplus[pc.exec], need), pc.work);
          const double q_len = best / static_cast<double>(pc.len + 1);
          const double comm = q_len * hidden + static_cast<double>(2 * (pc.len + 1) * kv_hidden);
          const double prio = comm / best;
          if (pick == pieces.size() || prio < pick_prio) {
            pick = k;
            pick_prio = prio;
          }
        }
        if (pick == pieces.size()) break;
        Piece& pc = pieces[pick];
        const double amount = std::min(std::min(need, pc.work), surplus[pc.exec]);
        const i64 donor = pc.exec;
        double moved;
        if (amount >= pc.work) {  // the whole piece moves
          moved = pc.work;
          pc.exec = r;
        } else {
          i64 m = static_cast<i64>(amount / static_cast<double>(pc.len + 1));
          if (m <= 0) break;
          if (pc.whole) {  // a whole document becomes its head and tail halves
            const i64 q = pc.hq;
            pc.hq = pc.hk = (q + 1) / 2;
            pc.tq = q / 2;
            pc.tk = q;
            pc.whole = false;
          }
          m = std::min({m, pc.hq, pc.tq});
          if (m <= 0) break;
          const double before = pc.work;
          pc.hq -= m;
          pc.hk -= m;
          pc.tq -= m;
          Piece cut = pc;  // rows [hk, hk + m) of the head's end, [tk - tq - m, tk - tq) of the tail's start
          cut.exec = r;
          cut.hq = m;
          cut.hk = pc.hk + m;
          cut.tq = m;
          cut.tk = pc.tk - pc.tq;
          pc.work = static_cast<double>(pairs(pc.hq, pc.hk) + pairs(pc.tq, pc.tk));
          cut.work = static_cast<double>(pairs(cut.hq, cut.hk) + pairs(cut.tq, cut.tk));
          moved = before - pc.work;
          pieces.push_back(cut);  // (pc is not used past this point)
        }
        if (!(moved > 0)) break;
        surplus[donor] -= moved;
        surplus[r] += moved;
        need -= moved;
      }
    }
    std::vector<RowShard> rows;
    for (const Piece& pc : pieces) {
      if (pc.hq > 0) rows.push_back({pc.seq, pc.doc, pc.off, pc.hk - pc.hq, pc.hk, pc.owner, pc.exec});
      if (pc.tq > 0) rows.push_back({pc.seq, pc.doc, pc.off, pc.tk - pc.tq, pc.tk, pc.owner, pc.exec});
    }
    push_row_shards(plan, members, rows);
  }
}

}  // namespace libra
