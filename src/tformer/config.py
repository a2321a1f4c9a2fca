"""The one typed, validated configuration of every tformer model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

Position = Literal["sinusoidal", "rotary", "learned", "none"]
AttnBackend = Literal["auto", "reference", "sdpa", "tiled", "triton"]
Activation = Literal["relu", "gelu", "gelu_tanh"]


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes and choices of a Transformer; checked when constructed.

    ``d_model`` must split evenly into ``num_heads`` heads of ``head_dim = d_model // num_heads``.
    ``norm_first=True`` is Pre-LN (``x + F(LN(x))``), ``False`` the original Post-LN (``LN(x + F(x))``).
    ``num_layers`` counts the blocks of a decoder-only LM and of each side of an encoder-decoder
    (``num_decoder_layers`` overrides the decoder side).
    ``position``: ``"sinusoidal"`` (added table, any length), ``"rotary"`` (RoPE in every attention,
    any length), ``"learned"`` (a trained table of ``max_seq_len`` rows; longer inputs are an error),
    ``"none"``.
    ``activation`` of the feed-forward layer: ``"relu"`` (the 2017 paper), ``"gelu"`` (exact,
    ``x Phi(x)``) or ``"gelu_tanh"`` (GPT-2's tanh approximation, within 5e-4 of the exact one).
    """

    vocab_size: int = 256
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int = 512
    dropout: float = 0.0
    max_seq_len: int = 256
    norm_first: bool = True
    position: Position = "sinusoidal"
    bias: bool = True
    tie_embeddings: bool = True
    num_kv_heads: int | None = None
    num_decoder_layers: int | None = None
    activation: Activation = "relu"
    rope_base: float = 10000.0
    rope_interleaved: bool = True
    layer_norm_eps: float = 1e-5
    attn_backend: AttnBackend = "auto"
    pad_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"TransformerConfig.{name} must be a positive integer; got {value!r}")
        for name in ("num_kv_heads", "num_decoder_layers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"TransformerConfig.{name} must be a positive integer or None; got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"TransformerConfig.d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                f"choose num_heads among the divisors of d_model (e.g. {_divisors(self.d_model)})"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"TransformerConfig.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"TransformerConfig.dropout must be in [0, 1); got {self.dropout!r}")
        for name, kind in (("position", Position), ("attn_backend", AttnBackend), ("activation", Activation)):
            if getattr(self, name) not in get_args(kind):
                raise ValueError(
                    f"TransformerConfig.{name}={getattr(self, name)!r} is unknown; choose one of {get_args(kind)}"
                )
        if self.position == "rotary" and self.head_dim % 2:
            raise ValueError(
                f"TransformerConfig.position='rotary' rotates pairs of features, so the head dimension "
                f"d_model/num_heads={self.head_dim} must be even; change d_model or num_heads"
            )
        if self.rope_base <= 1.0:
            raise ValueError(f"TransformerConfig.rope_base must be > 1; got {self.rope_base!r}")
        if self.pad_id is not None and not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"TransformerConfig.pad_id={self.pad_id} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def decoder_layers(self) -> int:
        return self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers

    def replace(self, **changes: Any) -> TransformerConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TransformerConfig fields {unknown}; known fields are {sorted(known)}")
        return cls(**data)

    @classmethod
    def tiny(cls, **changes: Any) -> TransformerConfig:
        """A few-thousand-parameter model for tests and examples."""
        base = dict(vocab_size=32, d_model=32, num_heads=4, num_layers=2, d_ff=64, max_seq_len=64)
        return cls(**{**base, **changes})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0]
