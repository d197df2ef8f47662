// The tasks of one CpuDecoder.start on native threads: one call runs them all, so Python hands
// the work over once per slice (the GIL is released once) instead of once per ~1 MiB task.
//
// A pool is `workers` std::threads that sleep on a condition variable; kvtier_pool_run wakes
// them, works on the tasks itself too, and returns when every task is done. Tasks are taken
// in index order from an atomic counter and task i writes only out[i] and lse[i], so which
// thread ran a task changes nothing: the result is bitwise the same for any thread count.
//
//   kvtier_pool_run(pool, tasks=5):   caller ─ t0 ─ t3 ─ t4 ─┐
//                                     worker ─ t1 ─────────── ┤ (wait until done == 5)
//                                     worker ─ t2 ─────────── ┘

#include <stdint.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

extern "C" int kvtier_decode_f32(const void* kv, int64_t n, int G, const float* q, float scale, int R, int D,
                                 float* out, float* lse);
extern "C" int kvtier_decode_bf16(const void* kv, int64_t n, int G, const float* q, float scale, int R, int D,
                                  float* out, float* lse);
extern "C" int kvtier_decode_kivi2(const void* rows, int64_t n, int G, const float* q, float scale, int R, int D,
                                   float* out, float* lse);
extern "C" int kvtier_decode_kivi4(const void* rows, int64_t n, int G, const float* q, float scale, int R, int D,
                                   float* out, float* lse);
extern "C" int kvtier_decode_kivi8(const void* rows, int64_t n, int G, const float* q, float scale, int R, int D,
                                   float* out, float* lse);
extern "C" int kvtier_decode_fp8(const void* rows, int64_t n, int G, const float* q, float scale, int R, int D,
                                 float* out, float* lse);

namespace {

typedef int (*Kernel)(const void*, int64_t, int, const float*, float, int, int, float*, float*);

struct Job {
  Kernel fn;
  const void* const* kv;  // per task: its first token's row
  const int64_t* n;       // per task: tokens
  int64_t tasks;
  int G, R, D;
  const float* q;  // [G, R, D]
  float scale;
  float* out;  // [tasks, G, R, D]
  float* lse;  // [tasks, G, R]
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<int> rc{0};
};

class Pool {
 public:
  explicit Pool(int workers) {
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { loop(); });
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> l(m_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  int run(const std::shared_ptr<Job>& job) {
    std::lock_guard<std::mutex> one(run_);  // NOTE: one job at a time; later callers wait here
    {
      std::lock_guard<std::mutex> l(m_);
      job_ = job;
      ++epoch_;
    }
    wake_.notify_all();
    work(*job);
    std::unique_lock<std::mutex> l(m_);
    finished_.wait(l, [&] { return job->done.load() == job->tasks; });
    job_.reset();
    return job->rc.load();
  }

 private:
  void work(Job& j) {
    for (int64_t i; (i = j.next.fetch_add(1)) < j.tasks;) {
      const int64_t o = i * j.G * j.R;
      if (j.fn(j.kv[i], j.n[i], j.G, j.q, j.scale, j.R, j.D, j.out + o * j.D, j.lse + o) != 0) j.rc.store(-1);
      if (j.done.fetch_add(1) + 1 == j.tasks) {
        std::lock_guard<std::mutex> l(m_);  // NOTE: taken, so run's wait cannot miss the notify
        finished_.notify_all();
      }
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Job> job;  // NOTE: shared, so a worker that wakes late never reads a freed job
      {
        std::unique_lock<std::mutex> l(m_);
        wake_.wait(l, [&] { return stop_ || epoch_ != seen; });
        if (stop_) return;
        seen = epoch_;
        job = job_;
      }
      if (job) work(*job);
    }
  }

  std::mutex run_, m_;
  std::condition_variable wake_, finished_;
  std::shared_ptr<Job> job_;
  uint64_t epoch_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace

extern "C" {

// A pool of `workers` threads (the caller of kvtier_pool_run is one more). NULL if none started.
void* kvtier_pool_new(int workers) {
  try {
    return new Pool(workers < 0 ? 0 : workers);
  } catch (...) {
    return nullptr;
  }
}

void kvtier_pool_free(void* pool) { delete static_cast<Pool*>(pool); }

// `tasks` calls of one kernel, `kind`: 0 kvtier_decode_f32, 1 kvtier_decode_bf16, 2 / 4 / 8
// kvtier_decode_kivi2 / 4 / 8, 3 kvtier_decode_fp8 (n[i] then counts packed rows), with the same
// q [G, R, D] float32:
// task i attends n[i] tokens (rows) from kv[i] into out[i] [G, R, D] and lse[i] [G, R] (out:
// [tasks, G, R, D], lse: [tasks, G, R] float32). Returns 0, or -1 when the kernel rejected the
// shapes, the kind is unknown or the job could not be started.
int kvtier_pool_run(void* pool, int kind, const void* const* kv, const int64_t* n, int64_t tasks, int G,
                    const float* q, float scale, int R, int D, float* out, float* lse) {
  try {
    auto job = std::make_shared<Job>();
    switch (kind) {
      case 0: job->fn = kvtier_decode_f32; break;
      case 1: job->fn = kvtier_decode_bf16; break;
      case 2: job->fn = kvtier_decode_kivi2; break;
      case 4: job->fn = kvtier_decode_kivi4; break;
      case 8: job->fn = kvtier_decode_kivi8; break;
      case 3: job->fn = kvtier_decode_fp8; break;
      default: return -1;
    }
    job->kv = kv;
    job->n = n;
    job->tasks = tasks;
    job->G = G;
    job->R = R;
    job->D = D;
    job->q = q;
    job->scale = scale;
    job->out = out;
    job->lse = lse;
    return tasks < 1 ? 0 : static_cast<Pool*>(pool)->run(job);
  } catch (...) {
    return -1;
  }
}

}  // extern "C"
