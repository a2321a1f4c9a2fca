// tformer's bfloat16 matrix-vector kernel for decoding on the CPU: y (M, N) = x (M, K) W (N, K)^T (+ b (N,)).
//
// A decode step reads every weight once for one token (M = 1, or a few sequences), so its matmuls are bound by the
// bytes of W, not by arithmetic. The kernel streams W row by row, exactly once per call for up to kRowsPerPass rows
// of x: each thread takes a contiguous block of W's rows (tformer_kernels::parallel_blocks, torch's own OpenMP pool),
// optionally prefetches a few rows ahead into L2, and keeps one float32 accumulator per row of x. The sum is rounded to
// bfloat16 once, after the bias: what F.linear computes, up to the order of the float32 additions.
//
// Three paths, chosen when the file is compiled (-march=native, on the machine that runs it):
//   AVX512-BF16: _mm512_dpbf16_ps multiplies 32 bfloat16 pairs exactly and adds them into 16 float32 lanes;
//   AVX2 + FMA:  16 weights a load; the even ones become float32 by a 16-bit shift of each 32-bit word, the odd
//                ones by masking off its low half (a bfloat16 is the top half of a float32), each multiplied by x's
//                matching half, which is split into even and odd float32s once per call;
//   portable:    bfloat16 -> float32 is a 16-bit shift; 16 independent lanes per row that compilers vectorize.
//
// The same streaming for weight-only int8 (tformer.quantize): y = (x Q^T) * s (+ b) with int8 codes Q (N, K) and one
// float scale per row, x bfloat16 or float32: one byte per weight read, converted to float32 in registers (AVX-512:
// 16 codes an instruction; AVX2: 8), or with AVX512-VNNI at one row of x, not converted: x written in fixed point
// and the codes summed in integers, exactly (fixed_row, rows_int8_fixed).
//
// And float32 (tformer.engine.kernels.uses_kernel: decode steps, where F.linear's float32 GEMM is MKL's, which on some CPUs
// streams a single row at a third of the bandwidth): 16 (AVX-512) or 8 (AVX2) lanes of FMA, several independent
// chains per row.
//
// A matrix smaller than 2 * kBytesPerThread runs on the calling thread: waking a second one costs about what it
// saves there.
//
// Built on first use by tformer/kernels/__init__.py (torch.utils.cpp_extension); the ops are tformer::gemv_bf16,
// tformer::gemv_int8 and tformer::gemv_f32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define TFORMER_AVX512_BF16 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TFORMER_AVX512_INT8 1
#define TFORMER_AVX512_F32 1  // the float32 rows need what the int8 rows do: FMAs on float32 lanes
#endif
#if defined(TFORMER_AVX512_INT8) && defined(__AVX512VNNI__) && defined(__AVX512DQ__) && defined(__AVX512CD__) && \
    !defined(TFORMER_INT8_WIDEN)
#define TFORMER_AVX512_VNNI 1  // int8 codes against x in fixed point (fixed_row, rows_int8_fixed)
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#if !defined(TFORMER_AVX512_BF16)
#define TFORMER_AVX2_BF16 1
#endif
#if !defined(TFORMER_AVX512_INT8)
#define TFORMER_AVX2_INT8 1
#define TFORMER_AVX2_F32 1
#endif
#endif

namespace {

using tformer_kernels::bf16;
using tformer_kernels::Floats;
constexpr int kRowsPerPass = 4;      // rows of x sharing one read of W (one accumulator each)
// The software prefetch: each thread requests the row `prefetch_rows` rows ahead of the one it reads (0: none, the
// hardware's prefetchers alone), into the cache __builtin_prefetch's locality names (TFORMER_PREFETCH_HINT; 1: L2,
// prefetcht2; 3: L1, prefetcht0; a compile-time knob, TFORMER_KERNEL_CFLAGS="-DTFORMER_PREFETCH_HINT=3"). The distance
// is set at run time, one for each kind of weights: bfloat16, float32, int8 codes (tformer.engine.kernels.prefetch_rows, which
// picks them per CPU), so that one process can compare settings burst by burst (benchmarks/decode_step.py). What was
// measured, compiled SmolLM2 steps in paired bursts, the weights in one huge-page-backed block (tformer.engine.memory): on AMD
// CPUs only the AVX-512 int8 loop, which widens each code and reads one row at a time, needs the prefetch (AVX2's, four
// streams at batch 1, read at 0.737 of its bound without and 0.655 with 8 rows ahead on a Zen 3). On an AMD EPYC Zen 4
// (dpbf16) a bfloat16 step took 0.85-0.92 of the time without a software prefetch as with 8 rows ahead into L2
// (0.92-0.98 with each matrix its own allocation); on a Zen 3 (AVX2, batch 1 read as two streams: rows_avx2_streams<2>)
// a bfloat16 step read at 0.766 of its bound without against 0.699 with 8 rows ahead (medians of five alternated
// processes; one stream had gained a little from it: 0.976 of the time), and float32 took 1.105-1.136 of the time with
// them (two runs; no conversion); an int8 step took 0.89 of the time with 8 rows as without on a Zen 4 (its loop widens
// codes, and the hardware prefetchers fall behind). Earlier, 8 rows into L2 beat 8 rows into L1 there (0.62 against
// 0.49 of the bound); on an Intel Xeon, no prefetch was 10-20% slower than 8 rows into L1 (each matrix its own
// allocation; BENCHMARKS.md).
#ifndef TFORMER_PREFETCH_HINT
#define TFORMER_PREFETCH_HINT 1
#endif
enum Weights { kBf16Weights = 0, kF32Weights = 1, kInt8Weights = 2 };  // gemv_prefetch's `weights`
std::atomic<int64_t> prefetch_rows[3] = {8, 8, 8};
constexpr int64_t kGrain = 16;        // fewest rows of W per thread
constexpr int64_t kBytesPerThread = 1 << 18;  // fewest bytes of W per thread: below, waking a thread costs more

// The grain of parallel_blocks over N rows of `row_bytes`: a matrix of at most kBytesPerThread bytes runs on the
// calling thread (the demo model's 64-256 KB float32 matrices: a second thread woken for one of them costs
// more than it saves, 5.5 against 3.6 us at 196 KB on an AMD EPYC).
inline int64_t grain(int64_t row_bytes) {
  return std::max<int64_t>(kGrain, (kBytesPerThread + row_bytes - 1) / std::max<int64_t>(row_bytes, 1));
}

// The N rows of W split over torch's threads, each block of rows [n0, n1) read once per pass of up to kRowsPerPass
// rows of x: body(n0, n1, r0, std::integral_constant<int, R>{}) for the R rows of x from r0.
template <typename Body>
void over_rows(int64_t M, int64_t N, int64_t row_bytes, const Body& body) {
  tformer_kernels::parallel_blocks(N, grain(row_bytes), [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < M; r0 += kRowsPerPass) {
      switch (std::min<int64_t>(kRowsPerPass, M - r0)) {
        case 1: body(n0, n1, r0, std::integral_constant<int, 1>{}); break;
        case 2: body(n0, n1, r0, std::integral_constant<int, 2>{}); break;
        case 3: body(n0, n1, r0, std::integral_constant<int, 3>{}); break;
        default: body(n0, n1, r0, std::integral_constant<int, 4>{}); break;
      }
    }
  });
}

// What gemv_bf16 and gemv_f32 share: the checks (x (M, K) and weight (N, K) of `dtype` on the CPU, an optional bias
// of N values of it), the output y (M, N), and body(x, w, b or nullptr, y, M, K, N) on contiguous data of type T.
template <typename T, typename Body>
at::Tensor linear_op(const char* op, const char* dtype_name, at::ScalarType dtype, const at::Tensor& x,
                     const at::Tensor& weight, const std::optional<at::Tensor>& bias, const Body& body) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, op, ": need x (M, K) and weight (N, K); got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(x.size(1) == weight.size(1), op, ": x has ", x.size(1), " columns, weight ", weight.size(1));
  TORCH_CHECK(x.scalar_type() == dtype && weight.scalar_type() == dtype, op, ": need ", dtype_name,
              " x and weight; got ", x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": need CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == dtype && bias->device().is_cpu(),
                op, ": need a ", dtype_name, " CPU bias of ", N, " values; got ", bias->scalar_type(), " ",
                bias->sizes());
    b = bias->contiguous();
  }
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  body(xc.const_data_ptr<T>(), wc.const_data_ptr<T>(), b.defined() ? b.const_data_ptr<T>() : nullptr,
       y.mutable_data_ptr<T>(), M, K, N);
  return y;
}

// Software prefetch of row n + prefetch_rows of a thread's block [n0, n1) of rows `row_bytes` long (requesting the
// whole window at the block's start measured slower: it competes with the demand misses of the first rows).
template <Weights kind>
inline void prefetch_ahead(const char* block, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n) {
  const int64_t ahead = prefetch_rows[kind].load(std::memory_order_relaxed);  // a plain load, once a row
  if (ahead == 0 || n + ahead >= n1) return;
  const char* row = block + (n + ahead - n0) * row_bytes;
  for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, TFORMER_PREFETCH_HINT);
}

#ifdef TFORMER_AVX512_BF16
// out[r, n] = sum_k x[r, k] w[n, k] for rows n0 <= n < n1 of W and R rows of x.
template <int R>
void rows_avx512(const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t K, int64_t N, int64_t n0,
                 int64_t n1) {
  const int64_t tail = K % 32;
  const __mmask32 tail_mask = tail ? static_cast<__mmask32>((1u << tail) - 1u) : 0;
  for (int64_t n = n0; n < n1; ++n) {
    const bf16* wr = w + n * K;
    prefetch_ahead<kBf16Weights>(reinterpret_cast<const char*>(w + n0 * K), K * 2, n0, n1, n);
    // Two independent chains of dpbf16 per row of x (even and odd blocks of 32 columns), added at the end: one
    // chain waits on dpbf16's latency, which capped a cache-resident matrix at 45-62 GB/s a core (63-81 with two,
    // AMD EPYC Zen 5; streaming from memory, the same either way).
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
#endif

#if defined(TFORMER_AVX2_BF16) || defined(TFORMER_AVX2_INT8) || defined(TFORMER_AVX2_F32)
inline float hsum8(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
#endif

#ifdef TFORMER_AVX2_BF16
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
      float sum = hsum8(total);
      for (int64_t kk = body; kk < K; ++kk) sum += static_cast<float>(wr[kk]) * xs[r * K + kk];
      y[r * N + n] = bf16(sum + b);
    }
  }
}
#endif

// sum[r] = sum_k xf[r, k] w[k] for one row w of K weights (bfloat16 or int8) and R rows of xf (float32), on any
// CPU: 16 independent lanes per row of x, which compilers vectorize; the order of the additions is fixed.
template <int R, typename W>
void dot_portable(const float* xf, const W* w, int64_t K, float* sum) {
  constexpr int kLanes = 16;
  float acc[R][kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    float wf[kLanes];
    for (int j = 0; j < kLanes; ++j) wf[j] = static_cast<float>(w[k + j]);
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < kLanes; ++j) acc[r][j] += wf[j] * xf[r * K + k + j];
    }
  }
  for (int r = 0; r < R; ++r) {
    sum[r] = 0.0f;
    for (int j = 0; j < kLanes; ++j) sum[r] += acc[r][j];
    for (int64_t kk = k; kk < K; ++kk) sum[r] += static_cast<float>(w[kk]) * xf[r * K + kk];
  }
}

// The bfloat16 rows on any CPU; xf is x in float32 (R rows of K).
template <int R>
void rows_portable(const float* xf, const bf16* w, const bf16* bias, bf16* y, int64_t K, int64_t N, int64_t n0,
                   int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    prefetch_ahead<kBf16Weights>(reinterpret_cast<const char*>(w + n0 * K), K * 2, n0, n1, n);
    float sum[R];
    dot_portable<R>(xf, w + n * K, K, sum);
    const float b = bias ? static_cast<float>(bias[n]) : 0.0f;
    for (int r = 0; r < R; ++r) y[r * N + n] = bf16(sum[r] + b);
  }
}

#if defined(TFORMER_AVX2_BF16) || defined(TFORMER_AVX2_INT8)
// A thread's block of rows [n0, n1) of W (`row_bytes` each, from `w`) read as S streams side by side, for one row of
// x: rows(i, h, std::integral_constant<int, S>{}) takes rows i, i + h, ..., i + (S - 1) h in one pass (h = the
// block's rows / S; i from n0 to n0 + h), each stream prefetching its own rows (prefetch_rows[kind] ahead, within the
// stream); then rows(i, h, std::integral_constant<int, 1>{}) takes each of the last (n1 - n0) % S rows alone. What
// the AVX2 loops at batch 1 share (rows_avx2_streams, rows_int8_streams); each loop loads S rows of W per load of x.
template <int S, Weights kind, typename Rows>
void in_streams(const void* w, int64_t row_bytes, int64_t n0, int64_t n1, const Rows& rows) {
  static_assert(S >= 1, "TFORMER_AVX2_STREAMS and TFORMER_AVX2_INT8_STREAMS must be at least 1");
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
#endif

#ifdef TFORMER_AVX2_BF16
// One row of x (batch 1) on AVX2: the thread's block of rows [n0, n1) read as S streams side by side, rows n0 + i,
// n0 + h + i, ..., n0 + (S - 1) h + i in one pass (h = the block's rows / S; the last (n1 - n0) % S rows alone), so
// that each load of x serves S rows of W. Per row the arithmetic of rows_avx2<R> for R > 1 (two FMA chains, even and
// odd columns, added at the end): a row of a batch and the same row alone give the same bits, whatever S. Measured on
// an AMD EPYC Zen 3: one row at a time, a thread streams SmolLM2's 121 matrices at ~0.8 of a 1 GiB `sum`'s rate (the
// widening and the loads of x, a few operations a cache line, hold it back), two streams at ~1.0 (scratch loops); a
// compiled SmolLM2 step read at 0.834-0.838 of its bound with S = 4, 0.805 with 3, 0.743-0.755 with 2, 0.747 with 6,
// 0.741 with 8 (medians of five alternated processes, benchmarks/kernel_builds.py); rows taken next to each other
// (streams 1152 bytes apart) read at 0.65-0.68 (BENCHMARKS.md). -DTFORMER_AVX2_STREAMS=S sets S (4 by default);
// -DTFORMER_AVX2_ONE_STREAM keeps rows_avx2<1>, for comparison.
#ifndef TFORMER_AVX2_STREAMS
#define TFORMER_AVX2_STREAMS 4
#endif
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
      float sum = hsum8(_mm256_add_ps(acc[t][0], acc[t][1]));
      for (int64_t k = body; k < K; ++k) sum += static_cast<float>(wr[t][k]) * xs[k];
      const int64_t n = i + t * h;
      y[n] = bf16(sum + (bias ? static_cast<float>(bias[n]) : 0.0f));
    }
  });
}
#endif

template <int R>
void pass(const bf16* x, const float* xf, const bf16* w, const bf16* bias, bf16* y, int64_t K, int64_t N,
          int64_t n0, int64_t n1) {
#if defined(TFORMER_AVX512_BF16)
  (void)xf;
  rows_avx512<R>(x, w, bias, y, K, N, n0, n1);
#elif defined(TFORMER_AVX2_BF16)
  (void)x;
#ifndef TFORMER_AVX2_ONE_STREAM
  if constexpr (R == 1) {
    rows_avx2_streams<TFORMER_AVX2_STREAMS>(xf, w, bias, y, K, n0, n1);
    return;
  }
#endif
  rows_avx2<R>(xf, w, bias, y, K, N, n0, n1);
#else
  (void)x;
  rows_portable<R>(xf, w, bias, y, K, N, n0, n1);
#endif
}

void bf16_all_rows(const bf16* xp, const bf16* wp, const bf16* bp, bf16* yp, int64_t M, int64_t K, int64_t N) {
  std::vector<float> xf;  // x in float32 for the paths without bfloat16 arithmetic
#if defined(TFORMER_AVX2_BF16)
  xf = split_even_odd(xp, M, K);
#elif !defined(TFORMER_AVX512_BF16)
  xf.resize(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xp[i]);
#endif
  over_rows(M, N, K * 2, [&](int64_t n0, int64_t n1, int64_t r0, auto rows) {
    const float* xfr = xf.empty() ? nullptr : xf.data() + r0 * K;
    pass<decltype(rows)::value>(xp + r0 * K, xfr, wp, bp, yp + r0 * N, K, N, n0, n1);
  });
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return linear_op<bf16>("gemv_bf16", "bfloat16", at::kBFloat16, x, weight, bias, bf16_all_rows);
}

// ---------------------------------------------------------------------------------------------------------------
// What every int8 loop ends a row with, so that a row gets the same bits from each: `sum` plus the products of its
// columns [from, K) one by one, in order (those past the loop's vectors), and the output, the sum times the row's
// scale plus its bias in one fused multiply-add.
inline float plus_columns(float sum, const int8_t* qr, const float* x, int64_t from, int64_t K) {
  for (int64_t k = from; k < K; ++k) sum += static_cast<float>(qr[k]) * x[k];
  return sum;
}
inline float scaled_row(float sum, Floats scale, Floats bias, int64_t n) {
  return std::fma(sum, scale[n], bias ? bias[n] : 0.0f);
}

#ifdef TFORMER_AVX512_INT8
inline __m512 widen(__m128i codes) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)); }  // 16 int8 -> float32

#endif
#ifdef TFORMER_AVX512_VNNI
// One row of x (batch 1) against the codes in fixed point, with AVX512-VNNI's byte products (-DTFORMER_INT8_WIDEN
// keeps the widening loop). Widening takes three instructions for 16 codes (sign-extend, convert, FMA) on the two
// ports that do vector arithmetic: ~22 G codes/s a core from L2 on an Intel Xeon (Emerald Rapids, 2.1 GHz), so that
// at batch 1 a step's int8 products read at 0.71-0.84 of the bandwidth where the bfloat16 ones (one dpbf16 for 32
// weights) read at 0.92-0.98 (BENCHMARKS.md). Instead, the row is written as integers X_k = x_k 2^s, exactly: s is
// the smallest shift that makes every x_k 2^s an integer (from the lowest set bit of each float); it takes P bytes a
// column when every |X_k| fits P balanced base-256 digits (each in [-128, 127]: |X_k| <= 0x7F7F...7F). A bfloat16 x
// has 8 significant bits, so P <= kMaxPlanes = 5 while its nonzero values span up to ~2^30 (SmolLM2's products: P =
// 3 for 69% of the rows, 4 for 30%, 5 for 1.5%, beyond 0.1%). Each digit position is a plane of signed bytes, and
//   sum_k c_k X_k = sum_j 2^(8j) sum_k (c_k + 128) d_jk - 128 sum_k X_k,
// where c_k + 128 is the code's byte with its top bit flipped (an unsigned byte, as vpdpbusd takes it): one XOR and
// P vpdpbusd for 64 codes, each adding four byte products into 16 int32 lanes (the same loop from L2: 42 G codes/s
// at P = 3, 30 at P = 4, 26 at P = 5; vpdpbusd issues once a cycle and waits 5, hence two sets of P chains). A row's
// P chains are summed with 15 other rows' (lane_sums16): P horizontal sums a row cost about as much as its loop at
// K = 576, and made a compiled step 4% slower than widening; 16 rows at a time, 1.12x faster. Nothing is rounded on
// the way: the int32 sums stay below 32640 K < 2^31 (K <= kMaxFixedColumns), their combination is exact in int64,
// and the dot product is rounded to float32 once (then times 2^-s, exact unless subnormal), where the widening loop
// rounds at each FMA. So the result does not depend on the order of the additions, nor on the number of threads. A
// row that does not fit (a value not finite, values too far apart, most float32 rows, more columns) takes the
// widening loop; so do batches (a pass of R rows costs R P vpdpbusd a block against 2 (2 + R) widening
// instructions: no gain from 2 rows on).
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
#ifdef TFORMER_AVX2_INT8
inline __m256 widen8(const int8_t* codes) {  // 8 int8 -> float32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes))));
}

// The codes' bits read as float32 (AVX2, AMD CPUs). Widening costs two instructions for 8 codes beside their FMA; on
// a Zen 3 core that caps the int8 loop at ~15 G codes/s, the bfloat16 loop's rate in weights (15 GB/s of codes from
// L3 against its 30 of bfloat16; BENCHMARKS.md). Instead: a code's byte b = c ^ 0x80 = c + 128 (1 to 255) alone in
// bits 8p..8p+7 of a 32-bit word, the other bits zero, is the float b 2^(8p - 149): exponent field 0 or (bit 23 set)
// 1, both binades in steps of 2^-149, so the value is linear in b; byte 3 shifted down by 24 is b 2^-149. A 32-byte
// load, one XOR, three ANDs and a shift give 32 codes as four vectors of floats, no conversion, and
//   sum_k c_k x_k = 2^T sum_k b_k x'_k - 128 sum_k x_k,
// where x' is x with each 32 columns permuted (code 4j + p is byte p of word j: x'[8p + j] = x[4j + p]) and scaled
// by 2^(149 - 8p - T) (2^(149 - T) for p = 3), T = ilogb(max |x|) + 24: x' stays below 2^126, and each product (b x
// 2^-T, below 2^-15) is a normal float rounded once in its FMA, as a widened code's. But the sum is over b = c + 128
// in place of c, so the float32 error bound has |c| + 128 where the widening loop's has |c| (for SmolLM2's codes,
// mean |c| ~ 30: about 5x the bound, still ~10^4 below the int8 rounding itself); 2^T and the correction are taken in
// double. The loops widen the codes instead where the bits would not be exact: the calling or working thread has
// denormals-are-zero set in MXCSR (torch.set_flush_denormal(True): the subnormal codes would read as 0) or x has a
// value that is not finite (inf - inf); and on CPUs other than AMD's (Intel cores may take microcode assists on
// subnormal operands; unmeasured) and with -DTFORMER_AVX2_INT8_WIDEN. Both int8 loops (batch 1 and batches) read the
// bits alike, so a row of a batch still gets the bits it gets alone.
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

inline bool denormals_are_zero() { return (_mm_getcsr() & 0x40) != 0; }

inline CodeBitsRows code_bits_rows(const CodeBits& bits, int64_t r0) {  // on this thread, from row r0
  if (!bits.on || denormals_are_zero()) return {nullptr, nullptr, nullptr, 0};
  return {bits.xs.data() + r0 * bits.body, bits.factor.data() + r0, bits.offset.data() + r0, bits.body};
}

inline CodeBits code_bits(const float* xf, int64_t M, int64_t K) {
  CodeBits bits;
#ifndef TFORMER_AVX2_INT8_WIDEN
  static const bool amd = __builtin_cpu_is("amd");
  bits.body = K - K % 32;
  if (!amd || bits.body == 0 || denormals_are_zero()) return bits;
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
#endif
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
  return plus_columns(static_cast<float>(std::fma(static_cast<double>(hsum8(_mm256_add_ps(a0, a1))), factor, -offset)),
                      qr, x, body, K);
}

// bits_sum for 8 rows at once (one row of x), all but their last K - body columns: lane j is
// float(hsum8(chains[j]) 2^T - offset), hsum8's additions in hsum8's order and the same fused multiply-subtract in
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
#else
struct CodeBitsRows {};  // the codes' bits are read on AVX2 only
#endif

#ifdef TFORMER_AVX2_INT8
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
    sum[r] = plus_columns(hsum8(total), qr, xf + r * K, body, K);
  }
}
#endif

// Weight-only int8: out[r, n] = (sum_k xf[r, k] q[n, k]) * scale[n] + bias[n], xf float32 (R rows of K).
template <int R, typename Out>
void rows_int8(const float* xf, [[maybe_unused]] const CodeBitsRows& bits, const int8_t* q, Floats scale, Floats bias,
               Out* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qr = q + n * K;
    float sum[R];
    prefetch_ahead<kInt8Weights>(reinterpret_cast<const char*>(q + n0 * K), K, n0, n1, n);
#ifdef TFORMER_AVX512_INT8
    // U independent accumulators per row of x: widening and one FMA per 16 bytes would otherwise wait on the
    // FMA's latency, below the bandwidth the loads could have.
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
#elif defined(TFORMER_AVX2_INT8)
    if (bits.xs != nullptr) {
      bits_dot<R>(bits, qr, xf, K, sum);
    } else {
      widened_dot<R>(qr, xf, K, sum);
    }
#else
    dot_portable<R>(xf, qr, K, sum);
#endif
    for (int r = 0; r < R; ++r) y[r * N + n] = static_cast<Out>(scaled_row(sum[r], scale, bias, n));
  }
}

#ifdef TFORMER_AVX2_INT8
// One row of x (batch 1) on AVX2: rows_avx2_streams's reading for int8 codes, the thread's block of rows [n0, n1)
// as S streams side by side (in_streams: rows n0 + i, n0 + h + i, ..., n0 + (S - 1) h + i; h = the block's rows / S;
// the last (n1 - n0) % S rows alone), each load of x serving S rows. Per row the arithmetic of the batch loop's
// bits_dot<R> or widened_dot<R> for R > 1 (two FMA chains, added at the end; the codes' bits where code_bits is on):
// a row of a batch and the same row alone give the same bits, whatever S. Measured on an AMD EPYC Zen 3, compiled
// SmolLM2 int8 steps (medians of five alternated processes, benchmarks/kernel_builds.py): widened codes one row at a
// time with 8 rows of prefetch 0.613 and 0.640 of the bound, four streams without prefetch 0.684 and 0.737, with it
// 0.655 (so no prefetch on AVX2 for AMD CPUs: tformer.engine.kernels.prefetch_rows); four streams of the codes' bits 0.719
// and 0.694 against 0.661 and 0.635 widened (two more runs): the widening capped a Zen 3 core at ~15 G codes/s even
// from L3, the bits run at 21-26 (BENCHMARKS.md). On the bits' path each stream's rows are finished 8 at a time
// (bits_sums8: their horizontal sums and scaling share the transposes; 0.679 of the bound against 0.648 row by row,
// medians of five alternated processes, the rounds mixed). -DTFORMER_AVX2_INT8_STREAMS=S sets S (4 by default);
// -DTFORMER_AVX2_INT8_ONE_STREAM keeps rows_int8<1>, for comparison.
#ifndef TFORMER_AVX2_INT8_STREAMS
#define TFORMER_AVX2_INT8_STREAMS 4
#endif
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
        sum[t] = plus_columns(hsum8(_mm256_add_ps(acc[t][0], acc[t][1])), qr[t], xf, body, K);
      }
    }
    for (int t = 0; t < T; ++t) {
      const int64_t n = i + t * h;
      y[n] = static_cast<Out>(scaled_row(sum[t], scale, bias, n));
    }
  });
}
#endif

template <typename Out>
void int8_all_rows(const float* xf, const int8_t* q, Floats scale, Floats bias, Out* y, int64_t M, int64_t K,
                   int64_t N) {
#ifdef TFORMER_AVX512_VNNI
  if (M == 1) {
    const FixedRow row = fixed_row(xf, K);
    const auto fixed = [&](auto planes) {
      tformer_kernels::parallel_blocks(N, grain(K), [&](int64_t n0, int64_t n1) {
        rows_int8_fixed<decltype(planes)::value, Out>(row, q, scale, bias, y, K, n0, n1);
      });
    };
    switch (row.P) {
      case 1: return fixed(std::integral_constant<int, 1>{});
      case 2: return fixed(std::integral_constant<int, 2>{});
      case 3: return fixed(std::integral_constant<int, 3>{});
      case 4: return fixed(std::integral_constant<int, 4>{});
      case 5: return fixed(std::integral_constant<int, 5>{});
      default: break;  // the row does not fit: widen the codes
    }
  }
#endif
#ifdef TFORMER_AVX2_INT8
  const CodeBits all_bits = code_bits(xf, M, K);
#endif
  over_rows(M, N, K, [&](int64_t n0, int64_t n1, int64_t r0, auto rows) {
#ifdef TFORMER_AVX2_INT8
    const CodeBitsRows bits = code_bits_rows(all_bits, r0);  // checked on this thread: its MXCSR is its own
#else
    const CodeBitsRows bits{};
#endif
#if defined(TFORMER_AVX2_INT8) && !defined(TFORMER_AVX2_INT8_ONE_STREAM)
    if constexpr (decltype(rows)::value == 1) {
      rows_int8_streams<TFORMER_AVX2_INT8_STREAMS, Out>(xf + r0 * K, bits, q, scale, bias, y + r0 * N, K, n0, n1);
      return;
    }
#endif
    rows_int8<decltype(rows)::value, Out>(xf + r0 * K, bits, q, scale, bias, y + r0 * N, K, N, n0, n1);
  });
}

at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2, "gemv_int8: need x (M, K) and codes (N, K); got ", x.sizes(),
              " and ", codes.sizes());
  TORCH_CHECK(x.size(1) == codes.size(1), "gemv_int8: x has ", x.size(1), " columns, codes ", codes.size(1));
  TORCH_CHECK(codes.scalar_type() == at::kChar, "gemv_int8: need int8 codes; got ", codes.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "gemv_int8: need bfloat16 or float32 x; got ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scale.device().is_cpu(), "gemv_int8: need CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N, "gemv_int8: need ", N, " scales; got ", scale.sizes());
  const auto is_float = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
  };
  TORCH_CHECK(is_float(scale), "gemv_int8: need float32 or bfloat16 scales; got ", scale.scalar_type());
  const at::Tensor sc = scale.contiguous(), qc = codes.contiguous(), xc = x.contiguous();
  at::Tensor bc;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->device().is_cpu() && is_float(*bias),
                "gemv_int8: need a float32 or bfloat16 CPU bias of ", N, " values; got ", bias->scalar_type(), " ",
                bias->sizes());
    bc = bias->contiguous();
  }
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  const Floats sv{sc.const_data_ptr(), sc.scalar_type() == at::kBFloat16};
  const Floats bv{bc.defined() ? bc.const_data_ptr() : nullptr, bc.defined() && bc.scalar_type() == at::kBFloat16};
  if (xc.scalar_type() == at::kBFloat16) {
    std::vector<float> xf(M * K);  // x widened once: every row of the codes reuses it
    const bf16* xp = xc.const_data_ptr<bf16>();
    for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xp[i]);
    int8_all_rows(xf.data(), qc.const_data_ptr<int8_t>(), sv, bv, y.mutable_data_ptr<bf16>(), M, K, N);
  } else {
    int8_all_rows(xc.const_data_ptr<float>(), qc.const_data_ptr<int8_t>(), sv, bv, y.mutable_data_ptr<float>(), M, K,
                  N);
  }
  return y;
}

// ---------------------------------------------------------------------------------------------------------------
// float32: out[r, n] = sum_k x[r, k] w[n, k] (+ b[n]) for R rows of x, in float32 (no rounding but the sums'). On an
// AMD EPYC (Zen 5) MKL's one-row GEMM streamed SmolLM2's matrices at 7-16 GB/s, this loop at 19-44; at the demo
// model's cache-resident 64-256 KB matrices it costs 1.2-1.4x less per call.
template <int R>
void rows_f32(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t n0,
              int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    prefetch_ahead<kF32Weights>(reinterpret_cast<const char*>(w + n0 * K), K * 4, n0, n1, n);
    float sum[R];
#if defined(TFORMER_AVX512_F32)
    // The int8 rows' loop with float32 weights. Kept apart: one loop for both with the load passed in (a lambda)
    // measured 13-14% slower on the int8 rows at 2-4 rows of x (AMD EPYC Zen 5).
    constexpr int U = R == 1 ? 4 : 2;
    __m512 acc[R][U];
    for (int r = 0; r < R; ++r) {
      for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 16 * U <= K; k += 16 * U) {
      for (int u = 0; u < U; ++u) {
        const __m512 wv = _mm512_loadu_ps(wr + k + 16 * u);
        for (int r = 0; r < R; ++r) acc[r][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * K + k + 16 * u), acc[r][u]);
      }
    }
    for (; k < K; k += 16) {  // the rest, 16 at a time, the last masked (zeros past the end add nothing)
      const __mmask16 mask = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1u);
      const __m512 wv = _mm512_maskz_loadu_ps(mask, wr + k);
      for (int r = 0; r < R; ++r) acc[r][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + r * K + k), acc[r][0]);
    }
    for (int r = 0; r < R; ++r) {
      for (int u = 1; u < U; ++u) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][u]);
      sum[r] = _mm512_reduce_add_ps(acc[r][0]);
    }
#elif defined(TFORMER_AVX2_F32)
    constexpr int U = R == 1 ? 4 : 2;
    __m256 acc[R][U];
    for (int r = 0; r < R; ++r) {
      for (int u = 0; u < U; ++u) acc[r][u] = _mm256_setzero_ps();
    }
    const int64_t body = K - K % 8;
    int64_t k = 0;
    for (; k + 8 * U <= body; k += 8 * U) {
      for (int u = 0; u < U; ++u) {
        const __m256 wv = _mm256_loadu_ps(wr + k + 8 * u);
        for (int r = 0; r < R; ++r) acc[r][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * K + k + 8 * u), acc[r][u]);
      }
    }
    for (; k < body; k += 8) {
      const __m256 wv = _mm256_loadu_ps(wr + k);
      for (int r = 0; r < R; ++r) acc[r][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * K + k), acc[r][0]);
    }
    for (int r = 0; r < R; ++r) {
      for (int u = 1; u < U; ++u) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][u]);
      sum[r] = hsum8(acc[r][0]);
      for (int64_t kk = body; kk < K; ++kk) sum[r] += wr[kk] * x[r * K + kk];
    }
#else
    dot_portable<R>(x, wr, K, sum);
#endif
    const float b = bias ? bias[n] : 0.0f;
    for (int r = 0; r < R; ++r) y[r * N + n] = sum[r] + b;
  }
}

void f32_all_rows(const float* xp, const float* wp, const float* bp, float* yp, int64_t M, int64_t K, int64_t N) {
  over_rows(M, N, K * 4, [&](int64_t n0, int64_t n1, int64_t r0, auto rows) {
    rows_f32<decltype(rows)::value>(xp + r0 * K, wp, bp, yp + r0 * N, K, N, n0, n1);
  });
}

at::Tensor gemv_f32(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return linear_op<float>("gemv_f32", "float32", at::kFloat, x, weight, bias, f32_all_rows);
}

// Which paths this build took, e.g. "bf16=avx512_bf16 int8=avx512"
std::string gemv_paths() {
#if defined(TFORMER_AVX512_BF16)
  std::string paths = "bf16=avx512_bf16";
#elif defined(TFORMER_AVX2_BF16)
  std::string paths = "bf16=avx2";
#else
  std::string paths = "bf16=portable";
#endif
#if defined(TFORMER_AVX512_VNNI)
  paths += " int8=avx512_vnni";  // batch 1 in fixed point where x fits (fixed_row), else widened
#elif defined(TFORMER_AVX512_INT8)
  paths += " int8=avx512";
#elif defined(TFORMER_AVX2_INT8) && !defined(TFORMER_AVX2_INT8_WIDEN)
  paths += __builtin_cpu_is("amd") ? " int8=avx2_bits" : " int8=avx2";  // code_bits: the codes' bits, or widened
#elif defined(TFORMER_AVX2_INT8)
  paths += " int8=avx2";
#else
  paths += " int8=portable";
#endif
#if defined(TFORMER_AVX512_F32)
  return paths + " f32=avx512";
#elif defined(TFORMER_AVX2_F32)
  return paths + " f32=avx2";
#else
  return paths + " f32=portable";
#endif
}

// The software prefetch distance in rows of one kind of weights (0: bfloat16, 1: float32, 2: int8 codes; see
// prefetch_rows): set it when rows >= 0; returns the one before.
int64_t gemv_prefetch(int64_t rows, int64_t weights) {
  TORCH_CHECK(rows >= -1 && rows <= 1024, "gemv_prefetch: rows must be 0-1024 (or -1 to read it); got ", rows);
  TORCH_CHECK(weights >= kBf16Weights && weights <= kInt8Weights,
              "gemv_prefetch: weights must be 0 (bfloat16), 1 (float32) or 2 (int8); got ", weights);
  std::atomic<int64_t>& setting = prefetch_rows[weights];
  return rows < 0 ? setting.load() : setting.exchange(rows);
}

}  // namespace

namespace tformer_kernels {
void gemv_bf16_into(const bf16* x, const bf16* w, const bf16* b, bf16* y, int64_t M, int64_t K, int64_t N) {
  bf16_all_rows(x, w, b, y, M, K, N);
}
void gemv_f32_into(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t K, int64_t N) {
  f32_all_rows(x, w, b, y, M, K, N);
}
void gemv_int8_into(const float* xf, const int8_t* q, Floats scale, Floats bias, bf16* y, int64_t M, int64_t K,
                    int64_t N) {
  int8_all_rows(xf, q, scale, bias, y, M, K, N);
}
void gemv_int8_into(const float* xf, const int8_t* q, Floats scale, Floats bias, float* y, int64_t M, int64_t K,
                    int64_t N) {
  int8_all_rows(xf, q, scale, bias, y, M, K, N);
}
}  // namespace tformer_kernels

TORCH_LIBRARY(tformer, m) {
  m.def("gemv_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("gemv_int8(Tensor x, Tensor codes, Tensor scale, Tensor? bias) -> Tensor");
  m.def("gemv_f32(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("gemv_paths() -> str", &gemv_paths);
  m.def("gemv_prefetch(int rows=-1, int weights=0) -> int", &gemv_prefetch);
}

TORCH_LIBRARY_IMPL(tformer, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_int8", &gemv_int8);
  m.impl("gemv_f32", &gemv_f32);
}
