// Worker threads for the independent pieces of one plan (TAP's groups). Results must not depend
// on the worker count: workers only write the slot of the piece they took.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <functional>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace libra {

// Cores this process may run on: its CPU affinity mask where the platform has one, else the
// machine's (at least 1).
std::size_t usable_cores();
// Of those, the ones no other runnable thread holds right now: the machine's cores less the
// threads running or waiting to run besides the caller (Linux: /proc/loadavg), at least 1. A
// plan split over cores that other processes hold waits on descheduled workers at every join,
// while one thread only runs at its share.
std::size_t idle_cores();
// Workers for `units` of work: one per `per_worker` units, at most idle_cores() and `cap`, at
// least 1.
std::size_t auto_workers(std::size_t units, std::size_t per_worker, std::size_t cap);

// Hands out piece indices 0, 1, ... count - 1, each once, to whichever worker asks first.
class WorkQueue {
 public:
  explicit WorkQueue(std::size_t count) : count_(count) {}
  bool take(std::size_t& piece) {
    piece = next_.fetch_add(1, std::memory_order_relaxed);
    return piece < count_;
  }
  void stop() { next_.store(count_, std::memory_order_relaxed); }

 private:
  std::atomic<std::size_t> next_{0};
  std::size_t count_;
};

// Runs worker(queue) on `workers` threads, the calling one included, until the queue is empty.
// If a thread cannot be started the others do its share; the first exception a worker throws
// stops the queue and is rethrown here once all have returned.
template <typename Worker>
void run_workers(std::size_t workers, std::size_t count, Worker&& worker) {
  WorkQueue queue(count);
  workers = std::max<std::size_t>(1, std::min(workers, count));
  if (workers == 1) {
    worker(queue);
    return;
  }
  std::vector<std::exception_ptr> errors(workers);
  auto guarded = [&](std::size_t w) {
    try {
      worker(queue);
    } catch (...) {
      errors[w] = std::current_exception();
      queue.stop();
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(workers - 1);
  for (std::size_t w = 1; w < workers; ++w) {
    try {
      threads.emplace_back(guarded, w);
    } catch (const std::system_error&) {
      break;  // no more threads: the started ones and this one share the queue
    }
  }
  guarded(0);
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

// A task that runs on a thread of its own while the caller goes on (or right here, when
// `own_thread` is false or no thread can be started). join() waits for it and rethrows what it
// threw; the destructor waits too.
class SideTask {
 public:
  SideTask(bool own_thread, std::function<void()> task) : task_(std::move(task)) {
    if (own_thread) {
      try {
        thread_ = std::thread([this] { run(); });
        return;
      } catch (const std::system_error&) {
      }
    }
    run();
  }
  SideTask(const SideTask&) = delete;
  SideTask& operator=(const SideTask&) = delete;
  ~SideTask() {
    if (thread_.joinable()) thread_.join();
  }
  void join() {
    if (thread_.joinable()) thread_.join();
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  void run() {
    try {
      task_();
    } catch (...) {
      error_ = std::current_exception();
    }
  }
  std::function<void()> task_;
  std::thread thread_;
  std::exception_ptr error_;
};

}  // namespace libra
