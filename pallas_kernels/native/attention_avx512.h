// Paged attention's AVX-512 tiles: PrefillTileAvx512 and DecodeTileAvx512 (stubs without FERRY_HAVE_X86_TILES,
// where AttentionTiles never picks them).

#pragma once

#include "attention.h"
#include "simd.h"

namespace {

#ifdef FERRY_HAVE_X86_TILES

// ----------------------------------------------------------------------------- prefill

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
// the accumulators out through it (rep movsq), a large part of the tile's time.
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

// ----------------------------------------------------------------------------- decode

// A decode tile on AVX-512: one query row; kv heads head0.. of one sequence, G query vectors each, taken
// two at a time (an odd G's last one paired with itself, its twin's sums going to a spare slot). Per chunk
// of up to 16 keys: the 2 x 16 dot products as 16 + 16 accumulators, each reduced to one register by a
// transpose-add tree (SumTree16) and permuted to a register per query vector (lane = key). The online
// softmax takes kDecodeChunks chunks (64 keys) a step, its horizontal max and sum once per step; then
// acc += P · V, V's rows read once for both vectors. K and V rows are read in place, 32 elements at a
// time as two vectors (SplitRow): bfloat16 pairs split into their even and odd elements, exactly widened,
// so q and acc are kept in that order (the same split of each 32 features: PermuteForPages) and put back
// at the end. Where AttendTileImpl widened each page into scratch, reduced every score horizontally and
// ran the softmax in scalar code. The dot loop has no branch (with one, GCC kept its 16 sums on the stack),
// and the next keys' lines are prefetched a line per line read, spread over the work (see PrefetchLine for
// why in asm).

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
  if (p.sinks != nullptr)  // vector hh * G + gi: query head head0 * G + itself; the twin slot M stays empty
    StartFromSinks(p.sinks, M, [&](int64_t mi) { return tile.head0 * G + mi; }, mx, l);

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

void PrefillTileAvx512(const Problem<float, float>&, const Tile&, Scratch&) {}
void PrefillTileAvx512(const Problem<uint16_t, uint16_t>&, const Tile&, Scratch&) {}
void PrefillTileAvx512(const Problem<float, uint16_t>&, const Tile&, Scratch&) {}
void DecodeTileAvx512(const Problem<float, float>&, const Tile&, Scratch&) {}
void DecodeTileAvx512(const Problem<uint16_t, uint16_t>&, const Tile&, Scratch&) {}
void DecodeTileAvx512(const Problem<float, uint16_t>&, const Tile&, Scratch&) {}
#endif  // FERRY_HAVE_X86_TILES

}  // namespace
