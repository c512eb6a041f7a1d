// x86 vector helpers that more than one kernel family uses (masked loads and stores, bfloat16 rounding, exp on
// 16 and 8 lanes), and which of the hand-written tiles this CPU runs. Those of one family only live with it
// (matmul_avx2.h's LeadingLanes8, attention_avx2.h's Row8, ...).

#pragma once

#include "common.h"

namespace {

#ifdef FERRY_HAVE_X86_TILES

// ----------------------------------------------------------------------------- AVX-512

// 16 bfloat16 from `w` (lanes outside `m` zero), each in a 32-bit lane: low half (`shift` 0) or high half
// (16, the bits of its float32). Zero-masked forms: the plain intrinsics start from _mm512_undefined_epi32,
// which GCC 12's -Wall reports as maybe-uninitialized.
FERRY_AVX512 FERRY_INLINE __m512i LoadBf16Lanes(const uint16_t* w, __mmask16 m, unsigned shift) {
  const __m512i lanes = _mm512_maskz_cvtepu16_epi32(m, _mm256_maskz_loadu_epi16(m, w));
  return shift ? _mm512_maskz_slli_epi32(m, lanes, shift) : lanes;
}

// 16 values (weights, or the norms' rows) from `w` as float32 (lanes outside `m` zero).
FERRY_AVX512 FERRY_INLINE __m512 LoadWeights(const float* w, __mmask16 m) { return _mm512_maskz_loadu_ps(m, w); }
FERRY_AVX512 FERRY_INLINE __m512 LoadWeights(const uint16_t* w, __mmask16 m) {
  return _mm512_castsi512_ps(LoadBf16Lanes(w, m, 16));
}

// RoundedToBf16 on 16 lanes: round to nearest even at bfloat16's precision (NaN stays NaN, made quiet).
FERRY_AVX512 FERRY_INLINE __m512 RoundedToBf16x16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i sum = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  const __m512i nan = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
  const __m512i r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), sum, nan);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

FERRY_INLINE __mmask16 LeadingLanes(int64_t count) {  // the first min(count, 16) lanes
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1u);
}

// exp(x) for x in [-87, 88]: ExpInRange's reduction and polynomial, 16 lanes.
FERRY_AVX512 FERRY_INLINE __m512 Exp512InRange(__m512 x) {
  const __mmask16 all = 0xFFFF;  // zero-masked forms: see LoadBf16Lanes
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                 _mm512_set1_ps(12582912.0f)), _mm512_set1_ps(12582912.0f));
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits =
      _mm512_maskz_slli_epi32(all, _mm512_add_epi32(_mm512_maskz_cvtps_epi32(all, n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// exp(x) for x <= 0 or -inf, 16 lanes (ExpNonPositive's steps): 0 below -87.
FERRY_AVX512 FERRY_INLINE __m512 Exp512NonPositive(__m512 x) {
  const __m512 y = Exp512InRange(_mm512_maskz_max_ps(0xFFFF, x, _mm512_set1_ps(-87.0f)));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), y);
}

// 16 lanes at T's precision (the pointer only picks T), and their store into T (v already at its precision).
FERRY_AVX512 FERRY_INLINE __m512 Rounded16(__m512 v, const float*) { return v; }
FERRY_AVX512 FERRY_INLINE __m512 Rounded16(__m512 v, const uint16_t*) { return RoundedToBf16x16(v); }
FERRY_AVX512 FERRY_INLINE void Store16(float* y, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(y, m, v); }
FERRY_AVX512 FERRY_INLINE void Store16(uint16_t* y, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(y, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

// ----------------------------------------------------------------------------- AVX2

// Exp512InRange's steps on 8 lanes.
FERRY_AVX2 FERRY_INLINE __m256 Exp256InRange(__m256 x) {
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                 _mm256_set1_ps(12582912.0f)), _mm256_set1_ps(12582912.0f));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// exp(x) for x <= 0 or -inf on 8 lanes (ExpNonPositive's steps): 0 below -87.
FERRY_AVX2 FERRY_INLINE __m256 Exp256NonPositive(__m256 x) {
  const __m256 y = Exp256InRange(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)));
  return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}

// ----------------------------------------------------------------------------- which tiles run

// AVX512-BF16's dot products and conversion; FERRY_NATIVE_MATMUL_NO_BF16_DOT=1 (tests) widens bf16 x instead
// and rounds to bfloat16 by integer ops.
bool UseDpbf16Matmul() {
  if (EnvIsOne("FERRY_NATIVE_MATMUL_NO_BF16_DOT")) return false;
  return __builtin_cpu_supports("avx512bf16");
}

// FERRY_NATIVE_MATMUL_GENERIC=1 forces the portable loops, FERRY_NATIVE_NO_AVX512=1 the AVX2 ones (tests).
bool UseAvx512Matmul() {
  if (EnvIsOne("FERRY_NATIVE_MATMUL_GENERIC") || EnvIsOne("FERRY_NATIVE_NO_AVX512")) return false;
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

// The AVX2 tiles (matmul and attention) where AVX-512 is missing or switched off.
bool UseAvx2Matmul() {
  if (EnvIsOne("FERRY_NATIVE_MATMUL_GENERIC")) return false;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

#else  // no x86 tiles: the portable loops everywhere

bool UseAvx512Matmul() { return false; }
bool UseAvx2Matmul() { return false; }
bool UseDpbf16Matmul() { return false; }

#endif  // FERRY_HAVE_X86_TILES

}  // namespace
