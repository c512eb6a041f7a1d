// Paged attention's tiles for CPUs with AVX2 and FMA but not AVX-512: DecodeTileAvx2 and PrefillTileAvx2 (stubs
// without FERRY_HAVE_X86_TILES, where AttentionTiles never picks them).

#pragma once

#include "attention.h"
#include "simd.h"

namespace {

#ifdef FERRY_HAVE_X86_TILES

// ----------------------------------------------------------------------------- decode

// A decode tile on AVX2 (no AVX-512): one query row, kv heads head0.. of one sequence, G query vectors each
// taken two at a time (an odd G's last one paired with itself, its twin's sums going to a spare slot). Pages
// are taken kDecodeGroupPages at a time and each is read in row order, row t of every page in turn: the
// dot products 4 keys (row t of each page) x 2 vectors at a time (8 accumulators, reduced by a hadd tree to
// a lane per key), the online softmax over the group's keys with one horizontal max and sum per vector, then
// acc += P · V over the same rows, each V row read once for both vectors of a pair. bfloat16 rows are
// widened 8 elements at a time. Four pages read in step are four runs the L2 prefetcher streams, where a page
// at a time with the next one software-prefetched was held back by the core's few L1 miss buffers (Zen 2's),
// well short of the memory's bandwidth. The AVX-512 decode tile keeps the page-at-a-time plan (untried on
// such a CPU). The vector-at-a-time tiles (GCC's vectors, a horizontal sum per key and a scalar softmax) were
// a large part of a float32 model's run once its matmuls had AVX2 tiles.
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
  if (p.sinks != nullptr)  // vector hh * G + gi: query head head0 * G + itself; the twin slot M stays empty
    StartFromSinks(p.sinks, M, [&](int64_t mi) { return tile.head0 * G + mi; }, mx, l);
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
          _mm256_storeu_ps(acc + m * D + 8 * c,
                           _mm256_mul_ps(_mm256_loadu_ps(acc + m * D + 8 * c), _mm256_set1_ps(alpha)));
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

// ----------------------------------------------------------------------------- prefill

// A prefill tile on AVX2: PrefillTileAvx512Of's two small GEMMs per chunk of keys in 8-lane vectors,
// S^T [8 keys][8 query vectors] in 8 registers, the online softmax across them (a lane per query vector),
// then acc += P · V two query vectors x 32 features at a time. K and V rows are widened into scratch 8 at a
// time (read once per tile). Where the vector-at-a-time tiles take one query vector at a time through dot
// products, this one shares each K and V row among 8 query vectors, the more so the longer the chunk.
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

#else

void PrefillTileAvx2(const Problem<float, float>&, const Tile&, Scratch&) {}
void PrefillTileAvx2(const Problem<uint16_t, uint16_t>&, const Tile&, Scratch&) {}
void PrefillTileAvx2(const Problem<float, uint16_t>&, const Tile&, Scratch&) {}
void DecodeTileAvx2(const Problem<float, float>&, const Tile&, Scratch&) {}
void DecodeTileAvx2(const Problem<uint16_t, uint16_t>&, const Tile&, Scratch&) {}
void DecodeTileAvx2(const Problem<float, uint16_t>&, const Tile&, Scratch&) {}
#endif  // FERRY_HAVE_X86_TILES

}  // namespace
