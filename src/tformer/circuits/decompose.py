"""The residual stream as a sum of what each part of the model wrote into it, and the logit lens.

Shapes: Nc, NL, B, T, H, C, V (the package legend, :mod:`tformer`).

The stream entering the output head is ``embed + pos_embed + sum over blocks of (attn_out + mlp_out)`` (Pre-LN),
passed through the final norm. A norm with its scale held is affine (``LN(x) = (x - mean x) / s * g + b``), so it
maps a sum of components to the sum of the mapped components plus one more, its bias: that is how the final norm,
and in a Post-LN model every norm on the residual path, is carried through exactly. The scales held are the ones the
forward computed (``hook_scale``), so the components sum to the model's own hidden state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tformer.engine.apply import TiedHead
from tformer.hooks import ActivationCache, model_of, points, run_with_cache
from tformer.layers import LayerNorm, RMSNorm
from tformer.models import DecoderLM, Encoder


@dataclass
class Decomposition:
    """``values (Nc, B, T, C)``: component ``labels[i]``'s share of the residual stream that leaves the blocks
    (``values.sum(0)`` is it, up to float rounding); ``model`` and ``cache`` (scales held) made it."""

    labels: list[str]
    values: Tensor
    model: nn.Module
    cache: ActivationCache

    @torch.no_grad()
    def normalized(self) -> Decomposition:
        """The components through the final norm, its scale held: they sum to the final hidden state (what the
        output head reads). A Post-LN model has no final norm: the same components."""
        norm = _body(self.model).stack.final_norm
        if not isinstance(norm, (LayerNorm, RMSNorm)):
            return self
        values, labels = _through_norm(
            self.values, list(self.labels), norm, self.cache["ln_final.hook_scale"], "ln_final"
        )
        return Decomposition(labels, values, self.model, self.cache)

    @torch.no_grad()
    def attribution(self, direction: Tensor) -> Tensor:
        """Each component's projection on ``direction (C,)`` or ``(B, T, C)``, after the final norm: ``(Nc, B, T)``.
        For a language model's token, the direction is its row of the unembedding (:func:`logit_attribution`)."""
        return (self.normalized().values * direction).sum(-1)


def _body(model: nn.Module):
    model = model_of(model)
    if isinstance(model, DecoderLM):
        return model.decoder
    if isinstance(model, Encoder):
        return model
    raise TypeError(
        f"decomposition and the logit lens read one stack of blocks (a DecoderLM or an Encoder); got a "
        f"{type(model).__name__}"
    )


def _through_norm(values: Tensor, labels: list[str], norm: nn.Module, scale: Tensor, name: str):
    """``values (Nc, B, T, C)`` through ``norm`` with its scale ``(B, T, 1)`` held, and the norm's bias added as one
    more component ``{name}.bias``."""
    if isinstance(norm, LayerNorm):
        values = values - values.mean(-1, keepdim=True)  # centering is linear: each component centred on its own
    values = values / scale
    if norm.weight is not None:
        values = values * norm.weight
    if getattr(norm, "bias", None) is not None:
        values = torch.cat([values, norm.bias.expand_as(values[:1])])
        labels = [*labels, f"{name}.bias"]
    return values, labels


def _needed(model: nn.Module, heads: bool) -> list[str]:
    """The points :func:`decompose` reads: the embeddings, each block's sublayer outputs, the norms' scales."""
    table, body = points(model), _body(model)
    prefix = "" if isinstance(model_of(model), DecoderLM) else "embed."
    embeds = ("hook_embed", "hook_pos_embed", "hook_token_type_embed", "ln.hook_scale")
    names = [prefix + local for local in embeds if prefix + local in table]
    for i, block in enumerate(body.stack.blocks):
        p = f"blocks.{i}."
        names += [p + ("attn.hook_result" if heads else "hook_attn_out"), p + "hook_mlp_out"]
        names += [] if block.norm_first else [p + "ln1.hook_scale", p + "ln2.hook_scale"]
    return names + (["ln_final.hook_scale"] if "ln_final.hook_scale" in table else [])


@torch.no_grad()
def decompose(model: nn.Module, *args, heads: bool = False, **kwargs) -> Decomposition:
    """Run ``model(*args, **kwargs)`` and split the residual stream leaving its blocks into components: the
    embeddings, then per block its attention output (``heads=True``: one term per head, ``L3H5``, and the output
    projection's bias ``L3.attn.bias``) and its feed-forward output; in a Post-LN model each norm on the path, scale
    held, maps the sum so far and adds its bias (``L3.ln1.bias``). ``.normalized()`` carries them through the final
    norm. The model runs in eval mode (dropout would add terms that are no component)."""
    body = _body(model)
    if body.training:
        raise ValueError("decompose a model in eval mode (model.eval()): dropout adds terms that are no component")
    _, cache = run_with_cache(model, *args, names=_needed(model, heads), **kwargs)
    labels, parts = [], []
    prefix = "" if isinstance(model_of(model), DecoderLM) else "embed."
    for local, label in (("hook_embed", "embed"), ("hook_pos_embed", "pos_embed"), ("hook_token_type_embed", "types")):
        if prefix + local in cache:
            labels.append(label)
            parts.append(cache[prefix + local])
    values = torch.stack(parts)
    if body.embed.norm is not None:
        values, labels = _through_norm(values, labels, body.embed.norm, cache[prefix + "ln.hook_scale"], "embed.ln")
    for i, block in enumerate(body.stack.blocks):
        p = f"blocks.{i}."
        if heads:
            result = cache[p + "attn.hook_result"].movedim(2, 0)  # (B, T, H, C) -> (H, B, T, C)
            terms, names = [result], [f"L{i}H{h}" for h in range(result.shape[0])]
            bias = block.self_attn.out_proj.bias
            if bias is not None:
                terms.append(bias.expand_as(result[:1]))
                names.append(f"L{i}.attn.bias")
            values, labels = torch.cat([values, *terms]), labels + names
        else:
            values, labels = torch.cat([values, cache[p + "hook_attn_out"][None]]), [*labels, f"L{i}.attn"]
        if not block.norm_first:
            values, labels = _through_norm(
                values, labels, block.self_attn_norm, cache[p + "ln1.hook_scale"], f"L{i}.ln1"
            )
        values, labels = torch.cat([values, cache[p + "hook_mlp_out"][None]]), [*labels, f"L{i}.mlp"]
        if not block.norm_first:
            values, labels = _through_norm(values, labels, block.ff_norm, cache[p + "ln2.hook_scale"], f"L{i}.ln2")
    return Decomposition(labels, values, model_of(model), cache)


def unembedding(model: nn.Module) -> Tensor:
    """A language model's output matrix ``W_U (V, C)`` (the token embedding when tied)."""
    model = model_of(model)
    if not isinstance(model, DecoderLM):
        raise TypeError(f"an unembedding belongs to a language model (DecoderLM); got a {type(model).__name__}")
    tied = model.head is None or isinstance(model.head, TiedHead)  # accelerate() gives a tied model a TiedHead
    return model.decoder.embed.tokens.weight if tied else model.head.weight


@torch.no_grad()
def logit_attribution(
    model: nn.Module, ids: Tensor, token: int, *, against: int | None = None, position: int = -1, heads: bool = True
) -> tuple[list[str], Tensor]:
    """Direct logit attribution: each component's share of the logit of ``token`` (or of the difference
    ``logit(token) - logit(against)``) at ``position``: ``(labels, (Nc, B))``. The shares sum to that logit (or
    difference) less the output bias, if the head has one."""
    w_u = unembedding(model)
    direction = w_u[token] if against is None else w_u[token] - w_u[against]
    parts = decompose(model, ids, heads=heads)
    normalized = parts.normalized()
    return normalized.labels, (normalized.values[:, :, position] * direction).sum(-1)


@dataclass
class Lens:
    """The logit lens: ``logits (NL + 1, B, T, V)``, what the output head reads from the residual stream entering
    each block (``labels[0]``: the embeddings) and leaving the last one (which equals the model's logits)."""

    labels: list[str]
    logits: Tensor

    def top(self, position: int = -1, k: int = 5, batch: int = 0) -> tuple[Tensor, Tensor]:
        """The ``k`` most probable tokens at ``position`` by layer: ids and probabilities ``(NL + 1, k)``."""
        probs = self.logits[:, batch, position].float().softmax(-1)
        top = probs.topk(k, dim=-1)
        return top.indices, top.values


def logit_lens(model: nn.Module, ids: Tensor, mask: Tensor | None = None) -> Lens:
    """Each layer's residual stream through the final norm (its own scale) and the output head (nostalgebraist,
    2020). Post-LN models have no final norm: the output head reads each block's output directly."""
    lm = model_of(model)
    if not isinstance(lm, DecoderLM):
        raise TypeError(f"the logit lens reads through a language model's head (DecoderLM); got a {type(lm).__name__}")
    depth = len(lm.decoder.stack.blocks)
    post_ln = not lm.decoder.stack.blocks[0].norm_first
    last = "hook_normalized_resid_post" if post_ln else "hook_resid_post"
    names = [f"blocks.{i}.hook_resid_pre" for i in range(depth)] + [f"blocks.{depth - 1}.{last}"]
    _, cache = run_with_cache(lm, ids, mask, names=names)
    with torch.no_grad():
        stream = torch.stack([cache[n] for n in names])  # (NL + 1, B, T, C)
        logits = lm.logits(lm.decoder.stack.final_norm(stream))
    return Lens(["embed", *[f"L{i}" for i in range(depth)]], logits)
