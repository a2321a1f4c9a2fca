"""Apply the engine to a model from outside: :func:`accelerate` swaps its modules for kernel-backed ones of the same
parameters, :func:`plain` swaps them back.

What changes (in place; the state dict, the parameters and the function stay the same):

* every ``nn.Linear`` becomes a :class:`KernelLinear`, whose forward is :func:`tformer.engine.kernels.linear`: the
  matrix-vector kernels for a decode step's few rows, oneDNN or float32 GEMMs where they beat ``F.linear`` on the
  CPU, ``F.linear`` everywhere else (training, CUDA, float16);
* self-attention on the ``auto`` or ``sdpa`` backend takes the ``kernel`` backend, registered here in
  :mod:`tformer.attention`: the decode attention kernel for a few query rows on the CPU, PyTorch's SDPA otherwise;
* a tied output head (the logits read the token embedding) gets a :class:`TiedHead` that runs the same kernels.

``generate``, the seq2seq decoders, ``load_pretrained`` and the command line apply it; a model built in code runs the
plain PyTorch modules until then. The kernels compute what ``F.linear`` and softmax attention compute, up to the order
of float32 additions (``engine/kernels/README.md`` states the rounding contract).

Shapes: B, H, Hkv, L, S, D, Dv, T, C, V (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

from torch import Tensor, nn

from tformer import attention
from tformer.attention import sdpa_attention
from tformer.engine import kernels
from tformer.layers import MultiHeadAttention

KERNEL_BACKEND = "kernel"  # the attention backend this module registers
_PLAIN_BACKENDS = ("auto", "sdpa")  # the backends it replaces; one asked for by name (tiled, ...) is kept


def kernel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """``softmax(Q K^T * scale + mask) V``: query ``(B, H, L, D)``, key ``(B, Hkv, S, D)``, value ``(B, Hkv, S, Dv)``
    -> ``(B, H, L, Dv)``, on the decode attention kernel where it takes the call (a few query rows on the CPU, no
    dropout or gradient: :func:`tformer.engine.kernels.uses_attention_kernel`), else on PyTorch's SDPA."""
    if kernels.uses_attention_kernel(query, key, value, attn_mask, dropout_p):
        return kernels.attention(query, key, value, attn_mask, is_causal, scale)
    return sdpa_attention(query, key, value, attn_mask, is_causal, scale, dropout_p)


attention.register(attention.Backend(KERNEL_BACKEND, kernel_attention, dropout=True))


class KernelLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict keys) whose forward is :func:`tformer.engine.kernels.linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return kernels.linear(x, self.weight, self.bias)


class TiedHead(nn.Module):
    """The output head of a model whose logits reuse its token embedding ``(V, C)``: ``(B, T, C) -> (B, T, V)`` on
    :func:`tformer.engine.kernels.linear`. It holds no parameter: the embedding is referenced, not registered, so
    the state dict keeps the one matrix."""

    def __init__(self, tokens: nn.Embedding) -> None:
        super().__init__()
        self.__dict__["tokens"] = tokens  # not a submodule (its weight would appear twice in the state dict)

    def forward(self, h: Tensor) -> Tensor:
        return kernels.linear(h, self.tokens.weight)


def _tied_embedding(model: nn.Module) -> nn.Embedding | None:
    """The token embedding a model's logits read when its head is tied (``head`` is ``None``), else ``None``."""
    decoder = getattr(model, "decoder", None)
    if decoder is None or not hasattr(model, "head") or model.head is not None:
        return None
    return decoder.embed.tokens


def accelerate(model: nn.Module) -> nn.Module:
    """Swap ``model``'s modules for their kernel-backed versions, in place (the module docstring); returns ``model``.
    Idempotent."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"accelerate takes a model (an nn.Module); got a {type(model).__name__}")
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = KernelLinear
        elif isinstance(module, MultiHeadAttention) and module.backend in _PLAIN_BACKENDS:
            module.plain_backend, module.backend = module.backend, KERNEL_BACKEND
    tokens = _tied_embedding(model)
    if tokens is not None:
        model.head = TiedHead(tokens)
    return model


def plain(model: nn.Module) -> nn.Module:
    """Undo :func:`accelerate`, in place: plain ``nn.Linear`` layers, the attention backends as they were, no
    :class:`TiedHead`; returns ``model``."""
    for module in model.modules():
        if type(module) is KernelLinear:
            module.__class__ = nn.Linear
        elif isinstance(module, MultiHeadAttention) and module.backend == KERNEL_BACKEND:
            module.backend = module.__dict__.pop("plain_backend", "auto")
    if isinstance(getattr(model, "head", None), TiedHead):
        model.head = None
    return model


def is_accelerated(model: nn.Module) -> bool:
    """Whether :func:`accelerate` has swapped modules of ``model``."""
    return any(isinstance(m, (KernelLinear, TiedHead)) for m in model.modules())


__all__ = ["KERNEL_BACKEND", "KernelLinear", "TiedHead", "accelerate", "is_accelerated", "kernel_attention", "plain"]
