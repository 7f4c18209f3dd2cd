#include "libra/packing.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <utility>

#include "libra/workload.h"

namespace libra {

std::vector<std::vector<i64>> pack_production(const std::vector<i64>& docs, i64 context,
                                              i64 max_sequences) {
  require_positive(context, "context");
  if (context > kMaxTokens) fail("context exceeds " + std::to_string(kMaxTokens));
  if (max_sequences < 0) fail("max_sequences must be >= 0");
  validate_lengths(docs, kMaxTokens, "lengths");
  PackedBatch out;
  ProductionPacker packer(out, context, max_sequences);
  for (const i64 len : docs)
    if (!packer.add(len)) break;
  packer.finish();
  return out.nested();
}

std::vector<std::vector<i64>> pack_best_fit(const std::vector<i64>& docs, i64 context) {
  require_positive(context, "context");
  if (context > kMaxTokens) fail("context exceeds " + std::to_string(kMaxTokens));
  validate_lengths(docs, kMaxTokens, "lengths");
  for (std::size_t i = 0; i < docs.size(); ++i)
    if (docs[i] > context)
      fail(field_at("lengths", static_cast<i64>(i)) + " = " + std::to_string(docs[i]) +
           " is longer than context " + std::to_string(context) +
           " and best-fit packing cannot split documents");
  std::vector<i64> order(docs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](i64 a, i64 b) { return docs[a] > docs[b]; });
  std::vector<std::vector<i64>> out;
  std::set<std::pair<i64, i64>> rooms;  // (room left, sequence index)
  for (i64 i : order) {
    const i64 len = docs[i];
    auto it = rooms.lower_bound({len, -1});
    if (it == rooms.end()) {
      out.push_back({len});
      rooms.insert({context - len, static_cast<i64>(out.size()) - 1});
    } else {
      const auto [room, s] = *it;
      rooms.erase(it);
      out[s].push_back(len);
      rooms.insert({room - len, s});
    }
  }
  return out;
}

std::vector<i64> cu_seqlens(const std::vector<i64>& doc_lengths) {
  std::vector<i64> cu(doc_lengths.size() + 1, 0);
  for (std::size_t i = 0; i < doc_lengths.size(); ++i) cu[i + 1] = cu[i] + doc_lengths[i];
  return cu;
}

}  // namespace libra
