// FerryStackedMatmul's work distribution and body: work items of a panel (and a part of its rows), the x86
// tiles' row blocks, k blocks and next-panel requests (matmul_avx512.h, matmul_avx2.h), or else the portable
// loop per panel (matmul.h). Quantized panels (FerryStackedMatmulQuantized) take the same items: their own
// tiles for items of one row block (a decode step's), and for more rows each k block dequantized once and
// summed by the float32 tiles (SumPanelDequantized).

#pragma once

#include "matmul.h"
#include "matmul_avx2.h"
#include "matmul_avx512.h"
#include "parallel.h"
#include "simd.h"

namespace {

// ----------------------------------------------------------------------------- the tiles' items

#ifdef FERRY_HAVE_X86_TILES

// Rows an item takes at a time: a gated item's sums for them, 2 x 48 x 64 floats (24 KB), sit on the stack.
constexpr int64_t kGroupRows = 8 * kRowBlock;

// Hands an item's tile calls the next item's panel (null: none) in shares proportional to their k steps,
// spread evenly over those steps. (All of it in the first two row blocks came in bursts that held up the
// tiles' own loads.)
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

// k steps a quantized panel's item of several row blocks dequantizes at a time (FERRY_NATIVE_MATMUL_K_BLOCK's
// if smaller): 64 KB of float32 strips, which stay in L2 while the row blocks sum them.
constexpr int64_t kDequantKBlock = 256;

// SumPanel for a quantized panel over several row blocks: each k block dequantized once into float32 strips
// (tiles.dequant), then summed by the float32 tiles for every row block (each row's sums the bits of the
// quantized tiles', which dequantize the same way and sum alike), where the quantized tiles would dequantize
// it again for each block of rows.
void SumPanelDequantized(const Matmul& p, const PanelTiles& tiles, const void* panel, int64_t r0, int64_t rows,
                         int64_t cols, float* y, int64_t ldy, AheadPlan& ahead) {
  const RowBlocks blocks(rows);
  thread_local std::vector<float> strips;  // [4, K, 16], only the k block's rows written and read
  if (strips.size() < static_cast<size_t>(kPanelStrips * p.k * kStripCols))
    strips.resize(kPanelStrips * p.k * kStripCols);
  Matmul floats = p;  // the strips as a float32 panel's
  floats.qkind = 0;
  floats.w_bf16 = false;
  const int64_t kc = p.k_block > 0 && p.k_block < kDequantKBlock ? p.k_block : kDequantKBlock;
  const int64_t k_per_step = p.Pairs() ? 2 : 1;
  for (int64_t k0 = 0; k0 < p.k; k0 += kc) {
    const TileSpan span{k0, std::min(p.k, k0 + kc)};
    tiles.dequant(p, panel, span, strips.data());
    for (int64_t b0 = 0; b0 < rows; b0 += blocks.Height(b0)) {
      const int64_t height = blocks.Height(b0), passes = tiles.passes[height - 1];
      const PanelAhead asked = ahead.For((span.k1 - span.k0 + k_per_step - 1) / k_per_step * passes);
      tiles.float_by_rows[height - 1](floats, strips.data(), r0 + b0, cols, y + b0 * ldy, ldy, span, asked);
    }
  }
}

// Rows [r0, r0 + rows) x one panel, their sums into y (row r0 at y, rows ldy apart): each row block's
// tile over the panel's k steps p.k_block at a time, every row block taking a block of k steps before the
// next, so the panel's block stays in L2 while the rows take it (a K = 2048 float32 panel is 512 KB, all of
// Zen 2's L2; a row block's x stays in L1 across its strips either way).
void SumPanel(const Matmul& p, const PanelTiles& tiles, const void* panel, int64_t r0, int64_t rows, int64_t cols,
              float* y, int64_t ldy, AheadPlan& ahead) {
  if (tiles.dequant != nullptr && rows > kRowBlock)
    return SumPanelDequantized(p, tiles, panel, r0, rows, cols, y, ldy, ahead);
  const RowBlocks blocks(rows);
  const int64_t kc = rows > kRowBlock && p.k_block > 0 ? p.k_block : p.k, k_per_step = p.Pairs() ? 2 : 1;
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
  steps *= p.Pairs() ? (p.k + 1) / 2 : p.k;
  const int64_t lines = (p.PanelBytes() + 63) / 64;
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

// FERRY_NATIVE_MATMUL_K_BLOCK=n (tests, benchmarks) sets the tiles' k block (even, >= 2; 0: all of K).
int64_t KBlockFor(const PanelTiles& tiles) {
  const char* env = std::getenv("FERRY_NATIVE_MATMUL_K_BLOCK");
  if (env == nullptr || *env == '\0') return tiles.k_block;
  const int64_t k_block = std::atoll(env);
  return k_block <= 0 ? 0 : std::max<int64_t>(2, k_block / 2 * 2);
}

#endif  // FERRY_HAVE_X86_TILES

// ----------------------------------------------------------------------------- work and body

// The tiled paths split each panel's rows into parts so that every thread takes several items: with only a
// few panels a thread (a small model's attention output and down projections) the last item's work was left
// to one thread while the others waited. Where parts of kMinLongPartRows rows allow it, twice as many: a part
// re-reads its panel, which costs little next to that many rows' sums (at a few dozen rows it cost more than
// the split gained).
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
#ifdef FERRY_HAVE_X86_TILES
    if (w->tiles != nullptr) {
      const int64_t panel = item / w->row_parts, part = item % w->row_parts;
      const int64_t next = next_item < 0 ? -1 : next_item / w->row_parts;  // its panel: asked for meanwhile
      return MatmulItemTiled(*w->problem, *static_cast<const PanelTiles*>(w->tiles), panel, w->PartRow(part),
                             w->PartRow(part + 1), next != panel ? next : -1);
    }
#endif
    const Matmul& p = *w->problem;
    if (p.qkind != 0) MatmulPanelGenericQuant(p, item);
    else if (p.w_bf16) MatmulPanelGenericBf16(p, item);
    else MatmulPanelGenericF32(p, item);
    if (p.round_bf16)
      for (int64_t r = 0; r < p.m; ++r)
        for (int64_t c = p.PanelCol(item); c < p.PanelCol(item) + p.PanelWidth(item); ++c)
          p.y[r * p.n + c] = RoundedToBf16(p.y[r * p.n + c]);
  }
};

// The quantized operands of FerryStackedMatmulQuantized: scales and offsets (element count 0: none) of the
// packed values, and the values' kind (1 int8, 2 int4, 3 uint4).
struct QuantOperands {
  ffi::AnyBuffer scales, offsets;
  int32_t kind;
};

// A stacked matmul call's operands, checked, and what does not depend on the stack entry or the rows: `base`
// holds x and y at row 0 and the stack's entry 0 (w, scales, offsets), its m all of x's rows.
struct StackedOperands {
  Matmul base{nullptr, nullptr, nullptr, 0, 0, 0};
  int64_t entries = 0;       // L: the stack's entries
  int64_t entry_bytes = 0;   // from one entry's panels to the next
  int64_t entry_scales = 0;  // floats from one entry's scales (and offsets) to the next
  int64_t y_row_bytes = 0;   // the result's row (gated: the activation's, float32 or bfloat16)
  bool x16 = false, dpbf16 = false;
  const void* tiles = nullptr;  // MatmulWork::tiles

  // The problem of rows [r0, r0 + rows) (of x and y, or of the buffers RowBuffers put in their place) over
  // stack entry `entry`: the same call as x[r0 : r0 + rows] alone would make.
  Matmul Entry(int64_t entry, int64_t r0, int64_t rows) const {
    Matmul p = base;
    p.w = static_cast<const char*>(base.w) + entry * entry_bytes;
    if (p.scales != nullptr) p.scales += entry * entry_scales;
    if (p.offsets != nullptr) p.offsets += entry * entry_scales;
    p.x += r0 * p.k;
    if (p.x16 != nullptr) p.x16 += r0 * p.k;
    if (p.y != nullptr) p.y += r0 * p.n;
    if (p.gated_out != nullptr) p.gated_out = static_cast<char*>(p.gated_out) + r0 * y_row_bytes;
    p.m = rows;
    return p;
  }
};

ffi::Error CheckStackedOperands(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer>& y, int32_t act,
                                int32_t groups, int32_t round_bf16, const QuantOperands* quant, StackedOperands& s) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const bool gated = act >= 0;
  if (act > 1) return ffi::Error::InvalidArgument("ferry stacked matmul: act must be -1, 0 or 1");
  if (round_bf16 != 0 && (round_bf16 != 1 || gated))
    return ffi::Error::InvalidArgument("ferry stacked matmul: round_bf16 must be 0 or 1 (gated: 0)");
  if (groups < 1 || (gated && groups != 2))
    return ffi::Error::InvalidArgument("ferry stacked matmul: groups must be >= 1 (gated: 2)");
  const int qkind = quant == nullptr ? 0 : quant->kind;
  const bool bf16 = qkind == 0 && w.element_type() == ffi::DataType::BF16;
  if (quant == nullptr && !bf16 && w.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("ferry stacked matmul: w must be float32 or bfloat16");
  if (quant != nullptr &&
      !((qkind == 1 || qkind == 2) && w.element_type() == ffi::DataType::S8) &&
      !(qkind == 3 && w.element_type() == ffi::DataType::U8))
    return ffi::Error::InvalidArgument("ferry stacked matmul: quantized values must be kind 1 (int8) or 2 (int4) as "
                                       "int8, or kind 3 (uint4) as uint8");
  if (xd.size() != 2 || yd.size() != 2 || yd[0] != xd[0] || wd.size() != 5)
    return ffi::Error::InvalidArgument("ferry stacked matmul: expected x [M,K], packed w [L,P,4,KP,16E] and y [M,N] "
                                       "(gated: [M,N/2])");
  const int64_t n = gated ? 2 * yd[1] : yd[1], k = xd[1];
  const int64_t part_cols = n / groups, part_panels = (part_cols + kPanelCols - 1) / kPanelCols;
  const int64_t rows_k = qkind == 0 ? (bf16 ? (k + 1) / 2 : k) : (qkind == 1 ? k : (k + 1) / 2);
  if (n % groups != 0 || wd[1] != groups * part_panels || wd[2] != kPanelStrips || wd[3] != rows_k ||
      wd[4] != (bf16 ? 2 : 1) * kStripCols)
    return ffi::Error::InvalidArgument(
        "ferry stacked matmul: w is not x's K and y's N packed in `groups` parts (native.pack_stacked)");
  int64_t k_groups = 0;
  bool with_offsets = false;
  if (quant != nullptr) {
    auto sd = quant->scales.dimensions(), od = quant->offsets.dimensions();
    with_offsets = quant->offsets.element_count() > 0;
    const auto same_panels = [&](decltype(sd) d) {
      return d.size() == 5 && d[0] == wd[0] && d[1] == wd[1] && d[2] == wd[2] && d[4] == kStripCols;
    };
    if (quant->scales.element_type() != ffi::DataType::F32 || !same_panels(sd) || sd[3] < 1 || k % sd[3] != 0 ||
        (with_offsets && (quant->offsets.element_type() != ffi::DataType::F32 || !same_panels(od) || od[3] != sd[3])))
      return ffi::Error::InvalidArgument("ferry stacked matmul: scales (and offsets) must be float32 [L,P,4,G,16] "
                                         "with G dividing K");
    k_groups = sd[3];
    if (qkind != 1 && k_groups > 1 && (k / k_groups) % 2 != 0)
      return ffi::Error::InvalidArgument("ferry stacked matmul: 4-bit values need an even group size (or one group)");
  }
  const bool y_bf16 = y->element_type() == ffi::DataType::BF16;
  if (!(y->element_type() == ffi::DataType::F32 || (gated && y_bf16)))
    return ffi::Error::InvalidArgument("ferry stacked matmul: y must be float32 (gated: or bfloat16)");
  const bool x16 = x.element_type() == ffi::DataType::BF16;
  if (!(x.element_type() == ffi::DataType::F32 || (x16 && (bf16 || qkind != 0))))
    return ffi::Error::InvalidArgument(
        "ferry stacked matmul: x must be float32, or bfloat16 with bfloat16 or quantized w");
  if (wd[0] == 0) return ffi::Error::InvalidArgument("ferry stacked matmul: w has no layers");
  const int64_t element_bytes = qkind != 0 ? 1 : bf16 ? 2 : 4;
  s.entries = wd[0];
  s.entry_bytes = wd[1] * wd[2] * wd[3] * wd[4] * element_bytes;
  s.y_row_bytes = yd[1] * (y_bf16 ? 2 : 4);
  Matmul& p = s.base;
  // y is the sums' (gated: RowBuffers' scratch where the activation is not fused, else none)
  p = Matmul{static_cast<const float*>(x.untyped_data()), w.untyped_data(),
             gated ? nullptr : static_cast<float*>(y->untyped_data()), xd[0], k, n};
  p.w_bf16 = bf16;
  if (quant != nullptr) {
    s.entry_scales = wd[1] * wd[2] * k_groups * kStripCols;
    p.qkind = qkind;
    p.k_groups = k_groups;
    p.group = k / k_groups;
    p.scales = static_cast<const float*>(quant->scales.untyped_data());
    if (with_offsets) p.offsets = static_cast<const float*>(quant->offsets.untyped_data());
  }
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
  s.x16 = x16;
  s.dpbf16 = x16 && bf16 && avx512 && UseDpbf16Matmul();
  p.bf16_convert = avx512 && UseDpbf16Matmul();
  if (x16) p.x16 = static_cast<const uint16_t*>(x.untyped_data());
#ifdef FERRY_HAVE_X86_TILES
  const int quant_tiles = 2 * (qkind - 1) + (with_offsets ? 1 : 0);
  if (avx512) s.tiles = qkind != 0 ? &kAvx512QuantTiles[quant_tiles] : &kAvx512Tiles[s.dpbf16 ? 2 : bf16 ? 1 : 0];
  else if (UseAvx2Matmul()) s.tiles = qkind != 0 ? &kAvx2QuantTiles[quant_tiles] : &kAvx2Tiles[bf16 ? 1 : 0];
  if (s.tiles != nullptr) p.k_block = KBlockFor(*static_cast<const PanelTiles*>(s.tiles));
#endif
  return ffi::Error::Success();
}

// The buffers a call's first `rows` rows need besides x and y, put in their place in s.base: bf16 x for the
// float32 paths, widened once, exactly; gated on the paths that do not fuse it, every sum (then one pass).
struct RowBuffers {
  std::vector<float> widened, sums;
  RowBuffers(StackedOperands& s, int64_t rows) {
    Matmul& p = s.base;
    if (s.x16 && !s.dpbf16) {
      widened.resize(rows * p.k);
      for (int64_t i = 0; i < rows * p.k; ++i) widened[i] = Bf16ToF32(p.x16[i]);
      p.x = widened.data();
    }
    if (p.act >= 0 && s.tiles == nullptr) {
      sums.resize(rows * p.n);
      p.y = sums.data();
    }
  }
  // The activation of rows [0, rows) after their sums, on the paths that do not fuse it.
  void Activate(const Matmul& p, int64_t rows) const {
    if (!sums.empty()) GatedRows(p, sums.data(), sums.data() + p.n / 2, p.n, 0, rows, 0, p.n / 2);
  }
};

ffi::Error StackedMatmulBody(ffi::ThreadPool& pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer>& y,
                             int32_t act, int32_t groups, int32_t round_bf16, const QuantOperands* quant = nullptr) {
  if (layer.element_count() != 1 || rows.element_count() != 1)
    return ffi::Error::InvalidArgument("ferry stacked matmul: expected layer [] and rows []");
  StackedOperands s;
  if (auto error = CheckStackedOperands(x, w, y, act, groups, round_bf16, quant, s); error.failure()) return error;
  // Clamped like XLA's dynamic-slice clamps its start index.
  const int64_t l = std::clamp<int64_t>(*layer.typed_data(), 0, s.entries - 1);
  // Only x's first `rows` rows are computed (clamped into [0, M]): a bucketed step's padding rows are left
  // unwritten, their values never read by a real row.
  const int64_t m = std::clamp<int64_t>(*rows.typed_data(), 0, s.base.m);
  if (m == 0 || s.base.n == 0) return ffi::Error::Success();
  const RowBuffers buffers(s, m);
  const Matmul p = s.Entry(l, 0, m);
  MatmulWork work{&p, s.tiles};
  work.threads = ThreadsFor(pool, p.m * p.k * p.n, int64_t{1} << 18);
  work.row_parts = work.RowParts();
  ParallelFor(&pool, work.Items(), work.threads - 1, &work, &MatmulWork::Run);
  buffers.Activate(p, m);
  return ffi::Error::Success();
}

// ----------------------------------------------------------------------------- grouped (mixture of experts)

// A grouped call's items: every expert's with rows (its panels, or their row parts) in one ParallelFor, so a
// decode step's few rows an expert still spread over the threads. Expert e's items are
// [first_item[e], first_item[e + 1]).
struct GroupedWork {
  std::vector<Matmul> problems;  // the experts with rows, each over its rows and its stack entry
  std::vector<MatmulWork> works;
  std::vector<int64_t> first_item;
  int64_t Items() const { return first_item.back(); }
  static void Run(const void* self, int64_t item, int64_t next_item) {
    const auto* g = static_cast<const GroupedWork*>(self);
    const auto e = std::upper_bound(g->first_item.begin(), g->first_item.end(), item) - g->first_item.begin() - 1;
    const int64_t begin = g->first_item[e], end = g->first_item[e + 1];
    // The next item's panel is asked for only within the expert (MatmulItemTiled's `next` is its panel).
    MatmulWork::Run(&g->works[e], item - begin, next_item >= begin && next_item < end ? next_item - begin : -1);
  }
};

// x's rows sorted by expert, expert e's group_sizes[e] rows (negative: none) through stack entry first + e
// (first clamped into [0, L - E] like a dynamic slice of E entries); rows past the groups (or past M) zeros.
ffi::Error GroupedMatmulBody(ffi::ThreadPool& pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> first,
                             ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer>& y, int32_t act,
                             int32_t groups, const QuantOperands* quant = nullptr) {
  if (first.element_count() != 1 || group_sizes.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("ferry grouped matmul: expected first [] and group_sizes [E]");
  StackedOperands s;
  if (auto error = CheckStackedOperands(x, w, y, act, groups, 0, quant, s); error.failure()) return error;
  const int64_t experts = group_sizes.element_count(), m_all = s.base.m;
  if (experts > s.entries) return ffi::Error::InvalidArgument("ferry grouped matmul: more groups than stack entries");
  const int64_t entry0 = std::clamp<int64_t>(*first.typed_data(), 0, s.entries - experts);
  std::vector<int64_t> row0(experts + 1, 0);  // expert e's rows [row0[e], row0[e + 1]), clamped into [0, M]
  for (int64_t e = 0; e < experts; ++e)
    row0[e + 1] = std::min(m_all, row0[e] + std::max<int64_t>(0, group_sizes.typed_data()[e]));
  const int64_t m = row0[experts];
  // Rows of no group (other devices' experts, padding) are zeros: their routing weight is, and 0 * NaN is not.
  std::memset(static_cast<char*>(y->untyped_data()) + m * s.y_row_bytes, 0, (m_all - m) * s.y_row_bytes);
  if (m == 0 || s.base.n == 0) return ffi::Error::Success();
  const RowBuffers buffers(s, m);
  GroupedWork g;
  g.problems.reserve(experts);  // works point into problems
  for (int64_t e = 0; e < experts; ++e)
    if (row0[e + 1] > row0[e]) g.problems.push_back(s.Entry(entry0 + e, row0[e], row0[e + 1] - row0[e]));
  const int64_t threads = ThreadsFor(pool, m * s.base.k * s.base.n, int64_t{1} << 18);
  g.first_item.push_back(0);
  for (const Matmul& p : g.problems) {
    MatmulWork work{&p, s.tiles, threads};
    work.row_parts = work.RowParts();
    g.works.push_back(work);
    g.first_item.push_back(g.first_item.back() + work.Items());
  }
  ParallelFor(&pool, g.Items(), threads - 1, &g, &GroupedWork::Run);
  buffers.Activate(s.Entry(0, 0, m), m);
  return ffi::Error::Success();
}

}  // namespace
