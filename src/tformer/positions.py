"""Position encodings: the sinusoidal table, a learned table, and RoPE (rotary position embedding).

The tables are sized from the config when the module is built (``max_len`` rows). A longer input grows them by its
*shape*, a Python int known before any value is computed (:meth:`_FixedTables.reserve`), never by reading positions
back from the device: a forward pass stays free of host syncs and compiles into one graph.

Shapes: B, T, C, H, D (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tformer.functional import rotary_cos_sin, rotate_pairs, sinusoidal_positional_encoding


class _FixedTables(nn.Module):
    """Non-trainable tables of one row per position, computed in float64 by ``_compute(rows)`` and stored in the
    module's dtype. Recomputed (not converted) when the module moves to another dtype or device, so a
    ``.double()`` model holds float64-exact tables."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        for name, table in zip(self._names(), self._compute(rows, "cpu", torch.get_default_dtype()), strict=True):
            self.register_buffer(name, table, persistent=False)  # derived from the config: not in checkpoints

    def _names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _compute(self, rows: int, device, dtype: torch.dtype) -> tuple[Tensor, ...]:
        raise NotImplementedError

    @property
    def rows(self) -> int:
        return getattr(self, self._names()[0]).shape[0]

    def _rebuild(self, rows: int) -> None:
        like = getattr(self, self._names()[0])
        for name, table in zip(self._names(), self._compute(rows, like.device, like.dtype), strict=True):
            setattr(self, name, table)

    def reserve(self, length: int) -> None:
        """Make room for positions ``0 .. length - 1`` (doubling), ``length`` being an input's static size."""
        if length > self.rows:
            self._rebuild(max(length, 2 * self.rows))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._rebuild(self.rows)  # exact in the new dtype, on the new device
        return self


class SinusoidalPositions(_FixedTables):
    """Fixed table ``PE[pos]`` of :func:`tformer.functional.sinusoidal_positional_encoding`, added to the token
    embeddings: ``(max_len, C)`` from construction, grown for longer inputs (:meth:`reserve`)."""

    def __init__(self, d_model: int, max_len: int = 512, base: float = 10000.0, layout: str = "interleaved") -> None:
        self.d_model, self.base, self.layout = d_model, base, layout
        super().__init__(max_len)

    def _names(self) -> tuple[str, ...]:
        return ("table",)

    def _compute(self, rows: int, device, dtype: torch.dtype) -> tuple[Tensor, ...]:
        return (
            sinusoidal_positional_encoding(
                rows, self.d_model, self.base, dtype=dtype, device=device, layout=self.layout
            ),
        )

    def forward(self, positions: Tensor) -> Tensor:
        """``positions (T,)`` or ``(B, T)`` int -> ``(T, C)`` or ``(B, T, C)``; call :meth:`reserve` first."""
        return self.table[positions]


class LearnedPositions(nn.Module):
    """A trained table of ``max_len`` position vectors (BERT, GPT-2). Longer inputs are an error."""

    def __init__(self, max_len: int, d_model: int) -> None:
        super().__init__()
        if max_len < 1 or d_model < 1:
            raise ValueError(f"learned positions need max_len >= 1 and d_model >= 1; got {max_len} and {d_model}")
        self.table = nn.Embedding(max_len, d_model)

    def reserve(self, length: int) -> None:
        """``ValueError`` when ``length`` positions do not fit the table (the input's static size is checked)."""
        if length > self.table.num_embeddings:
            raise ValueError(
                f"position {length - 1} is beyond max_seq_len={self.table.num_embeddings} of the learned position "
                "table; shorten the input or build the model with a larger max_seq_len"
            )

    def forward(self, positions: Tensor) -> Tensor:
        return self.table(positions)


class RotaryEmbedding(_FixedTables):
    """RoPE applied to queries and keys inside attention (see :func:`tformer.functional.apply_rotary`).

    Holds ``cos(m theta_i)``, ``sin(m theta_i)`` for positions ``m < max_len`` (computed in float64), grown for longer
    inputs (:meth:`reserve`). ``forward(positions)`` looks up the angles of a batch once; :meth:`rotate` turns the
    queries or keys of every layer by them.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, interleaved: bool = True, *, max_len: int = 256) -> None:
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head dimension of at least 2; got {head_dim}")
        self.head_dim, self.base, self.interleaved = head_dim, base, interleaved
        super().__init__(max_len)

    def _names(self) -> tuple[str, ...]:
        return ("cos", "sin")

    def _compute(self, rows: int, device, dtype: torch.dtype) -> tuple[Tensor, ...]:
        return rotary_cos_sin(torch.arange(rows, device=device), self.head_dim, self.base, dtype)  # (rows, D/2) x2

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``positions (T,)`` or ``(B, T)`` -> ``cos, sin`` of shape ``(T, D/2)`` or ``(B, 1, T, D/2)`` (broadcast
        over heads); call :meth:`reserve` first."""
        cos, sin = self.cos[positions], self.sin[positions]
        if positions.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]  # (B, T, D/2) -> (B, 1, T, D/2)
        return cos, sin

    def rotate(self, x: Tensor, angles: tuple[Tensor, Tensor]) -> Tensor:
        """``x (B, H, T, D)`` turned by ``angles = forward(positions)``, cast to ``x``'s dtype (e.g. under autocast)."""
        cos, sin = angles
        return rotate_pairs(x, cos.to(x.dtype), sin.to(x.dtype), self.interleaved)
