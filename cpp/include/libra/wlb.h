// WLB-LLM baseline: workload-aware variable-length packing with an outlier delay queue, and
// per-document context-parallel sharding (2C chunks per document).
#pragma once

#include <vector>

#include "libra/common.h"
#include "libra/plan.h"

namespace libra {

// Repack the step's documents (plus queued ones) into D*m buckets of at most S tokens and fill
// plan.seq_* / doc_* with the result. Updates `state`.
void wlb_pack(StepPlan& plan, const SequencesView& sequences,
              const PlanOptions& opt, PlannerState& state, bool flush);

// Per-document CP tiles: chunks c and 2C-1-c of every document on cp rank c.
void wlb_tiles(StepPlan& plan);

}  // namespace libra
