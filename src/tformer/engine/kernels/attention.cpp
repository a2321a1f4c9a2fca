// tformer's attention kernel for decoding on the CPU: softmax(Q K^T * scale + mask) V for a few query rows.
//
// A decode step asks attention for one query row per head against the whole cache. That is little arithmetic
// (H * S * (D + Dv) multiply-adds), where PyTorch's CPU flash kernel spends most of a call on set-up and blocking
// made for long queries (BENCHMARKS.md). Here one task is one (batch, key/value head, query row) and the query
// heads that read that key/value head (grouped-query attention; up to kMaxGroup at once, when they share a mask):
//   1. s_j = (q . k_j) * scale for every key j the mask lets it see (float32 sums of exact float32 products); each
//      key row is read and widened once for all the task's heads;
//   2. p_j = exp(s_j - max_j s_j), the max-subtracted softmax numerators (masked keys: exactly 0);
//   3. out = (sum_j p_j v_j) / (sum_j p_j), float32 throughout, one rounding to the output dtype; each value row is
//      read and widened once for all the task's heads.
// Keys after a row's last visible one are skipped (a static cache's unwritten columns). A row that may see no key
// returns zeros (the library's convention). Grouped-query heads read key/value head h / (H / Hkv). Where there are
// few tasks (a decode step at batch 1), each row's keys are cut into pieces whose sums are merged afterwards (see
// kSplitRows). Tasks run on torch's OpenMP pool (tformer_kernels::parallel_blocks), inline when the problem is small.
//
// The loops are written once over simd.h's vector words (16 float32 lanes on AVX-512, 8 on AVX2 + FMA; dpbf16 for
// bfloat16 dot products where the CPU has it; four keys' sums reduced together); elsewhere plain C++ that the
// compiler vectorizes (`omp simd` reductions). exp is a polynomial (simd.h: range reduction by ln 2, degree 6 on
// [-ln2/2, ln2/2]; relative error at most 8.4e-8 over [-87, 0]), so step 2 runs on vectors too.
//
// Built with gemv.cpp by tformer/engine/kernels/build.py; the op is tformer::decode_attention.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace {

using tformer_kernels::bf16;

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }

using tformer_kernels::exp_nonpositive;

constexpr float kMasked = -std::numeric_limits<float>::infinity();  // a masked key's score

#if defined(TFORMER_SIMD)
using L = tformer_kernels::simd::Wide;  // simd.h's vector words: 16 float32 lanes on AVX-512, 8 on AVX2
using Lanes = L::V;
constexpr int kLanes = L::kWidth;
constexpr int kBlock = 8;  // value columns summed at once for one head: 8 vectors of float32 accumulators
#if defined(TFORMER_AVX512)
// ... and for each of G > 1 heads sharing the values: G x 4 accumulators, 4 values and a weight in 32 registers
constexpr int group_block(int) { return 4; }
constexpr int kDotHeads = 4;  // query rows whose sums with four keys stay in registers (4 x 4 of 32 registers)
#else
// ... as many as G x NV accumulators, NV values and a weight leave room for in 16 registers: 4 for 2 heads, 3 for 3,
// 2 for 4
constexpr int group_block(int G) { return G <= 2 ? 4 : G == 3 ? 3 : 2; }
constexpr int kDotHeads = 3;  // query rows whose sums with four keys stay in registers (12 of 16, a key, a query)
#endif
#if defined(TFORMER_AVX512_BF16)
constexpr bool kPairedBf16 = true;  // bfloat16 q . k by dpbf16, no widening to share
#else
constexpr bool kPairedBf16 = false;
#endif

// acc[g][0 .. width) = sum_j p[g][j] v[j, 0 .. width) for G heads that share the value rows (grouped-query
// attention) and NV = ceil(width / kLanes) vectors: each value row is loaded and widened once for the G heads, and
// the G * NV sums stay in registers (a masked store read back by the next key's load cannot be forwarded, and
// stalls). A key whose weight is 0 for every head is skipped, so a masked key's value is never read.
template <int G, int NV, typename T>
void weighted_sum(const float* const* p, const T* v, int64_t row_stride, int64_t keys, int64_t width,
                  float* const* acc) {
  Lanes sum[G][NV];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NV; ++c) sum[g][c] = L::zero();
  }
  for (int64_t j = 0; j < keys; ++j) {
    bool any = false;
    for (int g = 0; g < G; ++g) any |= p[g][j] != 0.0f;
    if (!any) continue;
    const T* vj = v + j * row_stride;
    Lanes vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = L::load_part(vj + kLanes * c, width - kLanes * c);
    for (int g = 0; g < G; ++g) {
      const Lanes pj = L::set1(p[g][j]);
      for (int c = 0; c < NV; ++c) sum[g][c] = L::fmadd(pj, vv[c], sum[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NV; ++c) L::store_part(acc[g] + kLanes * c, width - kLanes * c, sum[g][c]);
  }
}

// q . k over D values as a vector of partial sums, float32 sums of exact products: both widened to float32 (qf is q
// in float32), or bfloat16 pairs by dpbf16 where the CPU has it (no conversions).
template <typename T>
inline Lanes partial_dot(const T*, const float* qf, const T* k, int64_t D) {
  Lanes sum = L::zero();
  for (int64_t d = 0; d < D; d += kLanes) {
    sum = L::fmadd(L::load_part(qf + d, D - d), L::load_part(k + d, D - d), sum);
  }
  return sum;
}
#if defined(TFORMER_AVX512_BF16)
inline __m512 partial_dot(const bf16* q, const float*, const bf16* k, int64_t D) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    const __mmask32 m = D - d >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << (D - d)) - 1u);
    sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_maskz_loadu_epi16(m, q + d),
                           (__m512bh)_mm512_maskz_loadu_epi16(m, k + d));
  }
  return sum;
}
#endif

// Step 2 on kLanes lanes at a time from scores[j]: p = exp(s - best), masked keys (-inf) exactly 0; returns their sum
// and leaves j at the first key not done.
inline float numerators(float* scores, int64_t keys, float best, int64_t& j) {
  Lanes totals = L::zero();
  const Lanes top = L::set1(best), masked = L::set1(kMasked);
  for (; j + kLanes <= keys; j += kLanes) {
    const Lanes s = L::load(scores + j);
    const Lanes p = L::zero_where_equal(s, masked, tformer_kernels::simd::exp_lanes<L>(L::sub(s, top)));
    L::store(scores + j, p);
    totals = L::add(totals, p);
  }
  return L::sum(totals);
}
#endif

constexpr int kMaxGroup = 4;  // query heads that share one pass over their key/value head's values
// In a decode step the cache comes from memory: the weights streamed since the layer's last step evicted it. The
// keys are requested this many rows ahead of the scores' loop, the values all at once before it, so that they arrive
// while the loops work (BENCHMARKS.md).
constexpr int64_t kPrefetchKeys = 16;

// Software prefetch of `rows` rows of `width` values, `stride` elements apart (locality 3: into L1, 2: into L2).
template <typename T>
inline void prefetch_rows(const T* first, int64_t stride, int64_t rows, int64_t width, int locality) {
  for (int64_t j = 0; j < rows; ++j) {
    const char* row = reinterpret_cast<const char*>(first + j * stride);
    for (int64_t b = 0; b < width * static_cast<int64_t>(sizeof(T)); b += 64) {
      if (locality == 3) {
        __builtin_prefetch(row + b, 0, 3);
      } else {
        __builtin_prefetch(row + b, 0, 2);
      }
    }
  }
}

#ifdef TFORMER_SIMD
// The dot products of G query rows with four key rows (kj, kj + k_stride, ...; D values each) as G vectors of four
// sums: each key's D values are loaded and widened once for the G rows (grouped-query attention: the query heads
// of a key/value head read each key once, not once each). qf: the query rows in float32. For each (row, key)
// the float32 operations and their order are partial_dot's and L::sum4's, so the sums are the same bits. Where
// bfloat16 pairs multiply natively (dpbf16) nothing is widened, and each row takes partial_dot.
template <int G, typename T>
inline void dots4(const T* const* q, const float* const* qf, const T* kj, int64_t k_stride, int64_t D, __m128* out) {
  if constexpr (kPairedBf16 && std::is_same_v<T, bf16>) {
    for (int g = 0; g < G; ++g) {
      out[g] = L::sum4(partial_dot(q[g], qf[g], kj, D), partial_dot(q[g], qf[g], kj + k_stride, D),
                       partial_dot(q[g], qf[g], kj + 2 * k_stride, D), partial_dot(q[g], qf[g], kj + 3 * k_stride, D));
    }
  } else {
    Lanes sum[G][4];
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < 4; ++i) sum[g][i] = L::zero();
    }
    for (int64_t d = 0; d < D; d += kLanes) {
      for (int i = 0; i < 4; ++i) {
        const Lanes k = L::load_part(kj + i * k_stride + d, D - d);
        for (int g = 0; g < G; ++g) sum[g][i] = L::fmadd(L::load_part(qf[g] + d, D - d), k, sum[g][i]);
      }
    }
    for (int g = 0; g < G; ++g) out[g] = L::sum4(sum[g][0], sum[g][1], sum[g][2], sum[g][3]);
  }
}

// dots4 for G rows, at most kDotHeads at a time (their 4 G sums in registers).
template <int G, typename T>
inline void dots4_rows(const T* const* q, const float* const* qf, const T* kj, int64_t k_stride, int64_t D,
                       __m128* out) {
  constexpr int now = G < kDotHeads ? G : kDotHeads;
  dots4<now, T>(q, qf, kj, k_stride, D, out);
  if constexpr (G > now) dots4_rows<G - now, T>(q + now, qf + now, kj, k_stride, D, out + now);
}
#endif

// Step 2 for one head's scores[0 .. keys) (masked keys -inf), `best` the largest, `nan` whether one is NaN:
// scores[j] = p_j = exp(s_j - best), the max-subtracted softmax numerators (masked keys: exp(-inf) is 0 exactly, by
// the clamp and a select); `top` = best. Returns their sum, or 0 when no key is visible, or NaN when a score is NaN
// (a softmax over it would be NaN); in both cases the scores become zeros and `top` is left as it was.
inline float softmax_numerators(float* scores, int64_t keys, float best, bool nan, float& top) {
  if (nan || best == kMasked) {  // the caller writes the row; its weights add nothing
    std::fill(scores, scores + keys, 0.0f);
    return nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
  }
  top = best;
  float total = 0.0f;
  int64_t j = 0;
#ifdef TFORMER_SIMD
  total = numerators(scores, keys, best, j);
#endif
  for (; j < keys; ++j) {
    const float p = scores[j] == kMasked ? 0.0f : exp_nonpositive(scores[j] - best);
    scores[j] = p;
    total += p;
  }
  return total;
}

// Steps 1 and 2 for G query heads of one (batch, query row) that read the same key head under the same mask: q[g]
// (D,) against the rows of the key head k0 (keys, D), `k_stride` elements apart, under the row's mask (every
// `mask_stride`-th bool; none: all keys). Leaves scores[g * stride + j] = p_j, head g's max-subtracted softmax
// numerators (masked keys: exactly 0), tops[g] its largest score, and totals[g] their sum: at least 1 (the largest
// score's numerator is exp(0)), or 0 when the row may see no key, or NaN when a score is NaN (then the scores are
// zeros too).
template <typename T, int G>
void numerators_of(const T* const* q, const T* k0, int64_t k_stride, const bool* mask, int64_t mask_stride,
                   int64_t keys, int64_t D, float scale, float* scores, int64_t stride, float* totals, float* tops) {
  float qf[G][1024];  // D <= 1024 (checked by the op)
  const float* qrows[G];
  for (int g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) qf[g][d] = to_float(q[g][d]);
    qrows[g] = qf[g];
  }
  float best[G];
  bool nan[G];
  std::fill(best, best + G, kMasked);
  std::fill(nan, nan + G, false);
  int64_t first = 0;  // 1. scores
#ifdef TFORMER_SIMD
  // four keys at a time, their sums reduced together; each head's running max and NaN flags as four lanes
  __m128 top4[G], nan4[G];
  const __m128 masked4 = _mm_set1_ps(kMasked), scale4 = _mm_set1_ps(scale);
  for (int g = 0; g < G; ++g) top4[g] = masked4, nan4[g] = _mm_setzero_ps();
  for (; first + 4 <= keys; first += 4) {
    bool seen[4];
    for (int i = 0; i < 4; ++i) seen[i] = mask == nullptr || mask[(first + i) * mask_stride];
    if (!(seen[0] || seen[1] || seen[2] || seen[3])) {
      for (int g = 0; g < G; ++g) _mm_storeu_ps(scores + g * stride + first, masked4);
      continue;
    }
    const T* kj = k0 + first * k_stride;
    if (first + kPrefetchKeys + 4 <= keys) prefetch_rows(kj + kPrefetchKeys * k_stride, k_stride, 4, D, 3);
    __m128 sums[G];
    dots4_rows<G, T>(q, qrows, kj, k_stride, D, sums);
    const __m128 visible = _mm_castsi128_ps(_mm_setr_epi32(-int{seen[0]}, -int{seen[1]}, -int{seen[2]}, -int{seen[3]}));
    for (int g = 0; g < G; ++g) {
      const __m128 s = _mm_blendv_ps(masked4, _mm_mul_ps(sums[g], scale4), visible);  // masked keys -inf
      _mm_storeu_ps(scores + g * stride + first, s);
      top4[g] = _mm_max_ps(s, top4[g]);  // a NaN score leaves it: NaN rows are set apart by nan4
      nan4[g] = _mm_or_ps(nan4[g], _mm_cmpunord_ps(s, s));
    }
  }
  for (int g = 0; g < G; ++g) {
    float tops4[4];
    _mm_storeu_ps(tops4, top4[g]);
    best[g] = std::max(std::max(tops4[0], tops4[1]), std::max(tops4[2], tops4[3]));
    nan[g] = _mm_movemask_ps(nan4[g]) != 0;
  }
#endif
  for (int g = 0; g < G; ++g) {
    float* row = scores + g * stride;
    for (int64_t j = first; j < keys; ++j) {
      if (mask != nullptr && !mask[j * mask_stride]) {
        row[j] = kMasked;
        continue;
      }
      const T* kj = k0 + j * k_stride;
#ifdef TFORMER_SIMD
      const float dot = L::sum(partial_dot(q[g], qf[g], kj, D));
#else
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qf[g][d] * to_float(kj[d]);
#endif
      row[j] = dot * scale;
      best[g] = std::max(best[g], row[j]);
      nan[g] |= std::isnan(row[j]);
    }
    totals[g] = softmax_numerators(row, keys, best[g], nan[g], tops[g]);
  }
}

#ifdef TFORMER_SIMD
// Step 3 for G heads, NV vectors of value columns at a time (at most `Most`): weighted_sum<G, NV> for NV = ceil(width
// / kLanes), chosen by recursion so that only NV <= Most is instantiated.
template <int G, int NV, typename T>
void weighted_sum_upto(int64_t nv, const float* const* p, const T* v, int64_t row_stride, int64_t keys, int64_t width,
                       float* const* acc) {
  if constexpr (NV > 1) {
    if (nv < NV) return weighted_sum_upto<G, NV - 1, T>(nv, p, v, row_stride, keys, width, acc);
  }
  weighted_sum<G, NV, T>(p, v, row_stride, keys, width, acc);
}
#endif

// G query heads of one (batch, query row) that read the same key/value head under the same mask, over `keys` keys
// from k0, v0: steps 1-3 without the division. Steps 1 and 3 read each key and value row once for all G (step 2 runs
// per head; the weights in scores, a row of `stride` floats per head). Leaves acc[g] (Dv,) = sum_j p_j v_j, totals[g] =
// sum_j p_j and tops[g] = the largest score (numerators_of).
template <typename T, int G>
void attend_sums(const T* const* q, const T* k0, int64_t k_stride, const T* v0, int64_t v_stride, const bool* mask,
                 int64_t mask_stride, int64_t keys, int64_t D, int64_t Dv, float scale, float* scores, int64_t stride,
                 float* const* acc, float* totals, float* tops) {
  prefetch_rows(v0, v_stride, keys, Dv, 2);  // the values arrive while the scores are computed
  numerators_of<T, G>(q, k0, k_stride, mask, mask_stride, keys, D, scale, scores, stride, totals, tops);
  const float* p[G];
  for (int g = 0; g < G; ++g) p[g] = scores + g * stride;
  // 3. the weighted sums of the values, float32 accumulators in registers
#ifdef TFORMER_SIMD
  constexpr int kMost = G == 1 ? kBlock : group_block(G);
  for (int64_t d0 = 0; d0 < Dv; d0 += kLanes * kMost) {
    const int64_t width = std::min<int64_t>(Dv - d0, kLanes * kMost);
    float* at[G];
    for (int g = 0; g < G; ++g) at[g] = acc[g] + d0;
    weighted_sum_upto<G, kMost, T>((width + kLanes - 1) / kLanes, p, v0 + d0, v_stride, keys, width, at);
  }
#else
  for (int g = 0; g < G; ++g) std::fill(acc[g], acc[g] + Dv, 0.0f);
  for (int64_t j = 0; j < keys; ++j) {
    const T* vj = v0 + j * v_stride;
    for (int g = 0; g < G; ++g) {
      const float pj = p[g][j];
      if (pj == 0.0f) continue;
      float* a = acc[g];
#pragma omp simd
      for (int64_t d = 0; d < Dv; ++d) a[d] += pj * to_float(vj[d]);
    }
  }
#endif
}

// A head's output row from its sums: acc / total, one rounding; a NaN total gives a NaN row (as PyTorch's softmax
// over a NaN score), a zero total (no visible key) zeros, the library's convention.
template <typename T>
void finish_row(const float* acc, float total, int64_t Dv, T* out) {
  if (!(total > 0.0f)) {
    const T fill = static_cast<T>(std::isnan(total) ? std::numeric_limits<float>::quiet_NaN() : 0.0f);
    std::fill(out, out + Dv, fill);
    return;
  }
  const float inv = 1.0f / total;
  for (int64_t d = 0; d < Dv; ++d) out[d] = static_cast<T>(acc[d] * inv);
}

// One past the row's last visible key (0: none), so the keys after it are never touched. In a static cache's mask
// most columns are the positions not yet written, all at the end, and would cost as much as the visible ones. Mask
// bytes are 0 or 1, so a
// contiguous mask is scanned eight keys a read.
inline int64_t visible_end(const bool* mask, int64_t stride, int64_t keys) {
  if (mask == nullptr) return keys;
  int64_t end = keys;
  if (stride == 1) {
    for (uint64_t word = 0; end >= 8; end -= 8) {
      std::memcpy(&word, mask + end - 8, 8);
      if (word != 0) break;
    }
  }
  while (end > 0 && !mask[(end - 1) * stride]) --end;
  return end;
}

// The strides of a 4-d tensor's first three dimensions, in elements (the last is 1).
struct Strides {
  int64_t s0, s1, s2;
};

// Split over the keys (flash-decoding). A decode step has few tasks (at batch 1, one per key/value head), too few to
// share out evenly over the threads. When there are fewer than kSplitRows (batch, key/value head,
// query row)s, each row's visible keys are cut into ceil(kSplitRows / rows) equal pieces (at most one per kSplitKeys
// keys the rows may reach); each piece's task leaves its sums (attend_sums), and the pieces of a row are merged by
// the softmax's rescaling: with M the largest of the pieces' top scores, out = sum_s acc_s e^(top_s - M) /
// sum_s total_s e^(top_s - M). The cut depends on the shapes alone (not on the thread count, nor on how many heads go
// together), so a call gives the same bits on any number of threads (figures: benchmarks/decode_attention.py and
// BENCHMARKS.md).
constexpr int64_t kSplitRows = 4;
constexpr int64_t kSplitKeys = 64;
// At least kThreadWork multiply-adds a thread: a smaller call runs on the calling thread, since waking a second
// thread costs more than it saves there (benchmarks/decode_attention.py, third table).
constexpr int64_t kThreadWork = 65536;

// out (B, H, L, Dv), contiguous = attention of q (B, H, L, D) to k (B, Hkv, S, D) and v (B, Hkv, S, Dv), every last
// dimension contiguous, under mask (a bool per (b, h, l, j) at the strides ms, broadcast dimensions 0; or none).
// Keys from `limit` on are not looked at.
template <typename T>
void run_raw(const T* qp, Strides qs, const T* kp, Strides ks, const T* vp, Strides vs, const bool* mp,
             const int64_t* ms, int64_t B, int64_t H, int64_t L, int64_t D, int64_t Hkv, int64_t S, int64_t Dv,
             bool is_causal, int64_t limit, float scale, T* op) {
  const int64_t group = H / Hkv;
  const int64_t ms0 = mp ? ms[0] : 0, ms1 = mp ? ms[1] : 0, ms2 = mp ? ms[2] : 0, ms3 = mp ? ms[3] : 0;
  // A task is up to kMaxGroup heads of one key/value head at one (batch, query row), when the mask is the same for
  // every head (a decode step's (B, 1, 1, S) mask, or none); with a mask per head, one head; and one piece of the keys.
  const int64_t chunk = (mp == nullptr || ms1 == 0) ? std::min<int64_t>(group, kMaxGroup) : 1;
  const int64_t chunks = (group + chunk - 1) / chunk;
  const int64_t rows = B * Hkv * L, reach = std::min(limit, S);
  const int64_t splits = rows >= kSplitRows ? 1
                                            : std::max<int64_t>(1, std::min((kSplitRows + rows - 1) / rows,
                                                                            reach / kSplitKeys));
  const int64_t tasks = rows * chunks * splits;
  const int64_t span = (S + splits - 1) / splits;  // the most keys a task looks at
  const int64_t work = std::max<int64_t>(1, chunk * span * (D + Dv));
  const int64_t grain = std::max<int64_t>(1, (kThreadWork + work - 1) / work);
  const int64_t part = chunk * (Dv + 2);  // a piece's sums: acc (chunk x Dv), totals (chunk), tops (chunk)
  std::vector<float> pieces(splits > 1 ? tasks * part : 0);
  // The task's heads, their query and output rows, and the row's mask; t counts pieces fastest.
  struct Task {
    int64_t b, hk, l, h0, heads;
    const bool* mrow;
  };
  const auto task_of = [&](int64_t t) {
    const int64_t u = t / splits;
    const int64_t l = u % L, c = (u / L) % chunks, hk = (u / (L * chunks)) % Hkv, b = u / (L * chunks * Hkv);
    const int64_t h0 = hk * group + c * chunk;
    return Task{b, hk, l, h0, std::min<int64_t>(chunk, group - c * chunk),
                mp ? mp + b * ms0 + h0 * ms1 + l * ms2 : nullptr};
  };
  tformer_kernels::parallel_blocks(tasks, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(chunk * span), acc(chunk * Dv);
    for (int64_t t = t0; t < t1; ++t) {
      const Task task = task_of(t);
      const int64_t end = std::min<int64_t>(limit, is_causal ? std::min<int64_t>(S, task.l + 1) : S);  // top-left
      const int64_t keys = visible_end(task.mrow, ms3, end);
      const int64_t piece = (keys + splits - 1) / splits;
      const int64_t lo = std::min(keys, (t % splits) * piece), hi = std::min(keys, lo + piece);
      const T* qrows[kMaxGroup];
      T* orows[kMaxGroup];
      float* sums[kMaxGroup];
      float* const own = splits > 1 ? pieces.data() + t * part : nullptr;
      float local[2 * kMaxGroup];
      float* totals = own ? own + chunk * Dv : local;
      float* tops = totals + chunk;
      for (int64_t g = 0; g < task.heads; ++g) {
        qrows[g] = qp + task.b * qs.s0 + (task.h0 + g) * qs.s1 + task.l * qs.s2;
        orows[g] = op + ((task.b * H + task.h0 + g) * L + task.l) * Dv;
        sums[g] = (own ? own : acc.data()) + g * Dv;
      }
      const T* krows = kp + task.b * ks.s0 + task.hk * ks.s1 + lo * ks.s2;
      const T* vrows = vp + task.b * vs.s0 + task.hk * vs.s1 + lo * vs.s2;
      const bool* mrow = task.mrow ? task.mrow + lo * ms3 : nullptr;
      const auto attend = [&](auto heads_at_once) {
        constexpr int G = decltype(heads_at_once)::value;
        attend_sums<T, G>(qrows, krows, ks.s2, vrows, vs.s2, mrow, ms3, hi - lo, D, Dv, scale, scores.data(), span,
                          sums, totals, tops);
      };
      switch (task.heads) {
        case 1: attend(std::integral_constant<int, 1>{}); break;
        case 2: attend(std::integral_constant<int, 2>{}); break;
        case 3: attend(std::integral_constant<int, 3>{}); break;
        default: attend(std::integral_constant<int, 4>{}); break;
      }
      if (own == nullptr) {
        for (int64_t g = 0; g < task.heads; ++g) finish_row(sums[g], totals[g], Dv, orows[g]);
      }
    }
  });
  if (splits == 1) return;
  // The pieces of each row merged on the calling thread (a few heads x pieces x values: too little to share out).
  std::vector<float> merged(Dv);
  for (int64_t u = 0; u < tasks / splits; ++u) {
    const Task task = task_of(u * splits);
    const float* first = pieces.data() + u * splits * part;
    for (int64_t g = 0; g < task.heads; ++g) {
      bool nan = false;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < splits; ++s) {
        const float total = first[s * part + chunk * Dv + g], best = first[s * part + chunk * Dv + chunk + g];
        nan |= std::isnan(total);
        if (total > 0.0f) top = std::max(top, best);
      }
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
      for (int64_t s = 0; s < splits && !nan; ++s) {
        const float* own = first + s * part;
        const float piece_total = own[chunk * Dv + g];
        if (!(piece_total > 0.0f)) continue;  // a piece that saw no key adds nothing
        const float w = exp_nonpositive(own[chunk * Dv + chunk + g] - top);
        total += piece_total * w;
        const float* a = own + g * Dv;
        for (int64_t d = 0; d < Dv; ++d) merged[d] += a[d] * w;
      }
      finish_row(merged.data(), total, Dv, op + ((task.b * H + task.h0 + g) * L + task.l) * Dv);
    }
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, bool is_causal,
         float scale, at::Tensor& out) {
  const auto strides = [](const at::Tensor& t) { return Strides{t.stride(0), t.stride(1), t.stride(2)}; };
  const bool* mp = mask.defined() ? mask.const_data_ptr<bool>() : nullptr;
  const int64_t ms[4] = {mp ? mask.stride(0) : 0, mp ? mask.stride(1) : 0, mp ? mask.stride(2) : 0,
                         mp ? mask.stride(3) : 0};
  const int64_t S = k.size(2);
  run_raw<T>(q.const_data_ptr<T>(), strides(q), k.const_data_ptr<T>(), strides(k), v.const_data_ptr<T>(), strides(v),
             mp, ms, q.size(0), q.size(1), q.size(2), q.size(3), k.size(1), S, v.size(3), is_causal, S, scale,
             out.mutable_data_ptr<T>());
}

// query (B, H, L, D), key (B, Hkv, S, D), value (B, Hkv, S, Dv), mask: boolean, broadcastable to (B, H, L, S), or
// none -> (B, H, L, Dv), contiguous, in the query's dtype (float32 or bfloat16, the same for all three).
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& mask, bool is_causal, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "decode_attention: need 4-d query, key and value (B, H, L, D); got ", query.sizes(), ", ", key.sizes(),
              ", ", value.sizes());
  const auto dtype = query.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && key.scalar_type() == dtype &&
                  value.scalar_type() == dtype,
              "decode_attention: need float32 or bfloat16 query, key and value of one dtype; got ", dtype, ", ",
              key.scalar_type(), ", ", value.scalar_type());
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "decode_attention: need CPU tensors");
  const int64_t B = query.size(0), H = query.size(1), L = query.size(2), D = query.size(3);
  TORCH_CHECK(key.size(0) == B && value.size(0) == B && key.size(1) == value.size(1) && key.size(2) == value.size(2),
              "decode_attention: key ", key.sizes(), " and value ", value.sizes(), " do not fit query ", query.sizes());
  TORCH_CHECK(key.size(3) == D, "decode_attention: key has head size ", key.size(3), ", query ", D);
  TORCH_CHECK(key.size(1) > 0 && H % key.size(1) == 0, "decode_attention: ", key.size(1),
              " key/value heads must divide ", H, " query heads");
  TORCH_CHECK(D <= 1024, "decode_attention: head size ", D, " > 1024");
  const auto last_contiguous = [](const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  const at::Tensor q = last_contiguous(query), k = last_contiguous(key), v = last_contiguous(value);
  at::Tensor m;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool, "decode_attention: need a boolean mask; got ", mask->scalar_type());
    TORCH_CHECK(mask->dim() <= 4, "decode_attention: mask of ", mask->dim(), " dimensions");
    m = mask->expand({B, H, L, key.size(2)});  // broadcast dimensions get stride 0: nothing is copied
  }
  at::Tensor out = at::empty({B, H, L, value.size(3)}, query.options());
  if (out.numel() == 0) return out;
  if (dtype == at::kFloat) {
    run<float>(q, k, v, m, is_causal, static_cast<float>(scale), out);
  } else {
    run<bf16>(q, k, v, m, is_causal, static_cast<float>(scale), out);
  }
  return out;
}

}  // namespace

namespace tformer_kernels {
template <typename T>
void decode_attention_any(const T* q, const T* k, const T* v, int64_t cs0, int64_t cs1, int64_t cs2,
                          int64_t q_stride, const bool* keys, int64_t keys_stride, int64_t limit, int64_t B,
                          int64_t H, int64_t Hkv, int64_t D, float scale, T* out) {
  const int64_t ms[4] = {keys_stride, 0, 0, 1};  // (B, S) broadcast over heads and the one query row
  run_raw<T>(q, Strides{q_stride, D, D}, k, Strides{cs0, cs1, cs2}, v, Strides{cs0, cs1, cs2}, keys, ms, B, H, 1, D,
             Hkv, limit, D, false, limit, scale, out);
}
void decode_attention_into(const bf16* q, const bf16* k, const bf16* v, int64_t cs0, int64_t cs1, int64_t cs2,
                           int64_t q_stride, const bool* keys, int64_t keys_stride, int64_t limit, int64_t B,
                           int64_t H, int64_t Hkv, int64_t D, float scale, bf16* out) {
  decode_attention_any(q, k, v, cs0, cs1, cs2, q_stride, keys, keys_stride, limit, B, H, Hkv, D, scale, out);
}
void decode_attention_into(const float* q, const float* k, const float* v, int64_t cs0, int64_t cs1, int64_t cs2,
                           int64_t q_stride, const bool* keys, int64_t keys_stride, int64_t limit, int64_t B,
                           int64_t H, int64_t Hkv, int64_t D, float scale, float* out) {
  decode_attention_any(q, k, v, cs0, cs1, cs2, q_stride, keys, keys_stride, limit, B, H, Hkv, D, scale, out);
}
}  // namespace tformer_kernels

TORCH_LIBRARY_FRAGMENT(tformer, m) {
  m.def("decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, bool is_causal, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tformer, CPU, m) { m.impl("decode_attention", &decode_attention); }
