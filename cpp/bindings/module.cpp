// pybind11 binding of the planner core: libra_ext._planner. The only file that includes Python.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <utility>

#include "libra/generators.h"
#include "libra/moe.h"
#include "libra/packing.h"
#include "libra/plan.h"
#include "libra/vrsp.h"
#include "libra/workload.h"

namespace py = pybind11;
using namespace libra;

namespace {

// Hand a vector's buffer to numpy without copying: the capsule owns the moved vector.
template <typename T, typename A>
py::array_t<T> to_numpy(std::vector<T, A>&& v) {
  auto* heap = new std::vector<T, A>(std::move(v));
  py::capsule owner(heap, [](void* p) { delete static_cast<std::vector<T, A>*>(p); });
  return py::array_t<T>(static_cast<py::ssize_t>(heap->size()), heap->data(), owner);
}

py::dict plan_to_dict(StepPlan&& p) {
  py::dict d;
  d["system"] = system_name(p.system);
  for (auto [k, v] : {std::pair<const char*, i64>{"dp", p.dp}, {"cp", p.cp}, {"tp", p.tp},
                      {"pool", p.pool}, {"context", p.context}, {"slots", p.slots},
                      {"exchange_pool", p.exchange_pool}, {"heads_local", p.heads_local},
                      {"kv_heads_local", p.kv_heads_local}, {"head_dim", p.head_dim},
                      {"dtype_bytes", p.dtype_bytes}})
    d[k] = v;
#define LIBRA_ARR(name) d[#name] = to_numpy(std::move(p.name))
  LIBRA_ARR(seq_doc_offsets); LIBRA_ARR(doc_lengths); LIBRA_ARR(doc_ids);
  LIBRA_ARR(seq_replica); LIBRA_ARR(seq_slot);
  LIBRA_ARR(tile_seq); LIBRA_ARR(tile_doc); LIBRA_ARR(tile_doc_count); LIBRA_ARR(tile_q_start); LIBRA_ARR(tile_q_len);
  LIBRA_ARR(tile_head_start); LIBRA_ARR(tile_head_count); LIBRA_ARR(tile_kv_start);
  LIBRA_ARR(tile_kv_len); LIBRA_ARR(tile_owner); LIBRA_ARR(tile_executor); LIBRA_ARR(tile_cp);
  LIBRA_ARR(tile_pairs);
  LIBRA_ARR(xchg_q); LIBRA_ARR(xchg_kv); LIBRA_ARR(xchg_o);
  LIBRA_ARR(send_order); LIBRA_ARR(send_group_offsets);
  LIBRA_ARR(kv_group); LIBRA_ARR(kv_src); LIBRA_ARR(kv_dst); LIBRA_ARR(kv_seq);
  LIBRA_ARR(kv_start); LIBRA_ARR(kv_len); LIBRA_ARR(kv_head);
  LIBRA_ARR(rank_load); LIBRA_ARR(rank_load_before); LIBRA_ARR(group_load);
  LIBRA_ARR(rank_bytes_sent); LIBRA_ARR(phase_ms);
#undef LIBRA_ARR
  for (auto [k, v] : {std::pair<const char*, double>{"max_over_mean", p.max_over_mean},
                      {"max_over_mean_before", p.max_over_mean_before},
                      {"inter_pool_imbalance", p.inter_pool_imbalance},
                      {"inter_pool_imbalance_before", p.inter_pool_imbalance_before},
                      {"pool_total_imbalance", p.pool_total_imbalance},
                      {"pool_total_imbalance_before", p.pool_total_imbalance_before},
                      {"vrsp_max_group", p.vrsp_max_group},
                      {"vrsp_lower_bound", p.vrsp_lower_bound},
                      {"vrsp_max_pool", p.vrsp_max_pool},
                      {"vrsp_pool_lower_bound", p.vrsp_pool_lower_bound},
                      {"achievable_max_over_mean", p.achievable_max_over_mean},
                      {"moved_token_fraction", p.moved_token_fraction},
                      {"total_bytes", p.total_bytes}, {"plan_ms", p.plan_ms}})
    d[k] = v;
  d["hash"] = p.hash;
  return d;
}

}  // namespace

PYBIND11_MODULE(_planner, m) {
  m.doc() = "Libra planner core (C++17): cost model, packing, generators, VRSP, TAP, baselines.";

  py::class_<ModelDims>(m, "ModelDims")
      .def(py::init<>())
      .def_readwrite("hidden", &ModelDims::hidden)
      .def_readwrite("heads", &ModelDims::heads)
      .def_readwrite("kv_heads", &ModelDims::kv_heads)
      .def_readwrite("head_dim", &ModelDims::head_dim)
      .def_readwrite("ffn", &ModelDims::ffn)
      .def_readwrite("layers", &ModelDims::layers)
      .def_readwrite("moe_topk", &ModelDims::moe_topk)
      .def_readwrite("moe_ffn", &ModelDims::moe_ffn)
      .def_readwrite("shared_ffn", &ModelDims::shared_ffn)
      .def("validate", &ModelDims::validate);

  py::class_<Layout>(m, "Layout")
      .def(py::init<>())
      .def_readwrite("dp", &Layout::dp)
      .def_readwrite("cp", &Layout::cp)
      .def_readwrite("tp", &Layout::tp)
      .def_readwrite("pool", &Layout::pool)
      .def_readwrite("context", &Layout::context)
      .def("validate", &Layout::validate);

  py::class_<PlanOptions>(m, "PlanOptions")
      .def(py::init<>())
      .def_property(
          "system", [](const PlanOptions& o) { return system_name(o.system); },
          [](PlanOptions& o, const std::string& s) { o.system = parse_system(s); })
      .def_readwrite("block", &PlanOptions::block)
      .def_readwrite("head_group", &PlanOptions::head_group)
      .def_readwrite("epsilon", &PlanOptions::epsilon)
      .def_readwrite("max_tile_share", &PlanOptions::max_tile_share)
      .def_readwrite("vrsp", &PlanOptions::vrsp)
      .def_readwrite("tap", &PlanOptions::tap)
      .def_readwrite("refine", &PlanOptions::refine)
      .def_readwrite("max_refine_moves", &PlanOptions::max_refine_moves)
      .def_readwrite("distca_tolerance", &PlanOptions::distca_tolerance)
      .def_readwrite("dtype_bytes", &PlanOptions::dtype_bytes)
      .def_readwrite("wlb_outlier_len", &PlanOptions::wlb_outlier_len)
      .def_readwrite("wlb_max_delay", &PlanOptions::wlb_max_delay)
      .def_readwrite("wlb_release_count", &PlanOptions::wlb_release_count)
      .def_readwrite("threads", &PlanOptions::threads)
      .def_property(
          "order", [](const PlanOptions& o) { return order_name(o.order); },
          [](PlanOptions& o, const std::string& s) { o.order = parse_order(s); })
      .def_readwrite("micro_batch_size", &PlanOptions::micro_batch)
      .def("validate", &PlanOptions::validate);

  py::class_<MoeOptions>(m, "MoeOptions")
      .def(py::init<>())
      .def_readwrite("ep", &MoeOptions::ep)
      .def_readwrite("experts", &MoeOptions::experts)
      .def_readwrite("replica_slots", &MoeOptions::replica_slots)
      .def_readwrite("local_slots", &MoeOptions::local_slots)
      .def_readwrite("expert_bytes", &MoeOptions::expert_bytes)
      .def("validate", &MoeOptions::validate);

  py::class_<PlannerState>(m, "PlannerState")
      .def(py::init<>())
      .def_readonly("next_doc_id", &PlannerState::next_doc_id)
      .def_readonly("steps", &PlannerState::steps)
      .def_property_readonly("pending", &PlannerState::pending)
      .def("serialize", &PlannerState::serialize)
      .def_static("deserialize", &PlannerState::deserialize);

  py::class_<LengthDist>(m, "LengthDist")
      .def(py::init<>())
      .def_readwrite("kind", &LengthDist::kind)
      .def_readwrite("median", &LengthDist::median)
      .def_readwrite("sigma", &LengthDist::sigma)
      .def_readwrite("tail_weight", &LengthDist::tail_weight)
      .def_readwrite("tail_xm", &LengthDist::tail_xm)
      .def_readwrite("tail_alpha", &LengthDist::tail_alpha)
      .def_readwrite("long_weight", &LengthDist::long_weight)
      .def_readwrite("long_median", &LengthDist::long_median)
      .def_readwrite("long_sigma", &LengthDist::long_sigma)
      .def_readwrite("long_cap", &LengthDist::long_cap)
      .def_readwrite("min_len", &LengthDist::min_len)
      .def_readwrite("cap", &LengthDist::cap)
      .def_readwrite("values", &LengthDist::values)
      .def("validate", &LengthDist::validate);

  m.def("causal_pairs", [](i64 l) {
    if (l < 0 || l > kMaxTokens) fail("length must be in [0, 2^30], got " + std::to_string(l));
    return causal_pairs(l);
  });
  m.def("block_pairs", [](i64 a, i64 b) {
    if (a < 0 || b < a || b > kMaxTokens) fail("block rows need 0 <= a <= b <= 2^30");
    return block_pairs(a, b);
  });
  m.def("attn_fwd_flops", &attn_fwd_flops, py::arg("pairs"), py::arg("heads"), py::arg("head_dim"));
  m.def("linear_fwd_flops_per_token", [](const ModelDims& d) {
    d.validate();
    return linear_fwd_flops_per_token(d);
  });
  m.attr("ATTN_BWD_FACTOR") = kAttnBwdFactor;
  m.attr("LINEAR_BWD_FACTOR") = kLinearBwdFactor;
  m.attr("MAX_TOKENS") = kMaxTokens;

  m.def("pack_production", &pack_production, py::arg("lengths"), py::arg("context"),
        py::arg("max_sequences") = 0);
  m.def("pack_best_fit", &pack_best_fit, py::arg("lengths"), py::arg("context"));
  m.def("cu_seqlens", &cu_seqlens, py::arg("doc_lengths"));

  m.def("preset", &preset, py::arg("name"));
  m.def("preset_names", &preset_names);
  m.def("sample_lengths", &sample_lengths, py::arg("dist"), py::arg("n"), py::arg("seed"));
  m.def("step_sequences", &step_sequences, py::arg("dist"), py::arg("gbs"), py::arg("context"),
        py::arg("seed"), py::arg("step"), py::arg("shuffle_window") = 1,
        py::call_guard<py::gil_scoped_release>());
  m.def("window_sequences", &window_sequences, py::arg("dist"), py::arg("gbs"),
        py::arg("context"), py::arg("seed"), py::arg("window"), py::arg("shuffle_window"),
        py::call_guard<py::gil_scoped_release>());

  m.def("exact_cardinality_lpt", &exact_cardinality_lpt, py::arg("loads"), py::arg("n_groups"),
        py::arg("cardinality"));
  m.def("exact_cardinality_lower_bound", &exact_cardinality_lower_bound, py::arg("loads"),
        py::arg("n_groups"), py::arg("cardinality"));

  using I64Array = py::array_t<i64, py::array::c_style | py::array::forcecast>;
  auto moe_dict = [](MoePlan&& p) {
        py::dict d;
        d["ep"] = p.ep;
        d["experts"] = p.experts;
        d["host_offsets"] = to_numpy(std::move(p.host_offsets));
        d["hosts"] = to_numpy(std::move(p.hosts));
        d["assign"] = to_numpy(std::move(p.assign));
        d["rank_tokens_before"] = to_numpy(std::move(p.rank_tokens_before));
        d["rank_tokens_after"] = to_numpy(std::move(p.rank_tokens_after));
        for (auto [k, v] : {std::pair<const char*, i64>{"replicas_local", p.replicas_local},
                            {"replicas_balance", p.replicas_balance},
                            {"remote_tokens_before", p.remote_tokens_before},
                            {"remote_tokens_after", p.remote_tokens_after}})
          d[k] = v;
        for (auto [k, v] : {std::pair<const char*, double>{"max_over_mean_before",
                                                            p.max_over_mean_before},
                            {"max_over_mean_after", p.max_over_mean_after},
                            {"bytes_moved", p.bytes_moved},
                            {"plan_ms", p.plan_ms}})
          d[k] = v;
        return d;
  };
  auto vec = [](const I64Array& a) { return std::vector<i64>(a.data(), a.data() + a.size()); };
  m.def(
      "moe_plan",
      [moe_dict, vec](const I64Array& counts, const MoeOptions& options) {
        std::vector<i64> c = vec(counts);
        MoePlan p;
        {
          py::gil_scoped_release release;
          p = moe_plan(c, options);
        }
        return moe_dict(std::move(p));
      },
      py::arg("counts"), py::arg("options"));
  m.def(
      "moe_shard",
      [moe_dict, vec](const I64Array& counts, const MoeOptions& options,
                      const I64Array& host_offsets, const I64Array& hosts) {
        std::vector<i64> c = vec(counts), off = vec(host_offsets), h = vec(hosts);
        MoePlan p;
        {
          py::gil_scoped_release release;
          p = moe_shard(c, options, off, h);
        }
        return moe_dict(std::move(p));
      },
      py::arg("counts"), py::arg("options"), py::arg("host_offsets"), py::arg("hosts"));

  m.def(
      "plan_step",
      [](const std::vector<std::vector<i64>>& sequences, const Layout& layout,
         const ModelDims& model, const PlanOptions& options, PlannerState* state, bool flush) {
        StepPlan plan;
        {
          py::gil_scoped_release release;  // the sampler plans from a background thread
          plan = plan_step(sequences, layout, model, options, state, flush);
        }
        return plan_to_dict(std::move(plan));
      },
      py::arg("sequences"), py::arg("layout"), py::arg("model"), py::arg("options"),
      py::arg("state") = nullptr, py::arg("flush") = false);

  m.def(
      "plan_hashes",
      [](const std::vector<std::vector<i64>>& sequences, const Layout& layout,
         const ModelDims& model, const PlanOptions& options, PlannerState* state, bool flush) {
        py::gil_scoped_release release;
        const StepPlan plan = plan_step(sequences, layout, model, options, state, flush);
        return std::make_pair(plan.hash, plan.compute_hash(1));
      },
      "The plan's hash as planned (arrays hashed as they were written) and recomputed from its "
      "finished arrays on one thread; the two agree.",
      py::arg("sequences"), py::arg("layout"), py::arg("model"), py::arg("options"),
      py::arg("state") = nullptr, py::arg("flush") = false);
}
