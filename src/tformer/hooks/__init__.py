"""Open a model up: named activations, caching, interventions (TransformerLens's vocabulary, on tformer's models).

Every model has hook points (:mod:`tformer.hooks.points`: ``hook_embed``, ``blocks.3.attn.hook_pattern``, ...).
Hooks fire only while attached; with none attached the forward is the same function, bit for bit::

    from tformer import hooks
    logits, cache = hooks.run_with_cache(model, ids, names=["blocks.0.attn.hook_pattern"])
    logits = hooks.run_with_hooks(model, ids, hooks=[("blocks.2.hook_resid_post", steer)])
    with hooks.hooks(model, [("blocks.1.attn.hook_z", ablate)]):
        tformer.generate(model, prompt, max_new_tokens=20)      # hooks fire while decoding too

or TransformerLens's method style on a wrapper: ``hooked = hooks.HookedModel(model)``; ``hooked.run_with_cache(ids)``.
The analysis built on them (logit lens, attribution, ablation, patching, induction): :mod:`tformer.circuits`.
The table of points: ``docs/hooks.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from tformer.hooks.points import (
    HEAD_POINTS,
    NameFilter,
    Point,
    act_name,
    hook_names,
    model_of,
    num_blocks,
    points,
    select,
)
from tformer.hooks.run import (
    ActivationCache,
    Handle,
    Hook,
    HookError,
    HookFn,
    attach,
    hooks,
    remove_all,
    run_with_cache,
    run_with_hooks,
)

__all__ = [
    "HEAD_POINTS",
    "ActivationCache",
    "Handle",
    "Hook",
    "HookError",
    "HookFn",
    "HookedModel",
    "NameFilter",
    "Point",
    "act_name",
    "attach",
    "generate",
    "hook_names",
    "hooks",
    "model_of",
    "num_blocks",
    "points",
    "remove_all",
    "run_with_cache",
    "run_with_hooks",
    "select",
]


def generate(model: nn.Module, prompt_ids, *, hooks: Sequence[tuple[NameFilter, HookFn]] = (), **kwargs):
    """:func:`tformer.generate` with ``hooks`` firing at every step (the prompt's forward, then each new token's,
    through the key/value cache: a hook sees the new positions only). The fused and compiled paths step aside
    while hooks are attached (a warning says so when they were asked for)."""
    from tformer.generation.sampling import generate as run

    with attach(model, hooks):
        return run(model_of(model), prompt_ids, **kwargs)


class HookedModel(nn.Module):
    """TransformerLens's method style around a tformer model: ``run_with_cache``, ``run_with_hooks``, ``hooks``,
    ``hook_names``, ``generate``; calling it calls the model. ``tokenizer`` (optional) gives ``to_tokens`` and
    ``to_str_tokens``. It holds the model, not a copy: hooks attached through it are the model's."""

    def __init__(self, model: nn.Module, tokenizer=None) -> None:
        super().__init__()
        self.model = model_of(model)
        self.tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        self.cfg = self.model.cfg

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    @property
    def hook_names(self) -> list[str]:
        return hook_names(self.model)

    def run_with_cache(self, *args, **kwargs) -> tuple[object, ActivationCache]:
        return run_with_cache(self.model, *args, **kwargs)

    def run_with_hooks(self, *args, **kwargs):
        return run_with_hooks(self.model, *args, **kwargs)

    def hooks(self, fwd_hooks: Sequence[tuple[NameFilter, HookFn]] = ()):
        return hooks(self.model, fwd_hooks)

    def reset_hooks(self) -> None:
        remove_all(self.model)

    def generate(self, prompt_ids, **kwargs):
        return generate(self.model, prompt_ids, **kwargs)

    def to_tokens(self, text: str | Sequence[str]) -> Tensor:
        """``text`` -> ids ``(B, T)`` (one row per string; rows must encode to one length)."""
        import torch

        tok = self._tokenizer()
        rows = [tok.encode(t) for t in ([text] if isinstance(text, str) else text)]
        if len({len(r) for r in rows}) != 1:
            raise ValueError(f"the texts encode to different lengths {[len(r) for r in rows]}: pass one at a time")
        return torch.tensor(rows, dtype=torch.long, device=next(self.model.parameters()).device)

    def to_str_tokens(self, text_or_ids) -> list[str]:
        """Each token of one text (or one row of ids) as its own string."""
        tok = self._tokenizer()
        ids = tok.encode(text_or_ids) if isinstance(text_or_ids, str) else [int(i) for i in text_or_ids]
        return [tok.decode([i]) for i in ids]

    def _tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this HookedModel has no tokenizer: HookedModel(model, tokenizer=...)")
        return self.tokenizer
