#include "libra/parallel.h"

#include <cstdio>
#if defined(__linux__)
#include <sched.h>
#endif

namespace libra {

std::size_t usable_cores() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return static_cast<std::size_t>(n);
  }
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

std::size_t idle_cores() {
  const std::size_t usable = usable_cores();
#if defined(__linux__)
  // "0.50 0.40 0.30 R/T last-pid": R = runnable threads now, the reader included
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return usable;
  double a, b, c;
  long running = 0, total = 0;
  const int got = std::fscanf(f, "%lf %lf %lf %ld/%ld", &a, &b, &c, &running, &total);
  std::fclose(f);
  if (got != 5 || running < 1) return usable;
  const std::size_t machine = std::max(1u, std::thread::hardware_concurrency());
  const std::size_t others = static_cast<std::size_t>(running - 1);
  const std::size_t idle = others >= machine ? 0 : machine - others;
  return std::max<std::size_t>(1, std::min(usable, idle));
#else
  return usable;
#endif
}

std::size_t auto_workers(std::size_t units, std::size_t per_worker, std::size_t cap) {
  const std::size_t wanted = per_worker > 0 ? units / per_worker : units;
  if (wanted <= 1 || cap <= 1) return 1;  // no need to look at the machine
  return std::max<std::size_t>(1, std::min({wanted, cap, idle_cores()}));
}

}  // namespace libra
