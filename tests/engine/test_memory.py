"""Weights in one block of memory (``tformer.engine.memory.pack_weights``): every tensor keeps its identity, values and
flags, lands in module order in one mapping (2 MB-aligned start, 64-byte-aligned tensors) with a storage of its own,
tied tensors once, views left as views; the model computes and trains as before; loading and quantizing pack."""

from __future__ import annotations

import io

import pytest
import torch
from safetensors.torch import load, save

from tformer import DecoderLM, TransformerConfig, quantize
from tformer.engine.memory import ALIGN, HUGE_PAGE, is_packed, pack_weights


def tensors_of(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers once each, in module order (what pack_weights packs)."""
    seen, out = set(), []
    for module in model.modules():
        for t in (*module._parameters.values(), *module._buffers.values()):
            if t is not None and id(t) not in seen and t.numel():
                seen.add(id(t))
                out.append(t)
    return out


def test_packing_keeps_every_tensor_and_lays_them_out_in_one_block_in_module_order():
    torch.manual_seed(0)
    model = DecoderLM(TransformerConfig.tiny(position="rotary", norm="rms", ffn="gated", activation="silu"))
    model.decoder.embed.tokens.weight.requires_grad_(False)
    before = {id(t): (t.detach().clone(), t.dtype, t.shape, t.requires_grad) for t in tensors_of(model)}
    x = torch.randint(0, model.cfg.vocab_size, (2, 7))
    expected = model(x)
    assert not is_packed(model)
    assert pack_weights(model) is model and is_packed(model)
    tensors = tensors_of(model)
    assert {id(t) for t in tensors} == set(before)  # the same objects: every holder of one sees the block
    for t in tensors:
        value, dtype, shape, grad = before[id(t)]
        assert t.dtype == dtype and t.shape == shape and t.requires_grad == grad and torch.equal(t, value)
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # saving one writes its bytes only
    pointers = [t.data_ptr() for t in tensors]
    assert pointers[0] % HUGE_PAGE == 0 and all(p % ALIGN == 0 for p in pointers)
    ends = [t.data_ptr() + t.numel() * t.element_size() for t in tensors]
    assert all(end <= nxt < end + ALIGN for end, nxt in zip(ends, pointers[1:]))  # consecutive, in module order
    assert torch.equal(model(x), expected)
    pack_weights(model)  # already packed: nothing moves
    assert [t.data_ptr() for t in tensors_of(model)] == pointers


def test_tensors_of_odd_sizes_each_start_on_a_cache_line():
    model = pack_weights(torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5)))  # 60, 20, 20, 20 bytes
    pointers = [t.data_ptr() for t in tensors_of(model)]
    assert pointers[0] % HUGE_PAGE == 0 and all(p % ALIGN == 0 for p in pointers)
    assert [b - a for a, b in zip(pointers, pointers[1:])] == [ALIGN] * 3  # each padded to the next line, no more


def test_tied_tensors_are_packed_once_and_views_stay_views():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as an LM head
    base = torch.arange(12.0)
    model.register_buffer("whole", base)
    model.register_buffer("part", base[4:8])  # a view of another buffer
    pack_weights(model)
    assert model[1].weight is model[0].weight and is_packed(model)
    assert model.part.data_ptr() == model.whole.data_ptr() + 4 * 4  # still a view: written through one, read in both
    model.whole[5] = -1.0
    assert model.part[1] == -1.0


def test_a_packed_model_trains_and_a_converted_one_is_no_longer_packed():
    torch.manual_seed(0)
    model = pack_weights(DecoderLM(TransformerConfig.tiny()))
    reference = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randint(0, model.cfg.vocab_size, (2, 5))).logsumexp(-1).mean().backward()
    optimizer.step()
    assert all(not torch.equal(p, r) for p, r in zip(model.parameters(), reference, strict=True) if p.grad is not None)
    assert is_packed(model)  # updated in place
    model.double()
    assert not is_packed(model)


def test_packed_tensors_save_alone():
    model = pack_weights(torch.nn.Linear(64, 32))
    data = save({"weight": model.weight.detach()})
    assert len(data) < 64 * 32 * 4 + 1024  # the tensor's bytes and a header, not the block
    assert torch.equal(load(data)["weight"], model.weight)
    buffer = io.BytesIO()
    torch.save(model.bias.detach(), buffer)
    assert buffer.tell() < 32 * 4 + 2048


def test_pack_weights_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match="need an nn.Module; got Tensor"):
        pack_weights(torch.zeros(3))


def test_quantize_packs_the_int8_model():
    model = quantize(DecoderLM(TransformerConfig.tiny()).bfloat16())
    assert is_packed(model)
