"""tformer's CPU decode kernels (``tformer.engine.kernels``): they build; the matrix-vector kernels compute
``x W^T + b`` within the rounding bound of one rounding of a float32 sum (checked against float64) and the attention
kernel errs against float64 no more than PyTorch's own attention at the same precision; each takes exactly the calls
it is meant for, keeps autograd and ``torch.compile`` working, and everything falls back to PyTorch with a warning
when the build fails; without a C++ compiler the tests skip, saying so."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import platform
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from tformer import DecoderLM, TransformerConfig
from tformer.attention import scaled_dot_product_attention, sdpa_attention
from tformer.engine import kernels
from tformer.engine.apply import KernelLinear, accelerate, kernel_attention
from tformer.engine.quantization import Int8Linear

U_BF16 = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits)
U_F32 = 2.0**-24

SHAPES = [(1, 576, 576), (1, 1536, 77), (2, 100, 5), (3, 33, 64), (4, 8, 3), (4, 24, 300), (1, 1, 1)]  # (M, I, O)
SPLIT = (1, 576, 1001)  # rows of W split over two threads in blocks of 501 and 500 (kernels.h, parallel_blocks)


pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("kernels_built")]


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def code_offset() -> int:
    """128 where the int8 kernel reads the codes' bits (``avx2_bits``: it sums ``(c + 128) x`` and takes ``128 sum
    x`` off, so its float32 roundoff scales with ``|c| + 128``), else 0."""
    return 128 if kernels.paths()["int8"] == "avx2_bits" else 0


def int8_bound(x: torch.Tensor, layer: Int8Linear, offset: int, u: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 of ``(x Q^T) s + b`` and the bound on a kernel's error: the float32 sum, the scale and the bias err by
    at most ``delta = (I + 2) u32 (|x| (|Q| + offset)^T s + |b|)``; one rounding to a dtype of unit roundoff ``u``
    adds ``u (|exact| + delta)``."""
    xd, q, scale = x.double(), layer.codes.double(), layer.scale.double()
    bd = torch.zeros(q.shape[0], dtype=torch.float64) if layer.bias is None else layer.bias.double()
    exact = (xd @ q.T) * scale + bd
    delta = (x.shape[1] + 2) * U_F32 * ((xd.abs() @ (q.abs() + offset).T) * scale + bd.abs())
    return exact, u * (exact.abs() + delta) + delta


def case(m: int, i: int, o: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(m, i, generator=g), torch.randn(o, i, generator=g), torch.randn(o, generator=g)
    return x.bfloat16(), w.bfloat16(), b.bfloat16()


def rounding_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 value ``s`` and the bound on ``|y - s|`` for ``y = bf16(float32 sum + b)``: a float32 sum of I
    products (exact in float32) and the bias errs by at most ``delta = (I + 1) u32 (|x| |w|^T + |b|)``, one rounding
    to bfloat16 adds ``u16 (|s| + delta)``."""
    xd, wd = x.double(), w.double()
    bd = torch.zeros(w.shape[0], dtype=torch.float64) if b is None else b.double()
    s = xd @ wd.T + bd
    delta = (x.shape[-1] + 1) * U_F32 * (xd.abs() @ wd.abs().T + bd.abs())
    return s, U_BF16 * (s.abs() + delta) + delta


def test_the_kernel_builds_on_this_machine():
    assert kernels.ready(), kernels.build_error()
    paths = kernels.paths()
    assert paths["bf16"] in {"avx512_bf16", "avx2", "portable"}
    assert paths["int8"] in {"avx512_vnni", "avx512", "avx2", "avx2_bits", "portable"}
    assert paths["f32"] in {"avx512", "avx2", "portable"}


def test_the_build_notice_is_for_a_build_not_for_loading_a_built_library(tmp_path, monkeypatch):
    """ready() says "building ... 20-30 s" only when is_built is False: the library this process loaded is built; a
    name never built (in an empty extensions folder) is not."""
    build = kernels.build
    assert build.is_built(build.build_name(build.cflags()))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert not build.is_built(build.build_name(build.cflags()))


def test_a_build_says_so_on_stderr_when_stderr_is_not_a_terminal(tmp_path):
    """A build starts with a line on stderr whatever stderr is (here a pipe): a silent 20-30 s looks like a hang."""
    out = subprocess.run(
        [sys.executable, "-c", "from tformer.engine import kernels; kernels.ready()"],
        env={**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "tformer: building the decode kernels for this CPU (once, about 20-30 s) ..." in out.stderr


def test_the_kernels_command_builds_and_prints_the_paths():
    """``tformer kernels`` (the library is built already: it only loads it) prints one ``kind: path`` line each."""
    from tformer.cli import main

    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main(["kernels"]) == 0
    assert printed.getvalue().splitlines() == [f"{kind}: {path}" for kind, path in kernels.paths().items()]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", [*SHAPES, SPLIT], ids=lambda s: "x".join(map(str, s)))
def test_the_kernel_is_within_one_bfloat16_rounding_of_float64(shape, bias):
    x, w, b = case(*shape)
    b = b if bias else None
    s, bound = rounding_bound(x, w, b)
    y = torch.ops.tformer.gemv_bf16(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == s.shape
    assert ((y.double() - s).abs() <= bound).all()
    plain = (F.linear(x, w, b).double() - s).abs().max()  # the same products and one rounding: no worse than it
    assert (y.double() - s).abs().max() <= 2 * plain + 1e-30


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", [*SHAPES, (1, 128, 384), (2, 512, 700)], ids=lambda s: "x".join(map(str, s)))
def test_the_float32_kernel_is_within_a_float32_sums_roundoff_of_float64(shape, bias):
    """A float32 sum of I exact-in-float64 products and the bias errs by at most ``(I + 1) u32 (|x| |w|^T + |b|)``;
    (1, 128, 384) is one of the demo model's matrices run on the calling thread, (2, 512, 700) one split over
    threads."""
    g = torch.Generator().manual_seed(2)
    m, i, o = shape
    x, w, b = torch.randn(m, i, generator=g), torch.randn(o, i, generator=g), torch.randn(o, generator=g)
    b = b if bias else None
    y = torch.ops.tformer.gemv_f32(x, w, b)
    xd, wd = x.double(), w.double()
    bd = torch.zeros(o, dtype=torch.float64) if b is None else b.double()
    exact = xd @ wd.T + bd
    bound = (i + 1) * U_F32 * (xd.abs() @ wd.abs().T + bd.abs())
    assert y.dtype == torch.float32 and y.shape == (m, o)
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [*SHAPES, SPLIT], ids=lambda s: "x".join(map(str, s)))
def test_the_int8_kernel_is_within_one_rounding_of_float64(shape, dtype):
    """``(x Q^T) s + b`` against float64 of the dequantized matrix ``s Q``, within :func:`int8_bound` (``|Q| + 128``
    where the kernel reads the codes' bits, :func:`code_offset`)."""
    x, w, b = case(*shape, seed=1)
    layer = Int8Linear.from_weight(w.float(), b.float())
    x = x.to(dtype)
    exact, bound = int8_bound(x, layer, code_offset(), U_BF16 if dtype == torch.bfloat16 else U_F32)
    y = torch.ops.tformer.gemv_int8(x, layer.codes, layer.scale, layer.bias)
    assert y.dtype == dtype and ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("scale", [2.0**-100, 2.0**-60, 2.0**60, 2.0**100])
def test_the_int8_kernel_keeps_its_bound_at_any_scale_of_x(scale):
    """Reading the codes' bits, the kernel scales x by powers of two chosen from its largest value, so that the
    products are normal floats and nothing overflows whatever that value is: the same bound from x near 2^-100 (its
    results still normal floats) to 2^100."""
    x, w, b = case(2, 576, 300, seed=7)
    layer = Int8Linear.from_weight(w.float())
    x = x.float() * scale
    exact, bound = int8_bound(x, layer, code_offset(), U_F32)
    y = torch.ops.tformer.gemv_int8(x, layer.codes, layer.scale, None)
    assert torch.isfinite(y).all() and ((y.double() - exact).abs() <= bound).all()


def exact_rounded_once(x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``x Q^T`` for float32 rows ``x``, computed exactly and rounded once to float32: each row as integers ``X = x
    2^s`` (``s`` from the lowest set bit of its values, so that ``X`` is exact in int64), ``X Q^T`` in int64, rounded
    to float32 by the conversion, then times ``2^-s`` (exact in double)."""
    mantissa, exponent = torch.frexp(x.double())  # x = m 2^e, |m| in [0.5, 1): m 2^24 an integer for a float32
    m = (mantissa.abs() * 2**24).long()
    nonzero = m != 0
    lowest = torch.where(nonzero, exponent - 24 + torch.log2((m & -m).double()).long(), 1 << 20)  # its lowest set bit
    shift = torch.where(nonzero.any(dim=1, keepdim=True), -lowest.min(dim=1, keepdim=True).values, 0)
    big = (x.double() * torch.exp2(shift.double())).long()
    return (((big @ codes.long().T).float().double()) * torch.exp2(-shift.double())).float()


def test_the_int8_kernel_at_batch_1_sums_exactly_in_fixed_point_where_x_fits():
    """With AVX512-VNNI (``paths()["int8"] == "avx512_vnni"``) one row of x whose values fit a few bytes of fixed
    point after a shift is summed in integers: the dot product exactly, rounded once to float32, then times the
    scale (one fused multiply-add: one more rounding), whatever the number of columns (a block of 64 and what is left
    over), of rows (summed 16 at a time, then those left over: 300 rows are 9 groups and 6 on each of two threads)
    and threads. The rows here span 2^0 to 2^30 of bfloat16 magnitudes (two to five bytes), and a row of zeros (one
    byte: the scale times 0); a row spanning 2^45 does not fit and takes the widening loop, within its float32
    bound, and so does a row of no columns."""
    if kernels.paths()["int8"] != "avx512_vnni":
        pytest.skip("the fixed-point loop is built where the CPU has AVX512-VNNI")
    g = torch.Generator().manual_seed(11)
    for i, o in [(576, 300), (1536, 70), (100, 9), (64, 5), (17, 3), (1, 2)]:
        layer = Int8Linear.from_weight(torch.randn(o, i, generator=g))
        for span in (0, 8, 16, 24, 30, None):
            if span is None:
                x = torch.zeros(1, i)
            else:  # bfloat16 mantissas times 2^-e, e from 0 to span, the largest set (its exponent 0), signs mixed
                e = torch.randint(0, span + 1, (1, i), generator=g)
                e[0, 0] = 0
                signs = torch.randn(1, i, generator=g).sign()
                x = (signs * (1 + torch.rand(1, i, generator=g)) * torch.exp2(-e.float())).bfloat16().float()
            want = (exact_rounded_once(x, layer.codes).double() * layer.scale.double()).float()
            for dtype in (torch.float32, torch.bfloat16):
                for threads in (1, 2):
                    with num_threads(threads):
                        y = torch.ops.tformer.gemv_int8(x.to(dtype), layer.codes, layer.scale, None)
                    assert torch.equal(y, want.to(dtype)), (i, span, dtype, threads)
    layer = Int8Linear.from_weight(torch.randn(40, 576, generator=g))
    x = torch.randn(1, 576, generator=g).bfloat16().float()
    x[0, :2] = torch.tensor([2.0**20, 2.0**-25])  # 2^45 apart, 8-bit mantissas: more than five bytes
    exact, bound = int8_bound(x, layer, 0, U_F32)
    y = torch.ops.tformer.gemv_int8(x, layer.codes, layer.scale, None)
    assert ((y.double() - exact).abs() <= bound).all()
    bias = torch.randn(3, generator=g)  # no columns: each output its bias (sums of nothing), on either dtype
    for dtype in (torch.float32, torch.bfloat16):
        y = torch.ops.tformer.gemv_int8(torch.ones(1, 0, dtype=dtype), torch.ones(3, 0, dtype=torch.int8), bias, bias)
        assert torch.equal(y, bias.to(dtype)[None])


def test_the_int8_kernel_widens_the_codes_where_their_bits_would_not_be_exact():
    """Where reading the codes' bits would not be exact the kernel widens them (the bound with ``|Q|``): with
    denormals-are-zero set (``torch.set_flush_denormal(True)``, which would read the subnormal codes as 0; the
    64 x 576 matrix runs on the calling thread, whose MXCSR that sets), and where x has an infinity (2^T sum - 128
    sum x would be inf - inf): then the result is float64's, inf or nan column for column."""
    x, w, b = case(1, 576, 64, seed=8)
    layer = Int8Linear.from_weight(w.float(), b.float())
    x = x.float()
    exact, bound = int8_bound(x, layer, 0, U_F32)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no denormals-are-zero mode")
    try:
        y = torch.ops.tformer.gemv_int8(x, layer.codes, layer.scale, layer.bias)
    finally:
        torch.set_flush_denormal(False)
    assert ((y.double() - exact).abs() <= bound).all()
    x[0, 5] = float("inf")
    layer.codes[:8, 5] = 0  # inf * 0: nan in these rows, +-inf in the others
    exact = (x.double() @ layer.codes.double().T) * layer.scale.double() + layer.bias.double()
    y = torch.ops.tformer.gemv_int8(x, layer.codes, layer.scale, layer.bias)
    assert torch.equal(y.isnan(), exact.isnan()) and torch.equal(y[~y.isnan()].double(), exact[~exact.isnan()])


def test_the_software_prefetch_distance_is_a_setting_that_changes_no_result():
    """``prefetch_rows`` only changes which addresses are requested early: every kernel gives the same bits at any
    distance, including one past the end of a thread's rows (SPLIT: 500 and 501 rows a thread)."""
    x, w, b = case(*SPLIT)
    layer = Int8Linear.from_weight(w, b)
    kinds = kernels.WEIGHT_KINDS
    before = [kernels.prefetch_rows(weights=kind) for kind in kinds]
    assert before == [kernels.default_prefetch_rows(kind) for kind in kinds]
    results = []
    try:
        for rows in (0, 1, 8, 1024):
            settings = {"bfloat16": rows, "float32": 1024 - rows, "int8": rows // 2}  # the three settings apart
            for kind in kinds:
                kernels.prefetch_rows(settings[kind], weights=kind)
            assert {kind: kernels.prefetch_rows(weights=kind) for kind in kinds} == settings
            results.append(
                (
                    torch.ops.tformer.gemv_bf16(x, w, b),
                    torch.ops.tformer.gemv_bf16(x[:1], w, b),  # batch 1: its own loop (four streams on AVX2)
                    torch.ops.tformer.gemv_f32(x.float(), w.float(), b.float()),
                    torch.ops.tformer.gemv_int8(x, layer.codes, layer.scale, layer.bias),
                    torch.ops.tformer.gemv_int8(x[:1], layer.codes, layer.scale, layer.bias),
                )
            )
    finally:
        for kind, rows in zip(kinds, before, strict=True):
            kernels.prefetch_rows(rows, weights=kind)
    for other in results[1:]:
        assert all(torch.equal(a, c) for a, c in zip(results[0], other, strict=True))
    for bad in (-1, 1025, 2.0, True):
        with pytest.raises(ValueError, match="need an int from 0"):
            kernels.prefetch_rows(bad)
    with pytest.raises(ValueError, match="weights='int4': need one of 'bfloat16', 'float32', 'int8'"):
        kernels.prefetch_rows(weights="int4")


def test_any_thread_count_gives_the_bits_of_one_thread():
    """Each row of the output is one thread's sum, whichever thread takes it and however the rows are split, so any
    thread count gives the bits of one thread, for every kernel (3 and 5 threads: blocks of unequal count)."""
    x, w, b = case(3, 576, 4099, seed=7)
    layer = Int8Linear.from_weight(w, b)
    results = []
    for n in (1, 2, 3, 4, 5):
        with num_threads(n):
            results.append(
                (
                    torch.ops.tformer.gemv_bf16(x, w, b),
                    torch.ops.tformer.gemv_bf16(x[:1], w, b),  # batch 1: its own loop (four streams on AVX2)
                    torch.ops.tformer.gemv_f32(x.float(), w.float(), b.float()),
                    torch.ops.tformer.gemv_int8(x, layer.codes, layer.scale, layer.bias),
                    torch.ops.tformer.gemv_int8(x[:1], layer.codes, layer.scale, layer.bias),
                )
            )
    for other in results[1:]:
        assert all(torch.equal(a, c) for a, c in zip(results[0], other, strict=True))
    exact, bound = rounding_bound(x, w, b)
    assert ((results[1][0].double() - exact).abs() <= bound).all()


def cancelling_half(x: torch.Tensor, w: torch.Tensor, x_large: float, w_large: torch.Tensor, seed: int) -> None:
    """In place: at half of the columns (the same for every row of ``w``) ``x`` becomes ``x_large`` and each row of
    ``w`` +-``w_large`` in equal numbers, in an order of its own; the other half keeps its random values."""
    g = torch.Generator().manual_seed(seed)
    columns = torch.randperm(x.shape[1], generator=g)[: x.shape[1] // 2 // 2 * 2]
    x[:, columns] = x_large
    signs = torch.stack([w_large, -w_large]).repeat(len(columns) // 2)
    for row in w:
        row[columns] = signs[torch.randperm(len(columns), generator=g)]


@pytest.mark.parametrize("i, o", [SPLIT[1:], (576, 9), (100, 7), (17, 2), (8, 1)])
def test_a_row_of_a_batch_gets_the_bits_of_the_row_alone(i, o):
    """The bfloat16 kernel adds a row's products in the same order whatever the batch (batch 1 has a loop of its
    own: on AVX2 it reads a thread's rows as four streams, one from each quarter of its block), so each row
    of x (M, I) gets the bits it gets alone, in passes of up to 4 rows and past them. At half of the columns x is
    one and each row of W +-4096 in equal numbers, in an order of its own: float32's partial sums reach ~10^5 and
    cancel, and the other half (random x and W) is rounded at their scale, so any other order of the additions
    shows in the bfloat16 result (random data alone would hide it: a float32 roundoff rarely moves a bfloat16
    rounding)."""
    x, w, b = case(kernels.WIDE_ROWS, i, o, seed=3)  # the most rows a decode call brings (kernels.max_rows)
    cancelling_half(x, w, 1.0, torch.tensor(4096.0).bfloat16(), seed=4)
    alone = torch.cat([torch.ops.tformer.gemv_bf16(x[r : r + 1], w, b) for r in range(len(x))])
    for m in (2, 3, 4, 5, 6, 9, len(x)):
        assert torch.equal(torch.ops.tformer.gemv_bf16(x[:m], w, b), alone[:m])
    exact, bound = rounding_bound(x, w, b)
    assert ((alone.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("i, o", [SPLIT[1:], (576, 9), (100, 7), (40, 10), (17, 2), (16, 1)])
def test_an_int8_row_of_a_batch_gets_the_bits_of_the_row_alone(i, o):
    """The same for the int8 kernel where its loops add a row's products in one order whatever the batch: on AVX2
    (batch 1 reads a thread's rows as four streams, each row with the two chains of the batch loop; blocks of rows
    with 0-3 left over; where the codes' bits are read, both loops read them alike) and on the portable path. At
    half of the columns x is 1024 and each row of codes +-127 in equal numbers, in an order of its own: partial sums
    reach ~10^5, and the other half (random x, random codes) is rounded at their scale, so any other order of the
    float32 additions changes the float32 result (I = 17 and 16 are below the 32 columns the bits are read in)."""
    if kernels.paths()["int8"] in ("avx512", "avx512_vnni"):
        pytest.skip(
            "the AVX-512 int8 loops sum batch 1 in four chains (or exactly in fixed point, avx512_vnni) and "
            "batches in two: other bits, same bound"
        )
    x, w, b = case(kernels.WIDE_ROWS, i, o, seed=5)
    layer = Int8Linear.from_weight(w.float(), b.float())
    x = x.float()
    cancelling_half(x, layer.codes, 1024.0, torch.tensor(127, dtype=torch.int8), seed=6)

    def product(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.tformer.gemv_int8(rows, layer.codes, layer.scale, layer.bias)

    alone = torch.cat([product(x[r : r + 1]) for r in range(len(x))])
    for m in (2, 3, 4, 5, 6, 9, len(x)):
        assert torch.equal(product(x[:m]), alone[:m])
    exact, bound = int8_bound(x, layer, code_offset(), U_F32)
    assert ((alone.double() - exact).abs() <= bound).all()


def test_the_prefetch_default_follows_the_cpus_features(monkeypatch):
    """8 rows ahead for int8 codes on AVX-512 and for every kind on CPUs with AMX; none elsewhere."""

    def defaults(*flags: str) -> tuple[int, ...]:
        monkeypatch.setattr(kernels.build, "cpu_flags", lambda: {"fpu", "avx2", "fma", *flags})
        return tuple(kernels.default_prefetch_rows(kind) for kind in kernels.WEIGHT_KINDS)  # bfloat16, float32, int8

    assert defaults("avx512f", "avx512bw", "avx512_bf16") == (0, 0, 8)
    assert defaults() == (0, 0, 0)  # AVX2: four streams of codes too
    assert defaults("avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16") == (8, 8, 8)
    with pytest.raises(ValueError, match="weights='float16'"):
        kernels.default_prefetch_rows("float16")


def test_a_quantized_layer_decodes_on_the_int8_kernel_and_prefills_on_torchs():
    x, w, b = case(kernels.WIDE_ROWS + 4, 64, 24)  # more rows than the kernel takes on any CPU
    layer = Int8Linear.from_weight(w, b)
    with torch.no_grad():
        assert kernels.uses_int8_kernel(x[:1], layer.codes) and not kernels.uses_int8_kernel(x, layer.codes)
        step, prefill = layer(x[:1]), layer(x)
    assert torch.equal(step, kernels.int8_linear(x[:1], layer.codes, layer.scale, layer.bias))
    oracle = x.double() @ layer.dequantized().double().T + b.double()
    assert (step.double() - oracle[:1]).abs().max() <= 2 * (prefill.double() - oracle).abs().max()


def test_the_kernel_refuses_mismatched_arguments_by_name():
    x, w, b = case(2, 16, 8)
    with pytest.raises(RuntimeError, match="x has 16 columns, weight 15"):
        torch.ops.tformer.gemv_bf16(x, w[:, :15], None)
    with pytest.raises(RuntimeError, match="need bfloat16 x and weight"):
        torch.ops.tformer.gemv_bf16(x.float(), w, None)
    with pytest.raises(RuntimeError, match="bias of 8 values"):
        torch.ops.tformer.gemv_bf16(x, w, b[:7])
    codes = torch.zeros(8, 16, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="need 8 scales"):
        torch.ops.tformer.gemv_int8(x, codes, torch.ones(7), None)
    with pytest.raises(RuntimeError, match="need int8 codes"):
        torch.ops.tformer.gemv_int8(x, codes.float(), torch.ones(8), None)
    with pytest.raises(RuntimeError, match="need float32 x and weight"):
        torch.ops.tformer.gemv_f32(x, w, None)
    with pytest.raises(RuntimeError, match="float32 CPU bias of 8 values"):
        torch.ops.tformer.gemv_f32(x.float(), w.float(), b.float()[:7])


def test_linear_routes_only_gradient_free_bfloat16_and_float32_cpu_calls_of_few_rows_to_the_kernel():
    """At most max_rows(dtype) rows: 4 (MAX_ROWS), or 16 (WIDE_ROWS) for int8 codes (bfloat16 or float32 x) and for
    bfloat16 weights where bfloat16 GEMMs run as float32 (forced on and off here, so that any CPU checks both)."""
    x, w, b = case(kernels.WIDE_ROWS + 1, 32, 16)
    codes = torch.zeros(16, 32, dtype=torch.int8)
    wide = kernels.WIDE_ROWS
    with torch.no_grad():
        for route, rows in ((False, kernels.MAX_ROWS), (True, kernels.WIDE_ROWS)):
            with kernels.float32_gemms(route):
                assert kernels.max_rows(torch.bfloat16) == rows and kernels.max_rows(torch.int8) == wide
                assert kernels.max_rows(torch.float32) == kernels.MAX_ROWS
                assert kernels.uses_kernel(x[:rows], w, b)
                assert kernels.uses_kernel(x[None, :rows], w)  # leading dims are flattened: still `rows` rows
                assert not kernels.uses_kernel(x[: rows + 1], w)  # one row more: a GEMM
                for xs in (x, x.float()):
                    assert kernels.uses_int8_kernel(xs[:wide], codes) and not kernels.uses_int8_kernel(xs, codes)
                assert kernels.uses_kernel(x[: kernels.MAX_ROWS].float(), w.float(), b.float())
                assert not kernels.uses_kernel(x[: kernels.MAX_ROWS + 1].float(), w.float(), b.float())
        x = x[: kernels.MAX_ROWS]
        assert kernels.uses_kernel(x.float(), w.float(), b.float())
        assert torch.equal(
            kernels.linear(x.float(), w.float(), b.float()), torch.ops.tformer.gemv_f32(x.float(), w.float(), b.float())
        )
        assert torch.equal(kernels.linear(x, w, b), torch.ops.tformer.gemv_bf16(x, w, b))
        for other in (torch.float16, torch.float64):
            assert not kernels.uses_kernel(x.to(other), w.to(other), b.to(other))
        assert not kernels.uses_kernel(x, w, b.float())  # one dtype for all three
        assert not kernels.uses_kernel(x.float(), w, b)
        with kernels.enabled(False):
            assert not kernels.uses_kernel(x, w, b)
    w.requires_grad_(True)
    assert not kernels.uses_kernel(x, w, b)  # training: autograd needs F.linear
    with torch.no_grad(), kernels.float32_gemms(False):
        assert kernels.uses_kernel(x, w, b)
        many = torch.cat([x, x[:1]])
        assert torch.equal(kernels.linear(many, w, b), F.linear(many, w, b))  # the fallback is F.linear itself


def test_large_gradient_free_float32_gemms_go_to_onednn_within_a_float32_sums_roundoff():
    """Rows past MAX_ROWS with at least ONEDNN_MIN_MACS multiply-adds: oneDNN's GEMM, which errs against float64 by
    no more than a float32 sum of I products may, ``(I + 1) u32 (|x| |w|^T + |b|)``; smaller ones, gradients, other
    dtypes, non-contiguous inputs or the kernels turned off: F.linear itself."""
    if not kernels.routes._onednn_available():
        pytest.skip("this PyTorch has no oneDNN")
    g = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(2, 64, 384, generator=g), torch.randn(1152, 384, generator=g), torch.randn(1152, generator=g)
    assert x.numel() * w.shape[0] >= kernels.ONEDNN_MIN_MACS
    with torch.no_grad():
        assert kernels.uses_onednn(x, w, b) and kernels.uses_onednn(x, w)
        y = kernels.linear(x, w, b)
        xd, wd, bd = x.double(), w.double(), b.double()
        exact = xd @ wd.T + bd
        bound = 385 * U_F32 * (xd.abs() @ wd.abs().T + bd.abs())
        assert y.shape == (2, 64, 1152) and y.dtype == torch.float32 and ((y.double() - exact).abs() <= bound).all()
        small = x[0, : kernels.ONEDNN_MIN_MACS // (384 * 1152)]  # contiguous, more than MAX_ROWS, below the threshold
        assert small.is_contiguous() and small.shape[0] > kernels.MAX_ROWS
        assert not kernels.uses_onednn(small, w, b) and torch.equal(kernels.linear(small, w, b), F.linear(small, w, b))
        assert not kernels.uses_onednn(x[:, :1], w, b)  # a decode step: the matrix-vector kernel
        assert not kernels.uses_onednn(x.transpose(0, 1), w, b)
        assert not kernels.uses_onednn(x.double(), w.double(), b.double())
        with kernels.enabled(False):
            assert not kernels.uses_onednn(x, w, b)
    w.requires_grad_(True)
    assert not kernels.uses_onednn(x, w, b)  # training: autograd needs F.linear
    assert torch.equal(kernels.linear(x, w, b), F.linear(x, w, b))


def test_bfloat16_gemms_without_onednn_bfloat16_run_as_float32_within_one_rounding(monkeypatch):
    """On a CPU where PyTorch has no oneDNN bfloat16 GEMM (forced here, so that any CPU checks the route), gradient-
    free bfloat16 calls of more than MAX_ROWS rows run as float32 GEMMs, the weight converted in blocks (a small
    block here: 1001 rows in blocks of 100, the last of 1): each output errs against float64 by at most a float32 sum
    of I exact products, ``(I + 1) u32 (|x| |w|^T + |b|)``, plus its one rounding to bfloat16, ``u_bf16 |y|``.
    Where PyTorch has the oneDNN GEMM, for a decode step's rows, with a gradient asked for or the kernels off:
    F.linear itself."""
    monkeypatch.setattr(kernels, "FLOAT32_BLOCK_BYTES", 100 * 4 * 384)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 40, 384, generator=g).bfloat16()
    w, b = torch.randn(1001, 384, generator=g).bfloat16(), torch.randn(1001, generator=g).bfloat16()
    with torch.no_grad(), kernels.float32_gemms(True):
        assert kernels.uses_float32_gemm(x, w, b) and kernels.uses_float32_gemm(x, w)
        xd, wd, bd = x.double(), w.double(), b.double()
        for bias, exact_bias in ((b, bd), (None, torch.zeros_like(bd))):
            y = kernels.linear(x, w, bias)
            exact = xd @ wd.T + exact_bias
            bound = 385 * U_F32 * (xd.abs() @ wd.abs().T + exact_bias.abs()) + U_BF16 * exact.abs()
            assert y.shape == (2, 40, 1001) and y.dtype == torch.bfloat16
            assert ((y.double() - exact).abs() <= bound).all()
        step = x[:, :2]  # 4 rows: the matrix-vector kernel
        assert not kernels.uses_float32_gemm(step, w, b) and kernels.uses_kernel(step, w, b)
        assert not kernels.uses_float32_gemm(x, w, b.float())  # F.linear refuses mixed dtypes: its error stays
        assert not kernels.uses_float32_gemm(x.float(), w.float(), b.float())
        with kernels.enabled(False):
            assert not kernels.uses_float32_gemm(x, w, b)
            assert torch.equal(kernels.linear(x, w, b), F.linear(x, w, b))
        with kernels.float32_gemms(False):
            assert not kernels.uses_float32_gemm(x, w, b)
            assert torch.equal(kernels.linear(x, w, b), F.linear(x, w, b))
    w.requires_grad_(True)
    with kernels.float32_gemms(True):
        assert not kernels.uses_float32_gemm(x, w, b)  # training: F.linear, whose backward autograd has
        assert torch.equal(kernels.linear(x, w, b), F.linear(x, w, b))


def test_a_compiled_bfloat16_gemm_run_as_float32_gives_eager_bits():
    """The float32 route compiles to the same library GEMM and the same float32 bias add and rounding: the same bits,
    so a compiled generation's tokens are eager's (with inductor's emulate_precision_casts, which StaticLM's backend
    sets, also where the input is rounded to bfloat16 inside the graph: ``x * 1.5`` here)."""
    g = torch.Generator().manual_seed(6)
    rows = kernels.WIDE_ROWS + 4  # more than the kernel takes
    x, w = torch.randn(rows, 24, generator=g).bfloat16(), torch.randn(40, 24, generator=g).bfloat16()
    b = torch.randn(40, generator=g).bfloat16()

    def scaled(x, w, b):
        return kernels.linear(x * 1.5, w, b)

    torch._dynamo.reset()
    with torch.no_grad(), kernels.float32_gemms(True):
        assert kernels.uses_float32_gemm(x * 1.5, w, b)
        compiled = torch.compile(scaled, fullgraph=True, options={"emulate_precision_casts": True})
        assert torch.equal(compiled(x, w, b), scaled(x, w, b))
    torch._dynamo.reset()


def test_a_compiled_graph_keeps_f_linear_where_eager_calls_onednn():
    """Inductor lowers oneDNN's linear only with the weight frozen into the graph (it fails on a weight passed in):
    a traced call takes F.linear, which inductor compiles with its own choice of GEMM."""
    x, w = torch.randn(64, 256), torch.randn(512, 256)
    targets = []

    def record(gm: torch.fx.GraphModule, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        assert kernels.uses_onednn(x, w) or not kernels.routes._onednn_available()
        y = torch.compile(kernels.linear, backend=record, fullgraph=True)(x, w)
    assert F.linear in targets and not any("mkldnn" in str(target) for target in targets)
    assert torch.equal(y, F.linear(x, w))


def test_the_layer_keeps_nn_linear_parameters_and_gradients():
    torch.manual_seed(0)
    layer, plain = KernelLinear(24, 10).bfloat16(), torch.nn.Linear(24, 10).bfloat16()
    plain.load_state_dict(layer.state_dict())
    assert isinstance(layer, torch.nn.Linear) and layer.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(3, 24).bfloat16()
    layer(x).float().square().sum().backward()
    plain(x).float().square().sum().backward()
    assert torch.equal(layer.weight.grad, plain.weight.grad) and torch.equal(layer.bias.grad, plain.bias.grad)


def bf16_lm() -> tuple[DecoderLM, DecoderLM]:
    torch.manual_seed(0)
    cfg = TransformerConfig.tiny(position="rotary", num_kv_heads=2, norm="rms", ffn="gated", activation="silu")
    model = DecoderLM(cfg).eval()
    return accelerate(copy.deepcopy(model).bfloat16()), model.double()  # the kernels applied (tformer.engine.apply)


def test_a_bfloat16_decode_step_through_the_kernel_errs_no_more_than_through_f_linear():
    lm, oracle = bf16_lm()
    ids = torch.randint(0, lm.cfg.vocab_size, (2, 9))  # 2 rows per step: the kernel's territory
    with torch.no_grad():
        exact = oracle(ids)[:, -1]
        errors = {}
        for on in (True, False):
            with kernels.enabled(on):
                cache = lm.new_cache()
                lm(ids[:, :-1], cache=cache)
                errors[on] = (lm(ids[:, -1:], cache=cache)[:, -1].double() - exact).abs().max()
    assert errors[True] <= 2 * errors[False]  # bfloat16 rounding dominates both; the kernel adds none of its own


def test_compiled_graphs_call_the_kernel_without_breaks():
    lm, _ = bf16_lm()
    assert kernels.ready()
    graphs = []

    def record(gm, example_inputs):
        graphs.append({str(node.target) for node in gm.graph.nodes})
        return gm.forward

    ids = torch.randint(0, lm.cfg.vocab_size, (1, 1))
    with torch.no_grad():
        torch.compile(lm, backend=record, fullgraph=True)(ids)
        assert len(graphs) == 1 and any("tformer.gemv_bf16" in target for target in graphs[0])
        assert any("tformer.decode_attention" in target for target in graphs[0])
        x, w, b = case(2, 40, 12)
        aot = torch.compile(kernels.linear, backend="aot_eager", fullgraph=True)  # traces the op's fake shapes
        assert torch.equal(aot(x, w, b), torch.ops.tformer.gemv_bf16(x, w, b))
        q, k, v, mask = attention_case((1, 4, 2, 1, 12, 16, 16), torch.bfloat16)
        attend = torch.compile(kernels.attention, backend="aot_eager", fullgraph=True)
        assert torch.equal(attend(q, k, v, mask, False, None), kernels.attention(q, k, v, mask, False, None))


# (B, H, Hkv, L, S, D, Dv): a SmolLM2 step (GQA 9/3), the demo model's, several query rows, odd sizes and tails, a
# group of 12 query heads a key/value head (the kernel takes them 4 at a time)
ATTENTION_SHAPES = [
    (1, 9, 3, 1, 320, 64, 64),
    (2, 12, 1, 2, 40, 16, 24),
    (2, 4, 4, 1, 384, 32, 32),
    (1, 4, 2, 3, 17, 8, 8),
    (3, 2, 1, 4, 5, 33, 20),
    (1, 1, 1, 1, 1, 1, 1),
    (1, 2, 2, 2, 40, 130, 144),
]


def attention_case(shape, dtype, seed=0):
    B, H, Hkv, L, S, D, Dv = shape
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H, L, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, Dv, generator=g)
    mask = torch.rand(B, 1, L, S, generator=g) < 0.7
    mask[0, 0, 0] = False  # one row sees no key: zeros by the library's convention
    return q.to(dtype), k.to(dtype), v.to(dtype), mask


@pytest.mark.parametrize("causal", [False, True], ids=["mask", "mask+causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_attention_kernel_errs_no_more_than_pytorchs_attention_against_float64(shape, dtype, causal):
    """Against float64 attention of the same (rounded) inputs. PyTorch's fused attention at the same precision is the
    plain path: the kernel's largest error is at most 2x its own (float32 sums, one rounding at the end), plus 4
    float32 ulps of the output's scale where both are that small (float32 inputs: a few roundings either way)."""
    q, k, v, mask = attention_case(shape, dtype)
    exact = scaled_dot_product_attention(q.double(), k.double(), v.double(), mask, causal, backend="reference")
    assert kernels.uses_attention_kernel(q, k, v, mask)
    out = kernels.attention(q, k, v, mask, causal, None)
    assert out.dtype == dtype and out.shape == exact.shape and out.is_contiguous()
    assert torch.equal(out[0, :, 0], torch.zeros_like(out[0, :, 0]))  # the row that sees no key
    with kernels.enabled(False):
        plain = sdpa_attention(q, k, v, mask, causal)  # PyTorch's kernel, under the library's conventions
    seen = exact.abs().amax()
    error, plain_error = (out.double() - exact).abs().max(), (torch.nan_to_num(plain).double() - exact).abs().max()
    assert error <= 2 * plain_error + 4 * U_F32 * seen


@pytest.mark.parametrize("shape", [(2, 12, 3, 2, 70, 64, 48), (1, 12, 1, 1, 300, 64, 48)], ids=["rows", "pieces"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_query_heads_sharing_a_mask_attend_as_each_head_alone(dtype, shape):
    """Heads of one key/value head that share a mask go through the kernel together (each value row read once for
    the group); with a mask of their own, one by one. The per-head arithmetic is the same, in the same order: equal
    bitwise; also where a row's keys are cut into pieces (the cut does not depend on how heads go together)."""
    q, k, v, mask = attention_case(shape, dtype, seed=3)
    together = kernels.attention(q, k, v, mask, False, None)  # mask (B, 1, L, S): one mask for every head
    one_by_one = kernels.attention(q, k, v, mask.expand(-1, 12, -1, -1).contiguous(), False, None)
    assert torch.equal(together, one_by_one)


def long_rows_case(keys: int, seed: int):
    """One query row of 3 heads on one key/value head (B * Hkv * L = 1): the kernel cuts its keys into 4 pieces."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(1, 3, 1, 32, generator=g),
        torch.randn(1, 1, keys, 32, generator=g),
        torch.randn(1, 1, keys, 32, generator=g),
    )
    return q, k, v, torch.ones(1, 1, 1, keys, dtype=torch.bool)


@pytest.mark.parametrize("case", ["all", "left padding", "top in the last piece", "one key in the tail", "random"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_keys_cut_into_pieces_merge_to_its_softmax(case, dtype):
    """With few (batch, key/value head, query row)s, each row's keys are cut into pieces (the two threads of a
    SmolLM2 step would otherwise get 2 tasks and 1), each piece's sums taken against its own largest score and merged
    by rescaling. Pieces that see no key (left padding: the first 700 of 1000 keys masked), the largest score in the
    last piece (every piece's scale differs from the row's), a single visible key: the bound of the test against
    float64 above."""
    q, k, v, mask = long_rows_case(1000, seed=11)
    if case == "left padding":
        mask[..., :700] = False
    elif case == "top in the last piece":
        k[0, 0, 990] = 4 * q[0, 0, 0]  # a score ~4x the others' largest for head 0
    elif case == "one key in the tail":
        mask[..., :] = False
        mask[..., 871] = True
    elif case == "random":
        mask = torch.rand(1, 1, 1, 1000, generator=torch.Generator().manual_seed(2)) < 0.3
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    exact = scaled_dot_product_attention(q.double(), k.double(), v.double(), mask, backend="reference")
    out = kernels.attention(q, k, v, mask, False, None)
    with kernels.enabled(False):
        plain = sdpa_attention(q, k, v, mask)
    error, plain_error = (out.double() - exact).abs().max(), (plain.double() - exact).abs().max()
    assert error <= 2 * plain_error + 4 * U_F32 * exact.abs().amax()
    if case == "one key in the tail":
        assert torch.equal(out[0, :, 0], v[0, 0, 871].expand(3, 32))  # softmax over one key: that key's value


def test_a_split_row_propagates_nan_from_any_piece_and_gives_the_same_bits_on_any_thread_count():
    """A NaN score in one piece makes the row NaN (as PyTorch's softmax); a NaN value behind a masked key does not.
    The cut depends on the shapes alone, so one and two threads give the same bits."""
    q, k, v, mask = long_rows_case(600, seed=4)
    spoiled = k.clone()
    spoiled[0, 0, 400, 0] = float("nan")  # in the third of four pieces of 150 keys
    assert kernels.attention(q, spoiled, v, mask, False, None).isnan().all()
    v_nan = v.clone()
    v_nan[0, 0, 100] = float("nan")
    mask[..., 100] = False
    assert not kernels.attention(q, k, v_nan, mask, False, None).isnan().any()
    outs = []
    for n in (1, 2):
        with num_threads(n):
            outs.append(kernels.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, False, None))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_the_attention_kernel_stops_at_each_rows_last_visible_key(layout):
    """A static cache's mask: row r sees its first ``length_r`` columns, the rest are unwritten (the kernel skips
    the keys after a row's last visible one, scanning a contiguous mask eight bytes a read). Lengths on both sides of
    those eight-key words, the whole row and none, and one row whose only visible key lies alone far out in the tail;
    also a mask with columns ``L`` apart (a transposed view). Bound as in the test against float64 above."""
    B, H, Hkv, L, S, D = 2, 2, 1, 4, 41, 16
    g = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(B, H, L, D, generator=g),
        torch.randn(B, Hkv, S, D, generator=g),
        torch.randn(B, Hkv, S, D, generator=g),
    )
    lengths = torch.tensor([[0, 1, 7, 8], [9, 16, 17, S]])  # (B, L)
    mask = (torch.arange(S) < lengths[..., None]).unsqueeze(1)  # (B, 1, L, S)
    mask[0, 0, 0, S - 3] = True  # row (0, 0): a single visible key, 38 columns past an empty prefix
    if layout == "strided":
        mask = mask.transpose(-1, -2).contiguous().transpose(-1, -2)
        assert mask.stride(-1) == L
    exact = scaled_dot_product_attention(q.double(), k.double(), v.double(), mask, False, backend="reference")
    out = kernels.attention(q, k, v, mask, False, None)
    with kernels.enabled(False):
        plain = sdpa_attention(q, k, v, mask, False)
    error, plain_error = (out.double() - exact).abs().max(), (plain.double() - exact).abs().max()
    assert error <= 2 * plain_error + 4 * U_F32 * exact.abs().amax()
    assert torch.allclose(out[0, :, 0], v[0, 0, S - 3].expand(H, D))  # softmax over one key: that key's value


def test_the_attention_kernels_softmax_is_within_float32_roundings_over_the_exponents_range():
    """One-dimensional heads with ``q = 1``, ``scale = 1`` and ``V = I``: the output row is the softmax of the keys
    themselves, so it checks the kernel's exponential. Scores spread over [-80, 0] (every binade of exp it uses); each
    weight is one exp (a few ulps), one sum of S terms and one division: relative error <= (S + 8) u32."""
    S = 1000
    g = torch.Generator().manual_seed(3)
    scores = torch.cat([torch.zeros(1), -80 * torch.rand(S - 1, generator=g)])
    q, k = torch.ones(1, 1, 1, 1), scores.view(1, 1, S, 1)
    v = torch.eye(S).view(1, 1, S, S)
    probs = kernels.attention(q, k, v, None, False, 1.0).view(S).double()
    exact = torch.softmax(scores.double(), dim=0)
    assert ((probs - exact).abs() <= (S + 8) * U_F32 * exact).all()
    far = kernels.attention(
        q, torch.tensor([0.0, -200.0]).view(1, 1, 2, 1), torch.eye(2).view(1, 1, 2, 2), None, False, 1.0
    )
    assert far[0, 0, 0, 0] == 1.0 and 0 <= far[0, 0, 0, 1] <= 2e-38  # below float32's exp range: 0 or ~2^-126


def test_attention_routes_only_gradient_free_cpu_calls_of_few_query_rows_with_boolean_masks_to_the_kernel():
    q, k, v, mask = attention_case((1, 4, 2, kernels.MAX_ROWS, 12, 16, 16), torch.float32)
    with torch.no_grad():
        assert kernels.uses_attention_kernel(q, k, v, mask) and kernels.uses_attention_kernel(q, k, v, None)
        assert kernels.uses_attention_kernel(q, k, v, mask[0, 0])  # broadcastable masks of fewer dimensions
        assert torch.equal(kernel_attention(q, k, v, mask), kernels.attention(q, k, v, mask, False, None))
        assert torch.equal(kernel_attention(q, k, v, mask[0, 0]), kernels.attention(q, k, v, mask, False, None))
        longer = torch.cat([q, q[:, :, :1]], dim=2)
        assert not kernels.uses_attention_kernel(longer, k, v, None)  # one query row more: PyTorch's kernel
        assert not kernels.uses_attention_kernel(q, k, v, torch.zeros(mask.shape))  # additive masks: PyTorch's
        assert not kernels.uses_attention_kernel(q.half(), k.half(), v.half(), mask)
        assert not kernels.uses_attention_kernel(q, k, v, mask, dropout_p=0.1)
        assert not kernels.uses_attention_kernel(q[0], k[0], v[0], mask[0])  # 3-d: PyTorch's
        with kernels.enabled(False):
            assert not kernels.uses_attention_kernel(q, k, v, mask)
    assert not kernels.uses_attention_kernel(q.requires_grad_(), k, v, mask)  # training: autograd needs PyTorch's
    with torch.no_grad():
        assert kernels.uses_attention_kernel(q, k, v, mask)


def test_the_attention_kernel_propagates_nan_like_pytorchs():
    """A NaN in the query or a visible key makes the row NaN (a model with a NaN weight must not decode to
    numbers: the CLI reports it); a NaN value at a masked key is never read."""
    q, k, v, mask = attention_case((1, 2, 1, 1, 6, 8, 8), torch.float32)
    mask = torch.ones_like(mask)
    for bad in (q, k):
        spoiled = bad.clone()
        spoiled.view(-1)[0] = float("nan")
        args = (spoiled, k, v) if bad is q else (q, spoiled, v)
        out = kernels.attention(*args, mask, False, None)
        with kernels.enabled(False):
            plain = sdpa_attention(*args, mask)
        assert torch.equal(out.isnan(), plain.isnan()) and out.isnan().any()
    v = v.clone()
    v[0, 0, 5] = float("nan")
    mask[..., 5] = False
    assert not kernels.attention(q, k, v, mask, False, None).isnan().any()


def test_the_attention_kernel_refuses_mismatched_arguments_by_name():
    q, k, v, mask = attention_case((1, 4, 2, 1, 12, 16, 16), torch.float32)
    op = torch.ops.tformer.decode_attention
    with pytest.raises(RuntimeError, match="must divide"):
        op(q[:, :3], k, v, mask, False, 0.25)
    with pytest.raises(RuntimeError, match="one dtype"):
        op(q, k.bfloat16(), v, mask, False, 0.25)
    with pytest.raises(RuntimeError, match="boolean mask"):
        op(q, k, v, mask.float(), False, 0.25)
    with pytest.raises(RuntimeError, match="head size"):
        op(q, k[..., :8], v, mask, False, 0.25)


CHILD = textwrap.dedent(
    """
    import json, warnings, torch
    import torch.nn.functional as F
    from tformer.engine import kernels
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ready = kernels.ready()
    g = torch.Generator().manual_seed(0)
    within, within_int8, within_f32, first = True, None, None, None
    for m, k, n in ((3, 100, 7), (1, 576, 9), (5, 40, 6)):  # (rows of x, K, N): a tail, the unrolled loop, 4 + 1 rows
        x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
        with torch.no_grad():
            y = kernels.linear(x, w)
        first = first or (x, w, y)
        s = x.double() @ w.double().T
        bound = 2.0**-8 * s.abs() + (k + 1) * 2.0**-24 * (1 + 2.0**-8) * (x.double().abs() @ w.double().abs().T)
        within &= bool(((y.double() - s).abs() <= bound).all())
        if ready:  # the int8 form of the same build, against float64 of its dequantized matrix
            from tformer.engine.quantization import Int8Linear
            layer = Int8Linear.from_weight(w)
            yq = torch.ops.tformer.gemv_int8(x, layer.codes, layer.scale, None)
            xd, qd, sd = x.double(), layer.codes.double(), layer.scale.double()
            exact = (xd @ qd.T) * sd
            offset = 128 if kernels.paths()["int8"] == "avx2_bits" else 0  # test_kernels.code_offset
            delta = (k + 2) * 2.0**-24 * (xd.abs() @ (qd.abs() + offset).T) * sd
            ok = bool(((yq.double() - exact).abs() <= 2.0**-8 * (exact.abs() + delta) + delta).all())
            within_int8 = ok if within_int8 is None else within_int8 and ok
            xf, wf = x.float(), w.float()  # the float32 form: a float32 sum's roundoff
            yf = torch.ops.tformer.gemv_f32(xf, wf, None)
            sf = xf.double() @ wf.double().T
            bound = (k + 1) * 2.0**-24 * (xf.double().abs() @ wf.double().abs().T)
            ok = bool(((yf.double() - sf).abs() <= bound).all())
            within_f32 = ok if within_f32 is None else within_f32 and ok
    rows_alone = None
    if ready:  # each row of a batch gets the bits it gets alone (batch 1 has a loop of its own)
        x, w = torch.randn(5, 576, generator=g).bfloat16(), torch.randn(9, 576, generator=g).bfloat16()
        alone = torch.cat([torch.ops.tformer.gemv_bf16(x[r : r + 1], w, None) for r in range(5)])
        rows_alone = torch.equal(torch.ops.tformer.gemv_bf16(x, w, None), alone)
    attention_within = None
    if ready:  # the attention kernel of the same build: float32, against float64, at most 2x PyTorch's error
        from tformer.attention import scaled_dot_product_attention
        q, k, v = (torch.randn(1, 4, 1, 40, generator=g), torch.randn(1, 2, 50, 40, generator=g),
                   torch.randn(1, 2, 50, 40, generator=g))
        mask = torch.rand(1, 1, 1, 50, generator=g) < 0.7
        exact = scaled_dot_product_attention(q.double(), k.double(), v.double(), mask, backend="reference")
        plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        error = (kernels.attention(q, k, v, mask, False, None).double() - exact).abs().max()
        attention_within = bool(error <= 2 * (plain.double() - exact).abs().max() + 4 * 2.0**-24 * exact.abs().max())
    fused_within = None
    if ready:  # a Llama-style block's decode step as one op (float32): the modules' logits, up to addition order
        from tformer import DecoderLM, TransformerConfig
        from tformer.engine import fused
        from tformer.generation.static import StaticLM
        torch.manual_seed(0)
        cfg = TransformerConfig.tiny(position="rotary", norm="rms", ffn="gated", activation="silu", num_kv_heads=2)
        lm = DecoderLM(cfg).eval()
        with torch.no_grad():
            for p in lm.parameters():
                p.normal_(1.0 if p.dim() == 1 else 0.0, 0.3)
        steps = []
        for on in (True, False):
            with fused.enabled(on), torch.inference_mode():
                decoding = StaticLM(lm, torch.tensor([[3, 5, 7]]), None, max_new_tokens=3, compile=False)
                decoding.prefill()
                steps.append(decoding.step(torch.tensor([4])))
        fused_within = bool((steps[0] - steps[1]).abs().max() < 1e-5)
    print(json.dumps({"ready": ready, "paths": kernels.paths(), "warnings": [str(c.message) for c in caught],
                      "within": within, "within_int8": within_int8, "within_f32": within_f32,
                      "attention_within": attention_within, "fused_within": fused_within, "rows_alone": rows_alone,
                      "is_f_linear": bool(torch.equal(first[2], F.linear(first[0], first[1])))}))
    """
)


def child(script: str = CHILD, /, **env: str) -> dict:
    """Run ``script`` in a fresh interpreter with ``env`` added; the JSON its last line prints."""
    out = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def _has_avx2_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in {"x86_64", "AMD64"}, reason="-mno-avx512f is an x86 flag")
@pytest.mark.parametrize("cflags", ["-mno-avx512f", "-mno-avx2"])
def test_the_paths_without_avx512_build_and_are_within_the_same_bound(cflags):
    """Built without AVX-512 (so no dpbf16) the kernels take the AVX2 + FMA path where the CPU has it; without AVX2
    too, the portable C++ one. Each meets the bounds the native build's tests hold it to."""
    result = child(TFORMER_KERNEL_CFLAGS=cflags)
    assert result["ready"] and result["within"] and result["within_int8"] and result["within_f32"]
    assert result["attention_within"] and result["fused_within"] and result["rows_alone"] and not result["warnings"]
    path = "avx2" if cflags == "-mno-avx512f" and _has_avx2_fma() else "portable"
    int8 = {path, "avx2_bits"} if path == "avx2" else {path}  # the codes' bits on AMD CPUs
    assert result["paths"]["bf16"] == result["paths"]["f32"] == path and result["paths"]["int8"] in int8


@pytest.mark.slow
def test_a_failed_build_warns_once_and_falls_back_to_f_linear(tmp_path):
    result = child(CXX="/bin/false", TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert not result["ready"] and result["paths"] is None and result["is_f_linear"]
    assert len(result["warnings"]) == 1 and "did not build" in result["warnings"][0]
    assert "TFORMER_KERNELS=0" in result["warnings"][0]


def test_tformer_kernels_0_builds_nothing(tmp_path):
    result = child(TFORMER_KERNELS="0", TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert not result["ready"] and result["is_f_linear"] and not result["warnings"]
    assert not any(tmp_path.iterdir())
