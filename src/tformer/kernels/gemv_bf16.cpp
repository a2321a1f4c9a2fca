// tformer's bfloat16 matrix-vector kernel for decoding on the CPU: y (M, N) = x (M, K) W (N, K)^T (+ b (N,)).
//
// A decode step reads every weight once for one token (M = 1, or a few sequences), so its matmuls are bound by the
// bytes of W, not by arithmetic. The kernel streams W row by row, exactly once per call for up to kRowsPerPass rows
// of x: each thread takes a contiguous block of W's rows (at::parallel_for, torch's own OpenMP pool), prefetches
// kPrefetchRows rows ahead, and keeps one float32 accumulator per row of x. The sum is rounded to bfloat16 once, after
// the bias: what F.linear computes, up to the order of the float32 additions.
//
// Two paths, chosen when the file is compiled (-march=native, on the machine that runs it):
//   AVX512-BF16: _mm512_dpbf16_ps multiplies 32 bfloat16 pairs exactly and adds them into 16 float32 lanes;
//   portable:    bfloat16 -> float32 is a 16-bit shift; 16 independent lanes per row that compilers vectorize.
//
// Built on first use by tformer/kernels/__init__.py (torch.utils.cpp_extension); the op is tformer::gemv_bf16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TFORMER_AVX512_BF16 1
#endif

namespace {

using bf16 = c10::BFloat16;
constexpr int kRowsPerPass = 4;      // rows of x sharing one read of W (one accumulator each)
constexpr int64_t kPrefetchRows = 8;  // rows of W requested ahead of the one being read
constexpr int64_t kGrain = 16;        // fewest rows of W per thread

#ifdef TFORMER_AVX512_BF16
// out[r, n] = sum_k x[r, k] w[n, k] for rows n0 <= n < n1 of W and R rows of x.
template <int R>
void rows_avx512(const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t K, int64_t N, int64_t n0,
                 int64_t n1) {
  const int64_t tail = K % 32;
  const __mmask32 tail_mask = tail ? static_cast<__mmask32>((1u << tail) - 1u) : 0;
  for (int64_t n = n0; n < n1; ++n) {
    const bf16* wr = w + n * K;
    if (n + kPrefetchRows < n1) {
      for (int64_t k = 0; k < K; k += 32) {  // one 64-byte line per 32 weights
        _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetchRows * K + k), _MM_HINT_T0);
      }
    }
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    int64_t k = 0;
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

// The same on any CPU; xf is x in float32 (R rows of K).
template <int R>
void rows_portable(const float* xf, const bf16* w, const bf16* bias, bf16* y, int64_t K, int64_t N, int64_t n0,
                   int64_t n1) {
  constexpr int kLanes = 16;
  for (int64_t n = n0; n < n1; ++n) {
    const bf16* wr = w + n * K;
    float acc[R][kLanes] = {};
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) {
      float wf[kLanes];
      for (int j = 0; j < kLanes; ++j) wf[j] = static_cast<float>(wr[k + j]);
      for (int r = 0; r < R; ++r) {
        for (int j = 0; j < kLanes; ++j) acc[r][j] += wf[j] * xf[r * K + k + j];
      }
    }
    const float b = bias ? static_cast<float>(bias[n]) : 0.0f;
    for (int r = 0; r < R; ++r) {
      float sum = 0.0f;
      for (int j = 0; j < kLanes; ++j) sum += acc[r][j];
      for (int64_t kk = k; kk < K; ++kk) sum += static_cast<float>(wr[kk]) * xf[r * K + kk];
      y[r * N + n] = bf16(sum + b);
    }
  }
}

template <int R>
void pass(const bf16* x, const float* xf, const bf16* w, const bf16* bias, bf16* y, int64_t K, int64_t N,
          int64_t n0, int64_t n1) {
#ifdef TFORMER_AVX512_BF16
  (void)xf;
  rows_avx512<R>(x, w, bias, y, K, N, n0, n1);
#else
  (void)x;
  rows_portable<R>(xf, w, bias, y, K, N, n0, n1);
#endif
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "gemv_bf16: need x (M, K) and weight (N, K); got ", x.sizes(),
              " and ", weight.sizes());
  TORCH_CHECK(x.size(1) == weight.size(1), "gemv_bf16: x has ", x.size(1), " columns, weight ", weight.size(1));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "gemv_bf16: need bfloat16 x and weight; got ", x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "gemv_bf16: need CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N && b.scalar_type() == at::kBFloat16 && b.device().is_cpu(),
                "gemv_bf16: need a bfloat16 CPU bias of ", N, " values; got ", b.scalar_type(), " ", b.sizes());
  }
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  const bf16* xp = xc.const_data_ptr<bf16>();
  const bf16* wp = wc.const_data_ptr<bf16>();
  const bf16* bp = b.defined() ? b.const_data_ptr<bf16>() : nullptr;
  bf16* yp = y.mutable_data_ptr<bf16>();
  std::vector<float> xf;
#ifndef TFORMER_AVX512_BF16
  xf.resize(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xp[i]);
#endif
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < M; r0 += kRowsPerPass) {
      const bf16* xr = xp + r0 * K;
      const float* xfr = xf.empty() ? nullptr : xf.data() + r0 * K;
      bf16* yr = yp + r0 * N;
      switch (std::min<int64_t>(kRowsPerPass, M - r0)) {
        case 1: pass<1>(xr, xfr, wp, bp, yr, K, N, n0, n1); break;
        case 2: pass<2>(xr, xfr, wp, bp, yr, K, N, n0, n1); break;
        case 3: pass<3>(xr, xfr, wp, bp, yr, K, N, n0, n1); break;
        default: pass<4>(xr, xfr, wp, bp, yr, K, N, n0, n1); break;
      }
    }
  });
  return y;
}

// Which path this build took: "avx512_bf16" or "portable".
std::string gemv_bf16_path() {
#ifdef TFORMER_AVX512_BF16
  return "avx512_bf16";
#else
  return "portable";
#endif
}

}  // namespace

TORCH_LIBRARY(tformer, m) {
  m.def("gemv_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("gemv_bf16_path() -> str", &gemv_bf16_path);
}

TORCH_LIBRARY_IMPL(tformer, CPU, m) { m.impl("gemv_bf16", &gemv_bf16); }
