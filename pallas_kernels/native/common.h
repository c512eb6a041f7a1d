// What every kernel family of the library shares: the FFI API, the compiler macros that pick code per CPU,
// the element types (float32, and bfloat16 as uint16_t bits) and their conversions, the scalar exp and tanh
// the vectorised loops use, a cache-line prefetch, the tests' environment switches, and the guard that keeps
// C++ exceptions out of XLA.
//
// ferry_native.cc is the library's one translation unit and includes this folder's headers (a unity build):
// GCC's inlining decisions depend on the whole unit, so the kernels compile as they would from a single file.
// Each header's definitions sit in the anonymous namespace, which all of them share.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
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

// The same with an AVX-512 clone too, for loops that are all element work (the gated activation's, the
// norms'): GCC's vectors of them are all there is.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && \
    !defined(FERRY_NO_TARGET_CLONES)
#define FERRY_CLONES_512 __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FERRY_CLONES_512
#endif

// The hand-written x86 tiles (AVX-512 and AVX2: simd.h, matmul_avx512.h, matmul_avx2.h, attention_avx512.h,
// attention_avx2.h) are compiled for their own targets, whatever the baseline, and picked at run time
// (UseAvx512Matmul, UseAvx2Matmul). Without FERRY_HAVE_X86_TILES (another CPU, or the legacy build's
// -DFERRY_NO_TARGET_CLONES for compilers before GCC 12) the headers leave them out, with stubs where portable
// code names them, and only the portable loops run.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(FERRY_NO_TARGET_CLONES)
#define FERRY_HAVE_X86_TILES 1
#define FERRY_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define FERRY_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define FERRY_UNROLL _Pragma("GCC unroll 8")  // unrolled before GCC decides where acc lives
#define FERRY_AVX2 __attribute__((target("avx2,fma")))
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

// ----------------------------------------------------------------------------- exp, tanh

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

// ----------------------------------------------------------------------------- helpers

// A cache line asked for (the attention tiles' pages, the matmul's next panel). An asm statement on x86-64,
// which the compiler keeps: GCC 12's dead-code elimination dropped every __builtin_prefetch from the AVX-512
// tiles (and from TileWork), so their pages were never prefetched.
FERRY_INLINE void PrefetchLine(const char* p) {
#if defined(__x86_64__) && defined(__GNUC__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p);
#endif
}

bool EnvIsOne(const char* name) {  // the tests' switches, read on every call
  const char* env = std::getenv(name);
  return env != nullptr && *env == '1';
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

}  // namespace
