"""What the explorer's circuit views show, as plain functions of a loaded model: the logit lens at one position, the
next-token distribution with heads ablated, and activation patching of the residual stream. Each is a thin call of
:mod:`tformer.circuits` on the model the page serves.

Hooks are attached to that one shared model, so every function here holds the explorer's lock while they are on:
a request in another thread never runs the model with this one's hooks.

Shapes: L (layers), T, V (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tformer.circuits import ablate_heads, logit_diff, logit_lens, patch_residual, restored
from tformer.explore.analysis import TOP, ExploreError, Explorer, encode, piece
from tformer.generation.sampling import apply_temperature, filter_logits
from tformer.hooks import run_with_hooks

MAX_LENS_K = 50  # tokens per row of the lens
MAX_PATCH_FORWARDS = 512  # one forward per (layer, position): layers x tokens at most this (SmolLM2: 17 tokens)


def _lm_only(ex: Explorer, what: str) -> None:
    if ex.kind != "lm":
        raise ExploreError(f"{what} reads one stack of blocks (a language model); this is an encoder-decoder")


def _ids(ex: Explorer, text: str, what: str = "prompt") -> Tensor:
    device = next(ex.model.parameters()).device
    return torch.tensor([encode(ex, text, what)], device=device)


def lens(ex: Explorer, prompt: str, position: int = -1, k: int = 5) -> dict[str, Any]:
    """The logit lens (:func:`tformer.circuits.logit_lens`) at ``position``: per row (``embed``, then the residual
    stream leaving each block ``L0 .. L{n-1}``, read through the final norm and the output head) the ``k`` most
    probable tokens, and the probability each row gives the model's own top token (the last row's first)."""
    _lm_only(ex, "the logit lens")
    ids = _ids(ex, prompt)
    T = ids.shape[1]
    if not -T <= position < T:
        raise ExploreError(f"position must be in [-{T}, {T}) for this prompt of {T} tokens; got {position}")
    if not 1 <= k <= MAX_LENS_K:
        raise ExploreError(f"k must be in [1, {MAX_LENS_K}]; got {k}")
    with ex.lock, torch.inference_mode():
        result = logit_lens(ex.model, ids)
    probs = result.logits[:, 0, position].float().softmax(-1)  # (L + 1, V)
    top = probs.topk(k, dim=-1)
    final = int(top.indices[-1, 0])
    rows = []
    for label, idx, p, row in zip(result.labels, top.indices.tolist(), top.values.tolist(), probs, strict=True):
        tops = [{"id": i, "token": piece(ex.tokenizer, i), "prob": q} for i, q in zip(idx, p, strict=True)]
        rows.append({"label": label, "top": tops, "final_prob": float(row[final])})
    tokens = ids[0].tolist()
    return {
        "position": position % T,
        "token": piece(ex.tokenizer, tokens[position]),
        "tokens": [piece(ex.tokenizer, i) for i in tokens],
        "final": {"id": final, "token": piece(ex.tokenizer, final)},
        "rows": rows,
    }


def check_heads(ex: Explorer, heads: list) -> list[tuple[int, int]]:
    """``heads`` as distinct ``(layer, head)`` pairs, or :class:`ExploreError` naming the bad one."""
    layers, num_heads = ex.num_layers["self"], ex.model.cfg.num_heads  # a language model (_lm_only)
    out: list[tuple[int, int]] = []
    for pair in heads:
        ok = isinstance(pair, list) and len(pair) == 2 and all(type(v) is int for v in pair)
        if not ok:
            raise ExploreError(f"heads must be a list of [layer, head] pairs of ints; got {str(pair)[:40]}")
        if not (0 <= pair[0] < layers and 0 <= pair[1] < num_heads):
            raise ExploreError(
                f"head {pair} is out of range: the model has {layers} layers of {num_heads} heads "
                f"(layer 0..{layers - 1}, head 0..{num_heads - 1})"
            )
        if tuple(pair) not in out:
            out.append(tuple(pair))
    return out


def ablated(
    ex: Explorer,
    prompt: str,
    heads: list,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    top: int = TOP,
) -> dict[str, Any]:
    """The next-token distribution with ``heads`` zero-ablated (:func:`tformer.circuits.ablate_heads` through
    :func:`tformer.hooks.run_with_hooks`) beside the model's own: the ``top`` tokens most probable in either, each
    with ``prob`` (ablated, after the sampling filters, as :func:`tformer.explore.analysis.next_tokens`), ``raw``
    (ablated, before them), ``kept``, and ``original`` / ``original_raw`` (the same without the ablation)."""
    _lm_only(ex, "head ablation")
    pairs = check_heads(ex, heads)
    ids = _ids(ex, prompt)
    with ex.lock, torch.inference_mode():
        original = ex.model(ids)[0, -1].float()  # (V,)
        hooks = ablate_heads(ex.model, pairs, kind="zero")
        changed = run_with_hooks(ex.model, ids, hooks=hooks)[0, -1].float()

    def dists(logits: Tensor) -> tuple[Tensor, Tensor]:
        raw = apply_temperature(logits[None].cpu(), temperature).softmax(-1)[0]
        kept = filter_logits(logits[None].cpu(), temperature=temperature, top_k=top_k, top_p=top_p).softmax(-1)[0]
        return raw, kept

    (raw, kept), (raw0, kept0) = dists(changed), dists(original)
    order = torch.maximum(raw, raw0).argsort(descending=True)[:top].tolist()
    nxt = [
        {
            "id": i,
            "token": piece(ex.tokenizer, i),
            "prob": float(kept[i]),
            "raw": float(raw[i]),
            "kept": bool(kept[i] > 0),
            "original": float(kept0[i]),
            "original_raw": float(raw0[i]),
        }
        for i in order
    ]
    change = 0.5 * float((raw - raw0).abs().sum())  # total variation distance of the raw distributions
    return {"heads": [list(p) for p in pairs], "next": nxt, "total_variation": change}


def answer_id(ex: Explorer, given: str | int | None, fallback: int, what: str) -> int:
    """The token id of ``given`` (a text that must encode to exactly one token, or an id), else ``fallback``."""
    if given is None or given == "":
        return fallback
    if isinstance(given, int):
        if not 0 <= given < ex.model.cfg.vocab_size:
            raise ExploreError(f"{what} id {given} is outside the vocabulary [0, {ex.model.cfg.vocab_size})")
        return given
    ids = encode(ex, given, what)
    if len(ids) != 1:
        shown = ", ".join(repr(piece(ex.tokenizer, i)) for i in ids[:6])
        raise ExploreError(f"{what} {given!r} is {len(ids)} tokens ({shown}); give one token, or its id")
    return ids[0]


def patch(ex: Explorer, clean: str, corrupted: str, correct: str | int | None, wrong: str | int | None):
    """Activation patching of the residual stream entering each block (:func:`tformer.circuits.patch_residual`,
    metric ``logit_diff(correct, wrong)`` at the last position): ``patched (L, T)`` the corrupted run's logit
    difference with the clean stream put back at one (layer, position); ``restored (L, T)`` its share of the gap,
    ``(patched - corrupted) / (clean - corrupted)`` (:func:`tformer.circuits.restored`; ``None`` when the two runs
    give the same difference: there is no gap to restore). ``correct`` defaults to the clean run's top token,
    ``wrong`` to the corrupted run's (its second when that is the same)."""
    _lm_only(ex, "patching")
    clean_ids, corrupted_ids = _ids(ex, clean, "clean prompt"), _ids(ex, corrupted, "corrupted prompt")
    T, C = clean_ids.shape[1], corrupted_ids.shape[1]
    if T != C:
        raise ExploreError(
            f"the clean prompt is {T} tokens and the corrupted one {C}: patching swaps activations position by "
            "position, so give prompts of the same token length"
        )
    layers = ex.num_layers["self"]
    if layers * T > MAX_PATCH_FORWARDS:
        raise ExploreError(
            f"patching runs one forward per layer and position: {layers} layers x {T} tokens = {layers * T}; at most "
            f"{MAX_PATCH_FORWARDS}: shorten the prompts to {MAX_PATCH_FORWARDS // layers} tokens"
        )
    with ex.lock, torch.inference_mode():
        clean_logits = ex.model(clean_ids)[0, -1].float()
        corrupted_logits = ex.model(corrupted_ids)[0, -1].float()
    good = answer_id(ex, correct, int(clean_logits.argmax()), "correct")
    second = corrupted_logits.topk(2).indices.tolist()
    bad = answer_id(ex, wrong, second[1] if second[0] == good else second[0], "wrong")
    if good == bad:
        raise ExploreError(f"correct and wrong are the same token {piece(ex.tokenizer, good)!r}; give two tokens")
    metric = logit_diff(good, bad)
    with ex.lock, torch.inference_mode():
        patched = patch_residual(ex.model, clean_ids, corrupted_ids, metric)  # (L, T)
    clean_diff = float(clean_logits[good] - clean_logits[bad])
    corrupted_diff = float(corrupted_logits[good] - corrupted_logits[bad])
    gap = clean_diff - corrupted_diff
    share = restored(patched, clean_diff, corrupted_diff) if abs(gap) > 1e-6 * max(1.0, abs(clean_diff)) else None
    return {
        "clean_tokens": [piece(ex.tokenizer, i) for i in clean_ids[0].tolist()],
        "corrupted_tokens": [piece(ex.tokenizer, i) for i in corrupted_ids[0].tolist()],
        "layers": [f"L{i}" for i in range(layers)],
        "point": "resid_pre",
        "correct": {"id": good, "token": piece(ex.tokenizer, good)},
        "wrong": {"id": bad, "token": piece(ex.tokenizer, bad)},
        "clean_diff": clean_diff,
        "corrupted_diff": corrupted_diff,
        "patched": patched.tolist(),
        "restored": None if share is None else share.tolist(),
    }
