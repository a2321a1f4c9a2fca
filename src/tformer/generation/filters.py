"""The sampling rule of one decoding step: pure filters on logits ``z (B, V)`` and the draw, in this order:

    greedy        y = argmax_i z_i                                   (first index on ties)
    temperature   z <- z / T                  T < 1 sharpens, T > 1 flattens, T -> 0 is greedy
    top-k         keep the k largest z_i, the rest -> -inf          (Fan et al. 2018)
    top-p         keep the smallest set of most probable tokens whose probability sums to >= p,
                  the rest -> -inf; the most probable token is always kept  (nucleus, Holtzman et al. 2020)
    sample        y ~ softmax(z)

Shapes: B, V (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------------
# Pure filters on logits (..., V)
# --------------------------------------------------------------------------------------------------
def check_max_new_tokens(max_new_tokens: int) -> None:
    """Raise ``ValueError`` unless ``max_new_tokens`` is an integer >= 0."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens (--max-new-tokens) must be an integer >= 0; got {max_new_tokens!r}")


def check_sampling_args(temperature: float, top_k: int | None, top_p: float | None, greedy: bool) -> None:
    """Raise ``ValueError`` for settings that define no distribution. The messages name the argument and its
    ``tformer sample`` flag, as both reach users. Greedy decoding ignores all three, so nothing is checked then."""
    if greedy:
        return
    given = {"temperature": temperature} | ({} if top_p is None else {"top_p": top_p})
    for name, value in given.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} (--{name.replace('_', '-')}) must be a number; got {value!r}")
    if not temperature > 0:
        raise ValueError(
            f"temperature (--temperature) must be > 0 when sampling; for T -> 0 use greedy decoding "
            f"(greedy=True, --greedy); got {temperature}"
        )
    if not math.isfinite(temperature):  # T = inf would ignore the model: every token equally likely
        raise ValueError(
            f"temperature (--temperature) must be a finite number > 0 (T = inf samples uniformly, "
            f"ignoring the model); got {temperature}"
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k (--top-k) must be an integer >= 1 (or None / left out: no limit); got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p (--top-p) must be in (0, 1] (or None / left out: no limit); got {top_p!r}")


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """``z / T``: ``softmax(z / T)_i`` is proportional to ``p_i^(1/T)``.

    Computed as ``(z - max_i z_i) / T``, which has the same softmax but is ``<= 0`` everywhere and ``0`` at the
    maximum: a tiny ``T`` sends the other logits to ``-inf`` (``T -> 0`` is greedy, ties shared) instead of
    overflowing ``z / T`` to ``+inf`` and the softmax to ``inf - inf = NaN``. A ``T`` too small for the logits'
    dtype (it would round to 0, and ``0 / 0`` is NaN) is applied in float64.
    """
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0; got {temperature}")
    if temperature == 1.0:
        return logits
    if temperature < torch.finfo(logits.dtype).tiny:
        logits = logits.double()
    return (logits - logits.amax(dim=-1, keepdim=True)) / temperature  # (..., V)


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep exactly the ``min(k, V)`` largest logits of each row (ties broken as ``torch.topk``); others ``-inf``."""
    if k < 1:
        raise ValueError(f"top_k must be >= 1; got {k}")
    if k >= logits.shape[-1]:
        return logits
    kept = logits.topk(k, dim=-1)  # (..., k)
    return torch.full_like(logits, NEG_INF).scatter(-1, kept.indices, kept.values)


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filter: keep the smallest set of most probable tokens whose total probability is ``>= p``.

    Sort descending, ``p_(1) >= p_(2) >= ...``; token ``(i)`` is kept iff ``sum_{j<i} p_(j) < p`` (the mass
    before it has not yet reached ``p``), so the most probable token is always kept. Probabilities are summed
    in float64. ``p = 1`` keeps every token.
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1]; got {p}")
    if p == 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (..., V)
    probs = sorted_logits.double().softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (..., V): sum_{j<i} p_(j)
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, NEG_INF)


def filter_logits(
    logits: Tensor, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> Tensor:
    """Temperature, then top-k, then top-p: the logits whose softmax is the sampling distribution."""
    logits = apply_temperature(logits, temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    return logits


NAN_LOGITS = (
    "the model produced NaN (or infinite) logits, so there is no distribution to sample from; the "
    "checkpoint has probably diverged (look at its training loss) or its weights are corrupted"
)


def sample(logits: Tensor, generators: Sequence[torch.Generator] | None = None) -> Tensor:
    """Draw one token per row ``y_b ~ softmax(logits_b)``: ``(B, V) -> (B,)``.

    With ``generators`` (one per row) row ``b`` draws only from ``generators[b]``, so its token does not
    depend on the other rows of the batch. Tokens with logit ``-inf`` (probability 0) are never drawn.

    NaN logits (or ``+inf`` ones, whose softmax is NaN) raise ``ValueError``: ``torch.multinomial`` finds them
    while it draws, so checking costs nothing extra (no host sync) when they are fine.
    """
    probs = logits.float().softmax(dim=-1)  # (B, V)
    if generators is not None and len(generators) != probs.shape[0]:
        raise ValueError(f"need one generator per row: {probs.shape[0]} rows, {len(generators)} generators")
    try:
        if generators is None:
            return torch.multinomial(probs, 1)[:, 0]
        return torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators, strict=True)])
    except RuntimeError as err:
        if not bool(probs.isnan().any()):
            raise
        raise ValueError(NAN_LOGITS) from err


def check_finite_logits(logits: Tensor) -> Tensor:
    """``logits`` unchanged, or ``ValueError`` (:data:`NAN_LOGITS`) if any is NaN or infinite.

    One host sync: decoders call it once, on the first step's logits (a model with a NaN weight gives NaN
    there), not on every step of the decode loop."""
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(NAN_LOGITS)
    return logits


@dataclass(frozen=True)
class SamplingRule:
    """The settings of one sampling step, applied by :meth:`pick` to logits ``(B, V)``."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    greedy: bool = False
    generators: Sequence[torch.Generator] | None = None  # one per row, or None: torch's global RNG

    def pick(self, logits: Tensor) -> Tensor:
        """One token per row ``(B,)``."""
        if self.greedy:  # max's indices: argmax's (the first maximum), and faster on the CPU
            return logits.max(dim=-1).indices
        filtered = filter_logits(logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        return sample(filtered, self.generators)
