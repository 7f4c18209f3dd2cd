// pybind11 binding of the planner core: libra_ext._planner. The only file that includes Python.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <iterator>
#include <memory>
#include <thread>
#include <utility>

#include "libra/batch.h"
#include "libra/cost.h"
#include "libra/generators.h"
#include "libra/moe.h"
#include "libra/packing.h"
#include "libra/parallel.h"
#include "libra/plan.h"
#include "libra/program.h"
#include "libra/vrsp.h"
#include "libra/workload.h"

namespace py = pybind11;
using namespace libra;

namespace {

bool interpreter_exiting() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// The GIL released around planner work, taken back after it - unless the interpreter is
// exiting by then: Python (before 3.14) ends a thread that asks for the GIL during
// finalization by unwinding its stack, and unwinding through these C++ frames aborts the
// process ("terminate called without an active exception"). A daemon thread that plans (the
// sampler's) is then parked for good instead, as Python 3.14 does itself; the process exits.
// Finalization can also begin between that check and taking the GIL back: the thread is then
// ended inside PyEval_RestoreThread by a forced unwind, which may leave the destructor (hence
// noexcept(false): out of a noexcept one it would terminate the process) and pybind11, which
// rethrows it, as it leaves a thread Python ends.
class ReleaseGil {
 public:
  ReleaseGil() : state_(PyEval_SaveThread()) {}
  ReleaseGil(const ReleaseGil&) = delete;
  ReleaseGil& operator=(const ReleaseGil&) = delete;
  ~ReleaseGil() noexcept(false) {
    if (interpreter_exiting())
      for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
    PyEval_RestoreThread(state_);
  }

 private:
  PyThreadState* state_;
};

// Hand a vector's buffer to numpy without copying: the capsule owns the moved vector.
template <typename T, typename A>
py::array_t<T> to_numpy(std::vector<T, A>&& v) {
  auto* heap = new std::vector<T, A>(std::move(v));
  py::capsule owner(heap, [](void* p) { delete static_cast<std::vector<T, A>*>(p); });
  return py::array_t<T>(static_cast<py::ssize_t>(heap->size()), heap->data(), owner);
}

// --- the planner's input from Python -----------------------------------------------------------

std::string repr_of(py::handle h) {
  std::string r = py::repr(h).cast<std::string>();
  return r.size() > 60 ? r.substr(0, 57) + "..." : r;
}

// One document length: a Python int or a numpy integer (not a bool, not a float).
i64 length_of(py::handle v, const std::string& field) {
  PyObject* o = v.ptr();
  if (PyBool_Check(o) || !PyIndex_Check(o) || PyFloat_Check(o))
    fail(field + " must be an integer, got " + repr_of(v));
  int overflow = 0;
  long long x;
  if (PyLong_CheckExact(o)) {
    x = PyLong_AsLongLongAndOverflow(o, &overflow);
  } else {
    if (py::hasattr(v, "dtype") && py::str(v.attr("dtype").attr("kind")).cast<std::string>() == "b")
      fail(field + " must be an integer, got " + repr_of(v));
    py::object i = py::reinterpret_steal<py::object>(PyNumber_Index(o));
    if (!i) {
      PyErr_Clear();
      fail(field + " must be an integer, got " + repr_of(v));
    }
    x = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  }
  if (overflow != 0) fail(field + " = " + repr_of(v) + " is out of range");
  if (x == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    fail(field + " must be an integer, got " + repr_of(v));
  }
  return static_cast<i64>(x);
}

// A 1-D numpy array of document lengths, appended to `out`: integer dtypes only.
void append_array(const py::array& a, const std::string& field, std::vector<i64>& out) {
  const char kind = a.dtype().kind();
  if ((kind != 'i' && kind != 'u') || a.ndim() != 1)
    fail(field + " must be a 1-D integer array of document lengths, got a " +
         std::to_string(a.ndim()) + "-D " + py::str(a.dtype()).cast<std::string>() + " array");
  const auto n = static_cast<std::size_t>(a.shape(0));
  if (kind == 'i' && a.itemsize() == 8 && (a.flags() & py::array::c_style)) {
    const i64* data = static_cast<const i64*>(a.data());
    out.insert(out.end(), data, data + n);
    return;
  }
  py::array_t<i64> as64;
  if (kind == 'u' && a.itemsize() == 8) {
    const py::array_t<std::uint64_t, py::array::c_style | py::array::forcecast> u(a);
    for (std::size_t j = 0; j < n; ++j) {
      if (u.data()[j] > static_cast<std::uint64_t>(INT64_MAX))
        fail(field_at(field, static_cast<i64>(j)) + " = " + std::to_string(u.data()[j]) +
             " is out of range");
      out.push_back(static_cast<i64>(u.data()[j]));
    }
    return;
  }
  const py::array_t<i64, py::array::c_style | py::array::forcecast> c(a);  // exact: smaller ints
  out.insert(out.end(), c.data(), c.data() + n);
}

// The step's sequences as Python gives them: a list or tuple of lists, tuples or 1-D integer
// arrays of document lengths, read into CSR form; every bad entry is named.
PackedBatch batch_from_python(py::handle seqs) {
  if (py::hasattr(seqs, "lengths") && py::hasattr(seqs, "offsets")) {  // a Python PackedBatch
    PackedBatch b;
    b.offsets.clear();
    append_array(seqs.attr("lengths"), "lengths", b.lengths);
    append_array(seqs.attr("offsets"), "offsets", b.offsets);
    if (b.offsets.empty()) fail("offsets must hold at least one entry (0)");
    return b;
  }
  if (!PyList_Check(seqs.ptr()) && !PyTuple_Check(seqs.ptr()))
    fail("sequences must be a list of lists of document lengths, got " + repr_of(seqs));
  const py::sequence outer = py::reinterpret_borrow<py::sequence>(seqs);
  PackedBatch b;
  const std::size_t n = outer.size();
  b.offsets.reserve(n + 1);
  for (std::size_t i = 0; i < n; ++i) {
    const py::handle item = PySequence_Fast_GET_ITEM(seqs.ptr(), static_cast<Py_ssize_t>(i));
    const std::string field = field_at("sequences", static_cast<i64>(i));
    PyObject* o = item.ptr();
    if (PyList_Check(o) || PyTuple_Check(o)) {
      const Py_ssize_t m = PySequence_Fast_GET_SIZE(o);
      PyObject** items = PySequence_Fast_ITEMS(o);
      for (Py_ssize_t j = 0; j < m; ++j) {
        PyObject* v = items[j];
        if (PyLong_CheckExact(v)) {  // the common case, without building a field name
          int overflow = 0;
          const long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
          if (overflow == 0) {
            b.lengths.push_back(static_cast<i64>(x));
            continue;
          }
        }
        b.lengths.push_back(length_of(v, field_at(field, static_cast<i64>(j))));
      }
    } else if (py::isinstance<py::array>(item)) {
      append_array(py::reinterpret_borrow<py::array>(item), field, b.lengths);
    } else {
      fail(field + " must be a list of document lengths, got " + repr_of(item));
    }
    b.close_sequence();
  }
  return b;
}

// A flat int64 input array, handed to the core without a copy.
struct FlatArray {
  const i64* data = nullptr;
  std::size_t size = 0;
};

FlatArray flat_array(const py::buffer& buf, const char* field) {
  const py::buffer_info info = buf.request();
  const bool int64 = info.itemsize == 8 && (info.format == "q" || info.format == "l" ||
                                            info.format == "<q" || info.format == "<l" ||
                                            info.format == "=q" || info.format == "=l");
  if (!int64 || info.ndim != 1 || (info.shape[0] > 1 && info.strides[0] != 8))
    fail(std::string(field) + " must be a 1-D contiguous int64 array, got format '" + info.format +
         "', " + std::to_string(info.ndim) + "-D");
  return {static_cast<const i64*>(info.ptr), static_cast<std::size_t>(info.shape[0])};
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

// The option and layout types, with their validators.
void bind_types(py::module_& m) {
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

  m.attr("COST_BINS") = kCostBins;
  m.attr("COST_FEATURES") = kCostFeatures;
  m.def("cost_bin", [](i64 kv_len) {
    if (kv_len < 1 || kv_len > kMaxTokens) fail("kv_len must be in [1, 2^30], got " + std::to_string(kv_len));
    return cost_bin(kv_len);
  }, py::arg("kv_len"), "The half-octave bin of an attended length (see cpp/include/libra/cost.h).");
  m.def("cost_features", [](i64 q_len, i64 kv_len, i64 heads) {
    if (kv_len < 1 || kv_len > kMaxTokens) fail("kv_len must be in [1, 2^30], got " + std::to_string(kv_len));
    if (q_len < 0 || q_len > kv_len) fail("q_len must be in [0, kv_len], got " + std::to_string(q_len));
    if (heads < 1 || heads > kMaxSplit) fail("heads must be in [1, 2^16], got " + std::to_string(heads));
    std::vector<double> f(static_cast<std::size_t>(kCostFeatures), 0.0);
    add_segment_features(f.data(), q_len, kv_len, heads);
    return f;
  }, py::arg("q_len"), py::arg("kv_len"), py::arg("heads"),
  "One segment's features as the core computes them (see cpp/include/libra/cost.h).");
  py::class_<CostModel>(m, "CostModel")
      .def(py::init<>())
      .def_property(
          "per_pair", [](const CostModel& c) { return c.per_pair; },
          [](CostModel& c, const std::vector<double>& v) {
            c.per_pair = v;
            c.unprepare();  // the O(1) tables were made from the old entries
          })
      .def_readwrite("per_row", &CostModel::per_row)
      .def_readwrite("per_segment", &CostModel::per_segment)
      .def_readwrite("per_rank", &CostModel::per_rank)
      .def_property_readonly("active", &CostModel::active)
      .def("validate", &CostModel::validate)
      .def("segment", [](const CostModel& c, i64 q_len, i64 kv_len, i64 heads) {
        c.validate();
        if (!c.active()) fail("segment: the cost model has no table");
        if (kv_len < 1 || kv_len > kMaxTokens) fail("kv_len must be in [1, 2^30], got " + std::to_string(kv_len));
        if (q_len < 0 || q_len > kv_len) fail("q_len must be in [0, kv_len], got " + std::to_string(q_len));
        if (heads < 1 || heads > kMaxSplit) fail("heads must be in [1, 2^16], got " + std::to_string(heads));
        return c.segment(q_len, kv_len, heads);
      }, py::arg("q_len"), py::arg("kv_len"), py::arg("heads"))
      .def("rows", [](const CostModel& c, i64 a, i64 b, i64 heads) {
        c.validate();
        if (!c.active()) fail("rows: the cost model has no table");
        if (b < 1 || b > kMaxTokens) fail("b must be in [1, 2^30], got " + std::to_string(b));
        if (a < 0 || a >= b) fail("a must be in [0, b), got " + std::to_string(a));
        if (heads < 1 || heads > kMaxSplit) fail("heads must be in [1, 2^16], got " + std::to_string(heads));
        return c.rows(a, b, heads);
      }, py::arg("a"), py::arg("b"), py::arg("heads"),
      "Rows [a, b) of a document as the planner prices a tile (see cost.h).")
      .def("prepared", [](const CostModel& c) {
        c.validate();
        CostModel m = c;
        m.prepare();
        return m;
      }, "A copy with its O(1) price tables made, as the planner prices with it (see cost.h).")
      .def("tail_start", [](const CostModel& c, i64 lo, i64 hi, i64 b, i64 heads, double want) {
        c.validate();
        if (!c.active()) fail("tail_start: the cost model has no table");
        if (b < 2 || b > kMaxTokens) fail("b must be in [2, 2^30], got " + std::to_string(b));
        if (lo < 1 || lo >= b) fail("lo must be in [1, b), got " + std::to_string(lo));
        if (hi < lo || hi >= b) fail("hi must be in [lo, b), got " + std::to_string(hi));
        if (heads < 1 || heads > kMaxSplit) fail("heads must be in [1, 2^16], got " + std::to_string(heads));
        if (!std::isfinite(want)) fail("want must be finite, got " + std::to_string(want));
        CostModel m = c;
        m.prepare();
        return m.tail_start(lo, hi, b, heads, want);
      }, py::arg("lo"), py::arg("hi"), py::arg("b"), py::arg("heads"), py::arg("want"),
      "The smallest c in [lo, hi] with rows(c, b, heads) <= want (hi when none), priced as "
      "the planner prices (prepared); TAP's cut of a tile's tail rows.")
      .def("prefix_end", [](const CostModel& c, i64 lo, i64 hi, i64 heads, double want) {
        c.validate();
        if (!c.active()) fail("prefix_end: the cost model has no table");
        if (lo < 1 || lo > kMaxTokens) fail("lo must be in [1, 2^30], got " + std::to_string(lo));
        if (hi < lo || hi > kMaxTokens) fail("hi must be in [lo, 2^30], got " + std::to_string(hi));
        if (heads < 1 || heads > kMaxSplit) fail("heads must be in [1, 2^16], got " + std::to_string(heads));
        if (!std::isfinite(want)) fail("want must be finite, got " + std::to_string(want));
        CostModel m = c;
        m.prepare();
        return m.prefix_end(lo, hi, heads, want);
      }, py::arg("lo"), py::arg("hi"), py::arg("heads"), py::arg("want"),
      "The smallest c in [lo, hi] with rows(0, c, heads) >= want (hi when none before it), "
      "priced as the planner prices (prepared); where TAP re-cuts a fragmented document.");
  m.def("nnls_normal", [](const std::vector<double>& G, const std::vector<double>& b,
                          const std::vector<double>& prior, double alpha, i64 max_sweeps) {
    NnlsResult r;
    {
      ReleaseGil release;
      r = nnls_normal(G, b, prior, alpha, max_sweeps);
    }
    return py::make_tuple(r.x, r.sweeps, r.converged);
  }, py::arg("G"), py::arg("b"), py::arg("prior"), py::arg("alpha"), py::arg("max_sweeps") = 20000,
  "Non-negative least squares on normal equations, pulled towards prior (see cost.h): (x, sweeps, converged).");

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
      .def_property(
          "distca_server", [](const PlanOptions& o) { return std::string(o.distca_gpu ? "gpu" : "replica"); },
          [](PlanOptions& o, const std::string& s) {
            if (s != "gpu" && s != "replica")
              fail("distca_server must be one of replica, gpu; got '" + s + "'");
            o.distca_gpu = s == "gpu";
          })
      .def_readwrite("dtype_bytes", &PlanOptions::dtype_bytes)
      .def_readwrite("wlb_outlier_len", &PlanOptions::wlb_outlier_len)
      .def_readwrite("wlb_max_delay", &PlanOptions::wlb_max_delay)
      .def_readwrite("wlb_release_count", &PlanOptions::wlb_release_count)
      .def_readwrite("threads", &PlanOptions::threads)
      .def_property(
          "order", [](const PlanOptions& o) { return order_name(o.order); },
          [](PlanOptions& o, const std::string& s) { o.order = parse_order(s); })
      .def_readwrite("micro_batch_size", &PlanOptions::micro_batch)
      .def_property(
          "cost", [](PlanOptions& o) -> CostModel& { return o.cost; },
          [](PlanOptions& o, const CostModel& c) {
            o.cost = c;
            o.cost.prepare();  // once here, not in every plan
          },
          py::return_value_policy::reference_internal)
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
      .def_static("deserialize", &PlannerState::deserialize)
      .def("validate", &PlannerState::validate, py::arg("layout"), py::arg("options"));

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

}

// Cost model, packing, length generators and the step source.
void bind_workload(py::module_& m) {
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
  m.def(
      "block_pool",
      [] {
        const PoolStats s = pool_stats();
        py::dict d;
        d["kept_bytes"] = s.kept_bytes;
        d["reused"] = s.reused;
        d["fresh"] = s.fresh;
        d["evicted"] = s.evicted;
        return d;
      },
      "The plan arrays' block pool: bytes kept for reuse, and how many blocks of at least 64 "
      "KiB were handed out again (reused), taken from the system (fresh) or given back to it to "
      "make room for another size (evicted).");
  m.def("usable_cores", &usable_cores, "Cores this process may run on (its affinity mask).");
  m.def("idle_cores", &idle_cores,
        "Usable cores that no other runnable thread holds right now (at least 1): what automatic "
        "planner threads are capped at.");
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
  auto batch_arrays = [](PackedBatch&& b) {
    return py::make_tuple(to_numpy(std::move(b.lengths)), to_numpy(std::move(b.offsets)));
  };
  m.def(
      "step_sequences",
      [](const LengthDist& dist, i64 gbs, i64 context, u64 seed, i64 step, i64 shuffle_window,
         i64 threads) {
        PackedBatch b;
        {
          ReleaseGil release;
          b = step_sequences(dist, gbs, context, seed, step, shuffle_window, threads);
        }
        return b.nested();
      },
      "The step's packed sequences as nested lists (see step_batch).", py::arg("dist"),
      py::arg("gbs"), py::arg("context"), py::arg("seed"), py::arg("step"),
      py::arg("shuffle_window") = 1, py::arg("threads") = 0);
  m.def(
      "check_fast_lengths",
      [](const LengthDist& dist, u64 seed, i64 n) {
        if (n < 0 || n > (i64(1) << 32)) fail("n must be in [0, 2^32], got " + std::to_string(n));
        FastLengthCheck c;
        {
          ReleaseGil release;
          c = check_fast_lengths(dist, seed, static_cast<std::size_t>(n));
        }
        return py::make_tuple(c.draws, c.mismatches, c.exact);
      },
      "(draws, mismatches, exact): the draw lengths' fast path against their definition (libm "
      "for every draw) on n draws of the stream `seed` plus edge draws; mismatches must be 0, "
      "exact counts the draws the fast path handed to libm.",
      py::arg("dist"), py::arg("seed"), py::arg("n"));
  py::class_<WindowCache>(m, "WindowCache",
                          "A source's current shuffled window; step() serves step_sequences' "
                          "steps from it, making a window once for its shuffle_window steps and "
                          "reusing the window's buffers for the next one.")
      .def(py::init<LengthDist, i64>(), py::arg("dist"), py::arg("shuffle_window"))
      .def(
          "step",
          [batch_arrays](WindowCache& cache, i64 gbs, i64 context, u64 seed, i64 step,
                         i64 threads) {
            PackedBatch b;
            {
              ReleaseGil release;
              b = cache.step(gbs, context, seed, step, threads);
            }
            return batch_arrays(std::move(b));
          },
          "(lengths, offsets) of the step, in CSR form: step_sequences' sequences.",
          py::arg("gbs"), py::arg("context"), py::arg("seed"), py::arg("step"),
          py::arg("threads") = 0)
      .def_property_readonly("shuffle_window", &WindowCache::shuffle_window);
  m.def(
      "window_batch",
      [](const LengthDist& dist, i64 gbs, i64 context, u64 seed, i64 window, i64 shuffle_window,
         i64 threads) {
        ShuffledWindow w;
        {
          ReleaseGil release;
          w = window_stream(dist, gbs, context, seed, window, shuffle_window, threads);
        }
        return py::make_tuple(to_numpy(std::move(w.stream.lengths)),
                              to_numpy(std::move(w.stream.offsets)), to_numpy(std::move(w.order)));
      },
      "(lengths, offsets, order): the W*B packed sequences of steps [window*W, (window+1)*W) in "
      "stream order, in CSR form, and the stream sequence at each shuffled position (step k of "
      "the window takes positions [k*B, (k+1)*B); gather_sequences makes it).",
      py::arg("dist"), py::arg("gbs"), py::arg("context"), py::arg("seed"), py::arg("window"),
      py::arg("shuffle_window"), py::arg("threads") = 0);
  m.def(
      "gather_sequences",
      [batch_arrays](const py::buffer& lengths, const py::buffer& offsets, const py::buffer& order,
                     i64 threads) {
        const FlatArray l = flat_array(lengths, "lengths"), o = flat_array(offsets, "offsets"),
                        k = flat_array(order, "order");
        if (o.size == 0) fail("offsets must hold at least one entry (0)");
        PackedBatch b;
        {
          ReleaseGil release;
          b = gather_sequences(SequencesView{l.data, o.data, o.size - 1, l.size}, k.data, k.size,
                               threads);
        }
        return batch_arrays(std::move(b));
      },
      "(lengths, offsets) of sequences order[0], order[1], ... of a CSR batch, copied on "
      "`threads` threads (0 = automatic; the result does not depend on it).",
      py::arg("lengths"), py::arg("offsets"), py::arg("order"), py::arg("threads") = 1);

}

// VRSP's building blocks and the step planner.
void bind_planner(py::module_& m) {
  m.def("exact_cardinality_lpt", &exact_cardinality_lpt, py::arg("loads"), py::arg("n_groups"),
        py::arg("cardinality"));
  m.def("exact_cardinality_lower_bound", &exact_cardinality_lower_bound, py::arg("loads"),
        py::arg("n_groups"), py::arg("cardinality"));

  m.def(
      "plan_step",
      [](py::handle sequences, const Layout& layout, const ModelDims& model,
         const PlanOptions& options, PlannerState* state, bool flush) {
        const PackedBatch batch = batch_from_python(sequences);
        StepPlan plan;
        {
          ReleaseGil release;  // the sampler plans from a background thread
          plan = plan_step(batch.view(), layout, model, options, state, flush);
        }
        return plan_to_dict(std::move(plan));
      },
      "Plan one step from nested lists (or 1-D integer arrays) of document lengths.",
      py::arg("sequences"), py::arg("layout"), py::arg("model"), py::arg("options"),
      py::arg("state") = nullptr, py::arg("flush") = false);
  m.def(
      "plan_step_flat",
      [](const py::buffer& lengths, const py::buffer& offsets, const Layout& layout,
         const ModelDims& model, const PlanOptions& options, PlannerState* state, bool flush) {
        const FlatArray l = flat_array(lengths, "lengths"), o = flat_array(offsets, "offsets");
        if (o.size == 0) fail("offsets must hold at least one entry (0)");
        const SequencesView view{l.data, o.data, o.size - 1, l.size};
        StepPlan plan;
        {
          // the buffers stay alive (and must not be written) while the core reads them
          ReleaseGil release;
          plan = plan_step(view, layout, model, options, state, flush);
        }
        return plan_to_dict(std::move(plan));
      },
      "Plan one step from the sequences in CSR form: sequence s holds the document lengths "
      "lengths[offsets[s]:offsets[s + 1]] (1-D contiguous int64 arrays, read without a copy).",
      py::arg("lengths"), py::arg("offsets"), py::arg("layout"), py::arg("model"),
      py::arg("options"), py::arg("state") = nullptr, py::arg("flush") = false);

  m.def(
      "plan_hashes",
      [](py::handle sequences, const Layout& layout, const ModelDims& model,
         const PlanOptions& options, PlannerState* state, bool flush) {
        const PackedBatch batch = batch_from_python(sequences);
        ReleaseGil release;
        const StepPlan plan = plan_step(batch.view(), layout, model, options, state, flush);
        return std::make_pair(plan.hash, plan.compute_hash(1));
      },
      "The plan's hash as planned (arrays hashed as they were written) and recomputed from its "
      "finished arrays on one thread; the two agree.",
      py::arg("sequences"), py::arg("layout"), py::arg("model"), py::arg("options"),
      py::arg("state") = nullptr, py::arg("flush") = false);
}

// The MoE expert-balancing plan.
void bind_moe(py::module_& m) {
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
          ReleaseGil release;
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
          ReleaseGil release;
          p = moe_shard(c, options, off, h);
        }
        return moe_dict(std::move(p));
      },
      py::arg("counts"), py::arg("options"), py::arg("host_offsets"), py::arg("hosts"));

}

// Per-slot attention programs (libra_ext.attention.meta.compile_slot). compile_slots reads the
// plan's arrays with the GIL held and compiles and stages without it; each program comes back
// as a CompiledProgram handle (the C++ program itself) and its staged buffer. The handle's
// `unpack` makes the nested tuples meta reads - on the thread that runs the program - so the
// sampler's thread makes four Python objects per slot (the handle, the staged buffer, its sizes
// and the backward order) while a thread launching kernels waits on the GIL.
void bind_program(py::module_& m) {
  using I64Array = py::array_t<i64, py::array::c_style | py::array::forcecast>;
  auto vec1d = [](const std::vector<i64>& v) {
    return py::array_t<i64>(static_cast<py::ssize_t>(v.size()), v.data());
  };
  // `arrays` false: the calls' cu_q / cu_k and the gathers' runs are None (a staged program
  // is uploaded from its staged buffer, which holds them)
  auto call = [vec1d](const ProgCall& c, bool arrays) -> py::tuple {
    if (!arrays) return py::make_tuple(c.hc, c.hk, py::none(), py::none(), c.max_q, c.max_k);
    return py::make_tuple(c.hc, c.hk, vec1d(c.cu_q), vec1d(c.cu_k), c.max_q, c.max_k);
  };
  auto gather = [vec1d](const ProgGather& g, bool arrays) -> py::tuple {
    if (!arrays) return py::make_tuple(py::none(), g.size);
    const py::ssize_t n = static_cast<py::ssize_t>(g.runs.size() / 4);
    return py::make_tuple(vec1d(g.runs).reshape({n, py::ssize_t(4)}), g.size);
  };
  auto packs = [call, gather](const std::vector<ProgPack>& ps, bool arrays) {
    py::list out;
    for (const ProgPack& p : ps)
      out.append(py::make_tuple(call(p.call, arrays), gather(p.q, arrays), gather(p.k, arrays)));
    return out;
  };
  // flat (member, ...) entries of n values each -> a list of n-tuples
  auto tuples = [](const std::vector<i64>& flat, std::size_t n) {
    py::list out(flat.size() / n);
    for (std::size_t i = 0, k = 0; i + n <= flat.size(); i += n, ++k) {
      py::tuple t(n);
      for (std::size_t j = 0; j < n; ++j) t[j] = py::int_(flat[i + j]);
      out[k] = std::move(t);
    }
    return out;
  };
  py::class_<Program>(m, "CompiledProgram",
                      "One slot's attention program as the C++ compiler made it (unpack: its "
                      "nested tuples).")
      .def(
          "unpack",
          [call, gather, packs, tuples](const Program& prog, bool arrays) {
            py::list subs;
            for (const ProgSub& sc : prog.subchunks)
              subs.append(py::make_tuple(
                  sc.direct, sc.part, py::cast(sc.q_send), py::cast(sc.kv_send),
                  py::cast(sc.q_recv), py::cast(sc.kv_recv), sc.q_send_off, sc.kv_send_off,
                  sc.has_call ? py::object(call(sc.call, arrays)) : py::object(py::none()),
                  packs(sc.packs, arrays), tuples(sc.q_ranges, 3), tuples(sc.kv_ranges, 3),
                  tuples(sc.q_recv_ranges, 2), tuples(sc.kv_recv_ranges, 2)));
            return py::make_tuple(prog.t, prog.tokens, prog.executed, call(prog.direct, arrays),
                                  packs(prog.lpacks, arrays), subs, gather(prog.send_q, arrays),
                                  gather(prog.send_kv, arrays));
          },
          "(t, tokens, tiles executed, direct call, local packs, sub-chunks, send_q, "
          "send_kv): a call is (hc, hk, cu_q, cu_k, max_q, max_k), a gather (runs [n, 4], "
          "size), a pack (call, q, k), a sub-chunk (direct, part, q_send, kv_send, q_recv, "
          "kv_recv, q_send_off, kv_send_off, call or None, packs, then its ranges sent - lists "
          "of (member, vectors, first vector or -1) - and received - lists of (member, vectors) "
          "- for Q and for K/V). Without `arrays`, every cu_q, cu_k and runs is None.",
          py::arg("arrays") = true)
      .def(
          "features",
          [](const Program& prog) {
            std::vector<double> f(static_cast<std::size_t>(kCostFeatures), 0.0);
            {
              ReleaseGil release;
              add_program_features(prog, f.data());
            }
            return py::array_t<double>(static_cast<py::ssize_t>(f.size()), f.data());
          },
          "The cost-model features [FEATURES] of every segment of the program's calls, the "
          "constant 0 (libra_ext.costmodel.call_features over its calls, but the constant).");
  m.def(
      "compile_slots",
      [](py::object plan, i64 replica, const std::vector<i64>& slots, i64 chunks) {
        ProgramPlan p;
        static constexpr std::pair<const char*, i64 ProgramPlan::*> kScalars[] = {
            {"dp", &ProgramPlan::dp},
            {"slots", &ProgramPlan::slots},
            {"cp", &ProgramPlan::cp},
            {"exchange_pool", &ProgramPlan::exchange_pool},
            {"heads_local", &ProgramPlan::heads_local},
            {"kv_heads_local", &ProgramPlan::kv_heads_local},
            {"head_dim", &ProgramPlan::head_dim}};
        static constexpr std::pair<const char*, ArrayView ProgramPlan::*> kArrays[] = {
            {"doc_lengths", &ProgramPlan::doc_lengths},
            {"seq_doc_offsets", &ProgramPlan::seq_doc_offsets},
            {"seq_replica", &ProgramPlan::seq_replica},
            {"seq_slot", &ProgramPlan::seq_slot},
            {"send_order", &ProgramPlan::send_order},
            {"send_group_offsets", &ProgramPlan::send_group_offsets},
            {"tile_doc", &ProgramPlan::tile_doc},
            {"tile_doc_count", &ProgramPlan::tile_doc_count},
            {"tile_q_start", &ProgramPlan::tile_q_start},
            {"tile_q_len", &ProgramPlan::tile_q_len},
            {"tile_kv_start", &ProgramPlan::tile_kv_start},
            {"tile_kv_len", &ProgramPlan::tile_kv_len},
            {"tile_head_start", &ProgramPlan::tile_head_start},
            {"tile_head_count", &ProgramPlan::tile_head_count},
            {"tile_owner", &ProgramPlan::tile_owner},
            {"tile_executor", &ProgramPlan::tile_executor},
            {"tile_cp", &ProgramPlan::tile_cp}};
        for (const auto& [name, field] : kScalars) p.*field = plan.attr(name).cast<i64>();
        std::vector<I64Array> keep;  // the arrays the views read, alive until the compile ends
        keep.reserve(std::size(kArrays));
        for (const auto& [name, field] : kArrays) {
          keep.emplace_back(I64Array::ensure(plan.attr(name)));
          if (!keep.back()) fail(std::string("plan.") + name + " must be an integer array");
          if (keep.back().ndim() != 1) fail(std::string("plan.") + name + " must be 1-D");
          p.*field = ArrayView{keep.back().data(), static_cast<i64>(keep.back().size())};
        }
        for (const auto& [name, field] : {std::pair{"xchg_q", &ProgramPlan::xchg_q},
                                          std::pair{"xchg_kv", &ProgramPlan::xchg_kv}}) {
          keep.emplace_back(I64Array::ensure(plan.attr(name)));
          if (!keep.back()) fail(std::string("plan.") + name + " must be an integer array");
          if (keep.back().ndim() != 3) fail(std::string("plan.") + name + " must be 3-D");
          p.*field = ArrayView{keep.back().data(), static_cast<i64>(keep.back().size())};
        }
        const std::size_t n = slots.size();
        std::vector<Program> progs(n);
        std::vector<std::vector<std::int32_t>> flats(n);
        std::vector<std::vector<i64>> sizes(n);
        std::vector<char> fits(n, 0), early(n, 0);
        {
          ReleaseGil release;  // compiled and staged without it
          for (std::size_t i = 0; i < n; ++i) {
            progs[i] = compile_slot_program(p, replica, slots[i], chunks);
            fits[i] = stage_program(progs[i], flats[i], sizes[i]);
            early[i] = early_returns(p, replica, slots[i]);
          }
        }
        py::list out(n);
        for (std::size_t i = 0; i < n; ++i)
          out[i] = py::make_tuple(
              py::cast(std::move(progs[i])),
              fits[i] ? py::object(to_numpy(std::move(flats[i]))) : py::object(py::none()),
              fits[i] ? py::object(to_numpy(std::move(sizes[i]))) : py::object(py::none()),
              py::bool_(early[i] != 0));
        return out;
      },
      "The attention programs of (replica, slot) for each of `slots` of a StepPlan (libra, "
      "distca, ulysses), each as (CompiledProgram, staged, sizes, early_returns): the program, "
      "its arrays as one int32 buffer in meta._walk's order with their sizes (both None when "
      "an entry does not fit in int32), and its group's backward order under rebuild "
      "(meta.early_return_groups). The plan is read once; the GIL is released while they "
      "compile.",
      py::arg("plan"), py::arg("replica"), py::arg("slots"), py::arg("chunks"));
}

PYBIND11_MODULE(_planner, m) {
  m.doc() = "Libra planner core (C++17): cost model, packing, generators, VRSP, TAP, baselines.";

  bind_types(m);
  bind_workload(m);
  bind_planner(m);
  bind_moe(m);
  bind_program(m);
}
