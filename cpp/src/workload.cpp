#include "libra/workload.h"

namespace libra {

void ModelDims::validate() const {
  require_positive(hidden, "model.hidden");
  require_positive(heads, "model.heads");
  require_positive(kv_heads, "model.kv_heads");
  require_positive(head_dim, "model.head_dim");
  require_positive(layers, "model.layers");
  require_at_most(heads, kMaxSplit, "model.heads", "2^16");
  require_at_most(head_dim, kMaxSplit, "model.head_dim", "2^16");
  if (heads % kv_heads != 0)
    fail("model.heads (" + std::to_string(heads) + ") must be divisible by model.kv_heads (" +
         std::to_string(kv_heads) + ")");
  if (moe_topk < 0) fail("model.moe_topk must be >= 0");
  if (moe_topk == 0) {
    require_positive(ffn, "model.ffn");
  } else {
    require_positive(moe_ffn, "model.moe_ffn");
  }
  if (shared_ffn < 0) fail("model.shared_ffn must be >= 0");
}

double linear_fwd_flops_per_token(const ModelDims& m) {
  const double H = static_cast<double>(m.hidden);
  const double d = static_cast<double>(m.head_dim);
  const double qkv_o = H * static_cast<double>(m.heads + 2 * m.kv_heads) * d +
                       static_cast<double>(m.heads) * d * H;
  const double ffn = m.moe_topk > 0
                         ? static_cast<double>(m.moe_topk * m.moe_ffn + m.shared_ffn)
                         : static_cast<double>(m.ffn);
  return 2.0 * qkv_o + 2.0 * 3.0 * H * ffn;
}

void validate_lengths(const std::vector<i64>& lengths, i64 max_len, const std::string& field) {
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    const i64 l = lengths[i];
    if (l <= 0)
      fail(field_at(field, static_cast<i64>(i)) + " must be positive, got " + std::to_string(l));
    if (l > max_len)
      fail(field_at(field, static_cast<i64>(i)) + " = " + std::to_string(l) +
           " exceeds the limit " + std::to_string(max_len));
  }
}

void validate_sequences(const SequencesView& seqs, i64 context) {
  for (std::size_t s = 0; s < seqs.size(); ++s) {
    const std::string field = field_at("sequences", static_cast<i64>(s));
    unsigned __int128 total = 0;  // every length is checked first, so this cannot overflow
    for (const i64* l = seqs.begin(s); l != seqs.end(s); ++l) {
      const std::string entry = field_at(field, static_cast<i64>(l - seqs.begin(s)));
      if (*l <= 0) fail(entry + " must be positive, got " + std::to_string(*l));
      if (*l > context)
        fail(entry + " = " + std::to_string(*l) + " exceeds the limit " + std::to_string(context));
      total += static_cast<unsigned __int128>(*l);
    }
    if (total > static_cast<unsigned __int128>(context)) {
      const std::string tokens = total < (static_cast<unsigned __int128>(1) << 63)
                                     ? std::to_string(static_cast<i64>(total))
                                     : std::to_string(static_cast<double>(total));
      fail(field + " holds " + tokens + " tokens, more than context " + std::to_string(context));
    }
  }
}

}  // namespace libra
