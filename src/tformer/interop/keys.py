"""One table per family maps Hugging Face tensors onto tformer's, in both directions.

A :class:`Key` says which tformer tensor is made of which HF tensors: one HF tensor copied (or transposed, for
GPT-2's ``Conv1D`` weights stored ``[in, out]``), or several concatenated along dim 0 (the q, k, v projections into
tformer's one ``in_proj``; a gated feed-forward's gate and up projections into one ``up``). Import reads the table
forwards, export backwards (splitting by the HF tensors' row counts), so the two cannot drift apart.

A file may hold more than the model: tensors a family declares as ignored (buffers such as GPT-2's causal ``attn.bias``
masks, sinusoidal tables that are recomputed) and tied aliases (``lm_head.weight`` of a tied model), which must equal
the tensor they alias. Anything else in the file, or any tformer tensor left unfilled, is an error naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor


class InteropError(ValueError):
    """A checkpoint that does not fit: a missing, unexpected or misshapen tensor, or a setting tformer refuses."""


@dataclass(frozen=True)
class Key:
    """``ours`` = ``theirs`` (one HF tensor) or ``cat(theirs, dim=0)``; ``rows`` are each HF tensor's dim-0 sizes
    (to split on export); ``transpose``: the HF matrix is stored ``[in, out]``; ``shape``: HF's shape when it differs
    from tformer's only by leading 1s (Marian's ``final_logits_bias`` is ``(1, V)``)."""

    ours: str
    theirs: tuple[str, ...]
    rows: tuple[int, ...] = ()
    transpose: bool = False
    shape: tuple[int, ...] | None = None


@dataclass
class KeyTable:
    """The keys of one model, the HF tensors a file may hold that tformer ignores (regexes), and tied aliases
    (HF name -> the HF name it repeats)."""

    keys: list[Key]
    ignored: tuple[str, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)

    def to_tformer(self, tensors: dict[str, Tensor], expected: dict[str, Tensor], source: str) -> dict[str, Tensor]:
        """tformer's state dict from the HF ``tensors`` of ``source``; ``expected``: the model's own state dict
        (names and shapes to fill). Every tensor of the file is used, ignored or a verified alias."""
        used: set[str] = set()
        out: dict[str, Tensor] = {}
        for key in self.keys:
            missing = [name for name in key.theirs if name not in tensors]
            if missing:
                raise InteropError(f"{source}: the tensor {missing[0]} is missing (tformer's {key.ours} needs it)")
            parts = [tensors[name] for name in key.theirs]
            parts = [p.t() if key.transpose else p for p in parts]
            value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if key.shape is not None:
                value = (
                    value.reshape(expected[key.ours].shape) if value.numel() == expected[key.ours].numel() else value
                )
            if key.ours not in expected:
                raise InteropError(f"{source}: tformer's model has no tensor {key.ours} (for {', '.join(key.theirs)})")
            if tuple(value.shape) != tuple(expected[key.ours].shape):
                raise InteropError(
                    f"{source}: {', '.join(key.theirs)} give {key.ours} the shape {tuple(value.shape)}, "
                    f"but the config makes it {tuple(expected[key.ours].shape)}"
                )
            out[key.ours] = value.contiguous()
            used.update(key.theirs)
        for name, primary in self.aliases.items():
            if name in tensors and name not in used:
                if primary in tensors and not torch.equal(tensors[name], tensors[primary]):
                    raise InteropError(f"{source}: {name} differs from {primary}, which the config ties it to")
                used.add(name)
        ignored = [re.compile(pattern) for pattern in self.ignored]
        extra = sorted(n for n in tensors if n not in used and not any(p.fullmatch(n) for p in ignored))
        if extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise InteropError(f"{source}: the tensor {extra[0]}{more} has no place in this model")
        return out

    def to_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The HF tensors of tformer's ``state`` (each tied matrix once, as Hugging Face saves it)."""
        out: dict[str, Tensor] = {}
        for key in self.keys:
            value = state[key.ours]
            parts = [value] if len(key.theirs) == 1 else list(torch.split(value, list(key.rows), dim=0))
            for name, part in zip(key.theirs, parts, strict=True):
                part = part.t() if key.transpose else part
                out[name] = (part.reshape(key.shape) if key.shape is not None else part).contiguous()
        return out


def per_layer(count: int, template: Iterable[Key]) -> list[Key]:
    """The keys of ``count`` layers from one template whose names hold ``{i}``."""
    return [
        Key(k.ours.format(i=i), tuple(t.format(i=i) for t in k.theirs), k.rows, k.transpose, k.shape)
        for i in range(count)
        for k in template
    ]
