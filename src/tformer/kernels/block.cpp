// tformer's decode step of one Llama-style block on the CPU, as one op: x (B, 1, C) -> x' (B, 1, C), the token's key
// and value written into a static cache (tformer.layers.StaticKVCache) at column `slot`:
//
//   h  = RMSNorm(x) g1;           q | k | v = h Wqkv^T (+ b);        q, k turned by RoPE (cos, sin of the position)
//   K[:, :, slot], V[:, :, slot] = k, v;  a = softmax(q K^T / sqrt(D)) V over the columns j <= slot that keys marks
//   x1 = x + a Wo^T (+ b);        h2 = RMSNorm(x1) g2;               g | u = h2 Wup^T (+ b)
//   x' = x1 + (silu(g) u) Wdown^T (+ b)
//
// Why. A decode step reads every weight once, so it is bound by memory bandwidth; its products run at 85-90% of it
// on tformer's matrix-vector kernels, but a compiled SmolLM2 step spent 18% of its time outside them: ~270 calls a
// step from Python, ~120 inductor kernels between the products, each with its own dispatch (BENCHMARKS.md, "Where a
// compiled step goes"). Here a block is one call: the products and the attention are gemv.cpp's and attention.cpp's
// loops (kernels.h), each its own parallel region on torch's pool; what lies between them (norms, RoPE, the cache
// write, SwiGLU, residual sums) is a few thousand values, done in place on the calling thread.
//
// Rounding. Every value the module path (tformer.layers) holds in a tensor of the model's dtype is rounded to that
// dtype here too, in the same order: the normalized x, its product with g, each projection's output (one rounding
// after the bias, as gemv), the attention output, each residual sum, silu(g) and its product with u. Between them
// the arithmetic is float32. One difference: RoPE's a cos - b sin is one rounding here, three in the module path
// (each product, then the difference). In float32 the two paths differ by the order of float32 additions and by
// SiLU's exp (a polynomial here, relative error at most 8.4e-8).
//
// Weights: bfloat16 or float32 of the activations' dtype, or weight-only int8 codes with one scale per row
// (tformer.quantize). Built with gemv.cpp and attention.cpp by tformer/kernels/__init__.py; the op is
// tformer::decode_block.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/core/List.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace {

using tformer_kernels::bf16;
using tformer_kernels::Floats;

inline float as_float(float v) { return v; }
inline float as_float(bf16 v) { return static_cast<float>(v); }

template <typename T>
constexpr at::ScalarType dtype_of() {
  return std::is_same_v<T, float> ? at::kFloat : at::kBFloat16;
}

bool is_float(const at::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16; }

Floats floats(const at::Tensor& t) {
  return Floats{t.defined() ? t.const_data_ptr() : nullptr, t.defined() && t.scalar_type() == at::kBFloat16};
}

// One projection y (M, N) = x (M, K) W^T (+ b): W of the activations' dtype, or int8 codes with a scale per row.
struct Projection {
  const void* weight = nullptr;
  bool int8 = false;
  Floats scale, bias;
  int64_t N = 0, K = 0;
};

template <typename T>
Projection projection(const char* name, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                      const std::optional<at::Tensor>& bias, int64_t N, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) == N && w.size(1) == K, "decode_block: ", name, " weight must be (", N, ", ",
              K, "); got ", w.sizes());
  TORCH_CHECK(w.device().is_cpu() && w.is_contiguous(), "decode_block: ", name, " weight must be contiguous, on the CPU");
  Projection p;
  p.weight = w.const_data_ptr();
  p.int8 = w.scalar_type() == at::kChar;
  p.N = N;
  p.K = K;
  if (p.int8) {
    TORCH_CHECK(scale.has_value() && scale->dim() == 1 && scale->size(0) == N && is_float(*scale) &&
                    scale->is_contiguous() && scale->device().is_cpu(),
                "decode_block: ", name, " has int8 codes: it needs ", N, " float32 or bfloat16 scales");
    p.scale = floats(*scale);
  } else {
    TORCH_CHECK(w.scalar_type() == dtype_of<T>(), "decode_block: ", name, " weight is ", w.scalar_type(),
                ", the activations ", dtype_of<T>());
    TORCH_CHECK(!scale.has_value(), "decode_block: ", name, " has a scale but no int8 codes");
  }
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N && b.is_contiguous() && b.device().is_cpu() &&
                    (p.int8 ? is_float(b) : b.scalar_type() == dtype_of<T>()),
                "decode_block: ", name, " bias must be ", N, " contiguous CPU values of the weight's dtype; got ",
                b.scalar_type(), " ", b.sizes());
    p.bias = floats(b);
  }
  return p;
}

// y (M, N) = x (M, K) W^T (+ b) on the matrix-vector kernels; `widened` holds a bfloat16 x as float32 for int8 codes.
template <typename T>
void project(const Projection& p, const T* x, T* y, int64_t M, std::vector<float>& widened) {
  if (p.int8) {
    const float* xf = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      xf = x;
    } else {
      widened.resize(M * p.K);
      for (int64_t i = 0; i < M * p.K; ++i) widened[i] = static_cast<float>(x[i]);
      xf = widened.data();
    }
    tformer_kernels::gemv_int8_into(xf, static_cast<const int8_t*>(p.weight), p.scale, p.bias, y, M, p.K, p.N);
  } else if constexpr (std::is_same_v<T, bf16>) {
    tformer_kernels::gemv_bf16_into(x, static_cast<const bf16*>(p.weight), static_cast<const bf16*>(p.bias.data), y,
                                    M, p.K, p.N);
  } else {
    tformer_kernels::gemv_f32_into(x, static_cast<const float*>(p.weight), static_cast<const float*>(p.bias.data), y,
                                   M, p.K, p.N);
  }
}

// out = T(T(x / sqrt(mean(x^2) + eps)) g), row by row (M rows of C): torch's rms_norm, which normalizes in float32,
// rounds, then multiplies by the weight in the model's dtype.
template <typename T>
void rms_norm(const T* x, const T* g, float eps, T* out, int64_t M, int64_t C) {
  for (int64_t r = 0; r < M; ++r) {
    const T* xr = x + r * C;
    float part[8] = {};  // eight independent sums: the loop is not one chain of C dependent additions
    int64_t c = 0;
    for (; c + 8 <= C; c += 8) {
      for (int j = 0; j < 8; ++j) part[j] += as_float(xr[c + j]) * as_float(xr[c + j]);
    }
    float total = 0.0f;
    for (int j = 0; j < 8; ++j) total += part[j];
    for (; c < C; ++c) total += as_float(xr[c]) * as_float(xr[c]);
    const float inv = 1.0f / std::sqrt(total / static_cast<float>(C) + eps);
    for (c = 0; c < C; ++c) out[r * C + c] = T(as_float(T(as_float(xr[c]) * inv)) * as_float(g[c]));
  }
}

// The D features of one head turned by the angles cos[i], sin[i] (i < D/2) of its position: pairs (2i, 2i + 1)
// (interleaved) or (i, i + D/2) (rotate-half: GPT-NeoX, Llama). a' = a cos - b sin, b' = a sin + b cos.
template <typename T>
void rotate(T* v, Floats cos, Floats sin, int64_t D, bool interleaved) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
    const float a = as_float(v[ia]), b = as_float(v[ib]), c = cos[i], s = sin[i];
    v[ia] = T(a * c - b * s);
    v[ib] = T(a * s + b * c);
  }
}

// g <- silu(g) = g sigmoid(g) = g / (1 + e^-g), in float32, for n values: with e = e^-|g| (never overflows),
// sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below. Branch-free, so the loop vectorizes (the polynomial
// exp: relative error at most 8.4e-8, attention.cpp).
inline void silu(float* g, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float e = tformer_kernels::exp_nonpositive(-std::fabs(g[i]));
    g[i] = g[i] * ((g[i] >= 0.0f ? 1.0f : e) / (1.0f + e));
  }
}

template <typename T>
at::Tensor run(const at::Tensor& x, at::TensorList norms, at::ArrayRef<double> eps, at::TensorList weights,
               const c10::List<std::optional<at::Tensor>>& scales, const c10::List<std::optional<at::Tensor>>& biases,
               const at::Tensor& cos, const at::Tensor& sin, at::Tensor& key_cache, at::Tensor& value_cache,
               int64_t slot, const at::Tensor& keys, int64_t H, bool interleaved) {
  const int64_t C = x.size(-1), B = key_cache.size(0), Hkv = key_cache.size(1), S = key_cache.size(2);
  const int64_t D = key_cache.size(3), F = weights[3].size(1), Nqkv = (H + 2 * Hkv) * D;
  TORCH_CHECK(H * D == C, "decode_block: ", H, " heads of ", D, " features for d_model ", C);
  TORCH_CHECK(x.numel() == B * C, "decode_block: x ", x.sizes(), " for a cache of batch ", B);
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK(norms[i].dim() == 1 && norms[i].size(0) == C && norms[i].scalar_type() == dtype_of<T>() &&
                    norms[i].is_contiguous() && norms[i].device().is_cpu(),
                "decode_block: norm weight ", i, " must be ", C, " contiguous CPU values of x's dtype");
  }
  const auto opt = [](const c10::List<std::optional<at::Tensor>>& list, int i) { return list.get(i); };
  const Projection qkv = projection<T>("qkv", weights[0], opt(scales, 0), opt(biases, 0), Nqkv, C);
  const Projection proj = projection<T>("out", weights[1], opt(scales, 1), opt(biases, 1), C, C);
  const Projection up = projection<T>("up", weights[2], opt(scales, 2), opt(biases, 2), 2 * F, C);
  const Projection down = projection<T>("down", weights[3], opt(scales, 3), opt(biases, 3), C, F);
  TORCH_CHECK(cos.numel() == B * D / 2 && sin.numel() == B * D / 2 && cos.is_contiguous() && sin.is_contiguous() &&
                  is_float(cos) && is_float(sin),
              "decode_block: cos and sin must hold ", D / 2, " contiguous float32 or bfloat16 angles per row of ", B);
  TORCH_CHECK(keys.scalar_type() == at::kBool && keys.dim() == 2 && keys.size(0) == B && keys.size(1) == S &&
                  keys.stride(1) == 1,
              "decode_block: keys must be a boolean (", B, ", ", S, ") mask, its rows contiguous");

  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(x.sizes(), xc.options());
  // scratch: h (C), q|k|v (Nqkv), attention output (C), a projection's output (C), g|u (2F), silu(g) u (F)
  thread_local std::vector<T> scratch;  // reused by the calls of this thread: no allocation per layer
  scratch.resize(std::max<size_t>(scratch.size(), B * (3 * C + Nqkv + 3 * F)));
  T* h = scratch.data();
  T* qkv_out = h + B * C;
  T* att = qkv_out + B * Nqkv;
  T* y = att + B * C;
  T* gu = y + B * C;
  T* act = gu + B * 2 * F;
  thread_local std::vector<float> widened, gate;
  gate.resize(std::max<size_t>(gate.size(), F));
  const T* xp = xc.const_data_ptr<T>();
  T* xo = out.mutable_data_ptr<T>();
  T* kc = key_cache.mutable_data_ptr<T>();
  T* vc = value_cache.mutable_data_ptr<T>();
  const int64_t cs0 = key_cache.stride(0), cs1 = key_cache.stride(1), cs2 = key_cache.stride(2);
  const Floats cs = floats(cos), sn = floats(sin);

  // attention: norm, q | k | v, RoPE, the cache write, attention, the output projection, the residual sum
  rms_norm(xp, norms[0].const_data_ptr<T>(), static_cast<float>(eps[0]), h, B, C);
  project(qkv, h, qkv_out, B, widened);
  for (int64_t b = 0; b < B; ++b) {
    T* row = qkv_out + b * Nqkv;
    const Floats cb{static_cast<const char*>(cs.data) + b * (D / 2) * (cs.is_bf16 ? 2 : 4), cs.is_bf16};
    const Floats sb{static_cast<const char*>(sn.data) + b * (D / 2) * (sn.is_bf16 ? 2 : 4), sn.is_bf16};
    for (int64_t head = 0; head < H + Hkv; ++head) rotate(row + head * D, cb, sb, D, interleaved);  // q and k heads
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      std::memcpy(kc + b * cs0 + hk * cs1 + slot * cs2, row + (H + hk) * D, D * sizeof(T));
      std::memcpy(vc + b * cs0 + hk * cs1 + slot * cs2, row + (H + Hkv + hk) * D, D * sizeof(T));
    }
  }
  tformer_kernels::decode_attention_into(qkv_out, kc, vc, cs0, cs1, cs2, Nqkv, keys.const_data_ptr<bool>(),
                                         keys.stride(0), slot + 1, B, H, Hkv, D, 1.0f / std::sqrt(float(D)), att);
  project(proj, att, y, B, widened);
  for (int64_t i = 0; i < B * C; ++i) xo[i] = T(as_float(xp[i]) + as_float(y[i]));

  // feed-forward: norm, g | u, silu(g) u, the down projection, the residual sum
  rms_norm(static_cast<const T*>(xo), norms[1].const_data_ptr<T>(), static_cast<float>(eps[1]), h, B, C);
  project(up, h, gu, B, widened);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t f = 0; f < F; ++f) gate[f] = as_float(gu[b * 2 * F + f]);
    silu(gate.data(), F);
    for (int64_t f = 0; f < F; ++f) act[b * F + f] = T(as_float(T(gate[f])) * as_float(gu[b * 2 * F + F + f]));
  }
  project(down, act, y, B, widened);
  for (int64_t i = 0; i < B * C; ++i) xo[i] = T(as_float(xo[i]) + as_float(y[i]));
  return out;
}

at::Tensor decode_block(const at::Tensor& x, at::TensorList norms, at::ArrayRef<double> eps, at::TensorList weights,
                        const c10::List<std::optional<at::Tensor>>& scales,
                        const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot,
                        const at::Tensor& keys, int64_t num_heads, bool interleaved) {
  TORCH_CHECK(norms.size() == 2 && eps.size() == 2, "decode_block: need 2 norm weights and 2 eps");
  TORCH_CHECK(weights.size() == 4 && scales.size() == 4 && biases.size() == 4,
              "decode_block: need 4 projections (qkv, out, up, down): weights, scales and biases");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "decode_block: need float32 or bfloat16 x; got ", dtype);
  TORCH_CHECK(x.device().is_cpu() && key_cache.device().is_cpu() && value_cache.device().is_cpu() &&
                  slot.device().is_cpu() && keys.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(),
              "decode_block: need CPU tensors");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.strides() == value_cache.strides() && key_cache.stride(3) == 1 &&
                  key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "decode_block: key and value caches must be (B, Hkv, S, D) of x's dtype, alike, the last dimension "
              "contiguous; got ", key_cache.sizes(), " and ", value_cache.sizes());
  TORCH_CHECK(num_heads > 0 && num_heads % key_cache.size(1) == 0, "decode_block: ", key_cache.size(1),
              " key/value heads must divide ", num_heads, " heads");
  TORCH_CHECK(key_cache.size(3) % 2 == 0 && key_cache.size(3) <= 1024, "decode_block: head size ", key_cache.size(3),
              " must be even and at most 1024");
  TORCH_CHECK(slot.numel() == 1 && slot.scalar_type() == at::kLong, "decode_block: slot must be one int64 column");
  const int64_t column = *slot.const_data_ptr<int64_t>();
  TORCH_CHECK(column >= 0 && column < key_cache.size(2), "decode_block: slot ", column, " outside the cache's ",
              key_cache.size(2), " columns");
  if (dtype == at::kFloat) {
    return run<float>(x, norms, eps, weights, scales, biases, cos, sin, key_cache, value_cache, column, keys,
                      num_heads, interleaved);
  }
  return run<bf16>(x, norms, eps, weights, scales, biases, cos, sin, key_cache, value_cache, column, keys, num_heads,
                   interleaved);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tformer, m) {
  m.def(
      "decode_block(Tensor x, Tensor[] norms, float[] eps, Tensor[] weights, Tensor?[] scales, Tensor?[] biases, "
      "Tensor cos, Tensor sin, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot, Tensor keys, int num_heads, "
      "bool interleaved) -> Tensor");
}

TORCH_LIBRARY_IMPL(tformer, CPU, m) { m.impl("decode_block", &decode_block); }
