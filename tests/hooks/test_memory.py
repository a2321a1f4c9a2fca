"""A cache holds what its names imply and nothing more, by PyTorch's own allocator accounting (``torch.profiler``'s
memory events: each op's allocations minus its frees), not the resident set of the process."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tformer import DecoderLM, TransformerConfig, hooks


def kept_by_allocator(run) -> tuple[int, object]:
    """Bytes the CPU allocator holds more after ``run()`` than before, with its result still alive."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
    return sum(e.self_cpu_memory_usage for e in prof.events()), result


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=300, d_model=64, num_heads=4, num_kv_heads=2, num_layers=3, d_ff=128, max_seq_len=64,
        position="rotary", norm="rms", ffn="gated", activation="silu",
    )  # fmt: skip
    return DecoderLM(cfg).eval()


@pytest.mark.parametrize(
    "names",
    [
        ["blocks.1.attn.hook_q"],  # a head view of the fused q|k|v product: copied, not kept alive with k and v
        ["blocks.0.attn.hook_pattern", "blocks.2.attn.hook_z"],
        [f"blocks.{i}.hook_resid_post" for i in range(3)],
        None,  # every point
    ],
)
def test_a_cache_holds_exactly_the_bytes_of_its_names(model, names):
    ids = torch.randint(0, 300, (2, 20))
    plain, logits = kept_by_allocator(lambda: model(ids).detach())
    assert plain == logits.numel() * logits.itemsize  # the accounting itself: a forward keeps its logits alone
    kept, (out, cache) = kept_by_allocator(lambda: hooks.run_with_cache(model, ids, names=names))
    shared = cache.get("hook_unembed") is not None  # the returned logits are the cached ones
    assert kept == cache.nbytes() + (0 if shared else out.numel() * out.itemsize)
    if names is not None:
        implied = sum(t.numel() * t.itemsize for t in cache.values())  # these names hold distinct tensors
        assert cache.nbytes() == implied
        assert list(cache) == names


def test_points_that_hold_one_tensor_share_its_bytes(model):
    _, cache = hooks.run_with_cache(model, torch.randint(0, 300, (1, 8)), names=None)
    assert cache["blocks.0.hook_resid_post"].data_ptr() == cache["blocks.1.hook_resid_pre"].data_ptr()
    by_names = sum(t.numel() * t.itemsize for t in cache.values())
    # shared: each block's input (block 0's is hook_embed itself: a rotary model adds no position vectors), and each
    # Pre-LN block's mlp_in (it is resid_mid)
    shared = sum(cache[f"blocks.{i}.{p}"].numel() * 4 for i in range(3) for p in ("hook_resid_pre", "hook_mlp_in"))
    assert cache.nbytes() == by_names - shared
