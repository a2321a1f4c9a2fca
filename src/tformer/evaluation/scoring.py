"""Log-likelihoods of continuations, computed once per shared context.

Shapes: B, T, P, C, V, M (the package legend; here B counts the contexts of a batch, then the continuation rows,
and M the scored positions).

A request is ``(context ids, continuation ids)``; its log-likelihood is ``sum_k log p(cont_k | ctx, cont_<k)`` and it
is greedy when every ``cont_k`` is the argmax. The choices of one question share their context, so each distinct
context runs once: the contexts of a batch run left-padded (``hidden`` with a padding mask, positions counted from
the mask), and the continuations (all but their last token) run against their context's key/value cache, right-padded
in runs of similar length, each run with its own copy of the cache rows it needs. Only the positions that predict a
continuation token go through the output head, in float32 for the log-softmax. The result equals scoring
``ctx + cont`` in one pass (what lm-evaluation-harness's Hugging Face model does) up to float rounding;
tests/evaluation hold it against ``transformers``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tformer.models import pad_left, pad_right

BUCKET_FILL = 0.75  # a continuation run padded to its longest is at least 3/4 real tokens


@dataclass(frozen=True)
class Scored:
    """The log-likelihood of one continuation and whether greedy decoding would have produced it."""

    logprob: float
    greedy: bool


def _groups(requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[tuple[int, ...], list[int]]]:
    """``(context, [request indices])`` for each distinct context, longest context first (so that the contexts of a
    batch pad little and an out-of-memory error comes at once)."""
    by_context: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, _) in enumerate(requests):
        by_context.setdefault(tuple(ctx), []).append(i)
    longest = {ctx: max(len(requests[i][1]) for i in idx) for ctx, idx in by_context.items()}
    return sorted(by_context.items(), key=lambda item: (-len(item[0]), -longest[item[0]]))


def _buckets(lengths: Sequence[int], fill: float = BUCKET_FILL) -> list[list[int]]:
    """Indices of ``lengths`` (all > 0) in runs of similar length, longest first: a run takes each next length that
    is at least ``fill`` times its first, so a run padded to its longest is at least that full."""
    runs: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if runs and lengths[i] >= fill * lengths[runs[-1][0]]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


@torch.inference_mode()
def score_requests(
    model: torch.nn.Module,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    batch_size: int = 16,
    pad_id: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[Scored]:
    """:class:`Scored` for each ``(context ids, continuation ids)`` request of a decoder LM (``hidden``,
    ``logits``, ``new_cache``), batching ``batch_size`` distinct contexts at a time; ``progress(n)`` is told each
    time ``n`` more requests are done. Contexts must be non-empty (``protocols.split_pair`` makes them so)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    for i, (ctx, cont) in enumerate(requests):
        if not ctx or not cont:
            raise ValueError(f"request {i} has an empty {'context' if not ctx else 'continuation'}; both need tokens")
    out: list[Scored | None] = [None] * len(requests)
    groups = _groups(requests)
    for start in range(0, len(groups), batch_size):
        batch = groups[start : start + batch_size]
        for i, scored in _score_batch(model, requests, batch, pad_id).items():
            out[i] = scored
        if progress is not None:
            progress(sum(len(idx) for _, idx in batch))
    return out  # type: ignore[return-value]


def _score_batch(model, requests, batch, pad_id: int) -> dict[int, Scored]:
    device = next(model.parameters()).device
    ids, mask = pad_left([list(ctx) for ctx, _ in batch], pad_id, device)  # (B, P), (B, P) or None
    if mask is None:
        mask = torch.ones(ids.shape, dtype=torch.bool, device=device)
    cache = model.new_cache()
    h_ctx = model.hidden(ids, mask, cache)[:, -1]  # (B, C): the last context token predicts each first token
    rows = [i for _, idx in batch for i in idx]  # request of each continuation row
    owner = [b for b, (_, idx) in enumerate(batch) for _ in idx]
    conts = [list(requests[i][1]) for i in rows]
    h = [h_ctx.index_select(0, torch.tensor(owner, device=device))]  # (rows, C): each row's first token
    targets = [c[0] for c in conts]
    segment = list(range(len(rows)))
    longer = [r for r, c in enumerate(conts) if len(c) > 1]
    for run in _buckets([len(conts[r]) - 1 for r in longer]):  # the rest of the tokens against the context's cache
        bucket = [longer[k] for k in run]
        index = torch.tensor([owner[r] for r in bucket], device=device)
        inp, inp_mask = pad_right([conts[r][:-1] for r in bucket], pad_id)  # (b, T)
        inp_mask = inp_mask.to(device)
        full = torch.cat([mask.index_select(0, index), inp_mask], dim=1)  # (b, P + T)
        out = model.hidden(inp.to(device), full, [layer.select(index) for layer in cache])  # (b, T, C)
        h.append(out[inp_mask])  # position k predicts cont[k + 1]
        for r in bucket:
            targets += conts[r][1:]
            segment += [r] * (len(conts[r]) - 1)
    logits = model.logits(torch.cat(h).unsqueeze(0))[0].float()  # (M, V): only the scored positions
    target = torch.tensor(targets, device=device)  # (M,)
    token_lp = logits.gather(1, target[:, None])[:, 0] - logits.logsumexp(-1)  # (M,)
    hit = (logits.argmax(-1) == target).float()  # (M,)
    seg = torch.tensor(segment, device=device)
    totals = torch.zeros(len(rows), dtype=torch.float64, device=device).index_add_(0, seg, token_lp.double())
    misses = torch.zeros(len(rows), device=device).index_add_(0, seg, 1 - hit)
    return {
        i: Scored(float(lp), bool(miss == 0))
        for i, lp, miss in zip(rows, totals.tolist(), misses.tolist(), strict=True)
    }


def token_logprobs_reference(model: torch.nn.Module, ctx: Sequence[int], cont: Sequence[int]) -> Tensor:
    """The per-token log-likelihoods ``(len(cont),)`` of ``cont`` after ``ctx`` from one plain forward pass over
    ``ctx + cont[:-1]``: the oracle of the cached, batched path above."""
    ids = torch.tensor([list(ctx) + list(cont)[:-1]], device=next(model.parameters()).device)
    with torch.inference_mode():
        logp = F.log_softmax(model(ids)[0, len(ctx) - 1 :].float(), dim=-1)  # (len(cont), V)
    return logp.gather(1, torch.tensor(list(cont), device=ids.device)[:, None])[:, 0]
