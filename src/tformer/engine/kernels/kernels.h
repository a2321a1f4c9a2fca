// What tformer's kernel files share: the matrix-vector products (gemv.cpp) and decode attention (attention.cpp) on
// raw, contiguous data, for block.cpp's decode step of a whole block. Each function runs its own parallel region on
// torch's OpenMP pool, as the ops of those files do (they call the same code).

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if AT_PARALLEL_OPENMP && defined(_OPENMP) && !defined(TFORMER_ATEN_PARALLEL_FOR)
#include <omp.h>
#define TFORMER_RAW_OPENMP 1
#endif

namespace tformer_kernels {

using bf16 = c10::BFloat16;

// f(i0, i1) over [0, n) in min(threads, ceil(n / grain)) contiguous blocks of equal size (the last shorter), one a
// thread of torch's pool; at most `grain` items, or a call inside another parallel region, run on the calling thread
// as one block: at::parallel_for's split. Where ATen's backend is OpenMP this is one `omp parallel` region of just
// the threads that get work, without at::parallel_for's per-call bookkeeping: SmolLM2's 121 matrices of a decode
// step read from C++ at 0.745 of the read bandwidth through at::parallel_for, 0.79 through a plain region (medians
// of 10 alternated passes), a compiled step at 0.653 against 0.688 of its bound (5 alternated processes; AMD EPYC
// Zen 4). f must not throw.
template <typename F>
void parallel_blocks(int64_t n, int64_t grain, const F& f) {
  if (n <= 0) return;
#ifdef TFORMER_RAW_OPENMP
  grain = std::max<int64_t>(grain, 1);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (threads <= 1 || omp_in_parallel()) {
    f(int64_t{0}, n);
    return;
  }
  const int64_t chunk = (n + threads - 1) / threads;
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t i0 = omp_get_thread_num() * chunk;
    if (i0 < n) f(i0, std::min(n, i0 + chunk));
  }
#else
  at::parallel_for(0, n, grain, f);
#endif
}

// A float32 or bfloat16 vector read as float32 (int8 scales and biases, in the model's dtype).
struct Floats {
  const void* data = nullptr;
  bool is_bf16 = false;
  float operator[](int64_t i) const {
    return is_bf16 ? static_cast<float>(static_cast<const bf16*>(data)[i]) : static_cast<const float*>(data)[i];
  }
  explicit operator bool() const { return data != nullptr; }
};

// exp(x) for x <= 0 (softmax numerators after the max is subtracted; a sigmoid's e^-|x|): x = n ln2 + r,
// |r| <= ln2/2, e^x = 2^n e^r, e^r = 1 + r + r^2 P(r). Below -87 the result is 0 or the smallest normals (it is never
// used there except as a weight that the sum makes negligible). GCC does not vectorize a loop of it (std::max and the
// rounding stay scalar, with a branch), so the loops that matter call exp8 or exp16 below: the same steps on 8 or 16
// lanes, from the same constants: 1 / ln 2; ln 2 in two parts (n times the first is exact; ln 2 = kLn2High -
// kLn2Low); P of degree 5 fitted to (e^r - 1 - r) / r^2 on [-ln2/2, ln2/2] (near 1/2, 1/6, 1/24, ...), its
// coefficients from the highest degree.
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

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes: the same reduction and polynomial, 2^n applied by scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Low), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  const __m512 er = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(er, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive on 8 lanes: the same reduction and polynomial, 2^n built from its exponent bits.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(kLn2Low), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256 er = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(er, _mm256_castsi256_ps(two_n));  // n >= -126: a normal 2^n
}
#endif

// y (M, N) = x (M, K) W (N, K)^T (+ b (N,)), one rounding to the output's dtype after the bias; M <= 4 is what the
// kernels are made for (more rows work, in passes of 4).
void gemv_bf16_into(const bf16* x, const bf16* w, const bf16* b, bf16* y, int64_t M, int64_t K, int64_t N);
void gemv_f32_into(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t K, int64_t N);
// y = (xf Q^T) * scale (+ bias) for int8 codes Q (N, K), xf (M, K) in float32 (a bfloat16 x widened by the caller).
void gemv_int8_into(const float* xf, const int8_t* q, Floats scale, Floats bias, bf16* y, int64_t M, int64_t K,
                    int64_t N);
void gemv_int8_into(const float* xf, const int8_t* q, Floats scale, Floats bias, float* y, int64_t M, int64_t K,
                    int64_t N);

// One query row per head against a key/value cache: out[b, h] = softmax(q[b, h] . K[b, h / (H / Hkv), j] * scale) V
// over the columns j < limit with keys[b * keys_stride + j] true. q (B, H, D): its heads contiguous, its rows q_stride
// elements apart; out (B, H, D) contiguous; the caches (B, Hkv, S, D) with strides cs0, cs1, cs2 (in elements; the
// last dimension contiguous). Float32 inside, one rounding.
void decode_attention_into(const bf16* q, const bf16* k, const bf16* v, int64_t cs0, int64_t cs1, int64_t cs2,
                           int64_t q_stride, const bool* keys, int64_t keys_stride, int64_t limit, int64_t B,
                           int64_t H, int64_t Hkv, int64_t D, float scale, bf16* out);
void decode_attention_into(const float* q, const float* k, const float* v, int64_t cs0, int64_t cs1, int64_t cs2,
                           int64_t q_stride, const bool* keys, int64_t keys_stride, int64_t limit, int64_t B,
                           int64_t H, int64_t Hkv, int64_t D, float scale, float* out);

}  // namespace tformer_kernels
