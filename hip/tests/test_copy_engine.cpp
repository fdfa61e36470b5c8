// Host tests of the copy engine: gather/scatter round trip on shuffled pages, job failures,
// back-pressure, many concurrent jobs.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "check.h"
#include "copy_engine.h"

using kvtier::CopyEngine;
using kvtier::JobState;

namespace {

void test_gather_scatter_round_trip() {
  constexpr int kLayers = 3, kPages = 11, kPageBytes = 40, kStride = 48;  // padded pages: stride > bytes
  std::vector<std::vector<std::uint8_t>> pools(kLayers, std::vector<std::uint8_t>(kPages * kStride));
  std::mt19937 rng(1);
  for (auto& p : pools)
    for (auto& b : p) b = static_cast<std::uint8_t>(rng());
  kvtier::PagePools pp;
  for (auto& p : pools) pp.layer_base.push_back(p.data());
  pp.page_stride_bytes = kStride;
  pp.page_bytes = kPageBytes;
  pp.num_pages = kPages;
  std::vector<std::int64_t> pages = {7, 2, 9, 0};
  std::vector<std::uint8_t> staging(pages.size() * pp.block_bytes());
  kvtier::gather_pages(pp, pages.data(), pages.size(), staging.data());
  for (std::size_t i = 0; i < pages.size(); ++i)
    for (int l = 0; l < kLayers; ++l)
      for (int b = 0; b < kPageBytes; ++b)
        CHECK(staging[i * pp.block_bytes() + l * kPageBytes + b] == pools[l][pages[i] * kStride + b]);
  // Scatter into other pages, then gather those: identical bytes; padding bytes untouched.
  auto before = pools;
  std::vector<std::int64_t> dst = {1, 3, 4, 10};
  kvtier::scatter_pages(pp, dst.data(), dst.size(), staging.data());
  std::vector<std::uint8_t> again(staging.size());
  kvtier::gather_pages(pp, dst.data(), dst.size(), again.data());
  CHECK(again == staging);
  for (int l = 0; l < kLayers; ++l)
    for (int pg = 0; pg < kPages; ++pg)
      for (int b = kPageBytes; b < kStride; ++b) CHECK(pools[l][pg * kStride + b] == before[l][pg * kStride + b]);
  std::vector<std::int64_t> bad = {3, 11};
  bool threw = false;
  try {
    kvtier::gather_pages(pp, bad.data(), bad.size(), staging.data());
  } catch (const std::out_of_range&) {
    threw = true;
  }
  CHECK(threw);
}

void test_jobs_and_failures() {
  CopyEngine engine(2, 4);
  auto ok = engine.submit([] { return std::vector<int>{0, 0, 3}; });
  auto bad = engine.submit([]() -> std::vector<int> { throw std::runtime_error("disk on fire"); });
  CHECK(engine.wait(ok) == JobState::kDone && engine.wait(bad) == JobState::kFailed);
  auto r = engine.collect(ok);
  CHECK(r.block_status == (std::vector<int>{0, 0, 3}));
  auto f = engine.collect(bad);
  CHECK(f.error == "disk on fire");
  bool threw = false;
  try {
    engine.poll(ok);  // collected: forgotten
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
}

void test_back_pressure_and_many_jobs() {
  CopyEngine engine(2, 2);
  std::atomic<bool> release{false};
  auto blocker = [&] {
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return std::vector<int>{0};
  };
  std::vector<CopyEngine::Handle> hs;
  for (int i = 0; i < 4; ++i) hs.push_back(engine.submit(blocker));  // 2 running + 2 queued
  while (engine.queued() != 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(engine.try_submit(blocker) == 0);  // full: refused without blocking
  CHECK(engine.wait(hs[0], 0.01) == JobState::kPending);
  release = true;
  for (auto h : hs) CHECK(engine.wait(h) == JobState::kDone);
  std::atomic<int> sum{0};
  std::vector<CopyEngine::Handle> many;
  for (int i = 0; i < 500; ++i)
    many.push_back(engine.submit([&sum, i] {
      sum += i;
      return std::vector<int>{};
    }));
  for (auto h : many) {
    CHECK(engine.wait(h) == JobState::kDone);
    engine.collect(h);
  }
  CHECK(sum.load() == 499 * 500 / 2);
}

}  // namespace

int main() {
  test_gather_scatter_round_trip();
  test_jobs_and_failures();
  test_back_pressure_and_many_jobs();
  std::printf("copy_engine: ok\n");
  return 0;
}
