// The AVX2 + FMA matrix-vector loops (simd.h: TFORMER_AVX2, TFORMER_AVX2_BF16), included by gemv.cpp:
//   bfloat16: 16 weights a load; the even ones become float32 by a 16-bit shift of each 32-bit word, the odd ones by
//             masking off its low half (a bfloat16 is the top half of a float32), each multiplied by x's matching
//             half, which is split into even and odd float32s once per call (split_even_odd);
//   int8 codes: read as float32 bits where exact (code_bits), else widened 8 codes an instruction;
//   at one row of x, a thread's rows are read as four streams side by side (in_streams): each load of x serves four
//   rows of W, and the loop keeps up with the memory where one row at a time does not.
// A row of a batch and the same row alone get the same bits: both loops add a row's products in one order.

#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "gemv.h"

namespace tformer_kernels::gemv {
namespace {  // gemv.cpp's alone: internal linkage, so the compiler inlines as in one file

using simd::F32x8;
constexpr int kStreams = 4;  // rows of W read side by side at one row of x

// A thread's block of rows [n0, n1) of W (`row_bytes` each, from `w`) read as S streams side by side, for one row of
// x: rows(i, h, std::integral_constant<int, S>{}) takes rows i, i + h, ..., i + (S - 1) h in one pass (h = the
// block's rows / S; i from n0 to n0 + h), each stream prefetching its own rows (prefetch_rows[kind] ahead, within the
// stream); then rows(i, h, std::integral_constant<int, 1>{}) takes each of the last (n1 - n0) % S rows alone. What
// the AVX2 loops at batch 1 share (rows_avx2_streams, rows_int8_streams); each loop loads S rows of W per load of x.
template <int S, Weights kind, typename Rows>
void in_streams(const void* w, int64_t row_bytes, int64_t n0, int64_t n1, const Rows& rows) {
  const char* block = static_cast<const char*>(w);
  const int64_t h = (n1 - n0) / S;
  for (int64_t i = n0; i < n0 + h; ++i) {
    if constexpr (S > 1) {
      for (int t = 0; t < S; ++t) {
        prefetch_ahead<kind>(block + (n0 + t * h) * row_bytes, row_bytes, n0 + t * h, n0 + (t + 1) * h, i + t * h);
      }
    }
    rows(i, h, std::integral_constant<int, S>{});
  }
  for (int64_t i = n0 + S * h; i < n1; ++i) rows(i, h, std::integral_constant<int, 1>{});
}

#if defined(TFORMER_AVX2_BF16)
// x (R rows of K) as the AVX2 loop reads it: per 16 columns, the 8 even ones then the 8 odd ones, in float32; the
// last K % 16 columns in order.
std::vector<float> split_even_odd(const bf16* x, int64_t M, int64_t K) {
  std::vector<float> xs(M * K);
  const int64_t body = K - K % 16;
  for (int64_t r = 0; r < M; ++r) {
    const bf16* xr = x + r * K;
    float* out = xs.data() + r * K;
    for (int64_t k = 0; k < body; k += 16) {
      for (int j = 0; j < 8; ++j) {
        out[k + j] = static_cast<float>(xr[k + 2 * j]);
        out[k + 8 + j] = static_cast<float>(xr[k + 2 * j + 1]);
      }
    }
    for (int64_t k = body; k < K; ++k) out[k] = static_cast<float>(xr[k]);
  }
  return xs;
}

// out[r, n] = sum_k x[r, k] w[n, k] for rows n0 <= n < n1 of W; xs is x split by split_even_odd. U blocks of 16
// weights per iteration: at one row of x, four independent FMA chains (the FMA's latency would otherwise cap the
// loop below the loads' rate).
template <int R>
void rows_avx2(const float* xs, const bf16* w, const bf16* bias, bf16* y, int64_t K, int64_t N, int64_t n0,
               int64_t n1) {
  constexpr int U = R == 1 ? 2 : 1;
  const int64_t body = K - K % 16;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t n = n0; n < n1; ++n) {
    const bf16* wr = w + n * K;
    prefetch_ahead<kBf16Weights>(reinterpret_cast<const char*>(w + n0 * K), K * 2, n0, n1, n);
    __m256 acc[R][2 * U];
    for (int r = 0; r < R; ++r) {
      for (int u = 0; u < 2 * U; ++u) acc[r][u] = _mm256_setzero_ps();
    }
    int64_t k = 0;
    const auto block = [&](int64_t at, int u) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + at));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(wv, high));
      for (int r = 0; r < R; ++r) {
        acc[r][2 * u] = _mm256_fmadd_ps(even, _mm256_loadu_ps(xs + r * K + at), acc[r][2 * u]);
        acc[r][2 * u + 1] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xs + r * K + at + 8), acc[r][2 * u + 1]);
      }
    };
    for (; k + 16 * U <= body; k += 16 * U) {
      for (int u = 0; u < U; ++u) block(k + 16 * u, u);
    }
    for (; k < body; k += 16) block(k, 0);
    const float b = bias ? static_cast<float>(bias[n]) : 0.0f;
    for (int r = 0; r < R; ++r) {
      __m256 total = acc[r][0];
      for (int u = 1; u < 2 * U; ++u) total = _mm256_add_ps(total, acc[r][u]);
      float sum = F32x8::sum(total);
      for (int64_t kk = body; kk < K; ++kk) sum += static_cast<float>(wr[kk]) * xs[r * K + kk];
      y[r * N + n] = bf16(sum + b);
    }
  }
}

// One row of x (batch 1): the thread's block of rows read as S streams side by side (in_streams), each load of x
// serving S rows of W; per row the arithmetic of rows_avx2<R> for R > 1 (two FMA chains, even and odd columns,
// added at the end), so a row of a batch and the same row alone give the same bits.
template <int S>
void rows_avx2_streams(const float* xs, const bf16* w, const bf16* bias, bf16* y, int64_t K, int64_t n0,
                       int64_t n1) {
  const int64_t body = K - K % 16;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  // rows i, i + h, ..., i + (T - 1) h (T == 1: a row alone, one of the last (n1 - n0) % S)
  in_streams<S, kBf16Weights>(w, K * 2, n0, n1, [&](int64_t i, int64_t h, auto streams) {
    constexpr int T = decltype(streams)::value;
    const bf16* wr[T];
    __m256 acc[T][2];
    for (int t = 0; t < T; ++t) {
      wr[t] = w + (i + t * h) * K;
      acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < body; k += 16) {
      const __m256 xe = _mm256_loadu_ps(xs + k), xo = _mm256_loadu_ps(xs + k + 8);
      for (int t = 0; t < T; ++t) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[t] + k));
        acc[t][0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), xe, acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, high)), xo, acc[t][1]);
      }
    }
    for (int t = 0; t < T; ++t) {
      float sum = F32x8::sum(_mm256_add_ps(acc[t][0], acc[t][1]));
      for (int64_t k = body; k < K; ++k) sum += static_cast<float>(wr[t][k]) * xs[k];
      const int64_t n = i + t * h;
      y[n] = bf16(sum + (bias ? static_cast<float>(bias[n]) : 0.0f));
    }
  });
}

struct Bf16Avx2 {
  static constexpr const char* kName = "avx2";
  static std::vector<float> prepare(const bf16* x, int64_t M, int64_t K) { return split_even_odd(x, M, K); }
  template <int R>
  static void rows(const bf16*, const float* xs, const bf16* w, const bf16* bias, bf16* y, int64_t K, int64_t N,
                   int64_t n0, int64_t n1) {
    if constexpr (R == 1) {
      rows_avx2_streams<kStreams>(xs, w, bias, y, K, n0, n1);
    } else {
      rows_avx2<R>(xs, w, bias, y, K, N, n0, n1);
    }
  }
};
#endif

#if defined(TFORMER_AVX2)
inline __m256 widen8(const int8_t* codes) {  // 8 int8 -> float32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes))));
}

// The codes' bits read as float32 (AVX2, AMD CPUs), because widening costs two instructions for 8 codes beside their
// FMA, which caps the loop below the bandwidth where the bfloat16 loop is not. Instead: a code's byte
// b = c ^ 0x80 = c + 128 (1 to 255) alone in bits 8p..8p+7 of a 32-bit word, the other bits zero, is the float
// b 2^(8p - 149): exponent field 0 or (bit 23 set) 1, both binades in steps of 2^-149, so the value is linear in b;
// byte 3 shifted down by 24 is b 2^-149. A 32-byte load, one XOR, three ANDs and a shift give 32 codes as four vectors
// of floats, no conversion, and
//   sum_k c_k x_k = 2^T sum_k b_k x'_k - 128 sum_k x_k,
// where x' is x with each 32 columns permuted (code 4j + p is byte p of word j: x'[8p + j] = x[4j + p]) and scaled
// by 2^(149 - 8p - T) (2^(149 - T) for p = 3), T = ilogb(max |x|) + 24: x' stays below 2^126, and each product (b x
// 2^-T, below 2^-15) is a normal float rounded once in its FMA, as a widened code's. But the sum is over b = c + 128
// in place of c, so the float32 error bound has |c| + 128 where the widening loop's has |c| (still far below the
// int8 rounding itself); 2^T and the correction are taken in double. The loops widen the codes instead where the bits
// would not be exact: the calling or working thread has denormals-are-zero set in MXCSR
// (torch.set_flush_denormal(True): the subnormal codes would read as 0) or x has a value that is not finite
// (inf - inf); and on other vendors' CPUs (code_bits_on). Both int8 loops (batch 1 and batches) read the bits alike,
// so a row of a batch still gets the bits it gets alone.
struct CodeBits {
  std::vector<float> xs;       // per row of x its first `body` columns, permuted and scaled
  std::vector<double> factor;  // per row: 2^T
  std::vector<double> offset;  // per row: 128 times the sum of its first `body` columns
  int64_t body = 0;            // K - K % 32: the columns read as bits; the rest one by one, as codes
  bool on = false;
};

struct CodeBitsRows {  // R rows of a CodeBits from row r0, or xs == nullptr: widen the codes
  const float* xs;
  const double* factor;
  const double* offset;
  int64_t body;
};

// Whether this CPU reads the codes as bits at all: AMD's (other vendors' cores may take microcode assists on
// subnormal operands).
inline bool code_bits_on() {
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
}

inline bool denormals_are_zero() { return (_mm_getcsr() & 0x40) != 0; }

inline CodeBitsRows code_bits_rows(const CodeBits& bits, int64_t r0) {  // on this thread, from row r0
  if (!bits.on || denormals_are_zero()) return {nullptr, nullptr, nullptr, 0};
  return {bits.xs.data() + r0 * bits.body, bits.factor.data() + r0, bits.offset.data() + r0, bits.body};
}

inline CodeBits code_bits(const float* xf, int64_t M, int64_t K) {
  CodeBits bits;
  bits.body = K - K % 32;
  if (!code_bits_on() || bits.body == 0 || denormals_are_zero()) return bits;
  bits.xs.resize(M * bits.body);
  bits.factor.resize(M);
  bits.offset.resize(M);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 inf = _mm256_set1_ps(INFINITY);
  for (int64_t r = 0; r < M; ++r) {
    const float* x = xf + r * K;
    // max |x|, whether any |x| is inf or nan, and sum x in double, 8 columns a step
    __m256 top8 = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    __m256d sum4[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()};
    for (int64_t k = 0; k < bits.body; k += 8) {
      const __m256 v = _mm256_loadu_ps(x + k), a = _mm256_and_ps(v, magnitude);
      top8 = _mm256_max_ps(top8, a);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // inf, or nan (unordered)
      sum4[0] = _mm256_add_pd(sum4[0], _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
      sum4[1] = _mm256_add_pd(sum4[1], _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
    if (_mm256_movemask_ps(bad) != 0) return bits;
    alignas(32) float tops[8];
    alignas(32) double sums[4];
    _mm256_store_ps(tops, top8);
    _mm256_store_pd(sums, _mm256_add_pd(sum4[0], sum4[1]));
    const float top = *std::max_element(tops, tops + 8);
    const double total = (sums[0] + sums[1]) + (sums[2] + sums[3]);
    const int T = (top > 0.0f ? std::ilogb(top) : 0) + 24;
    double scaled[4];  // powers of two: x times each is exact, and a float
    for (int p = 0; p < 4; ++p) scaled[p] = std::ldexp(1.0, 149 - 8 * (p % 3) - T);
    float* xs = bits.xs.data() + r * bits.body;
    for (int64_t c = 0; c < bits.body; c += 32) {
      for (int p = 0; p < 4; ++p) {
        for (int j = 0; j < 8; ++j) xs[c + 8 * p + j] = static_cast<float>(x[c + 4 * j + p] * scaled[p]);
      }
    }
    bits.factor[r] = std::ldexp(1.0, T);
    bits.offset[r] = 128.0 * total;
  }
  bits.on = true;
  return bits;
}

struct CodeQuarters {  // 32 codes as four vectors of floats b 2^(8p - 149) (byte 3: b 2^-149)
  __m256 f[4];
};

inline CodeQuarters code_quarters(const int8_t* codes) {
  const __m256i v = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)),
                                     _mm256_set1_epi8(static_cast<char>(0x80)));
  return {{_mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFF))),
           _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFF00))),
           _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFF0000))),
           _mm256_castsi256_ps(_mm256_srli_epi32(v, 24))}};
}

// One row's 32 codes into its two chains, in one order for every loop: bytes 0 and 2 into a0, 1 and 3 into a1.
inline void add_quarters(const CodeQuarters& q, const float* xs, __m256& a0, __m256& a1) {
  a0 = _mm256_fmadd_ps(q.f[0], _mm256_loadu_ps(xs), a0);
  a1 = _mm256_fmadd_ps(q.f[1], _mm256_loadu_ps(xs + 8), a1);
  a0 = _mm256_fmadd_ps(q.f[2], _mm256_loadu_ps(xs + 16), a0);
  a1 = _mm256_fmadd_ps(q.f[3], _mm256_loadu_ps(xs + 24), a1);
}

// A row's sum of products from its two chains of bits, its 2^T and offset, and its last K - body columns one by one.
inline float bits_sum(__m256 a0, __m256 a1, double factor, double offset, const int8_t* qr, const float* x,
                      int64_t body, int64_t K) {
  const double sum = static_cast<double>(F32x8::sum(_mm256_add_ps(a0, a1)));
  return plus_columns(static_cast<float>(std::fma(sum, factor, -offset)),
                      qr, x, body, K);
}

// bits_sum for 8 rows at once (one row of x), all but their last K - body columns: lane j is
// float(sum(chains[j]) 2^T - offset), F32x8::sum's additions in its order and the same fused multiply-subtract in
// double, so the same bits as bits_sum row by row, with the transposes shared: ~3 operations a row where bits_sum
// takes ~10 on one chain of dependent ones.
inline __m256 bits_sums8(const __m256 chains[8], double factor, double offset) {
  __m256 s4[4];  // rows 2i and 2i + 1: each row's v[j] + v[j + 4], as hsum8's first step
  for (int i = 0; i < 4; ++i) {
    s4[i] = _mm256_add_ps(_mm256_permute2f128_ps(chains[2 * i], chains[2 * i + 1], 0x20),
                          _mm256_permute2f128_ps(chains[2 * i], chains[2 * i + 1], 0x31));
  }
  __m256 s2[2];  // rows 4i, 4i + 2 in the low half, 4i + 1, 4i + 3 in the high: s4[0] + s4[2], s4[1] + s4[3]
  for (int i = 0; i < 2; ++i) {
    s2[i] = _mm256_add_ps(_mm256_shuffle_ps(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm256_shuffle_ps(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));  // rows 0 2 4 6 1 3 5 7
  const __m256 h = _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  const __m256d f = _mm256_set1_pd(factor), o = _mm256_set1_pd(offset);
  const __m128 lo = _mm256_cvtpd_ps(_mm256_fmsub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(h)), f, o));
  const __m128 hi = _mm256_cvtpd_ps(_mm256_fmsub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(h, 1)), f, o));
  return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}
// sum[r] = sum_k xf[r, k] qr[k] for R rows of x on AVX2, from the codes' bits: two chains a row of x, as the batch-1
// loop (rows_int8_streams) takes each of its rows.
template <int R>
void bits_dot(const CodeBitsRows& bits, const int8_t* qr, const float* xf, int64_t K, float* sum) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < bits.body; k += 32) {
    const CodeQuarters codes = code_quarters(qr + k);
    for (int r = 0; r < R; ++r) add_quarters(codes, bits.xs + r * bits.body + k, acc[r][0], acc[r][1]);
  }
  for (int r = 0; r < R; ++r) {
    sum[r] = bits_sum(acc[r][0], acc[r][1], bits.factor[r], bits.offset[r], qr, xf + r * K, bits.body, K);
  }
}

// The same from widened codes: 16 codes a block, widened 8 at a time; four independent FMA chains at one row of x,
// two above.
template <int R>
void widened_dot(const int8_t* qr, const float* xf, int64_t K, float* sum) {
  constexpr int U = R == 1 ? 2 : 1;
  __m256 acc[R][2 * U];
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < 2 * U; ++u) acc[r][u] = _mm256_setzero_ps();
  }
  const int64_t body = K - K % 16;
  const auto block = [&](int64_t at, int u) {
    const __m256 lo = widen8(qr + at), hi = widen8(qr + at + 8);
    for (int r = 0; r < R; ++r) {
      acc[r][2 * u] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xf + r * K + at), acc[r][2 * u]);
      acc[r][2 * u + 1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xf + r * K + at + 8), acc[r][2 * u + 1]);
    }
  };
  int64_t k = 0;
  for (; k + 16 * U <= body; k += 16 * U) {
    for (int u = 0; u < U; ++u) block(k + 16 * u, u);
  }
  for (; k < body; k += 16) block(k, 0);
  for (int r = 0; r < R; ++r) {
    __m256 total = acc[r][0];
    for (int u = 1; u < 2 * U; ++u) total = _mm256_add_ps(total, acc[r][u]);
    sum[r] = plus_columns(F32x8::sum(total), qr, xf + r * K, body, K);
  }
}

// One row of x (batch 1): the thread's block of rows of codes read as S streams side by side (in_streams), each
// load of x serving S rows. Per row the arithmetic of bits_dot<R> or widened_dot<R> for R > 1 (two FMA chains, added
// at the end), so a row of a batch and the same row alone give the same bits, whatever S. On the bits' path each
// stream's rows are finished 8 at a time (bits_sums8: their horizontal sums and scaling share the transposes).
template <int S, typename Out>
void rows_int8_streams(const float* xf, const CodeBitsRows& bits, const int8_t* q, Floats scale, Floats bias, Out* y,
                       int64_t K, int64_t n0, int64_t n1) {
  const int64_t body = K - K % 16;
  __m256 pending[S][8];  // the bits' path: each stream's last rows' chains, a0 + a1, not yet summed
  // rows i, i + h, ..., i + (T - 1) h (T == 1: a row alone, one of the last (n1 - n0) % S)
  in_streams<S, kInt8Weights>(q, K, n0, n1, [&](int64_t i, int64_t h, auto streams) {
    constexpr int T = decltype(streams)::value;
    const int8_t* qr[T];
    __m256 acc[T][2];
    for (int t = 0; t < T; ++t) {
      qr[t] = q + (i + t * h) * K;
      acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    }
    float sum[T];
    if (bits.xs != nullptr) {  // the codes' bits (code_bits); each row as in bits_dot
      for (int64_t k = 0; k < bits.body; k += 32) {
        for (int t = 0; t < T; ++t) add_quarters(code_quarters(qr[t] + k), bits.xs + k, acc[t][0], acc[t][1]);
      }
      if constexpr (T == S && S > 1) {  // the streams' rows: their chains kept, finished 8 rows at a time
        const int64_t j = (i - n0) % 8;
        for (int t = 0; t < T; ++t) pending[t][j] = _mm256_add_ps(acc[t][0], acc[t][1]);
        if (j == 7 || i == n0 + h - 1) {
          const int64_t first = i - j;  // of the 8 (or the block's last j + 1) rows
          for (int t = 0; t < T; ++t) {
            for (int64_t jj = j + 1; jj < 8; ++jj) pending[t][jj] = _mm256_setzero_ps();
            alignas(32) float sums[8];
            _mm256_store_ps(sums, bits_sums8(pending[t], bits.factor[0], bits.offset[0]));
            for (int64_t jj = 0; jj <= j; ++jj) {
              const int64_t n = first + jj + t * h;
              y[n] = static_cast<Out>(scaled_row(plus_columns(sums[jj], q + n * K, xf, bits.body, K), scale, bias, n));
            }
          }
        }
        return;
      }
      for (int t = 0; t < T; ++t) {
        sum[t] = bits_sum(acc[t][0], acc[t][1], bits.factor[0], bits.offset[0], qr[t], xf, bits.body, K);
      }
    } else {  // widened codes; each row as in widened_dot<R> for R > 1
      for (int64_t k = 0; k < body; k += 16) {
        const __m256 lo = _mm256_loadu_ps(xf + k), hi = _mm256_loadu_ps(xf + k + 8);
        for (int t = 0; t < T; ++t) {
          acc[t][0] = _mm256_fmadd_ps(widen8(qr[t] + k), lo, acc[t][0]);
          acc[t][1] = _mm256_fmadd_ps(widen8(qr[t] + k + 8), hi, acc[t][1]);
        }
      }
      for (int t = 0; t < T; ++t) {
        sum[t] = plus_columns(F32x8::sum(_mm256_add_ps(acc[t][0], acc[t][1])), qr[t], xf, body, K);
      }
    }
    for (int t = 0; t < T; ++t) {
      const int64_t n = i + t * h;
      y[n] = static_cast<Out>(scaled_row(sum[t], scale, bias, n));
    }
  });
}

struct Int8Avx2 {
  static std::string name() { return code_bits_on() ? "avx2_bits" : "avx2"; }
  using Prepared = CodeBits;
  static CodeBits prepare(const float* xf, int64_t M, int64_t K) { return code_bits(xf, M, K); }
  template <typename Out>
  static bool one_row(const float*, const int8_t*, Floats, Floats, Out*, int64_t, int64_t) {
    return false;
  }
  template <int R, typename Out>
  static void rows(const CodeBits& all_bits, int64_t r0, const float* xf, const int8_t* q, Floats scale, Floats bias,
                   Out* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    const CodeBitsRows bits = code_bits_rows(all_bits, r0);  // checked on this thread: its MXCSR is its own
    if constexpr (R == 1) {
      rows_int8_streams<kStreams, Out>(xf, bits, q, scale, bias, y, K, n0, n1);
    } else {
      const auto dot = [&](const int8_t* qr, float* sum) {
        if (bits.xs != nullptr) {
          bits_dot<R>(bits, qr, xf, K, sum);
        } else {
          widened_dot<R>(qr, xf, K, sum);
        }
      };
      rows_int8<R, Out>(dot, q, scale, bias, y, K, N, n0, n1);
    }
  }
};
#endif

}  // namespace
}  // namespace tformer_kernels::gemv
