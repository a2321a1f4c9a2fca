// The instruction sets the kernels are built for, and the vector words their shared loops are written in.
//
// Paths. Every file is compiled with -march=native, so the compiler's feature macros say what this CPU has; the
// macros below name, once, which family each kind of kernel takes (README.md, "Paths"):
//   TFORMER_AVX512       AVX-512 F, BW, VL and DQ: float32 and int8 rows, attention, SiLU on 16 float32 lanes;
//   TFORMER_AVX512_BF16  ... and AVX512-BF16: bfloat16 rows by dpbf16 (32 exact products into 16 float32 lanes);
//   TFORMER_AVX512_VNNI  ... and AVX512-VNNI (with CD): one row of int8 codes summed exactly in fixed point;
//   TFORMER_AVX2         AVX2 and FMA, no TFORMER_AVX512: the same loops on 8 lanes;
//   TFORMER_AVX2_BF16    AVX2 and FMA, no TFORMER_AVX512_BF16: bfloat16 rows widened in registers;
//   neither:             plain C++ that the compiler vectorizes.
//
// Vocabulary. F32x16 (AVX-512) and F32x8 (AVX2) are the same set of static functions on float32 lanes, so that a
// loop written once as a template over them (exp_lanes, the float32 rows, attention's sums, SiLU) gives each family
// the same operations in the same order; Wide is the widest one this build has (TFORMER_SIMD where there is one).
// Only what differs by instruction set lives here: masks and tails, horizontal sums, 2^n. A loop whose algorithm
// itself differs by instruction set (dpbf16, vpdpbusd, reading int8 codes as float bits) stays in its family's file.

#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define TFORMER_AVX512 1
#if defined(__AVX512BF16__)
#define TFORMER_AVX512_BF16 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512CD__)
#define TFORMER_AVX512_VNNI 1
#endif
#endif
#if defined(__AVX2__) && defined(__FMA__)
#if !defined(TFORMER_AVX512)
#define TFORMER_AVX2 1
#endif
#if !defined(TFORMER_AVX512_BF16)
#define TFORMER_AVX2_BF16 1
#endif
#endif
#if defined(TFORMER_AVX512) || defined(TFORMER_AVX2) || defined(TFORMER_AVX2_BF16)
#include <immintrin.h>
#endif
#if defined(TFORMER_AVX512) || defined(TFORMER_AVX2)
#define TFORMER_SIMD 1
#endif

namespace tformer_kernels {

using bf16 = c10::BFloat16;

// exp(x) for x <= 0 (softmax numerators after the max is subtracted; a sigmoid's e^-|x|): x = n ln2 + r,
// |r| <= ln2/2, e^x = 2^n e^r, e^r = 1 + r + r^2 P(r). Below -87 the result is 0 or the smallest normals (only ever a
// weight that the sum makes negligible). The constants: 1 / ln 2; ln 2 in two parts (n times the first is exact;
// ln 2 = kLn2High - kLn2Low); P of degree 5 fitted to (e^r - 1 - r) / r^2 on [-ln2/2, ln2/2], from the highest degree.
constexpr float kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = 2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * kLog2e);  // round(x / ln 2)
  const float r = (x - n * kLn2High) + n * kLn2Low;  // x - n ln2
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  const float er = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n as a float32 (n >= -126 here)
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return er * two_n;
}

namespace simd {

#if defined(TFORMER_AVX512)
struct F32x16 {
  using V = __m512;
  static constexpr int kWidth = 16;
  static constexpr bool kMaskedTail = true;  // a part of a vector loads and stores under a mask, zeros past it
  static __mmask16 mask(int64_t count) {
    return count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1u);
  }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_part(const float* p, int64_t count) { return _mm512_maskz_loadu_ps(mask(count), p); }
  static V load_part(const bf16* p, int64_t count) {  // bfloat16 is the top half of a float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask(count), p)), 16));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void store_part(float* p, int64_t count, V v) { _mm512_mask_storeu_ps(p, mask(count), v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }    // a b + c
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
  static V round(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V times_pow2(V a, V n) { return _mm512_scalef_ps(a, n); }  // a 2^n, n integral
  static V neg_abs(V a) { return _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(a)); }  // -|a|
  static V zero_where_equal(V a, V b, V p) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, b, _CMP_NEQ_OQ), p); }
  static V where_nonnegative(V a, V yes, V no) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GE_OQ), no, yes);
  }
  static float sum(V a) { return _mm512_reduce_add_ps(a); }
  // The sums of a, b, c, d as one vector (one reduction tree for the four: a third of the shuffles of four).
  static __m128 sum4(V a, V b, V c, V d) {
    const V ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
    const V cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const V abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));  // a b c d
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  }
};
#endif

#if defined(TFORMER_AVX2) || defined(TFORMER_AVX2_BF16)
struct F32x8 {
  using V = __m256;
  static constexpr int kWidth = 8;
  static constexpr bool kMaskedTail = false;  // the loops of gemv take a row's last columns one by one
  static __m256i mask(int64_t count) {  // all-ones in the first min(count, 8) lanes
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(count, 8))),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load_part(const float* p, int64_t count) {
    return count >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask(count));
  }
  static V load_part(const bf16* p, int64_t count) {  // a short tail through a zeroed copy: AVX2 has no 16-bit mask
    __m128i raw;
    if (count >= 8) {
      raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    } else {
      alignas(16) uint16_t part[8] = {};
      std::memcpy(part, p, static_cast<size_t>(count) * sizeof(bf16));
      raw = _mm_load_si128(reinterpret_cast<const __m128i*>(part));
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void store_part(float* p, int64_t count, V v) {
    if (count >= 8) {
      _mm256_storeu_ps(p, v);
    } else {
      _mm256_maskstore_ps(p, mask(count), v);
    }
  }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V round(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V times_pow2(V a, V n) {  // 2^n from its exponent bits: n >= -126, a normal power of two
    return _mm256_mul_ps(a, _mm256_castsi256_ps(_mm256_slli_epi32(
                                _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)));
  }
  static V neg_abs(V a) { return _mm256_or_ps(a, _mm256_set1_ps(-0.0f)); }
  static V zero_where_equal(V a, V b, V p) { return _mm256_and_ps(_mm256_cmp_ps(a, b, _CMP_NEQ_OQ), p); }
  static V where_nonnegative(V a, V yes, V no) {
    return _mm256_blendv_ps(no, yes, _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_GE_OQ));
  }
  static float sum(V a) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
  }
  static __m128 sum4(V a, V b, V c, V d) {
    const V abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // a b c d, per 128-bit half
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
  }
};
#endif

#if defined(TFORMER_AVX512)
using Wide = F32x16;
#elif defined(TFORMER_AVX2)
using Wide = F32x8;
#endif

// exp_nonpositive on a vector's lanes: the same reduction, polynomial and constants.
template <typename L>
inline typename L::V exp_lanes(typename L::V x) {
  x = L::max(x, L::set1(-87.0f));
  const typename L::V n = L::round(L::mul(x, L::set1(kLog2e)));
  const typename L::V r = L::fmadd(n, L::set1(kLn2Low), L::fnmadd(n, L::set1(kLn2High), x));
  typename L::V p = L::set1(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = L::fmadd(p, r, L::set1(kExpPoly[i]));
  return L::times_pow2(L::add(L::fmadd(L::mul(p, r), r, r), L::set1(1.0f)), n);
}

}  // namespace simd
}  // namespace tformer_kernels
