// The stacked matmul's AVX-512 panel tiles (float32, widened bfloat16, and AVX512-BF16's dot products), with
// the AVX-512 SiLU epilogue of the gated activation.

#pragma once

#include "matmul.h"
#include "simd.h"

#ifdef FERRY_HAVE_X86_TILES

namespace {

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
// CPU's conversion. GCC's vectors of GatedRowsOf took a sizeable share of a gated bf16 call, most of it in the
// integer roundings.
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

// ----------------------------------------------------------------------------- panel tiles

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

// ----------------------------------------------------------------------------- quantized panel tiles

// A pair's bytes (zero-extended into 32-bit lanes) -> the low (even k) or high nibble's value as float32, by
// a permute of `table` (float(value) by nibble), which reads only an index's low 4 bits: one instruction for
// the low nibble, a shift and one for the high, where widening, sign-extending and converting took three.
// (Zero-masked forms, as LoadBf16Lanes: the plain ones start from _mm512_undefined_*, which -Wall reports.)
FERRY_AVX512 FERRY_INLINE __m512 NibbleTable(int kind) {  // 2: int4 (two's complement nibbles), 3: uint4
  return kind == 2 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1)
                   : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
template <bool kHigh>
FERRY_AVX512 FERRY_INLINE __m512 Nibbles16(__m512i bytes, __m512 table) {
  const __mmask16 all = 0xFFFF;
  return _mm512_maskz_permutexvar_ps(all, kHigh ? _mm512_maskz_srli_epi32(all, bytes, 4) : bytes, table);
}

// float(q) * s (+ o) of 16 values already float32.
template <bool kOffsets>
FERRY_AVX512 FERRY_INLINE __m512 Scaled16(__m512 q, __m512 s, __m512 o) {
  __m512 d = _mm512_mul_ps(q, s);
  if constexpr (kOffsets) {
    asm("" : "+v"(d));  // DequantBarrier in a register
    d = _mm512_add_ps(d, o);
  }
  return d;
}

// 16 int8 values (int32 lanes) -> float(q) * s (+ o).
template <bool kOffsets>
FERRY_AVX512 FERRY_INLINE __m512 Dequant16(__m512i q, __m512 s, __m512 o) {
  return Scaled16<kOffsets>(_mm512_maskz_cvtepi32_ps(0xFFFF, q), s, o);
}

// Quantized panel (kKind 1 int8, 2 int4, 3 uint4; kOffsets: with offsets), float32 x: a group's 4 strips'
// scales (and offsets) in registers over its k steps; per k step (4-bit: per pair) a 16-byte line of each
// strip, widened, dequantized and summed as the float32 tile sums (FmaRows).
template <int MR, int kKind, bool kOffsets>
FERRY_AVX512 void PanelTileQuant(const Matmul& p, const void* panel, int64_t r0, int64_t cols, float* y,
                                 int64_t ldy, TileSpan span, PanelAhead ahead) {
  __m512 acc[MR][4];
  FERRY_START_TILE(acc);
  const int64_t index = p.PanelIndex(panel), strip = p.StripBytes(), strip_scales = p.StripScales();
  const uint8_t* w = static_cast<const uint8_t*>(panel);
  const float* scales = p.PanelScales(index);
  const float* offsets = p.PanelOffsets(index);
  const float* x = p.x + r0 * p.k;
  const __m512 table = NibbleTable(kKind);
  for (int64_t k = span.k0; k < span.k1;) {
    const int64_t gi = k / p.group, end = std::min(span.k1, (gi + 1) * p.group);
    __m512 s[4], o[4];
    FERRY_UNROLL for (int v = 0; v < 4; ++v) {
      s[v] = _mm512_loadu_ps(scales + v * strip_scales + gi * kStripCols);
      o[v] = kOffsets ? _mm512_loadu_ps(offsets + v * strip_scales + gi * kStripCols) : _mm512_setzero_ps();
    }
    if constexpr (kKind == 1) {
      for (; k < end; ++k) {
        ahead.Next();
        __m512 b[4];
        FERRY_UNROLL for (int v = 0; v < 4; ++v) b[v] = Dequant16<kOffsets>(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + v * strip + k * kStripCols))), s[v], o[v]);
        FmaRows<MR>(acc, x + k, p.k, b);
      }
    } else {
      for (; k < end; k += 2) {
        ahead.Next();
        __m512i bytes[4];
        __m512 b[4];
        FERRY_UNROLL for (int v = 0; v < 4; ++v) bytes[v] = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + v * strip + k / 2 * kStripCols)));
        FERRY_UNROLL for (int v = 0; v < 4; ++v) b[v] = Scaled16<kOffsets>(Nibbles16<false>(bytes[v], table), s[v], o[v]);
        FmaRows<MR>(acc, x + k, p.k, b);
        if (k + 1 == p.k) continue;  // an odd K's last pair: its high nibble is padding
        FERRY_UNROLL for (int v = 0; v < 4; ++v) b[v] = Scaled16<kOffsets>(Nibbles16<true>(bytes[v], table), s[v], o[v]);
        FmaRows<MR>(acc, x + k + 1, p.k, b);
      }
      k = std::min(k, end);  // past an odd K's last step
    }
  }
  FERRY_STORE_TILE(acc);
}

// DequantFn: the k steps `span` of a quantized panel's 4 strips dequantized into `out`'s float32 strips
// (K * 16 floats apart, a float32 panel's layout), for PanelTileF32 to sum over several row blocks.
template <int kKind, bool kOffsets>
FERRY_AVX512 void DequantBlockAvx512(const Matmul& p, const void* panel, TileSpan span, float* out) {
  const int64_t index = p.PanelIndex(panel), strip = p.StripBytes(), strip_scales = p.StripScales();
  const __m512 table = NibbleTable(kKind);
  for (int64_t v = 0; v < kPanelStrips; ++v) {
    const uint8_t* w = static_cast<const uint8_t*>(panel) + v * strip;
    const float* scales = p.PanelScales(index) + v * strip_scales;
    const float* offsets = kOffsets ? p.PanelOffsets(index) + v * strip_scales : nullptr;
    float* o_strip = out + v * p.k * kStripCols;
    for (int64_t k = span.k0; k < span.k1;) {
      const int64_t gi = k / p.group, end = std::min(span.k1, (gi + 1) * p.group);
      const __m512 s = _mm512_loadu_ps(scales + gi * kStripCols);
      const __m512 o = kOffsets ? _mm512_loadu_ps(offsets + gi * kStripCols) : _mm512_setzero_ps();
      if constexpr (kKind == 1) {
        for (; k < end; ++k)
          _mm512_storeu_ps(o_strip + k * kStripCols, Dequant16<kOffsets>(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kStripCols))), s, o));
      } else {
        for (; k < end; k += 2) {
          const __m512i bytes = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k / 2 * kStripCols)));
          _mm512_storeu_ps(o_strip + k * kStripCols, Scaled16<kOffsets>(Nibbles16<false>(bytes, table), s, o));
          if (k + 1 < p.k)
            _mm512_storeu_ps(o_strip + (k + 1) * kStripCols,
                             Scaled16<kOffsets>(Nibbles16<true>(bytes, table), s, o));
        }
        k = std::min(k, end);
      }
    }
  }
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

// [2 * (kind - 1) + offsets][rows - 1]: the quantized tiles, kind 1 int8, 2 int4, 3 uint4.
#define FERRY_QUANT_TILES(kind, offsets)                                                               \
  {&PanelTileQuant<1, kind, offsets>, &PanelTileQuant<2, kind, offsets>, &PanelTileQuant<3, kind, offsets>, \
   &PanelTileQuant<4, kind, offsets>, &PanelTileQuant<5, kind, offsets>, &PanelTileQuant<6, kind, offsets>}
constexpr PanelTileFn kQuantPanelTiles[6][kRowBlock] = {
    FERRY_QUANT_TILES(1, false), FERRY_QUANT_TILES(1, true), FERRY_QUANT_TILES(2, false),
    FERRY_QUANT_TILES(2, true),  FERRY_QUANT_TILES(3, false), FERRY_QUANT_TILES(3, true)};
#undef FERRY_QUANT_TILES

// The AVX-512 quantized tiles as PanelTiles, by 2 * (kind - 1) + offsets: as the float tiles.
// Items of several row blocks dequantize a k block once and sum it by the float32 tiles.
#define FERRY_QUANT_PANEL_TILES(i, kind, offsets) \
  {kQuantPanelTiles[i], {1, 1, 1, 1, 1, 1}, &GatedRowsAvx512, 1, 0, &DequantBlockAvx512<kind, offsets>, kPanelTiles[0]}
constexpr PanelTiles kAvx512QuantTiles[6] = {
    FERRY_QUANT_PANEL_TILES(0, 1, false), FERRY_QUANT_PANEL_TILES(1, 1, true), FERRY_QUANT_PANEL_TILES(2, 2, false),
    FERRY_QUANT_PANEL_TILES(3, 2, true),  FERRY_QUANT_PANEL_TILES(4, 3, false), FERRY_QUANT_PANEL_TILES(5, 3, true)};
#undef FERRY_QUANT_PANEL_TILES

// The AVX-512 tiles as PanelTiles, by kind: one pass over a panel's k steps, the next panel asked for at any
// row count, K in one block.
constexpr PanelTiles kAvx512Tiles[3] = {{kPanelTiles[0], {1, 1, 1, 1, 1, 1}, &GatedRowsAvx512, 1, 0},
                                        {kPanelTiles[1], {1, 1, 1, 1, 1, 1}, &GatedRowsAvx512, 1, 0},
                                        {kPanelTiles[2], {1, 1, 1, 1, 1, 1}, &GatedRowsAvx512, 1, 0}};

}  // namespace

#endif  // FERRY_HAVE_X86_TILES
