// The stacked matmul (FerryStackedMatmul): its packed layout and problem, the interface of the x86 panel tiles
// (matmul_avx512.h, matmul_avx2.h), the portable loop and the gated activation. The work distribution and
// the body are in stacked_matmul.h.
//
// y [M, N] = x [M, K] @ w[layer] where w is a whole stack of per-layer weights, packed once at load
// (pallas_kernels/native/ops.py, pack_stacked): the decoder layers' linears inside jax.lax.scan read their
// layer's weights in place, where XLA CPU would copy the dynamic-slice w[layer] on every step.
//
// The packed layout is panel-major, the order in which the tiles read it: w [L, P, 4, KP, 16 * E], a panel
// being 64 output columns over all of K, contiguous in memory, as 4 strips of 16 columns one after another.
//   float32 (E = 1): KP = K, strip[s][k, j] = w[k, c + 16 s + j].
//   bfloat16 (E = 2): KP = ceil(K / 2), strip[s][k2, 2 j + h] = w[2 k2 + h, c + 16 s + j] (zero past K): a
//     32-bit lane per column holding a pair of rows, as vdpbf16ps takes them.
// A tile walks each strip's k steps as one stream of whole lines (the AVX-512 tiles four streams at once),
// which the hardware prefetcher follows, where in a [KP, 64 E] panel an AVX2 tile's pass over 16 columns
// would read a line every 256 bytes.
// Quantized weights (weight-only, FerryStackedMatmulQuantized): w[k, n] = q[k, n] * scale[k / g, n] +
// offset[k / g, n], per group of g rows of K (g = K / G; G = 1: per output channel), in the same panels:
//   values int8 (kind 1): [L, P, 4, K, 16] int8, strip[s][k, j] = q[k, c + 16 s + j];
//   values int4 (kind 2, two's complement nibbles) or uint4 (kind 3): [L, P, 4, ceil(K / 2), 16] bytes,
//     strip[s][k2, j] = q[2 k2, c + 16 s + j] & 15 | q[2 k2 + 1, c + 16 s + j] << 4 (low nibble the even
//     row; zero past K): a 16-byte line per pair of k steps. g is even or G = 1, so a pair never spans groups.
//   scales (and offsets, when present) float32: [L, P, 4, G, 16], strip[s][i, j] = scale[i, c + 16 s + j].
// A tile holds a strip's group's 16 scales (and offsets) in registers and dequantizes each k step's 16
// columns as float(q) * s, rounded, then + o (a separate add, never contracted into an FMA: see
// DequantBarrier), then sums as the float32 tiles do, one FMA per term in k order: for float32 x the bits of
// the float32 path on the dequantized weights.
// The columns are `groups` equal parts of N / groups (a fused projection's, [gate | up]), each padded
// with zero columns to whole panels: Pg = ceil(N / groups / 64) panels a part, P = groups * Pg.
// The panels are packed once, at load: packed on every call, w would be read from rows N * 2 bytes apart,
// far slower than the tiles stream packed panels.
// A work item is a panel (gated: a gate panel and its up panel) over all rows (the tiled paths: over a part
// of them, MatmulWork::RowParts), kRowBlock rows at a time: the panel comes from memory once and from L2 for
// the next rows. Every path sums each column over k in order, one FMA (vdpbf16ps: one pair) per term, so a
// row's result does not depend on the batch. The tiles also ask for the thread's next item's panels, a few
// lines per k (PanelAhead), so memory streams them while this item computes.

#pragma once

#include "common.h"

namespace {

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
  // Quantized weights (qkind 1 int8, 2 int4, 3 uint4; 0: float, w_bf16 says which): the chosen layer's
  // scales and offsets (null: none) [P, 4, G, 16], g rows of K a group.
  int qkind = 0;
  const float* scales = nullptr;
  const float* offsets = nullptr;
  int64_t group = 0, k_groups = 0;  // g, G
  // Whether a packed row holds two k steps (bf16 pairs, 4-bit nibbles).
  bool Pairs() const { return w_bf16 || qkind >= 2; }
  // A strip's 32-bit lanes (float32 weights, or bf16 pairs): the tiles' step from one strip to the next.
  int64_t StripLanes() const { return (w_bf16 ? (k + 1) / 2 : k) * kStripCols; }
  int64_t StripElems() const { return StripLanes() * (w_bf16 ? 2 : 1); }
  int64_t StripBytes() const {
    if (qkind != 0) return (qkind == 1 ? k : (k + 1) / 2) * kStripCols;
    return StripElems() * (w_bf16 ? 2 : 4);
  }
  int64_t PanelBytes() const { return kPanelStrips * StripBytes(); }
  const void* Panel(int64_t p) const { return static_cast<const char*>(w) + p * PanelBytes(); }
  int64_t PanelIndex(const void* panel) const {  // Panel's inverse
    return (static_cast<const char*>(panel) - static_cast<const char*>(w)) / PanelBytes();
  }
  int64_t StripScales() const { return k_groups * kStripCols; }  // floats from one strip's scales to the next
  const float* PanelScales(int64_t p) const { return scales + p * kPanelStrips * StripScales(); }
  const float* PanelOffsets(int64_t p) const {
    return offsets == nullptr ? nullptr : offsets + p * kPanelStrips * StripScales();
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

// ----------------------------------------------------------------------------- quantized weights

// The dequantized product float(q) * s kept apart from the offset's add: C++ lets GCC contract a multiply
// and an add into an FMA (-ffp-contract=fast, its default outside ISO C, which the portable loops' FMA clone
// relies on for their sums), and the intrinsics' multiply and add are plain vector expressions to it. An
// empty asm the value passes through hides the product from the contraction; it costs no instruction.
template <typename T>
FERRY_INLINE void DequantBarrier(T& v) {
#if defined(__GNUC__)
  asm("" : "+m"(v));
#endif
}

// Quantized value j of packed row `row` of a strip (int8: one k step a row; 4-bit: the pair's low nibble
// for `high` false).
FERRY_INLINE int32_t QuantValue(int qkind, const uint8_t* row, int64_t j, bool high) {
  const uint8_t b = row[j];
  if (qkind == 1) return static_cast<int8_t>(b);
  const int32_t nibble = high ? b >> 4 : b & 15;
  return qkind == 2 ? (nibble ^ 8) - 8 : nibble;  // int4: sign-extended
}

// Portable: a quantized panel's sums for every row into y, k_chunk steps of the panel dequantized at a time
// (float(q) * s, then + o: DequantBarrier), then summed over k in order as MatmulPanelGenericOf sums the
// float32 panel (the same statement, so the FMA clone contracts it alike).
FERRY_CLONES void MatmulPanelGenericQuant(const Matmul& p, int64_t panel) {
  constexpr int64_t kChunk = 64;
  const int64_t c0 = p.PanelCol(panel), cols = p.PanelWidth(panel);
  const uint8_t* values = static_cast<const uint8_t*>(p.Panel(panel));
  const float* scales = p.PanelScales(panel);
  const float* offsets = p.PanelOffsets(panel);
  const int64_t strip = p.StripBytes(), strip_scales = p.StripScales();
  float deq[kChunk][kPanelCols];
  std::vector<float> acc(p.m * kPanelCols, 0.0f);
  for (int64_t k0 = 0; k0 < p.k; k0 += kChunk) {
    const int64_t k1 = std::min(p.k, k0 + kChunk);
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t gi = k / p.group;
      for (int64_t s = 0; s < kPanelStrips; ++s) {
        const uint8_t* row = values + s * strip + (p.qkind == 1 ? k : k / 2) * kStripCols;
        const float* sc = scales + s * strip_scales + gi * kStripCols;
        float d[kStripCols];
        for (int64_t j = 0; j < kStripCols; ++j) d[j] = static_cast<float>(QuantValue(p.qkind, row, j, k & 1)) * sc[j];
        if (offsets != nullptr) {
          DequantBarrier(d);
          const float* of = offsets + s * strip_scales + gi * kStripCols;
          for (int64_t j = 0; j < kStripCols; ++j) d[j] += of[j];
        }
        std::copy(d, d + kStripCols, deq[k - k0] + s * kStripCols);
      }
    }
    for (int64_t r = 0; r < p.m; ++r) {
      float* __restrict sums = acc.data() + r * kPanelCols;
      const float* xr = p.x + r * p.k;
      for (int64_t k = k0; k < k1; ++k) {
        const float a = xr[k];
        const float* __restrict wk = deq[k - k0];
        for (int64_t j = 0; j < kPanelCols; ++j) sums[j] += a * wk[j];
      }
    }
  }
  for (int64_t r = 0; r < p.m; ++r) std::copy(acc.data() + r * kPanelCols, acc.data() + r * kPanelCols + cols,
                                              p.y + r * p.n + c0);
}

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

// ----------------------------------------------------------------------------- the x86 tiles' interface

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

// A CPU's panel tiles: by row count, the passes each makes over a panel's k steps, and its gated epilogue.
using GatedRowsFn = void (*)(const Matmul&, const float* gate, const float* up, int64_t ld, int64_t r0,
                             int64_t rows, int64_t n0, int64_t cols);
// Quantized tiles: the k steps `span` of a quantized panel dequantized into float32 strips at `out` (K * 16
// floats apart: a float32 panel's layout).
using DequantFn = void (*)(const Matmul&, const void* panel, TileSpan span, float* out);
struct PanelTiles {
  const PanelTileFn* by_rows;  // [kRowBlock]: tile for rows - 1
  int passes[kRowBlock];       // passes over the panel's k steps a tile of rows - 1 makes
  GatedRowsFn gated_rows;
  // Batches of fewer rows do not ask for the next panel: AVX2's one- and two-row tiles stream the panel
  // in one or two passes, which the hardware prefetcher follows, and asking as well only slowed them; from 4
  // rows on it pays.
  int64_t ahead_from_rows;
  int64_t k_block;  // k steps each row block sums before the next block of k (SumPanel); 0: all of K
  // Quantized tiles: an item of several row blocks dequantizes each k block of its panel once, into
  // float32 strips the float32 tiles `float_by_rows` then sum for every row block (SumPanelDequantized);
  // the quantized tiles, which dequantize per row block, take items of one. Null for the float tiles.
  DequantFn dequant = nullptr;
  const PanelTileFn* float_by_rows = nullptr;
};

}  // namespace
