"""Decoding for encoder-decoder models: greedy search and beam search, with a key/value cache.

The encoder runs once; each step feeds only the newest target token to the decoder, whose blocks keep
the keys and values of earlier steps (and the cross-attention keys/values of the encoder output).

Beam search keeps the ``K`` best partial hypotheses of each source. Its score is the GNMT one
(Wu et al. 2016, eq. 14), with ``|Y|`` the number of generated tokens including the final EOS::

    s(Y) = log P(Y | X) / lp(Y),        lp(Y) = ((5 + |Y|) / 6) ** alpha

``alpha = 0`` ranks by the plain log-probability (which favours short outputs); ``alpha > 0`` favours longer
ones (GNMT used 0.6-0.7). Decoder-only sampling lives in :mod:`tformer.generation.sampling`.

Neither search outputs the start token ``bos_id``: it marks where the decoder starts, never a target (tformer's
seq2seq data has none after it; Marian starts from its pad token, which its generation config forbids as output
too). An under-trained model would otherwise emit it, and it decodes to nothing.

Shapes: B (sources), K, S, C, V (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tformer.engine import accelerate
from tformer.generation.sampling import check_finite_logits
from tformer.models import EncoderDecoder, check_inputs


def _check_decode_args(
    model: EncoderDecoder, src: Tensor, src_mask: Tensor | None, max_new_tokens: int, bos_id: int, eos_id: int
) -> None:
    if not isinstance(model, EncoderDecoder):
        if isinstance(getattr(model, "model", None), EncoderDecoder):  # what load_pretrained and load_checkpoint return
            hint = "pass its .model"
        else:
            hint = "a DecoderLM continues prompts with generate"
        raise TypeError(
            f"greedy_seq2seq and beam_search decode with an EncoderDecoder; got a {type(model).__name__} ({hint})"
        )
    cfg = model.cfg
    if not isinstance(src, Tensor):
        raise TypeError(
            f"src must be a (batch, time) tensor of token ids; got a {type(src).__name__} (tformer.models.pad_right "
            "makes ids and src_mask of a list of sources)"
        )
    check_inputs(cfg, src, src_mask, name="src", mask_name="src_mask")  # once: the decode loop reads nothing back
    if src.shape[1] == 0 or (src_mask is not None and not bool(src_mask.any(dim=1).all())):
        raise ValueError("every source needs at least one token (src_mask True somewhere in each row); one is empty")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id)):
        if not 0 <= value < cfg.vocab_size:
            raise ValueError(f"{name}={value} is outside the vocabulary [0, {cfg.vocab_size})")
    if cfg.position == "learned" and max_new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} exceeds the decoder's max_seq_len={cfg.max_seq_len} (learned "
            "positions: BOS and the tokens fed back need one position each); lower max_new_tokens "
            "(--max-new-tokens)"
        )


@torch.inference_mode()
def greedy_seq2seq(
    model: EncoderDecoder,
    src: Tensor,
    src_mask: Tensor | None,
    *,
    bos_id: int,
    eos_id: int,
    max_new_tokens: int,
) -> list[list[int]]:
    """Greedy decoding of a batch ``src (B, S)``: ``y_t = argmax_y p(y | y_<t, X)`` until EOS or
    ``max_new_tokens``. Returns each output without BOS and EOS. NaN (or infinite) logits at the first step
    (a diverged model) raise ``ValueError``."""
    _check_decode_args(model, src, src_mask, max_new_tokens, bos_id, eos_id)
    accelerate(model)  # the engine's kernels where they pay (tformer.engine.apply)
    memory = model.encode(src, src_mask)  # (B, S, C)
    cache = model.new_cache()
    batch = src.shape[0]
    token = torch.full((batch, 1), bos_id, dtype=torch.long, device=src.device)
    done = torch.zeros(batch, dtype=torch.bool, device=src.device)
    outputs = torch.empty(batch, max_new_tokens, dtype=torch.long, device=src.device)
    length = 0
    for step in range(max_new_tokens):
        logits = model.decode(token, memory, src_mask, cache=cache)[:, -1]  # (B, 1, V) -> (B, V)
        if step == 0:  # once per call: a model with a NaN weight gives NaN here
            check_finite_logits(logits)
        _forbid_start(logits, bos_id, eos_id)
        token = logits.argmax(-1, keepdim=True).masked_fill(done[:, None], eos_id)  # (B, 1)
        outputs[:, step] = token[:, 0]
        length = step + 1
        done |= token[:, 0] == eos_id
        if bool(done.all()):
            break
    return [row[: row.index(eos_id)] if eos_id in row else row for row in outputs[:, :length].tolist()]


def _forbid_start(logits: Tensor, bos_id: int, eos_id: int) -> None:
    """Make the start token ``bos_id`` impossible as output (the module docstring), unless it is also the end."""
    if bos_id != eos_id:
        logits[:, bos_id] = float("-inf")


def gnmt_length_penalty(length: int, alpha: float) -> float:
    """``lp = ((5 + length) / 6) ** alpha`` (Wu et al. 2016, eq. 14); 1 for ``alpha = 0``."""
    return ((5.0 + length) / 6.0) ** alpha


def _keep_best(kept: list[tuple[float, list[int]]], score: float, tokens: list[int], size: int) -> None:
    """Insert a complete hypothesis into ``kept`` (best first, ties: earlier first) and keep at most ``size``."""
    kept.append((score, tokens))
    kept.sort(key=lambda item: -item[0])  # stable: among equal scores the earlier hypothesis stays ahead
    del kept[size:]


@torch.inference_mode()
def beam_search(
    model: EncoderDecoder,
    src: Tensor,
    src_mask: Tensor | None,
    *,
    beam_size: int,
    max_new_tokens: int,
    bos_id: int,
    eos_id: int,
    length_penalty: float = 0.6,
) -> list[list[int]]:
    """The highest-scoring output found for each source of ``src (B, S)``, without BOS and EOS.

    Score: ``log P(Y|X) / ((5 + |Y|)/6)^length_penalty`` (module docstring). Each step extends every live
    beam by every token (``K * V`` candidates per source, log-probabilities summed in float64) and ranks them:
    a candidate ending in EOS among the ``K`` best is a complete hypothesis; the ``K`` best that do not end in
    EOS live on, and the cache rows are re-ordered to follow them (:meth:`LayerCache.reorder`). A source is
    finished when it holds ``K`` complete hypotheses and no live beam can still beat the worst of them
    (bound: log-probabilities only fall as tokens are added, so a live beam scores at most
    ``log P / max(lp(t + 1), lp(max_new_tokens))``). At ``max_new_tokens`` the live beams are complete too.
    ``beam_size=1`` with ``length_penalty=0`` is greedy decoding.

    NaN (or infinite) logits at the first step (a diverged model) raise ``ValueError``. Should NaN appear only
    later and leave a source no hypothesis of finite score, its first live beam is returned.
    """
    _check_decode_args(model, src, src_mask, max_new_tokens, bos_id, eos_id)
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size must be an integer >= 1; got {beam_size!r}")
    if not (math.isfinite(length_penalty) and length_penalty >= 0):  # NaN would rank the hypotheses at random
        raise ValueError(
            f"length_penalty must be a finite number >= 0 (GNMT alpha; 0 = plain log-probability); "
            f"got {length_penalty!r}"
        )
    B, K, V = src.shape[0], beam_size, model.cfg.vocab_size
    device = src.device
    accelerate(model)  # the engine's kernels where they pay (tformer.engine.apply)
    memory = model.encode(src, src_mask).repeat_interleave(K, dim=0)  # (B*K, S, C): a source's beams adjacent
    memory_mask = None if src_mask is None else src_mask.repeat_interleave(K, dim=0)  # (B*K, S)
    cache = model.new_cache()
    scores = torch.full((B, K), float("-inf"), dtype=torch.float64, device=device)  # log P of each live beam
    scores[:, 0] = 0.0  # all beams start as the same "BOS": expand only one of them at the first step
    tokens = torch.full((B * K, 1), bos_id, dtype=torch.long, device=device)
    history = torch.empty(B * K, 0, dtype=torch.long, device=device)  # (B*K, t): each live beam's tokens
    first_row = torch.arange(B, device=device)[:, None] * K  # (B, 1): row of a source's beam 0
    complete: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
    done = [False] * B
    final_lp = gnmt_length_penalty(max_new_tokens, length_penalty)
    for step in range(1, max_new_tokens + 1):
        logits = model.decode(tokens, memory, memory_mask, cache=cache)[:, -1]  # (B*K, V)
        if step == 1:  # once per call: a model with a NaN weight gives NaN here
            check_finite_logits(logits)
        _forbid_start(logits, bos_id, eos_id)
        candidates = scores.view(B * K, 1) + torch.log_softmax(logits.double(), dim=-1)  # (B*K, V)
        top, index = candidates.view(B, K * V).topk(min(2 * K, K * V), dim=1)  # (B, 2K), best first
        beam, token = index // V, index % V  # which beam each candidate extends, with which token
        # EOS among the K best candidates: a complete hypothesis (its tokens are the beam's, without EOS)
        lp = gnmt_length_penalty(step, length_penalty)
        ends = (token[:, :K] == eos_id) & torch.isfinite(top[:, :K])  # (B, K)
        for b, r in ends.nonzero().tolist():
            if not done[b]:
                row = int(first_row[b, 0] + beam[b, r])
                _keep_best(complete[b], float(top[b, r]) / lp, history[row].tolist(), K)
        # the K best candidates not ending in EOS live on (at most K of the 2K end in EOS: one per beam)
        survivors = torch.sort((token == eos_id).to(torch.int8), dim=1, stable=True).indices[:, :K]  # (B, K)
        scores = top.gather(1, survivors)  # (B, K)
        rows = (first_row + beam.gather(1, survivors)).view(-1)  # (B*K,): the beam each survivor extends
        tokens = token.gather(1, survivors).view(B * K, 1)
        history = torch.cat([history[rows], tokens], dim=1)  # (B*K, step)
        for layer in cache:
            layer.reorder(rows)
        if step == max_new_tokens:
            break
        best_live = scores.max(dim=1).values / max(gnmt_length_penalty(step + 1, length_penalty), final_lp)
        for b in range(B):
            if not done[b] and len(complete[b]) == K and float(best_live[b]) <= complete[b][-1][0]:
                done[b] = True
        if all(done):
            break
    if not all(done):  # out of steps: the live beams are complete hypotheses of max_new_tokens tokens
        for b in range(B):
            if done[b]:
                continue
            for k in range(K):
                if torch.isfinite(scores[b, k]):
                    _keep_best(complete[b], float(scores[b, k]) / final_lp, history[b * K + k].tolist(), K)
    # none complete only when no live beam has a finite score (the model went NaN after the first step): then
    # every beam is as good as another, and beam 0 is returned rather than failing
    return [hyps[0][1] if hyps else history[b * K].tolist() for b, hyps in enumerate(complete)]
