// tformer's decode step of a stack of Llama-style blocks on the CPU, as one op: x (B, 1, C) -> x' (B, 1, C) through
// blocks 0 .. L-1, each writing the token's key and value into its static cache (tformer.layers.StaticKVCache) at
// column `slot`. Per block:
//
//   h  = RMSNorm(x) g1;           q | k | v = h Wqkv^T (+ b);        q, k turned by RoPE (cos, sin of the position)
//   K[:, :, slot], V[:, :, slot] = k, v;  a = softmax(q K^T / sqrt(D)) V over the columns j <= slot that keys marks
//   x1 = x + a Wo^T (+ b);        h2 = RMSNorm(x1) g2;               g | u = h2 Wup^T (+ b)
//   x' = x1 + (silu(g) u) Wdown^T (+ b)
//
// Why. A decode step reads every weight once, so it is bound by memory bandwidth; its products run near it on
// tformer's matrix-vector kernels, but the calls between them (~9 modules a block from Python, or the inductor
// kernels of a compiled step), and even one op a block dispatched from Python, cost a share of the step while the
// other threads wait (BENCHMARKS.md, "Where a compiled step goes"). So the whole stack is one call: the products
// and the attention are gemv.cpp's and attention.cpp's loops (kernels.h), each its own parallel region on torch's
// pool; what lies between them (norms, RoPE, the cache write, SwiGLU, residual sums) is a few thousand values, done
// in place on the calling thread.
//
// Rounding. Every value the module path (tformer.layers) holds in a tensor of the model's dtype is rounded to that
// dtype here too, in the same order: the normalized x, its product with g, each projection's output (one rounding
// after the bias, as gemv), the attention output, each residual sum, silu(g) and its product with u. Between them
// the arithmetic is float32. One difference: RoPE's a cos - b sin is one rounding here, three in the module path
// (each product, then the difference). In float32 the two paths differ by the order of float32 additions and by
// SiLU's exp (a polynomial here, relative error at most 8.4e-8).
//
// Weights: bfloat16 or float32 of the activations' dtype, or weight-only int8 codes with one scale per row
// (tformer.quantize), each projection of each block on its own. Built with gemv.cpp and attention.cpp by
// tformer/engine/kernels/build.py; the op is tformer::decode_blocks, its lists flat: two norms, two eps and four
// projections (q|k|v, out, gate|up, down) a block, one key and one value cache a block.

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
Projection projection(int64_t block, const char* name, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                      const std::optional<at::Tensor>& bias, int64_t N, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) == N && w.size(1) == K, "decode_blocks: block ", block, "'s ", name,
              " weight must be (", N, ", ", K, "); got ", w.sizes());
  TORCH_CHECK(w.device().is_cpu() && w.is_contiguous(), "decode_blocks: block ", block, "'s ", name,
              " weight must be contiguous, on the CPU");
  Projection p;
  p.weight = w.const_data_ptr();
  p.int8 = w.scalar_type() == at::kChar;
  p.N = N;
  p.K = K;
  if (p.int8) {
    TORCH_CHECK(scale.has_value() && scale->dim() == 1 && scale->size(0) == N && is_float(*scale) &&
                    scale->is_contiguous() && scale->device().is_cpu(),
                "decode_blocks: block ", block, "'s ", name, " has int8 codes: it needs ", N,
                " float32 or bfloat16 scales");
    p.scale = floats(*scale);
  } else {
    TORCH_CHECK(w.scalar_type() == dtype_of<T>(), "decode_blocks: block ", block, "'s ", name, " weight is ",
                w.scalar_type(), ", the activations ", dtype_of<T>());
    TORCH_CHECK(!scale.has_value(), "decode_blocks: block ", block, "'s ", name, " has a scale but no int8 codes");
  }
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N && b.is_contiguous() && b.device().is_cpu() &&
                    (p.int8 ? is_float(b) : b.scalar_type() == dtype_of<T>()),
                "decode_blocks: block ", block, "'s ", name, " bias must be ", N,
                " contiguous CPU values of the weight's dtype; got ",
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
// sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below. The exp is simd.h's polynomial (relative error at
// most 8.4e-8), on simd.h's vectors where the CPU has them: compilers leave the plain loop scalar, with a branch on
// the sign that the predictor cannot learn.
inline void silu(float* g, int64_t n) {
  int64_t i = 0;
#if defined(TFORMER_SIMD)
  using L = tformer_kernels::simd::Wide;
  const L::V one = L::set1(1.0f);
  for (; i + L::kWidth <= n; i += L::kWidth) {
    const L::V x = L::load(g + i);
    const L::V e = tformer_kernels::simd::exp_lanes<L>(L::neg_abs(x));
    L::store(g + i, L::mul(x, L::div(L::where_nonnegative(x, one, e), L::add(one, e))));
  }
#endif
  for (; i < n; ++i) {
    const float e = tformer_kernels::exp_nonpositive(-std::fabs(g[i]));
    g[i] = g[i] * ((g[i] >= 0.0f ? 1.0f : e) / (1.0f + e));
  }
}

// One block's weights, checked: the two RMSNorms' gains and eps, the four projections.
template <typename T>
struct Block {
  const T* norm1 = nullptr;
  const T* norm2 = nullptr;
  float eps1 = 0, eps2 = 0;
  Projection qkv, proj, up, down;
};

// Where a step writes and what it attends to: the caches (B, Hkv, S, D) with their strides, the column, the keys.
template <typename T>
struct Cache {
  T* k = nullptr;
  T* v = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0;
};

struct Shape {
  int64_t B, C, H, Hkv, S, D;
  bool interleaved;
};

// Scratch of one step, in values: h (C), q|k|v (Nqkv), attention output (C), a projection's output (C), g|u (2F),
// silu(g) u (F), per row (block_step lays it out in this order).
inline int64_t step_scratch(int64_t B, int64_t C, int64_t Nqkv, int64_t F) { return B * (3 * C + Nqkv + 3 * F); }

// n values of T reused by the calls of this thread (no allocation per block or step).
template <typename T>
T* scratch(size_t n) {
  thread_local std::vector<T> buffer;
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// A decode step of one block: x (B, C) -> xo (B, C) (xo may not alias x), the token's key and value written to the
// cache at column `slot`.
template <typename T>
void block_step(const Block<T>& w, const Shape& sh, const T* xp, T* xo, const Cache<T>& cache, int64_t slot,
                const bool* keys, int64_t keys_stride, Floats cs, Floats sn, T* work, std::vector<float>& widened,
                std::vector<float>& gate) {
  const int64_t B = sh.B, C = sh.C, H = sh.H, Hkv = sh.Hkv, D = sh.D, F = w.down.K, Nqkv = w.qkv.N;
  T* h = work;
  T* qkv_out = h + B * C;
  T* att = qkv_out + B * Nqkv;
  T* y = att + B * C;
  T* gu = y + B * C;
  T* act = gu + B * 2 * F;
  gate.resize(std::max<size_t>(gate.size(), F));

  // attention: norm, q | k | v, RoPE, the cache write, attention, the output projection, the residual sum
  rms_norm(xp, w.norm1, w.eps1, h, B, C);
  project(w.qkv, h, qkv_out, B, widened);
  for (int64_t b = 0; b < B; ++b) {
    T* row = qkv_out + b * Nqkv;
    const Floats cb{static_cast<const char*>(cs.data) + b * (D / 2) * (cs.is_bf16 ? 2 : 4), cs.is_bf16};
    const Floats sb{static_cast<const char*>(sn.data) + b * (D / 2) * (sn.is_bf16 ? 2 : 4), sn.is_bf16};
    for (int64_t head = 0; head < H + Hkv; ++head) rotate(row + head * D, cb, sb, D, sh.interleaved);  // q and k
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      std::memcpy(cache.k + b * cache.s0 + hk * cache.s1 + slot * cache.s2, row + (H + hk) * D, D * sizeof(T));
      std::memcpy(cache.v + b * cache.s0 + hk * cache.s1 + slot * cache.s2, row + (H + Hkv + hk) * D, D * sizeof(T));
    }
  }
  tformer_kernels::decode_attention_into(qkv_out, cache.k, cache.v, cache.s0, cache.s1, cache.s2, Nqkv, keys,
                                         keys_stride, slot + 1, B, H, Hkv, D, 1.0f / std::sqrt(float(D)), att);
  project(w.proj, att, y, B, widened);
  for (int64_t i = 0; i < B * C; ++i) xo[i] = T(as_float(xp[i]) + as_float(y[i]));

  // feed-forward: norm, g | u, silu(g) u, the down projection, the residual sum
  rms_norm(static_cast<const T*>(xo), w.norm2, w.eps2, h, B, C);
  project(w.up, h, gu, B, widened);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t f = 0; f < F; ++f) gate[f] = as_float(gu[b * 2 * F + f]);
    silu(gate.data(), F);
    for (int64_t f = 0; f < F; ++f) act[b * F + f] = T(as_float(T(gate[f])) * as_float(gu[b * 2 * F + F + f]));
  }
  project(w.down, act, y, B, widened);
  for (int64_t i = 0; i < B * C; ++i) xo[i] = T(as_float(xo[i]) + as_float(y[i]));
}

// Block i's weights from the op's flat lists (2 norms, 4 projections a block), checked against the shape.
template <typename T>
Block<T> block_of(int64_t i, const Shape& sh, at::TensorList norms, at::ArrayRef<double> eps, at::TensorList weights,
                  const c10::List<std::optional<at::Tensor>>& scales,
                  const c10::List<std::optional<at::Tensor>>& biases) {
  const int64_t C = sh.C, Nqkv = (sh.H + 2 * sh.Hkv) * sh.D;
  for (int64_t j = 2 * i; j < 2 * i + 2; ++j) {
    TORCH_CHECK(norms[j].dim() == 1 && norms[j].size(0) == C && norms[j].scalar_type() == dtype_of<T>() &&
                    norms[j].is_contiguous() && norms[j].device().is_cpu(),
                "decode_blocks: block ", i, "'s norm weight ", j - 2 * i, " must be ", C,
                " contiguous CPU values of x's dtype");
  }
  const at::Tensor& down = weights[4 * i + 3];
  TORCH_CHECK(down.dim() == 2, "decode_blocks: block ", i, "'s down weight must be a matrix; got ", down.sizes());
  const int64_t F = down.size(1);
  const auto opt = [&](const c10::List<std::optional<at::Tensor>>& list, int64_t j) { return list.get(4 * i + j); };
  Block<T> w;
  w.norm1 = norms[2 * i].const_data_ptr<T>();
  w.norm2 = norms[2 * i + 1].const_data_ptr<T>();
  w.eps1 = static_cast<float>(eps[2 * i]);
  w.eps2 = static_cast<float>(eps[2 * i + 1]);
  w.qkv = projection<T>(i, "qkv", weights[4 * i], opt(scales, 0), opt(biases, 0), Nqkv, C);
  w.proj = projection<T>(i, "out", weights[4 * i + 1], opt(scales, 1), opt(biases, 1), C, C);
  w.up = projection<T>(i, "up", weights[4 * i + 2], opt(scales, 2), opt(biases, 2), 2 * F, C);
  w.down = projection<T>(i, "down", down, opt(scales, 3), opt(biases, 3), C, F);
  return w;
}

template <typename T>
at::Tensor run(const at::Tensor& x, at::TensorList norms, at::ArrayRef<double> eps, at::TensorList weights,
               const c10::List<std::optional<at::Tensor>>& scales, const c10::List<std::optional<at::Tensor>>& biases,
               const at::Tensor& cos, const at::Tensor& sin, at::TensorList key_caches, at::TensorList value_caches,
               int64_t slot, const at::Tensor& keys, const Shape& sh) {
  const int64_t L = static_cast<int64_t>(key_caches.size()), B = sh.B, C = sh.C, D = sh.D;
  TORCH_CHECK(cos.numel() == B * D / 2 && sin.numel() == B * D / 2 && cos.is_contiguous() && sin.is_contiguous() &&
                  is_float(cos) && is_float(sin),
              "decode_blocks: cos and sin must hold ", D / 2, " contiguous float32 or bfloat16 angles per row of ", B);
  TORCH_CHECK(keys.scalar_type() == at::kBool && keys.dim() == 2 && keys.size(0) == B && keys.size(1) == sh.S &&
                  keys.stride(1) == 1,
              "decode_blocks: keys must be a boolean (", B, ", ", sh.S, ") mask, its rows contiguous");
  std::vector<Block<T>> blocks;
  blocks.reserve(L);
  int64_t F = 0;
  for (int64_t i = 0; i < L; ++i) {
    blocks.push_back(block_of<T>(i, sh, norms, eps, weights, scales, biases));
    F = std::max(F, blocks.back().down.K);
  }

  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(x.sizes(), xc.options());
  const int64_t step = step_scratch(B, C, (sh.H + 2 * sh.Hkv) * D, F);  // the widest block's
  T* work = scratch<T>(step + 2 * B * C);  // the step's scratch, then two rows of x between blocks
  T* between[2] = {work + step, work + step + B * C};
  thread_local std::vector<float> widened, gate;
  const Floats cs = floats(cos), sn = floats(sin);
  const T* in = xc.const_data_ptr<T>();
  for (int64_t i = 0; i < L; ++i) {
    T* xo = i == L - 1 ? out.mutable_data_ptr<T>() : between[i % 2];
    const at::Tensor& kc = key_caches[i];
    const Cache<T> cache{kc.mutable_data_ptr<T>(), value_caches[i].mutable_data_ptr<T>(), kc.stride(0), kc.stride(1),
                         kc.stride(2)};
    block_step(blocks[i], sh, in, xo, cache, slot, keys.const_data_ptr<bool>(), keys.stride(0), cs, sn, work,
               widened, gate);
    in = xo;
  }
  return out;
}

at::Tensor decode_blocks(const at::Tensor& x, at::TensorList norms, at::ArrayRef<double> eps, at::TensorList weights,
                         const c10::List<std::optional<at::Tensor>>& scales,
                         const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& cos,
                         const at::Tensor& sin, at::TensorList key_caches, at::TensorList value_caches,
                         const at::Tensor& slot, const at::Tensor& keys, int64_t num_heads, bool interleaved) {
  const int64_t L = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(L > 0 && value_caches.size() == key_caches.size(), "decode_blocks: need a key and a value cache a "
              "block; got ", key_caches.size(), " and ", value_caches.size());
  TORCH_CHECK(norms.size() == 2 * L && eps.size() == 2 * L, "decode_blocks: need 2 norm weights and 2 eps a block (",
              2 * L, " for ", L, " blocks); got ", norms.size(), " and ", eps.size());
  TORCH_CHECK(weights.size() == 4 * L && scales.size() == 4 * L && biases.size() == 4 * L,
              "decode_blocks: need 4 projections a block (qkv, out, up, down: ", 4 * L, " weights, scales and biases "
              "for ", L, " blocks); got ", weights.size(), ", ", scales.size(), " and ", biases.size());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "decode_blocks: need float32 or bfloat16 x; got ", dtype);
  TORCH_CHECK(x.device().is_cpu() && slot.device().is_cpu() && keys.device().is_cpu() && cos.device().is_cpu() &&
                  sin.device().is_cpu(),
              "decode_blocks: need CPU tensors");
  const at::Tensor& first = key_caches[0];
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor &k = key_caches[i], &v = value_caches[i];
    TORCH_CHECK(k.dim() == 4 && k.sizes() == first.sizes() && v.sizes() == first.sizes() &&
                    k.strides() == v.strides() && k.stride(3) == 1 && k.scalar_type() == dtype &&
                    v.scalar_type() == dtype && k.device().is_cpu() && v.device().is_cpu(),
                "decode_blocks: block ", i, "'s key and value caches must be (B, Hkv, S, D) CPU tensors of x's "
                "dtype, alike and like block 0's ", first.sizes(), ", the last dimension contiguous; got ", k.sizes(),
                " and ", v.sizes());
  }
  const Shape sh{first.size(0), x.size(-1), num_heads, first.size(1), first.size(2), first.size(3), interleaved};
  TORCH_CHECK(num_heads > 0 && num_heads % sh.Hkv == 0, "decode_blocks: ", sh.Hkv, " key/value heads must divide ",
              num_heads, " heads");
  TORCH_CHECK(sh.D % 2 == 0 && sh.D <= 1024, "decode_blocks: head size ", sh.D, " must be even and at most 1024");
  TORCH_CHECK(sh.H * sh.D == sh.C, "decode_blocks: ", sh.H, " heads of ", sh.D, " features for d_model ", sh.C);
  TORCH_CHECK(x.numel() == sh.B * sh.C, "decode_blocks: x ", x.sizes(), " for a cache of batch ", sh.B);
  TORCH_CHECK(slot.numel() == 1 && slot.scalar_type() == at::kLong, "decode_blocks: slot must be one int64 column");
  const int64_t column = *slot.const_data_ptr<int64_t>();
  TORCH_CHECK(column >= 0 && column < sh.S, "decode_blocks: slot ", column, " outside the cache's ", sh.S, " columns");
  if (dtype == at::kFloat) {
    return run<float>(x, norms, eps, weights, scales, biases, cos, sin, key_caches, value_caches, column, keys, sh);
  }
  return run<bf16>(x, norms, eps, weights, scales, biases, cos, sin, key_caches, value_caches, column, keys, sh);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tformer, m) {
  m.def(
      "decode_blocks(Tensor x, Tensor[] norms, float[] eps, Tensor[] weights, Tensor?[] scales, Tensor?[] biases, "
      "Tensor cos, Tensor sin, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor slot, Tensor keys, "
      "int num_heads, bool interleaved) -> Tensor");
}

TORCH_LIBRARY_IMPL(tformer, CPU, m) { m.impl("decode_blocks", &decode_blocks); }
