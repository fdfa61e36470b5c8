// Copy engine of the tiered KV pool: worker threads that run batched block copies
// (gather device pages -> page-first staging, scatter back, host <-> disk) off the caller's
// thread, behind a bounded queue, with handles to poll or wait on.
//
// Page-first block layout: block i of a batch occupies num_layers * page_bytes contiguous
// bytes; layer l's page sits at offset l * page_bytes inside it (one DMA per block instead of
// one per layer).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace kvtier {

// Per-layer page pools ([num_pages, page_size, row] each, any base address) as raw pointers.
struct PagePools {
  std::vector<std::uint8_t*> layer_base;  // [num_layers] base of each layer's pool
  std::int64_t page_stride_bytes = 0;     // bytes between consecutive pages of a pool
  std::int64_t page_bytes = 0;            // bytes of one page (page_size * row bytes), contiguous
  std::int64_t num_pages = 0;             // pages per pool (bounds check)

  std::int64_t block_bytes() const { return page_bytes * static_cast<std::int64_t>(layer_base.size()); }
};

// Copies pages[i] of every layer into staging + i * block_bytes. Throws std::out_of_range on a
// page id outside [0, num_pages).
void gather_pages(const PagePools& pools, const std::int64_t* pages, std::size_t n, std::uint8_t* staging);
// The inverse of gather_pages.
void scatter_pages(const PagePools& pools, const std::int64_t* pages, std::size_t n, const std::uint8_t* staging);

enum class JobState : int { kPending = 0, kDone = 1, kFailed = 2 };

struct JobResult {
  JobState state = JobState::kPending;
  std::vector<int> block_status;  // per block: 0 = ok, else a job-specific code
  std::string error;              // set when the job threw
  double run_s = 0.0;             // seconds the job itself ran on its worker (no queueing)
};

class CopyEngine {
 public:
  using Handle = std::uint64_t;
  // A job returns one status per block (0 = ok); an exception fails the whole job.
  using Job = std::function<std::vector<int>()>;

  // num_threads >= 1 workers; at most max_queued jobs wait to run (submit blocks beyond that).
  CopyEngine(int num_threads, std::size_t max_queued);
  ~CopyEngine();  // finishes queued jobs, then joins the workers
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Queues a job; blocks while the queue is full (back-pressure). Returns its handle.
  Handle submit(Job job);
  // Like submit but returns 0 instead of blocking when the queue is full.
  Handle try_submit(Job job);

  // kPending until the job ended; never blocks.
  JobState poll(Handle h) const;
  // Blocks until the job ended or timeout_s passed (< 0: no limit); returns its state.
  JobState wait(Handle h, double timeout_s = -1.0) const;
  // Returns and forgets the result of an ended job (throws std::invalid_argument otherwise).
  JobResult collect(Handle h);

  std::size_t queued() const;
  std::size_t num_threads() const { return workers_.size(); }

 private:
  struct Slot {
    Job job;
    std::shared_ptr<JobResult> result;
    Handle handle;
  };
  void worker_loop();
  Handle enqueue(Job job, bool block);

  mutable std::mutex mu_;
  std::condition_variable work_cv_;          // workers wait for jobs
  std::condition_variable space_cv_;         // submitters wait for queue space
  mutable std::condition_variable done_cv_;  // waiters wait for results
  std::deque<Slot> queue_;
  std::unordered_map<Handle, std::shared_ptr<JobResult>> results_;
  std::vector<std::thread> workers_;
  std::size_t max_queued_;
  Handle next_handle_ = 1;
  bool stopping_ = false;
};

}  // namespace kvtier
