"""The engine applied from outside (``tformer.engine.accelerate``): the same parameters, state dict and function, the
kernels where they pay, undone by ``plain``; and what applies it (generation, the seq2seq decoders)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tformer import DecoderLM, EncoderDecoder, TransformerConfig, generate, greedy_seq2seq
from tformer.engine import accelerate, is_accelerated, plain
from tformer.engine.apply import KERNEL_BACKEND, KernelLinear, TiedHead
from tformer.layers import MultiHeadAttention

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("kernels_built")]
FLOAT32 = 1e-5  # the library's bound for two float32 paths that differ in the order of their additions


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in model.state_dict().items()}


@pytest.mark.parametrize("tied", [True, False])
def test_accelerate_swaps_modules_in_place_and_keeps_the_parameters(tied):
    model = DecoderLM(TransformerConfig.tiny(position="rotary", tie_embeddings=tied)).eval()
    before, parameters = state(model), [id(p) for p in model.parameters()]
    assert accelerate(model) is model and is_accelerated(model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is KernelLinear for m in linears)
    assert all(m.backend == KERNEL_BACKEND for m in model.modules() if isinstance(m, MultiHeadAttention))
    assert isinstance(model.head, TiedHead) == tied  # a head of its own is a KernelLinear already
    after = state(model)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert [id(p) for p in model.parameters()] == parameters  # the embedding is not registered twice
    accelerate(model)  # idempotent
    assert state(model).keys() == before.keys()
    assert plain(model) is model and not is_accelerated(model)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert all(m.backend == "auto" for m in model.modules() if isinstance(m, MultiHeadAttention))
    assert model.head is None if tied else type(model.head) is nn.Linear


def test_a_backend_asked_for_by_name_is_kept():
    model = accelerate(DecoderLM(TransformerConfig.tiny(attn_backend="tiled")))
    assert {m.backend for m in model.modules() if isinstance(m, MultiHeadAttention)} == {"tiled"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_accelerated_model_computes_the_same_function(random_ids, dtype):
    """Float64 takes no kernel: the same modules' numbers (to 1e-12: BLAS sums one row and ten rows in another
    order). Float32: a one-row product (the last position, a decode step) runs on the matrix-vector kernel, the same
    float32 sums in another order."""
    torch.manual_seed(6)
    model = DecoderLM(TransformerConfig.tiny(position="rotary", num_kv_heads=2)).to(dtype).eval()
    ids = random_ids(2, 10, seed=9)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :6], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(6, 10)]
        accelerate(model)
        fast = model(ids)
        last = model.logits(model.hidden(ids)[:, -1:])  # one row: the kernel
        cache = model.new_cache()
        fast_steps = [model(ids[:, :6], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(6, 10)]
    tolerance = 1e-12 if dtype == torch.float64 else FLOAT32
    torch.testing.assert_close(fast, full, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(last, full[:, -1:], rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(torch.cat(fast_steps, 1), torch.cat(steps, 1), rtol=tolerance, atol=tolerance)


def test_generation_accelerates_the_model_and_gives_the_plain_models_tokens(random_prompts):
    model = DecoderLM(TransformerConfig.tiny(position="rotary"))
    prompts = random_prompts([3, 7, 5])
    with torch.no_grad():
        reference = []
        for p in prompts:  # greedy by hand on the plain modules, the whole sequence each step
            ids = torch.tensor([p])
            for _ in range(8):
                ids = torch.cat([ids, model.eval()(ids)[:, -1:].argmax(-1)], dim=1)
            reference.append(ids[0, len(p) :].tolist())
    assert not is_accelerated(model)
    assert generate(model, prompts, max_new_tokens=8, greedy=True) == reference
    assert is_accelerated(model)


def test_seq2seq_decoding_accelerates_the_model_and_gives_the_plain_models_tokens(random_ids):
    torch.manual_seed(2)
    model = EncoderDecoder(TransformerConfig.tiny()).eval()
    src = random_ids(2, 6, seed=3)
    with torch.no_grad():  # greedy by hand on the plain modules: the whole target each step
        memory, tgt = model.encode(src), torch.ones(2, 1, dtype=torch.long)
        for _ in range(6):
            logits = model.decode(tgt, memory)[:, -1:]
            logits[..., 1] = float("-inf")  # the start token is never an output
            tgt = torch.cat([tgt, logits.argmax(-1)], dim=1)
    tokens = greedy_seq2seq(model, src, None, bos_id=1, eos_id=2, max_new_tokens=6)
    assert is_accelerated(model)
    assert tokens == [row[: row.index(2)] if 2 in row else row for row in tgt[:, 1:].tolist()]  # EOS dropped
