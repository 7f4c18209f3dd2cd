#include "libra/moe.h"

#include <algorithm>
#include <chrono>
#include <numeric>

namespace libra {

void MoeOptions::validate() const {
  require_positive(ep, "ep");
  require_positive(experts, "experts");
  if (experts % ep != 0)
    fail("experts (" + std::to_string(experts) + ") must be divisible by ep (" +
         std::to_string(ep) + ")");
  const i64 foreign = experts - experts / ep;  // experts a rank does not own
  if (replica_slots < 0 || replica_slots > foreign)
    fail("replica_slots (" + std::to_string(replica_slots) + ") must be in [0, " +
         std::to_string(foreign) + "]: a rank can hold a copy of each expert it does not own, "
         "at most");
  if (local_slots < -1 || local_slots > replica_slots)
    fail("local_slots (" + std::to_string(local_slots) + ") must be -1 (a quarter of the replica "
         "slots) or in [0, replica_slots = " + std::to_string(replica_slots) + "]");
  if (!(expert_bytes >= 0)) fail("expert_bytes must be >= 0");
  // the assignment table holds ep * experts * ep counts
  if (ep > (i64(1) << 16) || experts > (i64(1) << 20) || ep * ep * experts > (i64(1) << 26))
    fail("ep * ep * experts (" + std::to_string(ep) + " * " + std::to_string(ep) + " * " +
         std::to_string(experts) + ") must be at most 2^26: the plan's assignment table is that "
         "large");
}

namespace {

double max_over_mean(const std::vector<i64>& load) {
  const i64 total = std::accumulate(load.begin(), load.end(), i64{0});
  if (total == 0) return 1.0;
  const double mean = static_cast<double>(total) / static_cast<double>(load.size());
  return static_cast<double>(*std::max_element(load.begin(), load.end())) / mean;
}

// The layer's state while replicas are placed: hosts of every expert, the tokens each host
// computes of it, and the resulting rank loads.
class Balancer {
 public:
  Balancer(const std::vector<i64>& counts, i64 ep, i64 experts)
      : c_(counts), ep_(ep), E_(experts), per_rank_(experts / ep),
        hosts_(static_cast<std::size_t>(experts)),
        is_host_(static_cast<std::size_t>(experts * ep), 0),
        share_(static_cast<std::size_t>(experts * ep), 0),
        load_(static_cast<std::size_t>(ep), 0),
        total_(static_cast<std::size_t>(experts), 0),
        level_(static_cast<std::size_t>(ep)) {
    for (i64 e = 0; e < E_; ++e) {
      const i64 owner = e / per_rank_;
      hosts_[e].push_back(owner);
      is_host_[e * ep_ + owner] = 1;
      for (i64 s = 0; s < ep_; ++s) total_[e] += count(s, e);
      share_[e * ep_ + owner] = total_[e];
      load_[owner] += total_[e];
    }
  }

  i64 count(i64 s, i64 e) const { return c_[s * E_ + e]; }
  i64 total(i64 e) const { return total_[e]; }  // tokens of expert e from every source
  bool hosts(i64 e, i64 r) const { return is_host_[e * ep_ + r] != 0; }
  i64 share(i64 e, i64 r) const { return share_[e * ep_ + r]; }
  const std::vector<i64>& load() const { return load_; }
  const std::vector<i64>& hosts_of(i64 e) const { return hosts_[e]; }
  i64 max_load() const { return *std::max_element(load_.begin(), load_.end()); }

  // Remote tokens of expert e (those of sources that hold no copy of it) for each host: water
  // filling onto the hosts' loads without e, each host's own tokens of e staying local; the
  // units left after the integer level go to the lowest levels, then the earliest hosts.
  void remote_quota(i64 e, std::vector<i64>& quota) {
    const auto& H = hosts_[e];
    const std::size_t m = H.size();
    i64 remote = 0;
    for (i64 s = 0; s < ep_; ++s)
      if (!hosts(e, s)) remote += count(s, e);
    std::vector<std::pair<i64, std::size_t>>& lv = level_;
    lv.resize(m);
    for (std::size_t i = 0; i < m; ++i)
      lv[i] = {load_[H[i]] - share(e, H[i]) + count(H[i], e), i};
    std::sort(lv.begin(), lv.begin() + static_cast<std::ptrdiff_t>(m));
    // the k lowest hosts are raised to a common level: the smallest k whose level stays at or
    // below the next host's
    std::size_t k = 1;
    i64 sum = lv[0].first;
    while (k < m && (remote + sum) >= static_cast<i64>(k) * lv[k].first) {
      sum += lv[k].first;
      ++k;
    }
    const i64 level = (remote + sum) / static_cast<i64>(k);
    i64 left = (remote + sum) - level * static_cast<i64>(k);
    quota.assign(m, 0);
    for (std::size_t i = 0; i < k; ++i) {
      quota[lv[i].second] = level - lv[i].first + (left > 0 ? 1 : 0);
      if (left > 0) --left;
    }
  }

  // Re-shard expert e over its hosts (after a host was added or removed).
  void reshard(i64 e) {
    remote_quota(e, quota_);
    const auto& H = hosts_[e];
    for (std::size_t i = 0; i < H.size(); ++i) {
      const i64 h = H[i];
      const i64 now = count(h, e) + quota_[i];
      load_[h] += now - share_[e * ep_ + h];
      share_[e * ep_ + h] = now;
    }
  }

  // Adds rank r as a host of expert e if the heaviest rank then weighs at most `bound`;
  // otherwise leaves everything as it was. Returns whether r was kept.
  bool add_host_within(i64 e, i64 r, i64 bound) {
    hosts_[e].push_back(r);
    is_host_[e * ep_ + r] = 1;
    reshard(e);
    if (max_load() <= bound) return true;
    hosts_[e].pop_back();
    is_host_[e * ep_ + r] = 0;
    load_[r] -= share_[e * ep_ + r];
    share_[e * ep_ + r] = 0;
    reshard(e);
    return false;
  }

  // The final assignment: each host's own tokens stay; remote sources fill the hosts' remote
  // shares (as last sharded) in (source, host) order.
  void assignment(std::vector<i64>& assign) {
    assign.assign(static_cast<std::size_t>(ep_ * E_ * ep_), 0);
    for (i64 e = 0; e < E_; ++e) {
      const auto& H = hosts_[e];
      quota_.resize(H.size());
      for (std::size_t i = 0; i < H.size(); ++i) quota_[i] = share(e, H[i]) - count(H[i], e);
      std::size_t i = 0;
      for (i64 s = 0; s < ep_; ++s) {
        i64* row = &assign[static_cast<std::size_t>((s * E_ + e) * ep_)];
        if (hosts(e, s)) {
          row[s] = count(s, e);
          continue;
        }
        for (i64 left = count(s, e); left > 0;) {
          while (quota_[i] == 0) ++i;  // quotas sum to the remote tokens
          const i64 take = std::min(left, quota_[i]);
          row[H[i]] += take;
          quota_[i] -= take;
          left -= take;
        }
      }
    }
  }

 private:
  const std::vector<i64>& c_;
  i64 ep_, E_, per_rank_;
  std::vector<std::vector<i64>> hosts_;
  std::vector<char> is_host_;
  std::vector<i64> share_, load_, total_;
  std::vector<std::pair<i64, std::size_t>> level_;
  std::vector<i64> quota_;
};

void check_counts(const std::vector<i64>& counts, i64 ep, i64 E) {
  if (static_cast<i64>(counts.size()) != ep * E)
    fail("counts must hold ep * experts = " + std::to_string(ep * E) + " entries (source rank "
         "major), got " + std::to_string(counts.size()));
  for (std::size_t i = 0; i < counts.size(); ++i)
    if (counts[i] < 0 || counts[i] > kMaxTokens)
      fail(field_at("counts", static_cast<i64>(i)) + " (source rank " +
           std::to_string(static_cast<i64>(i) / E) + ", expert " +
           std::to_string(static_cast<i64>(i) % E) + ") must be in [0, 2^30], got " +
           std::to_string(counts[i]));
}

// A plan's shape and its owners-only figures.
MoePlan start(const Balancer& b, i64 ep, i64 E) {
  MoePlan p;
  p.ep = ep;
  p.experts = E;
  p.rank_tokens_before = b.load();
  for (i64 s = 0; s < ep; ++s)
    for (i64 e = 0; e < E; ++e)
      if (e / (E / ep) != s) p.remote_tokens_before += b.count(s, e);
  return p;
}

// The plan's balanced half: hosts, assignment, figures, time since t0.
void finish(Balancer& b, const MoeOptions& options,
            std::chrono::steady_clock::time_point t0, MoePlan& p) {
  const i64 ep = options.ep, E = options.experts;
  p.rank_tokens_after = b.load();
  p.host_offsets.assign(static_cast<std::size_t>(E + 1), 0);
  for (i64 e = 0; e < E; ++e) {
    const auto& H = b.hosts_of(e);
    p.hosts.insert(p.hosts.end(), H.begin(), H.end());
    p.host_offsets[e + 1] = static_cast<i64>(p.hosts.size());
  }
  b.assignment(p.assign);
  for (i64 s = 0; s < ep; ++s)
    for (i64 e = 0; e < E; ++e)
      for (i64 h = 0; h < ep; ++h)
        if (h != s) p.remote_tokens_after += p.assign[(s * E + e) * ep + h];
  p.max_over_mean_before = max_over_mean(p.rank_tokens_before);
  p.max_over_mean_after = max_over_mean(p.rank_tokens_after);
  p.bytes_moved = static_cast<double>(p.replicas_local + p.replicas_balance) * options.expert_bytes;
  p.plan_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

MoePlan moe_plan(const std::vector<i64>& counts, const MoeOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  options.validate();
  const i64 ep = options.ep, E = options.experts, N = options.replica_slots;
  check_counts(counts, ep, E);
  const i64 local_slots = options.local_slots < 0 ? N / 4 : options.local_slots;

  Balancer b(counts, ep, E);
  MoePlan p = start(b, ep, E);
  std::vector<i64> used(static_cast<std::size_t>(ep), 0);

  // Phase 1, locality: each rank imports the non-resident experts that receive the most of its
  // own tokens (they then stay on it), while that does not raise the heaviest rank.
  std::vector<i64> cand;
  for (i64 r = 0; r < ep && local_slots > 0; ++r) {
    cand.clear();
    for (i64 e = 0; e < E; ++e)
      if (!b.hosts(e, r) && b.count(r, e) > 0) cand.push_back(e);
    std::stable_sort(cand.begin(), cand.end(),
                     [&](i64 x, i64 y) { return b.count(r, x) > b.count(r, y); });
    for (i64 e : cand) {
      if (used[r] >= local_slots) break;
      if (b.add_host_within(e, r, b.max_load())) {
        ++used[r];
        ++p.replicas_local;
      }
    }
  }

  // Phase 2, balance: replicate the hottest expert of the most loaded rank onto the least loaded
  // rank with a free slot that holds no copy of it, while that lowers the maximum.
  std::vector<i64> hot;
  for (i64 round = 0; round < ep * N + 1; ++round) {
    const auto& load = b.load();
    const i64 hi = std::max_element(load.begin(), load.end()) - load.begin();
    const i64 top = load[hi];
    hot.clear();
    for (i64 e = 0; e < E; ++e)
      if (b.share(e, hi) > b.count(hi, e)) hot.push_back(e);  // it computes remote tokens of e
    std::stable_sort(hot.begin(), hot.end(),
                     [&](i64 x, i64 y) { return b.share(x, hi) > b.share(y, hi); });
    bool moved = false;
    for (i64 e : hot) {
      i64 target = -1;
      for (i64 t = 0; t < ep; ++t)
        if (used[t] < N && !b.hosts(e, t) && (target < 0 || load[t] < load[target])) target = t;
      if (target < 0) continue;
      if (b.add_host_within(e, target, top - 1)) {  // the maximum must drop
        ++used[target];
        ++p.replicas_balance;
        moved = true;
        break;
      }
    }
    if (!moved) break;
  }

  finish(b, options, t0, p);
  return p;
}

MoePlan moe_shard(const std::vector<i64>& counts, const MoeOptions& options,
                  const std::vector<i64>& host_offsets, const std::vector<i64>& hosts) {
  const auto t0 = std::chrono::steady_clock::now();
  options.validate();
  const i64 ep = options.ep, E = options.experts;
  check_counts(counts, ep, E);
  if (static_cast<i64>(host_offsets.size()) != E + 1 || host_offsets.front() != 0 ||
      host_offsets.back() != static_cast<i64>(hosts.size()))
    fail("host_offsets must hold experts + 1 = " + std::to_string(E + 1) +
         " offsets from 0 to len(hosts) = " + std::to_string(hosts.size()));
  std::vector<i64> extra(static_cast<std::size_t>(ep), 0);
  for (i64 e = 0; e < E; ++e) {
    const i64 a = host_offsets[e], z = host_offsets[e + 1];
    if (z <= a || z > static_cast<i64>(hosts.size()))
      fail(field_at("host_offsets", e + 1) + " must exceed host_offsets[" + std::to_string(e) +
           "]: every expert has its owner as a host");
    if (hosts[a] != e / (E / ep))
      fail(field_at("hosts", a) + " must be expert " + std::to_string(e) + "'s owner (rank " +
           std::to_string(e / (E / ep)) + "), got " + std::to_string(hosts[a]));
    for (i64 i = a + 1; i < z; ++i) {
      if (hosts[i] < 0 || hosts[i] >= ep)
        fail(field_at("hosts", i) + " must be a rank in [0, ep = " + std::to_string(ep) +
             "), got " + std::to_string(hosts[i]));
      for (i64 j = a; j < i; ++j)
        if (hosts[j] == hosts[i])
          fail(field_at("hosts", i) + ": rank " + std::to_string(hosts[i]) +
               " holds expert " + std::to_string(e) + " twice");
      if (++extra[hosts[i]] > options.replica_slots)
        fail(field_at("hosts", i) + ": rank " + std::to_string(hosts[i]) + " holds more than "
             "replica_slots = " + std::to_string(options.replica_slots) + " copies");
    }
  }
  Balancer b(counts, ep, E);
  MoePlan p = start(b, ep, E);
  // experts with copies, most tokens first: their copies join one by one, each time re-sharding
  // the expert over its hosts, and a copy that would raise the heaviest rank (its own tokens
  // must stay on it) is left idle; a second pass re-shards each against the final loads
  std::vector<i64> order;
  for (i64 e = 0; e < E; ++e)
    if (host_offsets[e + 1] - host_offsets[e] > 1) order.push_back(e);
  std::stable_sort(order.begin(), order.end(),
                   [&](i64 x, i64 y) { return b.total(x) > b.total(y); });
  for (i64 e : order)
    for (i64 i = host_offsets[e] + 1; i < host_offsets[e + 1]; ++i)
      if (b.add_host_within(e, hosts[i], b.max_load())) ++p.replicas_balance;
  for (i64 e : order) b.reshard(e);
  finish(b, options, t0, p);
  return p;
}

}  // namespace libra
