"""The one typed, validated configuration of every tformer model.

Each field's ``metadata["help"]`` says what it sets (the ``tformer train`` flags take their help from it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

Position = Literal["sinusoidal", "rotary", "learned", "none"]
AttnBackend = Literal["auto", "reference", "sdpa", "tiled", "triton"]  # tformer.attention.BACKEND_NAMES (tested)
Activation = Literal["relu", "gelu", "gelu_tanh"]


class ConfigError(ValueError):
    """A setting that cannot work; ``fields`` names the settings the message is about (first the one to change)."""

    def __init__(self, message: str, *fields: str) -> None:
        super().__init__(message)
        self.fields = fields


def _doc(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes and choices of a Transformer; checked when constructed.

    ``d_model`` must split evenly into ``num_heads`` heads of ``head_dim = d_model // num_heads``.
    ``norm_first=True`` is Pre-LN (``x + F(LN(x))``), ``False`` the original Post-LN (``LN(x + F(x))``).
    ``num_layers`` counts the blocks of a decoder-only LM and of each side of an encoder-decoder
    (``num_decoder_layers`` overrides the decoder side).
    ``position``: ``"sinusoidal"`` (added table, any length), ``"rotary"`` (RoPE in every attention,
    any length), ``"learned"`` (a trained table of ``max_seq_len`` rows; longer inputs are an error),
    ``"none"``. Sinusoidal and rotary tables hold ``max_seq_len`` rows from construction and grow for longer inputs.
    ``activation`` of the feed-forward layer: ``"relu"`` (the 2017 paper), ``"gelu"`` (exact,
    ``x Phi(x)``) or ``"gelu_tanh"`` (GPT-2's tanh approximation, within 5e-4 of the exact one).
    """

    vocab_size: int = _doc(256, "tokens in the vocabulary")
    d_model: int = _doc(128, "model width: the size of every token's vector")
    num_heads: int = _doc(4, "attention heads (d_model must be a multiple)")
    num_layers: int = _doc(2, "blocks (of each side of an encoder-decoder)")
    d_ff: int = _doc(512, "width of the feed-forward layer")
    dropout: float = _doc(0.0, "dropout on embeddings, attention weights and sublayer outputs, in [0, 1)")
    max_seq_len: int = _doc(256, "positions of the learned table; initial rows of the sinusoidal and RoPE tables")
    norm_first: bool = _doc(True, "Pre-LN (x + F(LN(x))) or Post-LN (LN(x + F(x))) blocks")
    position: Position = _doc("sinusoidal", "position encoding")
    bias: bool = _doc(True, "biases in the linear layers and LayerNorms")
    tie_embeddings: bool = _doc(True, "the output projection reuses the token embedding")
    num_kv_heads: int | None = _doc(None, "key/value heads of grouped-query attention (default num_heads)")
    num_decoder_layers: int | None = _doc(None, "decoder blocks of an encoder-decoder (default num_layers)")
    activation: Activation = _doc("relu", "activation of the feed-forward layer")
    rope_base: float = _doc(10000.0, "RoPE's base: theta_i = base^(-2i/head_dim)")
    rope_interleaved: bool = _doc(True, "RoPE pairs (x0, x1), (x2, x3)... (True) or (x_i, x_{i+D/2}) (False)")
    layer_norm_eps: float = _doc(1e-5, "epsilon of every LayerNorm")
    attn_backend: AttnBackend = _doc("auto", "attention implementation (all exact; tformer.attention)")
    pad_id: int | None = _doc(None, "the padding token's id, if the vocabulary has one")

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"TransformerConfig.{name} must be a positive integer; got {value!r}", name)
        for name in ("num_kv_heads", "num_decoder_layers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"TransformerConfig.{name} must be a positive integer or None; got {value!r}", name)
        for name in ("dropout", "rope_base", "layer_norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigError(f"TransformerConfig.{name} must be a number; got {value!r}", name)
        if not (math.isfinite(self.layer_norm_eps) and self.layer_norm_eps > 0):
            raise ConfigError(
                f"TransformerConfig.layer_norm_eps must be a number > 0; got {self.layer_norm_eps!r}", "layer_norm_eps"
            )
        for name in ("norm_first", "bias", "tie_embeddings", "rope_interleaved"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"TransformerConfig.{name} must be True or False; got {getattr(self, name)!r}", name)
        if self.d_model % self.num_heads:
            raise ConfigError(
                f"TransformerConfig.d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                f"choose num_heads among the divisors of d_model (e.g. {_divisors(self.d_model)})",
                "d_model",
                "num_heads",
            )
        if self.num_heads % self.kv_heads:
            raise ConfigError(
                f"TransformerConfig.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}",
                "num_kv_heads",
                "num_heads",
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"TransformerConfig.dropout must be in [0, 1); got {self.dropout!r}", "dropout")
        for name, kind in (("position", Position), ("attn_backend", AttnBackend), ("activation", Activation)):
            if getattr(self, name) not in get_args(kind):
                raise ConfigError(
                    f"TransformerConfig.{name}={getattr(self, name)!r} is unknown; choose one of {get_args(kind)}", name
                )
        if self.position == "rotary" and self.head_dim % 2:
            raise ConfigError(
                f"TransformerConfig.position='rotary' rotates pairs of features, so the head dimension "
                f"d_model/num_heads={self.head_dim} must be even; change d_model or num_heads",
                "position",
                "d_model",
                "num_heads",
            )
        if not (math.isfinite(self.rope_base) and self.rope_base > 1.0):
            raise ConfigError(f"TransformerConfig.rope_base must be > 1; got {self.rope_base!r}", "rope_base")
        if self.pad_id is not None and not 0 <= self.pad_id < self.vocab_size:
            raise ConfigError(
                f"TransformerConfig.pad_id={self.pad_id} is outside the vocabulary [0, {self.vocab_size})", "pad_id"
            )

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
            raise ConfigError(f"unknown TransformerConfig fields {unknown}; known fields are {sorted(known)}")
        return cls(**data)

    @classmethod
    def tiny(cls, **changes: Any) -> TransformerConfig:
        """A few-thousand-parameter model for tests and examples."""
        base = dict(vocab_size=32, d_model=32, num_heads=4, num_layers=2, d_ff=64, max_seq_len=64)
        return cls(**{**base, **changes})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0]
