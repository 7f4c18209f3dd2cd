#include "libra/wlb.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "libra/workload.h"

namespace libra {

void wlb_pack(StepPlan& plan, const std::vector<std::vector<i64>>& sequences,
              const PlanOptions& opt, PlannerState& state, bool flush) {
  using Doc = PlannerState::Doc;
  const i64 n_buckets = plan.dp * plan.slots;
  const i64 S = plan.context;
  const i64 threshold = opt.wlb_outlier_len > 0 ? opt.wlb_outlier_len : std::max<i64>(1, S / 4);
  const i64 release_count = opt.wlb_release_count > 0 ? opt.wlb_release_count : plan.dp;

  std::vector<Doc> regular;
  for (std::size_t q = 0; q < sequences.size(); ++q)
    for (i64 len : sequences[q]) {
      const Doc doc{state.next_doc_id++, len, 0, static_cast<i64>(q)};
      if (len >= threshold) {
        state.queue.push_back(doc);
      } else {
        regular.push_back(doc);
      }
    }

  // Outlier levels: floor(log2(len / threshold)). A level is released once it holds
  // release_count documents. Documents that waited wlb_max_delay steps (queued outliers and
  // documents that did not fit an earlier step) are due: they are packed before anything else.
  std::map<i64, i64> level_count;
  auto level_of = [&](i64 len) {
    i64 lvl = 0;
    for (i64 t = threshold; t * 2 <= len; t *= 2) ++lvl;
    return lvl;
  };
  for (const Doc& d : state.queue) ++level_count[level_of(d.len)];
  auto is_due = [&](const Doc& d) { return flush || d.age >= opt.wlb_max_delay; };
  std::vector<Doc> due, candidates, kept;
  for (const Doc& d : state.spill) (is_due(d) ? due : candidates).push_back(d);
  state.spill.clear();
  for (const Doc& d : state.queue) {
    if (is_due(d)) {
      due.push_back(d);
    } else if (level_count[level_of(d.len)] >= release_count) {
      candidates.push_back(d);
    } else {
      kept.push_back(d);
    }
  }
  state.queue = std::move(kept);
  candidates.insert(candidates.end(), regular.begin(), regular.end());

  // Workload-aware packing: heaviest document first, into the bucket with the least attention
  // work that still has token room.
  std::vector<std::vector<Doc>> buckets(static_cast<std::size_t>(n_buckets));
  std::vector<i64> tokens(static_cast<std::size_t>(n_buckets), 0);
  std::vector<double> work(static_cast<std::size_t>(n_buckets), 0.0);
  auto heaviest_first = [](std::vector<Doc>& docs) {
    std::stable_sort(docs.begin(), docs.end(), [](const Doc& a, const Doc& b) {
      return a.len != b.len ? a.len > b.len : a.id < b.id;
    });
  };
  auto put = [&](i64 b, const Doc& d) {
    buckets[b].push_back(d);
    tokens[b] += d.len;
    work[b] += static_cast<double>(causal_pairs(d.len));
  };
  auto pack = [&](const std::vector<Doc>& docs, std::vector<Doc>& left) {
    for (const Doc& d : docs) {
      i64 best = -1;
      for (i64 b = 0; b < n_buckets; ++b) {
        if (tokens[b] + d.len > S) continue;
        if (best < 0 || work[b] < work[best]) best = b;
      }
      if (best < 0) {
        left.push_back(d);
      } else {
        put(best, d);
      }
    }
  };
  // Documents packed again as the input sequences that brought them held them: each (arrival,
  // input sequence) group whole, heaviest group first, into a bucket of its own while empty ones
  // remain (`any_bucket` false) or into the bucket with the least work that has room for it
  // (`any_bucket` true; empty buckets have the least). A group that cannot go whole, or of
  // unknown origin (a version-1 state), goes one by one; what fits nowhere lands in `left`.
  auto pack_as_input = [&](const std::vector<Doc>& docs, bool any_bucket, std::vector<Doc>& left) {
    for (auto& b : buckets) b.clear();
    std::fill(tokens.begin(), tokens.end(), 0);
    std::fill(work.begin(), work.end(), 0.0);
    std::map<std::pair<i64, i64>, std::vector<Doc>> groups;  // (age, origin) -> documents
    for (const Doc& d : docs) groups[{d.age, d.origin}].push_back(d);
    std::vector<std::pair<double, std::vector<Doc>*>> order;  // (work, documents)
    for (auto& [key, group] : groups) {
      double w = 0;
      for (const Doc& d : group) w += static_cast<double>(causal_pairs(d.len));
      order.push_back({w, &group});
    }
    std::stable_sort(order.begin(), order.end(),
                     [](const auto& x, const auto& y) { return x.first > y.first; });
    i64 next = 0;  // the first bucket not yet given a group (any_bucket false)
    for (const auto& [w, group] : order) {
      i64 sum = 0;
      for (const Doc& d : *group) sum += d.len;
      i64 best = -1;
      if (group->front().origin >= 0) {
        if (!any_bucket) {
          if (next < n_buckets && sum <= S) best = next++;
        } else {
          for (i64 b = 0; b < n_buckets; ++b) {
            if (tokens[b] + sum > S) continue;
            if (best < 0 || work[b] < work[best]) best = b;
          }
        }
      }
      if (best >= 0) {
        for (const Doc& d : *group) put(best, d);
      } else {
        heaviest_first(*group);
        pack(*group, left);
      }
    }
  };
  heaviest_first(due);
  std::vector<Doc> due_left;
  pack(due, due_left);
  if (!due_left.empty() && !flush) {
    // Due documents that arrived in one step fit by the way that step's input held them.
    due_left.clear();
    pack_as_input(due, false, due_left);
  }
  heaviest_first(candidates);
  std::vector<Doc> left;
  pack(candidates, left);
  if (flush && (!due_left.empty() || !left.empty())) {
    // The last step holds nothing back where it can help it: when the greedy leaves documents
    // over, every document is packed again as the input held them.
    due_left.clear();
    left.clear();
    std::vector<Doc> all = due;
    all.insert(all.end(), candidates.begin(), candidates.end());
    pack_as_input(all, true, left);
  }
  // What did not fit waits (a due document only if even its input's packing did not fit, which
  // a state carried between steps of one run cannot produce).
  for (const auto* list : {&due_left, &left})
    for (const Doc& d : *list) state.spill.push_back({d.id, d.len, d.age + 1, d.origin});
  for (Doc& d : state.queue) ++d.age;
  ++state.steps;

  plan.seq_doc_offsets.assign(1, 0);
  plan.doc_lengths.clear();
  plan.doc_ids.clear();
  plan.seq_replica.clear();
  plan.seq_slot.clear();
  for (i64 b = 0; b < n_buckets; ++b) {
    for (const Doc& d : buckets[b]) {
      plan.doc_lengths.push_back(d.len);
      plan.doc_ids.push_back(d.id);
    }
    plan.seq_doc_offsets.push_back(static_cast<i64>(plan.doc_lengths.size()));
    // Round robin over replicas, so the heaviest buckets (filled first) land on distinct replicas.
    plan.seq_replica.push_back(b % plan.dp);
    plan.seq_slot.push_back(b / plan.dp);
  }
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
