"""Hand-written kernels where PyTorch's own leave the hardware idle in a CPU decode step: matrix-vector products in
bfloat16 and float32 (:func:`linear`) and with weight-only int8 (:func:`int8_linear`, for :func:`tformer.quantize`),
and attention for a few query rows (:func:`attention`).

Why. A decode step at batch 1 is a chain of matrix-vector products that reads every weight once per token, so its
speed is bounded by memory bandwidth / weight bytes. On the CPU, torch 2.13's bfloat16 ``F.linear`` streams the
weights at about 40% of the machine's bandwidth at one row (float32's MKL reaches about 90%), so bfloat16, with half
the bytes, decoded *slower* than float32. ``gemv.cpp`` streams them at 85-100% (BENCHMARKS.md "Matrix-vector
kernels"; ``benchmarks/gemv.py``). Its int8 form reads one byte per weight, widened in registers, at 50-65%: at half
the bytes the fixed start-up of each call weighs twice as much (still 1.2-1.3x ``torch._weight_int8pack_mm``).
Between the products, each layer attends one query row to its cache: PyTorch's CPU flash kernel spends ~40 us a
call on set-up made for long queries (~90 us on bfloat16 through its float32 route), a sixth of a compiled SmolLM2
step; ``attention.cpp`` does the same call in a few microseconds plus the arithmetic (BENCHMARKS.md "Attention kernel
for CPU decoding"; ``benchmarks/decode_attention.py``). MKL's one-row float32 GEMM streamed at about 90% of the
bandwidth on an Intel Xeon, 15-35% on an AMD EPYC (Zen 5), where ``gemv.cpp``'s float32 FMA loop streams at 77-90%
at 1-4 rows, 1.2-1.4x faster at the demo model's 64-256 KB matrices (BENCHMARKS.md "On AMD EPYC (Zen 5)").

And whole blocks. ``block.cpp`` runs a decode step of a stack of Llama-style blocks as one op,
``tformer::decode_blocks`` (:mod:`tformer.engine.fused` calls it): the products and the attention above, and between them,
in C++ on the calling thread, what the modules would have run as ~9 Python calls a block or, compiled, ~4 inductor
kernels (norms, RoPE, the cache write, SwiGLU, residual sums). ``kernels.h`` is what the three files share.

When. :func:`linear` runs the kernel for bfloat16 or float32 CPU inputs of at most :func:`max_rows` rows (``x``
flattened to ``(M, I)``; 4, 16 for int8 codes and for bfloat16 where its GEMMs run as float32) without gradients.
Float32 calls of more rows (prefill, an encoder's forward, evaluation) go to oneDNN's GEMM
(``torch.ops.mkldnn._linear_pointwise``, PyTorch's own, as inductor calls it) when gradient-free, outside a graph
being compiled, and of at least :data:`ONEDNN_MIN_MACS` multiply-adds (:func:`uses_onednn`): F.linear's float32
GEMM is MKL's, which on an AMD EPYC (Zen 5) ran at 90-180 GFLOP/s where oneDNN ran at 160-420 (MiniLM's embeddings
1.7-1.8x faster). Gradient-free bfloat16 calls of more rows run as float32 GEMMs on CPUs where PyTorch has no oneDNN
bfloat16 GEMM (:func:`uses_float32_gemm`; 7-8x faster there).
Everything else (training, float16 and float64, CUDA) goes to ``F.linear``. The kernel computes what ``F.linear``
computes up to the order of the float32 additions: the same products (a bfloat16 product is exact in float32),
float32 sums, in bfloat16 one rounding after the bias.
:func:`int8_linear` takes the same calls with int8 codes (bfloat16 or float32 activations): ``(x Q^T) s + b``,
float32 inside, one rounding; on AVX2 with an AMD CPU (``paths()["int8"] == "avx2_bits"``) the sum runs over the
codes' bits read as float32, ``(c + 128) x`` less ``128 sum(x)``, whose float32 error bound has ``|c| + 128`` for
``|c|`` (gemv.cpp's ``code_bits``).
:func:`attention` takes the attention calls of at most :data:`MAX_ROWS` query rows, float32 or bfloat16, with a
boolean mask or none and no gradient (:func:`uses_attention_kernel`; ``tformer.attention``'s ``sdpa`` backend asks):
float32 scores, softmax and weighted sum, one rounding.

Build. The C++ files are compiled for this CPU (``-march=native``) on first use, by ``torch.utils.cpp_extension``
(20-30 s; needs a C++ compiler, as ``torch.compile`` on the CPU does), and cached under ``TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``) under a name that hashes the source, the flags, torch's version and the
CPU's feature flags. When it cannot be built, one warning says why and :func:`linear` uses ``F.linear``: correct,
slower. ``TFORMER_KERNELS=0`` turns the kernels and the oneDNN route off (nothing is built); :func:`enabled` does
so in code (the benchmarks' A/B runs).

Shapes: M, I, O; B, H, Hkv, L, S, D, Dv (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

MAX_ROWS = 4  # up to this many rows of x the kernel beats F.linear (benchmarks/gemv.py); beyond, F.linear
# ... and this many for int8 codes, and bfloat16 weights where bfloat16 GEMMs run as float32 (_FLOAT32_GEMM): the
# kernel beat int8pack_mm at 8-16 rows (1.5-1.8x; 39-42x for float32 x) and the float32 route (1.8-5.3x), not AMX's
WIDE_ROWS = 16  # bfloat16 GEMM (0.55-0.87x; SmolLM2's layers, Zen 3 and an Intel Xeon; BENCHMARKS.md)
SOURCES = tuple(Path(__file__).with_name(name) for name in ("gemv.cpp", "attention.cpp", "block.cpp"))
HEADERS = (Path(__file__).with_name("kernels.h"),)  # not compiled on their own, but part of the build's hash
_STATE: dict[str, object] = {"ready": None, "error": None}  # ready: None = not tried yet, then True or False
_ON = [os.environ.get("TFORMER_KERNELS", "1") != "0"]
_ONEDNN: list[bool | None] = [None]  # PyTorch's oneDNN linear op: None = not looked up yet
# Below this many multiply-adds a float32 GEMM stays on F.linear: oneDNN's call (its primitive and a reorder of the
# weight, ~35-45 us) costs more than it saves (AMD EPYC Zen 5: 0.3-0.7x F.linear at 256 x 128 below 2^22, 1.2-1.4x
# at 2-4M, 1.5-2.4x from 8M; BENCHMARKS.md "oneDNN for float32 GEMMs of more rows").
ONEDNN_MIN_MACS = 1 << 22
# Whether bfloat16 GEMMs of more rows run as float32 (uses_float32_gemm): where PyTorch has no oneDNN bfloat16 GEMM
# on this CPU (asked once, here: a graph being traced cannot ask)
_FLOAT32_GEMM = [not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())]
# A bfloat16 GEMM run as float32 converts its weight this many bytes of float32 at a time (SmolLM2's layers in one
# block, its 49152 x 576 head in 14): a block the GEMM reads back from cache, and no float32 copy of a whole head.
FLOAT32_BLOCK_BYTES = 1 << 23
# From this many rows an int8 product runs as a float32 GEMM there (uses_float32_int8_gemm): against int8pack_mm at
# SmolLM2's shapes (Zen 3, bfloat16 x) 0.58-0.76x at 16 rows, 1.02-1.20x at 32, 1.26-1.32x at 64, 1.76-1.78x at 256.
INT8_FLOAT32_MIN_ROWS = 64


def _cpuinfo(*fields: str) -> str:
    """The first line of ``/proc/cpuinfo`` naming one of ``fields``; off Linux, ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(fields)), "")
    except OSError:
        return platform.processor()


def _cpu_flags() -> str:
    return _cpuinfo("flags", "Features")


def _cflags() -> list[str]:
    """The compiler flags; ``TFORMER_KERNEL_CFLAGS`` adds some (the tests build the portable path with
    ``-mno-avx512f``)."""
    return ["-O3", "-march=native", "-fopenmp", *os.environ.get("TFORMER_KERNEL_CFLAGS", "").split()]


def build_name(cflags: list[str]) -> str:
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS)))
    for part in (*cflags, torch.__version__, _cpu_flags()):
        digest.update(b"\0" + part.encode())
    return f"tformer_kernels_{digest.hexdigest()[:16]}"


def ready() -> bool:
    """Build (the first time on this machine) and load the kernel; ``True`` when :func:`linear` can use it. Never
    raises: a failed build is warned about once and remembered for the process."""
    if _STATE["ready"] is not None or torch.compiler.is_compiling():
        return _STATE["ready"] is True
    if not _ON[0]:
        return False
    cflags = _cflags()
    try:
        from torch.utils import cpp_extension

        name = build_name(cflags)
        if sys.stderr.isatty() and not _built(name):
            print("tformer: building the decode kernels for this CPU (once, 20-30 s)", file=sys.stderr)
        cpp_extension.load(
            name=name,
            sources=[str(source) for source in SOURCES],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        torch.library.register_fake("tformer::gemv_bf16")(_gemv_shape)
        torch.library.register_fake("tformer::gemv_int8")(_gemv_shape)
        torch.library.register_fake("tformer::gemv_f32")(_gemv_shape)
        torch.library.register_fake("tformer::decode_attention")(_attention_shape)
        torch.library.register_fake("tformer::decode_blocks")(_block_shape)
    except Exception as error:  # no compiler, an unsupported flag, a failed link: fall back, say so once
        lines = str(error).strip().splitlines() or [type(error).__name__]
        message = next((line.strip() for line in lines if "error:" in line), lines[0])[:300]  # the compiler's own
        _STATE.update(ready=False, error=message)
        warnings.warn(
            f"tformer: the decode kernels did not build ({message}); layers use F.linear and attention PyTorch's "
            "kernels (correct, slower). TFORMER_KERNELS=0 skips the attempt.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    for index, weights in enumerate(WEIGHT_KINDS):
        torch.ops.tformer.gemv_prefetch(_starting_prefetch_rows(weights), index)
    _STATE["ready"] = True
    return True


def _starting_prefetch_rows(weights: str) -> int:
    """:func:`default_prefetch_rows`, or where its environment variable is not a distance, the rule's, with a
    warning: a mistyped tuning setting must not cost the kernels."""
    try:
        return default_prefetch_rows(weights)
    except ValueError as error:
        rows = _rule_prefetch_rows(weights)
        warnings.warn(f"tformer: {error}; the kernels prefetch {rows} rows ahead instead", RuntimeWarning, stacklevel=3)
        return rows


def _built(name: str) -> bool:
    """Whether ``cpp_extension.load`` will find the library ``name`` already built (in the folder it builds in)."""
    from torch.utils import cpp_extension

    try:
        folder = cpp_extension._get_build_directory(name, verbose=False)  # private, but the rule torch follows
    except Exception:  # a later torch without it: say nothing rather than something wrong
        return True
    return (Path(folder) / f"{name}.so").is_file()


# The kinds of weights with a prefetch distance each, in the order of gemv.cpp's enum Weights, and the variable that
# sets each one's distance for a process.
_PREFETCH_VARIABLES = {
    "bfloat16": "TFORMER_PREFETCH_ROWS",
    "float32": "TFORMER_PREFETCH_ROWS_F32",
    "int8": "TFORMER_PREFETCH_ROWS_INT8",
}
WEIGHT_KINDS = tuple(_PREFETCH_VARIABLES)


def _check_weights(weights: str) -> None:
    if weights not in WEIGHT_KINDS:
        raise ValueError(f"weights={weights!r}: need one of {', '.join(map(repr, WEIGHT_KINDS))}")


def default_prefetch_rows(weights: str = "bfloat16") -> int:
    """The software prefetch distance the kernels start with for ``weights`` (``"bfloat16"``, ``"float32"`` or
    ``"int8"`` codes): ``TFORMER_PREFETCH_ROWS`` (bfloat16), ``TFORMER_PREFETCH_ROWS_F32`` or
    ``TFORMER_PREFETCH_ROWS_INT8`` if set (0 to 1024 rows; anything else is a ``ValueError``), else by the rule
    :func:`prefetch_rows` gives: 8 rows, except 0 on AMD CPUs for bfloat16 and float32, and for int8 on AMD CPUs
    without AVX-512. (Loading the kernels, a bad variable is warned about and the rule's distance used.)"""
    _check_weights(weights)
    name = _PREFETCH_VARIABLES[weights]
    value = os.environ.get(name)
    if value is None:
        return _rule_prefetch_rows(weights)
    if not value.isdigit() or int(value) > 1024:
        raise ValueError(f"{name}={value!r}: need a number of rows from 0 (no software prefetch) to 1024")
    return int(value)


def _rule_prefetch_rows(weights: str) -> int:
    if "AuthenticAMD" not in _cpu_vendor():
        return 8
    # AMD: none, but for the AVX-512 int8 loop (one row at a time, each code widened); AVX2's reads a thread's rows
    # of codes as four streams at batch 1, which the hardware's prefetchers follow better alone
    return 8 if weights == "int8" and "avx512f" in _cpu_flags().split() else 0


def _cpu_vendor() -> str:
    return _cpuinfo("vendor_id")


def prefetch_rows(rows: int | None = None, *, weights: str = "bfloat16") -> int:
    """How many rows of a weight matrix ahead each thread of a matrix-vector kernel asks the CPU for (a software
    prefetch into L2; 0: none, the hardware prefetchers alone), for one kind of ``weights``: ``"bfloat16"``,
    ``"float32"`` or ``"int8"`` codes; set it to ``rows`` (0 to 1024) if given. Returns the distance in force before
    the call (0 when the kernels are not built).

    The defaults (:func:`default_prefetch_rows`) follow what was measured on weights packed by
    :func:`tformer.engine.memory.pack_weights` (compiled SmolLM2-135M steps in paired bursts; the figures in gemv.cpp's
    ``prefetch_rows`` and BENCHMARKS.md): a loop that widens each code one row at a time needs the prefetch (AVX-512
    int8), the others do not on AMD CPUs (Zen 3 and 4: 0.85-0.92 of the time without it); on an Intel Xeon no
    prefetch was 10-20% slower (bfloat16). A setting of the process, read by every call
    (``benchmarks/decode_step.py`` compares settings burst by burst)."""
    _check_weights(weights)
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= 1024):
        raise ValueError(f"prefetch_rows: rows={rows!r}; need an int from 0 (no software prefetch) to 1024")
    if not ready():
        return 0
    return int(torch.ops.tformer.gemv_prefetch(-1 if rows is None else rows, WEIGHT_KINDS.index(weights)))


def _gemv_shape(x: Tensor, weight: Tensor, *rest) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])  # (M, O) from x (M, I), weight or int8 codes (O, I)


def _attention_shape(query: Tensor, key: Tensor, value: Tensor, mask, is_causal: bool, scale: float) -> Tensor:
    return query.new_empty(*query.shape[:-1], value.shape[-1])  # (B, H, L, Dv), contiguous


def _block_shape(x: Tensor, *args) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)  # x's shape; the caches change in place


def build_error() -> str | None:
    """Why the kernel did not build, or ``None``."""
    return _STATE["error"]  # type: ignore[return-value]


def paths() -> dict[str, str] | None:
    """The code paths the build took on this CPU, e.g. ``{"bf16": "avx512_bf16", "int8": "avx512_vnni"}``
    (``"avx512_vnni"``: one row of int8 codes summed in fixed point where x fits; ``"avx2"``, ``"avx2_bits"`` for int8
    codes read as float32 bits on AMD CPUs, else ``"portable"``); ``None`` when not built."""
    if not ready():
        return None
    return dict(part.split("=") for part in torch.ops.tformer.gemv_paths().split())


@contextlib.contextmanager
def switched(flag: list[bool], on: bool) -> Iterator[None]:
    """Set a one-element switch ``flag`` to ``on`` inside a ``with`` block, and back after it."""
    before = flag[0]
    flag[0] = on
    try:
        yield
    finally:
        flag[0] = before


def enabled(on: bool) -> contextlib.AbstractContextManager[None]:
    """Turn the kernels and the oneDNN route on or off inside a ``with`` block (for A/B measurements); compiled
    graphs guard on it."""
    return switched(_ON, on)


def float32_gemms(on: bool) -> contextlib.AbstractContextManager[None]:
    """Run bfloat16 GEMMs of more rows as float32 (:func:`uses_float32_gemm`) or not, inside a ``with`` block: the
    default is on where PyTorch has no oneDNN bfloat16 GEMM for this CPU (for A/B measurements, and tests of the route
    on any CPU); compiled graphs guard on it."""
    return switched(_FLOAT32_GEMM, on)


def max_rows(dtype: torch.dtype) -> int:
    """The most rows of ``x`` the matrix-vector kernels take for weights (or :mod:`tformer.engine.fused`, activations) of
    ``dtype``: :data:`WIDE_ROWS` for int8 codes, and for bfloat16 where :func:`float32_gemms` is on; else 4."""
    return WIDE_ROWS if dtype == torch.int8 or (_FLOAT32_GEMM[0] and dtype == torch.bfloat16) else MAX_ROWS


def _decode_call(x: Tensor, weight: Tensor, wants_grad: bool) -> bool:
    """The checks both kernels share: turned on, CPU tensors, a matrix, at most :func:`max_rows` rows of ``x``, no
    gradient asked for, and the kernel built."""
    if not _ON[0] or x.device.type != "cpu" or weight.device.type != "cpu" or x.dim() == 0 or weight.dim() != 2:
        return False
    if x.numel() > max_rows(weight.dtype) * x.shape[-1]:
        return False
    return not (torch.is_grad_enabled() and wants_grad) and ready()


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
    """Whether ``tformer::decode_blocks`` (a decode step of whole blocks, :mod:`tformer.engine.fused`) may run: the kernels
    turned on and built (the tensors are :func:`tformer.engine.fused.applies`' to check)."""
    return _ON[0] and ready()


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
    if not _ON[0] or dropout_p > 0.0 or query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return False
    if query.dtype not in (torch.float32, torch.bfloat16) or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if any(t.device.type != "cpu" for t in (query, key, value)) or query.shape[-2] > MAX_ROWS or query.shape[-1] > 1024:
        return False
    if attn_mask is not None and (attn_mask.dtype != torch.bool or attn_mask.device.type != "cpu"):
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    return ready()


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


def _onednn_available() -> bool:
    if _ONEDNN[0] is None:
        _ONEDNN[0] = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    return _ONEDNN[0]


def uses_onednn(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether :func:`linear` would run oneDNN's float32 GEMM on these arguments: turned on (:func:`enabled`),
    float32 CPU tensors, contiguous, more than :func:`max_rows` rows of ``x`` (fewer: the matrix-vector kernel) and
    at least :data:`ONEDNN_MIN_MACS` multiply-adds, no gradient asked for, not inside a graph ``torch.compile`` is
    tracing, and PyTorch built with oneDNN."""
    if not _ON[0] or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() < 2 or weight.dim() != 2:
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
    if not (_ON[0] and _FLOAT32_GEMM[0]) or x.dtype != torch.bfloat16 or x.dim() < 2 or weight.dim() != 2:
        return False
    if x.device.type != "cpu" or weight.device.type != "cpu" or x.numel() < min_rows * x.shape[-1]:
        return False
    return not (torch.is_grad_enabled() and wants_grad)


def uses_float32_gemm(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether :func:`linear` would run a bfloat16 GEMM as float32: bfloat16 CPU tensors, more than :func:`max_rows`
    rows, no gradient asked for, on a CPU where PyTorch has no oneDNN bfloat16 GEMM (``torch.ops.mkldnn.
    _is_mkldnn_bf16_supported()`` false: no AVX-512, no AVX2-VNNI-2, e.g. Zen 3). Its ``F.linear`` is a plain loop
    there: 35-48 ms for 512 rows at SmolLM2's shapes against 4-7 ms as float32 (BENCHMARKS.md "bfloat16 prefill on
    a CPU without bfloat16 arithmetic"). Bfloat16 products are exact in float32; float32 sums, one rounding."""
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
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # no fused activation
    if uses_float32_gemm(x, weight, bias):
        return float32_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


__all__ = [
    "FLOAT32_BLOCK_BYTES",
    "INT8_FLOAT32_MIN_ROWS",
    "MAX_ROWS",
    "WIDE_ROWS",
    "ONEDNN_MIN_MACS",
    "WEIGHT_KINDS",
    "attention",
    "build_error",
    "default_prefetch_rows",
    "enabled",
    "float32_gemms",
    "float32_gemm",
    "int8_linear",
    "linear",
    "max_rows",
    "paths",
    "prefetch_rows",
    "ready",
    "switched",
    "uses_attention_kernel",
    "uses_block_kernel",
    "uses_float32_gemm",
    "uses_float32_int8_gemm",
    "uses_int8_kernel",
    "uses_kernel",
    "uses_onednn",
]
