"""The hook points of a model, by name: where each fires, what shape it holds, and the table that resolves a name.

Names follow TransformerLens (``blocks.3.attn.hook_pattern``) wherever it has the point. Shapes: B, T, S, C, H, Hkv,
D, F (the package legend, :mod:`tformer`; F is the feed-forward width ``d_ff``). Every point is a place in a
module's forward (:class:`tformer.layers.Tapped`); this module only names them. The full table, with where each point
sits in the math: ``docs/hooks.md``.
"""

from __future__ import annotations

import difflib
import re
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from tformer.layers import GatedFeedForward, LayerNorm, MultiHeadAttention, RMSNorm, Tapped, TransformerBlock
from tformer.models import Decoder, DecoderLM, Embedder, Encoder, EncoderDecoder, _EmbeddedStack

# Points whose module holds heads first, (B, H, T, D), and whose hooks see TransformerLens's (B, T, H, D).
HEAD_POINTS = frozenset({"hook_q", "hook_k", "hook_v", "hook_rot_q", "hook_rot_k"})
# Computed only when hooked (they cost a materialized pattern or a (B, T, H, C) tensor): not in the default cache.
ON_DEMAND = frozenset({"hook_result"})


@dataclass(frozen=True)
class Point:
    """One hook point: its full ``name``, the ``module`` whose forward fires it, the module's own name for it
    (``local``), the block it belongs to (``layer``, ``None`` outside the blocks) and its shape in symbols."""

    name: str
    module: Tapped
    local: str
    layer: int | None
    shape: str


def _shape(local: str) -> str:
    if local in ("hook_q", "hook_rot_q", "hook_z"):
        return "(B, T, H, D)"
    if local in ("hook_k", "hook_v", "hook_rot_k"):
        return "(B, S, Hkv, D)"
    if local in ("hook_attn_scores", "hook_pattern"):
        return "(B, H, T, S)"
    if local == "hook_result":
        return "(B, T, H, C)"
    if local in ("hook_pre", "hook_pre_linear", "hook_post"):
        return "(B, T, F)"
    if local == "hook_scale":
        return "(B, T, 1)"
    if local == "hook_unembed":
        return "(B, T, V)"
    return "(B, T, C)"


class _Table:
    """Builds the list of a model's points in the order they fire."""

    def __init__(self) -> None:
        self.points: list[Point] = []

    def add(self, prefix: str, module: nn.Module, locals_: Iterable[str], layer: int | None = None) -> None:
        for local in locals_:
            self.points.append(Point(prefix + local, module, local, layer, _shape(local)))

    def norm(self, prefix: str, norm: nn.Module, layer: int | None) -> None:
        if isinstance(norm, (LayerNorm, RMSNorm)):
            self.add(prefix, norm, ("hook_scale", "hook_normalized"), layer)

    def embedder(self, prefix: str, embed: Embedder) -> None:
        names = ["hook_embed"]
        names += ["hook_pos_embed"] if embed.positions is not None else []
        names += ["hook_token_type_embed"] if embed.token_types is not None else []
        self.add(prefix, embed, names)
        if embed.norm is not None:
            self.norm(prefix + "ln.", embed.norm, None)

    def attention(self, prefix: str, attn: MultiHeadAttention, layer: int, cross: bool) -> None:
        names = ["hook_q", "hook_k", "hook_v"]
        names += ["hook_rot_q", "hook_rot_k"] if attn.rotary is not None and not cross else []
        self.add(prefix, attn, [*names, "hook_attn_scores", "hook_pattern", "hook_z", "hook_result"], layer)

    def block(self, prefix: str, block: TransformerBlock, layer: int) -> None:
        cross = block.cross_attn is not None
        pre_ln = block.norm_first
        self.add(prefix, block, ("hook_resid_pre",), layer)
        if pre_ln:
            self.norm(prefix + "ln1.", block.self_attn_norm, layer)
        self.attention(prefix + "attn.", block.self_attn, layer, cross=False)
        self.add(prefix, block, ("hook_attn_out", "hook_resid_mid"), layer)
        if not pre_ln:
            self.norm(prefix + "ln1.", block.self_attn_norm, layer)
        if cross:
            if pre_ln:
                self.norm(prefix + "ln2.", block.cross_attn_norm, layer)
            self.attention(prefix + "cross_attn.", block.cross_attn, layer, cross=True)
            self.add(prefix, block, ("hook_cross_attn_out", "hook_resid_mid_cross"), layer)
            if not pre_ln:
                self.norm(prefix + "ln2.", block.cross_attn_norm, layer)
        ff_norm = prefix + ("ln3." if cross else "ln2.")
        self.add(prefix, block, ("hook_mlp_in",), layer)
        if pre_ln:
            self.norm(ff_norm, block.ff_norm, layer)
        gated = isinstance(block.ff, GatedFeedForward)
        mlp = ["hook_pre", "hook_pre_linear", "hook_post"] if gated else ["hook_pre", "hook_post"]
        self.add(prefix + "mlp.", block.ff, mlp, layer)
        self.add(prefix, block, ("hook_mlp_out", "hook_resid_post"), layer)
        if not pre_ln:
            self.norm(ff_norm, block.ff_norm, layer)
            self.add(prefix, block, ("hook_normalized_resid_post",), layer)

    def stack(self, body: _EmbeddedStack, embed_prefix: str, blocks_prefix: str, final_prefix: str) -> None:
        self.embedder(embed_prefix, body.embed)
        for i, block in enumerate(body.stack.blocks):
            self.block(f"{blocks_prefix}{i}.", block, i)
        self.norm(final_prefix, body.stack.final_norm, None)


def model_of(model: nn.Module) -> nn.Module:
    """The Transformer inside ``model``: itself, or the ``.model`` of what :func:`tformer.load_pretrained` and
    :func:`tformer.load_checkpoint` return."""
    inner = getattr(model, "model", None)
    if not isinstance(model, (DecoderLM, Encoder, Decoder, EncoderDecoder)) and isinstance(inner, nn.Module):
        return inner
    return model


def build(model: nn.Module) -> list[Point]:
    """Every hook point of ``model`` (a :class:`DecoderLM`, :class:`Encoder`, :class:`Decoder` or
    :class:`EncoderDecoder`), in the order a forward fires them."""
    table = _Table()
    if isinstance(model, DecoderLM):
        table.stack(model.decoder, "", "blocks.", "ln_final.")
        table.add("", model, ("hook_unembed",))
    elif isinstance(model, (Encoder, Decoder)):
        table.stack(model, "embed.", "blocks.", "ln_final.")
    elif isinstance(model, EncoderDecoder):
        table.stack(model.encoder, "encoder.embed.", "encoder.", "encoder_final_ln.")
        table.stack(model.decoder, "decoder.embed.", "decoder.", "decoder_final_ln.")
        table.add("", model, ("hook_unembed",))
    else:
        raise TypeError(
            f"hook points exist on tformer's models (DecoderLM, Encoder, Decoder, EncoderDecoder); got a "
            f"{type(model).__name__}: pass the model itself (or what load_pretrained returns)"
        )
    return table.points


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def points(model: nn.Module) -> dict[str, Point]:
    """``name -> Point`` of every hook point of ``model``, in firing order (built once per model)."""
    model = model_of(model)
    table = _TABLES.get(model)
    if table is None:
        table = _TABLES[model] = {p.name: p for p in build(model)}
    return table


def num_blocks(model: nn.Module) -> int:
    """How many blocks ``model``'s points belong to (an encoder-decoder: its deeper stack)."""
    return len({p.layer for p in points(model).values() if p.layer is not None})


def hook_names(model: nn.Module) -> list[str]:
    """The names of ``model``'s hook points, in the order a forward fires them."""
    return list(points(model))


NameFilter = str | Iterable[str] | Callable[[str], bool] | None


def select(model: nn.Module, names: NameFilter, *, default_all: bool = True) -> list[Point]:
    """The points ``names`` picks: one name, a list of names, a predicate on names (TransformerLens's
    ``names_filter``) or ``None`` (every point but those computed on demand, ``hook_result``).

    An unknown name raises ``KeyError`` listing the closest names of this model."""
    table = points(model)
    if names is None:
        return [p for p in table.values() if p.local not in ON_DEMAND] if default_all else []
    if callable(names):
        return [p for p in table.values() if names(p.name)]
    wanted = [names] if isinstance(names, str) else list(names)
    for name in wanted:
        if name not in table:
            raise KeyError(unknown_name(model, name))
    return [table[name] for name in wanted]


def unknown_name(model: nn.Module, name: object) -> str:
    table = points(model)
    text = str(name)
    close = difflib.get_close_matches(text, table, n=4, cutoff=0.6)
    layers = sorted({p.layer for p in table.values() if p.layer is not None})
    match = re.search(r"(?:blocks|encoder|decoder)\.(\d+)\.", text)
    if match and int(match.group(1)) not in layers:
        return (
            f"no hook point {text!r}: layer {match.group(1)} is out of range, the model has {len(layers)} blocks "
            f"(0..{len(layers) - 1})"
        )
    hint = f"; close: {', '.join(close)}" if close else "; tformer.hooks.hook_names(model) lists them all"
    return f"no hook point {text!r} in this {type(model_of(model)).__name__}{hint}"


# TransformerLens's short names (utils.get_act_name) -> (where, local name)
_SHORT = {
    "embed": ("", "hook_embed"),
    "pos_embed": ("", "hook_pos_embed"),
    "resid_pre": ("block", "hook_resid_pre"),
    "resid_mid": ("block", "hook_resid_mid"),
    "resid_post": ("block", "hook_resid_post"),
    "attn_out": ("block", "hook_attn_out"),
    "mlp_in": ("block", "hook_mlp_in"),
    "mlp_out": ("block", "hook_mlp_out"),
    "q": ("attn", "hook_q"),
    "k": ("attn", "hook_k"),
    "v": ("attn", "hook_v"),
    "rot_q": ("attn", "hook_rot_q"),
    "rot_k": ("attn", "hook_rot_k"),
    "attn_scores": ("attn", "hook_attn_scores"),
    "scores": ("attn", "hook_attn_scores"),
    "pattern": ("attn", "hook_pattern"),
    "attn": ("attn", "hook_pattern"),
    "z": ("attn", "hook_z"),
    "result": ("attn", "hook_result"),
    "pre": ("mlp", "hook_pre"),
    "pre_linear": ("mlp", "hook_pre_linear"),
    "post": ("mlp", "hook_post"),
    "scale": ("ln", "hook_scale"),
    "normalized": ("ln", "hook_normalized"),
}


def act_name(kind: str, layer: int | None = None, sublayer: str | None = None) -> str:
    """TransformerLens's ``utils.get_act_name``: ``act_name("pattern", 3) == "blocks.3.attn.hook_pattern"``;
    norms take their name as ``sublayer`` (``act_name("scale", 2, "ln1")``; without a layer, ``ln_final``)."""
    if kind not in _SHORT:
        raise KeyError(f"unknown activation kind {kind!r}; choose one of {', '.join(_SHORT)}")
    where, local = _SHORT[kind]
    if where == "":
        return local
    if where == "ln" and layer is None:
        return f"{sublayer or 'ln_final'}.{local}"
    if layer is None:
        raise ValueError(f"act_name({kind!r}) needs a layer: act_name({kind!r}, 0)")
    if where == "block":
        return f"blocks.{layer}.{local}"
    if where == "ln":
        return f"blocks.{layer}.{sublayer or 'ln1'}.{local}"
    return f"blocks.{layer}.{sublayer or where}.{local}"
