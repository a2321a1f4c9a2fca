// What tformer's kernel files share: the matrix-vector products (gemv.cpp) and decode attention (attention.cpp) on
// raw, contiguous data, for block.cpp's decode step of a whole block. Each function runs its own parallel region on
// torch's OpenMP pool, as the ops of those files do (they call the same code).

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"

#if AT_PARALLEL_OPENMP && defined(_OPENMP)
#include <omp.h>
#define TFORMER_RAW_OPENMP 1
#endif

namespace tformer_kernels {

// f(i0, i1) over [0, n) in min(threads, ceil(n / grain)) contiguous blocks of equal size (the last shorter), one a
// thread of torch's pool; at most `grain` items, or a call inside another parallel region, run on the calling thread
// as one block: at::parallel_for's split. Where ATen's backend is OpenMP this is one `omp parallel` region of just
// the threads that get work, without at::parallel_for's bookkeeping (cheaper at a decode step's ~100 small
// products; BENCHMARKS.md); elsewhere at::parallel_for itself. f must not throw.
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
