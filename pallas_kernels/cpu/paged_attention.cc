// Native CPU paged attention for Ferry (and the scanned layers' stacked matmul), exported as XLA
// FFI handlers:
//
//   FerryPagedDecodeAttention   q [S, Hq, D], k/v pages [NB, BS, Hkv, D], block_tables [S, W] i32,
//                               context_lens [S] i32                      -> out [S, Hq, D]
//   FerryPagedPrefillAttention  q [T, Hq, D], k/v pages, block_tables, context_lens,
//                               query_start_loc [S + 1] i32               -> out [T, Hq, D]
//   FerryKvWrite                pages [..., NB, BS, Hkv, D], new [T, Hkv, D] (pages' dtype),
//                               slot_mapping [T] i32  -> pages with row slot_mapping[t] = new[t]
//                               (rows of the leading dims in order; aliased in place; slots outside
//                               the rows are dropped)
//   FerryStackedMatmul          x [M, K] f32 (or bf16 under bf16 w), w [L, K, N] f32 or bf16, layer [] i32,
//                               rows [] i32 -> x[:rows] @ w[layer] [M, N] f32 (rows past `rows` unwritten;
//                               w[layer] read in place; see "stacked matmul" below); attribute
//                               act >= 0: act(gate) * up of its [gate | up]
//                               halves, [M, N/2] f32 or bf16 (see "gated activation")
//   FerryRmsNorm                x [M, K] f32 or bf16, w [K] (x's dtype)     -> RMSNorm(x) [M, K]
//   FerryAddRmsNorm             x [M, K], delta [M, K] (f32 or x's dtype), w [K]
//                               -> sum = x + delta (x's dtype), RMSNorm(sum) (see "RMSNorm" below)
//
// Attributes: scale (f32) and soft_cap (f32; 0 = no cap). Semantics are those of
// pallas_kernels/reference.py: a query's absolute position is context_len - query_len + its index
// in the chunk, it attends to keys at positions <= its own (and < W * BS), rows that attend to
// nothing come out as zeros, softmax runs in float32 and the output has q's dtype. float32 and
// bfloat16 are supported: q, pages and output of one dtype, or float32 q and output over bfloat16
// pages (a bf16 KV cache under a float32 model: half the cache bytes, no cast of the cache).
// Accumulation is float32.
//
// K/V are read through the block table in place (no gather copy) and only the pages a query row
// can see are touched, so garbage in unused page slots or unused table entries is never read.
// Page ids are clamped into [0, NB) like XLA's gather clamps indices, so a bad table cannot read
// out of bounds. Online (flash) softmax runs one page at a time in float32; all query heads of a
// KV head (and, in prefill, a tile of query rows) are processed together so each K/V row is
// loaded once per group, and the next pages are prefetched (they sit at random addresses).
// Work items are (sequence, all kv heads) in decode -- each page is then one contiguous read --
// with the heads split when the batch is small, and (sequence, query tile, kv head) in prefill,
// where on AVX-512 a tile runs as two small GEMMs per 16 keys (PrefillTileAvx512). A prefill call's
// sequences of one query row (a ragged step's decodes) take decode tiles: 2.7x faster for them than a
// one-row GEMM tile, and the same result as a decode step's. On AVX2 without AVX-512, prefill and decode
// tiles run in 8-lane vectors (PrefillTileAvx2, DecodeTileAvx2) and the matmul in AVX2 panel tiles;
// elsewhere the portable loops, GCC's vectors. FERRY_NATIVE_NO_AVX512=1 takes the AVX2 code on an AVX-512
// CPU (tests).
// They are spread over XLA's intra-op thread pool (FFI ThreadPool context); the calling thread
// takes items too, so the call never waits on a busy pool. FERRY_NATIVE_ATTENTION_THREADS=N sets
// the number of threads (1 = serial; above the pool's, the extra ones queue: tests); the result does
// not depend on it.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

#if defined(__GNUC__)
#define FERRY_INLINE inline __attribute__((always_inline))
#else
#define FERRY_INLINE inline
#endif

// Hot loops are compiled twice on x86-64 (baseline and AVX2/FMA) and picked at load time, so the
// library stays portable (-march=x86-64-v2 baseline) but uses wide vectors where the CPU has them.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && \
    !defined(FERRY_NO_TARGET_CLONES)
#define FERRY_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FERRY_CLONES
#endif

namespace {

// ----------------------------------------------------------------------------- element types

FERRY_INLINE float Bf16ToF32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

FERRY_INLINE uint16_t F32ToBf16(float f) {  // round to nearest even, like XLA's convert
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

FERRY_INLINE float ToF32(float x) { return x; }
FERRY_INLINE float ToF32(uint16_t x) { return Bf16ToF32(x); }
FERRY_INLINE void FromF32(float x, float* dst) { *dst = x; }
FERRY_INLINE void FromF32(float x, uint16_t* dst) { *dst = F32ToBf16(x); }
FERRY_INLINE float RoundedToBf16(float x) { return Bf16ToF32(F32ToBf16(x)); }  // float(bfloat16(x))

// An attention tile's output vector: dst[d] = sums[d] / l in TQ, 0 where the query vector saw no key (l == 0).
// The select outside the loop, which then vectorizes: inside it, GCC left the loop scalar, 26% of an AVX2
// prefill tile's time (4 prompts of 77-145 tokens) and 7% of the AVX2 decode tile's from L3.
template <typename TQ>
FERRY_INLINE void NormalizedOut(const float* __restrict sums, int64_t D, float l, TQ* __restrict dst) {
  if (l > 0.0f) {
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < D; ++d) FromF32(sums[d] * inv, dst + d);
  } else {
    for (int64_t d = 0; d < D; ++d) FromF32(0.0f, dst + d);
  }
}

// exp(x) for x in [-87, 88] (float32 neither under- nor overflows): Cephes-style range reduction and a
// degree-6 polynomial, ~2 ulp, written without calls or branches so the loops using it vectorise.
FERRY_INLINE float ExpInRange(float x) {
  const float kLog2e = 1.44269504088896341f;
  const float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * kLog2e + kRound) - kRound;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// exp(x) for x <= 0 (scores minus their running max): 0 below -87.
FERRY_INLINE float ExpNonPositive(float x) {
  const float y = ExpInRange(x < -87.0f ? -87.0f : x);
  return x < -87.0f ? 0.0f : y;
}

// exp(x) for any x, clamped into [-87, 88].
FERRY_INLINE float ExpClamped(float x) { return ExpInRange(x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x)); }

// tanh(x) (Cephes tanhf): an odd polynomial near 0, (1 - e) / (1 + e) with e = exp(-2|x|) beyond;
// both sides are computed and one selected, so loops using it vectorise.
FERRY_INLINE float Tanh(float x) {
  const float ax = std::fabs(x);
  const float z = x * x;
  const float poly =
      ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
        1.33314422036e-1f) * z - 3.33332819422e-1f) * z * x + x;
  const float e = ExpNonPositive(-2.0f * ax);
  const float big = (1.0f - e) / (1.0f + e);
  return ax < 0.625f ? poly : (x < 0.0f ? -big : big);
}

// ----------------------------------------------------------------------------- vectors

// Eight floats: one AVX register in the x86-64-v3 clone, two SSE registers in the baseline.
typedef float V8 __attribute__((vector_size(32)));

FERRY_INLINE V8 Load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
FERRY_INLINE void Store8(float* p, V8 v) { std::memcpy(p, &v, sizeof(v)); }

#if defined(__clang__)
#define FERRY_SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t I8 __attribute__((vector_size(32)));
#define FERRY_SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, I8{__VA_ARGS__})
#endif

// Horizontal sums of four vectors: {sum(a), sum(b), sum(c), sum(d)}.
FERRY_INLINE void Sum4(V8 a, V8 b, V8 c, V8 d, float* out) {
  const V8 ab = FERRY_SHUFFLE2(a, b, 0, 8, 2, 10, 4, 12, 6, 14) +
                FERRY_SHUFFLE2(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
  const V8 cd = FERRY_SHUFFLE2(c, d, 0, 8, 2, 10, 4, 12, 6, 14) +
                FERRY_SHUFFLE2(c, d, 1, 9, 3, 11, 5, 13, 7, 15);
  const V8 s = FERRY_SHUFFLE2(ab, cd, 0, 1, 8, 9, 4, 5, 12, 13) +
               FERRY_SHUFFLE2(ab, cd, 2, 3, 10, 11, 6, 7, 14, 15);
  out[0] = s[0] + s[4];
  out[1] = s[1] + s[5];
  out[2] = s[2] + s[6];
  out[3] = s[3] + s[7];
}

FERRY_INLINE float Sum1(V8 a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// scores[t] = dot(q, k + t * ks) for t < n. kD is the head dim when known at compile time (0:
// use d). Four keys at a time: four independent accumulators and one shuffle reduction.
template <int64_t kD>
FERRY_INLINE void Scores(const float* __restrict q, const float* __restrict k, int64_t ks,
                         int64_t n, int64_t d, float* __restrict scores) {
  const int64_t D = kD ? kD : d;
  const int64_t Dv = D & ~int64_t{7};
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const float* k0 = k + t * ks;
    const float* k1 = k0 + ks;
    const float* k2 = k1 + ks;
    const float* k3 = k2 + ks;
    V8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t i = 0; i < Dv; i += 8) {
      const V8 qv = Load8(q + i);
      a0 += qv * Load8(k0 + i);
      a1 += qv * Load8(k1 + i);
      a2 += qv * Load8(k2 + i);
      a3 += qv * Load8(k3 + i);
    }
    Sum4(a0, a1, a2, a3, scores + t);
    for (int64_t i = Dv; i < D; ++i) {
      scores[t] += q[i] * k0[i];
      scores[t + 1] += q[i] * k1[i];
      scores[t + 2] += q[i] * k2[i];
      scores[t + 3] += q[i] * k3[i];
    }
  }
  for (; t < n; ++t) {
    const float* k0 = k + t * ks;
    V8 a0 = {};
    for (int64_t i = 0; i < Dv; i += 8) a0 += Load8(q + i) * Load8(k0 + i);
    float sum = Sum1(a0);
    for (int64_t i = Dv; i < D; ++i) sum += q[i] * k0[i];
    scores[t] = sum;
  }
}

// acc[:] = acc[:] * alpha + sum_t w[t] * v[t * vs + :], 32 features at a time held in registers.
template <int64_t kD>
FERRY_INLINE void Accumulate(float* __restrict acc, float alpha, const float* __restrict w,
                             const float* __restrict v, int64_t vs, int64_t n, int64_t d) {
  const int64_t D = kD ? kD : d;
  const int64_t Dv = D & ~int64_t{7};
  int64_t i = 0;
  for (; i + 32 <= Dv; i += 32) {
    V8 c0 = Load8(acc + i) * alpha, c1 = Load8(acc + i + 8) * alpha;
    V8 c2 = Load8(acc + i + 16) * alpha, c3 = Load8(acc + i + 24) * alpha;
    for (int64_t t = 0; t < n; ++t) {
      const float* row = v + t * vs + i;
      const float wt = w[t];
      c0 += wt * Load8(row);
      c1 += wt * Load8(row + 8);
      c2 += wt * Load8(row + 16);
      c3 += wt * Load8(row + 24);
    }
    Store8(acc + i, c0);
    Store8(acc + i + 8, c1);
    Store8(acc + i + 16, c2);
    Store8(acc + i + 24, c3);
  }
  for (; i < Dv; i += 8) {
    V8 c0 = Load8(acc + i) * alpha;
    for (int64_t t = 0; t < n; ++t) c0 += w[t] * Load8(v + t * vs + i);
    Store8(acc + i, c0);
  }
  for (; i < D; ++i) {
    float c = acc[i] * alpha;
    for (int64_t t = 0; t < n; ++t) c += w[t] * v[t * vs + i];
    acc[i] = c;
  }
}

// ----------------------------------------------------------------------------- problem

struct Geometry {
  int64_t num_blocks, block_size, num_kv_heads, head_dim, num_q_heads, group, table_width;
};

// One unit of work: `nrows` consecutive query rows of one sequence, all query heads of kv heads
// [head0, head0 + nheads). Row r sits at absolute position first_pos + r and sees keys
// [0, clamp(first_pos + r + 1, 0, W * BS)).
struct Tile {
  int64_t row0;  // first query row (index into q / out)
  int64_t nrows;
  int64_t first_pos;
  int64_t seq;
  int64_t head0;
  int64_t nheads;
};

struct Scratch {
  std::vector<float> q, acc, m, l, s, k, v;
  std::vector<int64_t> nk;
  std::vector<int32_t> lane_keys;  // PrefillTileAvx512: keys each query vector sees
  const Tile* next_tile = nullptr;  // the AVX-512 decode tile: the tile whose first pages to prefetch (TileWork)
  void Reserve(int64_t rows, int64_t vecs, int64_t bs, int64_t d) {
    auto grow = [](auto& vec, int64_t n) {
      if (static_cast<int64_t>(vec.size()) < n) vec.resize(n);
    };
    grow(q, vecs * d);
    grow(acc, vecs * d);
    grow(m, vecs);
    grow(l, vecs);
    grow(s, bs);
    grow(k, bs * d);
    grow(v, bs * d);
    grow(nk, rows);
  }
};

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

// The tiles a problem runs: the vector-at-a-time ones (any CPU, any head_dim); on AVX-512 PrefillTileAvx512
// for prefill tiles (head_dim % 16 == 0) and DecodeTileAvx512 for decode ones (head_dim % 32 == 0); on AVX2
// without it PrefillTileAvx2 and DecodeTileAvx2 (head_dim % 8 == 0).
enum class TileKind { kVector, kPrefillAvx512, kDecodeAvx512, kPrefillAvx2, kDecodeAvx2 };

// TQ: the element type of q and out; TKV: of the k/v pages (float or uint16_t = bfloat16).
template <typename TQ, typename TKV>
struct Problem {
  const TQ* q;
  const TKV* k;
  const TKV* v;
  TQ* out;
  const int32_t* tables;
  Geometry g;
  float scale;
  float soft_cap;  // 0: none
  TileKind tiles = TileKind::kVector;
};

// n rows of one kv head of one page as float32: float pages are used in place, bfloat16 ones are
// widened into `buf` (once per page and head, shared by every query vector of the group).
FERRY_INLINE const float* PageRows(const float* page, int64_t, int64_t row_stride, int64_t,
                                   float*, int64_t* stride_out) {
  *stride_out = row_stride;
  return page;
}

FERRY_INLINE const float* PageRows(const uint16_t* page, int64_t n, int64_t row_stride, int64_t d,
                                   float* buf, int64_t* stride_out) {
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t* src = page + t * row_stride;
    float* dst = buf + t * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) dst[i] = Bf16ToF32(src[i]);
  }
  *stride_out = d;
  return buf;
}

#ifndef FERRY_PREFETCH_PAGES
#define FERRY_PREFETCH_PAGES 2
#endif
constexpr int64_t kPrefetchPages = FERRY_PREFETCH_PAGES;  // how far ahead to prefetch pages (0: off)

// An asm statement on x86-64, which the compiler keeps: GCC 12's dead-code elimination dropped every
// __builtin_prefetch from the AVX-512 tiles (and from TileWork), so their pages were never prefetched.
FERRY_INLINE void PrefetchLine(const char* p) {
#if defined(__x86_64__) && defined(__GNUC__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p);
#endif
}

// Pages sit at random places and a tile reads short runs of each, which the hardware prefetcher
// does not follow: ask for a later page's rows (of this tile's heads) while this one is used.
template <typename T>
FERRY_INLINE void Prefetch(const T* rows, int64_t n, int64_t row_stride, int64_t row_elems) {
  const int64_t bytes = row_elems * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0; t < n; ++t) {
    const char* row = reinterpret_cast<const char*>(rows + t * row_stride);
    for (int64_t b = 0; b < bytes; b += 64) PrefetchLine(row + b);
  }
}

// Keys the tile's last query row sees, within the block table's reach.
FERRY_INLINE int64_t TileKeys(const Geometry& g, const Tile& t) {
  return std::clamp<int64_t>(t.first_pos + t.nrows, 0, g.num_blocks > 0 ? g.table_width * g.block_size : 0);
}

// A page's K and V lines asked for `per_call` at a time (Next).
struct PageStream {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t lines = 0, per_call = 0;
  FERRY_INLINE void Next() {
    for (int64_t i = 0; i < per_call && lines > 0; ++i, --lines, k += 64, v += 64) {
      PrefetchLine(k);
      PrefetchLine(v);
    }
  }
};

// A tile's walk over its sequence's pages: page j's element offset at (row 0, head0, 0), block ids clamped
// into the pool, and the prefetch of page j + kPrefetchPages's rows (`row_elems` from head0) while page j
// is used.
struct TilePages {
  const int32_t* table;
  const Geometry& g;
  int64_t head0, keys, count;
  TilePages(const int32_t* tables, const Geometry& geometry, const Tile& tile, int64_t num_keys)
      : table(tables + tile.seq * geometry.table_width), g(geometry), head0(tile.head0), keys(num_keys),
        count((num_keys + geometry.block_size - 1) / geometry.block_size) {}
  int64_t Offset(int64_t j) const {
    const int64_t block = std::clamp<int64_t>(table[j], 0, g.num_blocks - 1);
    return (block * g.block_size * g.num_kv_heads + head0) * g.head_dim;
  }
  int64_t Rows(int64_t j) const { return std::min(g.block_size, keys - j * g.block_size); }  // keys in page j
  // Page j's K and V rows, all at once.
  template <typename T>
  void PrefetchPage(const T* k, const T* v, int64_t j, int64_t row_elems) const {
    Prefetch(k + Offset(j), Rows(j), g.num_kv_heads * g.head_dim, row_elems);
    Prefetch(v + Offset(j), Rows(j), g.num_kv_heads * g.head_dim, row_elems);
  }
  template <typename T>
  void PrefetchAhead(const T* k, const T* v, int64_t j, int64_t row_elems) const {
    if (kPrefetchPages > 0 && j + kPrefetchPages < count) PrefetchPage(k, v, j + kPrefetchPages, row_elems);
  }
  // Page j's K and V lines (none past the last page), a few at each of `calls` Next()s spread over the
  // work before it, where the tile's heads are all of them (a page's rows one run); otherwise at once.
  template <typename T>
  PageStream Stream(const T* k, const T* v, int64_t j, int64_t row_elems, int64_t calls) const {
    if (kPrefetchPages <= 0 || j >= count) return PageStream{};
    if (row_elems != g.num_kv_heads * g.head_dim) {
      PrefetchPage(k, v, j, row_elems);
      return PageStream{};
    }
    const int64_t lines = (Rows(j) * row_elems * static_cast<int64_t>(sizeof(T)) + 63) / 64;
    return PageStream{reinterpret_cast<const char*>(k + Offset(j)), reinterpret_cast<const char*>(v + Offset(j)),
                      lines, (lines + calls - 1) / calls};
  }
  // The first kPrefetchPages pages, which no PrefetchAhead of this tile asks for.
  template <typename T>
  void PrefetchFirst(const T* k, const T* v, int64_t row_elems) const {
    for (int64_t j = 0; j < std::min(kPrefetchPages, count); ++j) PrefetchPage(k, v, j, row_elems);
  }
};

template <typename TQ, typename TKV, int64_t kD>
FERRY_INLINE void AttendTileImpl(const Problem<TQ, TKV>& p, const Tile& tile, Scratch& sc) {
  const Geometry& g = p.g;
  const int64_t G = g.group, D = kD ? kD : g.head_dim, BS = g.block_size;
  const int64_t NH = tile.nheads;
  const int64_t M = tile.nrows * NH * G;  // query vectors: index (r * NH + hh) * G + gi
  const int64_t max_keys_total = g.num_blocks > 0 ? g.table_width * BS : 0;
  const int64_t q_row_stride = g.num_q_heads * D;
  const int64_t kv_row_stride = g.num_kv_heads * D;
  sc.Reserve(tile.nrows, M, BS, D);
  float* qf = sc.q.data();
  float* acc = sc.acc.data();
  float* mx = sc.m.data();
  float* l = sc.l.data();
  float* sv = sc.s.data();
  int64_t* nk = sc.nk.data();

  int64_t max_keys = 0;
  for (int64_t r = 0; r < tile.nrows; ++r) {
    nk[r] = std::clamp<int64_t>(tile.first_pos + r + 1, 0, max_keys_total);
    max_keys = std::max(max_keys, nk[r]);
  }
  // The tile's query heads of one row are contiguous in q: (head0 * G ... (head0 + NH) * G).
  for (int64_t r = 0; r < tile.nrows; ++r) {
    const TQ* src = p.q + (tile.row0 + r) * q_row_stride + tile.head0 * G * D;
    float* dst = qf + r * NH * G * D;
    for (int64_t i = 0; i < NH * G * D; ++i) dst[i] = ToF32(src[i]) * p.scale;
  }
  std::fill(acc, acc + M * D, 0.0f);
  std::fill(mx, mx + M, -std::numeric_limits<float>::infinity());
  std::fill(l, l + M, 0.0f);

  const TilePages pages(p.tables, g, tile, max_keys);
  const float cap = p.soft_cap;
  const float inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  for (int64_t j = 0; j < pages.count; ++j) {
    const int64_t base = j * BS;
    const int64_t n = pages.Rows(j);
    const int64_t offset = pages.Offset(j);
    pages.PrefetchAhead(p.k, p.v, j, NH * D);
    for (int64_t hh = 0; hh < NH; ++hh) {
      int64_t ks = 0, vs = 0;
      const float* kr = PageRows(p.k + offset + hh * D, n, kv_row_stride, D, sc.k.data(), &ks);
      const float* vr = PageRows(p.v + offset + hh * D, n, kv_row_stride, D, sc.v.data(), &vs);
      for (int64_t r = 0; r < tile.nrows; ++r) {
        const int64_t nm = std::min(n, nk[r] - base);  // keys of this page row r sees
        if (nm <= 0) continue;
        for (int64_t gi = 0; gi < G; ++gi) {
          const int64_t mi = (r * NH + hh) * G + gi;
          Scores<kD>(qf + mi * D, kr, ks, nm, D, sv);
          if (cap > 0.0f) {
#pragma omp simd
            for (int64_t t = 0; t < nm; ++t) sv[t] = cap * Tanh(sv[t] * inv_cap);
          }
          float page_max = sv[0];
          for (int64_t t = 1; t < nm; ++t) page_max = std::max(page_max, sv[t]);
          const float new_max = std::max(mx[mi], page_max);
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < nm; ++t) {
            const float e = ExpNonPositive(sv[t] - new_max);
            sv[t] = e;
            sum += e;
          }
          // 0 on the first page (mx = -inf), 1 while the max holds.
          const float alpha = new_max > mx[mi] ? std::exp(mx[mi] - new_max) : 1.0f;
          mx[mi] = new_max;
          l[mi] = l[mi] * alpha + sum;
          Accumulate<kD>(acc + mi * D, alpha, sv, vr, vs, nm, D);
        }
      }
    }
  }

  for (int64_t r = 0; r < tile.nrows; ++r) {
    TQ* dst = p.out + (tile.row0 + r) * q_row_stride + tile.head0 * G * D;
    for (int64_t v = 0; v < NH * G; ++v) NormalizedOut(acc + (r * NH * G + v) * D, D, l[r * NH * G + v], dst + v * D);
  }
}

template <typename TQ, typename TKV>
FERRY_INLINE void AttendTileAnyD(const Problem<TQ, TKV>& p, const Tile& tile, Scratch& sc) {
  switch (p.g.head_dim) {  // common head dims get fully unrolled loops
    case 32: return AttendTileImpl<TQ, TKV, 32>(p, tile, sc);
    case 64: return AttendTileImpl<TQ, TKV, 64>(p, tile, sc);
    case 128: return AttendTileImpl<TQ, TKV, 128>(p, tile, sc);
    case 256: return AttendTileImpl<TQ, TKV, 256>(p, tile, sc);
    default: return AttendTileImpl<TQ, TKV, 0>(p, tile, sc);
  }
}

FERRY_CLONES void AttendTileF32(const Problem<float, float>& p, const Tile& tile, Scratch& sc) {
  AttendTileAnyD(p, tile, sc);
}

FERRY_CLONES void AttendTileBf16(const Problem<uint16_t, uint16_t>& p, const Tile& tile, Scratch& sc) {
  AttendTileAnyD(p, tile, sc);
}

FERRY_CLONES void AttendTileF32Bf16(const Problem<float, uint16_t>& p, const Tile& tile, Scratch& sc) {
  AttendTileAnyD(p, tile, sc);
}

// Defined with the AVX-512 code below.
void PrefillTileAvx512(const Problem<float, float>& p, const Tile& t, Scratch& sc);
void PrefillTileAvx512(const Problem<uint16_t, uint16_t>& p, const Tile& t, Scratch& sc);
void PrefillTileAvx512(const Problem<float, uint16_t>& p, const Tile& t, Scratch& sc);
void DecodeTileAvx512(const Problem<float, float>& p, const Tile& t, Scratch& sc);
void DecodeTileAvx512(const Problem<uint16_t, uint16_t>& p, const Tile& t, Scratch& sc);
void DecodeTileAvx512(const Problem<float, uint16_t>& p, const Tile& t, Scratch& sc);
void DecodeTileAvx2(const Problem<float, float>& p, const Tile& t, Scratch& sc);
void DecodeTileAvx2(const Problem<uint16_t, uint16_t>& p, const Tile& t, Scratch& sc);
void DecodeTileAvx2(const Problem<float, uint16_t>& p, const Tile& t, Scratch& sc);
void PrefillTileAvx2(const Problem<float, float>& p, const Tile& t, Scratch& sc);
void PrefillTileAvx2(const Problem<uint16_t, uint16_t>& p, const Tile& t, Scratch& sc);
void PrefillTileAvx2(const Problem<float, uint16_t>& p, const Tile& t, Scratch& sc);
bool UseAvx512Matmul();
bool UseAvx2Matmul();

FERRY_INLINE void AttendTile(const Problem<float, float>& p, const Tile& t, Scratch& sc) {
  if (p.tiles == TileKind::kPrefillAvx512) return PrefillTileAvx512(p, t, sc);
  if (p.tiles == TileKind::kDecodeAvx512) return DecodeTileAvx512(p, t, sc);
  if (p.tiles == TileKind::kDecodeAvx2) return DecodeTileAvx2(p, t, sc);
  if (p.tiles == TileKind::kPrefillAvx2) return PrefillTileAvx2(p, t, sc);
  AttendTileF32(p, t, sc);
}
FERRY_INLINE void AttendTile(const Problem<uint16_t, uint16_t>& p, const Tile& t, Scratch& sc) {
  if (p.tiles == TileKind::kPrefillAvx512) return PrefillTileAvx512(p, t, sc);
  if (p.tiles == TileKind::kDecodeAvx512) return DecodeTileAvx512(p, t, sc);
  if (p.tiles == TileKind::kDecodeAvx2) return DecodeTileAvx2(p, t, sc);
  if (p.tiles == TileKind::kPrefillAvx2) return PrefillTileAvx2(p, t, sc);
  AttendTileBf16(p, t, sc);
}
FERRY_INLINE void AttendTile(const Problem<float, uint16_t>& p, const Tile& t, Scratch& sc) {
  if (p.tiles == TileKind::kPrefillAvx512) return PrefillTileAvx512(p, t, sc);
  if (p.tiles == TileKind::kDecodeAvx512) return DecodeTileAvx512(p, t, sc);
  if (p.tiles == TileKind::kDecodeAvx2) return DecodeTileAvx2(p, t, sc);
  if (p.tiles == TileKind::kPrefillAvx2) return PrefillTileAvx2(p, t, sc);
  AttendTileF32Bf16(p, t, sc);
}


// ----------------------------------------------------------------------------- threading

bool EnvIsOne(const char* name) {  // the tests' switches, read on every call
  const char* env = std::getenv(name);
  return env != nullptr && *env == '1';
}

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
// decode attention's next pages). With one counter for all, the guess "about `threads` items on" was wrong
// for 20% of a model-b decode step's matmul items at 64 rows, whose panels then came cold from memory;
// ranges ran 38 of 45 linears (16-512 rows, float32) faster, most by 3-10% (bench_native_matmul, both
// schedules taking turns in one process; notes, session 25). A panel's row parts also stay on one thread.
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

// In decode, each thread starting a tile asks for the first pages of the tile it takes next (ParallelFor's
// `next`): a tile's own prefetch only covers its later pages. The AVX-512 decode tile does it itself, spread
// over its last chunks (Scratch::next_tile); the vector tiles get them at once here; the AVX2 decode tile
// asks for nothing (its pages come as runs the L2 prefetcher streams). Not in prefill, where a sequence's
// pages serve several tiles: there it cost 10-15% of a 4 x 128-token chunk's attention.
template <typename P>
struct TileWork {
  const P* problem;
  const std::vector<Tile>* tiles;
  bool ask_next;  // decode
  static void Run(const void* self, int64_t i, int64_t next_item) {
    const auto* w = static_cast<const TileWork*>(self);
    const std::vector<Tile>& tiles = *w->tiles;
    const Tile* next = w->ask_next && next_item >= 0 ? &tiles[next_item] : nullptr;
    const TileKind kind = w->problem->tiles;  // a decode call's: kVector, kDecodeAvx512 or kDecodeAvx2
    Scratch& sc = ThreadScratch();
    sc.next_tile = kind == TileKind::kDecodeAvx512 ? next : nullptr;
    if (next != nullptr && kind == TileKind::kVector) {
      const Geometry& g = w->problem->g;
      TilePages(w->problem->tables, g, *next, TileKeys(g, *next))
          .PrefetchFirst(w->problem->k, w->problem->v, next->nheads * g.head_dim);
    }
    AttendTile(*w->problem, tiles[i], sc);
  }
};

template <typename P>
void RunTiles(ffi::ThreadPool& pool, const P& problem, const std::vector<Tile>& tiles, bool decode) {
  if (tiles.empty()) return;
  // Problems under ~0.1 ms of work are not worth waking other threads for.
  int64_t work = 0;
  for (const Tile& t : tiles)
    work += t.nrows * t.nheads * std::max<int64_t>(t.first_pos + t.nrows, 1);
  work *= problem.g.group * problem.g.head_dim;
  const int64_t threads = ThreadsFor(pool, work, int64_t{1} << 20);
  TileWork<P> w{&problem, &tiles, decode};
  ParallelFor(&pool, static_cast<int64_t>(tiles.size()), threads - 1, &w, &TileWork<P>::Run);
}

// ----------------------------------------------------------------------------- validation

ffi::Error CheckCommon(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens,
                       ffi::AnyBuffer out, Geometry* g) {
  const auto dt = q.element_type(), kv = k.element_type();
  if (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("ferry paged attention: q must be float32 or bfloat16");
  if (v.element_type() != kv || out.element_type() != dt ||
      !(kv == dt || (dt == ffi::DataType::F32 && kv == ffi::DataType::BF16)))
    return ffi::Error::InvalidArgument(
        "ferry paged attention: q and out share a dtype, and k/v pages have it too or are bfloat16 "
        "under float32 q");
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), od = out.dimensions();
  auto td = tables.dimensions(), ld = lens.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4 || od.size() != 3 || td.size() != 2 ||
      ld.size() != 1)
    return ffi::Error::InvalidArgument(
        "ferry paged attention: expected q [T,Hq,D], pages [NB,BS,Hkv,D], block_tables [S,W], "
        "context_lens [S]");
  for (int i = 0; i < 4; ++i)
    if (kd[i] != vd[i])
      return ffi::Error::InvalidArgument("ferry paged attention: k and v pages differ in shape");
  for (int i = 0; i < 3; ++i)
    if (qd[i] != od[i])
      return ffi::Error::InvalidArgument("ferry paged attention: out must have q's shape");
  if (kd[3] != qd[2])
    return ffi::Error::InvalidArgument("ferry paged attention: head_dim of q and pages differ");
  if (kd[2] <= 0 || qd[1] % kd[2] != 0)
    return ffi::Error::InvalidArgument(
        "ferry paged attention: num_q_heads must be a multiple of num_kv_heads");
  if (td[0] != ld[0])
    return ffi::Error::InvalidArgument(
        "ferry paged attention: block_tables and context_lens disagree on the number of sequences");
  if (kd[1] <= 0)
    return ffi::Error::InvalidArgument("ferry paged attention: block_size must be positive");
  g->num_blocks = kd[0];
  g->block_size = kd[1];
  g->num_kv_heads = kd[2];
  g->head_dim = kd[3];
  g->num_q_heads = qd[1];
  g->group = qd[1] / kd[2];
  g->table_width = td[1];
  return ffi::Error::Success();
}

template <typename TQ, typename TKV>
Problem<TQ, TKV> MakeProblem(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::Buffer<ffi::S32> tables, ffi::AnyBuffer out, const Geometry& g,
                             float scale, float soft_cap, TileKind tiles) {
  Problem<TQ, TKV> p;
  p.q = static_cast<const TQ*>(q.untyped_data());
  p.k = static_cast<const TKV*>(k.untyped_data());
  p.v = static_cast<const TKV*>(v.untyped_data());
  p.out = static_cast<TQ*>(out.untyped_data());
  p.tables = tables.typed_data();
  p.g = g;
  p.scale = scale;
  p.soft_cap = soft_cap > 0.0f ? soft_cap : 0.0f;
  p.tiles = tiles;
  return p;
}

template <typename T>
void ZeroRows(T* out, int64_t row0, int64_t nrows, int64_t row_elems) {
  std::memset(out + row0 * row_elems, 0, sizeof(T) * nrows * row_elems);
}

// FERRY_NATIVE_ATTENTION_NO_GEMM_TILES=1 keeps prefill and decode on the vector-at-a-time tiles (tests).
TileKind AttentionTiles(const Geometry& g, bool decode) {
  if (EnvIsOne("FERRY_NATIVE_ATTENTION_NO_GEMM_TILES")) return TileKind::kVector;
  if (UseAvx512Matmul() && g.head_dim % (decode ? 32 : 16) == 0)
    return decode ? TileKind::kDecodeAvx512 : TileKind::kPrefillAvx512;
  if (UseAvx2Matmul() && g.head_dim % 8 == 0) return decode ? TileKind::kDecodeAvx2 : TileKind::kPrefillAvx2;
  return TileKind::kVector;
}

// The tiles over the dtype pair CheckCommon accepted.
void RunAnyDtype(ffi::ThreadPool& pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                 ffi::Buffer<ffi::S32> tables, ffi::AnyBuffer out, const Geometry& g, float scale,
                 float soft_cap, const std::vector<Tile>& tiles, bool decode) {
  const TileKind kind = AttentionTiles(g, decode);
  const bool q_f32 = q.element_type() == ffi::DataType::F32;
  const bool kv_f32 = k.element_type() == ffi::DataType::F32;
  if (q_f32 && kv_f32) {
    RunTiles(pool, MakeProblem<float, float>(q, k, v, tables, out, g, scale, soft_cap, kind), tiles, decode);
  } else if (q_f32) {
    RunTiles(pool, MakeProblem<float, uint16_t>(q, k, v, tables, out, g, scale, soft_cap, kind), tiles, decode);
  } else {
    RunTiles(pool, MakeProblem<uint16_t, uint16_t>(q, k, v, tables, out, g, scale, soft_cap, kind), tiles, decode);
  }
}

// ----------------------------------------------------------------------------- decode

// Tiles for sequences of one query row each (`seqs`; their rows query_start_loc[s], or s where it is null):
// a decode step's, and a ragged prefill step's decoding sequences. A tile takes all kv heads of a sequence,
// so each page is read as one contiguous run; few sequences split the heads to keep enough tiles for the
// threads.
std::vector<Tile> DecodeTiles(const Geometry& g, const std::vector<int64_t>& seqs, const int32_t* qsl,
                              const int32_t* ctx) {
  const int64_t n = static_cast<int64_t>(seqs.size());
  const int64_t splits = std::clamp<int64_t>((16 + n - 1) / std::max<int64_t>(n, 1), 1, g.num_kv_heads);
  const int64_t heads_per_tile = (g.num_kv_heads + splits - 1) / splits;
  std::vector<Tile> tiles;
  tiles.reserve(n * splits);
  for (const int64_t s : seqs)
    for (int64_t h = 0; h < g.num_kv_heads; h += heads_per_tile)
      tiles.push_back(Tile{qsl != nullptr ? qsl[s] : s, 1, static_cast<int64_t>(ctx[s]) - 1, s, h,
                           std::min(heads_per_tile, g.num_kv_heads - h)});
  return tiles;
}

ffi::Error DecodeBody(ffi::ThreadPool& pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens,
                      ffi::Result<ffi::AnyBuffer>& out, float scale, float soft_cap) {
  Geometry g;
  if (auto err = CheckCommon(q, k, v, tables, lens, *out, &g); err.failure()) return err;
  const int64_t S = q.dimensions()[0];
  if (tables.dimensions()[0] != S)
    return ffi::Error::InvalidArgument(
        "ferry paged decode attention: q must have one row per sequence");
  std::vector<int64_t> seqs(S);
  std::iota(seqs.begin(), seqs.end(), int64_t{0});
  const std::vector<Tile> tiles = DecodeTiles(g, seqs, nullptr, lens.typed_data());
  RunAnyDtype(pool, q, k, v, tables, *out, g, scale, soft_cap, tiles, /*decode=*/true);
  return ffi::Error::Success();
}

// ----------------------------------------------------------------------------- prefill

ffi::Error PrefillBody(ffi::ThreadPool& pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens,
                       ffi::Buffer<ffi::S32> query_start_loc, ffi::Result<ffi::AnyBuffer>& out,
                       float scale, float soft_cap) {
  Geometry g;
  if (auto err = CheckCommon(q, k, v, tables, lens, *out, &g); err.failure()) return err;
  const int64_t T = q.dimensions()[0];
  const int64_t S = tables.dimensions()[0];
  if (query_start_loc.dimensions().size() != 1 || query_start_loc.dimensions()[0] != S + 1)
    return ffi::Error::InvalidArgument(
        "ferry paged prefill attention: query_start_loc must have num_sequences + 1 entries");
  const int32_t* ctx = lens.typed_data();
  const int32_t* qsl = query_start_loc.typed_data();
  // Query tiles of ~32 query vectors (rows x group) share every K/V row they load; 64 for the GEMM
  // tiles (measured: 1.1-1.3x of 32 at 512-token chunks, the same at 128).
  const TileKind prefill_kind = AttentionTiles(g, /*decode=*/false);
  const bool gemm_tiles = prefill_kind == TileKind::kPrefillAvx512 || prefill_kind == TileKind::kPrefillAvx2;
  const int64_t tile_rows = std::max<int64_t>(1, (gemm_tiles ? 64 : 32) / g.group);
  std::vector<Tile> tiles;
  std::vector<int64_t> one_row;  // sequences of one query row (a ragged step's decodes): decode tiles
  std::vector<char> covered(T, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t start = qsl[s], q_len = static_cast<int64_t>(qsl[s + 1]) - qsl[s];
    if (q_len == 1 && start >= 0 && start < T) {
      one_row.push_back(s);
      covered[start] = 1;
      continue;
    }
    // Rows of the chunk that exist in q (the reference drops the rest).
    const int64_t lo = std::max<int64_t>(0, -start), hi = std::min<int64_t>(q_len, T - start);
    for (int64_t i0 = lo; i0 < hi; i0 += tile_rows) {
      const int64_t n = std::min(tile_rows, hi - i0);
      std::fill(covered.begin() + start + i0, covered.begin() + start + i0 + n, 1);
      for (int64_t h = 0; h < g.num_kv_heads; ++h)
        tiles.push_back(Tile{start + i0, n, static_cast<int64_t>(ctx[s]) - q_len + i0, s, h, 1});
    }
  }
  const int64_t row_elems = g.num_q_heads * g.head_dim;
  const bool f32 = q.element_type() == ffi::DataType::F32;
  for (int64_t r = 0; r < T;) {  // rows of no sequence (padding) are zeros
    if (covered[r]) { ++r; continue; }
    int64_t e = r;
    while (e < T && !covered[e]) ++e;
    if (f32) ZeroRows(static_cast<float*>(out->untyped_data()), r, e - r, row_elems);
    else ZeroRows(static_cast<uint16_t*>(out->untyped_data()), r, e - r, row_elems);
    r = e;
  }
  // Long tiles first, so the last items handed out are the short ones.
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) {
    return a.first_pos + a.nrows > b.first_pos + b.nrows;
  });
  RunAnyDtype(pool, q, k, v, tables, *out, g, scale, soft_cap, DecodeTiles(g, one_row, qsl, ctx), /*decode=*/true);
  RunAnyDtype(pool, q, k, v, tables, *out, g, scale, soft_cap, tiles, /*decode=*/false);
  return ffi::Error::Success();
}

// No C++ exception may cross the C boundary into XLA (std::bad_alloc from the scratch buffers).
template <typename F>
ffi::Error Guarded(F&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("ferry paged attention: ") + e.what());
  } catch (...) {
    return ffi::Error::Internal("ferry paged attention: unknown C++ exception");
  }
}

// ----------------------------------------------------------------------------- KV write

// XLA CPU widens a scatter into a bfloat16/float16 array to float32 over the whole operand (a
// convert and a copy of every page, per layer, per step); this writes only the T rows, in place.
ffi::Error KvWriteImpl(ffi::AnyBuffer pages, ffi::AnyBuffer updates, ffi::Buffer<ffi::S32> slots,
                       ffi::Result<ffi::AnyBuffer> out) {
  auto pd = pages.dimensions(), ud = updates.dimensions();
  if (pages.element_type() != updates.element_type() || out->element_type() != pages.element_type())
    return ffi::Error::InvalidArgument("ferry kv write: pages, updates and out must share a dtype");
  const size_t n = pd.size();
  if (n < 4 || ud.size() != 3 || slots.dimensions().size() != 1 || ud[1] != pd[n - 2] ||
      ud[2] != pd[n - 1] || slots.dimensions()[0] != ud[0])
    return ffi::Error::InvalidArgument(
        "ferry kv write: expected pages [..., NB, BS, H, D], updates [T, H, D], slot_mapping [T]");
  int64_t num_slots = 1;  // the rows of the leading dims, in order: [L, NB, BS] is L * NB * BS slots
  for (size_t i = 0; i + 2 < n; ++i) num_slots *= pd[i];
  if (num_slots == 0) return ffi::Error::Success();
  const int64_t row_bytes = static_cast<int64_t>(pages.size_bytes() / num_slots);
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != pages.untyped_data())  // not aliased after all: start from the pages
    std::memcpy(dst, pages.untyped_data(), pages.size_bytes());
  const char* src = static_cast<const char*>(updates.untyped_data());
  const int32_t* slot = slots.typed_data();
  for (int64_t t = 0; t < ud[0]; ++t)
    if (slot[t] >= 0 && slot[t] < num_slots)
      std::memcpy(dst + slot[t] * row_bytes, src + t * row_bytes, row_bytes);
  return ffi::Error::Success();
}

// ----------------------------------------------------------------------------- stacked matmul

// y [M, N] = x [M, K] @ w[layer] where w is a whole stack of per-layer weights, packed once at load
// (pallas_kernels/native.py, pack_stacked): the decoder layers' linears inside jax.lax.scan read their
// layer's weights in place, where XLA CPU would copy the dynamic-slice w[layer] on every step.
//
// The packed layout is panel-major, the order in which the tiles read it: w [L, P, 4, KP, 16 * E], a panel
// being 64 output columns over all of K, contiguous in memory, as 4 strips of 16 columns one after another.
//   float32 (E = 1): KP = K, strip[s][k, j] = w[k, c + 16 s + j].
//   bfloat16 (E = 2): KP = ceil(K / 2), strip[s][k2, 2 j + h] = w[2 k2 + h, c + 16 s + j] (zero past K): a
//     32-bit lane per column holding a pair of rows, as vdpbf16ps takes them.
// A tile walks each strip's k steps as one stream of whole lines (the AVX-512 tiles four streams at once),
// where in a [KP, 64 E] panel an AVX2 tile's pass over 16 columns read a line every 256 bytes: on the Zen 2
// the 1-row LM head took 1.61 against 2.22 ms, a 1-row gated [512, 4096] 0.215 against 0.303, 64 rows of it
// 1.56 against 1.69 (bench_native_matmul.py, notes session 23).
// The columns are `groups` equal parts of N / groups (a fused projection's, [gate | up]), each padded
// with zero columns to whole panels: Pg = ceil(N / groups / 64) panels a part, P = groups * Pg.
// Packing panels on every call streamed w at 6-13 GB/s a thread (rows N * 2 bytes apart); pre-packed, a
// [512, 4096] bf16 layer with its gate took 0.14 against 0.23 ms at 4 rows (notes, session 11).
// A work item is a panel (gated: a gate panel and its up panel) over all rows (the tiled paths: over a part
// of them, MatmulWork::RowParts), kRowBlock rows at a time: the panel comes from memory once and from L2 for
// the next rows. Every path sums each column over k in order, one FMA (vdpbf16ps: one pair) per term, so a
// row's result does not depend on the batch. The tiles also ask for the thread's next item's panels, a few
// lines per k (PanelAhead), so memory streams them while this item computes: on AVX-512 a [64, 512] @
// [512, 4096] gated bf16 layer 0.46 -> 0.42 ms, a [64, 256] @ [256, 32000] head 1.57 -> 1.40 ms (notes,
// session 14).
constexpr int64_t kPanelCols = 64;
constexpr int64_t kStripCols = 16;
constexpr int64_t kPanelStrips = kPanelCols / kStripCols;
constexpr int kRowBlock = 6;

struct Matmul {
  const float* x;  // [M, K] float32 (bf16 x widened, for the tiles that read float32)
  const void* w;   // [P, 4, KP, 16 * E]: the chosen layer's panels, float or bfloat16 bits
  float* y;        // [M, N] sums (gated: scratch for the paths that do not fuse the activation)
  int64_t m, k, n;
  bool w_bf16 = false;
  int64_t part_cols = 0, part_panels = 0, panels = 0;  // N / groups, Pg, P
  const uint16_t* x16 = nullptr;  // [M, K] bfloat16 bits, when x came as bf16
  // Gated (act >= 0, two parts): w's columns are [gate | up], N = 2I, and the result is act(gate) * up,
  // [M, I] in `gated_out` (float32 or bfloat16: see GatedRows).
  int act = -1;
  void* gated_out = nullptr;
  bool gated_bf16 = false;
  bool bf16_convert = false;  // round to bfloat16 by AVX512-BF16's conversion (the AVX-512 SiLU)
  // Not gated: y's sums rounded to bfloat16's precision, kept float32 (a bf16 LM head's logits as the
  // sampler reads them, without a bf16 array between; see RoundedToBf16).
  bool round_bf16 = false;
  int64_t k_block = 0;  // the tiles' k block (PanelTiles::k_block, or FERRY_NATIVE_MATMUL_K_BLOCK's)
  // A strip's 32-bit lanes (float32 weights, or bf16 pairs): the tiles' step from one strip to the next.
  int64_t StripLanes() const { return (w_bf16 ? (k + 1) / 2 : k) * kStripCols; }
  int64_t StripElems() const { return StripLanes() * (w_bf16 ? 2 : 1); }
  int64_t PanelElems() const { return kPanelStrips * StripElems(); }
  const void* Panel(int64_t p) const {
    return static_cast<const char*>(w) + p * PanelElems() * (w_bf16 ? 2 : 4);
  }
  int64_t PanelCol(int64_t p) const { return p / part_panels * part_cols + p % part_panels * kPanelCols; }
  int64_t PanelWidth(int64_t p) const { return std::min(kPanelCols, part_cols - p % part_panels * kPanelCols); }
};

// Portable: panel `panel`'s sums for every row into y (auto-vectorised; AVX2/FMA clone on x86-64).
template <bool kBf16>
FERRY_INLINE void MatmulPanelGenericOf(const Matmul& p, int64_t panel) {
  const int64_t c0 = p.PanelCol(panel), cols = p.PanelWidth(panel);
  float acc[kPanelCols];
  for (int64_t r = 0; r < p.m; ++r) {
    std::fill(acc, acc + kPanelCols, 0.0f);
    const float* xr = p.x + r * p.k;
    for (int64_t k = 0; k < p.k; ++k) {
      const float a = xr[k];
      for (int64_t s = 0; s < kPanelStrips; ++s) {
        float* __restrict sums = acc + s * kStripCols;
        if constexpr (kBf16) {
          const uint16_t* __restrict wk = static_cast<const uint16_t*>(p.Panel(panel)) + s * p.StripElems() +
                                          k / 2 * 2 * kStripCols + (k & 1);
          for (int64_t j = 0; j < kStripCols; ++j) sums[j] += a * Bf16ToF32(wk[2 * j]);
        } else {
          const float* __restrict wk = static_cast<const float*>(p.Panel(panel)) + s * p.StripElems() + k * kStripCols;
          for (int64_t j = 0; j < kStripCols; ++j) sums[j] += a * wk[j];
        }
      }
    }
    std::copy(acc, acc + cols, p.y + r * p.n + c0);
  }
}

FERRY_CLONES void MatmulPanelGenericF32(const Matmul& p, int64_t panel) { MatmulPanelGenericOf<false>(p, panel); }
FERRY_CLONES void MatmulPanelGenericBf16(const Matmul& p, int64_t panel) { MatmulPanelGenericOf<true>(p, panel); }

// ----------------------------------------------------------------------------- gated activation

// out[r, j] = act(gate[r, j]) * up[r, j] for `rows` rows of `cols` sums (rows ld apart). A bfloat16 out
// rounds as a bfloat16 model's elementwise ops do (Hugging Face's act_fn(gate_proj(x)) * up_proj(x)):
// gate and up rounded, act in float32 rounded, the product rounded. act 0: SiLU; 1: GELU (tanh).
template <typename TOut, int kAct>
FERRY_INLINE void GatedRowsOf(const float* gate, const float* up, int64_t ld, int64_t rows, int64_t cols,
                              TOut* out, int64_t ldo) {
  constexpr bool kBf16 = std::is_same_v<TOut, uint16_t>;
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate + r * ld;
    const float* u = up + r * ld;
    TOut* o = out + r * ldo;
#pragma omp simd
    for (int64_t i = 0; i < cols; ++i) {
      const float gi = kBf16 ? Bf16ToF32(F32ToBf16(g[i])) : g[i];
      const float ui = kBf16 ? Bf16ToF32(F32ToBf16(u[i])) : u[i];
      float a;
      if (kAct == 0) {
        a = gi / (1.0f + ExpClamped(-gi));
      } else {
        a = 0.5f * gi * (1.0f + Tanh(0.7978845608028654f * (gi + 0.044715f * gi * gi * gi)));
      }
      if (kBf16) a = Bf16ToF32(F32ToBf16(a));
      FromF32(a * ui, o + i);
    }
  }
}

// AVX-512 too: the element loop is all there is.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && \
    !defined(FERRY_NO_TARGET_CLONES)
#define FERRY_CLONES_512 __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FERRY_CLONES_512
#endif

// Gate and up sums (rows ld apart) -> the result's rows r0.. at columns n0..n0 + cols.
FERRY_CLONES_512 void GatedRows(const Matmul& p, const float* gate, const float* up, int64_t ld, int64_t r0,
                            int64_t rows, int64_t n0, int64_t cols) {
  const int64_t ldo = p.n / 2;
  if (p.gated_bf16) {
    uint16_t* out = static_cast<uint16_t*>(p.gated_out) + r0 * ldo + n0;
    return p.act == 0 ? GatedRowsOf<uint16_t, 0>(gate, up, ld, rows, cols, out, ldo)
                      : GatedRowsOf<uint16_t, 1>(gate, up, ld, rows, cols, out, ldo);
  }
  float* out = static_cast<float*>(p.gated_out) + r0 * ldo + n0;
  return p.act == 0 ? GatedRowsOf<float, 0>(gate, up, ld, rows, cols, out, ldo)
                    : GatedRowsOf<float, 1>(gate, up, ld, rows, cols, out, ldo);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(FERRY_NO_TARGET_CLONES)
#define FERRY_HAVE_AVX512_MATMUL 1
#define FERRY_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define FERRY_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define FERRY_UNROLL _Pragma("GCC unroll 8")  // unrolled before GCC decides where acc lives

// 16 bfloat16 from `w` (lanes outside `m` zero), each in a 32-bit lane: low half (`shift` 0) or high half
// (16, the bits of its float32). Zero-masked forms: the plain intrinsics start from _mm512_undefined_epi32,
// which GCC 12's -Wall reports as maybe-uninitialized.
FERRY_AVX512 FERRY_INLINE __m512i LoadBf16Lanes(const uint16_t* w, __mmask16 m, unsigned shift) {
  const __m512i lanes = _mm512_maskz_cvtepu16_epi32(m, _mm256_maskz_loadu_epi16(m, w));
  return shift ? _mm512_maskz_slli_epi32(m, lanes, shift) : lanes;
}

// 16 values (weights, or the norms' rows) from `w` as float32 (lanes outside `m` zero).
FERRY_AVX512 FERRY_INLINE __m512 LoadWeights(const float* w, __mmask16 m) { return _mm512_maskz_loadu_ps(m, w); }
FERRY_AVX512 FERRY_INLINE __m512 LoadWeights(const uint16_t* w, __mmask16 m) {
  return _mm512_castsi512_ps(LoadBf16Lanes(w, m, 16));
}

// RoundedToBf16 on 16 lanes: round to nearest even at bfloat16's precision (NaN stays NaN, made quiet).
FERRY_AVX512 FERRY_INLINE __m512 RoundedToBf16x16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i sum = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  const __m512i nan = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
  const __m512i r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), sum, nan);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

FERRY_INLINE __mmask16 LeadingLanes(int64_t count) {  // the first min(count, 16) lanes
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1u);
}

// exp(x) for x in [-87, 88]: ExpInRange's reduction and polynomial, 16 lanes.
FERRY_AVX512 FERRY_INLINE __m512 Exp512InRange(__m512 x) {
  const __mmask16 all = 0xFFFF;  // zero-masked forms: see LoadBf16Lanes
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                 _mm512_set1_ps(12582912.0f)), _mm512_set1_ps(12582912.0f));
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits =
      _mm512_maskz_slli_epi32(all, _mm512_add_epi32(_mm512_maskz_cvtps_epi32(all, n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// exp(x) for x <= 0 or -inf, 16 lanes (ExpNonPositive's steps): 0 below -87.
FERRY_AVX512 FERRY_INLINE __m512 Exp512NonPositive(__m512 x) {
  const __m512 y = Exp512InRange(_mm512_maskz_max_ps(0xFFFF, x, _mm512_set1_ps(-87.0f)));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), y);
}

// 16 lanes at T's precision (the pointer only picks T), and their store into T (v already at its precision).
FERRY_AVX512 FERRY_INLINE __m512 Rounded16(__m512 v, const float*) { return v; }
FERRY_AVX512 FERRY_INLINE __m512 Rounded16(__m512 v, const uint16_t*) { return RoundedToBf16x16(v); }
FERRY_AVX512 FERRY_INLINE void Store16(float* y, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(y, m, v); }
FERRY_AVX512 FERRY_INLINE void Store16(uint16_t* y, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(y, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

// RoundedToBf16x16 by the CPU's conversion (AVX512-BF16's vcvtneps2bf16, which rounds to nearest even too;
// only where UseDpbf16Matmul), and the bfloat16 bits of 16 lanes so rounded. In asm, so the code around it
// needs no AVX512-BF16 target of its own.
FERRY_AVX512 FERRY_INLINE __m256i Bf16Bits16(__m512 v) {
  __m256i bits;
  asm("vcvtneps2bf16 %1, %0" : "=v"(bits) : "v"(v));
  return bits;
}
FERRY_AVX512 FERRY_INLINE __m512 RoundedToBf16Cvt16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(Bf16Bits16(v)), 16));
}

template <typename TOut, bool kCvt>
FERRY_AVX512 FERRY_INLINE __m512 RoundedFor(__m512 v) {  // to TOut's precision
  if constexpr (!std::is_same_v<TOut, uint16_t>) return v;
  else if constexpr (kCvt) return RoundedToBf16Cvt16(v);
  else return RoundedToBf16x16(v);
}

// GatedRowsOf<TOut, 0> (SiLU) 16 columns at a time, its steps and roundings; kCvt: the roundings by the
// CPU's conversion. GCC's vectors of GatedRowsOf spent 12-17% of a gated [512, 512] @ [512, 4096] bf16 call
// in it, most of that in the integer roundings (notes, session 16).
template <typename TOut, bool kCvt>
FERRY_AVX512 void SiluRowsAvx512(const float* gate, const float* up, int64_t ld, int64_t rows, int64_t cols,
                                 TOut* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r, gate += ld, up += ld, out += ldo) {
    for (int64_t i = 0; i < cols; i += 16) {
      const __mmask16 m = LeadingLanes(cols - i);
      const __m512 g = RoundedFor<TOut, kCvt>(_mm512_maskz_loadu_ps(m, gate + i));
      const __m512 u = RoundedFor<TOut, kCvt>(_mm512_maskz_loadu_ps(m, up + i));
      const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), g);  // ExpClamped(-g)
      const __m512 e =
          Exp512InRange(_mm512_min_ps(_mm512_max_ps(neg, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f)));
      const __m512 act = RoundedFor<TOut, kCvt>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
      if constexpr (std::is_same_v<TOut, uint16_t> && kCvt)
        _mm256_mask_storeu_epi16(out + i, m, Bf16Bits16(_mm512_mul_ps(act, u)));
      else
        Store16(out + i, m, RoundedFor<TOut, kCvt>(_mm512_mul_ps(act, u)));
    }
  }
}

// GatedRows on AVX-512: SiLU by hand, the rest (GELU) GCC's vectors.
void GatedRowsAvx512(const Matmul& p, const float* gate, const float* up, int64_t ld, int64_t r0, int64_t rows,
                     int64_t n0, int64_t cols) {
  if (p.act != 0) return GatedRows(p, gate, up, ld, r0, rows, n0, cols);
  const int64_t ldo = p.n / 2;
  if (!p.gated_bf16) {
    float* out = static_cast<float*>(p.gated_out) + r0 * ldo + n0;
    return SiluRowsAvx512<float, false>(gate, up, ld, rows, cols, out, ldo);
  }
  uint16_t* out = static_cast<uint16_t*>(p.gated_out) + r0 * ldo + n0;
  if (p.bf16_convert) return SiluRowsAvx512<uint16_t, true>(gate, up, ld, rows, cols, out, ldo);
  SiluRowsAvx512<uint16_t, false>(gate, up, ld, rows, cols, out, ldo);
}

// Lines of a later panel to ask for while a tile runs: `rate` / 256 lines per k step (a k step reads 4 lines:
// a panel row), the fraction carried from step to step.
// 16 bytes, so the tiles take it in two registers.
struct PanelAhead {
  const char* line = nullptr;  // the next line to ask for
  int32_t lines = 0;           // lines left to ask for
  int16_t rate = 0, credit = 0;
  FERRY_INLINE void Next() {
    for (credit += rate; credit >= 256 && lines > 0; credit -= 256, line += 64, --lines) PrefetchLine(line);
  }
};
static_assert(sizeof(PanelAhead) == 16);

// The k steps [k0, k1) of a panel one tile call sums (k0 even where the panel holds bf16 pairs): from zero
// where k0 == 0, else on from the sums a call over [.., k0) left in y, so each column still sums over k in
// order; rounded (round_bf16) once k1 == K.
struct TileSpan {
  int64_t k0, k1;
};

// A panel tile: rows r0.. (MR of them) x one panel's 64 columns, register-blocked (MR * 4 accumulators,
// 4 weight vectors and a broadcast <= 32 zmm); the first `cols` sums of each row go to y (rows ldy apart).
using PanelTileFn = void (*)(const Matmul&, const void* panel, int64_t r0, int64_t cols, float* y, int64_t ldy,
                             TileSpan span, PanelAhead ahead);

#define FERRY_START_TILE(acc)                                                               \
  FERRY_UNROLL for (int r = 0; r < MR; ++r)                                                 \
    FERRY_UNROLL for (int v = 0; v < 4; ++v) acc[r][v] = span.k0 == 0 || 16 * v >= cols     \
        ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(LeadingLanes(cols - 16 * v), y + r * ldy + 16 * v)

#define FERRY_STORE_TILE(acc)                                                       \
  if (p.round_bf16 && span.k1 == p.k)                                               \
    FERRY_UNROLL for (int r = 0; r < MR; ++r)                                       \
      FERRY_UNROLL for (int v = 0; v < 4; ++v) acc[r][v] = RoundedToBf16x16(acc[r][v]); \
  FERRY_UNROLL for (int r = 0; r < MR; ++r, y += ldy)                               \
    FERRY_UNROLL for (int v = 0; v < 4; ++v) if (16 * v < cols)                     \
      _mm512_mask_storeu_ps(y + 16 * v, LeadingLanes(cols - 16 * v), acc[r][v])

// acc[r] += x[r * ldx] * b for the tile's MR rows (x: each row's element k).
template <int MR>
FERRY_AVX512 FERRY_INLINE void FmaRows(__m512 (&acc)[MR][4], const float* x, int64_t ldx, const __m512 (&b)[4]) {
  FERRY_UNROLL for (int r = 0; r < MR; ++r) {
    const __m512 a = _mm512_set1_ps(x[r * ldx]);
    FERRY_UNROLL for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(a, b[v], acc[r][v]);
  }
}

// float32 panel, float32 x: per k, 4 loads of the panel's row and MR broadcasts of x.
template <int MR>
FERRY_AVX512 void PanelTileF32(const Matmul& p, const void* panel, int64_t r0, int64_t cols, float* y,
                               int64_t ldy, TileSpan span, PanelAhead ahead) {
  __m512 acc[MR][4];
  FERRY_START_TILE(acc);
  const float* w = static_cast<const float*>(panel) + span.k0 * kStripCols;
  const int64_t strip = p.StripLanes();
  const float* x = p.x + r0 * p.k;
  for (int64_t k = span.k0; k < span.k1; ++k, w += kStripCols) {
    ahead.Next();
    __m512 b[4];
    FERRY_UNROLL for (int v = 0; v < 4; ++v) b[v] = _mm512_loadu_ps(w + v * strip);
    FmaRows<MR>(acc, x + k, p.k, b);
  }
  FERRY_STORE_TILE(acc);
}

// bfloat16 panel, float32 x (bf16 x widened, where the CPU lacks AVX512-BF16): each lane's pair of
// weights widened exactly, the low half (row 2 k2) then the high (2 k2 + 1): one FMA per term in k order,
// the float32 tile's bits for float32 weights of the same values.
template <int MR>
FERRY_AVX512 void PanelTileWidened(const Matmul& p, const void* panel, int64_t r0, int64_t cols, float* y,
                                   int64_t ldy, TileSpan span, PanelAhead ahead) {
  __m512 acc[MR][4];
  FERRY_START_TILE(acc);
  const uint32_t* w = static_cast<const uint32_t*>(panel) + span.k0 / 2 * kStripCols;
  const int64_t strip = p.StripLanes();
  const float* x = p.x + r0 * p.k;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = span.k0; k < span.k1; k += 2, w += kStripCols) {
    ahead.Next();
    __m512 b[4];
    FERRY_UNROLL for (int v = 0; v < 4; ++v)
      b[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(w + v * strip), 16));
    FmaRows<MR>(acc, x + k, p.k, b);
    if (k + 1 == p.k) break;
    FERRY_UNROLL for (int v = 0; v < 4; ++v)
      b[v] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(w + v * strip), high));
    FmaRows<MR>(acc, x + k + 1, p.k, b);
  }
  FERRY_STORE_TILE(acc);
}

FERRY_INLINE uint32_t XPair(const uint16_t* x_row, int64_t k, int64_t k_rows) {  // (x[k], x[k + 1] or 0)
  const uint32_t hi = k + 1 < k_rows ? x_row[k + 1] : 0u;
  return static_cast<uint32_t>(x_row[k]) | (hi << 16);
}

// bfloat16 panel and x on a CPU with AVX512-BF16: vdpbf16ps multiplies pairs of bf16 and adds both
// products to a float32 lane, twice the float32 FMA's work per instruction; each x row is read as pairs
// (x[2 k2], x[2 k2 + 1]) broadcast.
template <int MR>
FERRY_AVX512_BF16 void PanelTileDpbf16(const Matmul& p, const void* panel, int64_t r0, int64_t cols, float* y,
                                       int64_t ldy, TileSpan span, PanelAhead ahead) {
  __m512 acc[MR][4];
  FERRY_START_TILE(acc);
  const uint32_t* w = static_cast<const uint32_t*>(panel) + span.k0 / 2 * kStripCols;
  const int64_t strip = p.StripLanes();
  const uint16_t* x = p.x16 + r0 * p.k;
  // A pair of x is the 32-bit word at x + k: broadcast from memory (an odd K's last pair is built).
  const int64_t even = p.k & ~int64_t{1};
  for (int64_t k = span.k0; k < span.k1; k += 2, w += kStripCols) {
    ahead.Next();
    __m512i b[4];
    FERRY_UNROLL for (int v = 0; v < 4; ++v) b[v] = _mm512_loadu_si512(w + v * strip);
    FERRY_UNROLL for (int r = 0; r < MR; ++r) {
      int32_t pair;
      if (k < even) std::memcpy(&pair, x + r * p.k + k, sizeof(pair));
      else pair = static_cast<int32_t>(XPair(x + r * p.k, k, p.k));
      const __m512i a = _mm512_set1_epi32(pair);
      FERRY_UNROLL for (int v = 0; v < 4; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)a, (__m512bh)b[v]);
    }
  }
  FERRY_STORE_TILE(acc);
}

#undef FERRY_START_TILE
#undef FERRY_STORE_TILE

// [kind][rows - 1]: kind 0 float32, 1 widened bfloat16, 2 bf16 dot products.
constexpr PanelTileFn kPanelTiles[3][kRowBlock] = {
    {&PanelTileF32<1>, &PanelTileF32<2>, &PanelTileF32<3>, &PanelTileF32<4>, &PanelTileF32<5>, &PanelTileF32<6>},
    {&PanelTileWidened<1>, &PanelTileWidened<2>, &PanelTileWidened<3>, &PanelTileWidened<4>,
     &PanelTileWidened<5>, &PanelTileWidened<6>},
    {&PanelTileDpbf16<1>, &PanelTileDpbf16<2>, &PanelTileDpbf16<3>, &PanelTileDpbf16<4>, &PanelTileDpbf16<5>,
     &PanelTileDpbf16<6>}};

// ----------------------------------------------------------------------------- panel tiles (AVX2)

// The same tiles for CPUs with AVX2 and FMA but not AVX-512 (Zen 2/3, Intel before Ice Lake): 16 ymm, so
// a tile takes a panel's 64 columns as four strips of 16, MR rows x 2 vectors each (12 accumulators, 2
// weight vectors and a broadcast <= 16), k in order within a strip: the AVX-512 tiles' bits. The
// portable loop (one row at a time, 8 accumulators: a load per FMA) ran model b's linears at ~35% of the
// two cores' FMA peak (75 of 214 GFLOP/s).
#define FERRY_AVX2 __attribute__((target("avx2,fma")))

FERRY_AVX2 FERRY_INLINE __m256i LeadingLanes8(int64_t count) {  // a maskstore mask: the first min(count, 8)
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(count, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// RoundedToBf16 on 8 lanes by integer ops (round to nearest even; NaN stays NaN, made quiet).
FERRY_AVX2 FERRY_INLINE __m256 RoundedToBf16x8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd),
                                           _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256i quiet = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)),
                                         _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(rounded, quiet, nan));
}

// 8 lanes of bfloat16 pairs at `w`, loaded in asm for each half, so GCC neither keeps the raw lanes alive
// between the two halves nor a mask constant (12 accumulators, 2 weight vectors and a broadcast fill the
// 16 registers; it had spilled). The high half by two shifts, for the same reason.
FERRY_AVX2 FERRY_INLINE __m256i LoadLanes(const uint32_t* w) {
  __m256i out;
  asm volatile("vmovdqu %1, %0" : "=x"(out) : "m"(*reinterpret_cast<const __m256i*>(w)));
  return out;
}
FERRY_AVX2 FERRY_INLINE __m256 LowBf16(const uint32_t* w) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(LoadLanes(w), 16));
}
FERRY_AVX2 FERRY_INLINE __m256 HighBf16(const uint32_t* w) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(LoadLanes(w), 16), 16));
}

// Weight vector v of a pass's k step, for FmaRows8: float32, and bfloat16 pairs' low and high halves; a
// pass wider than a strip (1 and 2 rows) takes vectors 2, 3.. from the next strips, `strip` lanes on.
struct F32Weights {
  const float* w;
  int64_t strip;
  FERRY_AVX2 FERRY_INLINE __m256 operator()(int v) const { return _mm256_loadu_ps(w + v / 2 * strip + 8 * (v % 2)); }
};
template <bool kHigh>
struct Bf16Weights {
  const uint32_t* w;
  int64_t strip;
  FERRY_AVX2 FERRY_INLINE __m256 operator()(int v) const {
    const uint32_t* lanes = w + v / 2 * strip + 8 * (v % 2);
    return kHigh ? HighBf16(lanes) : LowBf16(lanes);
  }
};

// A pass's width in vectors for an MR-row tile: one strip (16 columns, 2 vectors) from 3 rows on; fewer rows
// take wider passes, so a small batch's tile (bound by streaming the panel) makes fewer passes over the
// panel's k steps: 1 row one pass (8 accumulators), 2 rows two. With 16-column passes for every row count, a
// single request's decode step on model b took 12.4 against 8.8 ms/token for the portable loop's one pass.
constexpr int PassVectors(int mr) { return mr == 1 ? 8 : mr == 2 ? 4 : 2; }
constexpr int PassesOf(int mr) { return static_cast<int>(kPanelCols) / (8 * PassVectors(mr)); }

// acc[r][v] += x_rows[r][k] * b(v) for MR rows (a pointer per row: no address arithmetic per k beyond k).
// One row takes each weight vector as it comes (10 registers for 8 accumulators); more hold kV of them.
template <int MR, int kV, typename WeightVector>
FERRY_AVX2 FERRY_INLINE void FmaRows8(__m256 (&acc)[MR][kV], const float* const (&x_rows)[MR], int64_t k,
                                      WeightVector b) {
  if constexpr (MR == 1) {
    const __m256 a = _mm256_broadcast_ss(x_rows[0] + k);
    FERRY_UNROLL for (int v = 0; v < kV; ++v) acc[0][v] = _mm256_fmadd_ps(a, b(v), acc[0][v]);
  } else {
    __m256 bv[kV];
    FERRY_UNROLL for (int v = 0; v < kV; ++v) bv[v] = b(v);
    FERRY_UNROLL for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(x_rows[r] + k);
      FERRY_UNROLL for (int v = 0; v < kV; ++v) acc[r][v] = _mm256_fmadd_ps(a, bv[v], acc[r][v]);
    }
  }
}

// Pass s's sums so far (columns 8 kV s.. of the panel; `cols` of the panel's present): zero at k0 == 0,
// else what the call over the k steps before left in y.
template <int MR, int kV>
FERRY_AVX2 FERRY_INLINE void StartPass8(__m256 (&acc)[MR][kV], int64_t s, int64_t cols, const float* y, int64_t ldy,
                                         bool from_zero) {
  FERRY_UNROLL for (int r = 0; r < MR; ++r) {
    FERRY_UNROLL for (int v = 0; v < kV; ++v) {
      const int64_t c = 8 * kV * s + 8 * v;
      acc[r][v] = from_zero || c >= cols ? _mm256_setzero_ps()
                                         : _mm256_maskload_ps(y + r * ldy + c, LeadingLanes8(cols - c));
    }
  }
}

// Pass s's sums into y, rounded (round_bf16) where `last`.
template <int MR, int kV>
FERRY_AVX2 FERRY_INLINE void StorePass8(const Matmul& p, __m256 (&acc)[MR][kV], int64_t s, int64_t cols, float* y,
                                         int64_t ldy, bool last) {
  FERRY_UNROLL for (int r = 0; r < MR; ++r) {
    FERRY_UNROLL for (int v = 0; v < kV; ++v) {
      const int64_t c = 8 * kV * s + 8 * v;
      if (c >= cols) continue;
      const __m256 out = p.round_bf16 && last ? RoundedToBf16x8(acc[r][v]) : acc[r][v];
      if (c + 8 <= cols) _mm256_storeu_ps(y + r * ldy + c, out);
      else _mm256_maskstore_ps(y + r * ldy + c, LeadingLanes8(cols - c), out);
    }
  }
}

// float32 panel, float32 x.
template <int MR>
FERRY_AVX2 void PanelTileF32Avx2(const Matmul& p, const void* panel, int64_t r0, int64_t cols, float* y,
                                 int64_t ldy, TileSpan span, PanelAhead ahead) {
  constexpr int kV = PassVectors(MR);
  const float* x_rows[MR];
  FERRY_UNROLL for (int r = 0; r < MR; ++r) x_rows[r] = p.x + (r0 + r) * p.k;
  const int64_t strip = p.StripLanes();
  for (int64_t s = 0; 8 * kV * s < cols; ++s) {
    __m256 acc[MR][kV];
    StartPass8<MR, kV>(acc, s, cols, y, ldy, span.k0 == 0);
    const float* w = static_cast<const float*>(panel) + kV / 2 * s * strip + span.k0 * kStripCols;
    for (int64_t k = span.k0; k < span.k1; ++k, w += kStripCols) {
      ahead.Next();
      FmaRows8<MR, kV>(acc, x_rows, k, F32Weights{w, strip});
    }
    StorePass8<MR, kV>(p, acc, s, cols, y, ldy, span.k1 == p.k);
  }
}

// bfloat16 panel, float32 x (bf16 x widened): each lane's pair widened exactly, row 2 k2 then 2 k2 + 1.
template <int MR>
FERRY_AVX2 void PanelTileWidenedAvx2(const Matmul& p, const void* panel, int64_t r0, int64_t cols, float* y,
                                     int64_t ldy, TileSpan span, PanelAhead ahead) {
  constexpr int kV = PassVectors(MR);
  const float* x_rows[MR];
  FERRY_UNROLL for (int r = 0; r < MR; ++r) x_rows[r] = p.x + (r0 + r) * p.k;
  const int64_t strip = p.StripLanes();
  for (int64_t s = 0; 8 * kV * s < cols; ++s) {
    __m256 acc[MR][kV];
    StartPass8<MR, kV>(acc, s, cols, y, ldy, span.k0 == 0);
    const uint32_t* w = static_cast<const uint32_t*>(panel) + kV / 2 * s * strip + span.k0 / 2 * kStripCols;
    for (int64_t k = span.k0; k < span.k1; k += 2, w += kStripCols) {
      ahead.Next();
      FmaRows8<MR, kV>(acc, x_rows, k, Bf16Weights<false>{w, strip});
      if (k + 1 == p.k) break;
      FmaRows8<MR, kV>(acc, x_rows, k + 1, Bf16Weights<true>{w, strip});
    }
    StorePass8<MR, kV>(p, acc, s, cols, y, ldy, span.k1 == p.k);
  }
}

// Exp512InRange's steps on 8 lanes.
FERRY_AVX2 FERRY_INLINE __m256 Exp256InRange(__m256 x) {
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                 _mm256_set1_ps(12582912.0f)), _mm256_set1_ps(12582912.0f));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// 8 values to TOut's precision, and stored (the first `count`).
template <typename TOut>
FERRY_AVX2 FERRY_INLINE __m256 Rounded8(__m256 v) {
  if constexpr (std::is_same_v<TOut, uint16_t>) return RoundedToBf16x8(v);
  else return v;
}
FERRY_AVX2 FERRY_INLINE void Store8(float* out, int64_t count, __m256 v) {
  if (count >= 8) _mm256_storeu_ps(out, v);
  else _mm256_maskstore_ps(out, LeadingLanes8(count), v);
}
FERRY_AVX2 FERRY_INLINE void Store8(uint16_t* out, int64_t count, __m256 v) {  // v already at bf16 precision
  const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(v), 16);  // 8 x 16 bits, in 32-bit lanes
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  if (count >= 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
  alignas(16) uint16_t lanes[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), packed);
  std::memcpy(out, lanes, count * sizeof(uint16_t));
}

// SiluRowsAvx512's steps and roundings on 8 lanes (the integer roundings: no AVX512-BF16 here). GCC left
// GatedRowsOf scalar, its clamps as branches: 5.6% of model b's float32 run after the AVX2 tiles.
template <typename TOut>
FERRY_AVX2 void SiluRowsAvx2(const float* gate, const float* up, int64_t ld, int64_t rows, int64_t cols, TOut* out,
                             int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r, gate += ld, up += ld, out += ldo) {
    for (int64_t i = 0; i < cols; i += 8) {
      const __m256i m = LeadingLanes8(cols - i);
      const __m256 g = Rounded8<TOut>(_mm256_maskload_ps(gate + i, m));
      const __m256 u = Rounded8<TOut>(_mm256_maskload_ps(up + i, m));
      const __m256 neg = _mm256_sub_ps(_mm256_setzero_ps(), g);  // ExpClamped(-g)
      const __m256 e =
          Exp256InRange(_mm256_min_ps(_mm256_max_ps(neg, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f)));
      const __m256 act = Rounded8<TOut>(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
      Store8(out + i, cols - i, Rounded8<TOut>(_mm256_mul_ps(act, u)));
    }
  }
}

// GatedRows on AVX2: SiLU by hand, the rest (GELU) GCC's vectors.
void GatedRowsAvx2(const Matmul& p, const float* gate, const float* up, int64_t ld, int64_t r0, int64_t rows,
                   int64_t n0, int64_t cols) {
  if (p.act != 0) return GatedRows(p, gate, up, ld, r0, rows, n0, cols);
  const int64_t ldo = p.n / 2;
  if (p.gated_bf16)
    return SiluRowsAvx2(gate, up, ld, rows, cols, static_cast<uint16_t*>(p.gated_out) + r0 * ldo + n0, ldo);
  SiluRowsAvx2(gate, up, ld, rows, cols, static_cast<float*>(p.gated_out) + r0 * ldo + n0, ldo);
}

// [kind][rows - 1]: kind 0 float32, 1 widened bfloat16.
constexpr PanelTileFn kPanelTilesAvx2[2][kRowBlock] = {
    {&PanelTileF32Avx2<1>, &PanelTileF32Avx2<2>, &PanelTileF32Avx2<3>, &PanelTileF32Avx2<4>, &PanelTileF32Avx2<5>,
     &PanelTileF32Avx2<6>},
    {&PanelTileWidenedAvx2<1>, &PanelTileWidenedAvx2<2>, &PanelTileWidenedAvx2<3>, &PanelTileWidenedAvx2<4>,
     &PanelTileWidenedAvx2<5>, &PanelTileWidenedAvx2<6>}};

// A CPU's panel tiles: by row count, the passes each makes over a panel's k steps, and its gated epilogue.
using GatedRowsFn = void (*)(const Matmul&, const float* gate, const float* up, int64_t ld, int64_t r0,
                             int64_t rows, int64_t n0, int64_t cols);
struct PanelTiles {
  const PanelTileFn* by_rows;  // [kRowBlock]: tile for rows - 1
  int passes[kRowBlock];       // passes over the panel's k steps a tile of rows - 1 makes
  GatedRowsFn gated_rows;
  // Batches of fewer rows do not ask for the next panel: AVX2's one- and two-row tiles stream the panel
  // in one or two passes, which the hardware prefetcher follows; asking as well cost them 10-25% (the LM
  // head at 1 row 2.2 against 2.7-2.9 ms, a gated [512, 4096] 0.31 against 0.35-0.37; from 4 rows it
  // pays: the head 3.2 against 4.8 ms).
  int64_t ahead_from_rows;
  int64_t k_block;  // k steps each row block sums before the next block of k (SumPanel); 0: all of K
};
constexpr PanelTiles kAvx512Tiles[3] = {{kPanelTiles[0], {1, 1, 1, 1, 1, 1}, &GatedRowsAvx512, 1, 0},
                                        {kPanelTiles[1], {1, 1, 1, 1, 1, 1}, &GatedRowsAvx512, 1, 0},
                                        {kPanelTiles[2], {1, 1, 1, 1, 1, 1}, &GatedRowsAvx512, 1, 0}};
#define FERRY_AVX2_PASSES {PassesOf(1), PassesOf(2), PassesOf(3), PassesOf(4), PassesOf(5), PassesOf(6)}
constexpr PanelTiles kAvx2Tiles[2] = {{kPanelTilesAvx2[0], FERRY_AVX2_PASSES, &GatedRowsAvx2, 3, 512},
                                      {kPanelTilesAvx2[1], FERRY_AVX2_PASSES, &GatedRowsAvx2, 3, 512}};
#undef FERRY_AVX2_PASSES

// Rows an item takes at a time: a gated item's sums for them, 2 x 48 x 64 floats (24 KB), sit on the stack.
constexpr int64_t kGroupRows = 8 * kRowBlock;

// Hands an item's tile calls the next item's panel (null: none) in shares proportional to their k steps,
// spread evenly over those steps. (All of it in the first two row blocks came in bursts that held up the
// tiles' own loads: a model-b decode step's linears at 64 rows, float32, 15.2 -> 14.5 ms, 32 rows 8.9 ->
// 8.2; model b's throughput run +3-7% float32, +4% bf16; notes, session 18.)
struct AheadPlan {
  const char* panel = nullptr;
  int64_t lines = 0, steps = 1, done = 0;  // the panel's lines, the item's k steps over a panel, handed out
  PanelAhead For(int64_t call_steps) {
    const int64_t from = done * lines / steps;
    done += call_steps;
    const int64_t to = done * lines / steps;
    if (panel == nullptr || to <= from) return PanelAhead{};
    const auto rate =
        static_cast<int16_t>(std::min<int64_t>(4 * 256, ((to - from) * 256 + call_steps - 1) / call_steps));
    return PanelAhead{panel + from * 64, static_cast<int32_t>(to - from), rate};
  }
};

// A row group's blocks: blocks of 5 rows first where they make the rest a multiple of 6 (64 rows: 2 x 5 +
// 9 x 6, not 10 x 6 + 4), then blocks of 6, the last of the rows left. A 5-row AVX2 tile's 10 accumulators
// keep both FMA units busy (latency 5 cycles on Zen 2); a 4-row tile's 8 do not.
struct RowBlocks {
  int64_t rows, fives;
  explicit RowBlocks(int64_t rows) : rows(rows), fives(FivesFor(rows)) {}
  static int64_t FivesFor(int64_t rows) {
    const int64_t fives = (kRowBlock - rows % kRowBlock) % kRowBlock;
    return fives * (kRowBlock - 1) <= rows ? fives : 0;
  }
  int64_t Height(int64_t b0) const {  // of the block at row b0 of the group
    return b0 < (kRowBlock - 1) * fives ? kRowBlock - 1 : std::min<int64_t>(kRowBlock, rows - b0);
  }
};

// Rows [r0, r0 + rows) x one panel, their sums into y (row r0 at y, rows ldy apart): each row block's
// tile over the panel's k steps p.k_block at a time, every row block taking a block of k steps before the
// next, so the panel's block stays in L2 while the rows take it (a K = 2048 float32 panel is 512 KB, all of
// Zen 2's L2; a row block's x stays in L1 across its strips either way).
void SumPanel(const Matmul& p, const PanelTiles& tiles, const void* panel, int64_t r0, int64_t rows, int64_t cols,
              float* y, int64_t ldy, AheadPlan& ahead) {
  const RowBlocks blocks(rows);
  const int64_t kc = rows > kRowBlock && p.k_block > 0 ? p.k_block : p.k, k_per_step = p.w_bf16 ? 2 : 1;
  for (int64_t k0 = 0; k0 < p.k; k0 += kc) {
    const TileSpan span{k0, std::min(p.k, k0 + kc)};
    for (int64_t b0 = 0; b0 < rows; b0 += blocks.Height(b0)) {
      const int64_t height = blocks.Height(b0), passes = tiles.passes[height - 1];
      const PanelAhead asked = ahead.For((span.k1 - span.k0 + k_per_step - 1) / k_per_step * passes);
      tiles.by_rows[height - 1](p, panel, r0 + b0, cols, y + b0 * ldy, ldy, span, asked);
    }
  }
}

// Rows [r_begin, r_end) of panel `item` into y; gated, of the gate's panel `item` and the up's (Pg later),
// their sums in scratch a row group at a time, act(gate) * up into the result's columns 64 * item... The
// panel this thread takes next (`next`, -1: none) is asked for meanwhile.
void MatmulItemTiled(const Matmul& p, const PanelTiles& tiles, int64_t item, int64_t r_begin, int64_t r_end,
                     int64_t next) {
  const int64_t c0 = p.PanelCol(item), cols = p.PanelWidth(item);
  int64_t steps = 0;  // k steps of the item's tile calls over one panel: each row block's passes
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kGroupRows) {
    const RowBlocks blocks(std::min(kGroupRows, r_end - r0));
    for (int64_t b0 = 0; b0 < blocks.rows; b0 += blocks.Height(b0)) steps += tiles.passes[blocks.Height(b0) - 1];
  }
  steps *= p.w_bf16 ? (p.k + 1) / 2 : p.k;
  const int64_t lines = (p.PanelElems() * (p.w_bf16 ? 2 : 4) + 63) / 64;
  const bool ask = next >= 0 && p.m >= tiles.ahead_from_rows;
  auto plan = [&](int64_t panel) {
    return AheadPlan{ask ? static_cast<const char*>(p.Panel(panel)) : nullptr, lines, steps};
  };
  AheadPlan ahead = plan(next), up_ahead = p.act < 0 ? AheadPlan{} : plan(p.part_panels + next);
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kGroupRows) {
    const int64_t rows = std::min(kGroupRows, r_end - r0);
    if (p.act < 0) {
      SumPanel(p, tiles, p.Panel(item), r0, rows, cols, p.y + r0 * p.n + c0, p.n, ahead);
      continue;
    }
    float sums[2][kGroupRows * kPanelCols];
    SumPanel(p, tiles, p.Panel(item), r0, rows, cols, sums[0], kPanelCols, ahead);
    SumPanel(p, tiles, p.Panel(p.part_panels + item), r0, rows, cols, sums[1], kPanelCols, up_ahead);
    tiles.gated_rows(p, sums[0], sums[1], kPanelCols, r0, rows, c0, cols);
  }
}

// AVX512-BF16's dot products and conversion; FERRY_NATIVE_MATMUL_NO_BF16_DOT=1 (tests) widens bf16 x instead
// and rounds to bfloat16 by integer ops.
bool UseDpbf16Matmul() {
  if (EnvIsOne("FERRY_NATIVE_MATMUL_NO_BF16_DOT")) return false;
  return __builtin_cpu_supports("avx512bf16");
}

// FERRY_NATIVE_MATMUL_GENERIC=1 forces the portable loops, FERRY_NATIVE_NO_AVX512=1 the AVX2 ones (tests).
bool UseAvx512Matmul() {
  if (EnvIsOne("FERRY_NATIVE_MATMUL_GENERIC") || EnvIsOne("FERRY_NATIVE_NO_AVX512")) return false;
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

// FERRY_NATIVE_MATMUL_K_BLOCK=n (tests, benchmarks) sets the tiles' k block (even, >= 2; 0: all of K).
int64_t KBlockFor(const PanelTiles& tiles) {
  const char* env = std::getenv("FERRY_NATIVE_MATMUL_K_BLOCK");
  if (env == nullptr || *env == '\0') return tiles.k_block;
  const int64_t k_block = std::atoll(env);
  return k_block <= 0 ? 0 : std::max<int64_t>(2, k_block / 2 * 2);
}

bool UseAvx2Matmul() {
  if (EnvIsOne("FERRY_NATIVE_MATMUL_GENERIC")) return false;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// A prefill GEMM tile's query vectors as lanes (PrefillTileAvx512Of: 16 a group, PrefillTileAvx2Of: 8), its
// scratch: Q^T [D][lanes] scaled, the keys each lane sees (0 past the tile's M vectors), the online softmax's
// state, P^T of one lane group and the alpha per lane, K and V of one chunk widened.
struct PrefillLanes {
  int64_t vectors, lanes, max_keys;  // M = nrows * G query vectors (m = r * G + gi), lanes padded to `width`
  float *qt, *acc, *mx, *l, *pt, *alpha, *kb, *vb;
  int32_t* lane_keys;

  template <typename TQ, typename TKV>
  static PrefillLanes Start(const Problem<TQ, TKV>& p, const Tile& tile, Scratch& sc, int64_t D, int64_t width) {
    const Geometry& g = p.g;
    const int64_t G = g.group, M = tile.nrows * G, lanes = (M + width - 1) / width * width;
    const int64_t max_keys_total = g.num_blocks > 0 ? g.table_width * g.block_size : 0;
    auto grow = [](auto& vec, int64_t n) {
      if (static_cast<int64_t>(vec.size()) < n) vec.resize(n);
    };
    grow(sc.q, D * lanes);
    grow(sc.acc, lanes * D);
    grow(sc.m, lanes);
    grow(sc.l, lanes);
    grow(sc.s, width * width + lanes);
    grow(sc.k, width * D);
    grow(sc.v, width * D);
    grow(sc.lane_keys, lanes);
    PrefillLanes t{M, lanes, 0, sc.q.data(), sc.acc.data(), sc.m.data(), sc.l.data(), sc.s.data(),
                   sc.s.data() + width * width, sc.k.data(), sc.v.data(), sc.lane_keys.data()};
    for (int64_t m = 0; m < lanes; ++m) {
      const int64_t keys = m < M ? std::clamp<int64_t>(tile.first_pos + m / G + 1, 0, max_keys_total) : 0;
      t.lane_keys[m] = static_cast<int32_t>(keys);
      t.max_keys = std::max(t.max_keys, keys);
    }
    for (int64_t m = 0; m < lanes; ++m) {
      const TQ* src = p.q + (tile.row0 + m / G) * g.num_q_heads * D + (tile.head0 * G + m % G) * D;
      for (int64_t d = 0; d < D; ++d) t.qt[d * lanes + m] = m < M ? ToF32(src[d]) * p.scale : 0.0f;
    }
    std::fill(t.acc, t.acc + lanes * D, 0.0f);
    std::fill(t.mx, t.mx + lanes, -std::numeric_limits<float>::infinity());
    std::fill(t.l, t.l + lanes, 0.0f);
    return t;
  }

  // out = acc / l per query vector (0 where it saw no key).
  template <typename TQ, typename TKV>
  void Finish(const Problem<TQ, TKV>& p, const Tile& tile, int64_t D) const {
    const int64_t G = p.g.group;
    for (int64_t m = 0; m < vectors; ++m)
      NormalizedOut(acc + m * D, D, l[m],
                    p.out + (tile.row0 + m / G) * p.g.num_q_heads * D + (tile.head0 * G + m % G) * D);
  }
};

// ----------------------------------------------------------------------------- attention tiles (AVX2)

// A decode tile on AVX2 (no AVX-512): one query row, kv heads head0.. of one sequence, G query vectors each
// taken two at a time (an odd G's last one paired with itself, its twin's sums going to a spare slot). Pages
// are taken kDecodeGroupPages at a time and each is read in row order, row t of every page in turn: the
// dot products 4 keys (row t of each page) x 2 vectors at a time (8 accumulators, reduced by a hadd tree to
// a lane per key), the online softmax over the group's keys with one horizontal max and sum per vector, then
// acc += P · V over the same rows, each V row read once for both vectors of a pair. bfloat16 rows are
// widened 8 elements at a time. Zen 2's ~22 L1 miss buffers held a page at a time with the next one
// software-prefetched (this tile until session 26) to 16-17 GB/s of KV; four pages read in step are four runs
// the L2 prefetcher streams: 8 layers of 64 sequences x 192 keys, float32, 11.7 -> 6.9 ms (17.2 -> 29.3
// GB/s), bf16 7.1 -> 5.5 ms; model b's float32 run 1.04x (notes, session 26). The AVX-512 decode tile keeps
// the page-at-a-time plan (not measured on such a CPU). The vector-at-a-time tiles (GCC's vectors,
// a horizontal sum per key and a scalar softmax) took 13% of model b's float32 run on a 2-core Zen 2 once
// its matmuls had AVX2 tiles.
FERRY_AVX2 FERRY_INLINE __m256 Row8(const float* row, int64_t c) { return _mm256_loadu_ps(row + 8 * c); }
FERRY_AVX2 FERRY_INLINE __m256 Row8(const uint16_t* row, int64_t c) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 8 * c));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Lane i: the sum of a[i]'s 8 lanes.
FERRY_AVX2 FERRY_INLINE __m128 Sum4(const __m256* a) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

FERRY_AVX2 FERRY_INLINE float Max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

FERRY_AVX2 FERRY_INLINE float Sum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// exp(x) for x <= 0 or -inf on 8 lanes (ExpNonPositive's steps): 0 below -87.
FERRY_AVX2 FERRY_INLINE __m256 Exp256NonPositive(__m256 x) {
  const __m256 y = Exp256InRange(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)));
  return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}

// dst[i] = src[i] * scale as float32: a decode tile's query vectors (GCC left the loop scalar).
template <typename T>
FERRY_AVX2 FERRY_INLINE void ScaledRows8(const T* src, int64_t n, float scale, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(Row8(src + i, 0), _mm256_set1_ps(scale)));
  for (; i < n; ++i) dst[i] = ToF32(src[i]) * scale;
}

constexpr int kDecodeGroupPages = 4;  // DecodeTileAvx2's pages read in step (the scores' 4 keys)

// A group's pages for DecodeTileAvx2: page s's K and V rows (absent pages: the first page's, all masked) and
// its keys (0: absent).
template <typename TKV>
struct PageGroup {
  const TKV* k[kDecodeGroupPages];
  const TKV* v[kDecodeGroupPages];
  int32_t rows[kDecodeGroupPages];
  int64_t row_stride;
  PageGroup(const TKV* kc, const TKV* vc, const TilePages& pages, int64_t j0, int64_t kv_row_stride)
      : row_stride(kv_row_stride) {
    for (int s = 0; s < kDecodeGroupPages; ++s) {
      const bool here = j0 + s < pages.count;
      const int64_t offset = pages.Offset(here ? j0 + s : j0);
      k[s] = kc + offset;
      v[s] = vc + offset;
      rows[s] = here ? static_cast<int32_t>(pages.Rows(j0 + s)) : 0;
    }
  }
  int64_t Rows() const { return rows[0]; }  // the first page has the most
  // Row t of page s (an absent row: the page's last present one, or row 0; masked in the softmax).
  int64_t RowOffset(int s, int64_t t) const { return std::min<int64_t>(t, std::max(rows[s], 1) - 1) * row_stride; }
  // Lanes present among keys 8 h.. (key 4 t + s: row t of page s).
  FERRY_AVX2 __m256 Present(int64_t h) const {
    const __m256i r = _mm256_setr_epi32(rows[0], rows[1], rows[2], rows[3], rows[0], rows[1], rows[2], rows[3]);
    const __m256i t = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(2 * h)),
                                       _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(r, t));
  }
};
static_assert(kDecodeGroupPages == 4, "PageGroup::Present and the tile's 4-key dot products assume 4 pages");

template <typename TQ, typename TKV, int64_t kD>
FERRY_AVX2 void DecodeTileAvx2Of(const Problem<TQ, TKV>& p, const Tile& tile, Scratch& sc) {
  const Geometry& g = p.g;
  const int64_t G = g.group, D = kD ? kD : g.head_dim, NH = tile.nheads, C = D / 8;
  const int64_t M = NH * G;  // query vectors: hh * G + gi; slot M: an odd G's twin
  const int64_t GK = kDecodeGroupPages * g.block_size;  // a group's keys, 4 t + s: row t of page s
  const int64_t q_row_stride = g.num_q_heads * D, kv_row_stride = g.num_kv_heads * D;
  sc.Reserve(1, M + 1, (M + 1) * GK, D);
  float* qf = sc.q.data();
  float* acc = sc.acc.data();
  float* mx = sc.m.data();
  float* l = sc.l.data();
  float* w = sc.s.data();  // [slot][GK]: the group's scores, then its weights
  ScaledRows8(p.q + tile.row0 * q_row_stride + tile.head0 * G * D, M * D, p.scale, qf);
  std::fill(acc, acc + (M + 1) * D, 0.0f);
  std::fill(mx, mx + M + 1, -std::numeric_limits<float>::infinity());
  std::fill(l, l + M + 1, 0.0f);
  const float cap = p.soft_cap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  const TilePages pages(p.tables, g, tile, TileKeys(g, tile));
  for (int64_t j0 = 0; j0 < pages.count; j0 += kDecodeGroupPages) {
    const PageGroup<TKV> group(p.k, p.v, pages, j0, kv_row_stride);
    const int64_t rows = group.Rows(), vecs = (rows + 1) / 2;  // 8 keys (2 rows) a vector
    for (int64_t t = 0; t < rows; ++t) {
      const TKV* kr[kDecodeGroupPages];
      FERRY_UNROLL for (int s = 0; s < kDecodeGroupPages; ++s) kr[s] = group.k[s] + group.RowOffset(s, t);
      for (int64_t hh = 0; hh < NH; ++hh) {
        for (int64_t gi = 0; gi < G; gi += 2) {
          const int64_t m0 = hh * G + gi, m1 = gi + 1 < G ? m0 + 1 : M;
          const float* q0 = qf + m0 * D;
          const float* q1 = qf + (gi + 1 < G ? m1 : m0) * D;
          __m256 dots[8];
          FERRY_UNROLL for (int i = 0; i < 8; ++i) dots[i] = _mm256_setzero_ps();
          for (int64_t c = 0; c < C; ++c) {
            const __m256 a = _mm256_loadu_ps(q0 + 8 * c), b = _mm256_loadu_ps(q1 + 8 * c);
            FERRY_UNROLL for (int s = 0; s < 4; ++s) {
              const __m256 kv = Row8(kr[s] + hh * D, c);
              dots[s] = _mm256_fmadd_ps(a, kv, dots[s]);
              dots[4 + s] = _mm256_fmadd_ps(b, kv, dots[4 + s]);
            }
          }
          _mm_storeu_ps(w + m0 * GK + 4 * t, Sum4(dots));
          _mm_storeu_ps(w + m1 * GK + 4 * t, Sum4(dots + 4));
        }
      }
    }
    for (int64_t m = 0; m < M + G % 2; ++m) {  // the online softmax, each slot's scores into weights
      float* wm = w + m * GK;
      __m256 group_max = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t h = 0; h < vecs; ++h) {
        if (cap > 0.0f)
          for (int i = 0; i < 8; ++i) wm[8 * h + i] = cap * Tanh(wm[8 * h + i] * inv_cap);
        const __m256 scores = _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()),
                                               _mm256_loadu_ps(wm + 8 * h), group.Present(h));
        _mm256_storeu_ps(wm + 8 * h, scores);
        group_max = _mm256_max_ps(group_max, scores);
      }
      const float old_max = mx[m], new_max = std::max(old_max, Max8(group_max));
      __m256 sum = _mm256_setzero_ps();
      for (int64_t h = 0; h < vecs; ++h) {
        const __m256 e = Exp256NonPositive(_mm256_sub_ps(_mm256_loadu_ps(wm + 8 * h), _mm256_set1_ps(new_max)));
        sum = _mm256_add_ps(sum, e);
        _mm256_storeu_ps(wm + 8 * h, e);
      }
      if (new_max > old_max) {  // the sums so far to the new max (0 on the first keys: old max -inf)
        const float alpha = std::exp(old_max - new_max);
        l[m] *= alpha;
        for (int64_t c = 0; c < C; ++c)
          _mm256_storeu_ps(acc + m * D + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + m * D + 8 * c), _mm256_set1_ps(alpha)));
      }
      mx[m] = new_max;
      l[m] += Sum8(sum);
    }
    for (int64_t t = 0; t < rows; ++t) {  // acc += P · V, a pair's accumulators loaded once per 4 keys
      const TKV* vr[kDecodeGroupPages];
      FERRY_UNROLL for (int s = 0; s < kDecodeGroupPages; ++s) vr[s] = group.v[s] + group.RowOffset(s, t);
      for (int64_t hh = 0; hh < NH; ++hh) {
        for (int64_t gi = 0; gi < G; gi += 2) {
          const int64_t m0 = hh * G + gi, m1 = gi + 1 < G ? m0 + 1 : M;
          __m256 w0[4], w1[4];
          FERRY_UNROLL for (int s = 0; s < 4; ++s) {
            w0[s] = _mm256_set1_ps(w[m0 * GK + 4 * t + s]);
            w1[s] = _mm256_set1_ps(w[m1 * GK + 4 * t + s]);
          }
          float* acc0 = acc + m0 * D;
          float* acc1 = acc + m1 * D;
          for (int64_t c = 0; c < C; ++c) {
            __m256 a0 = _mm256_loadu_ps(acc0 + 8 * c), a1 = _mm256_loadu_ps(acc1 + 8 * c);
            FERRY_UNROLL for (int s = 0; s < 4; ++s) {
              const __m256 x = Row8(vr[s] + hh * D, c);
              a0 = _mm256_fmadd_ps(w0[s], x, a0);
              a1 = _mm256_fmadd_ps(w1[s], x, a1);
            }
            _mm256_storeu_ps(acc0 + 8 * c, a0);
            _mm256_storeu_ps(acc1 + 8 * c, a1);
          }
        }
      }
    }
  }
  TQ* dst = p.out + tile.row0 * q_row_stride + tile.head0 * G * D;
  for (int64_t mi = 0; mi < M; ++mi) NormalizedOut(acc + mi * D, D, l[mi], dst + mi * D);
}

// A prefill tile on AVX2: PrefillTileAvx512Of's two small GEMMs per chunk of keys in 8-lane vectors,
// S^T [8 keys][8 query vectors] in 8 registers, the online softmax across them (a lane per query vector),
// then acc += P · V two query vectors x 32 features at a time. K and V rows are widened into scratch 8 at a
// time (read once per tile). Against the vector-at-a-time tiles (8 q / 4 kv heads, D 64, 2-core Zen 2):
// 4 x 128-token chunks 2.0 -> 1.4 ms, a 512-token chunk 6.5-7.3 -> 3.7, after a 1024-token prefix 30.9 ->
// 16.8 (bf16 alike).
FERRY_AVX2 FERRY_INLINE void WidenRow8(const float* src, int64_t d, float* dst) { std::memcpy(dst, src, d * 4); }
FERRY_AVX2 FERRY_INLINE void WidenRow8(const uint16_t* src, int64_t d, float* dst) {
  for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(dst + i, Row8(src + i, 0));
}

// acc[m] = acc[m] * alpha[m] + sum_{t < kc} pt[t][lane m % 8] * v[t] for QB query vectors from m0, 32
// features (4 vectors) at a time.
template <int QB, int64_t kD>
FERRY_AVX2 FERRY_INLINE void AccumulatePv8(float* acc, int64_t d, const float* alpha, const float* pt, const float* v,
                                           int64_t kc, int64_t m0) {
  const int64_t D = kD ? kD : d;
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    const int nv = static_cast<int>(std::min<int64_t>(4, (D - d0) / 8));
    __m256 c[QB][4];
    for (int q = 0; q < QB; ++q) {
      const __m256 a = _mm256_set1_ps(alpha[m0 + q]);
      for (int j = 0; j < 4; ++j)
        c[q][j] = j < nv ? _mm256_mul_ps(_mm256_loadu_ps(acc + (m0 + q) * D + d0 + 8 * j), a) : _mm256_setzero_ps();
    }
    for (int64_t t = 0; t < kc; ++t) {
      const float* vt = v + t * D + d0;
      __m256 vv[4];
      for (int j = 0; j < 4; ++j) vv[j] = j < nv ? _mm256_loadu_ps(vt + 8 * j) : _mm256_setzero_ps();
      for (int q = 0; q < QB; ++q) {
        const __m256 w = _mm256_set1_ps(pt[t * 8 + (m0 + q) % 8]);
        for (int j = 0; j < 4; ++j) c[q][j] = _mm256_fmadd_ps(w, vv[j], c[q][j]);
      }
    }
    for (int q = 0; q < QB; ++q)
      for (int j = 0; j < nv; ++j) _mm256_storeu_ps(acc + (m0 + q) * D + d0 + 8 * j, c[q][j]);
  }
}

template <typename TQ, typename TKV, int64_t kD>
FERRY_AVX2 void PrefillTileAvx2Of(const Problem<TQ, TKV>& p, const Tile& tile, Scratch& sc) {
  const Geometry& g = p.g;
  const int64_t D = kD ? kD : g.head_dim, BS = g.block_size, kv_row_stride = g.num_kv_heads * D;
  const PrefillLanes t = PrefillLanes::Start(p, tile, sc, D, 8);
  const int64_t M = t.vectors, lanes = t.lanes, max_keys = t.max_keys;
  float *qt = t.qt, *acc = t.acc, *mx = t.mx, *l = t.l, *pt = t.pt, *alpha = t.alpha, *kb = t.kb, *vb = t.vb;
  const int32_t* lane_keys = t.lane_keys;

  const float cap = p.soft_cap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  const TilePages pages(p.tables, g, tile, max_keys);
  for (int64_t j = 0; j < pages.count; ++j) {
    const int64_t base = j * BS, n = pages.Rows(j), offset = pages.Offset(j);
    pages.PrefetchAhead(p.k, p.v, j, D);
    for (int64_t c0 = 0; c0 < n; c0 += 8) {
      const int64_t kc = std::min<int64_t>(8, n - c0);
      for (int64_t t = 0; t < kc; ++t) {
        WidenRow8(p.k + offset + (c0 + t) * kv_row_stride, D, kb + t * D);
        WidenRow8(p.v + offset + (c0 + t) * kv_row_stride, D, vb + t * D);
      }
      std::fill(kb + kc * D, kb + 8 * D, 0.0f);  // scores of absent keys are masked, never NaN
      for (int64_t m0 = 0; m0 < lanes; m0 += 8) {
        const __m256i keys = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane_keys + m0));
        if (_mm256_testz_si256(_mm256_cmpgt_epi32(keys, _mm256_set1_epi32(static_cast<int32_t>(base + c0))),
                               _mm256_set1_epi32(-1)))
          continue;  // no lane sees this chunk's first key (causal: nor the rest)
        __m256 st[8];
        for (int t = 0; t < 8; ++t) st[t] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
          const __m256 qv = _mm256_loadu_ps(qt + d * lanes + m0);
          for (int t = 0; t < 8; ++t) st[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(kb + t * D + d), qv, st[t]);
        }
        if (cap > 0.0f) {
          for (int t = 0; t < 8; ++t) _mm256_storeu_ps(pt + 8 * t, st[t]);
#pragma omp simd
          for (int i = 0; i < 64; ++i) pt[i] = cap * Tanh(pt[i] * inv_cap);
          for (int t = 0; t < 8; ++t) st[t] = _mm256_loadu_ps(pt + 8 * t);
        }
        __m256 seen[8];  // all-ones lanes: the query vector sees key t
        const __m256 old_max = _mm256_loadu_ps(mx + m0);
        __m256 new_max = old_max;
        for (int t = 0; t < 8; ++t) {
          seen[t] = t < kc ? _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                                 keys, _mm256_set1_epi32(static_cast<int32_t>(base + c0 + t))))
                           : _mm256_setzero_ps();
          new_max = _mm256_blendv_ps(new_max, _mm256_max_ps(new_max, st[t]), seen[t]);
        }
        // 0 on a lane's first keys (old max -inf), 1 while its max holds; lanes that have seen no
        // key yet keep -inf, their sums stay 0.
        const __m256 grew = _mm256_cmp_ps(new_max, old_max, _CMP_GT_OQ);
        const __m256 lane_alpha = _mm256_blendv_ps(_mm256_set1_ps(1.0f),
                                                   Exp256NonPositive(_mm256_sub_ps(old_max, new_max)), grew);
        __m256 sum = _mm256_setzero_ps();
        for (int t = 0; t < 8; ++t) {
          const __m256 e = _mm256_and_ps(seen[t], Exp256NonPositive(_mm256_sub_ps(st[t], new_max)));
          sum = _mm256_add_ps(sum, e);
          _mm256_storeu_ps(pt + 8 * t, e);
        }
        _mm256_storeu_ps(mx + m0, new_max);
        _mm256_storeu_ps(l + m0, _mm256_fmadd_ps(_mm256_loadu_ps(l + m0), lane_alpha, sum));
        _mm256_storeu_ps(alpha, lane_alpha);
        const int64_t m_end = std::min<int64_t>(m0 + 8, M);
        int64_t m = m0;
        for (; m + 2 <= m_end; m += 2) AccumulatePv8<2, kD>(acc, D, alpha - m0, pt, vb, kc, m);
        for (; m < m_end; ++m) AccumulatePv8<1, kD>(acc, D, alpha - m0, pt, vb, kc, m);
      }
    }
  }

  t.Finish(p, tile, D);
}

template <typename TQ, typename TKV>
void PrefillTileAvx2AnyD(const Problem<TQ, TKV>& p, const Tile& t, Scratch& sc) {
  switch (p.g.head_dim) {  // common head dims get constant offsets
    case 64: return PrefillTileAvx2Of<TQ, TKV, 64>(p, t, sc);
    case 128: return PrefillTileAvx2Of<TQ, TKV, 128>(p, t, sc);
    default: return PrefillTileAvx2Of<TQ, TKV, 0>(p, t, sc);
  }
}

void PrefillTileAvx2(const Problem<float, float>& p, const Tile& t, Scratch& sc) { PrefillTileAvx2AnyD(p, t, sc); }
void PrefillTileAvx2(const Problem<uint16_t, uint16_t>& p, const Tile& t, Scratch& sc) {
  PrefillTileAvx2AnyD(p, t, sc);
}
void PrefillTileAvx2(const Problem<float, uint16_t>& p, const Tile& t, Scratch& sc) { PrefillTileAvx2AnyD(p, t, sc); }

template <typename TQ, typename TKV>
void DecodeTileAvx2AnyD(const Problem<TQ, TKV>& p, const Tile& t, Scratch& sc) {
  switch (p.g.head_dim) {  // common head dims get fully unrolled loops
    case 64: return DecodeTileAvx2Of<TQ, TKV, 64>(p, t, sc);
    case 128: return DecodeTileAvx2Of<TQ, TKV, 128>(p, t, sc);
    default: return DecodeTileAvx2Of<TQ, TKV, 0>(p, t, sc);
  }
}

void DecodeTileAvx2(const Problem<float, float>& p, const Tile& t, Scratch& sc) { DecodeTileAvx2AnyD(p, t, sc); }
void DecodeTileAvx2(const Problem<uint16_t, uint16_t>& p, const Tile& t, Scratch& sc) { DecodeTileAvx2AnyD(p, t, sc); }
void DecodeTileAvx2(const Problem<float, uint16_t>& p, const Tile& t, Scratch& sc) { DecodeTileAvx2AnyD(p, t, sc); }

// ----------------------------------------------------------------------------- prefill tiles (AVX-512)

// A prefill tile (nrows query rows x G query heads of one kv head: M query vectors) as two small GEMMs
// per 16 keys, where AttendTileImpl takes one query vector at a time through dot products (horizontal
// sums) and scalar softmax. The scores are kept transposed, S^T [16 keys][16 query vectors] in 16
// registers, so the online softmax's max, exp and sums run across registers, a lane per query vector:
//   S^T[t] = sum_d K[t, d] * Q^T[d]        (Q^T: [D][M] with the scale folded in, built once per tile)
//   P^T[t] = exp(S^T[t] - m) masked to the keys each lane sees (position < its key count)
//   acc[m] = acc[m] * alpha[m] + sum_t P^T[t][m] * V[t]
// K and V rows are widened to float32 16 at a time (they are read once per tile, as before).

FERRY_AVX512 FERRY_INLINE void WidenRow(const float* src, int64_t d, float* dst) { std::memcpy(dst, src, d * 4); }
FERRY_AVX512 FERRY_INLINE void WidenRow(const uint16_t* src, int64_t d, float* dst) {
  for (int64_t i = 0; i < d; i += 16)
    _mm512_storeu_ps(dst + i, LoadWeights(src + i, static_cast<__mmask16>(0xFFFF)));
}

// acc[m] = acc[m] * alpha[m] + sum_{t < kc} pt[t][lane m] * v[t] for QB query vectors (lanes m0..),
// D = 16 * NV columns at a time (4 vectors: 16 accumulators).
template <int QB, int64_t kD>
FERRY_AVX512 FERRY_INLINE void AccumulatePv(float* acc, int64_t d, const float* alpha, const float* pt,
                                            const float* v, int64_t kc, int64_t m0) {
  const int64_t D = kD ? kD : d;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int nv = static_cast<int>(std::min<int64_t>(4, (D - d0) / 16));
    __m512 c[QB][4];
    for (int q = 0; q < QB; ++q) {
      const __m512 a = _mm512_set1_ps(alpha[m0 + q]);
      for (int j = 0; j < 4; ++j)
        c[q][j] = j < nv ? _mm512_mul_ps(_mm512_loadu_ps(acc + (m0 + q) * D + d0 + 16 * j), a) : _mm512_setzero_ps();
    }
    for (int64_t t = 0; t < kc; ++t) {
      const float* vt = v + t * D + d0;
      __m512 vv[4];
      for (int j = 0; j < 4; ++j) vv[j] = j < nv ? _mm512_loadu_ps(vt + 16 * j) : _mm512_setzero_ps();
      for (int q = 0; q < QB; ++q) {
        const __m512 w = _mm512_set1_ps(pt[t * 16 + (m0 + q) % 16]);
        for (int j = 0; j < 4; ++j) c[q][j] = _mm512_fmadd_ps(w, vv[j], c[q][j]);
      }
    }
    for (int q = 0; q < QB; ++q)
      for (int j = 0; j < nv; ++j) _mm512_storeu_ps(acc + (m0 + q) * D + d0 + 16 * j, c[q][j]);
  }
}

// kD: the head dim when known at compile time (0: g.head_dim), so the K rows' offsets and the PV
// accumulators' count are constants: with a runtime D, GCC kept 16 row pointers on the stack and copied
// the accumulators out through it (rep movsq), ~40% of the tile's time (notes, session 16).
template <typename TQ, typename TKV, int64_t kD>
FERRY_AVX512 void PrefillTileAvx512Of(const Problem<TQ, TKV>& p, const Tile& tile, Scratch& sc) {
  const Geometry& g = p.g;
  const int64_t D = kD ? kD : g.head_dim, BS = g.block_size, kv_row_stride = g.num_kv_heads * D;
  const PrefillLanes t = PrefillLanes::Start(p, tile, sc, D, 16);
  const int64_t M = t.vectors, lanes = t.lanes, max_keys = t.max_keys;
  float *qt = t.qt, *acc = t.acc, *mx = t.mx, *l = t.l, *pt = t.pt, *alpha = t.alpha, *kb = t.kb, *vb = t.vb;
  const int32_t* lane_keys = t.lane_keys;

  const float cap = p.soft_cap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  const TilePages pages(p.tables, g, tile, max_keys);
  for (int64_t j = 0; j < pages.count; ++j) {
    const int64_t base = j * BS, n = pages.Rows(j), offset = pages.Offset(j);
    pages.PrefetchAhead(p.k, p.v, j, D);
    for (int64_t c0 = 0; c0 < n; c0 += 16) {
      const int64_t kc = std::min<int64_t>(16, n - c0);
      for (int64_t t = 0; t < kc; ++t) {
        WidenRow(p.k + offset + (c0 + t) * kv_row_stride, D, kb + t * D);
        WidenRow(p.v + offset + (c0 + t) * kv_row_stride, D, vb + t * D);
      }
      std::fill(kb + kc * D, kb + 16 * D, 0.0f);  // scores of absent keys are masked, never NaN
      for (int64_t m0 = 0; m0 < lanes; m0 += 16) {
        const __m512i keys = _mm512_loadu_si512(lane_keys + m0);
        if (_mm512_cmpgt_epi32_mask(keys, _mm512_set1_epi32(static_cast<int32_t>(base + c0))) == 0)
          continue;  // no lane sees this chunk's first key (causal: nor the rest)
        __m512 st[16];
        for (int t = 0; t < 16; ++t) st[t] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
          const __m512 qv = _mm512_loadu_ps(qt + d * lanes + m0);
          for (int t = 0; t < 16; ++t) st[t] = _mm512_fmadd_ps(_mm512_set1_ps(kb[t * D + d]), qv, st[t]);
        }
        if (cap > 0.0f) {
          for (int t = 0; t < 16; ++t) _mm512_storeu_ps(pt + 16 * t, st[t]);
#pragma omp simd
          for (int i = 0; i < 256; ++i) pt[i] = cap * Tanh(pt[i] * inv_cap);
          for (int t = 0; t < 16; ++t) st[t] = _mm512_loadu_ps(pt + 16 * t);
        }
        __mmask16 seen[16];
        const __m512 old_max = _mm512_loadu_ps(mx + m0);
        __m512 new_max = old_max;
        for (int t = 0; t < 16; ++t) {
          seen[t] = t < kc ? _mm512_cmpgt_epi32_mask(keys, _mm512_set1_epi32(static_cast<int32_t>(base + c0 + t)))
                           : static_cast<__mmask16>(0);
          new_max = _mm512_mask_max_ps(new_max, seen[t], new_max, st[t]);
        }
        // 0 on a lane's first keys (old max -inf), 1 while its max holds; lanes that have seen no
        // key yet keep -inf, their sums stay 0.
        const __mmask16 grew = _mm512_cmp_ps_mask(new_max, old_max, _CMP_GT_OQ);
        const __m512 lane_alpha = _mm512_mask_blend_ps(
            grew, _mm512_set1_ps(1.0f), Exp512NonPositive(_mm512_sub_ps(old_max, new_max)));
        __m512 sum = _mm512_setzero_ps();
        for (int t = 0; t < 16; ++t) {
          const __m512 e = _mm512_maskz_mov_ps(seen[t], Exp512NonPositive(_mm512_sub_ps(st[t], new_max)));
          sum = _mm512_add_ps(sum, e);
          _mm512_storeu_ps(pt + 16 * t, e);
        }
        _mm512_storeu_ps(mx + m0, new_max);
        _mm512_storeu_ps(l + m0, _mm512_fmadd_ps(_mm512_loadu_ps(l + m0), lane_alpha, sum));
        _mm512_storeu_ps(alpha, lane_alpha);
        const int64_t m_end = std::min<int64_t>(m0 + 16, M);
        int64_t m = m0;
        for (; m + 4 <= m_end; m += 4) AccumulatePv<4, kD>(acc, D, alpha - m0, pt, vb, kc, m);
        for (; m < m_end; ++m) AccumulatePv<1, kD>(acc, D, alpha - m0, pt, vb, kc, m);
      }
    }
  }

  t.Finish(p, tile, D);
}

// A decode tile on AVX-512: one query row; kv heads head0.. of one sequence, G query vectors each, taken
// two at a time (an odd G's last one paired with itself, its twin's sums going to a spare slot). Per chunk
// of up to 16 keys: the 2 x 16 dot products as 16 + 16 accumulators, each reduced to one register by a
// transpose-add tree (SumTree16) and permuted to a register per query vector (lane = key). The online
// softmax takes kDecodeChunks chunks (64 keys) a step, its horizontal max and sum once per step; then
// acc += P · V, V's rows read once for both vectors. K and V rows are read in place, 32 elements at a
// time as two vectors (SplitRow): bfloat16 pairs split into their even and odd elements, exactly widened,
// so q and acc are kept in that order (the same split of each 32 features: PermuteForPages) and put back
// at the end. Where AttendTileImpl widened each page into scratch, reduced every score horizontally and
// ran the softmax in scalar code. 64 sequences x 256 keys, 8 q / 4 kv heads, D 64, bf16: 0.78 -> 0.40 ms
// on two threads (float32, bound by memory: 1.17 -> 1.01; notes, session 12). Session 13: 64 keys a
// softmax step, a branch-free dot loop (it had kept its 16 sums on the stack) and prefetches that run
// (see PrefetchLine), spread a line per line read: from DRAM, 64 x 208 keys D 32 bf16 0.85 -> 0.37 ms,
// D 64 1.1-1.4 -> 0.70 ms.

// Sixteen vectors -> one: lane 4k + j = the sum of a[k + 4j]'s lanes.
FERRY_AVX512 FERRY_INLINE __m512 SumTree16(const __m512* a) {
  __m512 r[8], s[4], u[2];
  for (int i = 0; i < 8; ++i)  // quarters 0-1: a[2i]'s 8 partial sums, 2-3: a[2i + 1]'s
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // quarter k: a[4i + k]'s 4 partial sums
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // quarter k: 2 sums of a[8i + k], 2 of a[8i + 4 + k]
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

constexpr int TreeLane(int a) { return 4 * (a % 4) + a / 4; }  // where SumTree16 puts a[a]'s sum

// Elements 32c..32c + 31 of a row as two vectors: float32 in order; bfloat16 as the even elements
// (each 32-bit lane's low half) and the odd ones (high), exactly widened.
FERRY_AVX512 FERRY_INLINE void SplitRow(const float* row, int64_t c, __m512* lo, __m512* hi) {
  *lo = _mm512_loadu_ps(row + 32 * c);
  *hi = _mm512_loadu_ps(row + 32 * c + 16);
}
FERRY_AVX512 FERRY_INLINE void SplitRow(const uint16_t* row, int64_t c, __m512* lo, __m512* hi) {
  const __m512i x = _mm512_loadu_si512(row + 32 * c);
  *lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  *hi = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Feature i's place in SplitRow's order: the identity for float32 pages; for bfloat16 ones, within
// each 32, even features first, then odd.
template <typename TKV>
FERRY_INLINE int64_t PermuteForPages(int64_t i) {
  if constexpr (std::is_same_v<TKV, float>) return i;
  const int64_t j = i % 32;
  return i - j + (j % 2) * 16 + j / 2;
}

// Keys c0.. of a page, up to 16: a decode tile takes kDecodeChunks of them per softmax step.
constexpr int kDecodeChunks = 4;
struct KeyChunk {
  int64_t offset, kc;  // element offset of the chunk's first K/V row (the tile's first head); keys present
};
// A tile's keys as chunks, in order.
struct ChunkWalk {
  const TilePages* pages;
  int64_t block_size, row_stride, j = 0, c0 = 0;  // the next chunk: keys c0.. of page j
  bool Done() const { return j >= pages->count; }
  KeyChunk Next() {
    const int64_t n = std::min(block_size, pages->keys - j * block_size);
    const KeyChunk c{pages->Offset(j) + c0 * row_stride, std::min<int64_t>(16, n - c0)};
    c0 += 16;
    if (c0 >= n) ++j, c0 = 0;
    return c;
  }
};

template <typename T>
FERRY_INLINE void PrefetchElems32(const T* p) {  // one line of bfloat16, two of float32
  PrefetchLine(reinterpret_cast<const char*>(p));
  if constexpr (sizeof(T) == 4) PrefetchLine(reinterpret_cast<const char*>(p + 16));
}

template <typename TQ, typename TKV, int64_t kD>
FERRY_AVX512 void DecodeTileAvx512Of(const Problem<TQ, TKV>& p, const Tile& tile, Scratch& sc) {
  const Geometry& g = p.g;
  const int64_t G = g.group, D = kD ? kD : g.head_dim, BS = g.block_size, NH = tile.nheads, C = D / 32;
  const int64_t M = NH * G;  // query vectors: hh * G + gi; slot M: an odd G's twin
  const int64_t keys = TileKeys(g, tile);  // one query row
  const int64_t q_row_stride = g.num_q_heads * D, kv_row_stride = g.num_kv_heads * D;
  sc.Reserve(1, M + 1, 2 * kDecodeChunks * 16, D);
  float* qf = sc.q.data();
  float* acc = sc.acc.data();
  float* mx = sc.m.data();
  float* l = sc.l.data();
  float* pw = sc.s.data();  // the pair's 2 x kDecodeChunks x 16 weights
  const TQ* q_src = p.q + tile.row0 * q_row_stride + tile.head0 * G * D;
  for (int64_t mi = 0; mi < M; ++mi)
    for (int64_t i = 0; i < D; ++i) qf[mi * D + PermuteForPages<TKV>(i)] = ToF32(q_src[mi * D + i]) * p.scale;
  std::fill(acc, acc + (M + 1) * D, 0.0f);
  std::fill(mx, mx + M + 1, -std::numeric_limits<float>::infinity());
  std::fill(l, l + M + 1, 0.0f);

  // Tree A holds keys 0-7 (accumulators 0-7: the first query vector, 8-15: the second), tree B keys 8-15.
  alignas(64) int32_t pick[2][16];
  for (int t = 0; t < 16; ++t) {
    pick[0][t] = t < 8 ? TreeLane(t) : 16 + TreeLane(t - 8);
    pick[1][t] = t < 8 ? TreeLane(t + 8) : 16 + TreeLane(t);
  }
  const __m512i pick0 = _mm512_load_si512(pick[0]), pick1 = _mm512_load_si512(pick[1]);
  const float cap = p.soft_cap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  const TilePages pages(p.tables, g, tile, keys);
  // `ahead` walks kDecodeChunks chunks in front: each K/V line read asks for the same line there, so
  // the prefetches spread over the work (a page's worth at once stalls the core on its miss buffers).
  // Past this tile's end it walks on into the next one this thread is likely to take (TileWork).
  ChunkWalk walk{&pages, BS, kv_row_stride};
  ChunkWalk ahead = walk;
  for (int i = 0; i < kDecodeChunks && !ahead.Done(); ++i) ahead.Next();
  const Tile* next_tile = sc.next_tile;
  const TilePages next_pages(p.tables, g, next_tile != nullptr ? *next_tile : tile,
                             next_tile != nullptr ? TileKeys(g, *next_tile) : 0);
  bool into_next = next_tile == nullptr;  // whether `ahead` has moved on (or has nowhere to go)
  while (!walk.Done()) {
    KeyChunk chunk[kDecodeChunks], next[kDecodeChunks];
    int nc = 0;
    for (; nc < kDecodeChunks && !walk.Done(); ++nc) {
      chunk[nc] = walk.Next();
      if (ahead.Done() && !into_next) ahead = ChunkWalk{&next_pages, BS, kv_row_stride}, into_next = true;
      next[nc] = ahead.Done() ? chunk[nc] : ahead.Next();  // past both ends: lines already in cache
    }
    for (int64_t hh = 0; hh < NH; ++hh) {
      for (int64_t gi = 0; gi < G; gi += 2) {
        const int64_t m0 = hh * G + gi, m1 = gi + 1 < G ? m0 + 1 : M;
        const float* q0 = qf + m0 * D;
        const float* q1 = qf + (gi + 1 < G ? m1 : m0) * D;
        __m512 scores[2][kDecodeChunks];
        for (int ci = 0; ci < nc; ++ci) {
          const TKV* kr = p.k + chunk[ci].offset + hh * D;
          const TKV* k_ahead = p.k + next[ci].offset + hh * D;
          __m512 tree[2];
          FERRY_UNROLL for (int half = 0; half < 2; ++half) {
            __m512 dots[16];
            FERRY_UNROLL for (int a = 0; a < 16; ++a) dots[a] = _mm512_setzero_ps();
            FERRY_UNROLL for (int t = 0; t < 8; ++t) {
              // An absent key reads the last present row (its own may hold anything; LeadingLanes drops it):
              // no branch, so the 16 sums stay in registers.
              const TKV* row = kr + std::min<int64_t>(8 * half + t, chunk[ci].kc - 1) * kv_row_stride;
              for (int64_t c = 0; c < C; ++c) {
                if (gi == 0) PrefetchElems32(k_ahead + (8 * half + t) * kv_row_stride + 32 * c);
                __m512 lo, hi;
                SplitRow(row, c, &lo, &hi);
                dots[t] = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + 32 * c), lo, dots[t]);
                dots[t] = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + 32 * c + 16), hi, dots[t]);
                dots[t + 8] = _mm512_fmadd_ps(_mm512_loadu_ps(q1 + 32 * c), lo, dots[t + 8]);
                dots[t + 8] = _mm512_fmadd_ps(_mm512_loadu_ps(q1 + 32 * c + 16), hi, dots[t + 8]);
              }
            }
            tree[half] = SumTree16(dots);
          }
          scores[0][ci] = _mm512_permutex2var_ps(tree[0], pick0, tree[1]);
          scores[1][ci] = _mm512_permutex2var_ps(tree[0], pick1, tree[1]);
        }
        const int64_t slots[2] = {m0, m1};
        float alpha[2];
        for (int v = 0; v < 2; ++v) {
          const int64_t mi = slots[v];
          float* w = pw + kDecodeChunks * 16 * v;  // this vector's weights: the other's may be there already
          __m512 chunk_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
          for (int ci = 0; ci < nc; ++ci) {
            if (cap > 0.0f) {
              _mm512_storeu_ps(w, scores[v][ci]);
              for (int t = 0; t < 16; ++t) w[t] = cap * Tanh(w[t] * inv_cap);
              scores[v][ci] = _mm512_loadu_ps(w);
            }
            chunk_max = _mm512_mask_max_ps(chunk_max, LeadingLanes(chunk[ci].kc), chunk_max, scores[v][ci]);
          }
          const float old_max = mx[mi];
          const float new_max = std::max(old_max, _mm512_reduce_max_ps(chunk_max));
          const __m512 new_max_v = _mm512_set1_ps(new_max);
          __m512 sum = _mm512_setzero_ps();
          for (int ci = 0; ci < nc; ++ci) {
            const __m512 e = _mm512_maskz_mov_ps(LeadingLanes(chunk[ci].kc),
                                                 Exp512NonPositive(_mm512_sub_ps(scores[v][ci], new_max_v)));
            sum = _mm512_add_ps(sum, e);
            _mm512_storeu_ps(w + 16 * ci, e);
          }
          // 0 on the first keys (old max -inf), 1 while the max holds.
          alpha[v] = new_max > old_max ? std::exp(old_max - new_max) : 1.0f;
          mx[mi] = new_max;
          l[mi] = l[mi] * alpha[v] + _mm512_reduce_add_ps(sum);
        }
        for (int64_t cb = 0; cb < C; cb += 2) {  // 64 features (two 32s) of both accumulators at a time
          const int cn = static_cast<int>(std::min<int64_t>(2, C - cb));
          __m512 a[2][4];
          for (int v = 0; v < 2; ++v)
            for (int u = 0; u < 4; ++u)
              a[v][u] = u < 2 * cn ? _mm512_mul_ps(_mm512_loadu_ps(acc + slots[v] * D + 32 * cb + 16 * u),
                                                   _mm512_set1_ps(alpha[v]))
                                   : _mm512_setzero_ps();
          for (int ci = 0; ci < nc; ++ci) {
            const TKV* vr = p.v + chunk[ci].offset + hh * D;
            const TKV* v_ahead = p.v + next[ci].offset + hh * D;
            const float* w0 = pw + 16 * ci;
            const float* w1 = pw + kDecodeChunks * 16 + 16 * ci;
            for (int64_t t = 0; t < chunk[ci].kc; ++t) {
              const __m512 b0 = _mm512_set1_ps(w0[t]), b1 = _mm512_set1_ps(w1[t]);
              for (int c = 0; c < cn; ++c) {
                if (gi == 0) PrefetchElems32(v_ahead + t * kv_row_stride + 32 * (cb + c));
                __m512 lo, hi;
                SplitRow(vr + t * kv_row_stride, cb + c, &lo, &hi);
                a[0][2 * c] = _mm512_fmadd_ps(b0, lo, a[0][2 * c]);
                a[0][2 * c + 1] = _mm512_fmadd_ps(b0, hi, a[0][2 * c + 1]);
                a[1][2 * c] = _mm512_fmadd_ps(b1, lo, a[1][2 * c]);
                a[1][2 * c + 1] = _mm512_fmadd_ps(b1, hi, a[1][2 * c + 1]);
              }
            }
          }
          for (int v = 0; v < 2; ++v)
            for (int u = 0; u < 2 * cn; ++u) _mm512_storeu_ps(acc + slots[v] * D + 32 * cb + 16 * u, a[v][u]);
        }
      }
    }
  }

  TQ* dst = p.out + tile.row0 * q_row_stride + tile.head0 * G * D;
  for (int64_t mi = 0; mi < M; ++mi) {
    const float inv = l[mi] > 0.0f ? 1.0f / l[mi] : 0.0f;
    for (int64_t i = 0; i < D; ++i)
      FromF32(l[mi] > 0.0f ? acc[mi * D + PermuteForPages<TKV>(i)] * inv : 0.0f, dst + mi * D + i);
  }
}

template <typename TQ, typename TKV>
void DecodeTileAvx512AnyD(const Problem<TQ, TKV>& p, const Tile& t, Scratch& sc) {
  switch (p.g.head_dim) {  // common head dims get fully unrolled loops
    case 32: return DecodeTileAvx512Of<TQ, TKV, 32>(p, t, sc);
    case 64: return DecodeTileAvx512Of<TQ, TKV, 64>(p, t, sc);
    case 128: return DecodeTileAvx512Of<TQ, TKV, 128>(p, t, sc);
    default: return DecodeTileAvx512Of<TQ, TKV, 0>(p, t, sc);
  }
}

void DecodeTileAvx512(const Problem<float, float>& p, const Tile& t, Scratch& sc) { DecodeTileAvx512AnyD(p, t, sc); }
void DecodeTileAvx512(const Problem<uint16_t, uint16_t>& p, const Tile& t, Scratch& sc) {
  DecodeTileAvx512AnyD(p, t, sc);
}
void DecodeTileAvx512(const Problem<float, uint16_t>& p, const Tile& t, Scratch& sc) { DecodeTileAvx512AnyD(p, t, sc); }

template <typename TQ, typename TKV>
void PrefillTileAvx512AnyD(const Problem<TQ, TKV>& p, const Tile& t, Scratch& sc) {
  switch (p.g.head_dim) {  // common head dims get constant offsets
    case 64: return PrefillTileAvx512Of<TQ, TKV, 64>(p, t, sc);
    case 128: return PrefillTileAvx512Of<TQ, TKV, 128>(p, t, sc);
    default: return PrefillTileAvx512Of<TQ, TKV, 0>(p, t, sc);
  }
}

void PrefillTileAvx512(const Problem<float, float>& p, const Tile& t, Scratch& sc) { PrefillTileAvx512AnyD(p, t, sc); }
void PrefillTileAvx512(const Problem<uint16_t, uint16_t>& p, const Tile& t, Scratch& sc) {
  PrefillTileAvx512AnyD(p, t, sc);
}
void PrefillTileAvx512(const Problem<float, uint16_t>& p, const Tile& t, Scratch& sc) {
  PrefillTileAvx512AnyD(p, t, sc);
}
#else
bool UseAvx512Matmul() { return false; }
bool UseAvx2Matmul() { return false; }
bool UseDpbf16Matmul() { return false; }
void PrefillTileAvx512(const Problem<float, float>&, const Tile&, Scratch&) {}
void PrefillTileAvx512(const Problem<uint16_t, uint16_t>&, const Tile&, Scratch&) {}
void PrefillTileAvx512(const Problem<float, uint16_t>&, const Tile&, Scratch&) {}
void DecodeTileAvx512(const Problem<float, float>&, const Tile&, Scratch&) {}
void DecodeTileAvx512(const Problem<uint16_t, uint16_t>&, const Tile&, Scratch&) {}
void DecodeTileAvx512(const Problem<float, uint16_t>&, const Tile&, Scratch&) {}
void PrefillTileAvx2(const Problem<float, float>&, const Tile&, Scratch&) {}
void PrefillTileAvx2(const Problem<uint16_t, uint16_t>&, const Tile&, Scratch&) {}
void PrefillTileAvx2(const Problem<float, uint16_t>&, const Tile&, Scratch&) {}
void DecodeTileAvx2(const Problem<float, float>&, const Tile&, Scratch&) {}
void DecodeTileAvx2(const Problem<uint16_t, uint16_t>&, const Tile&, Scratch&) {}
void DecodeTileAvx2(const Problem<float, uint16_t>&, const Tile&, Scratch&) {}
#endif

// The tiled paths split each panel's rows into parts so that every thread takes several items: with a few
// panels a thread (o and down of model b: 4 each on 2 threads) the last item's work was left to one thread
// while the other waited (two threads ran those linears at 1.25-1.5x one thread's speed, 64 rows). Where
// parts of kMinLongPartRows rows allow it, twice as many: a part re-reads its panel, which costs little next
// to that many rows' sums (a prefill step's 512-row qkv of model b, float32, 16 panels: 3.14 -> 2.93 ms a
// layer, 256 rows 1.58 -> 1.48; at 64 rows two parts of qkv cost 0.43 -> 0.48).
constexpr int64_t kItemsPerThread = 8, kMinPartRows = 24, kMinLongPartRows = 128;

struct MatmulWork {
  const Matmul* problem;
  const void* tiles;  // a PanelTiles (AVX-512 or AVX2; the activation fused per item); null: the portable loops
  int64_t threads = 1;
  int64_t row_parts = 1;  // the tiled paths' parts of each panel's rows (RowParts)
  bool FusesGate() const { return tiles != nullptr; }
  int64_t Panels() const { return FusesGate() && problem->act >= 0 ? problem->part_panels : problem->panels; }
  int64_t Items() const { return Panels() * row_parts; }
  int64_t RowParts() const {  // kItemsPerThread items a thread in parts of kMinPartRows rows or more, or twice
    if (tiles == nullptr || threads <= 1) return 1;  // as many in parts of kMinLongPartRows
    const auto parts = [&](int64_t items_per_thread, int64_t min_rows) {
      return std::min((items_per_thread * threads + Panels() - 1) / Panels(), problem->m / min_rows);
    };
    return std::max<int64_t>({1, parts(kItemsPerThread, kMinPartRows), parts(2 * kItemsPerThread, kMinLongPartRows)});
  }
  int64_t PartRow(int64_t part) const {  // part's first row (row_parts: M), the nearest multiple of kRowBlock
    if (part == row_parts) return problem->m;
    return std::min(problem->m, (part * problem->m / row_parts + kRowBlock / 2) / kRowBlock * kRowBlock);
  }
  static void Run(const void* self, int64_t item, int64_t next_item) {
    const auto* w = static_cast<const MatmulWork*>(self);
#ifdef FERRY_HAVE_AVX512_MATMUL
    if (w->tiles != nullptr) {
      const int64_t panel = item / w->row_parts, part = item % w->row_parts;
      const int64_t next = next_item < 0 ? -1 : next_item / w->row_parts;  // its panel: asked for meanwhile
      return MatmulItemTiled(*w->problem, *static_cast<const PanelTiles*>(w->tiles), panel, w->PartRow(part),
                             w->PartRow(part + 1), next != panel ? next : -1);
    }
#endif
    const Matmul& p = *w->problem;
    if (p.w_bf16) MatmulPanelGenericBf16(p, item);
    else MatmulPanelGenericF32(p, item);
    if (p.round_bf16)
      for (int64_t r = 0; r < p.m; ++r)
        for (int64_t c = p.PanelCol(item); c < p.PanelCol(item) + p.PanelWidth(item); ++c)
          p.y[r * p.n + c] = RoundedToBf16(p.y[r * p.n + c]);
  }
};

ffi::Error StackedMatmulBody(ffi::ThreadPool& pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer>& y,
                             int32_t act, int32_t groups, int32_t round_bf16) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const bool gated = act >= 0;
  if (act > 1) return ffi::Error::InvalidArgument("ferry stacked matmul: act must be -1, 0 or 1");
  if (round_bf16 != 0 && (round_bf16 != 1 || gated))
    return ffi::Error::InvalidArgument("ferry stacked matmul: round_bf16 must be 0 or 1 (gated: 0)");
  if (groups < 1 || (gated && groups != 2))
    return ffi::Error::InvalidArgument("ferry stacked matmul: groups must be >= 1 (gated: 2)");
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  if (!bf16 && w.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("ferry stacked matmul: w must be float32 or bfloat16");
  if (xd.size() != 2 || yd.size() != 2 || layer.element_count() != 1 || rows.element_count() != 1 ||
      yd[0] != xd[0] || wd.size() != 5)
    return ffi::Error::InvalidArgument("ferry stacked matmul: expected x [M,K], packed w [L,P,4,KP,16E], layer [], "
                                       "rows [] and y [M,N] (gated: [M,N/2])");
  const int64_t n = gated ? 2 * yd[1] : yd[1], k = xd[1];
  const int64_t part_cols = n / groups, part_panels = (part_cols + kPanelCols - 1) / kPanelCols;
  if (n % groups != 0 || wd[1] != groups * part_panels || wd[2] != kPanelStrips ||
      wd[3] != (bf16 ? (k + 1) / 2 : k) || wd[4] != (bf16 ? 2 : 1) * kStripCols)
    return ffi::Error::InvalidArgument(
        "ferry stacked matmul: w is not x's K and y's N packed in `groups` parts (native.pack_stacked)");
  const bool y_bf16 = y->element_type() == ffi::DataType::BF16;
  if (!(y->element_type() == ffi::DataType::F32 || (gated && y_bf16)))
    return ffi::Error::InvalidArgument("ferry stacked matmul: y must be float32 (gated: or bfloat16)");
  const bool x16 = x.element_type() == ffi::DataType::BF16;
  if (!(x.element_type() == ffi::DataType::F32 || (x16 && bf16)))
    return ffi::Error::InvalidArgument("ferry stacked matmul: x must be float32, or bfloat16 with bfloat16 w");
  if (wd[0] == 0) return ffi::Error::InvalidArgument("ferry stacked matmul: w has no layers");
  // Clamped like XLA's dynamic-slice clamps its start index.
  const int64_t l = std::clamp<int64_t>(*layer.typed_data(), 0, wd[0] - 1);
  const int64_t element_bytes = bf16 ? 2 : 4;
  // Only x's first `rows` rows are computed (clamped into [0, M]): a bucketed step's padding rows are left
  // unwritten, their values never read by a real row.
  const int64_t m = std::clamp<int64_t>(*rows.typed_data(), 0, xd[0]);
  Matmul p{static_cast<const float*>(x.untyped_data()),
           static_cast<const char*>(w.untyped_data()) + l * wd[1] * wd[2] * wd[3] * wd[4] * element_bytes,
           static_cast<float*>(y->untyped_data()), m, k, n};
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  p.w_bf16 = bf16;
  p.round_bf16 = round_bf16 == 1;
  p.part_cols = part_cols;
  p.part_panels = part_panels;
  p.panels = wd[1];
  if (gated) {
    p.act = act;
    p.gated_out = y->untyped_data();
    p.gated_bf16 = y_bf16;
  }
  const bool avx512 = UseAvx512Matmul();
  // bf16 dot products for every row count (one row too): a row's sums do not depend on the batch.
  const bool dpbf16 = x16 && avx512 && UseDpbf16Matmul();
  p.bf16_convert = avx512 && UseDpbf16Matmul();
  std::vector<float> widened;  // bf16 x for the float32 paths: widened once, exactly
  if (x16) {
    p.x16 = static_cast<const uint16_t*>(x.untyped_data());
    if (!dpbf16) {
      widened.resize(p.m * p.k);
      for (int64_t i = 0; i < p.m * p.k; ++i) widened[i] = Bf16ToF32(p.x16[i]);
      p.x = widened.data();
    }
  }
  MatmulWork work{&p, nullptr};
#ifdef FERRY_HAVE_AVX512_MATMUL
  if (avx512) work.tiles = &kAvx512Tiles[dpbf16 ? 2 : bf16 ? 1 : 0];
  else if (UseAvx2Matmul()) work.tiles = &kAvx2Tiles[bf16 ? 1 : 0];
  if (work.tiles != nullptr) p.k_block = KBlockFor(*static_cast<const PanelTiles*>(work.tiles));
#endif
  std::vector<float> sums;  // gated, on the paths that do not fuse it: every sum, then one pass
  if (gated && !work.FusesGate()) {
    sums.resize(p.m * p.n);
    p.y = sums.data();
  }
  work.threads = ThreadsFor(pool, p.m * p.k * p.n, int64_t{1} << 18);
  work.row_parts = work.RowParts();
  ParallelFor(&pool, work.Items(), work.threads - 1, &work, &MatmulWork::Run);
  if (gated && !work.FusesGate()) GatedRows(p, sums.data(), sums.data() + p.n / 2, p.n, 0, p.m, 0, p.n / 2);
  return ffi::Error::Success();
}

ffi::Error StackedMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> y,
                             int32_t act, int32_t groups, int32_t round_bf16) {
  return Guarded([&] { return StackedMatmulBody(pool, x, w, layer, rows, y, act, groups, round_bf16); });
}

ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens,
                      ffi::Result<ffi::AnyBuffer> out, float scale, float soft_cap) {
  return Guarded([&] { return DecodeBody(pool, q, k, v, tables, lens, out, scale, soft_cap); });
}

ffi::Error PrefillImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens,
                       ffi::Buffer<ffi::S32> query_start_loc, ffi::Result<ffi::AnyBuffer> out,
                       float scale, float soft_cap) {
  return Guarded([&] {
    return PrefillBody(pool, q, k, v, tables, lens, query_start_loc, out, scale, soft_cap);
  });
}

// ----------------------------------------------------------------------------- RMSNorm

// A decoder layer's norms as the model's jnp RMSNorm rounds them (models/transformer.py): in float32,
// v * rsqrt(mean(v^2) + eps), then Llama's w * normed.astype(dtype) (offset 0) or Gemma's
// (normed * (offset + w)).astype(dtype). FerryAddRmsNorm first makes v = x + delta.astype(dtype) in
// x's dtype (the residual add; delta may be a matmul's float32 sums) and returns it too. XLA CPU ran
// each norm as four fusions and the add as one more, ~10 us each at [64, 512] whatever their size.
struct RmsNorm {
  const void* x;      // [M, K] float32 or bfloat16 bits (T)
  const void* delta;  // [M, K] or null
  bool delta_f32;     // delta float32 (else T)
  const void* w;      // [K] T
  void* sum;          // [M, K] T, with delta
  void* out;          // [M, K] T
  int64_t m, k;
  float eps, offset;
};

FERRY_INLINE float RoundedTo(float v, const float*) { return v; }
FERRY_INLINE float RoundedTo(float v, const uint16_t*) { return RoundedToBf16(v); }

// v = x + delta.astype(T) for a row into sum, rounded to T; returns the sum of v^2.
template <typename T, typename TD>
FERRY_INLINE float AddRowOf(const T* __restrict x, const TD* __restrict delta, int64_t k, T* __restrict sum) {
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < k; ++i) {
    const float v = RoundedTo(ToF32(x[i]) + RoundedTo(ToF32(delta[i]), x), x);
    FromF32(v, sum + i);
    squares += v * v;
  }
  return squares;
}

template <typename T>
FERRY_INLINE void RmsNormRowsOf(const RmsNorm& p, int64_t r0, int64_t r1) {
  const T* __restrict w = static_cast<const T*>(p.w);
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = static_cast<const T*>(p.x) + r * p.k;
    T* __restrict out = static_cast<T*>(p.out) + r * p.k;
    float squares = 0.0f;
    if (p.delta != nullptr) {
      T* sum = static_cast<T*>(p.sum) + r * p.k;
      squares = p.delta_f32 ? AddRowOf(x, static_cast<const float*>(p.delta) + r * p.k, p.k, sum)
                            : AddRowOf(x, static_cast<const T*>(p.delta) + r * p.k, p.k, sum);
      x = sum;  // the norm's input: the rounded sum
    } else {
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < p.k; ++i) squares += ToF32(x[i]) * ToF32(x[i]);
    }
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(p.k) + p.eps);
    if (p.offset == 0.0f) {
#pragma omp simd
      for (int64_t i = 0; i < p.k; ++i) FromF32(ToF32(w[i]) * RoundedTo(ToF32(x[i]) * inv, x), out + i);
    } else {
#pragma omp simd
      for (int64_t i = 0; i < p.k; ++i) FromF32(ToF32(x[i]) * inv * (p.offset + ToF32(w[i])), out + i);
    }
  }
}

constexpr int64_t kNormRowBlock = 16;
FERRY_CLONES_512 void RmsNormRowsF32(const RmsNorm& p, int64_t r0, int64_t r1) { RmsNormRowsOf<float>(p, r0, r1); }
FERRY_CLONES_512 void RmsNormRowsBf16(const RmsNorm& p, int64_t r0, int64_t r1) { RmsNormRowsOf<uint16_t>(p, r0, r1); }

#ifdef FERRY_HAVE_AVX512_MATMUL
// RmsNormRowsOf's steps 16 lanes at a time (its bits but for the order of the sum of squares): GCC's own
// vectors of it were 256 bits wide with a scalar-style rounding, 25 us for a [64, 512] bf16 add and norm.

template <typename T>
FERRY_AVX512 void RmsNormRowsAvx512(const RmsNorm& p, int64_t r0, int64_t r1) {
  const T* w = static_cast<const T*>(p.w);
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = static_cast<const T*>(p.x) + r * p.k;
    T* out = static_cast<T*>(p.out) + r * p.k;
    __m512 squares = _mm512_setzero_ps();
    if (p.delta != nullptr) {
      T* sum = static_cast<T*>(p.sum) + r * p.k;
      for (int64_t i = 0; i < p.k; i += 16) {
        const __mmask16 m = LeadingLanes(p.k - i);
        const __m512 d = p.delta_f32 ? Rounded16(LoadWeights(static_cast<const float*>(p.delta) + r * p.k + i, m), x)
                                     : LoadWeights(static_cast<const T*>(p.delta) + r * p.k + i, m);
        const __m512 v = Rounded16(_mm512_add_ps(LoadWeights(x + i, m), d), x);
        Store16(sum + i, m, v);
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      x = sum;
    } else {
      for (int64_t i = 0; i < p.k; i += 16) {
        const __m512 v = LoadWeights(x + i, LeadingLanes(p.k - i));
        squares = _mm512_fmadd_ps(v, v, squares);
      }
    }
    const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(p.k) + p.eps));
    const __m512 offset = _mm512_set1_ps(p.offset);
    for (int64_t i = 0; i < p.k; i += 16) {
      const __mmask16 m = LeadingLanes(p.k - i);
      const __m512 normed = _mm512_mul_ps(LoadWeights(x + i, m), inv), wi = LoadWeights(w + i, m);
      Store16(out + i, m, Rounded16(p.offset == 0.0f ? _mm512_mul_ps(wi, Rounded16(normed, x))
                                                     : _mm512_mul_ps(normed, _mm512_add_ps(offset, wi)), x));
    }
  }
}
#endif

struct RmsNormWork {
  const RmsNorm* problem;
  bool bf16;
  bool avx512;  // else the portable rows (FERRY_NATIVE_MATMUL_GENERIC=1 in tests)
  static void Run(const void* self, int64_t item, int64_t) {
    const auto* w = static_cast<const RmsNormWork*>(self);
    const int64_t r0 = item * kNormRowBlock, r1 = std::min(r0 + kNormRowBlock, w->problem->m);
#ifdef FERRY_HAVE_AVX512_MATMUL
    if (w->avx512)
      return w->bf16 ? RmsNormRowsAvx512<uint16_t>(*w->problem, r0, r1) : RmsNormRowsAvx512<float>(*w->problem, r0, r1);
#endif
    if (w->bf16) RmsNormRowsBf16(*w->problem, r0, r1);
    else RmsNormRowsF32(*w->problem, r0, r1);
  }
};

ffi::Error RmsNormBody(ffi::ThreadPool& pool, ffi::AnyBuffer x, const ffi::AnyBuffer* delta, ffi::AnyBuffer w,
                       ffi::AnyBuffer* sum, ffi::AnyBuffer out, float eps, float offset) {
  const auto dt = x.element_type();
  auto xd = x.dimensions(), wd = w.dimensions(), od = out.dimensions();
  if (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("ferry rms norm: x must be float32 or bfloat16");
  if (xd.size() != 2 || wd.size() != 1 || wd[0] != xd[1] || od.size() != 2 || od[0] != xd[0] || od[1] != xd[1] ||
      w.element_type() != dt || out.element_type() != dt)
    return ffi::Error::InvalidArgument("ferry rms norm: expected x [M, K], w [K] and out [M, K] of one dtype");
  RmsNorm p{x.untyped_data(), nullptr, false, w.untyped_data(), nullptr, out.untyped_data(), xd[0], xd[1],
            eps, offset};
  if (delta != nullptr) {
    auto dd = delta->dimensions(), sd = sum->dimensions();
    p.delta_f32 = delta->element_type() == ffi::DataType::F32;
    if (dd.size() != 2 || dd[0] != xd[0] || dd[1] != xd[1] || !(p.delta_f32 || delta->element_type() == dt) ||
        sd.size() != 2 || sd[0] != xd[0] || sd[1] != xd[1] || sum->element_type() != dt)
      return ffi::Error::InvalidArgument(
          "ferry add rms norm: expected delta [M, K] float32 or x's dtype, and sum [M, K] of x's dtype");
    p.delta = delta->untyped_data();
    p.sum = sum->untyped_data();
  }
  if (p.m == 0 || p.k == 0) return ffi::Error::Success();
  RmsNormWork work{&p, dt == ffi::DataType::BF16, UseAvx512Matmul()};
  const int64_t threads = ThreadsFor(pool, p.m * p.k, int64_t{1} << 16);  // a decode batch: 1
  ParallelFor(&pool, (p.m + kNormRowBlock - 1) / kNormRowBlock, threads - 1, &work, &RmsNormWork::Run);
  return ffi::Error::Success();
}

ffi::Error RmsNormImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                       float eps, float offset) {
  return Guarded([&] { return RmsNormBody(pool, x, nullptr, w, nullptr, *out, eps, offset); });
}

ffi::Error AddRmsNormImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer delta, ffi::AnyBuffer w,
                          ffi::Result<ffi::AnyBuffer> sum, ffi::Result<ffi::AnyBuffer> out, float eps,
                          float offset) {
  return Guarded([&] { return RmsNormBody(pool, x, &delta, w, &(*sum), *out, eps, offset); });
}

}  // namespace

// The library is built with -fvisibility=hidden; only these symbols are exported.
#if defined(__GNUC__)
#pragma GCC visibility push(default)
#endif

// Both handlers' bindings: the thread pool; q, k_pages, v_pages, block_tables, context_lens, then
// `more_args`; the output; the scale and soft_cap attributes. A macro rather than a helper
// function: a helper shifts GCC's file-wide inlining budget and with it the code of the
// AttendTile* kernels, while with the macro the library compiles exactly as before.
#define FERRY_PAGED_ATTENTION_BINDING(more_args)                 \
  ffi::Ffi::Bind()                                               \
      .Ctx<ffi::ThreadPool>()                                    \
      .Arg<ffi::AnyBuffer>()        /* q */                      \
      .Arg<ffi::AnyBuffer>()        /* k_pages */                \
      .Arg<ffi::AnyBuffer>()        /* v_pages */                \
      .Arg<ffi::Buffer<ffi::S32>>() /* block_tables */           \
      .Arg<ffi::Buffer<ffi::S32>>() /* context_lens */ more_args \
      .Ret<ffi::AnyBuffer>()        /* out */                    \
      .Attr<float>("scale")                                      \
      .Attr<float>("soft_cap")

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerryPagedDecodeAttention, DecodeImpl,
                              FERRY_PAGED_ATTENTION_BINDING());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerryPagedPrefillAttention, PrefillImpl,
                              FERRY_PAGED_ATTENTION_BINDING(
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  ));

#undef FERRY_PAGED_ATTENTION_BINDING

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerryKvWrite, KvWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // pages
                                  .Arg<ffi::AnyBuffer>()         // updates
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping
                                  .Ret<ffi::AnyBuffer>());       // pages, aliased

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerryStackedMatmul, StackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] f32, or bf16 under bf16 w
                                  .Arg<ffi::AnyBuffer>()  // w [L, P, KP, 64E] f32 or bf16, packed
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows []: x's real rows (the rest unwritten)
                                  .Ret<ffi::AnyBuffer>()  // y [M, N] f32; gated: [M, N/2] f32 or bf16
                                  .Attr<int32_t>("act")      // -1: none; gated: 0 SiLU, 1 GELU (tanh)
                                  .Attr<int32_t>("groups")   // w's column parts, each padded to panels
                                  .Attr<int32_t>("round_bf16"));  // 1: y at bfloat16's precision

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerryRmsNorm, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] f32 or bf16
                                  .Arg<ffi::AnyBuffer>()  // w [K]
                                  .Ret<ffi::AnyBuffer>()  // RMSNorm(x) [M, K]
                                  .Attr<float>("eps")
                                  .Attr<float>("offset"));  // 0: Llama's w * normed; 1: Gemma's (1 + w)

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerryAddRmsNorm, AddRmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] f32 or bf16
                                  .Arg<ffi::AnyBuffer>()  // delta [M, K] f32 or x's dtype
                                  .Arg<ffi::AnyBuffer>()  // w [K]
                                  .Ret<ffi::AnyBuffer>()  // sum = x + delta [M, K]
                                  .Ret<ffi::AnyBuffer>()  // RMSNorm(sum) [M, K]
                                  .Attr<float>("eps")
                                  .Attr<float>("offset"));

// Let the loader (pallas_kernels/native.py) check that the library matches the Python side and
// was built from this very source (the build passes -DFERRY_SOURCE_HASH=<sha256 prefix>).
// The jaxlib whose FFI headers it was compiled against goes in too: XLA takes handlers built with
// older headers, not necessarily newer ones.
#ifndef FERRY_SOURCE_HASH
#define FERRY_SOURCE_HASH "unknown"
#endif
#ifndef FERRY_JAXLIB_VERSION
#define FERRY_JAXLIB_VERSION "unknown"
#endif
extern "C" int FerryPagedAttentionAbiVersion() { return 8; }
extern "C" const char* FerryPagedAttentionSourceHash() { return FERRY_SOURCE_HASH; }
extern "C" const char* FerryPagedAttentionJaxlibVersion() { return FERRY_JAXLIB_VERSION; }

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif
