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
Activation = Literal["relu", "gelu", "gelu_tanh", "silu"]
Norm = Literal["layer", "rms"]
FeedForwardKind = Literal["mlp", "gated"]
PairLayout = Literal["interleaved", "half"]
CHOICES = {
    "position": Position,
    "attn_backend": AttnBackend,
    "activation": Activation,
    "norm": Norm,
    "ffn": FeedForwardKind,
    "pair_layout": PairLayout,
}


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
    ``x Phi(x)``), ``"gelu_tanh"`` (GPT-2's tanh approximation, within 5e-4 of the exact one) or ``"silu"``
    (``x sigmoid(x)``, Llama's, in a gated feed-forward ``ffn="gated"``: SwiGLU).

    The choices pretrained families need, each a small module where the model is built (defaults: the 2017 model):
    ``norm`` LayerNorm or RMSNorm; ``ffn`` a plain or a gated feed-forward; ``qkv_bias`` biases on the query, key and
    value projections only (Qwen2; ``None``: as ``bias``); ``type_vocab_size`` token-type embeddings (BERT);
    ``embed_norm`` a norm after the embeddings (BERT); ``embed_scale`` the ``sqrt(d_model)`` embedding scale (``None``:
    the model's convention, on in an encoder-decoder, off in an LM); ``logits_bias`` a fixed bias on the logits
    (Marian's ``final_logits_bias``); ``pooler`` BERT's tanh layer on the first token; ``pair_layout`` which
    features form the pairs of the sinusoidal table and of RoPE: ``"interleaved"`` ``(x_0, x_1), (x_2, x_3)...``
    (the 2017 paper, RoFormer) or ``"half"`` ``(x_i, x_{i + D/2})`` (Marian's ``[sin | cos]``, rotate-half RoPE).
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
    pair_layout: PairLayout = _doc(
        "interleaved", "features paired by the sinusoid and RoPE: (x0, x1)... or (x_i, x_i+D/2)"
    )
    layer_norm_eps: float = _doc(1e-5, "epsilon of every LayerNorm")
    attn_backend: AttnBackend = _doc("auto", "attention implementation (all exact; tformer.attention)")
    pad_id: int | None = _doc(None, "the padding token's id, if the vocabulary has one")
    norm: Norm = _doc("layer", "LayerNorm or RMSNorm (Llama)")
    ffn: FeedForwardKind = _doc("mlp", "a plain feed-forward W2 act(W1 x) or a gated one W2 (act(Wg x) * W1 x)")
    qkv_bias: bool | None = _doc(None, "biases on the q, k, v projections (default: as bias; Qwen2: True)")
    type_vocab_size: int = _doc(0, "token-type (segment) embeddings; 0: none (BERT: 2)")
    embed_norm: bool = _doc(False, "a norm right after the embeddings (BERT)")
    embed_scale: bool | None = _doc(None, "scale embeddings by sqrt(d_model) (default: in an encoder-decoder)")
    logits_bias: bool = _doc(False, "a fixed bias added to the logits (Marian's final_logits_bias)")
    pooler: bool = _doc(False, "an encoder's tanh layer on its first token (BERT's pooler)")

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
        for name in ("norm_first", "bias", "tie_embeddings", "embed_norm", "logits_bias", "pooler"):
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
        for name in ("qkv_bias", "embed_scale"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"TransformerConfig.{name} must be True, False or None; got {getattr(self, name)!r}", name
                )
        if (
            not isinstance(self.type_vocab_size, int)
            or isinstance(self.type_vocab_size, bool)
            or self.type_vocab_size < 0
        ):
            raise ConfigError(
                f"TransformerConfig.type_vocab_size must be an integer >= 0; got {self.type_vocab_size!r}",
                "type_vocab_size",
            )
        for name, kind in CHOICES.items():
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
        if self.pad_id is not None and (not isinstance(self.pad_id, int) or isinstance(self.pad_id, bool)):
            raise ConfigError(
                f"TransformerConfig.pad_id must be a token id (an integer) or None; got {self.pad_id!r}", "pad_id"
            )
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
        """Every field by name (JSON-ready: a checkpoint's ``model_config``); ``TransformerConfig(**d)`` rebuilds it."""
        return dataclasses.asdict(self)

    @property
    def interleaved(self) -> bool:
        """Whether the sinusoid and RoPE pair neighbouring features (``pair_layout="interleaved"``)."""
        return self.pair_layout == "interleaved"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        """The config of ``data``, ``to_dict``'s output (older ones hold ``rope_interleaved``, not ``pair_layout``)."""
        data = dict(data)
        if "rope_interleaved" in data and "pair_layout" not in data:
            data["pair_layout"] = "interleaved" if data.pop("rope_interleaved") else "half"
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
