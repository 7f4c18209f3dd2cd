// Random-input fuzz driver for the planner core, meant to run under AddressSanitizer and
// UndefinedBehaviorSanitizer (tools/fuzz_core.sh). Mode "any" throws arbitrary, mostly invalid
// values at every entry point (each must be rejected with std::invalid_argument, nothing else);
// mode "valid" draws well-formed layouts and steps so the planning paths themselves run; mode
// "state" loads crafted planner states (counts that overflow, extreme ids, lengths and waits)
// and plans with them under extreme options and CSR inputs with bad offsets; mode "source"
// serves steps from one reused window cache (shapes, seeds, steps, threads and distributions at
// their edges) and gathers with arbitrary orders: each served step must equal the one made from
// scratch.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <random>

#include "libra/generators.h"
#include "libra/packing.h"
#include "libra/plan.h"
#include "libra/vrsp.h"

using namespace libra;

namespace {

// One 64-bit value, often one of the edges.
i64 edge(std::mt19937_64& rng, i64 lo, i64 hi) {
  static const i64 edges[] = {0,  1,  -1, 2, 3, 4, 100, 4096, i64(1) << 30, (i64(1) << 30) + 1,
                              i64(1) << 31, i64(1) << 62, INT64_MAX, INT64_MAX - 1, INT64_MIN,
                              (i64(1) << 62) - 1};
  if (std::uniform_int_distribution<int>(0, 2)(rng) == 0)
    return edges[std::uniform_int_distribution<std::size_t>(0, std::size(edges) - 1)(rng)];
  return std::uniform_int_distribution<i64>(lo, hi)(rng);
}

double edge_real(std::mt19937_64& rng) {
  static const double edges[] = {0.0, 0.02, 0.25, 1.0, -0.0, -1.0, 1e300,
                                 std::numeric_limits<double>::infinity(),
                                 std::numeric_limits<double>::quiet_NaN()};
  return edges[std::uniform_int_distribution<std::size_t>(0, std::size(edges) - 1)(rng)];
}

// States, options and CSR inputs at their edges: everything is planned or refused with
// std::invalid_argument, and a plan made with a loaded state leaves a state that loads again.
int fuzz_states(long iterations) {
  std::mt19937_64 rng(3);
  auto R = [&](i64 lo, i64 hi) { return std::uniform_int_distribution<i64>(lo, hi)(rng); };
  long loaded = 0, planned = 0, rejected = 0;
  for (long it = 0; it < iterations; ++it) {
    Layout L;
    L.pool = i64(1) << R(0, 1);
    L.dp = L.pool * R(1, 2);
    L.cp = i64(1) << R(0, 1);
    L.context = R(0, 4) == 0 ? edge(rng, 1, 256) : R(1, 256);
    ModelDims M;
    M.heads = 2 * L.cp;
    M.kv_heads = R(0, 1) ? 1 : 2;
    M.head_dim = R(0, 6) == 0 ? edge(rng, 1, 64) : 4;
    PlanOptions o;
    o.system = R(0, 3) == 0 ? static_cast<System>(R(0, 3)) : System::Wlb;
    o.distca_gpu = R(0, 3) == 0;
    if (R(0, 1)) o.block = edge(rng, 0, 64);
    if (R(0, 2) == 0) o.head_group = edge(rng, 0, 4);
    if (R(0, 2) == 0) o.epsilon = edge_real(rng);
    if (R(0, 2) == 0) o.max_tile_share = edge_real(rng);
    if (R(0, 2) == 0) o.distca_tolerance = edge_real(rng);
    if (R(0, 3) == 0) o.max_refine_moves = edge(rng, 0, 10);
    if (R(0, 3) == 0) o.dtype_bytes = edge(rng, 1, 8);
    o.wlb_outlier_len = R(0, 1) ? edge(rng, 0, 128) : 0;
    o.wlb_max_delay = R(0, 1) ? edge(rng, 0, 3) : R(0, 3);
    o.wlb_release_count = R(0, 1) ? edge(rng, 0, 3) : R(0, 3);
    if (R(0, 3) == 0) o.threads = edge(rng, 0, 4);
    if (R(0, 5) == 0) o.micro_batch = edge(rng, 1, 2);
    // a state: plausible entries, or counts and fields at their edges
    std::vector<i64> flat{R(0, 5) == 0 ? edge(rng, 0, 3) : R(1, 2),
                          R(0, 3) == 0 ? edge(rng, 0, 50) : 64, edge(rng, 0, 9),
                          R(0, 3) == 0 ? edge(rng, 0, 4) : R(0, 4), R(0, 3) == 0 ? edge(rng, 0, 4) : R(0, 4)};
    const i64 width = flat[0] == 1 ? 3 : 4;
    const i64 n = R(0, 3) == 0 ? R(0, 20) : (std::clamp<i64>(flat[3], 0, 8) + std::clamp<i64>(flat[4], 0, 8)) * width;
    for (i64 k = 0; k < n; ++k) {
      const i64 field = k % width;
      flat.push_back(R(0, 4) == 0 ? edge(rng, -2, 300)
                     : field == 0  ? 3 * (k / width) + R(0, 2)
                     : field == 1  ? R(1, std::min<i64>(std::max<i64>(L.context, 1), 300))
                     : field == 2  ? R(0, 2)
                                   : R(-1, 4));
    }
    PlannerState state;
    try {
      state = PlannerState::deserialize(flat);
      ++loaded;
    } catch (const std::invalid_argument&) {
      ++rejected;
    }
    // the step, in CSR form; sometimes with offsets that do not describe the lengths
    PackedBatch batch;
    const i64 B = L.dp * R(1, 2);
    for (i64 q = 0; q < B; ++q) {
      i64 room = L.context;
      while (room > 0 && R(0, 3)) {
        const i64 x = R(0, 8) == 0 ? edge(rng, -2, 300) : R(1, std::min<i64>(room, 300));
        batch.lengths.push_back(x);
        room -= std::max<i64>(x, 1);
      }
      batch.close_sequence();
    }
    SequencesView view = batch.view();
    std::vector<i64> bad_offsets;
    if (R(0, 7) == 0) {
      bad_offsets = batch.offsets;
      bad_offsets[static_cast<std::size_t>(R(0, B))] = edge(rng, -2, 40);
      view.offsets = bad_offsets.data();
    }
    for (int k = 0; k < 3; ++k) {
      try {
        plan_step(view, L, M, o, &state, R(0, 2) == 0);
      } catch (const std::invalid_argument&) {
        ++rejected;
        break;
      }
      ++planned;
      try {  // what a plan leaves behind is a state that loads and validates again
        PlannerState::deserialize(state.serialize()).validate(L, o);
      } catch (const std::invalid_argument& e) {
        std::printf("iteration %ld: a planned state does not load again: %s\n", it, e.what());
        return 1;
      }
    }
  }
  std::printf("mode=state iterations=%ld loaded=%ld planned=%ld rejected=%ld\n", iterations, loaded,
              planned, rejected);
  return 0;
}

// Steps served from one window cache, whose buffers every call reuses, against steps made from
// scratch; bad shapes and distributions refused with std::invalid_argument; gathers with
// arbitrary order entries on several threads.
int fuzz_source(long iterations) {
  std::mt19937_64 rng(4);
  auto R = [&](i64 lo, i64 hi) { return std::uniform_int_distribution<i64>(lo, hi)(rng); };
  static const char* kinds[] = {"lognormal", "mixture", "empirical", "nope"};
  long served = 0, rejected = 0, gathered = 0;
  LengthDist dist = preset("libra-1m");
  i64 window = 2;
  auto cache = std::make_unique<WindowCache>(dist, window);
  for (long it = 0; it < iterations; ++it) {
    if (R(0, 15) == 0) {  // a new distribution (often invalid) and cache
      LengthDist d = R(0, 1) ? preset("libra-256k") : LengthDist{};
      if (R(0, 1)) d.kind = kinds[R(0, 3)];
      if (R(0, 2) == 0) d.median = edge_real(rng);
      if (R(0, 2) == 0) d.tail_weight = edge_real(rng);
      if (R(0, 2) == 0) d.long_weight = edge_real(rng);
      if (R(0, 2) == 0) d.cap = edge(rng, 1, 1 << 16);
      if (R(0, 2) == 0) d.min_len = edge(rng, 1, 64);
      if (d.kind == "empirical")
        for (i64 n = R(0, 4); n > 0; --n) d.values.push_back(edge(rng, 1, 5000));
      const i64 w = R(0, 5) == 0 ? edge(rng, 1, 8) : R(1, 4);
      try {
        auto fresh = std::make_unique<WindowCache>(d, w);
        dist = d;
        window = w;
        cache = std::move(fresh);
      } catch (const std::invalid_argument&) {
        ++rejected;
      }
    }
    const i64 gbs = R(0, 5) == 0 ? edge(rng, 1, 8) : R(1, 8);
    const i64 context = R(0, 5) == 0 ? edge(rng, 1, 4096) : R(1, 4096);
    const u64 seed = static_cast<u64>(edge(rng, 0, 1 << 20));
    const i64 step = R(0, 5) == 0 ? edge(rng, 0, 16) : R(0, 16);
    const i64 threads = R(0, 7) == 0 ? edge(rng, 0, 3) : R(0, 3);
    // a valid window past 2^20 tokens is served, slowly (up to 2^40 tokens are allowed): the
    // edges are for the refusals
    if (gbs > 0 && context > 0 && context <= kMaxTokens && threads >= 0 && threads <= 1024 &&
        step >= 0) {
      const __int128 per_step = static_cast<__int128>(gbs) * context;  // < 2^94
      if (per_step <= (__int128(1) << 40) / window && per_step * window > (1 << 20)) continue;
    }
    PackedBatch got;
    try {
      got = cache->step(gbs, context, seed, step, threads);
    } catch (const std::invalid_argument&) {
      ++rejected;
      continue;
    }
    const PackedBatch want = step_sequences(dist, gbs, context, seed, step, window, 1);
    if (got.lengths != want.lengths || got.offsets != want.offsets) {
      std::printf("iteration %ld: a served step differs from the one made from scratch\n", it);
      return 1;
    }
    ++served;
    std::vector<i64> order(static_cast<std::size_t>(R(0, 2 * gbs)));
    for (i64& o : order) o = R(0, 9) == 0 ? edge(rng, -1, gbs) : R(0, gbs - 1);
    try {
      gather_sequences(got.view(), order.data(), order.size(), R(0, 3));
      ++gathered;
    } catch (const std::invalid_argument&) {
      ++rejected;
    }
  }
  std::printf("mode=source iterations=%ld served=%ld gathered=%ld rejected=%ld\n", iterations,
              served, gathered, rejected);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "state") == 0)
    return fuzz_states(argc > 2 ? std::atol(argv[2]) : 20000);
  if (argc > 1 && std::strcmp(argv[1], "source") == 0)
    return fuzz_source(argc > 2 ? std::atol(argv[2]) : 2000);
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
    o.distca_gpu = R(0, 1);  // distca: every GPU a server (planned at cp 1, refused otherwise)
    o.vrsp = R(0, 1);
    o.tap = R(0, 1);
    o.refine = R(0, 1);
    o.max_tile_share = 0.05 * static_cast<double>(R(0, 4));
    if (valid) {
      L.pool = i64(1) << R(0, 2);
      L.dp = L.pool * R(1, 3);
      L.cp = o.system == System::Distca && o.distca_gpu ? 1 : i64(1) << R(0, 2);
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
