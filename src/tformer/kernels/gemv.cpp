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
// The same streaming for weight-only int8 (tformer.quantize): y = (x Q^T) * s (+ b) with int8 codes Q (N, K) and one
// float scale per row, x bfloat16 or float32: one byte per weight read, converted to float32 in registers.
//
// Built on first use by tformer/kernels/__init__.py (torch.utils.cpp_extension); the ops are tformer::gemv_bf16 and
// tformer::gemv_int8.

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

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define TFORMER_AVX512_BF16 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TFORMER_AVX512_INT8 1
#endif

namespace {

using bf16 = c10::BFloat16;
constexpr int kRowsPerPass = 4;      // rows of x sharing one read of W (one accumulator each)
constexpr int64_t kPrefetchRows = 8;  // rows of W requested ahead of the one being read
constexpr int64_t kGrain = 16;        // fewest rows of W per thread

// Software prefetch of row n + kPrefetchRows of a thread's block [n0, n1) of rows `row_bytes` long (requesting the
// whole window at the block's start measured slower: it competes with the demand misses of the first rows).
inline void prefetch_ahead(const char* block, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n) {
  if (n + kPrefetchRows >= n1) return;
  const char* row = block + (n + kPrefetchRows - n0) * row_bytes;
  for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
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
    prefetch_ahead(reinterpret_cast<const char*>(w + n0 * K), K * 2, n0, n1, n);
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
    prefetch_ahead(reinterpret_cast<const char*>(w + n0 * K), K * 2, n0, n1, n);
    float sum[R];
    dot_portable<R>(xf, w + n * K, K, sum);
    const float b = bias ? static_cast<float>(bias[n]) : 0.0f;
    for (int r = 0; r < R; ++r) y[r * N + n] = bf16(sum[r] + b);
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

// ---------------------------------------------------------------------------------------------------------------
#ifdef TFORMER_AVX512_INT8
inline __m512 widen(__m128i codes) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)); }  // 16 int8 -> float32
#endif

// A float32 or bfloat16 vector read as float32 (the scales and the bias, in the model's dtype: no conversion call).
struct Floats {
  const void* data = nullptr;
  bool is_bf16 = false;
  float operator[](int64_t i) const {
    return is_bf16 ? static_cast<float>(static_cast<const bf16*>(data)[i]) : static_cast<const float*>(data)[i];
  }
  explicit operator bool() const { return data != nullptr; }
};

// Weight-only int8: out[r, n] = (sum_k xf[r, k] q[n, k]) * scale[n] + bias[n], xf float32 (R rows of K).
template <int R, typename Out>
void rows_int8(const float* xf, const int8_t* q, Floats scale, Floats bias, Out* y, int64_t K, int64_t N, int64_t n0,
               int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qr = q + n * K;
    float sum[R];
    prefetch_ahead(reinterpret_cast<const char*>(q + n0 * K), K, n0, n1, n);
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
#else
    dot_portable<R>(xf, qr, K, sum);
#endif
    const float b = bias ? bias[n] : 0.0f;
    for (int r = 0; r < R; ++r) y[r * N + n] = static_cast<Out>(sum[r] * scale[n] + b);
  }
}

template <typename Out>
void int8_all_rows(const float* xf, const int8_t* q, Floats scale, Floats bias, Out* y, int64_t M, int64_t K,
                   int64_t N) {
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < M; r0 += kRowsPerPass) {
      const float* xr = xf + r0 * K;
      Out* yr = y + r0 * N;
      switch (std::min<int64_t>(kRowsPerPass, M - r0)) {
        case 1: rows_int8<1, Out>(xr, q, scale, bias, yr, K, N, n0, n1); break;
        case 2: rows_int8<2, Out>(xr, q, scale, bias, yr, K, N, n0, n1); break;
        case 3: rows_int8<3, Out>(xr, q, scale, bias, yr, K, N, n0, n1); break;
        default: rows_int8<4, Out>(xr, q, scale, bias, yr, K, N, n0, n1); break;
      }
    }
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

// Which paths this build took, e.g. "bf16=avx512_bf16 int8=avx512"
std::string gemv_paths() {
#ifdef TFORMER_AVX512_BF16
  std::string paths = "bf16=avx512_bf16";
#else
  std::string paths = "bf16=portable";
#endif
#ifdef TFORMER_AVX512_INT8
  return paths + " int8=avx512";
#else
  return paths + " int8=portable";
#endif
}

}  // namespace

TORCH_LIBRARY(tformer, m) {
  m.def("gemv_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("gemv_int8(Tensor x, Tensor codes, Tensor scale, Tensor? bias) -> Tensor");
  m.def("gemv_paths() -> str", &gemv_paths);
}

TORCH_LIBRARY_IMPL(tformer, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_int8", &gemv_int8);
}
