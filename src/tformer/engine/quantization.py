"""Weight-only int8 quantization for inference: ``tformer.quantize(model, "int8")``.

Each linear layer's weight ``W (out, in)`` becomes int8 codes ``Q`` and one float scale per output channel (row),
``s_o = max_i |W_oi| / 127``, ``Q_oi = round(W_oi / s_o)``: so ``|W_oi - s_o Q_oi| <= s_o / 2``. Activations stay in
the model's dtype (float32 or bfloat16); the product ``y = (x Q^T) * s`` reads one byte per weight instead of two or
four, and decoding at batch 1 is bound by those bytes. On the CPU a decode step (at most
:func:`tformer.engine.kernels.max_rows` rows) runs on tformer's int8 matrix-vector kernel, longer bfloat16 inputs
(prefill) on PyTorch's fused int8-weight kernel (``torch._weight_int8pack_mm``) or, where the CPU lacks bfloat16
arithmetic, a float32 GEMM on the exact codes, float32 inputs always as that float32 GEMM (PyTorch's fused kernel is
a scalar loop for them); elsewhere the codes are dequantized per call (BENCHMARKS.md, "Decode kernels").

A tied output head (the logits reuse the token embedding) gets an int8 copy of that matrix; the embedding itself
stays in floating point (a lookup reads only the rows of the tokens it is given). The result is for inference: the
codes are buffers, not parameters, and ``quantize`` puts the model in eval mode. Gradients still flow through a
quantized layer to its input (``dx = (dy * s) Q``: input saliency, or training what stays in floating point, such as
the embeddings and norms); the codes and scales get none.

Shapes: B, T, C, V (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.engine import kernels
from tformer.engine.apply import TiedHead, accelerate
from tformer.engine.memory import pack_weights

Scheme = Literal["int8"]


def _fused(x: Tensor, in_features: int) -> bool:
    """Whether ``torch._weight_int8pack_mm`` takes this input: CPU, a float dtype, and for bfloat16 a row length that
    is a multiple of 16 (torch 2.13's bfloat16 kernel crashes the process on others: 8, 24 and 100 were seen)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return x.dtype != torch.bfloat16 or in_features % 16 == 0


def _product(x: Tensor, codes: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """``(x @ codes^T) * scale + bias`` (one scale and bias value per row of ``codes``) in ``x``'s dtype, by the
    fastest path that takes ``x``."""
    if kernels.uses_int8_kernel(x, codes):  # a decode step: tformer's int8 matrix-vector kernel
        return kernels.int8_linear(x, codes, scale, bias)
    if kernels.uses_float32_int8_gemm(x, codes):  # a prompt, on a CPU where float32 GEMMs beat the int8 kernel
        return kernels.float32_gemm(x, codes, bias, scale)
    if x.dtype == torch.float32 and x.device.type == "cpu" and codes.device.type == "cpu":  # not int8pack_mm's loop
        return kernels.float32_gemm(x, codes, bias, scale)
    if _fused(x, codes.shape[1]):  # torch's own int8-weight kernel (a private op: no public one exists)
        flat = x.reshape(-1, x.shape[-1])  # (B*T, in)
        y = torch._weight_int8pack_mm(flat, codes, scale.to(x.dtype)).reshape(*x.shape[:-1], -1)
    else:
        y = F.linear(x, codes.to(x.dtype)) * scale.to(x.dtype)
    return y if bias is None else y + bias.to(y.dtype)


class _Int8Product(torch.autograd.Function):
    """:func:`_product` with a gradient for ``x``: ``dx = (dy * s) Q``, from the int8 codes (the fused kernel has no
    derivative; this keeps only the codes for the backward, not a float copy of the matrix). The codes, scales and
    bias are buffers: they get none."""

    @staticmethod
    def forward(ctx, x: Tensor, codes: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(codes, scale)
        return _product(x, codes, scale, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: Tensor):
        codes, scale = ctx.saved_tensors
        return (dy * scale.to(dy.dtype)) @ codes.to(dy.dtype), None, None, None


class Int8Linear(nn.Module):
    """``y = x (s * Q)^T + b`` with int8 codes ``Q (out, in)`` and per-row scales ``s (out,)``."""

    def __init__(self, codes: Tensor, scale: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        if codes.dtype != torch.int8 or codes.dim() != 2 or scale.shape != codes.shape[:1]:
            raise ValueError(f"need int8 codes (out, in) and scales (out,); got {codes.dtype} {tuple(codes.shape)}")
        self.in_features, self.out_features = codes.shape[1], codes.shape[0]
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None = None) -> Int8Linear:
        """Quantize ``weight (out, in)`` row by row (computed in float32; the scales keep ``weight``'s dtype)."""
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)  # (out,): an all-zero row
        codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(codes, scale.to(weight.dtype), None if bias is None else bias.detach().clone())

    def dequantized(self) -> Tensor:
        """``s * Q`` in the scales' dtype: the weight this layer computes with."""
        return self.codes.to(self.scale.dtype) * self.scale[:, None]

    @property
    def weight(self) -> Tensor:
        """The dequantized weight, for code that slices a layer's matrix (cross-attention's projections, the
        experiments): correct, but it builds the full float matrix; calling the layer does not."""
        return self.dequantized()

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and x.requires_grad:  # a gradient for x (the buffers take none)
            return _Int8Product.apply(x, self.codes, self.scale, self.bias)
        return _product(x, self.codes, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize(model: nn.Module, scheme: Scheme = "int8") -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by an :class:`Int8Linear`, and a tied output head by an
    int8 copy of the embedding; returns ``model`` in eval mode, accelerated (:func:`tformer.engine.accelerate`), its
    CPU tensors in one block of memory (:func:`tformer.engine.memory.pack_weights`). Embeddings and norms keep their
    dtype. A model without a linear layer, or a bare ``nn.Linear`` (it is replaced in its parent), is an error."""
    if not isinstance(model, nn.Module):
        pretrained = " (a Pretrained: quantize its .model)" if hasattr(model, "model") else ""
        raise TypeError(f"quantize takes a model (an nn.Module); got a {type(model).__name__}{pretrained}")
    if scheme != "int8":
        raise ValueError(f"unknown quantization scheme {scheme!r}; tformer has 'int8' (weight-only, per channel)")
    if is_quantized(model):
        raise ValueError("this model is already quantized")
    if isinstance(model, nn.Linear):  # replaced in its parent, so a layer alone cannot be
        raise TypeError(
            "quantize replaces the nn.Linear layers inside a model; for one layer use "
            "tformer.engine.quantization.Int8Linear.from_weight(layer.weight, layer.bias)"
        )
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        raise ValueError(f"this {type(model).__name__} has no nn.Linear layer to quantize")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear.from_weight(child.weight, child.bias))
    decoder = getattr(model, "decoder", None)
    tied = hasattr(model, "head") and (model.head is None or isinstance(model.head, TiedHead))
    if tied and decoder is not None:  # the logits read the embedding: the head gets its own codes
        model.head = Int8Linear.from_weight(decoder.embed.tokens.weight)
    return pack_weights(accelerate(model.eval()))


def is_quantized(model: nn.Module) -> bool:
    """Whether :func:`quantize` has replaced linear layers of ``model`` (its weights are int8 codes and scales)."""
    return any(isinstance(m, Int8Linear) for m in model.modules())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (tied tensors once): what a batch-1 decode step reads, plus the
    embedding rows it does not."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


__all__ = ["Int8Linear", "quantize", "weight_bytes"]
