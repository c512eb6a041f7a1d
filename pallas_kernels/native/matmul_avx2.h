// The stacked matmul's panel tiles for CPUs with AVX2 and FMA but not AVX-512 (Zen 2/3, Intel before Ice
// Lake), with the AVX2 SiLU epilogue of the gated activation.
//
// 16 ymm, so a tile takes a panel's 64 columns as four strips of 16, MR rows x 2 vectors each (12
// accumulators, 2 weight vectors and a broadcast <= 16), k in order within a strip: the AVX-512 tiles' bits.
// The portable loop (one row at a time, 8 accumulators: a load per FMA) left most of the FMA units' peak
// unused.

#pragma once

#include "matmul.h"
#include "simd.h"

#ifdef FERRY_HAVE_X86_TILES

namespace {

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
// single request's decode step was slower than the portable loop's one pass.
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

// ----------------------------------------------------------------------------- quantized panel tiles

// Weight vector v of a quantized pass's k step (8 columns: 8 bytes of a strip's row; kKind 1 int8, 2 int4,
// 3 uint4, 4-bit rows holding pairs: kHigh the odd k step's nibble), dequantized by the group's scales s[v]
// (and offsets o[v]) as float(q) * s, rounded, then + o.
template <int kKind, bool kHigh, bool kOffsets>
struct QuantWeights {
  const uint8_t* w;  // the pass's first strip's row
  int64_t strip;
  const __m256* s;
  const __m256* o;
  FERRY_AVX2 FERRY_INLINE __m256 operator()(int v) const {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + v / 2 * strip + 8 * (v % 2)));
    __m256i q;
    if constexpr (kKind == 1) {
      q = _mm256_cvtepi8_epi32(raw);
    } else {
      const __m256i bytes = _mm256_cvtepu8_epi32(raw);
      if constexpr (kKind == 2) q = _mm256_srai_epi32(_mm256_slli_epi32(bytes, kHigh ? 24 : 28), 28);
      else if constexpr (kHigh) q = _mm256_srli_epi32(bytes, 4);
      else q = _mm256_and_si256(bytes, _mm256_set1_epi32(15));
    }
    __m256 d = _mm256_mul_ps(_mm256_cvtepi32_ps(q), s[v]);
    if constexpr (kOffsets) {
      asm("" : "+x"(d));  // DequantBarrier in a register
      d = _mm256_add_ps(d, o[v]);
    }
    return d;
  }
};

// Quantized panel, float32 x: PanelTileF32Avx2's passes, each group's scales (and offsets) for the pass's
// vectors held across its k steps.
template <int MR, int kKind, bool kOffsets>
FERRY_AVX2 void PanelTileQuantAvx2(const Matmul& p, const void* panel, int64_t r0, int64_t cols, float* y,
                                   int64_t ldy, TileSpan span, PanelAhead ahead) {
  constexpr int kV = PassVectors(MR);
  const float* x_rows[MR];
  FERRY_UNROLL for (int r = 0; r < MR; ++r) x_rows[r] = p.x + (r0 + r) * p.k;
  const int64_t index = p.PanelIndex(panel), strip = p.StripBytes(), strip_scales = p.StripScales();
  for (int64_t s = 0; 8 * kV * s < cols; ++s) {
    __m256 acc[MR][kV];
    StartPass8<MR, kV>(acc, s, cols, y, ldy, span.k0 == 0);
    const uint8_t* w = static_cast<const uint8_t*>(panel) + kV / 2 * s * strip;
    const float* scales = p.PanelScales(index) + kV / 2 * s * strip_scales;
    const float* offsets = kOffsets ? p.PanelOffsets(index) + kV / 2 * s * strip_scales : nullptr;
    for (int64_t k = span.k0; k < span.k1;) {
      const int64_t gi = k / p.group, end = std::min(span.k1, (gi + 1) * p.group);
      __m256 sv[kV], ov[kV];
      FERRY_UNROLL for (int v = 0; v < kV; ++v) {
        const int64_t at = v / 2 * strip_scales + gi * kStripCols + 8 * (v % 2);
        sv[v] = _mm256_loadu_ps(scales + at);
        ov[v] = kOffsets ? _mm256_loadu_ps(offsets + at) : _mm256_setzero_ps();
      }
      if constexpr (kKind == 1) {
        for (; k < end; ++k) {
          ahead.Next();
          FmaRows8<MR, kV>(acc, x_rows, k, QuantWeights<kKind, false, kOffsets>{w + k * kStripCols, strip, sv, ov});
        }
      } else {
        for (; k < end; k += 2) {
          ahead.Next();
          const uint8_t* row = w + k / 2 * kStripCols;
          FmaRows8<MR, kV>(acc, x_rows, k, QuantWeights<kKind, false, kOffsets>{row, strip, sv, ov});
          if (k + 1 == p.k) continue;  // an odd K's last pair: its high nibble is padding
          FmaRows8<MR, kV>(acc, x_rows, k + 1, QuantWeights<kKind, true, kOffsets>{row, strip, sv, ov});
        }
        k = std::min(k, end);
      }
    }
    StorePass8<MR, kV>(p, acc, s, cols, y, ldy, span.k1 == p.k);
  }
}

// DequantFn on AVX2 (DequantBlockAvx512's): a k block of a quantized panel into float32 strips.
template <int kKind, bool kOffsets>
FERRY_AVX2 void DequantBlockAvx2(const Matmul& p, const void* panel, TileSpan span, float* out) {
  const int64_t index = p.PanelIndex(panel), strip = p.StripBytes(), strip_scales = p.StripScales();
  for (int64_t v = 0; v < kPanelStrips; ++v) {
    const uint8_t* w = static_cast<const uint8_t*>(panel) + v * strip;
    const float* scales = p.PanelScales(index) + v * strip_scales;
    const float* offsets = kOffsets ? p.PanelOffsets(index) + v * strip_scales : nullptr;
    float* o_strip = out + v * p.k * kStripCols;
    for (int64_t k = span.k0; k < span.k1;) {
      const int64_t gi = k / p.group, end = std::min(span.k1, (gi + 1) * p.group);
      __m256 sv[2], ov[2];
      FERRY_UNROLL for (int h = 0; h < 2; ++h) {
        sv[h] = _mm256_loadu_ps(scales + gi * kStripCols + 8 * h);
        ov[h] = kOffsets ? _mm256_loadu_ps(offsets + gi * kStripCols + 8 * h) : _mm256_setzero_ps();
      }
      if constexpr (kKind == 1) {
        for (; k < end; ++k) {
          const QuantWeights<kKind, false, kOffsets> q{w + k * kStripCols, strip, sv, ov};
          FERRY_UNROLL for (int h = 0; h < 2; ++h) _mm256_storeu_ps(o_strip + k * kStripCols + 8 * h, q(h));
        }
      } else {
        for (; k < end; k += 2) {
          const uint8_t* row = w + k / 2 * kStripCols;
          const QuantWeights<kKind, false, kOffsets> low{row, strip, sv, ov};
          const QuantWeights<kKind, true, kOffsets> high{row, strip, sv, ov};
          FERRY_UNROLL for (int h = 0; h < 2; ++h) _mm256_storeu_ps(o_strip + k * kStripCols + 8 * h, low(h));
          if (k + 1 < p.k)
            FERRY_UNROLL for (int h = 0; h < 2; ++h) _mm256_storeu_ps(o_strip + (k + 1) * kStripCols + 8 * h, high(h));
        }
        k = std::min(k, end);
      }
    }
  }
}

// ----------------------------------------------------------------------------- SiLU

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
// GatedRowsOf scalar, its clamps as branches, which showed in a float32 model's run once the AVX2 tiles had
// taken the matmuls' time down.
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

// The AVX2 tiles as PanelTiles, by kind: PassesOf passes over a panel's k steps, the next panel asked for from
// 3 rows on, K in blocks of 512 steps.
#define FERRY_AVX2_PASSES {PassesOf(1), PassesOf(2), PassesOf(3), PassesOf(4), PassesOf(5), PassesOf(6)}
constexpr PanelTiles kAvx2Tiles[2] = {{kPanelTilesAvx2[0], FERRY_AVX2_PASSES, &GatedRowsAvx2, 3, 512},
                                      {kPanelTilesAvx2[1], FERRY_AVX2_PASSES, &GatedRowsAvx2, 3, 512}};
// The quantized tiles, by 2 * (kind - 1) + offsets (kind 1 int8, 2 int4, 3 uint4), as the float ones.
#define FERRY_QUANT_TILES(kind, offsets)                                                                 \
  {&PanelTileQuantAvx2<1, kind, offsets>, &PanelTileQuantAvx2<2, kind, offsets>,                         \
   &PanelTileQuantAvx2<3, kind, offsets>, &PanelTileQuantAvx2<4, kind, offsets>,                         \
   &PanelTileQuantAvx2<5, kind, offsets>, &PanelTileQuantAvx2<6, kind, offsets>}
constexpr PanelTileFn kQuantPanelTilesAvx2[6][kRowBlock] = {
    FERRY_QUANT_TILES(1, false), FERRY_QUANT_TILES(1, true), FERRY_QUANT_TILES(2, false),
    FERRY_QUANT_TILES(2, true),  FERRY_QUANT_TILES(3, false), FERRY_QUANT_TILES(3, true)};
#undef FERRY_QUANT_TILES
#define FERRY_QUANT_PANEL_TILES(i, kind, offsets)                                   \
  {kQuantPanelTilesAvx2[i], FERRY_AVX2_PASSES, &GatedRowsAvx2, 3, 512, &DequantBlockAvx2<kind, offsets>, \
   kPanelTilesAvx2[0]}
constexpr PanelTiles kAvx2QuantTiles[6] = {
    FERRY_QUANT_PANEL_TILES(0, 1, false), FERRY_QUANT_PANEL_TILES(1, 1, true), FERRY_QUANT_PANEL_TILES(2, 2, false),
    FERRY_QUANT_PANEL_TILES(3, 2, true),  FERRY_QUANT_PANEL_TILES(4, 3, false), FERRY_QUANT_PANEL_TILES(5, 3, true)};
#undef FERRY_QUANT_PANEL_TILES
#undef FERRY_AVX2_PASSES

}  // namespace

#endif  // FERRY_HAVE_X86_TILES
