"""The bfloat16 matrix-vector kernel (``tformer.kernels``): it builds, computes ``x W^T + b`` within the rounding
bound of one bfloat16 rounding of a float32 sum (checked against float64), takes exactly the calls it is meant for,
keeps autograd and ``torch.compile`` working, and falls back to ``F.linear`` with a warning when it cannot build."""

from __future__ import annotations

import copy
import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from tformer import DecoderLM, TransformerConfig, kernels
from tformer.layers import Linear
from tformer.quantization import Int8Linear

U_BF16 = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits)
U_F32 = 2.0**-24

SHAPES = [(1, 576, 576), (1, 1536, 77), (2, 100, 5), (3, 33, 64), (4, 8, 3), (4, 24, 300), (1, 1, 1)]  # (M, I, O)


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
    assert paths["bf16"] in {"avx512_bf16", "portable"} and paths["int8"] in {"avx512", "portable"}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_kernel_is_within_one_bfloat16_rounding_of_float64(shape, bias):
    x, w, b = case(*shape)
    b = b if bias else None
    s, bound = rounding_bound(x, w, b)
    y = torch.ops.tformer.gemv_bf16(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == s.shape
    assert ((y.double() - s).abs() <= bound).all()
    plain = (F.linear(x, w, b).double() - s).abs().max()  # the same products and one rounding: no worse than it
    assert (y.double() - s).abs().max() <= 2 * plain + 1e-30


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_int8_kernel_is_within_one_rounding_of_float64(shape, dtype):
    """``(x Q^T) s + b`` against float64 of the dequantized matrix ``s Q``: the float32 sum, the scale and the bias err
    by at most ``delta = (I + 2) u32 (|x| |Q|^T s + |b|)``, one rounding to ``dtype`` adds ``u (|exact| + delta)``."""
    x, w, b = case(*shape, seed=1)
    layer = Int8Linear.from_weight(w.float(), b.float())
    x = x.to(dtype)
    xd, q, scale, bd = x.double(), layer.codes.double(), layer.scale.double(), b.float().double()
    exact = (xd @ q.T) * scale + bd
    delta = (shape[1] + 2) * U_F32 * ((xd.abs() @ q.abs().T) * scale + bd.abs())
    u = U_BF16 if dtype == torch.bfloat16 else U_F32
    y = torch.ops.tformer.gemv_int8(x, layer.codes, layer.scale, b.float())
    assert y.dtype == dtype and ((y.double() - exact).abs() <= u * (exact.abs() + delta) + delta).all()


def test_a_quantized_layer_decodes_on_the_int8_kernel_and_prefills_on_torchs():
    x, w, b = case(8, 64, 24)
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


def test_linear_routes_only_gradient_free_bfloat16_cpu_calls_of_few_rows_to_the_kernel():
    x, w, b = case(kernels.MAX_ROWS, 32, 16)
    with torch.no_grad():
        assert kernels.uses_kernel(x, w, b)
        assert kernels.uses_kernel(x[None], w)  # leading dims are flattened: still MAX_ROWS rows
        assert not kernels.uses_kernel(torch.cat([x, x[:1]]), w)  # one row more: F.linear's GEMM
        assert not kernels.uses_kernel(x.float(), w.float(), b.float())
        assert not kernels.uses_kernel(x, w, b.float())
        with kernels.enabled(False):
            assert not kernels.uses_kernel(x, w, b)
    w.requires_grad_(True)
    assert not kernels.uses_kernel(x, w, b)  # training: autograd needs F.linear
    with torch.no_grad():
        assert kernels.uses_kernel(x, w, b)
        many = torch.cat([x, x[:1]])
        assert torch.equal(kernels.linear(many, w, b), F.linear(many, w, b))  # the fallback is F.linear itself


def test_the_layer_keeps_nn_linear_parameters_and_gradients():
    torch.manual_seed(0)
    layer, plain = Linear(24, 10).bfloat16(), torch.nn.Linear(24, 10).bfloat16()
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
    return copy.deepcopy(model).bfloat16(), model.double()


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
        x, w, b = case(2, 40, 12)
        aot = torch.compile(kernels.linear, backend="aot_eager", fullgraph=True)  # traces the op's fake shapes
        assert torch.equal(aot(x, w, b), torch.ops.tformer.gemv_bf16(x, w, b))


CHILD = textwrap.dedent(
    """
    import json, warnings, torch
    import torch.nn.functional as F
    from tformer import kernels
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ready = kernels.ready()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 100, generator=g).bfloat16(), torch.randn(7, 100, generator=g).bfloat16()
    with torch.no_grad():
        y = kernels.linear(x, w)
    s = x.double() @ w.double().T
    bound = 2.0**-8 * s.abs() + 101 * 2.0**-24 * (1 + 2.0**-8) * (x.double().abs() @ w.double().abs().T)
    within_int8 = None
    if ready:  # the int8 form of the same build, against float64 of its dequantized matrix
        from tformer.quantization import Int8Linear
        layer = Int8Linear.from_weight(w)
        yq = torch.ops.tformer.gemv_int8(x, layer.codes, layer.scale, None)
        xd, qd, sd = x.double(), layer.codes.double(), layer.scale.double()
        exact = (xd @ qd.T) * sd
        delta = 102 * 2.0**-24 * (xd.abs() @ qd.abs().T) * sd
        within_int8 = bool(((yq.double() - exact).abs() <= 2.0**-8 * (exact.abs() + delta) + delta).all())
    print(json.dumps({"ready": ready, "paths": kernels.paths(), "warnings": [str(c.message) for c in caught],
                      "within": bool(((y.double() - s).abs() <= bound).all()), "within_int8": within_int8,
                      "is_f_linear": bool(torch.equal(y, F.linear(x, w)))}))
    """
)


def child(**env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env={**os.environ, **env}, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in {"x86_64", "AMD64"}, reason="-mno-avx512f is an x86 flag")
def test_the_portable_path_builds_and_is_within_the_same_bound():
    result = child(TFORMER_KERNEL_CFLAGS="-mno-avx512f")  # on x86: no AVX-512, so no dpbf16
    assert result["ready"] and result["within"] and result["within_int8"] and not result["warnings"]
    assert result["paths"] == {"bf16": "portable", "int8": "portable"}


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
