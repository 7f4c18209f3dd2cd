// StepPlan's tile columns: a tile as a row of the plan's struct of arrays. Every part of the
// planner that makes tiles (TAP, the baselines' placements, per-document CP) adds them here.
#include "libra/plan.h"

namespace libra {

const std::array<StepPlan::TileColumn, StepPlan::kTileColumns>& StepPlan::tile_columns() {
  static const std::array<TileColumn, kTileColumns> columns{{
      {&StepPlan::tile_seq, &Tile::seq},
      {&StepPlan::tile_doc, &Tile::doc},
      {&StepPlan::tile_doc_count, &Tile::doc_count},
      {&StepPlan::tile_q_start, &Tile::q_start},
      {&StepPlan::tile_q_len, &Tile::q_len},
      {&StepPlan::tile_head_start, &Tile::head_start},
      {&StepPlan::tile_head_count, &Tile::head_count},
      {&StepPlan::tile_kv_start, &Tile::kv_start},
      {&StepPlan::tile_kv_len, &Tile::kv_len},
      {&StepPlan::tile_owner, &Tile::owner},
      {&StepPlan::tile_executor, &Tile::executor},
      {&StepPlan::tile_cp, &Tile::cp},
      {&StepPlan::tile_pairs, &Tile::pairs},
  }};
  return columns;
}

StepPlan::Tile StepPlan::tile(std::size_t i) const {
  Tile t{};
  for (const TileColumn& c : tile_columns()) t.*c.field = (this->*c.array)[i];
  return t;
}

void StepPlan::add_tile(const Tile& t) {
  for (const TileColumn& c : tile_columns()) (this->*c.array).push_back(t.*c.field);
}

void StepPlan::resize_tiles(std::size_t n) {
  for (const TileColumn& c : tile_columns()) (this->*c.array).resize(n);
}

}  // namespace libra
