// A step's packed sequences in CSR form: the planner's input and the generators' output.
#pragma once

#include <cstddef>
#include <vector>

#include "libra/common.h"

namespace libra {

// Sequence s holds the document lengths lengths[offsets[s], offsets[s + 1]). A view: it owns
// nothing (a PackedBatch's arrays, or numpy buffers handed over without a copy).
struct SequencesView {
  const i64* lengths = nullptr;  // [n_lengths]
  const i64* offsets = nullptr;  // [count + 1]
  std::size_t count = 0;         // B: sequences
  std::size_t n_lengths = 0;

  std::size_t size() const { return count; }
  const i64* begin(std::size_t s) const { return lengths + offsets[s]; }
  const i64* end(std::size_t s) const { return lengths + offsets[s + 1]; }
  std::size_t docs(std::size_t s) const { return static_cast<std::size_t>(offsets[s + 1] - offsets[s]); }

  // offsets[0] == 0, non-decreasing, offsets[count] == n_lengths; raises naming the bad entry.
  // Every other accessor assumes it held.
  void validate_offsets() const {
    if (offsets == nullptr) fail("offsets must hold at least one entry (0)");
    if (offsets[0] != 0) fail("offsets[0] must be 0, got " + std::to_string(offsets[0]));
    for (std::size_t s = 0; s < count; ++s)
      if (offsets[s + 1] < offsets[s] || offsets[s + 1] > static_cast<i64>(n_lengths))
        fail(field_at("offsets", static_cast<i64>(s + 1)) + " = " + std::to_string(offsets[s + 1]) +
             " must lie in [offsets[" + std::to_string(s) + "] = " + std::to_string(offsets[s]) +
             ", len(lengths) = " + std::to_string(n_lengths) + "]");
    if (offsets[count] != static_cast<i64>(n_lengths))
      fail(field_at("offsets", static_cast<i64>(count)) + " = " + std::to_string(offsets[count]) +
           " must equal len(lengths) = " + std::to_string(n_lengths));
  }
};

// An owning CSR batch of packed sequences.
struct PackedBatch {
  std::vector<i64> lengths;
  std::vector<i64> offsets{0};

  std::size_t size() const { return offsets.size() - 1; }
  SequencesView view() const { return {lengths.data(), offsets.data(), size(), lengths.size()}; }
  // Closes the sequence being filled (the lengths appended since the last close).
  void close_sequence() { offsets.push_back(static_cast<i64>(lengths.size())); }

  static PackedBatch from_nested(const std::vector<std::vector<i64>>& seqs) {
    PackedBatch b;
    std::size_t n = 0;
    for (const auto& s : seqs) n += s.size();
    b.lengths.reserve(n);
    b.offsets.reserve(seqs.size() + 1);
    for (const auto& s : seqs) {
      b.lengths.insert(b.lengths.end(), s.begin(), s.end());
      b.close_sequence();
    }
    return b;
  }
  std::vector<std::vector<i64>> nested() const {
    std::vector<std::vector<i64>> out(size());
    const SequencesView v = view();
    for (std::size_t s = 0; s < size(); ++s) out[s].assign(v.begin(s), v.end(s));
    return out;
  }
};

}  // namespace libra
