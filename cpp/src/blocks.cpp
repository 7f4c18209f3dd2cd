// The block pool of the plan's large arrays (common.h): freed blocks kept by size class and
// handed to the next array of the same class; when full, classes other than the one being freed
// are given back to the system first.
#include <mutex>
#include <unordered_map>
#include <vector>

#include "libra/common.h"

namespace libra {
namespace {

// Eight classes per octave: at most 1/8 over the bytes asked for.
std::size_t size_class(std::size_t bytes) {
  if (bytes < kPooledBytes) return bytes;
  const int e = 63 - __builtin_clzll(static_cast<unsigned long long>(bytes));
  const std::size_t step = std::size_t(1) << (e - 3);
  return (bytes + step - 1) / step * step;
}

struct Pool {
  std::mutex mu;
  std::unordered_map<std::size_t, std::vector<void*>> free;
  PoolStats stats;
};

// Never destroyed: numpy may free a plan's arrays while the interpreter exits, after static
// destructors have run.
Pool& pool() {
  static Pool* p = new Pool;
  return *p;
}

}  // namespace

void* pool_allocate(std::size_t bytes) {
  const std::size_t c = size_class(bytes);
  if (c >= kPooledBytes) {
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mu);
    auto it = p.free.find(c);
    if (it != p.free.end() && !it->second.empty()) {
      void* block = it->second.back();
      it->second.pop_back();
      p.stats.kept_bytes -= c;
      ++p.stats.reused;
      return block;
    }
    ++p.stats.fresh;
  }
  return ::operator new(c);
}

void pool_deallocate(void* block, std::size_t bytes) noexcept {
  if (block == nullptr) return;
  const std::size_t c = size_class(bytes);
  if (c >= kPooledBytes) {
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mu);
    // full: blocks of other classes (sizes the plans no longer take) make room, so a pool
    // filled by earlier, differently sized plans still serves the current ones
    for (auto it = p.free.begin(); p.stats.kept_bytes + c > kPoolBytes && it != p.free.end();) {
      if (it->first != c) {
        for (void* old : it->second) {
          ::operator delete(old);
          p.stats.kept_bytes -= it->first;
          ++p.stats.evicted;
        }
        it = p.free.erase(it);
      } else {
        ++it;
      }
    }
    if (p.stats.kept_bytes + c <= kPoolBytes) {
      try {
        p.free[c].push_back(block);
        p.stats.kept_bytes += c;
        return;
      } catch (...) {  // no memory to remember it: give it back
      }
    }
  }
  ::operator delete(block);
}

PoolStats pool_stats() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  return p.stats;
}

}  // namespace libra
