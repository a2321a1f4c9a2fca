"""Models: the encoder, the decoder, the 2017 encoder-decoder Transformer and a GPT-style decoder-only LM.

All are thin compositions of :class:`tformer.layers.BlockStack`. Shapes: B, S (source), T (target), P, C, V (the package
legend, :mod:`tformer`).

The one mask convention for model inputs: a ``(B, T)`` boolean ``mask`` is ``True`` for a real token
(which may be attended) and ``False`` for padding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.config import TransformerConfig
from tformer.functional import causal_mask
from tformer.layers import BlockStack, LayerCache, Pooler, Tapped, init_weights, make_norm, tap
from tformer.positions import LearnedPositions, RotaryEmbedding, SinusoidalPositions


def check_inputs(
    cfg: TransformerConfig, ids: Tensor, mask: Tensor | None = None, *, name: str = "ids", mask_name: str = "mask"
) -> None:
    """``ValueError`` unless ``ids`` is a ``(B, T)`` integer tensor of token ids inside the vocabulary and ``mask``
    (if given) a boolean ``(B, T)`` tensor.

    The public entry points (``generate``, the seq2seq decoders, ``train``, the CLI) call this once on their input;
    a model's ``forward`` checks only shapes and dtypes, since reading the ids back would stall the device once per
    call (and break a compiled graph). This function reads them back: one ``aminmax`` per call.
    """
    _check_ids_shape(ids, name)
    if mask is not None:
        _check_mask(mask, ids, mask_name)
    low, high = (int(v) for v in torch.aminmax(ids)) if ids.numel() else (0, 0)  # one reduction, not two
    if low < 0 or high >= cfg.vocab_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"{name} holds token id {bad}, outside the vocabulary [0, {cfg.vocab_size}); "
            "check the tokenizer or raise vocab_size"
        )


def _check_ids_shape(ids: Tensor, name: str) -> None:
    """Shape and dtype only: metadata, known without reading the tensor."""
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"{name} must be a (batch, time) tensor of integer token ids (int64 or int32: {name}.long()); got "
            f"{ids.dtype} {tuple(ids.shape)}"
        )


def _check_mask(mask: Tensor | None, ids: Tensor, name: str) -> None:
    if mask is not None and (mask.dtype != torch.bool or mask.shape != ids.shape):
        raise ValueError(
            f"{name} must be a boolean (batch, time) tensor shaped like the ids {tuple(ids.shape)} "
            f"(True = real token, False = padding); got {mask.dtype} {tuple(mask.shape)}"
        )


def _check_memory(memory: Tensor, memory_mask: Tensor | None, tgt_ids: Tensor) -> None:
    """The encoder output ``memory (B, S, C)`` and its key mask ``(B, S)`` fit the target ``tgt_ids (B, T)``."""
    if memory.dim() != 3 or (tgt_ids.dim() == 2 and memory.shape[0] != tgt_ids.shape[0]):
        raise ValueError(
            f"memory must be the encoder output (batch, source length, d_model) of the batch of tgt_ids "
            f"{tuple(tgt_ids.shape)}; got {tuple(memory.shape)}: give as many sources as targets"
        )
    if memory_mask is not None and memory_mask.shape != memory.shape[:2]:
        raise ValueError(
            f"src_mask must be (batch, source length) = {tuple(memory.shape[:2])} like the source ids; got "
            f"{tuple(memory_mask.shape)}"
        )


def pad_right(seqs: list, pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Right-pad integer sequences with ``pad_id``: ids ``(B, T)`` and mask ``(B, T)`` (True = real token)."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    lengths = torch.tensor([len(s) for s in seqs])
    return ids, torch.arange(length)[None, :] < lengths[:, None]


def pad_left(prompts: list[list[int]], pad_id: int = 0, device: torch.device | str | None = None):
    """``ids (B, P)`` with each prompt at the right end, and ``mask (B, P)`` (True = real token), or ``None``
    as the mask when all prompts have the same length (decoding prompts: every row's newest token is last)."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
    if all(len(p) == P for p in prompts):
        return ids.to(device), None
    lengths = torch.tensor([len(p) for p in prompts])
    mask = torch.arange(P)[None, :] >= (P - lengths)[:, None]  # (B, P)
    return ids.to(device), mask.to(device)


def positions_from_mask(mask: Tensor | None, length: int, past: int, device) -> Tensor:
    """Position of each of the last ``length`` tokens: ``(T,)`` counting from ``past``, or with a padding
    mask ``(B, past+T)`` the count of real tokens before it, so left padding does not shift positions."""
    if mask is None:
        return torch.arange(past, past + length, device=device)
    return (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -length:]  # (B, T)


def self_attention_mask(mask: Tensor | None, length: int, past: int, causal: bool) -> tuple[Tensor | None, bool]:
    """The ``(attn_mask, is_causal)`` pair for self-attention of ``length`` new tokens after ``past`` cached ones.

    Without padding and cache, causal attention is the ``is_causal`` flag (PyTorch's fast path). Otherwise a
    boolean mask ``(B or 1, 1, T, past+T)``: query ``i`` (absolute ``past+i``) may see key ``j`` when
    ``j <= past+i`` (causal) and ``j`` is a real token.
    """
    causal = causal and length > 1  # one new token may see every key up to itself: no causal part needed
    if mask is None and (past == 0 or not causal):
        return None, causal
    keys = past + length
    allowed = None
    if causal:
        allowed = causal_mask(keys, keys, mask.device if mask is not None else None)[past:]  # (T, S)
    if mask is not None:
        padding = mask[:, None, None, :]  # (B, 1, 1, S)
        allowed = padding if allowed is None else padding & allowed
    return allowed, False


class Embedder(Tapped, nn.Module):
    """``x = E[ids] * scale + PE[positions] (+ E_type[token types])``, then a norm (BERT) and dropout.

    The scale is ``sqrt(C)`` in the 2017 model (``cfg.embed_scale``; ``None``: the model's own ``scale``). Hook points
    (:class:`tformer.layers.Tapped`), each ``(B, T, C)``: ``hook_embed`` (``E[ids] * scale``), ``hook_pos_embed``,
    ``hook_token_type_embed``.
    """

    def __init__(self, cfg: TransformerConfig, *, scale: bool, tokens: nn.Embedding | None = None):
        super().__init__()
        self.cfg = cfg
        self.tokens = tokens if tokens is not None else nn.Embedding(cfg.vocab_size, cfg.d_model)
        scale = scale if cfg.embed_scale is None else cfg.embed_scale
        self.scale = math.sqrt(cfg.d_model) if scale else 1.0
        if cfg.position == "sinusoidal":
            self.positions: nn.Module | None = SinusoidalPositions(cfg.d_model, cfg.max_seq_len, layout=cfg.pair_layout)
        elif cfg.position == "learned":
            self.positions = LearnedPositions(cfg.max_seq_len, cfg.d_model)
        else:  # rotary acts inside attention; "none" adds nothing
            self.positions = None
        self.token_types = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        self.norm = make_norm(cfg) if cfg.embed_norm else None
        self.dropout = nn.Dropout(cfg.dropout)

    def reserve(self, length: int) -> None:
        """Make the position table hold ``length`` positions (learned positions: ``ValueError`` if they cannot)."""
        if self.positions is not None:
            self.positions.reserve(length)

    def forward(
        self, ids: Tensor, positions: Tensor, token_types: Tensor | None = None, *, name: str = "ids"
    ) -> Tensor:
        """``ids (B, T)``, ``positions (T,)`` or ``(B, T)`` (inside the table: :meth:`reserve`) -> ``(B, T, C)``.

        ``token_types (B, T)``: each token's segment (default: all 0), where the model has token types. ``name``:
        what errors call the ids (``src_ids``, ``tgt_ids``)."""
        try:
            x = self.tokens(ids)  # (B, T) -> (B, T, C)
        except IndexError:  # an id outside the vocabulary: the CPU kernel raises (CUDA fails a device-side assert)
            check_inputs(self.cfg, ids, name=name)  # the error naming the id (reads the ids back, on this path only)
            raise
        if self.scale != 1.0:
            x = x * self.scale
        x = tap(self, "hook_embed", x)
        if self.positions is not None:
            x = x + tap(self, "hook_pos_embed", self.positions(positions).expand_as(x))  # (T, C) or (B, T, C)
        if self.token_types is not None:
            types = self.token_types.weight[0] if token_types is None else self._types(token_types, ids)
            x = x + tap(self, "hook_token_type_embed", types.expand_as(x))
        elif token_types is not None:
            raise ValueError("token_types given, but this model has no token-type embeddings (type_vocab_size=0)")
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x) if self.training else x

    def _types(self, token_types: Tensor, ids: Tensor) -> Tensor:
        """The token-type embeddings ``(B, T, C)``; ``ValueError`` for types not shaped like the ids or not known."""
        if token_types.shape != ids.shape or token_types.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"token_types must be an integer tensor shaped like the ids {tuple(ids.shape)}; got "
                f"{token_types.dtype} {tuple(token_types.shape)}"
            )
        try:
            return self.token_types(token_types)
        except IndexError:
            raise ValueError(
                f"token_types holds a type outside [0, {self.cfg.type_vocab_size}) (type_vocab_size); BERT-style "
                "models have types 0 (first segment) and 1 (second)"
            ) from None


class _EmbeddedStack(nn.Module):
    """Embedder + BlockStack: the body shared by the encoder, the decoder and the LM."""

    def __init__(
        self,
        cfg: TransformerConfig,
        num_layers: int,
        *,
        causal: bool,
        cross_attention: bool,
        scale_embeddings: bool,
        tokens: nn.Embedding | None = None,
    ):
        super().__init__()
        self.cfg, self.causal = cfg, causal
        self.ids_name = "tgt_ids" if cross_attention else "ids"  # what errors call the input; the encoder's: src_ids
        self.embed = Embedder(cfg, scale=scale_embeddings, tokens=tokens)
        self.rotary = (
            RotaryEmbedding(cfg.head_dim, cfg.rope_base, cfg.interleaved, max_len=cfg.max_seq_len)
            if cfg.position == "rotary"
            else None
        )
        self.stack = BlockStack(cfg, num_layers, cross_attention=cross_attention, rotary=self.rotary)

    def _run(
        self, ids: Tensor, mask: Tensor | None, caches: list[LayerCache] | None, token_types: Tensor | None = None, **kw
    ) -> Tensor:
        """Embed ``ids (B, T)`` (after ``past`` cached tokens) and run the blocks. Everything here is decided from
        shapes and Python ints: no value is read back from the device."""
        _check_ids_shape(ids, self.ids_name)
        B, T = ids.shape
        past = caches[0].self_kv.length if caches else 0
        if past and caches[0].self_kv.k.shape[0] != B:
            raise ValueError(
                f"the cache holds {caches[0].self_kv.k.shape[0]} rows; {self.ids_name} has {B}: give each row's "
                "new tokens, or start a new cache (new_cache()) for another batch"
            )
        if mask is not None and mask.shape != (B, past + T):
            raise ValueError(f"mask must be (batch, cached + new tokens) = {(B, past + T)}; got {tuple(mask.shape)}")
        self.embed.reserve(past + T)  # positions are < past + T, with or without padding
        positions = positions_from_mask(mask, T, past, ids.device)  # (T,) or (B, T)
        rope = None
        if self.rotary is not None:
            self.rotary.reserve(past + T)
            rope = self.rotary(positions)  # the angles of this batch, once for every block
        self_mask, is_causal = self_attention_mask(mask, T, past, self.causal)
        x = self.embed(ids, positions, token_types, name=self.ids_name)  # (B, T, C)
        return self.stack(x, caches=caches, self_mask=self_mask, is_causal=is_causal, rope=rope, **kw)

    def reserve(self, length: int) -> None:
        """Make the position tables hold ``length`` positions (a static cache's capacity, before decoding)."""
        self.embed.reserve(length)
        if self.rotary is not None:
            self.rotary.reserve(length)

    def new_cache(self) -> list[LayerCache]:
        """An empty key/value cache, one entry per block, for incremental decoding."""
        return [LayerCache() for _ in self.stack.blocks]


class Encoder(_EmbeddedStack):
    """Encoder self-attention: queries, keys and values all come from the source; no causal mask.

    On its own it is a BERT-style encoder: ``forward(ids, mask, token_type_ids)`` gives the last hidden states, and
    with ``cfg.pooler`` :meth:`pool` gives BERT's pooled first token.
    """

    def __init__(self, cfg: TransformerConfig, *, tokens: nn.Embedding | None = None, scale_embeddings: bool = True):
        super().__init__(
            cfg, cfg.num_layers, causal=False, cross_attention=False, scale_embeddings=scale_embeddings, tokens=tokens
        )
        self.pooler = Pooler(cfg.d_model) if cfg.pooler else None
        self.ids_name = "src_ids"

    def forward(self, src_ids: Tensor, src_mask: Tensor | None = None, token_type_ids: Tensor | None = None) -> Tensor:
        """``src_ids (B, S)`` -> memory (hidden states) ``(B, S, C)``; ``token_type_ids (B, S)`` where the model has
        token types (default: all 0)."""
        _check_mask(src_mask, src_ids, "src_mask")
        return self._run(src_ids, src_mask, None, token_types=token_type_ids)

    def pool(self, hidden: Tensor) -> Tensor:
        """``(B, S, C)`` hidden states -> ``(B, C)``: BERT's ``tanh(W h_0 + b)`` (``cfg.pooler``)."""
        if self.pooler is None:
            raise ValueError("this encoder has no pooler (cfg.pooler=False)")
        return self.pooler(hidden)


class Decoder(_EmbeddedStack):
    """Masked (causal) self-attention over the target, then cross-attention: queries from the decoder,
    keys and values from the encoder output (``memory``). Without cross-attention it is a GPT body."""

    def __init__(
        self,
        cfg: TransformerConfig,
        *,
        tokens: nn.Embedding | None = None,
        cross_attention: bool = True,
        scale_embeddings: bool = True,
    ):
        super().__init__(
            cfg,
            cfg.decoder_layers if cross_attention else cfg.num_layers,
            causal=True,
            cross_attention=cross_attention,
            scale_embeddings=scale_embeddings,
            tokens=tokens,
        )

    def forward(
        self,
        tgt_ids: Tensor,
        memory: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: list[LayerCache] | None = None,
    ) -> Tensor:
        """``tgt_ids (B, T)``, ``memory (B, S, C)`` -> hidden states ``(B, T, C)``.

        With ``cache`` only the new tokens are given; ``tgt_mask`` then covers cached + new tokens.
        """
        if tgt_mask is not None and cache is None:
            _check_mask(tgt_mask, tgt_ids, "tgt_mask")
        if memory is not None:
            _check_memory(memory, memory_mask, tgt_ids)
        cross_mask = None if memory_mask is None else memory_mask[:, None, None, :]  # (B, 1, 1, S)
        return self._run(tgt_ids, tgt_mask, cache, memory=memory, memory_mask=cross_mask)


def output_head(cfg: TransformerConfig) -> nn.Linear | None:
    """A separate ``C x V`` output matrix, or ``None`` when the logits reuse the token embedding (tied)."""
    return None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)


def project_logits(h: Tensor, head: nn.Module | None, tokens: nn.Embedding, bias: Tensor | None = None) -> Tensor:
    """``logits = h W^T (+ b)`` with ``W`` the output matrix or, tied (``head=None``), the token embedding ``(V, C)``,
    and ``b`` the fixed logits bias of ``cfg.logits_bias`` (Marian): ``(B, T, C) -> (B, T, V)``."""
    if head is None:
        return F.linear(h, tokens.weight, bias)
    logits = head(h)
    return logits if bias is None else logits + bias


def logits_bias(module: nn.Module, cfg: TransformerConfig) -> None:
    """Register the model's fixed logits bias ``(V,)`` (zeros; loaded from a checkpoint) when the config has one."""
    if cfg.logits_bias:
        module.register_buffer("logits_bias", torch.zeros(cfg.vocab_size))
    else:
        module.logits_bias = None


class EncoderDecoder(Tapped, nn.Module):
    """The Transformer of Vaswani et al. (2017): ``logits = head(Decoder(tgt, Encoder(src)))``.

    Embeddings are scaled by ``sqrt(d_model)``; with ``tie_embeddings`` the source embedding, the target
    embedding and the output projection share one matrix (one joint vocabulary, as in the paper).
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        shared = nn.Embedding(cfg.vocab_size, cfg.d_model) if cfg.tie_embeddings else None
        self.encoder = Encoder(cfg, tokens=shared)
        self.decoder = Decoder(cfg, tokens=shared)
        self.head = output_head(cfg)
        logits_bias(self, cfg)
        init_weights(self, cfg.num_layers + cfg.decoder_layers, embed_std=cfg.d_model**-0.5)

    def encode(self, src_ids: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """``src_ids (B, S)`` -> memory ``(B, S, C)``."""
        return self.encoder(src_ids, src_mask)

    def decode(
        self,
        tgt_ids: Tensor,
        memory: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        cache: list[LayerCache] | None = None,
    ) -> Tensor:
        """``tgt_ids (B, T)`` and ``memory (B, S, C)`` -> logits ``(B, T, V)``."""
        h = self.decoder(tgt_ids, memory, tgt_mask, src_mask, cache)  # (B, T, C)
        return tap(self, "hook_unembed", project_logits(h, self.head, self.decoder.embed.tokens, self.logits_bias))

    def forward(
        self, src_ids: Tensor, tgt_ids: Tensor, src_mask: Tensor | None = None, tgt_mask: Tensor | None = None
    ) -> Tensor:
        """Teacher-forced logits ``(B, T, V)`` of ``tgt_ids (B, T)`` given ``src_ids (B, S)``: :meth:`encode`, then
        :meth:`decode`. Masks: ``True`` = a real token (``None``: no padding); the decoder is causal."""
        return self.decode(tgt_ids, self.encode(src_ids, src_mask), src_mask, tgt_mask)

    def new_cache(self) -> list[LayerCache]:
        """An empty key/value cache of the decoder, one entry per block, for step-by-step decoding (the
        cross-attention keys and values of the encoder output are computed at the first step and kept)."""
        return self.decoder.new_cache()


class DecoderLM(Tapped, nn.Module):
    """GPT-style decoder-only language model: ``logits = head(Decoder(ids))`` with no cross-attention.

    Hook point (:class:`tformer.layers.Tapped`): ``hook_unembed``. With hooks attached anywhere in the model its own
    ``taps`` is set too, so decoding can tell at no cost (:mod:`tformer.hooks`)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.decoder = Decoder(cfg, cross_attention=False, scale_embeddings=False)
        self.head = output_head(cfg)
        logits_bias(self, cfg)
        init_weights(self, cfg.num_layers, embed_std=0.02)

    def forward(self, ids: Tensor, mask: Tensor | None = None, cache: list[LayerCache] | None = None) -> Tensor:
        """``ids (B, T)`` -> logits ``(B, T, V)``: :meth:`logits` of :meth:`hidden`. With ``cache``, ``ids`` are only
        the new tokens and ``mask (B, cached + new)`` covers both."""
        return self.logits(self.hidden(ids, mask, cache))

    def hidden(self, ids: Tensor, mask: Tensor | None = None, cache: list[LayerCache] | None = None) -> Tensor:
        """``ids (B, T)`` -> the final residual stream ``(B, T, C)`` (after the final norm)."""
        if mask is not None and cache is None:
            _check_mask(mask, ids, "mask")
        return self.decoder(ids, tgt_mask=mask, cache=cache)

    def logits(self, h: Tensor) -> Tensor:
        """The output head: hidden states ``(B, T, C)`` -> logits ``(B, T, V)``."""
        return tap(self, "hook_unembed", project_logits(h, self.head, self.decoder.embed.tokens, self.logits_bias))

    def new_cache(self) -> list[LayerCache]:
        """An empty key/value cache, one entry per block, for incremental decoding."""
        return self.decoder.new_cache()


def num_parameters(module: nn.Module) -> int:
    """Number of distinct parameters (tied matrices counted once)."""
    return sum(p.numel() for p in module.parameters())
