// Host tests of the CPU implementations of the GPU kernels (hip/cpu/): page copy against the copy
// engine's gather, moe_align_block_size against a stable sort, paged MLA decode against a
// double-precision softmax for several split counts, and the element conversions.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "check.h"
#include "copy_engine.h"
#include "kvtier/mla_decode.h"
#include "kvtier/moe_align.h"
#include "kvtier/numeric.h"
#include "kvtier/pages.h"

namespace {

void test_page_copy_matches_copy_engine() {
  constexpr int kLayers = 3, kPages = 9, kPageBytes = 48, kStride = 64;
  std::mt19937 rng(3);
  std::vector<std::vector<std::uint8_t>> pools(kLayers, std::vector<std::uint8_t>(kPages * kStride));
  for (auto& p : pools)
    for (auto& b : p) b = static_cast<std::uint8_t>(rng());
  std::vector<std::uint64_t> ptrs;
  kvtier::PagePools engine_pools;
  for (auto& p : pools) {
    ptrs.push_back(reinterpret_cast<std::uint64_t>(p.data()));
    engine_pools.layer_base.push_back(p.data());
  }
  engine_pools.page_stride_bytes = kStride;
  engine_pools.page_bytes = kPageBytes;
  engine_pools.num_pages = kPages;
  const std::vector<std::int32_t> pages32 = {8, 0, 5, 8};
  const std::vector<std::int64_t> pages64(pages32.begin(), pages32.end());
  std::vector<std::uint8_t> want(pages32.size() * kLayers * kPageBytes), got(want.size(), 0);
  kvtier::gather_pages(engine_pools, pages64.data(), pages64.size(), want.data());

  kvtier::PageCopyParams p;
  p.layer_ptrs = ptrs.data();
  p.pages = pages32.data();
  p.staging = got.data();
  p.num_blocks = static_cast<std::int64_t>(pages32.size());
  p.num_layers = kLayers;
  p.num_pages = kPages;
  p.page_bytes = kPageBytes;
  p.page_stride_bytes = kStride;
  p.word_bytes = kvtier::page_copy_word_bytes(ptrs.data(), kLayers, got.data(), kPageBytes, kStride);
  CHECK(p.word_bytes >= 1 && kPageBytes % p.word_bytes == 0);
  kvtier::gather_pages_cpu(p);
  CHECK(got == want);

  // Scatter back into zeroed pools (distinct pages): the gathered pages reappear, others stay 0.
  std::vector<std::vector<std::uint8_t>> fresh(kLayers, std::vector<std::uint8_t>(kPages * kStride, 0));
  std::vector<std::uint64_t> fresh_ptrs;
  for (auto& f : fresh) fresh_ptrs.push_back(reinterpret_cast<std::uint64_t>(f.data()));
  const std::vector<std::int64_t> dst = {2, 7, 4};
  p.layer_ptrs = fresh_ptrs.data();
  p.pages = dst.data();
  p.pages_int64 = true;
  p.num_blocks = 3;
  kvtier::scatter_pages_cpu(p);
  for (int l = 0; l < kLayers; ++l)
    for (int page = 0; page < kPages; ++page)
      for (int b = 0; b < kPageBytes; ++b) {
        const auto it = std::find(dst.begin(), dst.end(), page);
        const std::uint8_t expect =
            it == dst.end() ? 0 : got[((it - dst.begin()) * kLayers + l) * kPageBytes + b];
        CHECK(fresh[l][page * kStride + b] == expect);
      }

  // Out-of-range ids are skipped; a word size that does not divide the page is refused.
  const std::vector<std::int64_t> bad = {kPages};
  std::vector<std::uint8_t> untouched(kLayers * kPageBytes, 0xAB);
  p.layer_ptrs = ptrs.data();
  p.pages = bad.data();
  p.staging = untouched.data();
  p.num_blocks = 1;
  p.word_bytes = 1;
  kvtier::gather_pages_cpu(p);
  CHECK(std::all_of(untouched.begin(), untouched.end(), [](std::uint8_t b) { return b == 0xAB; }));
  p.word_bytes = 32;
  bool threw = false;
  try {
    kvtier::gather_pages_cpu(p);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
}

void test_page_copy_word_bytes() {
  alignas(16) static std::uint8_t buf[64];
  const std::uint64_t base = reinterpret_cast<std::uint64_t>(buf);
  std::uint64_t ptrs[2] = {base, base + 32};
  CHECK(kvtier::page_copy_word_bytes(ptrs, 2, buf, 64, 128) == 16);
  CHECK(kvtier::page_copy_word_bytes(ptrs, 2, buf, 72, 144) == 8);
  CHECK(kvtier::page_copy_word_bytes(ptrs, 2, buf + 2, 64, 128) == 2);
  ptrs[1] = base + 3;
  CHECK(kvtier::page_copy_word_bytes(ptrs, 2, buf, 64, 128) == 1);
}

void test_moe_align_matches_stable_sort() {
  std::mt19937 rng(7);
  for (const auto& [num_pairs, num_experts, block_m] : std::vector<std::tuple<int, int, int>>{
           {0, 5, 4}, {1, 3, 1}, {37, 7, 4}, {700, 13, 16}, {1031, 384, 64}}) {
    std::vector<std::int32_t> ids(num_pairs);
    for (auto& e : ids) e = static_cast<std::int32_t>(rng() % num_experts);
    if (num_pairs > 3) ids[1] = num_experts + 5, ids[2] = -1;  // out of range: skipped
    const std::int64_t max_padded = kvtier::moe_align_max_padded(num_pairs, num_experts, block_m);
    std::vector<std::int32_t> sorted(max_padded, -7), expert(max_padded / block_m, -7), padded(1, -7);
    std::vector<std::int32_t> work(std::max<std::int64_t>(1, kvtier::moe_align_workspace_size(num_pairs, num_experts)));
    kvtier::MoeAlignParams p;
    p.topk_ids = ids.data();
    p.sorted_ids = sorted.data();
    p.expert_ids = expert.data();
    p.num_padded = padded.data();
    p.chunk_counts = work.data();
    p.num_pairs = num_pairs;
    p.num_experts = num_experts;
    p.block_m = block_m;
    kvtier::moe_align_block_size_cpu(p);
    // Expected: per expert in order, its pairs ascending, then padding up to a multiple of block_m.
    std::vector<std::int32_t> want_sorted, want_expert;
    for (int e = 0; e < num_experts; ++e) {
      std::size_t n = 0;
      for (int i = 0; i < num_pairs; ++i)
        if (ids[i] == e) want_sorted.push_back(i), ++n;
      while (n % block_m) want_sorted.push_back(num_pairs), ++n;
      for (std::size_t b = 0; b < n / block_m; ++b) want_expert.push_back(e);
    }
    CHECK(padded[0] == static_cast<std::int32_t>(want_sorted.size()));
    want_sorted.resize(max_padded, num_pairs);
    want_expert.resize(max_padded / block_m, -1);
    CHECK(sorted == want_sorted);
    CHECK(expert == want_expert);
  }
}

// Double-precision decode of one (b, h) over its rows: returns lse, fills out.
double naive_decode(const std::vector<float>& q, const std::vector<std::vector<float>>& rows, int rank, double sm_scale,
                    std::vector<double>& out) {
  out.assign(rank, 0.0);
  if (rows.empty()) return std::numeric_limits<double>::infinity();
  std::vector<double> s(rows.size());
  double peak = -std::numeric_limits<double>::infinity();
  for (std::size_t t = 0; t < rows.size(); ++t) {
    double dot = 0.0;
    for (std::size_t d = 0; d < q.size(); ++d) dot += static_cast<double>(q[d]) * rows[t][d];
    s[t] = dot * sm_scale;
    peak = std::max(peak, s[t]);
  }
  double sum = 0.0;
  for (double& v : s) sum += v = std::exp(v - peak);
  for (std::size_t t = 0; t < rows.size(); ++t)
    for (int c = 0; c < rank; ++c) out[c] += s[t] / sum * rows[t][c];
  return peak + std::log(sum);
}

void test_mla_decode_matches_naive() {
  constexpr int kHeads = 3, kDim = 40, kRank = 32, kPage = 4, kMaxPages = 6, kPages = 20;
  const std::vector<std::int32_t> seq_lens = {0, 1, 13, 24};
  const int batch = static_cast<int>(seq_lens.size());
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> kv(kPages * kPage * kDim, nan);  // unused pages and tail slots stay NaN
  std::vector<std::int32_t> perm(kPages);
  for (int i = 0; i < kPages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::int32_t> table(batch * kMaxPages, 2147480000);  // huge sentinel past the used pages
  std::vector<std::vector<std::vector<float>>> rows(batch);
  int next = 0;
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < seq_lens[b]; ++t) {
      if (t % kPage == 0) table[b * kMaxPages + t / kPage] = perm[next++];
      float* row = &kv[(table[b * kMaxPages + t / kPage] * kPage + t % kPage) * kDim];
      for (int d = 0; d < kDim; ++d) row[d] = normal(rng);
      rows[b].emplace_back(row, row + kDim);
    }
  }
  std::vector<float> q(batch * kHeads * kDim);
  for (auto& v : q) v = normal(rng);
  const float sm_scale = 0.3f;
  for (int splits : {1, 3, 7}) {
    std::vector<float> out(batch * kHeads * kRank, nan), lse(batch * kHeads, nan);
    std::vector<float> part_out(batch * kHeads * splits * kRank), part_lse(batch * kHeads * splits);
    kvtier::MlaDecodeParams p;
    p.q = q.data();
    p.kv_cache = kv.data();
    p.block_table = table.data();
    p.seq_lens = seq_lens.data();
    p.out = out.data();
    p.lse = lse.data();
    p.part_out = part_out.data();
    p.part_lse = part_lse.data();
    p.q_stride_b = kHeads * kDim;
    p.q_stride_h = kDim;
    p.kv_stride_page = kPage * kDim;
    p.kv_stride_slot = kDim;
    p.block_table_stride_b = kMaxPages;
    p.out_stride_b = kHeads * kRank;
    p.out_stride_h = kRank;
    p.batch = batch;
    p.num_heads = kHeads;
    p.dim = kDim;
    p.kv_lora_rank = kRank;
    p.page_size = kPage;
    p.max_pages = kMaxPages;
    p.num_pages = kPages;
    p.num_splits = splits;
    p.sm_scale = sm_scale;
    p.q_dtype = p.kv_dtype = kvtier::DType::kFloat32;
    kvtier::mla_decode_cpu(p);
    for (int b = 0; b < batch; ++b)
      for (int h = 0; h < kHeads; ++h) {
        std::vector<float> qh(&q[(b * kHeads + h) * kDim], &q[(b * kHeads + h + 1) * kDim]);
        std::vector<double> want;
        const double want_lse = naive_decode(qh, rows[b], kRank, sm_scale, want);
        const float got_lse = lse[b * kHeads + h];
        CHECK(std::isinf(want_lse) ? std::isinf(got_lse) && got_lse > 0 : std::fabs(got_lse - want_lse) < 1e-4);
        for (int c = 0; c < kRank; ++c) CHECK(std::fabs(out[(b * kHeads + h) * kRank + c] - want[c]) < 1e-5);
      }
  }
}

void test_conversions() {
  using kvtier::BF16;
  using kvtier::F16;
  CHECK(BF16::from_float(1.0f) == 0x3F80 && BF16::to_float(0x3F80) == 1.0f);
  CHECK(BF16::from_float(std::numeric_limits<float>::quiet_NaN()) == 0x7FC0);
  CHECK(BF16::from_float(1.00390625f) == 0x3F80);  // tie -> even
  CHECK(BF16::from_float(1.01171875f) == 0x3F82);  // tie -> even (up)
  CHECK(F16::from_float(65504.0f) == 0x7BFF && F16::from_float(65520.0f) == 0x7C00);
  CHECK(F16::from_float(5.9604644775390625e-8f) == 0x0001 && F16::from_float(2.98023223876953125e-8f) == 0);
  CHECK(F16::from_float(-0.0f) == 0x8000 && F16::to_float(0x3C00) == 1.0f && F16::to_float(0x0001) > 0.0f);
  for (std::uint32_t h = 0; h < 0x10000; ++h) {  // f16 -> f32 -> f16 is the identity (NaN stays NaN)
    const float f = F16::to_float(static_cast<std::uint16_t>(h));
    if (f == f) CHECK(F16::from_float(f) == h);
  }
  CHECK(kvtier::E4M3FN::to_float(0x7E) == 448.0f && std::isnan(kvtier::E4M3FN::to_float(0x7F)));
  CHECK(kvtier::E4M3FN::to_float(0x01) == 0.001953125f);
  CHECK(kvtier::E4M3FNUZ::to_float(0x7F) == 240.0f && std::isnan(kvtier::E4M3FNUZ::to_float(0x80)));
  CHECK(kvtier::E4M3FNUZ::to_float(0x01) == 0.0009765625f);
}

}  // namespace

int main() {
  test_page_copy_matches_copy_engine();
  test_page_copy_word_bytes();
  test_moe_align_matches_stable_sort();
  test_mla_decode_matches_naive();
  test_conversions();
  std::puts("kernels_cpu: ok");
  return 0;
}
