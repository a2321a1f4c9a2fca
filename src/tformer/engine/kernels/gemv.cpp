// tformer's matrix-vector kernels for decoding on the CPU: y (M, N) = x (M, K) W (N, K)^T (+ b (N,)) for a few rows
// of x, with W in bfloat16, float32 or weight-only int8 codes (y = (x Q^T) s + b, one float scale per row of Q).
//
// A decode step reads every weight once for one token (M = 1, or a few sequences), so its products are bound by the
// bytes of W, not by arithmetic. The kernels stream W row by row, exactly once per call for up to kRowsPerPass rows
// of x: each thread takes a contiguous block of W's rows (parallel_blocks, torch's own OpenMP pool), and keeps one
// float32 accumulator per row of x. Contract (README.md, "Rounding"): exact products (a bfloat16 or int8 product is
// exact in float32), float32 sums in an order fixed by the path, one rounding to the output's dtype after the bias
// (int8: sum times scale plus bias in one fused multiply-add). Each row of y is one thread's sum, so the bits do not
// depend on the number of threads; a row of a batch gets the bits it gets alone, except on the AVX-512 int8 loops
// (batch 1 sums in four chains or exactly in fixed point, batches in two).
//
// The loops by instruction set: gemv_avx512.h, gemv_avx2.h, and below the portable ones and the float32 rows, which
// are written once over simd.h's vector words. The ops are tformer::gemv_bf16, tformer::gemv_int8, tformer::gemv_f32;
// built by tformer/engine/kernels/build.py (torch.utils.cpp_extension).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "gemv.h"
#if defined(TFORMER_AVX512)
#include "gemv_avx512.h"
#endif
#if defined(TFORMER_AVX2) || defined(TFORMER_AVX2_BF16)
#include "gemv_avx2.h"
#endif

namespace tformer_kernels::gemv {
namespace {  // gemv.cpp's alone: internal linkage, so the compiler inlines as in one file

// bfloat16 rows on any CPU; xf is x in float32 (R rows of K).
struct Bf16Portable {
  static constexpr const char* kName = "portable";
  static std::vector<float> prepare(const bf16* x, int64_t M, int64_t K) {
    std::vector<float> xf(M * K);
    for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(x[i]);
    return xf;
  }
  template <int R>
  static void rows(const bf16*, const float* xf, const bf16* w, const bf16* bias, bf16* y, int64_t K, int64_t N,
                   int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      prefetch_ahead<kBf16Weights>(reinterpret_cast<const char*>(w + n0 * K), K * 2, n0, n1, n);
      float sum[R];
      dot_portable<R>(xf, w + n * K, K, sum);
      const float b = bias ? static_cast<float>(bias[n]) : 0.0f;
      for (int r = 0; r < R; ++r) y[r * N + n] = bf16(sum[r] + b);
    }
  }
};

// int8 rows on any CPU.
struct Int8Portable {
  static std::string name() { return "portable"; }
  struct Prepared {};
  static Prepared prepare(const float*, int64_t, int64_t) { return {}; }
  template <typename Out>
  static bool one_row(const float*, const int8_t*, Floats, Floats, Out*, int64_t, int64_t) {
    return false;
  }
  template <int R, typename Out>
  static void rows(const Prepared&, int64_t, const float* xf, const int8_t* q, Floats scale, Floats bias, Out* y,
                   int64_t K, int64_t N, int64_t n0, int64_t n1) {
    const auto dot = [&](const int8_t* qr, float* sum) { dot_portable<R>(xf, qr, K, sum); };
    rows_int8<R, Out>(dot, q, scale, bias, y, K, N, n0, n1);
  }
};

#if defined(TFORMER_SIMD)
// sum[r] = sum_k x[r, k] wr[k] for R rows of x, float32 on the lanes of L: U independent FMA chains a row of x (one
// would wait on the FMA's latency), added in order at the end; the columns past the last whole vector under a mask
// where L has one, else one by one after the horizontal sum. Always inlined into rows_f32: the code the compiler
// makes of those last columns (fused multiply-adds or not) depends on the context, and the bits with it.
template <typename L, int R>
[[gnu::always_inline]] inline void f32_dot(const float* x, const float* wr, int64_t K, float* sum) {
  constexpr int W = L::kWidth, U = R == 1 ? 4 : 2;
  const int64_t body = L::kMaskedTail ? K : K - K % W;
  typename L::V acc[R][U];
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < U; ++u) acc[r][u] = L::zero();
  }
  int64_t k = 0;
  for (; k + W * U <= body; k += W * U) {
    for (int u = 0; u < U; ++u) {
      const typename L::V wv = L::load(wr + k + W * u);
      for (int r = 0; r < R; ++r) acc[r][u] = L::fmadd(wv, L::load(x + r * K + k + W * u), acc[r][u]);
    }
  }
  for (; k < body; k += W) {  // zeros past the end add nothing
    const typename L::V wv = L::load_part(wr + k, body - k);
    for (int r = 0; r < R; ++r) acc[r][0] = L::fmadd(wv, L::load_part(x + r * K + k, body - k), acc[r][0]);
  }
  for (int r = 0; r < R; ++r) {
    for (int u = 1; u < U; ++u) acc[r][0] = L::add(acc[r][0], acc[r][u]);
    sum[r] = L::sum(acc[r][0]);
    for (int64_t kk = body; kk < K; ++kk) sum[r] += wr[kk] * x[r * K + kk];
  }
}
using F32Lanes = simd::Wide;
#if defined(TFORMER_AVX512)
constexpr const char* kF32Name = "avx512";
#else
constexpr const char* kF32Name = "avx2";
#endif
#else
struct F32Lanes {};
template <typename, int R>
[[gnu::always_inline]] inline void f32_dot(const float* x, const float* wr, int64_t K, float* sum) {
  dot_portable<R>(x, wr, K, sum);
}
constexpr const char* kF32Name = "portable";
#endif

// float32: y[r, n] = sum_k x[r, k] w[n, k] (+ b[n]) for R rows of x, in float32 (no rounding but the sums').
template <int R>
void rows_f32(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t n0,
              int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    prefetch_ahead<kF32Weights>(reinterpret_cast<const char*>(w + n0 * K), K * 4, n0, n1, n);
    float sum[R];
    f32_dot<F32Lanes, R>(x, wr, K, sum);
    const float b = bias ? bias[n] : 0.0f;
    for (int r = 0; r < R; ++r) y[r * N + n] = sum[r] + b;
  }
}

// The loops this build takes for each kind of weights (simd.h's macros).
#if defined(TFORMER_AVX512_BF16)
using Bf16Loops = Bf16Avx512;
#elif defined(TFORMER_AVX2_BF16)
using Bf16Loops = Bf16Avx2;
#else
using Bf16Loops = Bf16Portable;
#endif
#if defined(TFORMER_AVX512)
using Int8Loops = Int8Avx512;
#elif defined(TFORMER_AVX2)
using Int8Loops = Int8Avx2;
#else
using Int8Loops = Int8Portable;
#endif

void bf16_all_rows(const bf16* xp, const bf16* wp, const bf16* bp, bf16* yp, int64_t M, int64_t K, int64_t N) {
  const std::vector<float> xf = Bf16Loops::prepare(xp, M, K);  // x as the loops read it, or empty
  over_rows(M, N, K * 2, [&](int64_t n0, int64_t n1, int64_t r0, auto rows) {
    const float* xfr = xf.empty() ? nullptr : xf.data() + r0 * K;
    Bf16Loops::rows<decltype(rows)::value>(xp + r0 * K, xfr, wp, bp, yp + r0 * N, K, N, n0, n1);
  });
}

template <typename Out>
void int8_all_rows(const float* xf, const int8_t* q, Floats scale, Floats bias, Out* y, int64_t M, int64_t K,
                   int64_t N) {
  if (M == 1 && Int8Loops::one_row(xf, q, scale, bias, y, K, N)) return;
  const auto prepared = Int8Loops::prepare(xf, M, K);
  over_rows(M, N, K, [&](int64_t n0, int64_t n1, int64_t r0, auto rows) {
    Int8Loops::rows<decltype(rows)::value, Out>(prepared, r0, xf + r0 * K, q, scale, bias, y + r0 * N, K, N, n0, n1);
  });
}

void f32_all_rows(const float* xp, const float* wp, const float* bp, float* yp, int64_t M, int64_t K, int64_t N) {
  over_rows(M, N, K * 4, [&](int64_t n0, int64_t n1, int64_t r0, auto rows) {
    rows_f32<decltype(rows)::value>(xp + r0 * K, wp, bp, yp + r0 * N, K, N, n0, n1);
  });
}

}  // namespace
}  // namespace tformer_kernels::gemv

namespace {

using tformer_kernels::bf16;
using tformer_kernels::Floats;
using namespace tformer_kernels::gemv;

// What gemv_bf16 and gemv_f32 share: the checks (x (M, K) and weight (N, K) of `dtype` on the CPU, an optional bias
// of N values of it), the output y (M, N), and body(x, w, b or nullptr, y, M, K, N) on contiguous data of type T.
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

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return linear_op<bf16>("gemv_bf16", "bfloat16", at::kBFloat16, x, weight, bias, bf16_all_rows);
}

at::Tensor gemv_f32(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return linear_op<float>("gemv_f32", "float32", at::kFloat, x, weight, bias, f32_all_rows);
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
    int8_all_rows(xc.const_data_ptr<float>(), qc.const_data_ptr<int8_t>(), sv, bv, y.mutable_data_ptr<float>(), M,
                  K, N);
  }
  return y;
}

// Which loops this build took, e.g. "bf16=avx512_bf16 int8=avx512_vnni f32=avx512" (README.md, "Paths").
std::string gemv_paths() {
  return std::string("bf16=") + Bf16Loops::kName + " int8=" + Int8Loops::name() + " f32=" + kF32Name;
}

// The software prefetch distance in rows of one kind of weights (0: bfloat16, 1: float32, 2: int8 codes; gemv.h's
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
  gemv::bf16_all_rows(x, w, b, y, M, K, N);
}
void gemv_f32_into(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t K, int64_t N) {
  gemv::f32_all_rows(x, w, b, y, M, K, N);
}
void gemv_int8_into(const float* xf, const int8_t* q, Floats scale, Floats bias, bf16* y, int64_t M, int64_t K,
                    int64_t N) {
  gemv::int8_all_rows(xf, q, scale, bias, y, M, K, N);
}
void gemv_int8_into(const float* xf, const int8_t* q, Floats scale, Floats bias, float* y, int64_t M, int64_t K,
                    int64_t N) {
  gemv::int8_all_rows(xf, q, scale, bias, y, M, K, N);
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
