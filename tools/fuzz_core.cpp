// Random-input fuzz driver for the planner core, meant to run under AddressSanitizer and
// UndefinedBehaviorSanitizer (tools/fuzz_core.sh). Mode "any" throws arbitrary, mostly invalid
// values at every entry point (each must be rejected with std::invalid_argument, nothing else);
// mode "valid" draws well-formed layouts and steps so the planning paths themselves run.
#include <cstdio>
#include <cstring>
#include <random>

#include "libra/packing.h"
#include "libra/plan.h"
#include "libra/vrsp.h"

using namespace libra;

int main(int argc, char** argv) {
  const bool valid = argc > 1 && std::strcmp(argv[1], "valid") == 0;
  const long iterations = argc > 2 ? std::atol(argv[2]) : 20000;
  std::mt19937_64 rng(valid ? 2 : 1);
  auto R = [&](i64 lo, i64 hi) { return std::uniform_int_distribution<i64>(lo, hi)(rng); };
  long planned = 0, rejected = 0, tiles = 0;
  for (long it = 0; it < iterations; ++it) {
    Layout L;
    ModelDims M;
    PlanOptions o;
    std::vector<std::vector<i64>> seqs;
    o.system = static_cast<System>(R(0, 3));
    o.vrsp = R(0, 1);
    o.tap = R(0, 1);
    o.refine = R(0, 1);
    o.max_tile_share = 0.05 * static_cast<double>(R(0, 4));
    if (valid) {
      L.pool = i64(1) << R(0, 2);
      L.dp = L.pool * R(1, 3);
      L.cp = i64(1) << R(0, 2);
      L.tp = R(1, 2);
      L.context = R(1, 512);
      M.heads = (i64(1) << R(0, 2)) * L.cp * L.tp;
      M.kv_heads = i64(1) << R(0, 3);
      M.head_dim = 4;
      o.block = R(0, 3) == 0 ? 0 : R(1, 64);
      o.head_group = R(0, 3);
      o.epsilon = 0.02 * static_cast<double>(R(0, 3));
      seqs.resize(static_cast<std::size_t>(L.dp * R(1, 3)));
      for (auto& s : seqs) {
        i64 room = L.context;
        while (room > 0 && R(0, 4)) {
          const i64 x = R(1, room);
          s.push_back(x);
          room -= x;
        }
      }
    } else {
      L.dp = R(-1, 6); L.cp = R(-1, 4); L.tp = R(-1, 2); L.pool = R(-1, 6);
      L.context = R(0, 3) == 0 ? R(-5, 5) : R(1, 300);
      M.heads = R(-1, 9); M.kv_heads = R(-1, 9); M.head_dim = R(-1, 4);
      o.block = R(-2, 50); o.head_group = R(-1, 5);
      o.epsilon = R(0, 5) == 0 ? -1.0 : 0.02 * static_cast<double>(R(0, 3));
      o.wlb_outlier_len = R(-1, 100); o.wlb_max_delay = R(-1, 3); o.wlb_release_count = R(-1, 3);
      seqs.resize(static_cast<std::size_t>(R(0, 12)));
      for (auto& s : seqs) {
        s.resize(static_cast<std::size_t>(R(0, 5)));
        for (auto& x : s) x = R(-2, 120);
      }
      try {
        std::vector<double> loads(static_cast<std::size_t>(R(0, 12)));
        for (auto& x : loads) x = static_cast<double>(R(0, 100));
        exact_cardinality_lpt(loads, R(-1, 4), R(-1, 4));
        exact_cardinality_lower_bound(loads, R(-1, 4), R(-1, 4));
      } catch (const std::invalid_argument&) {
      }
      try {
        std::vector<i64> d(static_cast<std::size_t>(R(0, 10)));
        for (auto& x : d) x = R(-2, 40);
        pack_production(d, R(-1, 30), R(-1, 3));
        pack_best_fit(d, R(-1, 30));
      } catch (const std::invalid_argument&) {
      }
      try {
        std::vector<i64> f(static_cast<std::size_t>(R(0, 12)));
        for (auto& x : f) x = R(-2, 5);
        PlannerState::deserialize(f);
      } catch (const std::invalid_argument&) {
      }
    }
    PlannerState state;
    try {
      for (int k = 0; k < 3; ++k) tiles += plan_step(seqs, L, M, o, &state, k == 2).n_tiles();
      ++planned;
    } catch (const std::invalid_argument&) {
      ++rejected;
    }
  }
  std::printf("mode=%s iterations=%ld planned=%ld rejected=%ld tiles=%ld\n", valid ? "valid" : "any",
              iterations, planned, rejected, tiles);
  return 0;
}
