// The GPU launchers and kernels of hip/kernels, run on the host under HIP-CPU (ROCm's CPU
// implementation of the HIP API), against the CPU implementations of hip/cpu on the same
// adversarial inputs (shuffled pages, NaN in unused pages and tail slots, a huge sentinel past
// the used block_table entries, zero-length sequences, padded slots and pages). Not part of CI
// (HIP-CPU is not packaged): run hip/tests/hip_cpu/run.sh, see there.
#include <hip/hip_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>
#include "kvtier/mla_decode.h"
#include "kvtier/moe_align.h"
#include "kvtier/pages.h"
#include "kvtier/numeric.h"

static int failures = 0;
#define EXPECT(c, ...) do { if (!(c)) { ++failures; std::printf("FAIL %s:%d: ", __FILE__, __LINE__); std::printf(__VA_ARGS__); std::printf("\n"); } } while (0)

static void device_sync() { hipDeviceSynchronize(); }

void test_pages(int page_size, int row, int es, int pad, bool int64_pages) {
  const int L = 3, P = 9;
  std::mt19937 rng(page_size * 31 + row);
  const long page_bytes = (long)page_size * row * es, stride = page_bytes + pad;
  std::vector<std::vector<unsigned char>> pools(L, std::vector<unsigned char>(P * stride + 64));
  for (auto& p : pools) for (auto& b : p) b = rng();
  std::vector<std::uint64_t> ptrs;
  for (auto& p : pools) ptrs.push_back(reinterpret_cast<std::uint64_t>(p.data()));
  std::vector<std::int64_t> pages64 = {8, 0, 5, 3};
  std::vector<std::int32_t> pages32(pages64.begin(), pages64.end());
  std::vector<unsigned char> gpu(pages64.size() * L * page_bytes + 32), cpu(gpu.size());
  kvtier::PageCopyParams p;
  p.layer_ptrs = ptrs.data();
  p.pages = int64_pages ? (const void*)pages64.data() : (const void*)pages32.data();
  p.pages_int64 = int64_pages;
  p.num_blocks = 4; p.num_layers = L; p.num_pages = P; p.page_bytes = page_bytes; p.page_stride_bytes = stride;
  p.staging = gpu.data();
  p.word_bytes = kvtier::page_copy_word_bytes(ptrs.data(), L, gpu.data(), page_bytes, stride);
  kvtier::launch_gather_pages(p, nullptr); device_sync();
  p.staging = cpu.data();
  kvtier::gather_pages_cpu(p);
  EXPECT(gpu == cpu, "gather page_size=%d row=%d es=%d word=%d", page_size, row, es, p.word_bytes);
  // scatter into fresh pools
  std::vector<std::vector<unsigned char>> a(L, std::vector<unsigned char>(P * stride + 64, 0)), b = a;
  std::vector<std::uint64_t> pa, pb;
  for (int l = 0; l < L; ++l) { pa.push_back((std::uint64_t)a[l].data()); pb.push_back((std::uint64_t)b[l].data()); }
  p.staging = gpu.data();
  p.layer_ptrs = pa.data(); kvtier::launch_scatter_pages(p, nullptr); device_sync();
  p.layer_ptrs = pb.data(); kvtier::scatter_pages_cpu(p);
  EXPECT(a == b, "scatter page_size=%d row=%d", page_size, row);
  std::printf("pages page_size=%d row=%d es=%d pad=%d int64=%d word=%d ok\n", page_size, row, es, pad, int64_pages, p.word_bytes);
}

void test_moe(int pairs, int E, int bm) {
  std::mt19937 rng(pairs + E);
  std::vector<std::int32_t> ids(pairs);
  for (auto& e : ids) e = rng() % E;
  if (pairs > 700) for (int i = 0; i < 400; ++i) ids[i] = 3 % E;  // skew
  const long maxp = kvtier::moe_align_max_padded(pairs, E, bm);
  auto run = [&](bool gpu, std::vector<std::int32_t>& s, std::vector<std::int32_t>& x, std::vector<std::int32_t>& n) {
    s.assign(maxp, -7); x.assign(maxp / bm, -7); n.assign(1, -7);
    std::vector<std::int32_t> work(std::max<long>(1, kvtier::moe_align_workspace_size(pairs, E)));
    kvtier::MoeAlignParams p;
    p.topk_ids = ids.data(); p.sorted_ids = s.data(); p.expert_ids = x.data(); p.num_padded = n.data();
    p.chunk_counts = work.data(); p.num_pairs = pairs; p.num_experts = E; p.block_m = bm;
    if (gpu) { kvtier::launch_moe_align_block_size(p, nullptr); device_sync(); } else kvtier::moe_align_block_size_cpu(p);
  };
  std::vector<std::int32_t> s1, x1, n1, s2, x2, n2;
  run(true, s1, x1, n1); run(false, s2, x2, n2);
  EXPECT(s1 == s2 && x1 == x2 && n1 == n2, "moe pairs=%d E=%d bm=%d", pairs, E, bm);
  std::printf("moe pairs=%d E=%d bm=%d num_padded=%d ok\n", pairs, E, bm, n1[0]);
}

template <typename QT, typename KVT>
void test_mla(int heads, int rank, int rope, int page_size, std::vector<int> lens, int splits, float kv_scale,
              int slot_pad, double tol) {
  using Q = typename QT::storage; using K = typename KVT::storage;
  const int B = lens.size(), dim = rank + rope;
  int max_len = *std::max_element(lens.begin(), lens.end());
  const int max_pages = std::max(1, (max_len + page_size - 1) / page_size) + 1;
  const int P = B * max_pages + 3;
  const int slot_stride = dim + slot_pad, page_stride = page_size * slot_stride;
  std::mt19937 rng(heads * 7 + page_size + splits);
  std::normal_distribution<float> nd;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<K> kv(P * page_stride);
  auto store = [&](float v) -> K {
    if constexpr (std::is_same_v<KVT, kvtier::E4M3FN> || std::is_same_v<KVT, kvtier::E4M3FNUZ>) {
      // nearest fp8 by search (test only)
      K best = 0; float bd = 1e30f;
      for (int b = 0; b < 256; ++b) { float f = KVT::to_float(b); if (f == f && std::fabs(f - v) < bd) { bd = std::fabs(f - v); best = b; } }
      return v != v ? (std::is_same_v<KVT, kvtier::E4M3FN> ? 0x7F : 0x80) : best;
    } else { return KVT::from_float(v); }
  };
  for (auto& x : kv) x = store(nan);
  std::vector<std::int32_t> perm(P); for (int i = 0; i < P; ++i) perm[i] = i; std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::int32_t> bt(B * max_pages, 2147483647);
  for (int b = 0; b < B; ++b) {
    const int used = (lens[b] + page_size - 1) / page_size;
    for (int i = 0; i < used; ++i) bt[b * max_pages + i] = perm[b * max_pages + i];
    for (int t = 0; t < lens[b]; ++t) for (int d = 0; d < dim; ++d)
      kv[bt[b * max_pages + t / page_size] * page_stride + (t % page_size) * slot_stride + d] = store(nd(rng) / kv_scale);
  }
  std::vector<Q> q(B * heads * dim);
  for (auto& x : q) x = QT::from_float(nd(rng));
  std::vector<std::int32_t> seq(lens.begin(), lens.end());
  auto run = [&](bool gpu, std::vector<Q>& out, std::vector<float>& lse) {
    out.assign(B * heads * rank, QT::from_float(7.0f)); lse.assign(B * heads, 7.0f);
    std::vector<float> po(B * heads * splits * rank), pl(B * heads * splits);
    kvtier::MlaDecodeParams p;
    p.q = q.data(); p.kv_cache = kv.data(); p.block_table = bt.data(); p.seq_lens = seq.data(); p.out = out.data();
    p.lse = lse.data(); p.part_out = po.data(); p.part_lse = pl.data();
    p.q_stride_b = heads * dim; p.q_stride_h = dim; p.kv_stride_page = page_stride; p.kv_stride_slot = slot_stride;
    p.block_table_stride_b = max_pages; p.out_stride_b = heads * rank; p.out_stride_h = rank;
    p.batch = B; p.num_heads = heads; p.dim = dim; p.kv_lora_rank = rank; p.page_size = page_size; p.max_pages = max_pages;
    p.num_pages = P; p.num_splits = splits; p.sm_scale = 0.3f * std::sqrt(64.0f / dim); p.kv_scale = kv_scale;
    p.q_dtype = QT::dtype; p.kv_dtype = KVT::dtype;
    if (gpu) { kvtier::launch_mla_decode(p, nullptr); device_sync(); } else kvtier::mla_decode_cpu(p);
  };
  std::vector<Q> og, oc; std::vector<float> lg, lc;
  run(true, og, lg); run(false, oc, lc);
  double worst = 0, worst_lse = 0; bool pattern = true;
  for (size_t i = 0; i < og.size(); ++i) {
    float a = QT::to_float(og[i]), c = QT::to_float(oc[i]);
    if ((a != a) != (c != c)) pattern = false;
    else if (a == a) worst = std::max(worst, std::fabs((double)a - c) / (1e-2 + std::fabs((double)c)));
  }
  for (size_t i = 0; i < lg.size(); ++i) {
    if (std::isinf(lc[i]) || std::isinf(lg[i])) { if (lc[i] != lg[i]) pattern = false; }
    else worst_lse = std::max(worst_lse, std::fabs((double)lg[i] - lc[i]));
  }
  EXPECT(pattern && worst < tol && worst_lse < 1e-4, "mla heads=%d rank=%d page=%d splits=%d worst=%g lse=%g pattern=%d",
         heads, rank, page_size, splits, worst, worst_lse, pattern);
  std::printf("mla q=%d kv=%d heads=%d dim=%d+%d page=%d splits=%d pad=%d: worst rel %.3g, lse %.3g %s\n",
              (int)QT::dtype, (int)KVT::dtype, heads, rank, rope, page_size, splits, slot_pad, worst, worst_lse,
              pattern ? "" : "PATTERN MISMATCH");
}

int main() {
  std::printf("kWarpSize %d, heads per block %d\n", kvtier::kWarpSize, kvtier::mla_decode_heads_per_block());
  test_pages(64, 576, 2, 0, true);   // 16-byte words
  test_pages(4, 5, 2, 0, false);     // 2-byte words
  test_pages(3, 7, 1, 5, true);      // 1-byte words, padded pages
  test_pages(16, 36, 4, 16, false);  // 16-byte words with padded stride
  test_moe(0, 5, 4);
  test_moe(1, 384, 64);
  test_moe(37, 7, 4);
  test_moe(2400, 384, 16);
  test_moe(1031, 13, 64);
  test_mla<kvtier::F32, kvtier::F32>(5, 40, 24, 16, {0, 1, 17, 64, 97}, 3, 1.0f, 0, 1e-4);
  test_mla<kvtier::F32, kvtier::F32>(17, 32, 16, 1, {33, 0, 5}, 2, 1.0f, 3, 1e-4);   // element loads (odd pitch)
  test_mla<kvtier::F16, kvtier::F16>(3, 33, 7, 4, {13, 0, 40}, 1, 1.0f, 0, 2e-3);
  test_mla<kvtier::BF16, kvtier::BF16>(16, 512, 64, 64, {0, 130, 7, 300}, 4, 1.0f, 0, 1.6e-2);
  test_mla<kvtier::BF16, kvtier::BF16>(8, 512, 64, 16, {1, 200}, 1, 1.0f, 8, 1.6e-2);
  test_mla<kvtier::BF16, kvtier::E4M3FN>(20, 512, 64, 64, {90, 0, 257}, 5, 0.05f, 0, 1.6e-2);
  test_mla<kvtier::BF16, kvtier::E4M3FNUZ>(8, 512, 64, 1, {3, 40}, 2, 0.05f, 0, 1.6e-2);
  std::printf("%s (%d failures)\n", failures ? "FAILED" : "all ok", failures);
  return failures != 0;
}
