// Paged attention (FerryPagedDecodeAttention, FerryPagedPrefillAttention): the problem and its tiles of work,
// the portable vector-at-a-time tile, the dispatch to the x86 tiles (attention_avx2.h, attention_avx512.h),
// validation, and the decode and prefill bodies.
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
// sequences of one query row (a ragged step's decodes) take decode tiles: a GEMM tile of one row wastes
// most of its lanes, and the result is the same as a decode step's. On AVX2 without AVX-512, prefill and
// decode tiles run in 8-lane vectors (PrefillTileAvx2, DecodeTileAvx2); elsewhere the portable loops, GCC's
// vectors. FERRY_NATIVE_NO_AVX512=1 takes the AVX2 code on an AVX-512 CPU (tests).

#pragma once

#include <numeric>

#include "common.h"
#include "parallel.h"
#include "simd.h"

namespace {

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
  int64_t page_dim;  // a page row's elements per kv head: head_dim, or head_dim + 4 for quantized pages
};

// One unit of work: `nrows` consecutive query rows of one sequence, all query heads of kv heads
// [head0, head0 + nheads). Row r sits at absolute position first_pos + r and sees keys
// [0, clamp(first_pos + r + 1, 0, W * BS)), under a sliding window only those > first_pos + r - window.
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

// TQ: the element type of q and out; TKV: of the k/v pages (float or uint16_t = bfloat16; int8_t or Fp8E4M3 for
// quantized pages, each row its values then its float32 scale).
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
  int64_t window = 0;  // sliding window: a row at position p sees keys > p - window (0: none)
  const float* sinks = nullptr;  // attention sinks [num_q_heads] (gpt-oss; StartFromSinks), or null: none
  TileKind tiles = TileKind::kVector;
};

// Attention sinks: each query vector's online softmax starts as if it had seen one key of logit sinks[head] and
// no value, m = sink and l = exp(sink - m) = 1, so the sink joins the denominator only; a vector that then sees
// no key comes out as zeros (acc 0), as without sinks. head_of(i): query vector i's query head.
template <typename HeadOf>
FERRY_INLINE void StartFromSinks(const float* sinks, int64_t n, HeadOf head_of, float* m, float* l) {
  for (int64_t i = 0; i < n; ++i) {
    m[i] = sinks[head_of(i)];
    l[i] = 1.0f;
  }
}

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

// ----------------------------------------------------------------------------- quantized pages

// int8 and float8_e4m3fn pages (EngineConfig.kv_dtype "int8" / "fp8", pallas_kernels/kv_quant.py): a row of
// one kv head is its head_dim values, then its float32 scale's 4 bytes (native byte order): page_dim =
// head_dim + 4. Read as value * scale in float32, widened into `buf` as bfloat16 pages are; only the vector
// tiles take them (AttentionTiles).
struct Fp8E4M3 {  // float8_e4m3fn, as its bits
  uint8_t bits;
};

// float8_e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN.
inline float Fp8E4M3ToF32(uint8_t b) {
  const int exponent = (b >> 3) & 15, mantissa = b & 7;
  float v;
  if (exponent == 15 && mantissa == 7) v = std::numeric_limits<float>::quiet_NaN();
  else if (exponent == 0) v = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: mantissa / 8 * 2^-6
  else v = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  return (b & 0x80) ? -v : v;
}

struct Fp8E4M3Table {
  float value[256];
  Fp8E4M3Table() {
    for (int i = 0; i < 256; ++i) value[i] = Fp8E4M3ToF32(static_cast<uint8_t>(i));
  }
};

inline const float* Fp8E4M3Values() {
  static const Fp8E4M3Table table;
  return table.value;
}

FERRY_INLINE float QuantizedToF32(int8_t x, const float*) { return static_cast<float>(x); }
FERRY_INLINE float QuantizedToF32(Fp8E4M3 x, const float* fp8_values) { return fp8_values[x.bits]; }

template <typename T>
FERRY_INLINE const float* QuantizedPageRows(const T* page, int64_t n, int64_t row_stride, int64_t d,
                                            float* buf, int64_t* stride_out) {
  const float* fp8_values = Fp8E4M3Values();
  for (int64_t t = 0; t < n; ++t) {
    const T* src = page + t * row_stride;
    float scale;
    std::memcpy(&scale, src + d, sizeof(scale));
    float* dst = buf + t * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = QuantizedToF32(src[i], fp8_values) * scale;
  }
  *stride_out = d;
  return buf;
}

FERRY_INLINE const float* PageRows(const int8_t* page, int64_t n, int64_t row_stride, int64_t d, float* buf,
                                   int64_t* stride_out) {
  return QuantizedPageRows(page, n, row_stride, d, buf, stride_out);
}

FERRY_INLINE const float* PageRows(const Fp8E4M3* page, int64_t n, int64_t row_stride, int64_t d, float* buf,
                                   int64_t* stride_out) {
  return QuantizedPageRows(page, n, row_stride, d, buf, stride_out);
}

#ifndef FERRY_PREFETCH_PAGES
#define FERRY_PREFETCH_PAGES 2
#endif
constexpr int64_t kPrefetchPages = FERRY_PREFETCH_PAGES;  // how far ahead to prefetch pages (0: off)

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
    return (block * g.block_size * g.num_kv_heads + head0) * g.page_dim;
  }
  int64_t Rows(int64_t j) const { return std::min(g.block_size, keys - j * g.block_size); }  // keys in page j
  // Page j's K and V rows, all at once.
  template <typename T>
  void PrefetchPage(const T* k, const T* v, int64_t j, int64_t row_elems) const {
    Prefetch(k + Offset(j), Rows(j), g.num_kv_heads * g.page_dim, row_elems);
    Prefetch(v + Offset(j), Rows(j), g.num_kv_heads * g.page_dim, row_elems);
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
    if (row_elems != g.num_kv_heads * g.page_dim) {
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

// ----------------------------------------------------------------------------- vector-at-a-time tile

// An attention tile's output vector: dst[d] = sums[d] / l in TQ, 0 where the query vector saw no key (l == 0).
// The select sits outside the loop, which then vectorizes: with it inside, GCC left the loop scalar, a
// visible part of the AVX2 prefill and decode tiles' time.
template <typename TQ>
FERRY_INLINE void NormalizedOut(const float* __restrict sums, int64_t D, float l, TQ* __restrict dst) {
  if (l > 0.0f) {
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < D; ++d) FromF32(sums[d] * inv, dst + d);
  } else {
    for (int64_t d = 0; d < D; ++d) FromF32(0.0f, dst + d);
  }
}

template <typename TQ, typename TKV, int64_t kD>
FERRY_INLINE void AttendTileImpl(const Problem<TQ, TKV>& p, const Tile& tile, Scratch& sc) {
  const Geometry& g = p.g;
  const int64_t G = g.group, D = kD ? kD : g.head_dim, BS = g.block_size;
  const int64_t NH = tile.nheads;
  const int64_t M = tile.nrows * NH * G;  // query vectors: index (r * NH + hh) * G + gi
  const int64_t max_keys_total = g.num_blocks > 0 ? g.table_width * BS : 0;
  const int64_t q_row_stride = g.num_q_heads * D;
  const int64_t PD = g.page_dim;  // a kv head's row in the pages (D, or D + 4 quantized)
  const int64_t kv_row_stride = g.num_kv_heads * PD;
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
  // A sliding window's first key of row r (0 without one): the tile's pages start at row 0's.
  auto first_key = [&](int64_t r) {
    return p.window > 0 ? std::max<int64_t>(tile.first_pos + r - p.window + 1, 0) : int64_t{0};
  };
  // The tile's query heads of one row are contiguous in q: (head0 * G ... (head0 + NH) * G).
  for (int64_t r = 0; r < tile.nrows; ++r) {
    const TQ* src = p.q + (tile.row0 + r) * q_row_stride + tile.head0 * G * D;
    float* dst = qf + r * NH * G * D;
    for (int64_t i = 0; i < NH * G * D; ++i) dst[i] = ToF32(src[i]) * p.scale;
  }
  std::fill(acc, acc + M * D, 0.0f);
  std::fill(mx, mx + M, -std::numeric_limits<float>::infinity());
  std::fill(l, l + M, 0.0f);
  if (p.sinks != nullptr)  // vector (r * NH + hh) * G + gi: query head (head0 + hh) * G + gi
    StartFromSinks(p.sinks, M, [&](int64_t mi) { return tile.head0 * G + mi % (NH * G); }, mx, l);

  const TilePages pages(p.tables, g, tile, max_keys);
  const float cap = p.soft_cap;
  const float inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  for (int64_t j = first_key(0) / BS; j < pages.count; ++j) {
    const int64_t base = j * BS;
    const int64_t n = pages.Rows(j);
    const int64_t offset = pages.Offset(j);
    pages.PrefetchAhead(p.k, p.v, j, NH * PD);
    for (int64_t hh = 0; hh < NH; ++hh) {
      int64_t ks = 0, vs = 0;
      const float* kr_page = PageRows(p.k + offset + hh * PD, n, kv_row_stride, D, sc.k.data(), &ks);
      const float* vr_page = PageRows(p.v + offset + hh * PD, n, kv_row_stride, D, sc.v.data(), &vs);
      for (int64_t r = 0; r < tile.nrows; ++r) {
        const int64_t t0 = std::max<int64_t>(first_key(r) - base, 0);  // the page's keys row r sees: [t0, end)
        const int64_t nm = std::min(n, nk[r] - base) - t0;
        if (nm <= 0) continue;
        const float* kr = kr_page + t0 * ks;
        const float* vr = vr_page + t0 * vs;
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

// Quantized pages: the vector tiles only.
FERRY_CLONES void AttendTileF32I8(const Problem<float, int8_t>& p, const Tile& tile, Scratch& sc) {
  AttendTileAnyD(p, tile, sc);
}
FERRY_CLONES void AttendTileBf16I8(const Problem<uint16_t, int8_t>& p, const Tile& tile, Scratch& sc) {
  AttendTileAnyD(p, tile, sc);
}
FERRY_CLONES void AttendTileF32Fp8(const Problem<float, Fp8E4M3>& p, const Tile& tile, Scratch& sc) {
  AttendTileAnyD(p, tile, sc);
}
FERRY_CLONES void AttendTileBf16Fp8(const Problem<uint16_t, Fp8E4M3>& p, const Tile& tile, Scratch& sc) {
  AttendTileAnyD(p, tile, sc);
}

// ----------------------------------------------------------------------------- dispatch

// The x86 tiles: attention_avx512.h and attention_avx2.h (stubs there without FERRY_HAVE_X86_TILES, where
// AttentionTiles never picks them).
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
FERRY_INLINE void AttendTile(const Problem<float, int8_t>& p, const Tile& t, Scratch& sc) { AttendTileF32I8(p, t, sc); }
FERRY_INLINE void AttendTile(const Problem<uint16_t, int8_t>& p, const Tile& t, Scratch& sc) {
  AttendTileBf16I8(p, t, sc);
}
FERRY_INLINE void AttendTile(const Problem<float, Fp8E4M3>& p, const Tile& t, Scratch& sc) {
  AttendTileF32Fp8(p, t, sc);
}
FERRY_INLINE void AttendTile(const Problem<uint16_t, Fp8E4M3>& p, const Tile& t, Scratch& sc) {
  AttendTileBf16Fp8(p, t, sc);
}

// In decode, each thread starting a tile asks for the first pages of the tile it takes next (ParallelFor's
// `next`): a tile's own prefetch only covers its later pages. The AVX-512 decode tile does it itself, spread
// over its last chunks (Scratch::next_tile); the vector tiles get them at once here; the AVX2 decode tile
// asks for nothing (its pages come as runs the L2 prefetcher streams). Not in prefill, where a sequence's
// pages serve several tiles: there the requests held up more than they saved.
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
  // A problem of little work (under 2^20 multiply-adds of q and k) finishes before a woken thread would start.
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
  const bool quantized = kv == ffi::DataType::S8 || kv == ffi::DataType::F8E4M3FN;
  if (v.element_type() != kv || out.element_type() != dt ||
      !(kv == dt || quantized || (dt == ffi::DataType::F32 && kv == ffi::DataType::BF16)))
    return ffi::Error::InvalidArgument(
        "ferry paged attention: q and out share a dtype, and k/v pages have it too, are bfloat16 "
        "under float32 q, or are quantized (int8 or float8_e4m3fn)");
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
  if (kd[3] != qd[2] + (quantized ? 4 : 0))
    return ffi::Error::InvalidArgument(
        "ferry paged attention: head_dim of q and pages differ (quantized pages: head_dim + 4, the scale)");
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
  g->head_dim = qd[2];
  g->page_dim = kd[3];
  g->num_q_heads = qd[1];
  g->group = qd[1] / kd[2];
  g->table_width = td[1];
  return ffi::Error::Success();
}

template <typename TQ, typename TKV>
Problem<TQ, TKV> MakeProblem(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::Buffer<ffi::S32> tables, ffi::AnyBuffer out, const Geometry& g,
                             float scale, float soft_cap, int64_t window, const float* sinks, TileKind tiles) {
  Problem<TQ, TKV> p;
  p.q = static_cast<const TQ*>(q.untyped_data());
  p.k = static_cast<const TKV*>(k.untyped_data());
  p.v = static_cast<const TKV*>(v.untyped_data());
  p.out = static_cast<TQ*>(out.untyped_data());
  p.tables = tables.typed_data();
  p.g = g;
  p.scale = scale;
  p.soft_cap = soft_cap > 0.0f ? soft_cap : 0.0f;
  p.window = window > 0 ? window : 0;
  p.sinks = sinks;
  p.tiles = tiles;
  return p;
}

template <typename T>
void ZeroRows(T* out, int64_t row0, int64_t nrows, int64_t row_elems) {
  std::memset(out + row0 * row_elems, 0, sizeof(T) * nrows * row_elems);
}

// FERRY_NATIVE_ATTENTION_NO_GEMM_TILES=1 keeps prefill and decode on the vector-at-a-time tiles (tests). A
// sliding window runs on them too: the x86 tiles have no per-row first key.
TileKind AttentionTiles(const Geometry& g, bool decode, int64_t window) {
  if (window > 0 || g.page_dim != g.head_dim || EnvIsOne("FERRY_NATIVE_ATTENTION_NO_GEMM_TILES"))
    return TileKind::kVector;  // quantized pages (page_dim != head_dim) too
  if (UseAvx512Matmul() && g.head_dim % (decode ? 32 : 16) == 0)
    return decode ? TileKind::kDecodeAvx512 : TileKind::kPrefillAvx512;
  if (UseAvx2Matmul() && g.head_dim % 8 == 0) return decode ? TileKind::kDecodeAvx2 : TileKind::kPrefillAvx2;
  return TileKind::kVector;
}

// The tiles over the dtype pair CheckCommon accepted.
void RunAnyDtype(ffi::ThreadPool& pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                 ffi::Buffer<ffi::S32> tables, ffi::AnyBuffer out, const Geometry& g, float scale,
                 float soft_cap, int64_t window, const float* sinks, const std::vector<Tile>& tiles, bool decode) {
  const TileKind kind = AttentionTiles(g, decode, window);
  const bool q_f32 = q.element_type() == ffi::DataType::F32;
  const bool kv_f32 = k.element_type() == ffi::DataType::F32;
  if (k.element_type() == ffi::DataType::S8) {
    if (q_f32) RunTiles(pool, MakeProblem<float, int8_t>(q, k, v, tables, out, g, scale, soft_cap, window, sinks, kind), tiles, decode);
    else RunTiles(pool, MakeProblem<uint16_t, int8_t>(q, k, v, tables, out, g, scale, soft_cap, window, sinks, kind), tiles, decode);
  } else if (k.element_type() == ffi::DataType::F8E4M3FN) {
    if (q_f32) RunTiles(pool, MakeProblem<float, Fp8E4M3>(q, k, v, tables, out, g, scale, soft_cap, window, sinks, kind), tiles, decode);
    else RunTiles(pool, MakeProblem<uint16_t, Fp8E4M3>(q, k, v, tables, out, g, scale, soft_cap, window, sinks, kind), tiles, decode);
  } else if (q_f32 && kv_f32) {
    RunTiles(pool, MakeProblem<float, float>(q, k, v, tables, out, g, scale, soft_cap, window, sinks, kind), tiles, decode);
  } else if (q_f32) {
    RunTiles(pool, MakeProblem<float, uint16_t>(q, k, v, tables, out, g, scale, soft_cap, window, sinks, kind), tiles, decode);
  } else {
    RunTiles(pool, MakeProblem<uint16_t, uint16_t>(q, k, v, tables, out, g, scale, soft_cap, window, sinks, kind), tiles, decode);
  }
}

// The sinks operand: [num_q_heads] float32 attention sinks, or [0] for none (null).
ffi::Error SinksOperand(ffi::Buffer<ffi::F32> sinks, const Geometry& g, const float** out) {
  if (sinks.element_count() != 0 && static_cast<int64_t>(sinks.element_count()) != g.num_q_heads)
    return ffi::Error::InvalidArgument("ferry paged attention: sinks must be [num_q_heads] float32, or [0] (none)");
  *out = sinks.element_count() != 0 ? sinks.typed_data() : nullptr;
  return ffi::Error::Success();
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
                      ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> window,
                      ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer>& out, float scale, float soft_cap) {
  Geometry g;
  if (auto err = CheckCommon(q, k, v, tables, lens, *out, &g); err.failure()) return err;
  const float* sink_logits = nullptr;
  if (auto err = SinksOperand(sinks, g, &sink_logits); err.failure()) return err;
  if (window.element_count() != 1)
    return ffi::Error::InvalidArgument("ferry paged attention: sliding_window must be one int32");
  const int64_t w = window.typed_data()[0];
  const int64_t S = q.dimensions()[0];
  if (tables.dimensions()[0] != S)
    return ffi::Error::InvalidArgument(
        "ferry paged decode attention: q must have one row per sequence");
  std::vector<int64_t> seqs(S);
  std::iota(seqs.begin(), seqs.end(), int64_t{0});
  const std::vector<Tile> tiles = DecodeTiles(g, seqs, nullptr, lens.typed_data());
  RunAnyDtype(pool, q, k, v, tables, *out, g, scale, soft_cap, w, sink_logits, tiles, /*decode=*/true);
  return ffi::Error::Success();
}

// ----------------------------------------------------------------------------- prefill

ffi::Error PrefillBody(ffi::ThreadPool& pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> window,
                       ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::F32> sinks,
                       ffi::Result<ffi::AnyBuffer>& out, float scale, float soft_cap) {
  Geometry g;
  if (auto err = CheckCommon(q, k, v, tables, lens, *out, &g); err.failure()) return err;
  const float* sink_logits = nullptr;
  if (auto err = SinksOperand(sinks, g, &sink_logits); err.failure()) return err;
  if (window.element_count() != 1)
    return ffi::Error::InvalidArgument("ferry paged attention: sliding_window must be one int32");
  const int64_t w = window.typed_data()[0];
  const int64_t T = q.dimensions()[0];
  const int64_t S = tables.dimensions()[0];
  if (query_start_loc.dimensions().size() != 1 || query_start_loc.dimensions()[0] != S + 1)
    return ffi::Error::InvalidArgument(
        "ferry paged prefill attention: query_start_loc must have num_sequences + 1 entries");
  const int32_t* ctx = lens.typed_data();
  const int32_t* qsl = query_start_loc.typed_data();
  // Query tiles of ~32 query vectors (rows x group) share every K/V row they load; 64 for the GEMM
  // tiles, which run long chunks faster that way and short ones no slower.
  const TileKind prefill_kind = AttentionTiles(g, /*decode=*/false, w);
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
  RunAnyDtype(pool, q, k, v, tables, *out, g, scale, soft_cap, w, sink_logits, DecodeTiles(g, one_row, qsl, ctx),
              /*decode=*/true);
  RunAnyDtype(pool, q, k, v, tables, *out, g, scale, soft_cap, w, sink_logits, tiles, /*decode=*/false);
  return ffi::Error::Success();
}

// ----------------------------------------------------------------------------- GEMM tiles' lanes

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
    if (p.sinks != nullptr)  // the M real vectors; padding lanes stay empty
      StartFromSinks(p.sinks, M, [&](int64_t m) { return tile.head0 * G + m % G; }, t.mx, t.l);
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

}  // namespace
