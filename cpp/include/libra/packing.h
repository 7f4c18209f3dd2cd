// Packing documents into S-token packed sequences.
#pragma once

#include <vector>

#include "libra/common.h"

namespace libra {

// Production packing: fill S-token sequences in order, splitting a document at the boundary
// (the remainder continues in the next sequence). Returns document lengths per sequence; the last
// sequence may be partly filled. If max_sequences > 0, stops after that many full sequences.
std::vector<std::vector<i64>> pack_production(const std::vector<i64>& docs, i64 context,
                                              i64 max_sequences = 0);

// Best-fit greedy knapsack: documents longest first, each into the open sequence with the least
// room that still fits it; a new sequence when none does. A document longer than `context`
// cannot be placed and raises. Order of documents inside a sequence: placement order.
std::vector<std::vector<i64>> pack_best_fit(const std::vector<i64>& docs, i64 context);

// cu_seqlens of one packed sequence: [0, l0, l0+l1, ...].
std::vector<i64> cu_seqlens(const std::vector<i64>& doc_lengths);

}  // namespace libra
