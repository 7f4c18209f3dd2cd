// A rank's attention program for one (replica, slot) of a plan: the compact descriptors the
// context-parallel operator runs (kernel calls as cu_seqlens, gathers as runs). The native
// twin of `libra_ext.attention.meta.compile_slot_reference`, which is its oracle: both give the
// same program, array for array. See docs/plan_contract.md ("Programs").
#pragma once

#include <cstdint>
#include <vector>

#include "libra/common.h"

namespace libra {

// A read-only int64 array of the plan (a numpy array's buffer), with the field's name for errors.
struct ArrayView {
  const i64* data = nullptr;
  i64 size = 0;
};

// What compiling a slot reads of a StepPlan (Ulysses family: libra, distca, ulysses).
struct ProgramPlan {
  i64 dp = 0, slots = 0, cp = 0, exchange_pool = 0, heads_local = 0, kv_heads_local = 0,
      head_dim = 0;
  ArrayView doc_lengths, seq_doc_offsets, seq_replica, seq_slot, send_order, send_group_offsets,
      tile_doc, tile_doc_count, tile_q_start, tile_q_len, tile_kv_start, tile_kv_len,
      tile_head_start, tile_head_count, tile_owner, tile_executor, tile_cp;
  ArrayView xchg_q, xchg_kv;  // [groups, exchange_pool, exchange_pool], flattened
};

// One batched varlen call: segments (cu_q, cu_k), hc query and hk KV heads each, max lengths
// rounded up to a power of two (at least 128).
struct ProgCall {
  i64 hc = 0, hk = 0;
  std::vector<i64> cu_q, cu_k;
  i64 max_q = 0, max_k = 0;
};

// Vector indices as runs (base, rows, width, stride), flattened [n_runs * 4]; `size` vectors.
struct ProgGather {
  std::vector<i64> runs;
  i64 size = 0;
};

struct ProgPack {
  ProgCall call;
  ProgGather q, k;
};

// One all-to-all round of the pool exchange, seen from one member.
struct ProgSub {
  bool direct = false;
  i64 part = 0;
  std::vector<i64> q_send, kv_send, q_recv, kv_recv;  // vectors per member
  i64 q_send_off = 0, kv_send_off = 0;
  // The messages cut into ranges (meta._ranges): sent, (member, vectors, first vector or -1)
  // triples in send order; received, (member, vectors) pairs in receive order.
  std::vector<i64> q_ranges, kv_ranges, q_recv_ranges, kv_recv_ranges;
  bool has_call = false;  // direct: the call over the received regions (when it receives any)
  ProgCall call;
  std::vector<ProgPack> packs;  // not direct: calls on packs gathered from the received regions
};

struct Program {
  i64 t = 0, tokens = 0, executed = 0;
  ProgCall direct;
  std::vector<ProgPack> lpacks;
  std::vector<ProgSub> subchunks;
  ProgGather send_q, send_kv;
};

// The program of (replica, any cp rank of it) for `slot`. Every index read from the plan is
// checked: a malformed plan raises std::invalid_argument naming the field and index.
Program compile_slot_program(const ProgramPlan& plan, i64 replica, i64 slot, i64 chunks);

// A plain call's backward peak over its X (the kernel's Q/K/V): `early_returns` weighs the
// exchange buffers against it (libra_ext.attention.meta.PEAK_BASE).
constexpr double kPeakBase = 3.6;

// Whether the exchange group of (replica, slot) runs its executed units' backward, and waits for
// every return, before the direct call's backward (system.attention_memory = rebuild): the
// early order's modeled peak below the late one's - the rule of
// libra_ext.attention.meta.early_return_groups, its oracle, the same on every member.
bool early_returns(const ProgramPlan& plan, i64 replica, i64 slot);

// A program's arrays as one flat int32 buffer, ready for one host-to-device copy: every call's
// cu_q then cu_k (the direct call, the local packs', then per sub-chunk its call and its packs'),
// then every gather's runs (send_q, send_kv, the local packs' q and k, the sub-chunks' packs' q
// and k) - the order of `libra_ext.attention.meta._walk`. `sizes` gets each array's length in
// that order. False (flat and sizes left empty) when an entry does not fit in int32.
bool stage_program(const Program& prog, std::vector<std::int32_t>& flat, std::vector<i64>& sizes);

// Adds the cost-model features of every segment of the program's calls to f ([kCostFeatures],
// add_segment_features; segments with no rows or no keys do no work and are not counted; the
// constant is not touched): libra_ext.costmodel.call_features over the program's calls.
void add_program_features(const Program& prog, double* f);

}  // namespace libra
