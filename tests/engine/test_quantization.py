"""Weight-only int8 (``tformer.quantize``): the codes are within half a step of the weights, the layer computes
with exactly the dequantized matrix, and a quantized model stays close to the float one and decodes consistently."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tformer import DecoderLM, EncoderDecoder, TransformerConfig, generate, greedy_seq2seq, quantize
from tformer.engine import kernels
from tformer.engine.quantization import Int8Linear, weight_bytes


def test_codes_are_within_half_a_step_of_the_weights():
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 1, 48)[:, None]
    layer = Int8Linear.from_weight(w)
    assert layer.codes.dtype == torch.int8 and layer.codes.abs().max() == 127  # each row uses the full range
    error = (layer.dequantized() - w).abs()
    assert (error <= layer.scale[:, None] / 2 * (1 + 1e-6)).all()  # rounding: at most half a step per row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [24, 32])  # bfloat16: 24 takes the dequantizing path, 32 the fused kernel
def test_the_layer_computes_with_the_dequantized_matrix(dtype, width):
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(40, width, generator=g), torch.randn(40, generator=g)
    x = torch.randn(3, 5, width, generator=g)
    layer = Int8Linear.from_weight(w.to(dtype), b.to(dtype))
    oracle = x.double() @ layer.dequantized().double().T + b.to(dtype).double()  # float64, same weights
    ours = (layer(x.to(dtype)).double() - oracle).abs().max()
    plain = (nn.functional.linear(x.to(dtype), layer.dequantized(), b.to(dtype)).double() - oracle).abs().max()
    assert ours <= 2 * plain + 1e-6  # the fused int8 kernel rounds no worse than the plain same-dtype product


@pytest.mark.kernels  # the engine's routes turned on (TFORMER_KERNELS=0 turns them off)
@pytest.mark.parametrize("block_rows", [None, 7])  # the weight converted in one block, or in 7-row blocks (6 of 40)
def test_many_rows_as_a_float32_gemm_on_the_exact_codes_within_a_float32_sums_roundoff(monkeypatch, block_rows):
    """Where the float32 route is on (forced here, so that any CPU checks it), a bfloat16 product of at least
    INT8_FLOAT32_MIN_ROWS rows runs as a float32 GEMM on the exact codes: against float64 with the same codes, scales
    and bias, within a float32 sum of I products and the scale's and bias's two roundings,
    ``(I + 2) u32 (|x| |Q|^T |s| + |b|)``, plus the one rounding to bfloat16, ``u_bf16 |y|``. Fewer rows, a gradient
    for x, float32 x or the route off: the other paths (the int8 kernel or torch's int8 GEMM)."""
    if block_rows is not None:
        monkeypatch.setattr(kernels, "FLOAT32_BLOCK_BYTES", block_rows * 4 * 96)
    g = torch.Generator().manual_seed(3)
    layer = Int8Linear.from_weight(torch.randn(40, 96, generator=g).bfloat16(), torch.randn(40, generator=g).bfloat16())
    x = torch.randn(2, kernels.INT8_FLOAT32_MIN_ROWS // 2, 96, generator=g).bfloat16()
    q, s, b = layer.codes.double(), layer.scale.double(), layer.bias.double()
    exact = (x.double() @ q.T) * s + b
    bound = 98 * 2.0**-24 * ((x.double().abs() @ q.abs().T) * s.abs() + b.abs()) + 2.0**-8 * exact.abs()
    with torch.no_grad(), kernels.float32_gemms(True):
        assert kernels.uses_float32_int8_gemm(x, layer.codes)
        y = layer(x)
        assert y.shape == (2, kernels.INT8_FLOAT32_MIN_ROWS // 2, 40) and y.dtype == torch.bfloat16
        assert ((y.double() - exact).abs() <= bound).all()
        assert not kernels.uses_float32_int8_gemm(x[:, 1:], layer.codes)  # one row short
        assert not kernels.uses_float32_int8_gemm(x.float(), layer.codes)
        with kernels.float32_gemms(False):
            assert not kernels.uses_float32_int8_gemm(x, layer.codes)
    with kernels.float32_gemms(True):
        assert not kernels.uses_float32_int8_gemm(x.requires_grad_(True), layer.codes)


@pytest.mark.kernels  # the engine's routes turned on (TFORMER_KERNELS=0 turns them off)
@pytest.mark.parametrize("compile", [False, True])
def test_float32_inputs_of_more_rows_than_the_kernel_takes_run_as_a_float32_gemm_of_the_codes(monkeypatch, compile):
    """A float32 prompt through int8 codes (more than ``max_rows(torch.int8)`` rows): a float32 GEMM on the exact
    codes (kernels.float32_gemm: its bits, eager and compiled), never ``torch._weight_int8pack_mm``, whose float32
    path took 30-57x as long; against float64 with the same codes, scales and bias within a float32 sum of I products
    and the scale's and bias's two roundings, ``(I + 2) u32 (|x| |Q|^T |s| + |b|)``."""

    def refuse(*args):
        raise AssertionError("torch._weight_int8pack_mm called")

    monkeypatch.setattr(torch, "_weight_int8pack_mm", refuse)
    g = torch.Generator().manual_seed(4)
    layer = Int8Linear.from_weight(torch.randn(40, 96, generator=g), torch.randn(40, generator=g))
    x = torch.randn(2, kernels.max_rows(torch.int8), 96, generator=g)  # 2x the rows the kernel takes
    q, s, b = layer.codes.double(), layer.scale.double(), layer.bias.double()
    exact = (x.double() @ q.T) * s + b
    bound = 98 * 2.0**-24 * ((x.double().abs() @ q.abs().T) * s.abs() + b.abs())
    run = torch.compile(layer, backend="inductor", fullgraph=True) if compile else layer
    with torch.no_grad():
        y = run(x)
    assert y.dtype == torch.float32 and torch.equal(y, kernels.float32_gemm(x, layer.codes, layer.bias, layer.scale))
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [24, 32])  # bfloat16: 24 takes the dequantizing path, 32 the fused kernel
@pytest.mark.parametrize("rows", [1, 20])  # 1: tformer's int8 kernel in the forward (kernels.max_rows), 20: not
def test_the_gradient_reaches_the_input_through_the_codes(dtype, width, rows):
    g = torch.Generator().manual_seed(2)
    w, dy = torch.randn(40, width, generator=g), torch.randn(rows, 40, generator=g)
    layer = Int8Linear.from_weight(w.to(dtype), torch.randn(40, generator=g).to(dtype))
    x = torch.randn(rows, width, generator=g).to(dtype).requires_grad_()
    y = layer(x)
    assert torch.equal(y.detach(), layer(x.detach()))  # the forward runs the same product as without autograd
    y.backward(dy.to(dtype))
    oracle = dy.double() @ layer.dequantized().double()  # float64: dL/dx of x (s Q)^T
    plain_dx = (dy.to(dtype) @ layer.dequantized()).double()
    error, plain_error = (x.grad.double() - oracle).abs().max(), (plain_dx - oracle).abs().max()
    assert error <= 2 * plain_error + 1e-5  # no worse than the same-dtype product with the dequantized matrix
    assert layer.codes.grad is None and layer.scale.grad is None


def test_a_quantized_model_passes_gradients_to_its_embedding():
    model, ids = tiny_lm(seed=3), torch.arange(12).reshape(2, 6)
    dequantized = tiny_lm(seed=3)  # the same model with each matrix replaced by its dequantized float copy
    quantize(model)
    for name, layer in model.named_modules():
        if isinstance(layer, Int8Linear) and name != "head":
            dequantized.get_submodule(name).weight.data.copy_(layer.dequantized())
    dequantized.head = nn.Linear(model.cfg.d_model, model.cfg.vocab_size, bias=False)
    dequantized.head.weight.data.copy_(model.head.dequantized())
    grads = []
    for m in (model, dequantized):
        m.zero_grad()
        m(ids).logsumexp(-1).sum().backward()
        grads.append(m.decoder.embed.tokens.weight.grad)
    # float32 both, the same matrices: only the order of the additions differs (1e-5 of the gradient's scale)
    assert (grads[0] - grads[1]).abs().max() <= 1e-5 * grads[1].abs().max()


def tiny_lm(seed: int = 0, **changes) -> DecoderLM:
    torch.manual_seed(seed)
    cfg = TransformerConfig.tiny(position="rotary", num_kv_heads=2, **changes)
    return DecoderLM(cfg).eval()


def test_quantize_replaces_every_linear_and_the_tied_head():
    model = tiny_lm()
    before = weight_bytes(model)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids)
        quantize(model)
        logits = model(ids)
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.head, Int8Linear)  # the tied head's int8 copy; the embedding stays float
    assert model.decoder.embed.tokens.weight.dtype == torch.float32
    # per-weight error <= half a step of 1/254 of the row's range: the logits move by a few percent of their spread
    assert (logits - reference).abs().max() < 0.05 * reference.abs().max()
    assert (
        torch.equal(logits.argmax(-1), reference.argmax(-1))
        or (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9
    )
    assert weight_bytes(model) < before  # int8 codes replace float32 matrices (the float embedding stays)
    with pytest.raises(ValueError, match="already quantized"):
        quantize(model)
    with pytest.raises(TypeError, match=r"for one layer use tformer\.engine\.quantization\.Int8Linear\.from_weight"):
        quantize(nn.Linear(4, 4))  # replaced in its parent: a layer alone would come back unchanged
    with pytest.raises(ValueError, match="this Embedding has no nn.Linear layer to quantize"):
        quantize(nn.Embedding(4, 4))
    with pytest.raises(ValueError, match="unknown quantization scheme 'int4'"):
        quantize(tiny_lm(), "int4")
    with pytest.raises(TypeError, match=r"^quantize takes a model \(an nn.Module\); got a SimpleNamespace \(a "):
        quantize(SimpleNamespace(model=tiny_lm()))  # a Pretrained's shape: its .model is what to quantize


def test_a_quantized_model_decodes_the_same_with_and_without_the_cache():
    model = quantize(tiny_lm(seed=2))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    cached = generate(model, prompts, max_new_tokens=10, greedy=True)
    full = generate(model, prompts, max_new_tokens=10, greedy=True, use_cache=False)
    assert cached == full


def test_bfloat16_after_quantize_keeps_the_codes():
    model = quantize(tiny_lm()).to(torch.bfloat16)
    layer = model.decoder.stack.blocks[0].ff.up
    assert layer.codes.dtype == torch.int8 and layer.scale.dtype == torch.bfloat16
    assert generate(model, [[1, 2, 3]], max_new_tokens=4, greedy=True)[0]


def test_an_encoder_decoder_quantizes_cross_attention_included():
    torch.manual_seed(0)
    model = EncoderDecoder(TransformerConfig.tiny()).eval()
    src = torch.randint(3, model.cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tgt = torch.randint(3, model.cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
        reference = model(src, tgt)
        logits = quantize(model)(src, tgt)
    assert (logits - reference).abs().max() < 0.05 * reference.abs().max()
    out = greedy_seq2seq(model, src, torch.ones_like(src, dtype=torch.bool), bos_id=1, eos_id=2, max_new_tokens=6)
    assert len(out) == 2
