#include "parallel.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "q4/kernels.h"

namespace q4 {
namespace {

int env_threads(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return 0;
  const int n = std::atoi(v);
  return n > 0 ? n : 0;
}

// Read once: hardware_concurrency() opens /sys/devices/system/cpu/online on
// every call (~10 us in a VM), which a per-call lookup paid on every kernel.
int default_threads() {
  static const int n = [] {
    if (int v = env_threads("Q4_NUM_THREADS")) return v;
    if (int v = env_threads("OMP_NUM_THREADS")) return v;
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return n;
}

int g_requested = 0;  // 0: default

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Polls `done` for up to `limit` before the caller sleeps: waking from a
// condition variable takes 20-60 us in a VM.
template <typename Done>
bool poll_for(std::chrono::microseconds limit, Done done) {
  if (done()) return true;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  do {
    for (int i = 0; i < 16; ++i) spin_pause();
    if (done()) return true;
  } while (std::chrono::steady_clock::now() < deadline);
  return false;
}

// Workers wait for a generation counter to change, run their chunk of the
// current job, and report completion. One job runs at a time (job_mu). Both
// sides poll for up to kSpin before sleeping on a condition variable (a
// worker after its job, the caller for the workers), as an OpenMP team's
// barrier does: a kernel call is often a few parallel_for calls in a row, and
// a wake-up from sleep is 20-60 us in a VM.
class Pool {
 public:
  static constexpr std::chrono::microseconds kSpin{100};

  void run(int chunks, const std::function<void(int)>& chunk_fn) {
    std::lock_guard<std::mutex> job_lock(job_mu_);
    ensure_workers(chunks - 1);
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &chunk_fn;
      active_ = chunks - 1;
      pending_ = chunks - 1;
      ++generation_;
    }
    cv_.notify_all();
    chunk_fn(0);
    poll_for(kSpin, [&] { return pending_.load(std::memory_order_acquire) == 0; });
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return pending_ == 0; });
    fn_ = nullptr;
  }

  // After fork() only the forking thread exists in the child: forget workers.
  void reset_after_fork() {
    new (&mu_) std::mutex();
    new (&job_mu_) std::mutex();
    new (&cv_) std::condition_variable();
    new (&done_cv_) std::condition_variable();
    for (auto& t : workers_) t.detach();
    workers_.clear();
    generation_ = 0;
    pending_ = active_ = 0;
  }

 private:
  void ensure_workers(int n) {
    while (static_cast<int>(workers_.size()) < n) {
      const int id = static_cast<int>(workers_.size()) + 1;
      workers_.emplace_back([this, id] { loop(id); });
    }
  }
  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      poll_for(kSpin, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      const std::function<void(int)>* fn;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
        if (id > active_) continue;
        fn = fn_;
      }
      (*fn)(id);
      std::lock_guard<std::mutex> lk(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }

  std::mutex job_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* fn_ = nullptr;
  // written under mu_; read without it only while polling
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  int active_ = 0;
};

Pool& pool() {
  static Pool* p = [] {
    auto* created = new Pool();  // never destroyed: workers outlive static teardown
    pthread_atfork(nullptr, nullptr, [] { pool().reset_after_fork(); });
    return created;
  }();
  return *p;
}

thread_local bool t_in_parallel = false;
std::atomic<ForkJoinFn> g_fork_join{nullptr};
std::atomic<pid_t> g_fork_join_pid{0};  // an OpenMP team does not survive fork(): children use q4's pool
thread_local const TaskScheduler* t_scheduler = nullptr;

// One parallel_for call: chunks are claimed from `next` by every worker (the
// caller included), each run with IEEE denormals. On a scheduler's workers
// the Job is shared-owned and the caller waits until every claimed chunk is
// finished (`finished` == chunks), never for a task that has not started: a
// task the scheduler runs late claims nothing (`next` is past the end) and
// touches only the Job.
struct Job {
  std::function<void(int64_t)> run_chunk;
  int64_t chunks = 0;
  std::atomic<int64_t> next{0}, finished{0};
  std::mutex mu;
  std::condition_variable done;

  void work() {
    cpu::ScopedIeeeFloat ieee;
    const bool outer = t_in_parallel;
    t_in_parallel = true;
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      run_chunk(c);
      if (finished.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lk(mu);
        done.notify_all();
      }
    }
    t_in_parallel = outer;
  }

  // The caller has run out of chunks; each one still running is on another
  // thread and at most one chunk from done. Waking from the condition
  // variable takes 20-60 us in a VM, a sixth of a 4096^2 batch-1 call, so
  // poll for up to kSpin first (an OpenMP team's barrier spins far longer).
  void wait() {
    if (poll_for(kSpin, [&] { return finished.load(std::memory_order_acquire) == chunks; })) return;
    std::unique_lock<std::mutex> lk(mu);
    done.wait(lk, [&] { return finished.load() == chunks; });
  }
  static constexpr std::chrono::microseconds kSpin{100};
};

void run_job_task(void* data) {
  auto* holder = static_cast<std::shared_ptr<Job>*>(data);
  std::shared_ptr<Job> job = std::move(*holder);
  delete holder;
  job->work();
}

void run_fork_join_task(void* data) { static_cast<Job*>(data)->work(); }

}  // namespace

int cpu_num_threads() {
  if (t_scheduler != nullptr) return std::max(1, t_scheduler->num_threads);
  return g_requested > 0 ? g_requested : default_threads();
}
void set_cpu_num_threads(int n) { g_requested = n > 0 ? n : 0; }
void set_cpu_fork_join(ForkJoinFn fn) {
  g_fork_join_pid.store(getpid());
  g_fork_join.store(fn);
}
ForkJoinFn cpu_fork_join() { return g_fork_join.load(); }

ScopedTaskScheduler::ScopedTaskScheduler(const TaskScheduler& s) : saved_(t_scheduler), own_(s) {
  t_scheduler = own_.schedule != nullptr ? &own_ : saved_;
}
ScopedTaskScheduler::~ScopedTaskScheduler() { t_scheduler = saved_; }

namespace cpu {

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t max_chunks = std::max<int64_t>(1, n / grain);
  const int threads = static_cast<int>(std::min<int64_t>(cpu_num_threads(), max_chunks));
  if (threads <= 1 || t_in_parallel) {
    ScopedIeeeFloat ieee;
    fn(0, n);
    return;
  }
  // Chunks are handed out dynamically (a few per thread): a thread that loses
  // its core for a while (another runtime's pool spinning beside ours, e.g.
  // PyTorch's OpenMP or XLA's) takes fewer chunks instead of holding up the
  // call. Every index is in exactly one fn call, so results do not depend on
  // which thread ran it.
  // The chunks' sizes differ by at most one index, the larger ones first, so
  // that the last ones claimed are the small ones: 28 tiles in 8 chunks are 4
  // x 4 + 4 x 3 (14 per thread on two), where chunks of ceil(28 / 8) = 4 made
  // 7 and left one thread 16 (the fp32 tiled forward at n = 384, m = 256,
  // two threads, Zen 4, medians: k = 1536 1.70 -> 1.53 ms, k = 384 0.45 ->
  // 0.40 ms).
  const int64_t chunks = std::min<int64_t>(max_chunks, int64_t(threads) * 4);
  const int64_t per = n / chunks, extra = n % chunks;  // chunks < extra hold per + 1 indices
  auto job = std::make_shared<Job>();
  job->chunks = chunks;
  job->run_chunk = [&fn, per, extra](int64_t c) {
    const int64_t b = c * per + std::min(c, extra);
    fn(b, b + per + (c < extra ? 1 : 0));
  };
  if (const TaskScheduler* sched = t_scheduler) {  // the host's workers (e.g. XLA's pool)
    for (int i = 1; i < threads; ++i) sched->schedule(sched->ctx, run_job_task, new std::shared_ptr<Job>(job));
    job->work();
  } else if (ForkJoinFn fork_join = g_fork_join.load(); fork_join != nullptr && g_fork_join_pid.load() == getpid()) {
    fork_join(run_fork_join_task, job.get(), static_cast<unsigned>(threads), 0);  // the host's OpenMP team
  } else {
    pool().run(threads, [&](int) { job->work(); });  // q4's own pool
  }
  job->wait();
}

#if defined(__x86_64__) || defined(__i386__)
constexpr unsigned kFtzDaz = 0x8040;  // MXCSR bit 15 (flush to zero) and bit 6 (denormals are zero)
ScopedIeeeFloat::ScopedIeeeFloat() : saved_(_mm_getcsr()) {
  if (saved_ & kFtzDaz) _mm_setcsr(saved_ & ~kFtzDaz);
}
ScopedIeeeFloat::~ScopedIeeeFloat() {
  if (saved_ & kFtzDaz) _mm_setcsr(saved_);
}
#else
ScopedIeeeFloat::ScopedIeeeFloat() {}
ScopedIeeeFloat::~ScopedIeeeFloat() {}
#endif

float* scratch(int slot, int64_t count) {
  thread_local std::vector<float> buffers[kScratchSlots];
  std::vector<float>& b = buffers[slot];
  if (static_cast<int64_t>(b.size()) < count) b.resize(static_cast<size_t>(count));
  return b.data();
}

void hint_fresh_output(void* ptr, int64_t bytes) {
#if defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (bytes < int64_t(4 * kHuge)) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(ptr) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(ptr) + uintptr_t(bytes)) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)ptr;
  (void)bytes;
#endif
}

}  // namespace cpu
}  // namespace q4
