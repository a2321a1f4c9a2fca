"""Which calls the kernels take (the ``uses_*`` functions) and the calls themselves (:func:`linear`,
:func:`int8_linear`, :func:`attention`, :func:`float32_gemm`); the switches :func:`enabled` and
:func:`float32_gemms`.

Routes of :func:`linear`, first that applies: the matrix-vector kernel (bfloat16 or float32, at most
:func:`max_rows` rows, no gradient), oneDNN's float32 GEMM (more rows, at least :data:`ONEDNN_MIN_MACS`
multiply-adds, not while ``torch.compile`` traces), a float32 GEMM for bfloat16 where PyTorch has no oneDNN bfloat16
GEMM (:func:`uses_float32_gemm`), else ``F.linear``. Each computes what ``F.linear`` computes up to the order of the
float32 additions (README.md in this folder, "Rounding"). Why each threshold is where it is: BENCHMARKS.md.

Shapes: M, I, O; B, H, Hkv, L, S, D, Dv (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from tformer.engine.kernels import build

MAX_ROWS = 4  # up to this many rows of x the matrix-vector kernel beats F.linear (benchmarks/gemv.py)
WIDE_ROWS = 16  # ... and this many for int8 codes, and for bfloat16 where its GEMMs run as float32
# Below this many multiply-adds a float32 GEMM stays on F.linear: oneDNN's call costs more than it saves
ONEDNN_MIN_MACS = 1 << 22
# A bfloat16 GEMM run as float32 converts its weight this many bytes of float32 at a time: a block the GEMM reads
# back from cache, and no float32 copy of a whole output head
FLOAT32_BLOCK_BYTES = 1 << 23
# From this many rows an int8 product runs as a float32 GEMM where bfloat16 GEMMs do (below, the int8 kernel or
# torch's int8 op is faster)
INT8_FLOAT32_MIN_ROWS = 64


def _no_onednn_bf16() -> bool:
    """Whether PyTorch has no oneDNN bfloat16 GEMM for this CPU (asked once: a graph being traced cannot ask)."""
    # private: no public API tells whether oneDNN has a bfloat16 GEMM for this CPU (AVX-512, AVX2-VNNI-2, Arm BF16)
    return not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


_on = os.environ.get("TFORMER_KERNELS", "1") != "0"  # the kernels and the oneDNN route (enabled)
_float32_gemm = _no_onednn_bf16()  # bfloat16 GEMMs of more rows as float32 (float32_gemms)


def is_enabled() -> bool:
    """Whether the kernels and the oneDNN route are on (``TFORMER_KERNELS=0`` turns them off; :func:`enabled`)."""
    return _on


def float32_gemms_on() -> bool:
    """Whether bfloat16 GEMMs of more rows run as float32 (:func:`float32_gemms`)."""
    return _float32_gemm


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Turn the kernels and the oneDNN route on or off inside a ``with`` block (A/B measurements); compiled graphs
    guard on it."""
    global _on
    before, _on = _on, on
    try:
        yield
    finally:
        _on = before


@contextlib.contextmanager
def float32_gemms(on: bool) -> Iterator[None]:
    """Run bfloat16 GEMMs of more rows as float32 (:func:`uses_float32_gemm`) or not, inside a ``with`` block: the
    default is on where PyTorch has no oneDNN bfloat16 GEMM for this CPU (A/B measurements, and tests of the route
    on any CPU); compiled graphs guard on it."""
    global _float32_gemm
    before, _float32_gemm = _float32_gemm, on
    try:
        yield
    finally:
        _float32_gemm = before


def max_rows(dtype: torch.dtype) -> int:
    """The most rows of ``x`` the matrix-vector kernels take for weights (or :mod:`tformer.engine.fused`,
    activations) of ``dtype``: :data:`WIDE_ROWS` for int8 codes, and for bfloat16 where :func:`float32_gemms` is
    on; else 4."""
    return WIDE_ROWS if dtype == torch.int8 or (_float32_gemm and dtype == torch.bfloat16) else MAX_ROWS


def _decode_call(x: Tensor, weight: Tensor, wants_grad: bool) -> bool:
    """The checks both kernels share: turned on, CPU tensors, a matrix, at most :func:`max_rows` rows of ``x``, no
    gradient asked for, and the kernel built."""
    if not _on or x.device.type != "cpu" or weight.device.type != "cpu" or x.dim() == 0 or weight.dim() != 2:
        return False
    if x.numel() > max_rows(weight.dtype) * x.shape[-1]:
        return False
    return not (torch.is_grad_enabled() and wants_grad) and build.ready()


def _asks_grad(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether a gradient would flow to any of a linear call's tensors (if autograd is on)."""
    return x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)


def uses_kernel(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether :func:`linear` would run a kernel on these arguments: bfloat16 or float32, all of one dtype (the
    dtypes first: float64 and float16 layers pay one test)."""
    if x.dtype not in (torch.bfloat16, torch.float32) or weight.dtype != x.dtype:
        return False
    if bias is not None and (bias.dtype != x.dtype or bias.device.type != "cpu"):
        return False
    return _decode_call(x, weight, _asks_grad(x, weight, bias))


def uses_block_kernel() -> bool:
    """Whether ``tformer::decode_blocks`` (a decode step of whole blocks, :mod:`tformer.engine.fused`) may run: the
    kernels turned on and built (the tensors are :func:`tformer.engine.fused.applies`' to check)."""
    return _on and build.ready()


def uses_int8_kernel(x: Tensor, codes: Tensor) -> bool:
    """Whether :func:`int8_linear` may run on these arguments (as :func:`uses_kernel`; float32 ``x`` too)."""
    if x.dtype not in (torch.bfloat16, torch.float32) or codes.dtype != torch.int8:
        return False
    return _decode_call(x, codes, x.requires_grad)


def int8_linear(x: Tensor, codes: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """``(x (..., I) @ codes (O, I)^T) * scale (O,) + bias (O,) -> (..., O)`` in ``x``'s dtype, on the kernel (the
    caller checks :func:`uses_int8_kernel`)."""
    y = torch.ops.tformer.gemv_int8(x.reshape(-1, x.shape[-1]), codes, scale, bias)  # (M, O)
    return y.view(*x.shape[:-1], codes.shape[0])


def uses_attention_kernel(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float = 0.0
) -> bool:
    """Whether :func:`attention` may run on these arguments: turned on and built, CPU, 4-d float32 or bfloat16
    tensors of one dtype, at most :data:`MAX_ROWS` query rows, a boolean mask (or none), no dropout and no gradient
    asked for."""
    if not _on or dropout_p > 0.0 or query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return False
    if query.dtype not in (torch.float32, torch.bfloat16) or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if any(t.device.type != "cpu" for t in (query, key, value)) or query.shape[-2] > MAX_ROWS or query.shape[-1] > 1024:
        return False
    if attn_mask is not None and (attn_mask.dtype != torch.bool or attn_mask.device.type != "cpu"):
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    return build.ready()


def attention(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, is_causal: bool, scale: float | None
) -> Tensor:
    """``softmax(Q K^T * scale + mask) V`` for query ``(B, H, L, D)``, key ``(B, Hkv, S, D)``, value
    ``(B, Hkv, S, Dv)`` and a boolean mask broadcastable to ``(B, H, L, S)`` -> ``(B, H, L, Dv)``, on the decode
    kernel (the caller checks :func:`uses_attention_kernel`). ``is_causal``: query ``i`` sees keys ``j <= i``
    (top-left aligned, as :func:`tformer.attention.scaled_dot_product_attention`); a row that sees no key is zeros.
    Float32 inside, one rounding to the inputs' dtype."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.tformer.decode_attention(query, key, value, attn_mask, is_causal, scale)


@functools.cache
def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def uses_onednn(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether :func:`linear` would run oneDNN's float32 GEMM on these arguments: turned on (:func:`enabled`),
    float32 CPU tensors, contiguous, more than :func:`max_rows` rows of ``x`` (fewer: the matrix-vector kernel) and
    at least :data:`ONEDNN_MIN_MACS` multiply-adds, no gradient asked for, not inside a graph ``torch.compile`` is
    tracing, and PyTorch built with oneDNN."""
    if not _on or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() < 2 or weight.dim() != 2:
        return False
    if x.device.type != "cpu" or weight.device.type != "cpu" or x.numel() <= max_rows(weight.dtype) * x.shape[-1]:
        return False
    if x.numel() * weight.shape[0] < ONEDNN_MIN_MACS:  # M * I * O multiply-adds
        return False
    if not (x.is_contiguous() and weight.is_contiguous()):
        return False
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu" or bias.dim() != 1):
        return False
    if torch.is_grad_enabled() and _asks_grad(x, weight, bias):
        return False
    # A graph being compiled keeps F.linear: inductor lowers this op only with the weight frozen into the graph, and
    # picks its own GEMM for F.linear.
    return not torch.compiler.is_compiling() and _onednn_available()


def _float32_route(x: Tensor, weight: Tensor, min_rows: int, wants_grad: bool) -> bool:
    """What both float32 routes check: turned on, a CPU whose bfloat16 GEMMs run as float32 (:func:`float32_gemms`),
    bfloat16 CPU ``x`` of at least ``min_rows`` rows against a matrix, no gradient asked for."""
    if not (_on and _float32_gemm) or x.dtype != torch.bfloat16 or x.dim() < 2 or weight.dim() != 2:
        return False
    if x.device.type != "cpu" or weight.device.type != "cpu" or x.numel() < min_rows * x.shape[-1]:
        return False
    return not (torch.is_grad_enabled() and wants_grad)


def uses_float32_gemm(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether :func:`linear` would run a bfloat16 GEMM as float32: bfloat16 CPU tensors, more than :func:`max_rows`
    rows, no gradient asked for, on a CPU where PyTorch has no oneDNN bfloat16 GEMM (no AVX-512, no AVX2-VNNI-2),
    whose ``F.linear`` is a plain loop there (BENCHMARKS.md). Bfloat16 products are exact in float32; float32 sums,
    one rounding."""
    if weight.dtype != torch.bfloat16:
        return False
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.device.type != "cpu" or bias.dim() != 1):
        return False
    return _float32_route(x, weight, max_rows(weight.dtype) + 1, _asks_grad(x, weight, bias))


def uses_float32_int8_gemm(x: Tensor, codes: Tensor) -> bool:
    """Whether an int8 product of :func:`tformer.quantize`'s, ``(x Q^T) s + b``, runs as a float32 GEMM on the exact
    codes (:func:`float32_gemm`): the route on (:func:`uses_float32_gemm`'s CPUs; :func:`float32_gemms`), bfloat16 CPU
    ``x`` of at least :data:`INT8_FLOAT32_MIN_ROWS` rows, no gradient asked for ``x``."""
    return codes.dtype == torch.int8 and _float32_route(x, codes, INT8_FLOAT32_MIN_ROWS, x.requires_grad)


def float32_gemm(x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """``(x (..., I) @ weight (O, I)^T) * scale (O,) + bias (O,) -> (..., O)`` in ``x``'s dtype through float32:
    :func:`linear` of bfloat16 tensors (:func:`uses_float32_gemm`), or int8 codes and their ``scale``
    (:func:`uses_float32_int8_gemm`; float32 prompts, :mod:`tformer.engine.quantization`). The weight converted
    :data:`FLOAT32_BLOCK_BYTES` at a time (exactly), MKL's float32 ``mm``, the scale and bias in float32, one
    rounding. ``mm`` and not oneDNN, the bias apart: inductor runs the same ops (``mm`` the same library call), so a
    compiled graph gives an eager call's bits."""
    xf = x.reshape(-1, x.shape[-1]).float()  # (M, I)
    rows = max(1, FLOAT32_BLOCK_BYTES // (4 * weight.shape[1]))
    if rows >= weight.shape[0]:
        y = xf @ weight.float().T  # (M, O)
    else:
        y = xf.new_empty(xf.shape[0], weight.shape[0])  # (M, O)
        for start in range(0, weight.shape[0], rows):
            y[:, start : start + rows] = xf @ weight[start : start + rows].float().T
    if scale is not None:
        y = y * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``: ``x (..., I) @ weight (O, I)^T + bias (O,) -> (..., O)``, through the kernel
    when :func:`uses_kernel` says so, through oneDNN when :func:`uses_onednn` does, as float32 when
    :func:`uses_float32_gemm` does."""
    if uses_kernel(x, weight, bias):
        op = torch.ops.tformer.gemv_bf16 if x.dtype == torch.bfloat16 else torch.ops.tformer.gemv_f32
        y = op(x.reshape(-1, x.shape[-1]), weight, bias)  # (M, O)
        return y.view(*x.shape[:-1], weight.shape[0])
    if uses_onednn(x, weight, bias):
        # private: no public API runs oneDNN's GEMM; the op is the one inductor's own lowering calls
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # no fused activation
    if uses_float32_gemm(x, weight, bias):
        return float32_gemm(x, weight, bias)
    return F.linear(x, weight, bias)
