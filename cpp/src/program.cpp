// Per-slot attention programs (see program.h): O(documents + tiles) work, no Python, run with
// the GIL released. Every step mirrors a function of libra_ext/attention/meta.py (named in the
// comments); the two give identical programs (tests/unit/test_attention_meta.py).
#include "libra/program.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <string>
#include <tuple>

#include "libra/cost.h"

namespace libra {
namespace {

using V = std::vector<i64>;

constexpr i64 kMinMaxSeqlen = 128;  // kernels.MIN_MAX_SEQLEN
constexpr i64 kClassKey = 1000003;  // (heads, KV heads) class key: hc * kClassKey + hk

i64 at(const ArrayView& a, i64 i, const char* field) {
  if (i < 0 || i >= a.size)
    fail(std::string("plan.") + field + ": index " + std::to_string(i) + " outside its " +
         std::to_string(a.size) + " entries");
  return a.data[i];
}

// meta.rounded_max
i64 rounded_max(const V& x) {
  i64 m = 0;
  for (i64 v : x) m = std::max(m, v);
  u64 y = static_cast<u64>(std::max<i64>(0, m - 1));
  int bits = 0;
  while (y) {
    ++bits;
    y >>= 1;
  }
  return std::max(kMinMaxSeqlen, i64(1) << bits);
}

// meta.CallPlan.of
ProgCall call_of(i64 hc, i64 hk, const V& q_len, const V& k_len) {
  ProgCall c;
  c.hc = hc;
  c.hk = hk;
  c.cu_q.resize(q_len.size() + 1);
  c.cu_k.resize(k_len.size() + 1);
  c.cu_q[0] = c.cu_k[0] = 0;
  for (size_t i = 0; i < q_len.size(); ++i) c.cu_q[i + 1] = c.cu_q[i] + q_len[i];
  for (size_t i = 0; i < k_len.size(); ++i) c.cu_k[i + 1] = c.cu_k[i] + k_len[i];
  c.max_q = rounded_max(q_len);
  c.max_k = rounded_max(k_len);
  return c;
}

// One run of meta.Gather.of (empty runs left out).
void add_run(ProgGather& g, i64 base, i64 rows, i64 width, i64 stride) {
  if (rows * width <= 0) return;
  g.runs.insert(g.runs.end(), {base, rows, width, stride});
  g.size += rows * width;
}

// A segment of the exchange group (meta._Segs): rows [a, b) of plan document `doc` (starting at
// `ds` in its sequence) against the prefix [0, b), heads [h0, h0 + hc), owner and executor.
struct Seg {
  i64 doc, ds, a, b, h0, hc, owner, exe;
};

// meta._merge_rows
std::vector<Seg> merge_rows(std::vector<Seg> s) {
  if (s.empty()) return s;
  std::stable_sort(s.begin(), s.end(), [](const Seg& x, const Seg& y) {
    return std::tie(x.owner, x.exe, x.doc, x.h0, x.hc, x.a) <
           std::tie(y.owner, y.exe, y.doc, y.h0, y.hc, y.a);
  });
  std::vector<Seg> out;
  for (size_t i = 0; i < s.size(); ++i) {
    const bool same = i > 0 && s[i].owner == s[i - 1].owner && s[i].exe == s[i - 1].exe &&
                      s[i].doc == s[i - 1].doc && s[i].h0 == s[i - 1].h0 &&
                      s[i].hc == s[i - 1].hc && s[i].a == s[i - 1].b;
    if (same)
      out.back().b = std::max(out.back().b, s[i].b);
    else
      out.push_back(s[i]);
  }
  return out;
}

// meta._direct_call: per document of the sequence (lengths L) its run (at most one), rows
// outside it zero-key segments, keys past it a zero-query segment, padding rows one more.
ProgCall direct_call(const V& L, const std::vector<Seg>& runs, i64 hl, i64 kvl, i64 rows) {
  const size_t n_doc = L.size();
  V a(n_doc, 0), b(n_doc, 0), q, k;
  for (const Seg& r : runs) {
    a[static_cast<size_t>(r.doc)] = r.a;
    b[static_cast<size_t>(r.doc)] = r.b;
  }
  i64 n = 0;
  for (size_t d = 0; d < n_doc; ++d) {
    n += L[d];
    const i64 qs[4] = {a[d], b[d] - a[d], L[d] - b[d], 0};
    const i64 ks[4] = {0, b[d], 0, L[d] - b[d]};
    for (int j = 0; j < 4; ++j)
      if (qs[j] > 0 || ks[j] > 0) {
        q.push_back(qs[j]);
        k.push_back(ks[j]);
      }
  }
  if (rows > n) {
    q.push_back(rows - n);
    k.push_back(0);
  }
  if (q.empty()) {
    q.push_back(0);
    k.push_back(0);
  }
  return call_of(hl, kvl, q, k);
}

// meta._Pieces: query rows r < rows of heads [h0, h0 + hc) at the vectors
// q_base + r * q_rstride + (h - q_h0), against keys r < k_rows of KV heads h / gl at
// k_base + r * k_rstride + (kv head - k_h0).
struct Piece {
  i64 q_base, q_rstride, q_h0, k_base, k_rstride, k_h0, rows, k_rows, h0, hc;
};

// A piece cut for a kernel: its source piece and (h0, hc, hk).
struct Cut {
  i64 src, h0, hc, hk;
};

// meta._native_pieces: inside one KV group (hk 1) or whole aligned groups (hk = hc / gl).
std::vector<Cut> native_pieces(const std::vector<Piece>& p, i64 gl) {
  std::vector<Cut> out;
  for (size_t i = 0; i < p.size(); ++i) {
    const i64 h0 = p[i].h0, hc = p[i].hc;
    const i64 g0 = h0 / gl, g1 = (h0 + hc - 1) / gl;
    const bool aligned = h0 % gl == 0 && hc % gl == 0;
    const i64 n = (aligned || g0 == g1) ? 1 : g1 - g0 + 1;
    for (i64 j = 0; j < n; ++j) {
      const i64 p0 = n > 1 ? std::max(h0, (g0 + j) * gl) : h0;
      const i64 p1 = n > 1 ? std::min(h0 + hc, (g0 + j + 1) * gl) : p0 + hc;
      const i64 pc = p1 - p0;
      out.push_back({static_cast<i64>(i), p0, pc, aligned && pc >= gl ? pc / gl : 1});
    }
  }
  return out;
}

// meta._two_classes: the class with the most work stays, every other piece is cut into units
// of u heads.
std::vector<Cut> two_classes(const std::vector<Cut>& c, const std::vector<Piece>& p, i64 gl) {
  V keys(c.size());
  for (size_t i = 0; i < c.size(); ++i) keys[i] = c[i].hc * kClassKey + c[i].hk;
  V uk = keys;
  std::sort(uk.begin(), uk.end());
  uk.erase(std::unique(uk.begin(), uk.end()), uk.end());
  if (uk.size() <= 2) return c;
  // the class with the most work (rows x heads); ties: more heads, then the smaller key
  i64 top = 0, top_vol = -1;
  for (i64 key : uk) {
    i64 vol = 0;
    for (size_t i = 0; i < c.size(); ++i)
      if (keys[i] == key) vol += p[static_cast<size_t>(c[i].src)].rows * c[i].hc;
    if (vol > top_vol || (vol == top_vol && key / kClassKey > top / kClassKey)) {
      top = key;
      top_vol = vol;
    }
  }
  i64 u = 0;
  bool grouped = false;
  for (size_t i = 0; i < c.size(); ++i)
    if (keys[i] != top) {
      u = std::gcd(u, c[i].hc);
      grouped |= c[i].hk > 1;
    }
  if (grouped) u = std::gcd(u, gl);
  std::vector<Cut> out;
  for (size_t i = 0; i < c.size(); ++i) {
    if (keys[i] == top) {
      out.push_back(c[i]);
      continue;
    }
    for (i64 j = 0; j < c[i].hc / u; ++j) out.push_back({c[i].src, c[i].h0 + j * u, u, 1});
  }
  return out;
}

// meta._pack_calls: at most two (heads, KV heads) classes, each piece one segment.
std::vector<ProgPack> pack_calls(const std::vector<Piece>& p, i64 gl) {
  std::vector<ProgPack> out;
  if (p.empty()) return out;
  std::vector<Cut> c = two_classes(native_pieces(p, gl), p, gl);
  V keys(c.size());
  for (size_t i = 0; i < c.size(); ++i) keys[i] = c[i].hc * kClassKey + c[i].hk;
  V uk = keys;
  std::sort(uk.begin(), uk.end());
  uk.erase(std::unique(uk.begin(), uk.end()), uk.end());
  for (i64 key : uk) {
    ProgPack pk;
    V rows, k_rows;
    i64 hc = 0, hk = 0;
    for (size_t i = 0; i < c.size(); ++i) {
      if (keys[i] != key) continue;
      const Piece& x = p[static_cast<size_t>(c[i].src)];
      hc = c[i].hc;
      hk = c[i].hk;
      add_run(pk.q, x.q_base + c[i].h0 - x.q_h0, x.rows, hc, x.q_rstride);
      add_run(pk.k, x.k_base + c[i].h0 / gl - x.k_h0, x.k_rows, hk, x.k_rstride);
      rows.push_back(x.rows);
      k_rows.push_back(x.k_rows);
    }
    pk.call = call_of(hc, hk, rows, k_rows);
    out.push_back(std::move(pk));
  }
  return out;
}

// meta._local_work: per document its last run with all heads runs directly on X; its other
// runs and every head-partial piece are packed.
void local_work(Program& prog, const V& L, const std::vector<Seg>& local, i64 hl, i64 kvl,
                i64 rows) {
  std::vector<Seg> full, last, rest;
  for (const Seg& s : local)
    if (s.hc == hl) full.push_back(s);
    else rest.push_back(s);
  for (size_t i = 0; i < full.size(); ++i)
    if (i + 1 == full.size() || full[i].doc != full[i + 1].doc)
      last.push_back(full[i]);
    else
      rest.push_back(full[i]);
  prog.direct = direct_call(L, last, hl, kvl, rows);
  std::vector<Piece> p;
  for (const Seg& r : rest)
    p.push_back({(r.ds + r.a) * hl, hl, 0, r.ds * kvl, kvl, 0, r.b - r.a, r.b, r.h0, r.hc});
  prog.lpacks = pack_calls(p, hl / kvl);
}

// meta._units: a moved segment cut per KV head, or one whole unit over all KV heads (kh = kvl).
struct Unit {
  i64 owner, exe, doc, ds, a, b, h0, hc, kh, stream;
};

struct Stream {
  i64 owner, exe, ds, kh, len, width;  // width: KV heads per row of its prefix (kvl: whole)
  bool direct;
  i64 sub;
};

// meta._units: units in canonical order (executor, owner, document, KV head, first row, first
// head), grouped into streams (document, KV heads, executor); with kvl > 1, a (document,
// executor) whose moved segments all hold the slice's hl heads moves as whole units.
void units_of(const std::vector<Seg>& moved, i64 gl, i64 kvl, std::vector<Unit>& u,
              std::vector<Stream>& st) {
  const i64 hl = gl * kvl;
  std::vector<std::pair<i64, i64>> partial;  // (executor, document) with a head-partial segment
  if (kvl > 1)
    for (const Seg& s : moved)
      if (s.hc != hl) partial.push_back({s.exe, s.doc});
  std::sort(partial.begin(), partial.end());
  for (const Seg& s : moved) {
    const bool whole = kvl > 1 && !std::binary_search(partial.begin(), partial.end(),
                                                      std::make_pair(s.exe, s.doc));
    if (whole) {
      u.push_back({s.owner, s.exe, s.doc, s.ds, s.a, s.b, 0, hl, kvl, 0});
      continue;
    }
    const i64 k0 = s.h0 / gl, k1 = (s.h0 + s.hc - 1) / gl;
    for (i64 kh = k0; kh <= k1; ++kh) {
      const i64 h0 = std::max(s.h0, kh * gl), h1 = std::min(s.h0 + s.hc, (kh + 1) * gl);
      u.push_back({s.owner, s.exe, s.doc, s.ds, s.a, s.b, h0, h1 - h0, kh, 0});
    }
  }
  std::stable_sort(u.begin(), u.end(), [](const Unit& x, const Unit& y) {
    return std::tie(x.exe, x.owner, x.doc, x.kh, x.a, x.h0) <
           std::tie(y.exe, y.owner, y.doc, y.kh, y.a, y.h0);
  });
  i64 max_doc = 0;
  for (const Unit& x : u) max_doc = std::max(max_doc, x.doc);
  i64 prev = -1;
  size_t first = 0;
  for (size_t i = 0; i <= u.size(); ++i) {
    const i64 key =
        i < u.size() ? (u[i].exe * (max_doc + 1) + u[i].doc) * (kvl + 1) + u[i].kh : -1;
    if (i > 0 && (i == u.size() || key != prev)) {  // the stream [first, i) ends
      i64 len = 0;
      for (size_t j = first; j < i; ++j) len = std::max(len, u[j].b);
      const Unit& f = u[first];
      const bool whole = f.kh == kvl;
      // the direct class: whole units with kvl > 1, one KV head's full group with kvl = 1
      const bool direct = i - first == 1 && (kvl > 1 ? whole : f.hc == gl);
      st.push_back({f.owner, f.exe, f.ds, f.kh, len, whole ? kvl : 1, direct, 0});
      first = i;
    }
    if (i < u.size()) u[i].stream = static_cast<i64>(st.size());
    prev = key;
  }
}

// meta._subchunks_of: per executor its streams cut into `chunks` parts of about equal bytes,
// each part split into its direct and its pack streams: sub-chunk = 2 part + (not direct).
void subchunks_of(std::vector<Stream>& st, const V& s_size, i64 px, i64 chunks) {
  V total(static_cast<size_t>(px), 0), pos(st.size(), 0);
  for (size_t i = 0; i < st.size(); ++i) {
    i64& t = total[static_cast<size_t>(st[i].exe)];
    pos[i] = t + s_size[i] / 2;
    t += s_size[i];
  }
  for (size_t i = 0; i < st.size(); ++i) {
    const i64 part = std::min(
        chunks - 1, pos[i] * chunks / std::max<i64>(total[static_cast<size_t>(st[i].exe)], 1));
    st[i].sub = 2 * part + (st[i].direct ? 0 : 1);
  }
}

// meta._executor_calls: what member `me` runs on what sub-chunk k brings it.
void executor_calls(ProgSub& sc, i64 k, const std::vector<Unit>& u, const V& u_sub,
                    const std::vector<Stream>& st, i64 me, i64 gl) {
  std::vector<size_t> sel;
  for (size_t i = 0; i < u.size(); ++i)
    if (u[i].exe == me && u_sub[i] == k) sel.push_back(i);
  if (sel.empty()) return;
  std::stable_sort(sel.begin(), sel.end(),
                   [&](size_t x, size_t y) { return u[x].owner < u[y].owner; });
  if (sc.direct) {  // one unit per stream, the direct class: the received buffers as they are
    V rows, ks;
    i64 kvl = 1;  // whole units, or one KV head's group
    for (size_t i : sel) {
      rows.push_back(u[i].b - u[i].a);
      ks.push_back(u[i].b);
      kvl = std::max(kvl, st[static_cast<size_t>(u[i].stream)].width);
    }
    sc.call = call_of(gl * kvl, kvl, rows, ks);
    sc.has_call = true;
    return;
  }
  std::vector<size_t> ss;
  for (size_t i = 0; i < st.size(); ++i)
    if (st[i].exe == me && st[i].sub == k) ss.push_back(i);
  std::stable_sort(ss.begin(), ss.end(),
                   [&](size_t x, size_t y) { return st[x].owner < st[y].owner; });
  V s_off(st.size(), 0);
  i64 off = 0;
  for (size_t i : ss) {
    s_off[i] = off;
    off += st[i].len * st[i].width;
  }
  std::vector<Piece> p;
  i64 q_off = 0;
  for (size_t i : sel) {
    const Unit& x = u[i];
    const i64 rows = x.b - x.a;
    const i64 width = st[static_cast<size_t>(x.stream)].width;
    p.push_back({q_off, x.hc, x.h0, s_off[static_cast<size_t>(x.stream)], width,
                 width > 1 ? 0 : x.kh, rows, x.b, x.h0, x.hc});
    q_off += rows * x.hc;
  }
  sc.packs = pack_calls(p, gl);
}

constexpr i64 kMaxInPlace = 4;  // meta.MAX_IN_PLACE

// meta._ranges: a message's items (n vectors from start, ok where contiguous) in send order
// as ranges (vectors, first vector or -1 for a range that travels gathered).
std::vector<std::pair<i64, i64>> ranges_of(const V& start, const V& n,
                                           const std::vector<char>& ok) {
  struct R {
    i64 c, x;
    bool o;
  };
  std::vector<R> rs;
  for (size_t i = 0; i < start.size(); ++i) {
    if (n[i] == 0) continue;
    const bool o = ok[i];
    if (!rs.empty() &&
        ((o && rs.back().o && rs.back().x + rs.back().c == start[i]) || (!o && !rs.back().o)))
      rs.back().c += n[i];
    else
      rs.push_back({n[i], start[i], o});
  }
  std::vector<size_t> placed;
  for (size_t i = 0; i < rs.size(); ++i)
    if (rs[i].o) placed.push_back(i);
  if (static_cast<i64>(placed.size()) > kMaxInPlace) {  // the largest stay, the earlier on ties
    std::vector<size_t> by = placed;
    std::stable_sort(by.begin(), by.end(), [&](size_t a, size_t b) { return rs[a].c > rs[b].c; });
    std::vector<char> keep(rs.size(), 0);
    for (i64 i = 0; i < kMaxInPlace; ++i) keep[by[static_cast<size_t>(i)]] = 1;
    for (size_t i : placed) rs[i].o = keep[i] != 0;
  }
  std::vector<std::pair<i64, i64>> out;
  for (const R& r : rs) {
    if (!out.empty() && !r.o && out.back().second < 0)
      out.back().first += r.c;
    else
      out.push_back({r.c, r.o ? r.x : -1});
  }
  return out;
}

// meta._message_ranges: (Q ranges, K ranges) of sub-chunk k's message from owner to exe.
std::pair<std::vector<std::pair<i64, i64>>, std::vector<std::pair<i64, i64>>> message_ranges(
    const std::vector<Unit>& u, const V& u_sub, const std::vector<Stream>& st, i64 k, i64 owner,
    i64 exe, i64 hl, i64 kvl) {
  V qs, qn, ks, kn;
  std::vector<char> qok, kok;
  for (size_t i = 0; i < u.size(); ++i) {
    const Unit& x = u[i];
    if (x.owner != owner || x.exe != exe || u_sub[i] != k) continue;
    qs.push_back((x.ds + x.a) * hl + x.h0);
    qn.push_back((x.b - x.a) * x.hc);
    qok.push_back(x.hc == hl || x.b - x.a == 1);
  }
  for (const Stream& s : st) {
    if (s.owner != owner || s.exe != exe || s.sub != k) continue;
    ks.push_back(s.ds * kvl + (s.width > 1 ? 0 : s.kh));
    kn.push_back(s.len * s.width);
    kok.push_back(s.width == kvl || s.len == 1);
  }
  return {ranges_of(qs, qn, qok), ranges_of(ks, kn, kok)};
}

// meta._exchange: the sub-chunks seen from member `me` and its send gathers.
void exchange(Program& prog, const std::vector<Seg>& moved, i64 px, i64 me, i64 chunks, i64 hl,
              i64 kvl) {
  const i64 gl = hl / kvl;
  std::vector<Unit> u;
  std::vector<Stream> st;
  units_of(moved, gl, kvl, u, st);
  if (u.empty()) return;
  V q_vec(u.size()), s_size(st.size(), 0);
  for (size_t i = 0; i < u.size(); ++i) {
    q_vec[i] = (u[i].b - u[i].a) * u[i].hc;
    s_size[static_cast<size_t>(u[i].stream)] += q_vec[i];
  }
  for (size_t i = 0; i < st.size(); ++i) s_size[i] += 2 * st[i].len * st[i].width;
  subchunks_of(st, s_size, px, chunks);
  // sub-chunks with traffic, renumbered without gaps
  V active;
  for (const Stream& s : st) active.push_back(s.sub);
  std::sort(active.begin(), active.end());
  active.erase(std::unique(active.begin(), active.end()), active.end());
  auto rank_of = [&](i64 sub) {
    return static_cast<i64>(std::lower_bound(active.begin(), active.end(), sub) - active.begin());
  };
  for (Stream& s : st) s.sub = rank_of(s.sub);
  V u_sub(u.size());
  for (size_t i = 0; i < u.size(); ++i) u_sub[i] = st[static_cast<size_t>(u[i].stream)].sub;
  const i64 n_sub = static_cast<i64>(active.size());
  // vectors per (sub-chunk, owner, executor)
  const size_t cells = static_cast<size_t>(n_sub * px * px);
  V nq(cells, 0), nkv(cells, 0);
  auto cell = [&](i64 sub, i64 owner, i64 exe) {
    return static_cast<size_t>((sub * px + owner) * px + exe);
  };
  for (size_t i = 0; i < u.size(); ++i) nq[cell(u_sub[i], u[i].owner, u[i].exe)] += q_vec[i];
  for (const Stream& s : st) nkv[cell(s.sub, s.owner, s.exe)] += s.len * s.width;
  // my send gathers: units (and streams) I own, in (sub-chunk, executor, canonical) order
  std::vector<size_t> mine_u, mine_s;
  for (size_t i = 0; i < u.size(); ++i)
    if (u[i].owner == me) mine_u.push_back(i);
  std::stable_sort(mine_u.begin(), mine_u.end(), [&](size_t x, size_t y) {
    return std::tie(u_sub[x], u[x].exe) < std::tie(u_sub[y], u[y].exe);
  });
  for (size_t i : mine_u)
    add_run(prog.send_q, (u[i].ds + u[i].a) * hl + u[i].h0, u[i].b - u[i].a, u[i].hc, hl);
  for (size_t i = 0; i < st.size(); ++i)
    if (st[i].owner == me) mine_s.push_back(i);
  std::stable_sort(mine_s.begin(), mine_s.end(), [&](size_t x, size_t y) {
    return std::tie(st[x].sub, st[x].exe) < std::tie(st[y].sub, st[y].exe);
  });
  for (size_t i : mine_s)  // a whole stream: all KV heads, from the first
    add_run(prog.send_kv, st[i].ds * kvl + (st[i].width > 1 ? 0 : st[i].kh), st[i].len,
            st[i].width, kvl);
  i64 q_send_off = 0, kv_send_off = 0;
  for (i64 k = 0; k < n_sub; ++k) {
    ProgSub sc;
    sc.direct = active[static_cast<size_t>(k)] % 2 == 0;
    sc.part = active[static_cast<size_t>(k)] / 2;
    for (i64 m = 0; m < px; ++m) {
      sc.q_send.push_back(nq[cell(k, me, m)]);
      sc.kv_send.push_back(nkv[cell(k, me, m)]);
      sc.q_recv.push_back(nq[cell(k, m, me)]);
      sc.kv_recv.push_back(nkv[cell(k, m, me)]);
    }
    sc.q_send_off = q_send_off;
    sc.kv_send_off = kv_send_off;
    q_send_off += std::accumulate(sc.q_send.begin(), sc.q_send.end(), i64(0));
    kv_send_off += std::accumulate(sc.kv_send.begin(), sc.kv_send.end(), i64(0));
    for (i64 m = 0; m < px; ++m) {
      const size_t j = static_cast<size_t>(m);
      if (sc.q_send[j] || sc.kv_send[j]) {
        const auto [q, kv] = message_ranges(u, u_sub, st, k, me, m, hl, kvl);
        for (const auto& [c, x] : q) sc.q_ranges.insert(sc.q_ranges.end(), {m, c, x});
        for (const auto& [c, x] : kv) sc.kv_ranges.insert(sc.kv_ranges.end(), {m, c, x});
      }
      if (sc.q_recv[j] || sc.kv_recv[j]) {
        const auto [q, kv] = message_ranges(u, u_sub, st, k, m, me, hl, kvl);
        for (const auto& [c, x] : q) sc.q_recv_ranges.insert(sc.q_recv_ranges.end(), {m, c});
        for (const auto& [c, x] : kv) sc.kv_recv_ranges.insert(sc.kv_recv_ranges.end(), {m, c});
      }
    }
    executor_calls(sc, k, u, u_sub, st, me, gl);
    prog.subchunks.push_back(std::move(sc));
  }
}

// meta._group_segments: the segments of the exchange group of (replica, slot), one per (tile,
// document), every index checked.
std::vector<Seg> group_segments(const ProgramPlan& p, i64 replica, i64 slot, i64& executed) {
  const i64 px = p.exchange_pool, base = (replica / px) * px;
  const i64 g = (replica / px) * p.slots + slot;
  const i64 lo = at(p.send_group_offsets, g, "send_group_offsets");
  const i64 hi = at(p.send_group_offsets, g + 1, "send_group_offsets");
  if (lo < 0 || lo > hi || hi > p.send_order.size)
    fail("plan.send_group_offsets: group " + std::to_string(g) + " spans [" +
         std::to_string(lo) + ", " + std::to_string(hi) + ") of " +
         std::to_string(p.send_order.size) + " send_order entries");
  for (i64 i = lo; i < hi; ++i) {
    const i64 t = p.send_order.data[i];
    if (t < 0 || t >= p.tile_cp.size)
      fail("plan.send_order[" + std::to_string(i) + "]: tile " + std::to_string(t) +
           " outside the plan's " + std::to_string(p.tile_cp.size) + " tiles");
    if (p.tile_cp.data[t] != -1) fail("plan tiles name a cp rank: a per-document CP plan (wlb)");
  }
  // each document's first token inside its packed sequence
  const i64 n_doc = p.doc_lengths.size, n_seq = p.seq_doc_offsets.size - 1;
  V ds(static_cast<size_t>(n_doc), 0);
  for (i64 s = 0; s < n_seq; ++s) {
    const i64 d0 = p.seq_doc_offsets.data[s], d1 = p.seq_doc_offsets.data[s + 1];
    if (d0 < 0 || d0 > d1 || d1 > n_doc)
      fail("plan.seq_doc_offsets[" + std::to_string(s) + "]: documents [" + std::to_string(d0) +
           ", " + std::to_string(d1) + ") outside the plan's " + std::to_string(n_doc));
    i64 off = 0;
    for (i64 d = d0; d < d1; ++d) {
      ds[static_cast<size_t>(d)] = off;
      off += p.doc_lengths.data[d];
    }
  }
  std::vector<Seg> segs;
  executed = 0;
  const i64 hl = p.heads_local;
  for (i64 i = lo; i < hi; ++i) {
    const i64 t = p.send_order.data[i];
    const i64 cnt = at(p.tile_doc_count, t, "tile_doc_count");
    const i64 owner = at(p.tile_owner, t, "tile_owner") - base;
    const i64 exe = at(p.tile_executor, t, "tile_executor") - base;
    const i64 h0 = at(p.tile_head_start, t, "tile_head_start");
    const i64 hc = at(p.tile_head_count, t, "tile_head_count");
    const std::string tile = "plan tile " + std::to_string(t);
    if (owner < 0 || owner >= px || exe < 0 || exe >= px)
      fail(tile + ": owner " + std::to_string(owner + base) + " or executor " +
           std::to_string(exe + base) + " outside its pool [" + std::to_string(base) + ", " +
           std::to_string(base + px) + ")");
    if (h0 < 0 || hc < 1 || h0 + hc > hl)
      fail(tile + ": heads [" + std::to_string(h0) + ", " + std::to_string(h0 + hc) +
           ") outside the " + std::to_string(hl) + " local heads");
    if (cnt < 0) fail(tile + ": a negative document count " + std::to_string(cnt));
    executed += (exe + base == replica);
    for (i64 j = 0; j < cnt; ++j) {
      const i64 doc = at(p.tile_doc, t, "tile_doc") + j;
      if (doc < 0 || doc >= n_doc)
        fail(tile + ": document " + std::to_string(doc) + " outside the plan's " +
             std::to_string(n_doc) + " documents");
      const i64 len = p.doc_lengths.data[doc];
      const i64 d = ds[static_cast<size_t>(doc)];
      i64 a = 0, b = len;
      if (cnt == 1) {
        a = at(p.tile_q_start, t, "tile_q_start") - d;
        b = a + at(p.tile_q_len, t, "tile_q_len");
        if (at(p.tile_kv_start, t, "tile_kv_start") != d || at(p.tile_kv_len, t, "tile_kv_len") != b)
          fail(tile + ": its KV range must be its document's prefix up to its last row");
      }
      if (a < 0 || a > b || b > len)
        fail(tile + ": rows [" + std::to_string(a) + ", " + std::to_string(b) +
             ") outside its document of " + std::to_string(len) + " tokens");
      segs.push_back({doc, d, a, b, h0, hc, owner, exe});
    }
  }
  return segs;
}

}  // namespace

Program compile_slot_program(const ProgramPlan& p, i64 replica, i64 slot, i64 chunks) {
  if (chunks < 1) fail("chunks must be at least 1, got " + std::to_string(chunks));
  if (replica < 0 || replica >= p.dp || slot < 0 || slot >= p.slots)
    fail("(replica, slot) = (" + std::to_string(replica) + ", " + std::to_string(slot) +
         ") outside the plan's " + std::to_string(p.dp) + " x " + std::to_string(p.slots));
  require_positive(p.cp, "plan.cp");
  require_positive(p.exchange_pool, "plan.exchange_pool");
  require_positive(p.kv_heads_local, "plan.kv_heads_local");
  require_at_most(p.heads_local, i64(1) << 20, "plan.heads_local", "2^20");
  if (p.heads_local < p.kv_heads_local || p.heads_local % p.kv_heads_local != 0)
    fail("plan.heads_local (" + std::to_string(p.heads_local) +
         ") must be a multiple of plan.kv_heads_local (" + std::to_string(p.kv_heads_local) + ")");
  if (p.seq_doc_offsets.size < 1) fail("plan.seq_doc_offsets must have at least one entry");
  for (const auto* a : {&p.seq_replica, &p.seq_slot})
    if (a->size != p.seq_doc_offsets.size - 1)
      fail("plan.seq_replica / seq_slot must have one entry per sequence (" +
           std::to_string(p.seq_doc_offsets.size - 1) + ")");
  const i64 hl = p.heads_local, kvl = p.kv_heads_local, px = p.exchange_pool;
  // the sequence at (replica, slot) and its document lengths
  i64 seq = -1, found = 0;
  for (i64 s = 0; s < p.seq_replica.size; ++s)
    if (p.seq_replica.data[s] == replica && p.seq_slot.data[s] == slot) {
      seq = s;
      ++found;
    }
  if (found != 1)
    fail("plan has " + std::to_string(found) + " sequences at replica " +
         std::to_string(replica) + ", slot " + std::to_string(slot));
  Program prog;
  i64 executed = 0;
  std::vector<Seg> segs = group_segments(p, replica, slot, executed);
  const i64 d0 = p.seq_doc_offsets.data[seq], d1 = p.seq_doc_offsets.data[seq + 1];
  V L(p.doc_lengths.data + d0, p.doc_lengths.data + d1);
  prog.tokens = std::accumulate(L.begin(), L.end(), i64(0));
  prog.t = std::max<i64>(1, (prog.tokens + p.cp - 1) / p.cp);
  prog.executed = executed;
  const i64 me = replica - (replica / px) * px;
  std::vector<Seg> local, moved;
  for (const Seg& s : segs)
    if (s.owner == me && s.exe == me) local.push_back(s);
    else if (s.owner != s.exe) moved.push_back(s);
  local = merge_rows(std::move(local));
  for (Seg& s : local) {
    s.doc -= d0;  // documents of this rank's sequence, in order
    if (s.doc < 0 || s.doc >= d1 - d0)
      fail("plan: a tile that replica " + std::to_string(replica) + " owns and runs at slot " +
           std::to_string(slot) + " names a document outside its sequence");
  }
  local_work(prog, L, local, hl, kvl, p.cp * prog.t);
  exchange(prog, merge_rows(std::move(moved)), px, me, chunks, hl, kvl);
  return prog;
}

bool early_returns(const ProgramPlan& p, i64 replica, i64 slot) {
  const i64 px = p.exchange_pool, cells = px * px;
  if (px <= 1) return false;
  const i64 base = (replica / px) * px, g = (replica / px) * p.slots + slot;
  if (p.xchg_q.size != p.xchg_kv.size || p.xchg_q.size < (g + 1) * cells)
    fail("plan.xchg_q / xchg_kv must be [groups, " + std::to_string(px) + ", " +
         std::to_string(px) + "] and hold group " + std::to_string(g));
  const i64* q = p.xchg_q.data + g * cells;
  const i64* kv = p.xchg_kv.data + g * cells;
  if (std::all_of(q, q + cells, [](i64 v) { return v == 0; })) return false;
  // each member's X (elements): its sequence's rows, cp-rounded, times its heads
  std::vector<double> x(static_cast<std::size_t>(px), 0.0);
  const double per_row = static_cast<double>(p.heads_local + 2 * p.kv_heads_local);
  for (i64 s = 0; s < p.seq_replica.size; ++s) {
    const i64 r = p.seq_replica.data[s];
    if (p.seq_slot.data[s] != slot || r < base || r >= base + px) continue;
    const i64 d0 = p.seq_doc_offsets.data[s], d1 = p.seq_doc_offsets.data[s + 1];
    if (d0 < 0 || d1 < d0 || d1 > p.doc_lengths.size)
      fail("plan.seq_doc_offsets[" + std::to_string(s) + "]: documents [" + std::to_string(d0) +
           ", " + std::to_string(d1) + ") outside the plan's " +
           std::to_string(p.doc_lengths.size));
    const i64 tokens = std::accumulate(p.doc_lengths.data + d0, p.doc_lengths.data + d1, i64(0));
    const i64 rows = p.cp * ((tokens + p.cp - 1) / p.cp);
    x[static_cast<std::size_t>(r - base)] =
        static_cast<double>(rows) * per_row * static_cast<double>(p.head_dim);
  }
  double late = 0.0, early = 0.0;
  for (i64 j = 0; j < px; ++j) {
    double in_q = 0, in_kv = 0, out_q = 0, out_kv = 0;
    for (i64 a = 0; a < px; ++a) {
      in_q += static_cast<double>(q[a * px + j]);
      in_kv += static_cast<double>(kv[a * px + j]);
      out_q += static_cast<double>(q[j * px + a]);
      out_kv += static_cast<double>(kv[j * px + a]);
    }
    const double xj = x[static_cast<std::size_t>(j)];
    const double e = 3.0 * in_q + in_kv, r = out_q + out_kv;
    late = std::max(late, kPeakBase * xj + e);
    early = std::max(early, std::max((kPeakBase - 1.0) * xj + e + r, kPeakBase * xj + r));
  }
  return early < late;
}

bool stage_program(const Program& prog, std::vector<std::int32_t>& flat, std::vector<i64>& sizes) {
  std::vector<const ProgCall*> calls{&prog.direct};
  std::vector<const ProgGather*> gathers{&prog.send_q, &prog.send_kv};
  for (const ProgPack& pk : prog.lpacks) {
    calls.push_back(&pk.call);
    gathers.push_back(&pk.q);
    gathers.push_back(&pk.k);
  }
  for (const ProgSub& sc : prog.subchunks) {
    if (sc.has_call) calls.push_back(&sc.call);
    for (const ProgPack& pk : sc.packs) {
      calls.push_back(&pk.call);
      gathers.push_back(&pk.q);
      gathers.push_back(&pk.k);
    }
  }
  std::vector<const std::vector<i64>*> arrays;
  arrays.reserve(2 * calls.size() + gathers.size());
  for (const ProgCall* c : calls) {
    arrays.push_back(&c->cu_q);
    arrays.push_back(&c->cu_k);
  }
  for (const ProgGather* g : gathers) arrays.push_back(&g->runs);
  std::size_t total = 0;
  for (const auto* a : arrays) total += a->size();
  flat.clear();
  sizes.clear();
  flat.reserve(total);
  sizes.reserve(arrays.size());
  constexpr i64 lo = std::numeric_limits<std::int32_t>::min(),
                hi = std::numeric_limits<std::int32_t>::max();
  for (const auto* a : arrays) {
    for (i64 x : *a) {
      if (x < lo || x > hi) {
        flat.clear();
        sizes.clear();
        return false;
      }
      flat.push_back(static_cast<std::int32_t>(x));
    }
    sizes.push_back(static_cast<i64>(a->size()));
  }
  return true;
}

void add_program_features(const Program& prog, double* f) {
  auto add = [f](const ProgCall& c) {
    for (std::size_t i = 0; i + 1 < c.cu_q.size() && i + 1 < c.cu_k.size(); ++i) {
      const i64 q = c.cu_q[i + 1] - c.cu_q[i], k = c.cu_k[i + 1] - c.cu_k[i];
      if (q > 0 && k > 0) add_segment_features(f, q, k, c.hc);
    }
  };
  add(prog.direct);
  for (const ProgPack& p : prog.lpacks) add(p.call);
  for (const ProgSub& sc : prog.subchunks) {
    if (sc.has_call) add(sc.call);
    else for (const ProgPack& p : sc.packs) add(p.call);
  }
}

}  // namespace libra
