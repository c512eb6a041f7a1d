// The kernels' threads: ParallelFor runs a call's work items on the caller and XLA's intra-op thread pool (the FFI
// ThreadPool context), ThreadsFor decides how many threads a call is worth.

#pragma once

#include <atomic>
#include <memory>
#include <thread>

#include "common.h"

namespace {

int ThreadsFromEnv() {  // read on every call (cheap next to the kernel), 0: unset
  const char* env = std::getenv("FERRY_NATIVE_ATTENTION_THREADS");
  if (env == nullptr || *env == '\0') return 0;
  return std::clamp(std::atoi(env), 1, 64);
}

// Threads for a call: the pool's, or FERRY_NATIVE_ATTENTION_THREADS (more than the pool's: the tests' way
// to have helpers start late, their items taken by the others); 1 when `work` is under `min_work` (a small
// call finishes before a woken thread would start).
int64_t ThreadsFor(const ffi::ThreadPool& pool, int64_t work, int64_t min_work) {
  if (work < min_work) return 1;
  const int env = ThreadsFromEnv();
  return env > 0 ? env : pool.num_threads();
}

// ParallelFor's items in one contiguous range per thread, each thread taking its own from the front and,
// once they are done, the others' from the back (the range with the most left). A thread's next item is
// known when it starts one, so a kernel can ask for that item's data meanwhile (the matmul's next panel,
// decode attention's next pages). With one counter for all, a thread could only guess its next item ("about
// `threads` items on"), and where the guess was wrong the panel it asked for was not the one it took, which
// then came cold from memory. A panel's row parts also stay on one thread.
struct ItemRange {
  std::atomic<uint64_t> bounds{0};  // front | back << 32: the items [front, back) not yet taken (< 2^32)
  static uint64_t Pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
  }
  // Takes the front item (else the back one) into `item`; false when none is left.
  bool Take(bool front, int64_t& item) {
    uint64_t v = bounds.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = static_cast<int64_t>(v & 0xffffffffu), b = static_cast<int64_t>(v >> 32);
      if (f >= b) return false;
      if (bounds.compare_exchange_weak(v, front ? Pack(f + 1, b) : Pack(f, b - 1), std::memory_order_relaxed)) {
        item = front ? f : b - 1;
        return true;
      }
    }
  }
  int64_t Left() const {
    const uint64_t v = bounds.load(std::memory_order_relaxed);
    return static_cast<int64_t>(v >> 32) - static_cast<int64_t>(v & 0xffffffffu);
  }
};

using ItemFn = void (*)(const void* ctx, int64_t item, int64_t next);  // next: this thread's likely next, or -1

struct ParallelState {
  std::atomic<int64_t> threads{0};  // threads started (the caller first): each owns the range of its turn
  std::atomic<int64_t> done{0};
  int64_t ranges = 1;
  std::unique_ptr<ItemRange[]> range;  // [ranges]
  const void* ctx = nullptr;
  ItemFn fn = nullptr;
};

void DrainWork(ParallelState& st) {
  // `ctx` may be gone once all items are done: never touch it after the last.
  const int64_t own = st.threads.fetch_add(1, std::memory_order_relaxed);
  int64_t item;
  while (own < st.ranges && st.range[own].Take(true, item)) {
    st.fn(st.ctx, item, st.range[own].Left() > 0 ? item + 1 : -1);
    st.done.fetch_add(1, std::memory_order_release);
  }
  for (;;) {
    int64_t most = 0, from = -1;
    for (int64_t r = 0; r < st.ranges; ++r) {
      const int64_t left = st.range[r].Left();
      if (left > most) most = left, from = r;
    }
    if (from < 0) return;
    if (!st.range[from].Take(false, item)) continue;
    st.fn(st.ctx, item, most > 1 ? item - 1 : -1);
    st.done.fetch_add(1, std::memory_order_release);
  }
}

// Runs fn(ctx, i, next) for i in [0, count) on the caller plus up to `helpers` pool threads. Helpers
// that start late find their range taken and return; the caller only waits for items in flight.
void ParallelFor(ffi::ThreadPool* pool, int64_t count, int64_t helpers, const void* ctx, ItemFn fn) {
  helpers = std::min<int64_t>(helpers, count - 1);
  if (pool == nullptr || helpers <= 0) {
    for (int64_t i = 0; i < count; ++i) fn(ctx, i, i + 1 < count ? i + 1 : -1);
    return;
  }
  auto st = std::make_shared<ParallelState>();
  st->ranges = helpers + 1;
  st->range.reset(new ItemRange[st->ranges]);
  for (int64_t r = 0; r < st->ranges; ++r)
    st->range[r].bounds.store(ItemRange::Pack(r * count / st->ranges, (r + 1) * count / st->ranges));
  st->ctx = ctx;
  st->fn = fn;
  for (int64_t h = 0; h < helpers; ++h) pool->Schedule([st] { DrainWork(*st); });
  DrainWork(*st);
  while (st->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

}  // namespace
