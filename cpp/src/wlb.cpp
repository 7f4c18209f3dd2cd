#include "libra/wlb.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "libra/plan.h"
#include "libra/workload.h"

namespace libra {

namespace {

using Doc = PlannerState::Doc;

// Refuse a step that would overflow the state's counters, or whose held documents came from a
// step of more input sequences than this one has.
void check_step(const PlannerState& state, const SequencesView& sequences) {
  const i64 n_new = static_cast<i64>(sequences.n_lengths);
  if (state.next_doc_id > kMaxDocId - n_new)
    fail("planner state: next_doc_id " + std::to_string(state.next_doc_id) + " + this step's " +
         std::to_string(n_new) + " documents would pass 2^62");
  if (state.steps >= kMaxDocId)
    fail("planner state: steps " + std::to_string(state.steps) + " would pass 2^62");
  i64 i = 0;  // held documents came from a step of as many sequences as this one
  for (const auto* list : {&state.queue, &state.spill})
    for (const Doc& d : *list) {
      if (d.origin >= static_cast<i64>(sequences.size()))
        fail(field_at("planner state entry", i) + ": input sequence " +
             std::to_string(d.origin) + " is not below the step's " +
             std::to_string(sequences.size()) + " sequences");
      ++i;
    }
}

void heaviest_first(std::vector<Doc>& docs) {
  std::stable_sort(docs.begin(), docs.end(), [](const Doc& a, const Doc& b) {
    return a.len != b.len ? a.len > b.len : a.id < b.id;
  });
}

// The step's buckets (one per (replica, slot)) and WLB-LLM's workload-aware packing into them.
// A document's attention work as the packing balances it: its causal pairs, or with a cost
// table its predicted time as one segment over the replica's heads (cost.h).
struct DocWork {
  const CostModel& cost;
  i64 heads;
  double operator()(i64 len) const {
    return cost.active() ? cost.segment(len, len, heads) : static_cast<double>(causal_pairs(len));
  }
};

struct Buckets {
  i64 n, S;
  DocWork doc_work;
  std::vector<std::vector<Doc>> docs;
  std::vector<i64> tokens;
  std::vector<double> work;

  Buckets(i64 n_buckets, i64 context, DocWork price)
      : n(n_buckets),
        S(context),
        doc_work(price),
        docs(static_cast<std::size_t>(n_buckets)),
        tokens(static_cast<std::size_t>(n_buckets), 0),
        work(static_cast<std::size_t>(n_buckets), 0.0) {}

  void put(i64 b, const Doc& d) {
    docs[b].push_back(d);
    tokens[b] += d.len;
    work[b] += doc_work(d.len);
  }

  void clear() {
    for (auto& b : docs) b.clear();
    std::fill(tokens.begin(), tokens.end(), 0);
    std::fill(work.begin(), work.end(), 0.0);
  }

  // The bucket with the least attention work that has room for `len` more tokens (-1: none).
  i64 lightest_with_room(i64 len) const {
    i64 best = -1;
    for (i64 b = 0; b < n; ++b) {
      if (tokens[b] + len > S) continue;
      if (best < 0 || work[b] < work[best]) best = b;
    }
    return best;
  }

  // Each document, in order, into the bucket with the least work that still has token room;
  // what fits nowhere goes to `left`.
  void pack(const std::vector<Doc>& in, std::vector<Doc>& left) {
    for (const Doc& d : in) {
      const i64 best = lightest_with_room(d.len);
      if (best < 0) {
        left.push_back(d);
      } else {
        put(best, d);
      }
    }
  }

  // Documents packed again as the input sequences that brought them held them, into empty
  // buckets: each (arrival, input sequence) group whole, the groups of `first` (heaviest first)
  // before those of `then` (heaviest first), into an empty bucket of its own while empty ones
  // remain (`any_bucket` false) or into the bucket with the least work that has room for it
  // (`any_bucket` true; empty buckets have the least). Documents of unknown origin (a version-1
  // state) go one by one after the groups of their list, into the room the groups leave, and so
  // does a group that cannot go whole; what fits nowhere lands in `first_left` or `then_left`.
  void pack_as_input(const std::vector<Doc>& first, const std::vector<Doc>& then,
                     bool any_bucket, std::vector<Doc>& first_left, std::vector<Doc>& then_left) {
    clear();
    i64 next = 0;  // the first bucket not yet given a group (any_bucket false)
    for (const auto* in : {&first, &then}) {
      std::vector<Doc>& left = in == &first ? first_left : then_left;
      std::map<std::pair<i64, i64>, std::vector<Doc>> groups;  // (age, origin) -> documents
      for (const Doc& d : *in) groups[{d.age, d.origin}].push_back(d);
      std::vector<std::pair<double, std::vector<Doc>*>> order;  // (work, documents)
      for (auto& [key, group] : groups) {
        double w = 0;
        for (const Doc& d : group) w += doc_work(d.len);
        order.push_back({w, &group});
      }
      // known input sequences first (what the due documents' guarantee rests on), heaviest
      // first; then the unknown ones
      std::stable_sort(order.begin(), order.end(), [](const auto& x, const auto& y) {
        const bool kx = x.second->front().origin >= 0, ky = y.second->front().origin >= 0;
        return kx != ky ? kx : x.first > y.first;
      });
      for (const auto& [w, group] : order) {
        i64 sum = 0;
        for (const Doc& d : *group) sum += d.len;
        i64 best = -1;
        if (group->front().origin >= 0) {
          if (!any_bucket) {
            while (next < n && !docs[next].empty()) ++next;
            if (next < n && sum <= S) best = next++;
          } else {
            best = lightest_with_room(sum);
          }
        }
        if (best >= 0) {
          for (const Doc& d : *group) put(best, d);
        } else {
          heaviest_first(*group);
          pack(*group, left);
        }
      }
    }
  }
};

// The step's candidates: the due documents (waited wlb_max_delay steps; with wlb_max_delay = 0
// a document of this step is due at once, so nothing is ever held), which are packed before
// anything else, and the others that may train now. New outliers join the state's queue;
// outlier levels, floor(log2(len / threshold)), are released once a level holds release_count
// documents, and `flush` releases every held document.
struct Candidates {
  std::vector<Doc> due, ready;
};

Candidates collect(const SequencesView& sequences, const PlanOptions& opt, PlannerState& state,
                   i64 threshold, i64 release_count, bool flush) {
  auto is_due = [&](const Doc& d) { return d.age >= opt.wlb_max_delay; };
  Candidates c;
  std::vector<Doc> kept, regular;
  for (std::size_t q = 0; q < sequences.size(); ++q)
    for (const i64* len = sequences.begin(q); len != sequences.end(q); ++len) {
      const Doc doc{state.next_doc_id++, *len, 0, static_cast<i64>(q)};
      if (is_due(doc)) {
        c.due.push_back(doc);
      } else if (*len >= threshold) {
        state.queue.push_back(doc);
      } else {
        regular.push_back(doc);
      }
    }
  std::map<i64, i64> level_count;
  auto level_of = [&](i64 len) {
    i64 lvl = 0;
    for (i64 t = threshold; t <= len / 2; t *= 2) ++lvl;  // t <= 2^29 here: t * 2 cannot overflow
    return lvl;
  };
  for (const Doc& d : state.queue) ++level_count[level_of(d.len)];
  for (const Doc& d : state.spill) (is_due(d) ? c.due : c.ready).push_back(d);
  state.spill.clear();
  for (const Doc& d : state.queue) {
    if (is_due(d)) {
      c.due.push_back(d);
    } else if (flush || level_count[level_of(d.len)] >= release_count) {
      c.ready.push_back(d);
    } else {
      kept.push_back(d);
    }
  }
  state.queue = std::move(kept);
  c.ready.insert(c.ready.end(), regular.begin(), regular.end());
  return c;
}

// The buckets as the plan's executed sequences, round robin over replicas, so the heaviest
// buckets (filled first) land on distinct replicas.
void write_sequences(StepPlan& plan, const Buckets& buckets) {
  plan.seq_doc_offsets.assign(1, 0);
  plan.doc_lengths.clear();
  plan.doc_ids.clear();
  plan.seq_replica.clear();
  plan.seq_slot.clear();
  for (i64 b = 0; b < buckets.n; ++b) {
    for (const Doc& d : buckets.docs[b]) {
      plan.doc_lengths.push_back(d.len);
      plan.doc_ids.push_back(d.id);
    }
    plan.seq_doc_offsets.push_back(static_cast<i64>(plan.doc_lengths.size()));
    plan.seq_replica.push_back(b % plan.dp);
    plan.seq_slot.push_back(b / plan.dp);
  }
}

}  // namespace

void wlb_pack(StepPlan& plan, const SequencesView& sequences, const PlanOptions& opt,
              PlannerState& state, bool flush) {
  const i64 S = plan.context;
  const i64 threshold = opt.wlb_outlier_len > 0 ? opt.wlb_outlier_len : std::max<i64>(1, S / 4);
  const i64 release_count = opt.wlb_release_count > 0 ? opt.wlb_release_count : plan.dp;
  check_step(state, sequences);
  Candidates c = collect(sequences, opt, state, threshold, release_count, flush);
  // Workload-aware packing: heaviest document first, into the bucket with the least attention
  // work (pairs, or a cost table's predicted time) that still has token room; due documents
  // first.
  Buckets buckets(plan.dp * plan.slots, S, DocWork{opt.cost, plan.heads_local * plan.cp});
  heaviest_first(c.due);
  std::vector<Doc> due_left;
  buckets.pack(c.due, due_left);
  if (!due_left.empty()) {
    // Due documents arrived in one step and fit by the way that step's input held them.
    due_left.clear();
    buckets.pack_as_input(c.due, {}, false, due_left, due_left);
  }
  heaviest_first(c.ready);
  std::vector<Doc> left;
  buckets.pack(c.ready, left);
  if (flush && !left.empty()) {
    // A flushed step holds back nothing it can help: when the greedy leaves documents over,
    // the due documents and then all others are packed again as the input held them.
    due_left.clear();
    left.clear();
    buckets.pack_as_input(c.due, c.ready, true, due_left, left);
  }
  // What did not fit waits: its wait grows by one. A due document that fits nowhere (only one
  // of unknown input, from a version-1 state: due documents of known input arrived in one step,
  // are packed before any of unknown input and fit as their input held them) stays due.
  for (const Doc& d : due_left)
    state.spill.push_back({d.id, d.len, std::min(d.age + 1, opt.wlb_max_delay), d.origin});
  for (const Doc& d : left) state.spill.push_back({d.id, d.len, d.age + 1, d.origin});
  for (Doc& d : state.queue) ++d.age;
  ++state.steps;
  write_sequences(plan, buckets);
}

void wlb_tiles(StepPlan& plan) {
  const i64 C = plan.cp;
  const i64 heads_tp = plan.heads_local * C;
  for (i64 s = 0; s < plan.n_seq(); ++s) {
    i64 off = 0;
    const i64 r = plan.seq_replica[s];
    for (i64 doc = plan.seq_doc_offsets[s]; doc < plan.seq_doc_offsets[s + 1]; ++doc) {
      const i64 l = plan.doc_lengths[doc];
      const i64 chunk = (l + 2 * C - 1) / (2 * C);  // document padded to a multiple of 2C
      for (i64 c = 0; c < C; ++c) {
        for (i64 k : {c, 2 * C - 1 - c}) {
          const i64 a = std::min(l, k * chunk);
          const i64 b = std::min(l, (k + 1) * chunk);
          if (a >= b) continue;
          plan.add_tile({s, doc, 1, off + a, b - a, 0, heads_tp, off, b, r, r, c, block_pairs(a, b)});
        }
      }
      off += l;
    }
  }
}

}  // namespace libra
