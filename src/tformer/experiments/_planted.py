"""A language model with an induction circuit set by hand: the known answer the ``circuits`` experiment's statistics
are checked on (its quick size and its tests).

Shapes: C (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import torch
from torch import nn

from tformer.config import TransformerConfig
from tformer.models import DecoderLM


def planted_model(vocab: int = 64, max_seq_len: int = 32, num_heads: int = 8, sharpness: float = 4.0) -> nn.Module:
    """A 2-layer language model (learned positions, Pre-LN, feed-forward layers zero) with an induction circuit set
    by hand: head L0H0 attends to the previous position and writes that token into a "previous token" block of the
    residual stream; head L1H0 attends to the positions whose previous token is the current token and writes
    their token into an "output" block, which the untied output head reads. Every other head has zero weights.

    The residual stream (width ``max(4, num_heads) * max(vocab, max_seq_len)``) holds four blocks of one-hot codes:
    the token, the position, the previous token, the output (and zeros). ``sharpness`` scales the two attention
    patterns' logits."""
    n = max(vocab, max_seq_len)
    C = max(4, num_heads) * n  # four blocks, and each head at least n dimensions
    cfg = TransformerConfig(
        vocab_size=vocab,
        d_model=C,
        num_heads=num_heads,
        num_layers=2,
        d_ff=4,
        max_seq_len=max_seq_len,
        position="learned",
        tie_embeddings=False,
        dropout=0.0,
    )
    model = DecoderLM(cfg)
    tok, pos, prev, out = (slice(i * n, i * n + n) for i in range(4))
    eye = torch.eye(n)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.zero_()
        model.decoder.embed.tokens.weight[:, tok] = eye[:vocab]
        model.decoder.embed.positions.table.weight[:, pos] = eye[:max_seq_len]
        scale = (C / 2) ** 0.5  # a one-hot entry after the norm: x = two ones of C entries, over their std
        # L0H0, previous token: q_t = e_{t-1} (the position one-hot shifted by one), k_s = e_s, v_s = token of s
        attn = model.decoder.stack.blocks[0].self_attn
        attn.in_proj.weight[: n - 1, pos][:, 1:] = sharpness * torch.eye(n - 1)
        attn.in_proj.weight[C : C + n, pos] = eye
        attn.in_proj.weight[2 * C : 2 * C + n, tok] = eye
        attn.out_proj.weight[prev, :n] = eye / scale
        # L1H0, induction: q_t = token of t, k_s = previous token of s, v_s = token of s, written to the output block
        attn = model.decoder.stack.blocks[1].self_attn
        scale = (C / 3) ** 0.5  # three ones now: token, position, previous token
        attn.in_proj.weight[:n, tok] = sharpness * eye
        attn.in_proj.weight[C : C + n, prev] = eye
        attn.in_proj.weight[2 * C : 2 * C + n, tok] = eye
        attn.out_proj.weight[out, :n] = eye / scale
        model.head.weight[:, out] = 2.0 * eye[:vocab]
    return model.eval()


__all__ = ["planted_model"]
