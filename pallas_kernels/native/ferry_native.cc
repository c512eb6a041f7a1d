// Native CPU paged attention for Ferry (and the scanned layers' stacked matmul), exported as XLA
// FFI handlers:
//
//   FerryPagedDecodeAttention   q [S, Hq, D], k/v pages [NB, BS, Hkv, D], block_tables [S, W] i32,
//                               context_lens [S] i32, sliding_window [] i32, sinks [Hq] or [0] f32
//                               -> out [S, Hq, D]
//   FerryPagedPrefillAttention  q [T, Hq, D], k/v pages, block_tables, context_lens, sliding_window,
//                               query_start_loc [S + 1] i32, sinks        -> out [T, Hq, D]
//   FerryKvWrite                pages [..., NB, BS, Hkv, D], new [T, Hkv, D] (pages' dtype),
//                               slot_mapping [T] i32  -> pages with row slot_mapping[t] = new[t]
//                               (rows of the leading dims in order; aliased in place; slots outside
//                               the rows are dropped)
//   FerryStackedMatmul          x [M, K] f32 (or bf16 under bf16 w), w [L, K, N] f32 or bf16, layer [] i32,
//                               rows [] i32 -> x[:rows] @ w[layer] [M, N] f32 (rows past `rows` unwritten;
//                               w[layer] read in place, packed: see matmul.h); attribute
//                               act >= 0: act(gate) * up of its [gate | up]
//                               halves, [M, N/2] f32 or bf16 (see "gated activation" in matmul.h)
//   FerryStackedMatmulQuantized x [M, K] f32 or bf16, values [L, P, 4, KP, 16] s8 (int8, int4) or u8 (uint4),
//                               scales [L, P, 4, G, 16] f32, offsets (scales' shape, or [0]: none), layer,
//                               rows -> x[:rows] @ dequantize(w[layer]) (see "Quantized weights" in matmul.h);
//                               FerryStackedMatmul's attributes and kind (1 int8, 2 int4, 3 uint4)
//   FerryGroupedMatmul          x [M, K] (rows sorted by expert), w [L * E, ...] packed (FerryStackedMatmul's),
//                               first [] i32, group_sizes [E] i32 -> expert e's rows x[r_e : r_e + g_e] @
//                               w[first + e] (r_e = sum of g before e), rows past the groups zeros; the
//                               attributes act and groups (a mixture of experts' ragged dot)
//   FerryGroupedMatmulQuantized the same over FerryStackedMatmulQuantized's operands (values, scales, offsets)
//   FerryRmsNorm                x [M, K] f32 or bf16, w [K] (x's dtype)     -> RMSNorm(x) [M, K]
//   FerryAddRmsNorm             x [M, K], delta [M, K] (f32 or x's dtype), w [K]
//                               -> sum = x + delta (x's dtype), RMSNorm(sum) (see rms_norm.h)
//
// Attributes: scale (f32) and soft_cap (f32; 0 = no cap); sinks: attention sinks (gpt-oss) per query head, [0]
// for none (attention.h's StartFromSinks). Semantics are those of
// pallas_kernels/reference.py: a query's absolute position is context_len - query_len + its index
// in the chunk, it attends to keys at positions <= its own (and < W * BS; under a sliding window > 0, the last
// `window` of them: table entries wholly before it are never read), rows that attend to
// nothing come out as zeros, softmax runs in float32 and the output has q's dtype. float32 and
// bfloat16 are supported: q, pages and output of one dtype, or float32 q and output over bfloat16
// pages (a bf16 KV cache under a float32 model: half the cache bytes, no cast of the cache).
// Accumulation is float32.
//
// The work of a call is spread over XLA's intra-op thread pool (FFI ThreadPool context); the calling
// thread takes items too, so the call never waits on a busy pool. FERRY_NATIVE_ATTENTION_THREADS=N sets
// the number of threads (1 = serial; above the pool's, the extra ones queue: tests); the result does
// not depend on it. On x86-64 the hot loops run as hand-written AVX-512 or AVX2 tiles where the CPU has
// them, else as portable loops (GCC's vectors, with an AVX2 clone); FERRY_NATIVE_NO_AVX512=1 takes the AVX2
// code on an AVX-512 CPU (tests).
//
// This file is the library's one translation unit: it includes one header per kernel family (a unity
// build, so GCC sees, and inlines across, all of the code at once, as it would in a single file) and
// defines the FFI bindings and the two exported C functions pallas_kernels/native/library.py loads.
//   common.h            element types, bfloat16 conversion, exp/tanh, compiler macros, the FFI error guard
//   simd.h              x86 vector helpers shared by the families, and which tiles this CPU runs
//   parallel.h          ParallelFor over XLA's thread pool, ThreadsFor
//   attention.h         paged attention: problem, tiles, portable tile, validation, decode/prefill bodies
//   kv_write.h          the KV-cache row write
//   matmul.h            the stacked matmul's packed layout and problem, portable loop, gated activation
//   matmul_avx512.h     its AVX-512 panel tiles      matmul_avx2.h      its AVX2 panel tiles
//   attention_avx2.h    attention's AVX2 tiles       attention_avx512.h attention's AVX-512 tiles
//   stacked_matmul.h    the stacked matmul's work distribution and body, and the grouped (experts') one
//   rms_norm.h          RMSNorm and the residual add
// The includes' order is the order in which GCC sees the definitions, and its code can depend on it (with
// matmul_avx2.h's LeadingLanes8 ahead of attention.h, TileWork::Run compiled differently): in this order the
// library compiles to the same machine code, function by function, as the single-file source it came from.

#include "common.h"
#include "parallel.h"
#include "simd.h"
#include "attention.h"
#include "kv_write.h"
#include "matmul.h"
#include "matmul_avx512.h"
#include "matmul_avx2.h"
#include "attention_avx2.h"
#include "attention_avx512.h"
#include "stacked_matmul.h"
#include "rms_norm.h"

namespace {

// ----------------------------------------------------------------------------- the handlers' bodies

ffi::Error StackedMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> y,
                             int32_t act, int32_t groups, int32_t round_bf16) {
  return Guarded([&] { return StackedMatmulBody(pool, x, w, layer, rows, y, act, groups, round_bf16); });
}

ffi::Error StackedMatmulQuantizedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer values,
                                      ffi::AnyBuffer scales, ffi::AnyBuffer offsets, ffi::Buffer<ffi::S32> layer,
                                      ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> y, int32_t act,
                                      int32_t groups, int32_t round_bf16, int32_t kind) {
  return Guarded([&] {
    if (kind < 1 || kind > 3)
      return ffi::Error::InvalidArgument("ferry stacked matmul: kind must be 1 (int8), 2 (int4) or 3 (uint4)");
    const QuantOperands quant{scales, offsets, kind};
    return StackedMatmulBody(pool, x, values, layer, rows, y, act, groups, round_bf16, &quant);
  });
}

ffi::Error GroupedMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> first,
                             ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> y, int32_t act,
                             int32_t groups) {
  return Guarded([&] { return GroupedMatmulBody(pool, x, w, first, group_sizes, y, act, groups); });
}

ffi::Error GroupedMatmulQuantizedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer values,
                                      ffi::AnyBuffer scales, ffi::AnyBuffer offsets, ffi::Buffer<ffi::S32> first,
                                      ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> y, int32_t act,
                                      int32_t groups, int32_t kind) {
  return Guarded([&] {
    if (kind < 1 || kind > 3)
      return ffi::Error::InvalidArgument("ferry grouped matmul: kind must be 1 (int8), 2 (int4) or 3 (uint4)");
    const QuantOperands quant{scales, offsets, kind};
    return GroupedMatmulBody(pool, x, values, first, group_sizes, y, act, groups, &quant);
  });
}

ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> window,
                      ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer> out, float scale, float soft_cap) {
  return Guarded([&] { return DecodeBody(pool, q, k, v, tables, lens, window, sinks, out, scale, soft_cap); });
}

ffi::Error PrefillImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> window,
                       ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::F32> sinks,
                       ffi::Result<ffi::AnyBuffer> out, float scale, float soft_cap) {
  return Guarded([&] {
    return PrefillBody(pool, q, k, v, tables, lens, window, query_start_loc, sinks, out, scale, soft_cap);
  });
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

// ----------------------------------------------------------------------------- FFI handlers

// The handlers are extern "C" functions (XLA_FFI_DEFINE_HANDLER_SYMBOL) but not exported: the library is
// built with -fvisibility=hidden, and library.py takes their addresses from FerryFfiTargets.

// Both attention handlers' bindings: the thread pool; q, k_pages, v_pages, block_tables, context_lens,
// sliding_window, then
// `more_args` (and the sinks last); the output; the scale and soft_cap attributes. A macro rather than a helper
// function: a helper shifts GCC's file-wide inlining budget and with it the code of the
// AttendTile* kernels, while the macro leaves the library's code as it is.
#define FERRY_PAGED_ATTENTION_BINDING(more_args)                 \
  ffi::Ffi::Bind()                                               \
      .Ctx<ffi::ThreadPool>()                                    \
      .Arg<ffi::AnyBuffer>()        /* q */                      \
      .Arg<ffi::AnyBuffer>()        /* k_pages */                \
      .Arg<ffi::AnyBuffer>()        /* v_pages */                \
      .Arg<ffi::Buffer<ffi::S32>>() /* block_tables */           \
      .Arg<ffi::Buffer<ffi::S32>>() /* context_lens */           \
      .Arg<ffi::Buffer<ffi::S32>>() /* sliding_window */ more_args \
      .Ret<ffi::AnyBuffer>()        /* out */                    \
      .Attr<float>("scale")                                      \
      .Attr<float>("soft_cap")

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerryPagedDecodeAttention, DecodeImpl,
                              FERRY_PAGED_ATTENTION_BINDING(
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks
                                  ));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerryPagedPrefillAttention, PrefillImpl,
                              FERRY_PAGED_ATTENTION_BINDING(
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks
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
                                  .Arg<ffi::AnyBuffer>()  // w [L, P, 4, KP, 16E] f32 or bf16, packed
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows []: x's real rows (the rest unwritten)
                                  .Ret<ffi::AnyBuffer>()  // y [M, N] f32; gated: [M, N/2] f32 or bf16
                                  .Attr<int32_t>("act")      // -1: none; gated: 0 SiLU, 1 GELU (tanh)
                                  .Attr<int32_t>("groups")   // w's column parts, each padded to panels
                                  .Attr<int32_t>("round_bf16"));  // 1: y at bfloat16's precision

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerryStackedMatmulQuantized, StackedMatmulQuantizedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] f32 or bf16
                                  .Arg<ffi::AnyBuffer>()  // values [L, P, 4, KP, 16] s8 or u8, packed
                                  .Arg<ffi::AnyBuffer>()  // scales [L, P, 4, G, 16] f32
                                  .Arg<ffi::AnyBuffer>()  // offsets: scales' shape, or [0] (none)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows []
                                  .Ret<ffi::AnyBuffer>()  // y [M, N] f32; gated: [M, N/2] f32 or bf16
                                  .Attr<int32_t>("act")
                                  .Attr<int32_t>("groups")
                                  .Attr<int32_t>("round_bf16")
                                  .Attr<int32_t>("kind"));  // 1 int8, 2 int4, 3 uint4

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerryGroupedMatmul, GroupedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K], rows sorted by expert
                                  .Arg<ffi::AnyBuffer>()  // w [L * E, P, 4, KP, 16E] f32 or bf16, packed
                                  .Arg<ffi::Buffer<ffi::S32>>()  // first []: expert 0's stack entry
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [E]
                                  .Ret<ffi::AnyBuffer>()  // y [M, N] f32; gated: [M, N/2] f32 or bf16
                                  .Attr<int32_t>("act")
                                  .Attr<int32_t>("groups"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FerryGroupedMatmulQuantized, GroupedMatmulQuantizedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] f32 or bf16, rows sorted by expert
                                  .Arg<ffi::AnyBuffer>()  // values [L * E, P, 4, KP, 16] s8 or u8, packed
                                  .Arg<ffi::AnyBuffer>()  // scales [L * E, P, 4, G, 16] f32
                                  .Arg<ffi::AnyBuffer>()  // offsets: scales' shape, or [0] (none)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // first []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [E]
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("act")
                                  .Attr<int32_t>("groups")
                                  .Attr<int32_t>("kind"));

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

// ----------------------------------------------------------------------------- exports

// The library's face (pallas_kernels/native/library.py): the table of FFI targets it registers with XLA, and
// what it was built as. The build passes the ABI version library.py asks for, the hash of these sources and the
// jaxlib whose FFI headers it compiled against (XLA takes handlers built with older headers, not necessarily
// newer ones).
#ifndef FERRY_ABI_VERSION
#define FERRY_ABI_VERSION 0
#endif
#ifndef FERRY_SOURCE_HASH
#define FERRY_SOURCE_HASH "unknown"
#endif
#ifndef FERRY_JAXLIB_VERSION
#define FERRY_JAXLIB_VERSION "unknown"
#endif

struct FerryFfiTarget {
  const char* name;
  XLA_FFI_Handler* handler;
};

struct FerryNativeInfoRecord {
  int32_t abi_version;
  const char* source_hash;
  const char* jaxlib_version;
  int32_t panel_cols;  // the stacked matmul's packed layout (ops.py's pack_stacked)
  int32_t strip_cols;
};

// Only these two are exported (the library is built with -fvisibility=hidden).
#if defined(__GNUC__)
#pragma GCC visibility push(default)
#endif

extern "C" const FerryFfiTarget* FerryFfiTargets(int32_t* count) {
  static const FerryFfiTarget kTargets[] = {
      {"ferry_paged_decode_attention", FerryPagedDecodeAttention},
      {"ferry_paged_prefill_attention", FerryPagedPrefillAttention},
      {"ferry_kv_write", FerryKvWrite},
      {"ferry_stacked_matmul", FerryStackedMatmul},
      {"ferry_stacked_matmul_quantized", FerryStackedMatmulQuantized},
      {"ferry_grouped_matmul", FerryGroupedMatmul},
      {"ferry_grouped_matmul_quantized", FerryGroupedMatmulQuantized},
      {"ferry_rms_norm", FerryRmsNorm},
      {"ferry_add_rms_norm", FerryAddRmsNorm},
  };
  *count = static_cast<int32_t>(sizeof(kTargets) / sizeof(kTargets[0]));
  return kTargets;
}

extern "C" const FerryNativeInfoRecord* FerryNativeInfo() {
  static const FerryNativeInfoRecord kInfo = {FERRY_ABI_VERSION, FERRY_SOURCE_HASH, FERRY_JAXLIB_VERSION,
                                              static_cast<int32_t>(kPanelCols), static_cast<int32_t>(kStripCols)};
  return &kInfo;
}

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif
