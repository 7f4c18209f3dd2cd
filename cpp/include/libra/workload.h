// Workload description and the cost model of DESIGN.md section 4.
#pragma once

#include <vector>

#include "libra/batch.h"
#include "libra/common.h"

namespace libra {

// Transformer dimensions the cost model needs.
struct ModelDims {
  i64 hidden = 2048;     // H: model width
  i64 heads = 32;        // h: query heads
  i64 kv_heads = 4;      // h_kv: key/value heads (GQA when < heads)
  i64 head_dim = 128;    // d
  i64 ffn = 6144;        // dense SwiGLU intermediate size (used when moe_topk == 0)
  i64 layers = 48;
  i64 moe_topk = 0;      // experts per token; 0 = dense model
  i64 moe_ffn = 0;       // per-expert intermediate size
  i64 shared_ffn = 0;    // shared-expert intermediate size (0 = none)

  void validate() const;
};

// Causal (query, key) pairs of a document of length l: l(l+1)/2.
inline i64 causal_pairs(i64 l) { return l * (l + 1) / 2; }

// Pairs of query rows [a, b) of a document against their causal prefix.
inline i64 block_pairs(i64 a, i64 b) { return (b * (b + 1) - a * (a + 1)) / 2; }

// Attention forward FLOPs for `pairs` causal pairs over `heads` heads: 4 * d * heads * pairs.
inline double attn_fwd_flops(double pairs, i64 heads, i64 head_dim) {
  return 4.0 * static_cast<double>(head_dim) * static_cast<double>(heads) * pairs;
}
constexpr double kAttnBwdFactor = 2.5;   // backward = 2.5 x forward
constexpr double kLinearBwdFactor = 2.0; // backward = 2 x forward

// Forward FLOPs per token per layer of the linear layers (QKV + O projections and SwiGLU MLP).
double linear_fwd_flops_per_token(const ModelDims& m);

// Validate a list of document lengths: each in [1, max_len]. `field` names the list in errors.
void validate_lengths(const std::vector<i64>& lengths, i64 max_len, const std::string& field);

// Validate packed sequences: every length positive, every sequence's sum <= context.
void validate_sequences(const SequencesView& seqs, i64 context);

}  // namespace libra
