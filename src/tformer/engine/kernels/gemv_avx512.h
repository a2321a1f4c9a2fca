// The AVX-512 matrix-vector loops (simd.h: TFORMER_AVX512, _BF16, _VNNI), included by gemv.cpp:
//   bfloat16 (AVX512-BF16): dpbf16 multiplies 32 bfloat16 pairs exactly and adds them into 16 float32 lanes;
//   int8 codes: 16 codes widened to float32 an instruction, four FMA chains at one row of x, two above;
//   int8 codes at one row of x (AVX512-VNNI): x written in fixed point and the codes summed in integers, exactly.
// Each family file defines the same structs (Bf16Loops, Int8Loops) that gemv.cpp's ops are written against.

#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "gemv.h"

namespace tformer_kernels::gemv {
namespace {  // gemv.cpp's alone: internal linkage, so the compiler inlines as in one file

#if defined(TFORMER_AVX512_BF16)
// out[r, n] = sum_k x[r, k] w[n, k] for rows n0 <= n < n1 of W and R rows of x.
template <int R>
void rows_avx512(const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t K, int64_t N, int64_t n0,
                 int64_t n1) {
  const int64_t tail = K % 32;
  const __mmask32 tail_mask = tail ? static_cast<__mmask32>((1u << tail) - 1u) : 0;
  for (int64_t n = n0; n < n1; ++n) {
    const bf16* wr = w + n * K;
    prefetch_ahead<kBf16Weights>(reinterpret_cast<const char*>(w + n0 * K), K * 2, n0, n1, n);
    // Two independent chains of dpbf16 per row of x (even and odd blocks of 32 columns), added at the end: one chain
    // waits on dpbf16's latency, below what the loads could deliver from cache.
    __m512 acc[R], odd[R];
    for (int r = 0; r < R; ++r) acc[r] = odd[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k), w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_dpbf16_ps(acc[r], w0, (__m512bh)_mm512_loadu_si512(x + r * K + k));
        odd[r] = _mm512_dpbf16_ps(odd[r], w1, (__m512bh)_mm512_loadu_si512(x + r * K + k + 32));
      }
    }
    for (int r = 0; r < R; ++r) acc[r] = _mm512_add_ps(acc[r], odd[r]);
    for (; k + 32 <= K; k += 32) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], wv, (__m512bh)_mm512_loadu_si512(x + r * K + k));
    }
    if (tail) {  // zeros past the end contribute nothing
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, wr + k);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_dpbf16_ps(acc[r], wv, (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, x + r * K + k));
      }
    }
    const float b = bias ? static_cast<float>(bias[n]) : 0.0f;
    for (int r = 0; r < R; ++r) y[r * N + n] = bf16(_mm512_reduce_add_ps(acc[r]) + b);
  }
}

struct Bf16Avx512 {
  static constexpr const char* kName = "avx512_bf16";
  static std::vector<float> prepare(const bf16*, int64_t, int64_t) { return {}; }  // dpbf16 reads x as it is
  template <int R>
  static void rows(const bf16* x, const float*, const bf16* w, const bf16* bias, bf16* y, int64_t K, int64_t N,
                   int64_t n0, int64_t n1) {
    rows_avx512<R>(x, w, bias, y, K, N, n0, n1);
  }
};
#endif

#if defined(TFORMER_AVX512)
inline __m512 widen(__m128i codes) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)); }  // 16 int8 -> float32

// sum[r] = sum_k xf[r, k] qr[k] for R rows of x, the codes widened: U independent chains per row of x (one chain
// would wait on the FMA's latency, below the bandwidth the loads could have).
template <int R>
void widened_dot(const int8_t* qr, const float* xf, int64_t K, float* sum) {
  constexpr int U = R == 1 ? 4 : 2;
  __m512 acc[R][U];
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U) {
    for (int u = 0; u < U; ++u) {
      const __m512 qv = widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + k + 16 * u)));
      for (int r = 0; r < R; ++r) acc[r][u] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(xf + r * K + k + 16 * u), acc[r][u]);
    }
  }
  for (; k + 16 <= K; k += 16) {
    const __m512 qv = widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + k)));
    for (int r = 0; r < R; ++r) acc[r][0] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(xf + r * K + k), acc[r][0]);
  }
  if (k < K) {  // zeros past the end contribute nothing
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
    const __m512 qv = widen(_mm_maskz_loadu_epi8(mask, qr + k));
    for (int r = 0; r < R; ++r) acc[r][0] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(mask, xf + r * K + k), acc[r][0]);
  }
  for (int r = 0; r < R; ++r) {
    for (int u = 1; u < U; ++u) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][u]);
    sum[r] = _mm512_reduce_add_ps(acc[r][0]);
  }
}
#endif

#if defined(TFORMER_AVX512_VNNI)
// One row of x (batch 1) against the codes in fixed point, with AVX512-VNNI's byte products, because widening takes
// three instructions for 16 codes where vpdpbusd adds 64 byte products in one. The row is written as integers
// X_k = x_k 2^s, exactly: s is the smallest shift that makes every x_k 2^s an integer (from the lowest set bit of each
// float); it takes P bytes a column when every |X_k| fits P balanced base-256 digits (each in [-128, 127]:
// |X_k| <= 0x7F7F...7F). A bfloat16 x has 8 significant bits, so P <= kMaxPlanes = 5 while its nonzero values span up
// to ~2^30. Each digit position is a plane of signed bytes, and
//   sum_k c_k X_k = sum_j 2^(8j) sum_k (c_k + 128) d_jk - 128 sum_k X_k,
// where c_k + 128 is the code's byte with its top bit flipped (an unsigned byte, as vpdpbusd takes it): one XOR and
// P vpdpbusd for 64 codes, each adding four byte products into 16 int32 lanes (two sets of P chains: vpdpbusd waits
// several cycles). A row's P chains are summed with 15 other rows' (lane_sums16), so that the horizontal sums do not
// cost as much as the row's loop. Nothing is rounded on the way: the int32 sums stay below 32640 K < 2^31
// (K <= kMaxFixedColumns), their combination is exact in int64, and the dot product is rounded to float32 once (then
// times 2^-s, exact unless subnormal), where the widening loop rounds at each FMA. So the result depends neither on
// the order of the additions nor on the number of threads. A row that does not fit (a value not finite, values too far
// apart, most float32 rows, more columns) takes the widening loop; so do batches (a pass of R rows costs R P vpdpbusd
// a block against 2 (2 + R) widening instructions: no gain from 2 rows on).
constexpr int kMaxPlanes = 5;
constexpr int64_t kMaxFixedColumns = 65536;

struct FixedRow {
  // For each block of 64 columns, its P planes of 64 bytes one after the other (the last block's columns past K: 0).
  std::unique_ptr<int8_t[]> planes;
  int P = 0;             // 0: the row does not fit; widen the codes
  int64_t total = 0;     // sum_k X_k
  double factor = 1.0;   // 2^-s
};

// x in fixed point, 16 and 8 columns a step. First the bits of its largest magnitude (positive floats order as their
// bits do) and the lowest set bit of its nonzero values: a float's bits (field f, mantissa m) are m' 2^(max(f, 1) -
// 150), m' = m with the hidden bit where f > 0, whose lowest set bit is that exponent plus m''s trailing zeros (31 less
// the leading zeros of m' & -m'). Then each X_k = x_k 2^s (exact in double, then an int64) and its digits, each the
// low byte read as signed: X = d + 256 X'.
inline FixedRow fixed_row(const float* x, int64_t K) {
  FixedRow row;
  if (K == 0 || K > kMaxFixedColumns) return row;  // (no columns: the widening loop's sums of nothing)
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), mantissa = _mm512_set1_epi32(0x7FFFFF);
  __m512i top = _mm512_setzero_si512(), low = _mm512_set1_epi32(INT32_MAX);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 in = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1u);
    const __m512i bits = _mm512_and_si512(_mm512_maskz_loadu_epi32(in, x + k), magnitude);
    top = _mm512_max_epu32(top, bits);
    const __m512i field = _mm512_srli_epi32(bits, 23), m = _mm512_and_si512(bits, mantissa);
    const __m512i with_hidden =
        _mm512_mask_or_epi32(m, _mm512_test_epi32_mask(field, field), m, _mm512_set1_epi32(1 << 23));
    const __m512i lowest = _mm512_and_si512(with_hidden, _mm512_sub_epi32(_mm512_setzero_si512(), with_hidden));
    const __m512i at = _mm512_sub_epi32(_mm512_max_epi32(field, _mm512_set1_epi32(1)), _mm512_lzcnt_epi32(lowest));
    low = _mm512_mask_min_epi32(low, _mm512_test_epi32_mask(with_hidden, with_hidden), low,
                                _mm512_add_epi32(at, _mm512_set1_epi32(31 - 150)));
  }
  const uint32_t top_bits = _mm512_reduce_max_epu32(top);
  const int lowest_bit = _mm512_reduce_min_epi32(low);
  if (top_bits >= 0x7F800000u) return row;  // inf or nan
  int s = 0, P = 1;
  if (lowest_bit != INT32_MAX) {  // a nonzero value
    float largest;
    std::memcpy(&largest, &top_bits, 4);
    s = -lowest_bit;
    const double X = std::ldexp(static_cast<double>(largest), s);  // the largest |X_k|, exactly
    for (double limit = 127.0; X > limit; limit = limit * 256.0 + 127.0) {
      if (++P > kMaxPlanes) return row;
    }
  }
  const int64_t blocks = (K + 63) / 64;
  row.planes.reset(new int8_t[blocks * P * 64]);
  std::memset(row.planes.get() + (blocks - 1) * P * 64, 0, P * 64);
  const __m512d scale = _mm512_set1_pd(std::ldexp(1.0, s));
  __m512i total = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 8) {
    const __mmask8 in = K - k >= 8 ? 0xFF : static_cast<__mmask8>((1u << (K - k)) - 1u);
    __m512i X = _mm512_cvtpd_epi64(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_maskz_loadu_ps(in, x + k)), scale));
    total = _mm512_add_epi64(total, X);
    for (int j = 0; j < P; ++j) {
      const __m512i d = _mm512_srai_epi64(_mm512_slli_epi64(X, 56), 56);
      _mm512_mask_cvtepi64_storeu_epi8(row.planes.get() + (k / 64 * P + j) * 64 + k % 64, in, d);
      X = _mm512_srai_epi64(_mm512_sub_epi64(X, d), 8);
    }
  }
  row.total = _mm512_reduce_add_epi64(total);
  row.factor = std::ldexp(1.0, -s);
  row.P = P;
  return row;
}

// The P int32 chains of sum_k x_k q_k for the codes `qr` and x as `row` (P planes): plane j's sum is the sum of
// out[j]'s lanes. Two sets of P chains (even and odd blocks: vpdpbusd waits 5 cycles), added lane by lane at the end
// (still below 2^31).
template <int P>
inline void fixed_chains(const FixedRow& row, const int8_t* qr, int64_t K, __m512i* out) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i even[P], odd[P];
  for (int j = 0; j < P; ++j) even[j] = odd[j] = _mm512_setzero_si512();
  const int8_t* planes = row.planes.get();
  const int64_t full = K / 64;
  int64_t b = 0;
  for (; b + 2 <= full; b += 2) {
    const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(qr + b * 64), flip);
    const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(qr + b * 64 + 64), flip);
    const int8_t* at = planes + b * P * 64;  // block b's planes, then block b + 1's
    for (int j = 0; j < P; ++j) even[j] = _mm512_dpbusd_epi32(even[j], u, _mm512_loadu_si512(at + j * 64));
    for (int j = 0; j < P; ++j) odd[j] = _mm512_dpbusd_epi32(odd[j], v, _mm512_loadu_si512(at + (P + j) * 64));
  }
  for (; b * 64 < K; ++b) {  // a last full block, then the codes past the end read as 0, times digits of 0
    const __mmask64 in = K - b * 64 >= 64 ? ~0ULL : (~0ULL) >> (64 - (K - b * 64));
    const __m512i u = _mm512_xor_si512(_mm512_maskz_loadu_epi8(in, qr + b * 64), flip);
    const int8_t* at = planes + b * P * 64;
    for (int j = 0; j < P; ++j) even[j] = _mm512_dpbusd_epi32(even[j], u, _mm512_loadu_si512(at + j * 64));
  }
  for (int j = 0; j < P; ++j) out[j] = _mm512_add_epi32(even[j], odd[j]);
}

// The planes' sums S_j of one row combined, exactly in int64, rounded to float32 once, times 2^-s.
inline float fixed_value(const FixedRow& row, int64_t S) {
  return static_cast<float>(static_cast<double>(static_cast<float>(S - 128 * row.total)) * row.factor);
}

template <int P>
float fixed_dot(const FixedRow& row, const int8_t* qr, int64_t K) {
  __m512i chains[P];
  fixed_chains<P>(row, qr, K, chains);
  int64_t S = 0;
  for (int j = P - 1; j >= 0; --j) S = S * 256 + _mm512_reduce_add_epi32(chains[j]);
  return fixed_value(row, S);
}

// 16 vectors -> one whose lane i is the sum of v[i]'s lanes: pairs interleaved and added within each 128-bit lane,
// then the 128-bit lanes (45 instructions where 16 horizontal sums take ~150).
inline __m512i lane_sums16(const __m512i* v) {
  __m512i a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    const __m512i& p = v[2 * i];
    const __m512i& q = v[2 * i + 1];
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(p, q), _mm512_unpackhi_epi32(p, q));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512i& p = a[2 * i];
    const __m512i& q = a[2 * i + 1];
    b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(p, q), _mm512_unpackhi_epi64(p, q));
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Rows [n0, n1) 16 at a time: each row's chains kept, then the 16 rows' sums of each plane in one vector, combined
// in int64 lanes (the last rows one by one).
template <int P, typename Out>
void rows_int8_fixed(const FixedRow& row, const int8_t* q, Floats scale, Floats bias, Out* y, int64_t K, int64_t n0,
                     int64_t n1) {
  int64_t n = n0;
  for (; n + 16 <= n1; n += 16) {
    __m512i chains[P][16];
    for (int i = 0; i < 16; ++i) {
      prefetch_ahead<kInt8Weights>(reinterpret_cast<const char*>(q + n0 * K), K, n0, n1, n + i);
      __m512i c[P];
      fixed_chains<P>(row, q + (n + i) * K, K, c);
      for (int j = 0; j < P; ++j) chains[j][i] = c[j];
    }
    __m512i sums[P];
    for (int j = 0; j < P; ++j) sums[j] = lane_sums16(chains[j]);
    alignas(64) int64_t S[16];
    for (int h = 0; h < 2; ++h) {
      __m512i total = _mm512_setzero_si512();
      for (int j = P - 1; j >= 0; --j) {
        const __m256i half = h == 0 ? _mm512_castsi512_si256(sums[j]) : _mm512_extracti64x4_epi64(sums[j], 1);
        total = _mm512_add_epi64(_mm512_slli_epi64(total, 8), _mm512_cvtepi32_epi64(half));
      }
      _mm512_store_si512(S + 8 * h, total);
    }
    for (int i = 0; i < 16; ++i) y[n + i] = static_cast<Out>(scaled_row(fixed_value(row, S[i]), scale, bias, n + i));
  }
  for (; n < n1; ++n) {
    prefetch_ahead<kInt8Weights>(reinterpret_cast<const char*>(q + n0 * K), K, n0, n1, n);
    y[n] = static_cast<Out>(scaled_row(fixed_dot<P>(row, q + n * K, K), scale, bias, n));
  }
}
#endif

#if defined(TFORMER_AVX512_VNNI)
// One row of x in fixed point where it fits: true when done, else the widening loop takes it.
template <typename Out>
bool fixed_point_row(const float* xf, const int8_t* q, Floats scale, Floats bias, Out* y, int64_t K, int64_t N) {
  const FixedRow row = fixed_row(xf, K);
  const auto fixed = [&](auto planes) {
    parallel_blocks(N, grain(K), [&](int64_t n0, int64_t n1) {
      rows_int8_fixed<decltype(planes)::value, Out>(row, q, scale, bias, y, K, n0, n1);
    });
    return true;
  };
  switch (row.P) {
    case 1: return fixed(std::integral_constant<int, 1>{});
    case 2: return fixed(std::integral_constant<int, 2>{});
    case 3: return fixed(std::integral_constant<int, 3>{});
    case 4: return fixed(std::integral_constant<int, 4>{});
    case 5: return fixed(std::integral_constant<int, 5>{});
    default: return false;  // the row does not fit: widen the codes
  }
}
constexpr const char* kInt8Avx512Name = "avx512_vnni";  // batch 1 in fixed point where x fits, else widened
#else
template <typename Out>
bool fixed_point_row(const float*, const int8_t*, Floats, Floats, Out*, int64_t, int64_t) {
  return false;
}
constexpr const char* kInt8Avx512Name = "avx512";
#endif

#if defined(TFORMER_AVX512)
struct Int8Avx512 {
  static std::string name() { return kInt8Avx512Name; }
  struct Prepared {};
  static Prepared prepare(const float*, int64_t, int64_t) { return {}; }
  template <typename Out>
  static bool one_row(const float* xf, const int8_t* q, Floats scale, Floats bias, Out* y, int64_t K, int64_t N) {
    return fixed_point_row(xf, q, scale, bias, y, K, N);
  }
  template <int R, typename Out>
  static void rows(const Prepared&, int64_t, const float* xf, const int8_t* q, Floats scale, Floats bias, Out* y,
                   int64_t K, int64_t N, int64_t n0, int64_t n1) {
    const auto dot = [&](const int8_t* qr, float* sum) { widened_dot<R>(qr, xf, K, sum); };
    rows_int8<R, Out>(dot, q, scale, bias, y, K, N, n0, n1);
  }
};
#endif

}  // namespace
}  // namespace tformer_kernels::gemv
