// Production order: where a step's input sequences run when nothing balances them.
#pragma once

#include <string>

#include "libra/common.h"

namespace libra {

// Which replica and micro-batch slot each of a step's B input sequences goes to when nothing
// balances them ("production order"). Megatron: Megatron-LM's pretraining sampler - the global
// batch is consumed micro-batch round by round, each round handing micro_batch consecutive
// samples to data-parallel rank 0, the next micro_batch to rank 1, ... (with micro_batch 1,
// sample q to rank q mod D in slot q / D). Contiguous: replica q / m holds slots q mod m (a
// loader that gives each replica a contiguous block of the batch).
enum class SampleOrder { Megatron = 0, Contiguous = 1 };

SampleOrder parse_order(const std::string& name);
std::string order_name(SampleOrder o);

struct ReplicaSlot {
  i64 replica, slot;
};
// Production (replica, slot) of input sequence q of a step with `slots` sequences per replica.
inline ReplicaSlot production_slot(i64 q, i64 dp, i64 slots, SampleOrder order, i64 micro_batch) {
  if (order == SampleOrder::Contiguous) return {q / slots, q % slots};
  const i64 round = q / (micro_batch * dp), within = q % (micro_batch * dp);
  return {within / micro_batch, round * micro_batch + within % micro_batch};
}

}  // namespace libra
