"""Triton FlashAttention-2 kernels against the float64 oracle.

With CUDA the kernels run natively. Without it they run on CPU tensors in Triton's interpreter, which
must be switched on (``TRITON_INTERPRET=1``) before triton is first imported, since triton decorates
its own library functions at import. Pytest imports every test module before running any test, so
this module sets the variable just for its own import of triton, unless something imported triton
earlier: then the kernel tests here are skipped and ``test_in_a_fresh_interpreter_process`` runs this
file again in a subprocess with the variable set. Tolerances as in ``test_attention_tiled.py``:
float32 (IEEE products, not TF32) within 1e-5 relative + 1e-6 absolute of the float64 oracle.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and "triton" not in sys.modules:
    _previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401  (imported now, with the interpreter on)
    except ImportError:
        pass
    finally:
        if _previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _previous

pytest.importorskip("triton")

from tests.attention.test_tiled import (  # noqa: E402
    close32,
    forward_and_grads,
    make_inputs,
    make_mask,
    materialized,
    max_err,
    oracle,
)
from tformer.attention import triton as attention_triton  # noqa: E402
from tformer.attention.triton import triton_attention, triton_supports  # noqa: E402

RUNS_HERE = DEVICE == "cuda" or attention_triton._interpreting()
pytestmark = pytest.mark.triton
kernels_run_here = pytest.mark.skipif(
    not RUNS_HERE, reason="triton was imported without its interpreter; test_in_a_fresh_interpreter_process"
)


@pytest.fixture(autouse=True)
def interpreter_flag(monkeypatch):
    """Triton also reads the variable lazily (e.g. when it first imports its gluon package)."""
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.subprocess
def test_in_a_fresh_interpreter_process():
    """Runs only when this process cannot interpret the kernels (triton imported earlier, no CUDA)."""
    if RUNS_HERE:
        pytest.skip("the kernels run in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-rs", "-p", "no:cacheprovider"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=os.path.dirname(__file__))
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout and "without its interpreter" not in result.stdout, result.stdout[-3000:]


def on_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


CASES = [  # (B, H, Hkv, L, S, E, Ev, mask, causal); tiles of 16 in the interpreter
    (2, 2, 2, 1, 1, 16, 16, None, False),
    (1, 2, 2, 17, 17, 16, 16, None, False),
    (1, 2, 2, 64, 64, 32, 32, None, True),
    (2, 4, 2, 17, 33, 16, 32, "pad", True),
    (2, 2, 1, 17, 64, 24, 16, "float", False),
    (2, 2, 2, 64, 17, 16, 16, "bool", True),
]


def check_float32_against_oracle(case, block):
    b, h, hkv, l, s, e, ev, mask_kind, causal = case
    q, k, v = make_inputs(b, h, hkv, l, s, e, ev, torch.float32)
    mask = make_mask(mask_kind, b, h, l, s)
    ref, leaves = oracle(q, k, v, mask, causal)
    dout = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    q, k, v, dmask = on_device(q, k, v, mask)
    got = forward_and_grads(lambda *a: triton_attention(*a, dmask, causal, block_size=block), q, k, v, dout.to(DEVICE))
    assert got[0].shape == ref.shape
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, (ref, *ref_grads)):
        assert close32(x.cpu(), r), name


@pytest.mark.parametrize("case", CASES, ids=str)
@kernels_run_here
def test_float32_matches_float64_oracle(case):
    check_float32_against_oracle(case, block=16)


@pytest.mark.parametrize("block_size", [(16, 32), (32, 16)], ids=str)
@pytest.mark.parametrize("case", [c for c in CASES if c[-1]], ids=str)
@kernels_run_here
def test_query_and_key_tiles_of_different_sizes(case, block_size):
    """Causal tile skipping with BLOCK_M != BLOCK_N (as the autotuner picks on CUDA): the forward and dQ
    stop at the key tile holding the tile's last row, dK/dV start at the query tile holding the first key."""
    check_float32_against_oracle(case, block_size)


@kernels_run_here
def test_block_sizes_must_be_powers_of_two_of_at_least_16():
    q, k, v = on_device(*make_inputs(1, 1, 1, 8, 8, 16, 16, torch.float32))
    for bad in (8, 24, (16, 48)):
        with pytest.raises(ValueError, match="powers of two"):
            triton_attention(q, k, v, block_size=bad)


@kernels_run_here
def test_cpu_runs_in_the_interpreter():
    if DEVICE != "cpu":
        pytest.skip("CUDA present: kernels run natively")
    q, k, v = make_inputs(1, 1, 1, 17, 17, 16, 16, torch.float32)
    out = triton_attention(q, k, v, block_size=16)
    assert type(attention_triton._fwd_kernel).__name__ == "InterpretedFunction"
    assert close32(out, oracle(q, k, v)[0])


@pytest.mark.parametrize("mask_type", ["bool", "float"])
@kernels_run_here
def test_fully_masked_rows_give_zeros_and_zero_grads(mask_type):
    b, h, l, s, e = 1, 2, 40, 48, 16
    q, k, v = make_inputs(b, h, h, l, s, e, e, torch.float32)
    allowed = torch.rand(b, h, l, s, generator=torch.Generator().manual_seed(5)) > 0.5
    allowed[..., 0] = True
    allowed[:, :, [3, 17]] = False  # rows with nothing to attend
    allowed[:, :, :, 16:32] = False  # a whole key tile
    allowed[:, :, 32:] = False  # the whole last query tile
    mask = allowed if mask_type == "bool" else torch.zeros(b, h, l, s).masked_fill(~allowed, -math.inf)
    ref, _ = oracle(q, k, v, mask)
    q, k, v, mask = on_device(q, k, v, mask)
    out, dq, dk, dv = forward_and_grads(
        lambda *a: triton_attention(*a, mask, block_size=16), q, k, v, torch.ones(ref.shape, device=DEVICE)
    )
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()
    dead = [3, 17, *range(32, 40)]
    assert (out[:, :, dead] == 0).all() and (dq[:, :, dead] == 0).all()
    assert (dk[:, :, 16:32] == 0).all() and (dv[:, :, 16:32] == 0).all()
    assert close32(out.cpu(), ref)


@kernels_run_here
def test_unsupported_inputs_are_refused_clearly():
    q, k, v = make_inputs(1, 2, 2, 8, 8, 16, 16, torch.float32)
    assert triton_supports(*on_device(q, k, v), None, True)
    refused = [
        (*(t.double() for t in (q, k, v)), None),  # float64
        (q, k[:, :1].expand(3, 2, 8, 16), v[:, :1].expand(3, 2, 8, 16), None),  # batch broadcast
        (q, k, v, torch.zeros(8, 8, requires_grad=True)),  # float mask that wants a gradient
        (q, k, v, torch.zeros(8, 8, dtype=torch.int64)),  # integer mask
    ]
    for q_, k_, v_, mask in refused:
        q_, k_, v_ = on_device(q_, k_, v_)
        mask = mask if mask is None else mask.to(DEVICE)
        assert not triton_supports(q_, k_, v_, mask, False)
        with pytest.raises(NotImplementedError, match="triton_attention: "):
            triton_attention(q_, k_, v_, mask)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_low_precision_within_twice_materialized_error(dtype, causal):
    b, h, hkv, l, s, e = 2, 8, 2, 1025, 1025, 64
    q, k, v = make_inputs(b, h, hkv, l, s, e, e, dtype)
    mask = make_mask("pad", b, h, l, s)
    ref, leaves = oracle(q, k, v, mask, causal)
    dout = torch.randn_like(ref).to(dtype).double()
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    q, k, v, dmask = on_device(q, k, v, mask)
    got = forward_and_grads(lambda *a: triton_attention(*a, dmask, causal), q, k, v, dout.to(DEVICE))
    base = forward_and_grads(lambda *a: materialized(*a, dmask, causal), q, k, v, dout.to(DEVICE))
    eps = torch.finfo(dtype).eps / 2  # the unavoidable final rounding to dtype
    for name, x, y, r in zip(("out", "dq", "dk", "dv"), got, base, (ref, *ref_grads)):
        assert max_err(x.cpu(), r) <= 2 * max_err(y.cpu(), r) + eps * r.abs().max().item(), name
