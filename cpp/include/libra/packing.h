// Packing documents into S-token packed sequences.
#pragma once

#include <algorithm>
#include <vector>

#include "libra/batch.h"
#include "libra/common.h"

namespace libra {

// Production packing: fill S-token sequences in order, splitting a document at the boundary
// (the remainder continues in the next sequence). Returns document lengths per sequence; the last
// sequence may be partly filled. If max_sequences > 0, stops after that many full sequences.
std::vector<std::vector<i64>> pack_production(const std::vector<i64>& docs, i64 context,
                                              i64 max_sequences = 0);

// Production packing one document at a time into `out` (the same sequences as pack_production,
// appended to what `out` holds). The caller validates the lengths (each in [1, 2^30]).
class ProductionPacker {
 public:
  ProductionPacker(PackedBatch& out, i64 context, i64 max_sequences)
      : out_(out), context_(context), max_(max_sequences), room_(context),
        first_(out.lengths.size()) {}
  // Adds a document; false once max_sequences sequences are full (the rest is dropped).
  bool add(i64 len) {
    while (len > 0) {
      if (room_ == 0) {
        if (max_ > 0 && started_ == max_) return false;
        out_.close_sequence();
        ++started_;
        room_ = context_;
      }
      const i64 take = std::min(len, room_);
      out_.lengths.push_back(take);
      room_ -= take;
      len -= take;
    }
    return true;
  }
  // Adds documents from `len` while `total` (the tokens added so far, updated) is below
  // `need`; returns how many it took. What add() does for each, with the common case (the
  // document fits the open sequence) kept in registers.
  std::size_t add_until(const i64* len, std::size_t n, i64& total, i64 need) {
    i64 room = room_, sum = total;
    std::size_t i = 0;
    for (; i < n && sum < need; ++i) {
      const i64 l = len[i];
      sum += l;
      if (l > 0 && l <= room) {
        out_.lengths.push_back(l);
        room -= l;
      } else {
        room_ = room;
        add(l);
        room = room_;
      }
    }
    room_ = room;
    total = sum;
    return i;
  }
  // Closes the last sequence (none at all if no document was added).
  void finish() {
    if (out_.lengths.size() != first_) out_.close_sequence();
  }

 private:
  PackedBatch& out_;
  i64 context_, max_, room_;
  std::size_t first_;
  i64 started_ = 1;
};

// Best-fit greedy knapsack: documents longest first, each into the open sequence with the least
// room that still fits it; a new sequence when none does. A document longer than `context`
// cannot be placed and raises. Order of documents inside a sequence: placement order.
std::vector<std::vector<i64>> pack_best_fit(const std::vector<i64>& docs, i64 context);

// cu_seqlens of one packed sequence: [0, l0, l0+l1, ...].
std::vector<i64> cu_seqlens(const std::vector<i64>& doc_lengths);

}  // namespace libra
