#include "copy_engine.h"

#include <chrono>
#include <cstring>
#include <stdexcept>

namespace kvtier {
namespace {

void check_page(const PagePools& pools, std::int64_t page, std::size_t i) {
  if (page < 0 || page >= pools.num_pages)
    throw std::out_of_range("pages[" + std::to_string(i) + "] = " + std::to_string(page) + " is outside [0, " +
                            std::to_string(pools.num_pages) + ")");
}

}  // namespace

void gather_pages(const PagePools& pools, const std::int64_t* pages, std::size_t n, std::uint8_t* staging) {
  const auto pb = static_cast<std::size_t>(pools.page_bytes);
  for (std::size_t i = 0; i < n; ++i) check_page(pools, pages[i], i);
  for (std::size_t i = 0; i < n; ++i) {
    std::uint8_t* dst = staging + i * static_cast<std::size_t>(pools.block_bytes());
    for (std::size_t l = 0; l < pools.layer_base.size(); ++l)
      std::memcpy(dst + l * pb, pools.layer_base[l] + pages[i] * pools.page_stride_bytes, pb);
  }
}

void scatter_pages(const PagePools& pools, const std::int64_t* pages, std::size_t n, const std::uint8_t* staging) {
  const auto pb = static_cast<std::size_t>(pools.page_bytes);
  for (std::size_t i = 0; i < n; ++i) check_page(pools, pages[i], i);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint8_t* src = staging + i * static_cast<std::size_t>(pools.block_bytes());
    for (std::size_t l = 0; l < pools.layer_base.size(); ++l)
      std::memcpy(pools.layer_base[l] + pages[i] * pools.page_stride_bytes, src + l * pb, pb);
  }
}

CopyEngine::CopyEngine(int num_threads, std::size_t max_queued) : max_queued_(max_queued) {
  if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(num_threads));
  if (max_queued < 1) throw std::invalid_argument("max_queued must be >= 1");
  for (int i = 0; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

CopyEngine::~CopyEngine() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  space_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

CopyEngine::Handle CopyEngine::enqueue(Job job, bool block) {
  std::unique_lock<std::mutex> lk(mu_);
  if (block) {
    space_cv_.wait(lk, [&] { return stopping_ || queue_.size() < max_queued_; });
  } else if (queue_.size() >= max_queued_) {
    return 0;
  }
  if (stopping_) throw std::runtime_error("copy engine is shutting down");
  const Handle h = next_handle_++;
  auto result = std::make_shared<JobResult>();
  results_[h] = result;
  queue_.push_back(Slot{std::move(job), std::move(result), h});
  lk.unlock();
  work_cv_.notify_one();
  return h;
}

CopyEngine::Handle CopyEngine::submit(Job job) { return enqueue(std::move(job), true); }
CopyEngine::Handle CopyEngine::try_submit(Job job) { return enqueue(std::move(job), false); }

void CopyEngine::worker_loop() {
  for (;;) {
    Slot slot;
    {
      std::unique_lock<std::mutex> lk(mu_);
      work_cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      slot = std::move(queue_.front());
      queue_.pop_front();
    }
    space_cv_.notify_one();
    JobResult local;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      local.block_status = slot.job();
      local.state = JobState::kDone;
    } catch (const std::exception& e) {
      local.state = JobState::kFailed;
      local.error = e.what();
    } catch (...) {
      local.state = JobState::kFailed;
      local.error = "unknown exception";
    }
    local.run_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    {
      std::lock_guard<std::mutex> g(mu_);
      *slot.result = std::move(local);
    }
    done_cv_.notify_all();
  }
}

JobState CopyEngine::poll(Handle h) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = results_.find(h);
  if (it == results_.end()) throw std::invalid_argument("unknown copy handle " + std::to_string(h));
  return it->second->state;
}

JobState CopyEngine::wait(Handle h, double timeout_s) const {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = results_.find(h);
  if (it == results_.end()) throw std::invalid_argument("unknown copy handle " + std::to_string(h));
  auto result = it->second;
  auto ended = [&] { return result->state != JobState::kPending; };
  if (timeout_s < 0) {
    done_cv_.wait(lk, ended);
  } else {
    done_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), ended);
  }
  return result->state;
}

JobResult CopyEngine::collect(Handle h) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = results_.find(h);
  if (it == results_.end()) throw std::invalid_argument("unknown copy handle " + std::to_string(h));
  if (it->second->state == JobState::kPending)
    throw std::invalid_argument("copy handle " + std::to_string(h) + " has not ended");
  JobResult out = std::move(*it->second);
  results_.erase(it);
  return out;
}

std::size_t CopyEngine::queued() const {
  std::lock_guard<std::mutex> g(mu_);
  return queue_.size();
}

}  // namespace kvtier
