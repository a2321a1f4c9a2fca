// What gemv.cpp's matrix-vector loops share, whatever the instruction set (gemv_avx512.h, gemv_avx2.h and the
// portable loops in gemv.cpp): how W's rows are split over threads and passes of x, the software prefetch, and how a
// row's sum becomes its output.

#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels.h"

namespace tformer_kernels::gemv {
namespace {  // gemv.cpp's alone: internal linkage, so the compiler inlines as in one file

constexpr int kRowsPerPass = 4;  // rows of x sharing one read of W (one accumulator each)
constexpr int64_t kGrain = 16;   // fewest rows of W per thread
constexpr int64_t kBytesPerThread = 1 << 18;  // fewest bytes of W per thread: below, waking a thread costs more

// The software prefetch: each thread requests the row `prefetch_rows[kind]` rows ahead of the one it reads into L2
// (0: none, the hardware's prefetchers alone). A setting of the process per kind of weights, read once a row
// (tformer.engine.kernels.prefetch_rows sets it; its default follows the CPU's features).
enum Weights { kBf16Weights = 0, kF32Weights = 1, kInt8Weights = 2 };
inline std::atomic<int64_t> prefetch_rows[3] = {8, 8, 8};

// Software prefetch of row n + prefetch_rows of a thread's block [n0, n1) of rows `row_bytes` long (one row at a
// time: requesting the whole window at once competes with the demand misses of the first rows).
template <Weights kind>
inline void prefetch_ahead(const char* block, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n) {
  const int64_t ahead = prefetch_rows[kind].load(std::memory_order_relaxed);
  if (ahead == 0 || n + ahead >= n1) return;
  const char* row = block + (n + ahead - n0) * row_bytes;
  for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 1);
}

// The grain of parallel_blocks over rows of `row_bytes`: a matrix of at most kBytesPerThread bytes runs on the
// calling thread (waking a second one costs about what it saves there).
inline int64_t grain(int64_t row_bytes) {
  return std::max<int64_t>(kGrain, (kBytesPerThread + row_bytes - 1) / std::max<int64_t>(row_bytes, 1));
}

// The N rows of W split over torch's threads, each block of rows [n0, n1) read once per pass of up to kRowsPerPass
// rows of x: body(n0, n1, r0, std::integral_constant<int, R>{}) for the R rows of x from r0.
template <typename Body>
void over_rows(int64_t M, int64_t N, int64_t row_bytes, const Body& body) {
  parallel_blocks(N, grain(row_bytes), [&](int64_t n0, int64_t n1) {
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

// sum[r] = sum_k xf[r, k] w[k] for one row w of K weights (bfloat16, float32 or int8) and R rows of xf (float32), on
// any CPU: 16 independent lanes per row of x, which compilers vectorize; the order of the additions is fixed.
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

// Weight-only int8 rows [n0, n1): y[r, n] = (sum_k xf[r, k] q[n, k]) * scale[n] + bias[n] for R rows of xf, each
// row's sums by dot(q + n K, sum) (the instruction set's loop).
template <int R, typename Out, typename Dot>
void rows_int8(const Dot& dot, const int8_t* q, Floats scale, Floats bias, Out* y, int64_t K, int64_t N, int64_t n0,
               int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    float sum[R];
    prefetch_ahead<kInt8Weights>(reinterpret_cast<const char*>(q + n0 * K), K, n0, n1, n);
    dot(q + n * K, sum);
    for (int r = 0; r < R; ++r) y[r * N + n] = static_cast<Out>(scaled_row(sum[r], scale, bias, n));
  }
}

}  // namespace
}  // namespace tformer_kernels::gemv
