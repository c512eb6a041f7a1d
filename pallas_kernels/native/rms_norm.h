// FerryRmsNorm and FerryAddRmsNorm: RMSNorm of rows, optionally of x plus a residual delta.
//
// A decoder layer's norms as the model's jnp RMSNorm rounds them (models/transformer.py): in float32,
// v * rsqrt(mean(v^2) + eps), then Llama's w * normed.astype(dtype) (offset 0) or Gemma's
// (normed * (offset + w)).astype(dtype). FerryAddRmsNorm first makes v = x + delta.astype(dtype) in
// x's dtype (the residual add; delta may be a matmul's float32 sums) and returns it too. XLA CPU ran
// each norm as four fusions and the add as one more, each with a fixed cost whatever its size.

#pragma once

#include "common.h"
#include "parallel.h"
#include "simd.h"

namespace {

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

#ifdef FERRY_HAVE_X86_TILES
// RmsNormRowsOf's steps 16 lanes at a time (its bits but for the order of the sum of squares): GCC's own
// vectors of it were 256 bits wide with a scalar-style rounding.
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
    const __m512 inv =
        _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(p.k) + p.eps));
    const __m512 offset = _mm512_set1_ps(p.offset);
    for (int64_t i = 0; i < p.k; i += 16) {
      const __mmask16 m = LeadingLanes(p.k - i);
      const __m512 normed = _mm512_mul_ps(LoadWeights(x + i, m), inv), wi = LoadWeights(w + i, m);
      Store16(out + i, m, Rounded16(p.offset == 0.0f ? _mm512_mul_ps(wi, Rounded16(normed, x))
                                                     : _mm512_mul_ps(normed, _mm512_add_ps(offset, wi)), x));
    }
  }
}
#endif  // FERRY_HAVE_X86_TILES

struct RmsNormWork {
  const RmsNorm* problem;
  bool bf16;
  bool avx512;  // else the portable rows (FERRY_NATIVE_MATMUL_GENERIC=1 in tests)
  static void Run(const void* self, int64_t item, int64_t) {
    const auto* w = static_cast<const RmsNormWork*>(self);
    const int64_t r0 = item * kNormRowBlock, r1 = std::min(r0 + kNormRowBlock, w->problem->m);
#ifdef FERRY_HAVE_X86_TILES
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

}  // namespace
