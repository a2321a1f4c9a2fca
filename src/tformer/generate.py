"""Decoding: greedy search for encoder-decoder models, with a key/value cache.

The encoder runs once; each step feeds only the newest target token to the decoder, whose blocks keep
the keys and values of earlier steps (and the cross-attention keys/values of the encoder output).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tformer.models import EncoderDecoder


@torch.no_grad()
def greedy_seq2seq(
    model: EncoderDecoder,
    src: Tensor,
    src_mask: Tensor | None,
    *,
    bos_id: int,
    eos_id: int,
    max_new_tokens: int,
) -> list[list[int]]:
    """Greedy decoding of a batch ``src (B, S)``; returns each output without BOS and EOS."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    memory = model.encode(src, src_mask)  # (B, S, C)
    cache = model.new_cache()
    batch = src.shape[0]
    token = torch.full((batch, 1), bos_id, dtype=torch.long, device=src.device)
    done = torch.zeros(batch, dtype=torch.bool, device=src.device)
    outputs = torch.empty(batch, 0, dtype=torch.long, device=src.device)
    for _ in range(max_new_tokens):
        logits = model.decode(token, memory, src_mask, cache=cache)  # (B, 1, V)
        token = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        token = token.masked_fill(done[:, None], eos_id)
        outputs = torch.cat([outputs, token], dim=1)
        done |= token[:, 0] == eos_id
        if bool(done.all()):
            break
    result = []
    for row in outputs.tolist():
        result.append(row[: row.index(eos_id)] if eos_id in row else row)
    return result
