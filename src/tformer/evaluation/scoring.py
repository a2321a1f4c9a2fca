"""Log-likelihoods of continuations, computed once per shared context.

Shapes: B, T, P, C, V, M (the package legend; here B counts the contexts of a batch, then the continuation rows,
and M the scored positions).

A request is ``(context ids, continuation ids)``; its log-likelihood is ``sum_k log p(cont_k | ctx, cont_<k)`` and
it is greedy when every ``cont_k`` is the argmax. The choices of one question share their context, so each distinct
context runs once, together with the leading tokens that all its continuations share (PIQA's two solutions often
begin alike): contexts of similar length run together, left-padded (``hidden`` with a padding mask, positions
counted from the mask), and the rest of each continuation (all but its last token) runs against its context's
key/value cache, right-padded in runs of similar length, each run with its own copy of the cache rows it needs. Only
the positions that predict a continuation token go through the output head, ``HEAD_ROWS`` at a time, in float32 for
the log-softmax; a shared token's log-probability is computed once and counted for every continuation that shares
it. The result equals scoring ``ctx + cont`` in one pass (what lm-evaluation-harness's Hugging Face model does) up
to float rounding; tests/evaluation hold it against ``transformers``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tformer.models import pad_left, pad_right

BUCKET_FILL = 0.75  # a continuation run padded to its longest is at least 3/4 real tokens
HEAD_ROWS = 4096  # positions per output-head call: 4,096 x a 49,152-token vocabulary in float32 is 0.8 GB


@dataclass(frozen=True)
class Scored:
    """The log-likelihood of one continuation and whether greedy decoding would have produced it."""

    logprob: float
    greedy: bool


def _shared(conts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens all of ``conts`` share, leaving each at least its last token of its own (so that each
    has a position of its own to predict from: the context's last)."""
    n = min(len(c) for c in conts) - 1
    first = conts[0]
    for k in range(n):
        if any(c[k] != first[k] for c in conts):
            return k
    return n


def _groups(requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[tuple[int, ...], list[int], int]]:
    """``(context, [request indices], shared)`` for each distinct context, ``shared`` its continuations' common
    leading tokens (:func:`_shared`); longest context and shared part first (so that the contexts of a batch pad
    little and an out-of-memory error comes at once)."""
    by_context: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, _) in enumerate(requests):
        by_context.setdefault(tuple(ctx), []).append(i)
    groups = [(ctx, idx, _shared([requests[i][1] for i in idx])) for ctx, idx in by_context.items()]
    longest = {ctx: max(len(requests[i][1]) for i in idx) for ctx, idx, _ in groups}
    return sorted(groups, key=lambda g: (-len(g[0]) - g[2], -longest[g[0]]))


def _buckets(lengths: Sequence[int], fill: float = BUCKET_FILL, size: int | None = None) -> list[list[int]]:
    """Indices of ``lengths`` (all > 0) in runs of similar length, longest first (ties in their given order): a run
    takes each next length that is at least ``fill`` times its first, up to ``size`` members, so a run padded to its
    longest is at least that full."""
    runs: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if runs and lengths[i] >= fill * lengths[runs[-1][0]] and (size is None or len(runs[-1]) < size):
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
    ``logits``, ``new_cache``), batching up to ``batch_size`` distinct contexts of similar length at a time;
    ``progress(n)`` is told each time ``n`` more requests are done. Contexts must be non-empty
    (``protocols.split_pair`` makes them so)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    for i, (ctx, cont) in enumerate(requests):
        if not ctx or not cont:
            raise ValueError(f"request {i} has an empty {'context' if not ctx else 'continuation'}; both need tokens")
    out: list[Scored | None] = [None] * len(requests)
    groups = _groups(requests)
    for run in _buckets([len(ctx) + shared for ctx, _, shared in groups], size=batch_size):
        batch = [groups[g] for g in run]
        for i, scored in _score_batch(model, requests, batch, pad_id).items():
            out[i] = scored
        if progress is not None:
            progress(sum(len(idx) for _, idx, _ in batch))
    return out  # type: ignore[return-value]


def _score_batch(model, requests, batch, pad_id: int) -> dict[int, Scored]:
    device = next(model.parameters()).device
    contexts = [list(ctx) + list(requests[idx[0]][1][:shared]) for ctx, idx, shared in batch]  # with shared tokens
    ids, mask = pad_left(contexts, pad_id, device)  # (B, P), (B, P) or None
    if mask is None:
        mask = torch.ones(ids.shape, dtype=torch.bool, device=device)
    cache = model.new_cache()
    h_all = model.hidden(ids, mask, cache)  # (B, P, C); left-padded, so every context ends at position P - 1
    rows = [i for _, idx, _ in batch for i in idx]  # request of each continuation row
    owner = [b for b, (_, idx, _) in enumerate(batch) for _ in idx]
    conts = [list(requests[i][1][batch[b][2] :]) for i, b in zip(rows, owner, strict=True)]  # each row's own tokens
    h = [h_all[:, -1].index_select(0, torch.tensor(owner, device=device))]  # (rows, C): each row's first own token
    targets = [c[0] for c in conts]
    segment = list(range(len(rows)))
    P = ids.shape[1]
    at_b = [b for b, (_, _, shared) in enumerate(batch) for _ in range(shared)]  # the shared tokens' positions
    at_p = [P - 1 - shared + k for _, _, shared in batch for k in range(shared)]
    if at_b:  # position p predicts the shared token at p + 1; segment R + b: counted for all of group b
        b_at, p_at = torch.tensor(at_b, device=device), torch.tensor(at_p, device=device)
        h.append(h_all[b_at, p_at])
        targets += ids[b_at, p_at + 1].tolist()
        segment += [len(rows) + b for b in at_b]
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
    hidden, target = torch.cat(h), torch.tensor(targets, device=device)  # (M, C), (M,): only the scored positions
    token_lp, hit = torch.empty(len(target), device=device), torch.empty(len(target), device=device)  # (M,), (M,)
    for at in range(0, len(target), HEAD_ROWS):
        logits = model.logits(hidden[None, at : at + HEAD_ROWS])[0].float()  # (<= HEAD_ROWS, V)
        t = target[at : at + HEAD_ROWS]
        picked = logits.gather(1, t[:, None])[:, 0]
        top, best = logits.max(-1)  # one pass for both; max's index is argmax's (the first maximum)
        # logsumexp's own steps (max, subtract, exp, sum, log, add), in place over the logits: the same floats
        lse = logits.sub_(top[:, None]).exp_().sum(-1).log_().add_(top)
        token_lp[at : at + len(t)] = picked - lse
        hit[at : at + len(t)] = (best == t).float()
    seg = torch.tensor(segment, device=device)
    n, own = len(rows) + len(batch), torch.tensor(owner, device=device) + len(rows)
    totals = torch.zeros(n, dtype=torch.float64, device=device).index_add_(0, seg, token_lp.double())
    misses = torch.zeros(n, device=device).index_add_(0, seg, 1 - hit)
    totals, misses = totals[: len(rows)] + totals[own], misses[: len(rows)] + misses[own]
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
