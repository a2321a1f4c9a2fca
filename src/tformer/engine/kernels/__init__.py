"""Hand-written C++ kernels for CPU decoding, where PyTorch's own leave the hardware idle: matrix-vector products in
bfloat16 and float32 (:func:`linear`) and with weight-only int8 codes (:func:`int8_linear`, for
:func:`tformer.quantize`), attention for a few query rows (:func:`attention`), and a decode step of whole
Llama-style blocks as one op (``tformer::decode_blocks``, :mod:`tformer.engine.fused`).

Why: a decode step at batch 1 reads every weight once per token, so it is bound by memory bandwidth, and PyTorch's
CPU ops spend their time on set-up made for larger problems (BENCHMARKS.md has the figures).

Contract: each kernel computes what the PyTorch op computes up to the order of the float32 additions: exact
products, float32 sums, one rounding to the inputs' dtype after the bias (README.md in this folder, "Rounding").

Build: compiled for this CPU on first use (:func:`ready`; a notice on stderr), by ``make`` during set-up, or on
demand by ``tformer kernels`` (``python -m tformer.engine.kernels``); needs a C++ compiler. Without one, or with
``TFORMER_KERNELS=0``, every call goes to PyTorch (correct, slower). :mod:`tformer.engine.kernels.build` builds
and loads; :mod:`tformer.engine.kernels.routes` decides which calls the kernels take.

Shapes: M, I, O; B, H, Hkv, L, S, D, Dv (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

from tformer.engine.kernels.build import (
    WEIGHT_KINDS,
    build_error,
    build_kernels,
    compiler,
    default_prefetch_rows,
    paths,
    prefetch_rows,
    ready,
)
from tformer.engine.kernels.routes import (
    FLOAT32_BLOCK_BYTES,
    INT8_FLOAT32_MIN_ROWS,
    MAX_ROWS,
    ONEDNN_MIN_MACS,
    WIDE_ROWS,
    attention,
    enabled,
    float32_gemm,
    float32_gemms,
    float32_gemms_on,
    int8_linear,
    is_enabled,
    linear,
    max_rows,
    uses_attention_kernel,
    uses_block_kernel,
    uses_float32_gemm,
    uses_float32_int8_gemm,
    uses_int8_kernel,
    uses_kernel,
    uses_onednn,
)

__all__ = [
    "FLOAT32_BLOCK_BYTES",
    "INT8_FLOAT32_MIN_ROWS",
    "MAX_ROWS",
    "ONEDNN_MIN_MACS",
    "WEIGHT_KINDS",
    "WIDE_ROWS",
    "attention",
    "build_kernels",
    "build_error",
    "compiler",
    "default_prefetch_rows",
    "enabled",
    "float32_gemm",
    "float32_gemms",
    "float32_gemms_on",
    "int8_linear",
    "is_enabled",
    "linear",
    "max_rows",
    "paths",
    "prefetch_rows",
    "ready",
    "uses_attention_kernel",
    "uses_block_kernel",
    "uses_float32_gemm",
    "uses_float32_int8_gemm",
    "uses_int8_kernel",
    "uses_kernel",
    "uses_onednn",
]
