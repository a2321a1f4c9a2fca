"""Interventions: head ablation, activation patching, and the induction-head measurements of Olsson et al. (2022).

Shapes: NL, H, B, T, S, D, C, V (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.hooks import Hook, HookFn, model_of, num_blocks, points, run_with_cache, run_with_hooks

Metric = Callable[[Tensor], Tensor]


def _depth_heads(model: nn.Module) -> tuple[int, int, int]:
    """Blocks, query heads and key/value heads of ``model``'s (first) stack."""
    table = points(model)
    depth = num_blocks(model) if "blocks.0.hook_resid_pre" in table else 0
    if depth == 0:
        raise TypeError("these tools read a single stack of blocks (a language model or an encoder)")
    attn = table["blocks.0.attn.hook_z"].module
    return depth, attn.num_heads, attn.num_kv_heads


def _check_heads(model: nn.Module, heads: Sequence[tuple[int, int]]) -> None:
    depth, num_heads, _ = _depth_heads(model)
    for layer, head in heads:
        if not (0 <= layer < depth and 0 <= head < num_heads):
            raise ValueError(
                f"head ({layer}, {head}) is out of range: the model has {depth} layers of {num_heads} heads "
                f"(layer 0..{depth - 1}, head 0..{num_heads - 1})"
            )


def head_means(model: nn.Module, *args, **kwargs) -> dict[int, Tensor]:
    """Each layer's mean head output ``z`` over the batch and positions of ``model(*args)``: ``{layer: (H, D)}``
    (the reference of mean ablation)."""
    depth, _, _ = _depth_heads(model)
    _, cache = run_with_cache(model, *args, names=[f"blocks.{i}.attn.hook_z" for i in range(depth)], **kwargs)
    return {i: cache[f"blocks.{i}.attn.hook_z"].mean(dim=(0, 1)) for i in range(depth)}


def ablate_heads(
    model: nn.Module, heads: Sequence[tuple[int, int]], kind: str = "zero", means: dict[int, Tensor] | None = None
) -> list[tuple[str, HookFn]]:
    """Hooks that remove heads ``[(layer, head), ...]``: their output ``z`` set to zero (``kind="zero"``: the same
    as zeroing the head's columns of ``W^O``) or to its mean (``kind="mean"``, ``means`` from :func:`head_means`).
    Use them with :func:`tformer.hooks.run_with_hooks` or :func:`tformer.hooks.hooks`."""
    if kind not in ("zero", "mean"):
        raise ValueError(f"kind={kind!r}: ablate with 'zero' or 'mean'")
    if kind == "mean" and means is None:
        raise ValueError("mean ablation needs means=head_means(model, reference_ids)")
    _check_heads(model, heads)
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)

    def make(layer: int, chosen: list[int]) -> HookFn:
        def ablate(z: Tensor, hook: Hook) -> Tensor:  # z (B, T, H, D)
            z = z.clone()
            z[:, :, chosen] = 0.0 if kind == "zero" else means[layer][chosen].to(z.dtype)
            return z

        return ablate

    return [(f"blocks.{layer}.attn.hook_z", make(layer, chosen)) for layer, chosen in by_layer.items()]


def logit_diff(correct: int, wrong: int, position: int = -1) -> Metric:
    """The metric ``logits[:, position, correct] - logits[:, position, wrong]``, averaged over the batch."""

    def metric(logits: Tensor) -> Tensor:
        return (logits[:, position, correct] - logits[:, position, wrong]).float().mean()

    return metric


def patch_residual(
    model: nn.Module,
    clean: Tensor,
    corrupted: Tensor,
    metric: Metric,
    point: str = "resid_pre",
    mask: Tensor | None = None,
) -> Tensor:
    """Activation patching of the residual stream: ``(NL, T)``, the metric of the corrupted run with the clean
    activation ``blocks.{l}.hook_{point}`` put back at one position ``t`` (clean and corrupted must have one
    length; ``mask``, the padding mask both share). Normalize with :func:`restored`."""
    if clean.shape != corrupted.shape:
        raise ValueError(
            f"clean {tuple(clean.shape)} and corrupted {tuple(corrupted.shape)} must have the same shape: patching "
            "swaps activations position by position"
        )
    depth, _, _ = _depth_heads(model)
    names = [f"blocks.{i}.hook_{point}" for i in range(depth)]
    _, cache = run_with_cache(model, clean, mask, names=names)
    out = torch.empty(depth, clean.shape[1])
    with torch.no_grad():
        for i, name in enumerate(names):
            for t in range(clean.shape[1]):

                def put(x: Tensor, hook: Hook, t: int = t) -> Tensor:
                    x = x.clone()
                    x[:, t] = cache[hook.name][:, t]
                    return x

                out[i, t] = metric(run_with_hooks(model, corrupted, mask, hooks=[(name, put)]))
    return out


def patch_heads(
    model: nn.Module, clean: Tensor, corrupted: Tensor, metric: Metric, point: str = "z", mask: Tensor | None = None
) -> Tensor:
    """Activation patching per head, at every position: ``(NL, H)`` (or ``(NL, Hkv)``), the metric of the corrupted
    run with one head's clean ``hook_{point}`` put back (``z``, ``q``, ``pattern``: query heads; ``k``, ``v``:
    key/value heads, so a grouped-query model patches each shared key/value head once). ``mask``: as
    :func:`patch_residual`."""
    depth, num_heads, kv_heads = _depth_heads(model)
    name_of = {"pattern": "hook_pattern", "z": "hook_z", "q": "hook_q", "k": "hook_k", "v": "hook_v"}
    if point not in name_of:
        raise ValueError(f"point={point!r}: patch heads at one of {', '.join(name_of)}")
    count = kv_heads if point in ("k", "v") else num_heads
    head_dim = 1 if point == "pattern" else 2  # pattern (B, H, T, S); the others (B, T, H, D)
    names = [f"blocks.{i}.attn.{name_of[point]}" for i in range(depth)]
    _, cache = run_with_cache(model, clean, mask, names=names)
    out = torch.empty(depth, count)
    with torch.no_grad():
        for i, name in enumerate(names):
            for h in range(count):

                def put(x: Tensor, hook: Hook, h: int = h) -> Tensor:
                    x = x.clone()
                    x.select(head_dim, h).copy_(cache[hook.name].select(head_dim, h))
                    return x

                out[i, h] = metric(run_with_hooks(model, corrupted, mask, hooks=[(name, put)]))
    return out


def restored(patched: Tensor, clean: float, corrupted: float) -> Tensor:
    """The share of the clean metric a patch restores: ``(patched - corrupted) / (clean - corrupted)``."""
    return (patched - corrupted) / (clean - corrupted)


def repeated_tokens(
    vocab_size: int, length: int, batch: int = 4, seed: int = 0, prefix: Sequence[int] = (), low: int = 0
) -> Tensor:
    """``(B, len(prefix) + 2 * length)``: ``prefix`` (a BOS token, say), then ``length`` random tokens in
    ``[low, vocab_size)``, then the same tokens again (Olsson et al., 2022)."""
    if length < 2 or batch < 1 or not 0 <= low < vocab_size - 1:
        raise ValueError(f"need length >= 2, batch >= 1 and 0 <= low < vocab_size - 1; got {length}, {batch}, {low}")
    gen = torch.Generator().manual_seed(seed)
    half = torch.randint(low, vocab_size, (batch, length), generator=gen)
    head = torch.tensor(list(prefix), dtype=torch.long).expand(batch, len(prefix))
    return torch.cat([head, half, half], dim=1)


def induction_scores(model: nn.Module, ids: Tensor, length: int, prefix: int = 0) -> Tensor:
    """``(NL, H)``: each head's mean attention, over the repeat of :func:`repeated_tokens`, from a token to the one
    after its earlier occurrence (query ``t``, key ``t - length + 1``): 1 for a perfect induction head."""
    depth, _, _ = _depth_heads(model)
    names = [f"blocks.{i}.attn.hook_pattern" for i in range(depth)]
    _, cache = run_with_cache(model, ids, names=names)
    queries = torch.arange(prefix + length, prefix + 2 * length)
    keys = queries - length + 1
    return torch.stack([cache[n][:, :, queries, keys].float().mean(dim=(0, 2)) for n in names])


def repeated_loss(
    model: nn.Module, ids: Tensor, length: int, prefix: int = 0, hooks: Sequence[tuple[str, HookFn]] = ()
) -> float:
    """The mean next-token loss over the repeat of :func:`repeated_tokens` (predicting tokens 2..length of it), with
    ``hooks`` attached: what induction heads make small."""
    lm = model_of(model)
    with torch.no_grad():
        logits = run_with_hooks(lm, ids, hooks=list(hooks))
    start = prefix + length  # the repeat's first token cannot be predicted from the first half
    predicted = logits[:, start:-1].float()
    return float(F.cross_entropy(predicted.reshape(-1, predicted.shape[-1]), ids[:, start + 1 :].reshape(-1)))
