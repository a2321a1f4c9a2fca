"""Sampling from a decoder-only LM: ``generate`` with a key/value cache.

One step turns the next-token logits ``z (B, V)`` into a token per row by the rule of
:mod:`tformer.generation.filters` (greedy, or temperature, top-k, top-p, then a draw; in that order, as Hugging
Face), whose names this module re-exports.

``generate`` prefills the prompt once, then feeds one token per row per step; every block keeps its keys and
values (:class:`tformer.layers.KVCache`). Prompts of different lengths are LEFT-padded and masked, so every row's
newest token sits in the last column and positions count only real tokens (``tformer.models.positions_from_mask``).

A sliding context window for models with learned positions (``cfg.position == "learned"``: a table of only
``W = cfg.max_seq_len`` positions). Each row's model input is a window of its last tokens, never more than ``W``:

    start   a prompt of L tokens starts the window at its last min(L, W) tokens (a longer prompt is cropped)
    grow    each new token joins the window
    restart when the window would hold W + 1 tokens, it restarts from the newest max(1, W // 2) tokens

so once the text is longer than ``W``, each token is drawn given the last ``max(1, W // 2)`` to ``W`` tokens.
With the cache a restart re-prefills a fresh cache from the restarted window (one prefill of at most ``W // 2``
tokens per ``W - W // 2`` steps); without it, the model is run on the same window. Both compute the same
logits, and a row's window depends only on its own prompt length and step, so a left-padded batch still gives
the tokens of one by one. Sinusoidal, rotary and no positions have no limit: the window is the whole sequence.

Shapes: B, P, N, V, W (the package legend, :mod:`tformer`).
"""

from __future__ import annotations

import numbers
import operator
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from tformer.engine import accelerate
from tformer.generation.filters import (  # noqa: F401  (re-exported: the sampling API)
    NEG_INF,
    SamplingRule,
    apply_temperature,
    check_finite_logits,
    check_max_new_tokens,
    check_sampling_args,
    filter_logits,
    sample,
    top_k_filter,
    top_p_filter,
)
from tformer.generation.stopping import Stopper, TextDecoder, token_id
from tformer.models import DecoderLM, pad_left


# --------------------------------------------------------------------------------------------------
# Feeding the model step by step
# --------------------------------------------------------------------------------------------------
def context_window(cfg) -> int | None:
    """How many tokens the model may see at once: ``max_seq_len`` with learned positions, else ``None`` (no limit)."""
    return cfg.max_seq_len if cfg.position == "learned" else None


class IncrementalLM:
    """Next-token logits ``(B, V)`` of a batch of growing sequences.

    ``prefill()`` runs the (left-padded) prompt ``ids (B, P)`` with ``mask (B, P)`` (``None``: no padding) once;
    each ``step(tokens (B,))`` appends one token per row. With ``use_cache`` only the new token goes through the
    model (its keys/values join the cache); without, the whole window is recomputed (the reference).

    With a context window ``W`` (:func:`context_window`; the module docstring gives the rule) row ``b`` sees
    the columns ``starts[b] <= c < length``. The model is run on columns ``base = min_b starts[b]`` onwards,
    with the mask ``False`` before each row's own start (so positions count from it); when a step would give
    some row ``W + 1`` tokens (``length > limit = base + W``) that row restarts and the cache is refilled
    (for every row: rows of different prompt lengths restart at different steps, each refilling all of them).
    """

    GROW = 256  # columns the token buffers hold past the prompt at first; they double when full (_room)

    def __init__(
        self, model: DecoderLM, ids: Tensor, mask: Tensor | None, *, max_new_tokens: int, use_cache: bool = True
    ) -> None:
        B, P = ids.shape
        self.model, self.use_cache, self.length = model, use_cache, P
        self.end = P + max_new_tokens  # the columns a generation can fill; the buffers grow to it as tokens come
        width = min(self.end, P + self.GROW)
        self.ids = ids.new_empty(B, width)  # (B, width): prompt, then generated tokens
        self.ids[:, :P] = ids
        self.mask = None  # stays None without padding: the decoder then needs no mask at all
        if mask is not None:
            self.mask = mask.new_ones(B, width)  # (B, width): generated tokens are real
            self.mask[:, :P] = mask
        self.cache = None
        self.window = context_window(model.cfg)
        self.base, self.limit = 0, self.end  # no window: every column, and no restart ever
        if self.window is not None:
            real = [P] * B if mask is None else mask.sum(dim=-1).tolist()  # prompt tokens of each row
            self.starts = [P - min(n, self.window) for n in real]  # a longer prompt is cropped to its last W
            self._set_window()

    def _set_window(self) -> None:
        self.base = min(self.starts)
        self.limit = self.base + self.window
        if self.mask is not None:  # rows with padding restart at their own steps: mask each before its start
            columns = torch.arange(self.mask.shape[1], device=self.mask.device)
            starts = torch.tensor(self.starts, device=self.mask.device)
            self.mask &= columns[None, :] >= starts[:, None]  # (B, width); later columns: after every start
        # without padding all rows have one start, and the model sees exactly ids[:, base:length]

    def _room(self) -> None:
        """A column for token ``length`` in ``ids`` (and ``mask``): the buffers double when full, up to ``end``, so
        that memory follows the tokens made, not ``max_new_tokens`` (an EOS may end a row long before it)."""
        if self.length < (width := self.ids.shape[1]):
            return
        more = min(self.end, max(self.length + 1, 2 * width)) - width
        self.ids = torch.cat([self.ids, self.ids.new_empty(self.ids.shape[0], more)], dim=1)
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], more)], dim=1)

    def keep(self, tokens: Tensor) -> None:
        """Append ``tokens (B,)`` without running the model (the last token of a generation)."""
        self._room()
        self.ids[:, self.length] = tokens
        self.length += 1

    def _mask(self) -> Tensor | None:
        return None if self.mask is None else self.mask[:, self.base : self.length]

    def prefill(self) -> Tensor:
        """Logits of the token after the prompt (or the current window) ``(B, V)``; with ``use_cache`` into a
        fresh cache."""
        self.cache = self.model.new_cache() if self.use_cache else None
        return self._last_logits(self.ids[:, self.base : self.length], self.cache)

    def step(self, tokens: Tensor) -> Tensor:
        """Append ``tokens (B,)``; logits of the token after them ``(B, V)``."""
        self._room()
        self.ids.select(1, self.length).copy_(tokens)  # ids[:, length] = tokens, in fewer calls
        self.length += 1
        if self.length > self.limit:  # a row's window is full: it restarts (learned positions only)
            return self._restart()
        if self.cache is None:
            return self._last_logits(self.ids[:, self.base : self.length], None)
        return self.model(tokens[:, None], self._mask(), self.cache)[:, -1]  # (B, 1) -> (B, 1, V) -> (B, V)

    def _last_logits(self, ids: Tensor, cache: list | None) -> Tensor:  # the head's product for one position
        return self.model.logits(self.model.hidden(ids, self._mask(), cache)[:, -1])

    def _restart(self) -> Tensor:
        """Restart each row whose window now holds ``W + 1`` tokens from its newest ``max(1, W // 2)``, then run
        the model on the new windows (re-prefill: the cache of every row is rebuilt, each from its own window)."""
        keep = max(1, self.window // 2)
        self.starts = [self.length - keep if self.length - s > self.window else s for s in self.starts]
        self._set_window()
        return self.prefill()


def _prompt_lists(prompt_ids: Sequence[Sequence[int]] | Tensor, vocab_size: int) -> list[list[int]]:
    if isinstance(prompt_ids, Tensor):
        if prompt_ids.dim() != 2 or prompt_ids.is_floating_point() or prompt_ids.dtype == torch.bool:
            raise ValueError(
                f"prompt_ids must be a (batch, time) integer tensor; got {prompt_ids.dtype} {tuple(prompt_ids.shape)}"
            )
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, str):
        raise TypeError(
            f"prompt_ids must be token ids, not the text {prompt_ids[:40]!r}: pass [tokenizer.encode(text)]"
        )
    prompt_ids = list(prompt_ids)
    if any(isinstance(p, numbers.Integral) for p in prompt_ids):
        raise TypeError(
            "prompt_ids must be a list of prompts, each a list of token ids; got ints: wrap one prompt, [ids]"
        )
    if any(isinstance(p, str) for p in prompt_ids):
        raise TypeError("prompt_ids must be lists of token ids, not texts: pass [tokenizer.encode(t) for t in texts]")
    prompts = [[token_id(t, f"prompt {i}") for t in p] for i, p in enumerate(prompt_ids)]
    if not prompts:
        raise ValueError("prompt_ids is empty: give at least one prompt")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: a decoder-only LM needs at least one token to condition on")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})")
    return prompts


MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds; the signed range is the one every device accepts


def row_seeds(seed: int | Sequence[int] | None, batch: int) -> list[int] | None:
    """The seed of each of ``batch`` rows: ``seed + b`` for an int, the list itself for a list, ``None`` for
    ``None``. Raises ``ValueError`` (naming ``--seed``) unless every row's seed is an integer in
    ``[0, MAX_SEED]``."""
    if seed is None:
        return None
    one = not isinstance(seed, Sequence)
    try:
        seeds = [operator.index(seed) + b for b in range(batch)] if one else [operator.index(s) for s in seed]
    except TypeError as err:
        raise ValueError(f"seed (--seed) must be an integer or a list of integers; got {seed!r}") from err
    if len(seeds) != batch:
        raise ValueError(f"seed: give one int, or one seed per prompt ({batch}); got {len(seeds)}")
    for b, s in enumerate(seeds):
        if not 0 <= s <= MAX_SEED:
            row = f" (row {b} of the batch draws with seed + {b})" if one and b else ""
            raise ValueError(f"seed (--seed) must be an integer in [0, 2**63 - 1 = {MAX_SEED}]{row}; got {s}")
    return seeds


def _generators(seeds: list[int] | None, device: torch.device) -> list[torch.Generator] | None:
    return None if seeds is None else [torch.Generator(device=device).manual_seed(s) for s in seeds]


# --------------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------------
def generate(
    model: DecoderLM,
    prompt_ids: Sequence[Sequence[int]] | Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    seed: int | Sequence[int] | None = None,
    stop: str | Sequence[str | Sequence[int]] | None = None,
    eos_id: int | Sequence[int] | None = None,
    tokenizer: TextDecoder | None = None,
    use_cache: bool = True,
    on_token: Callable[[int, int], None] | None = None,
    static_cache: bool = False,
    compile: bool = False,
) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens; returns the new tokens of each row.

    What the model conditions on: the whole prompt and every token generated so far, except with learned
    positions (``cfg.position == "learned"``), where it sees a sliding window of at most ``max_seq_len`` tokens
    (module docstring): a longer prompt is cropped to its last ``max_seq_len`` tokens, and once the window is
    full it restarts from its newest ``max_seq_len // 2``. Any ``max_new_tokens`` works with every position scheme.

    Args:
        prompt_ids: a list of token-id lists (any lengths; left-padded internally) or a ``(B, P)`` tensor.
        temperature, top_k, top_p, greedy: the sampling rule of the module docstring (``greedy`` ignores the rest).
        seed: ``None`` draws from torch's global RNG. An int ``s`` gives row ``b`` its own generator seeded
            ``s + b``; a list gives one seed per row. A row then draws only from its own generator, so
            ``generate(m, prompts, seed=s)[b] == generate(m, [prompts[b]], seed=s + b)[0]``: batching does not
            change what a row samples, as long as its logits agree (they do up to float rounding, ~1e-6 in
            float32; a token can differ only if a draw falls within that rounding of a probability boundary).
            Greedy decoding is deterministic and batch-independent in the same sense.
        stop, eos_id, tokenizer: end a row at ``eos_id`` (an id or a list of ids), at a stop sequence of ids, or
            at a stop string (needs ``tokenizer``); the stop itself is dropped from the output (see :class:`Stopper`).
            ``stop`` is a list of strings and id lists (``["\\n\\n", [13, 13]]``), or one string.
        use_cache: ``False`` recomputes the whole sequence each step (reference and benchmarks).
        static_cache: decode over a cache of ``prompt + max_new_tokens`` positions allocated once
            (:mod:`tformer.generation.static`): the same tokens, every step the same shapes. With learned positions
            the whole sequence must fit ``max_seq_len`` (no sliding window).
        compile: run prefill and steps through ``torch.compile`` over a static cache, compiled once per shape
            bucket (batch size, dtype, and prompt and capacity rounded up to 64: two graphs, prefill and step);
            dynamo keeps at most ``tformer.generation.static.RECOMPILE_LIMIT`` graphs per process, past which a
            ``RuntimeError`` names ``torch._dynamo.reset()``. ``tformer.generation.static.LAST_TIMINGS`` holds the
            wall time of the first prefill and step, compilation included.
        on_token: ``on_token(row, token_id)`` is called for each output token, in order, as soon as no stop
            can claim it any more (tokens that might begin a stop are held back); the calls spell exactly the
            returned lists.

    The model is accelerated in place (:func:`tformer.engine.accelerate`, undone by :func:`tformer.engine.plain`).
    Raises ``ValueError`` for an empty prompt, ids outside the vocabulary, bad sampling settings or seeds, or
    NaN (or infinite) logits from the model: checked once on the prompt's logits (a model with a NaN weight
    gives them there), and, when sampling, at every draw at no extra cost.
    """
    if not isinstance(model, DecoderLM):
        if isinstance(getattr(model, "model", None), DecoderLM):  # what load_pretrained and load_checkpoint return
            hint = "pass its .model"
        else:
            hint = "an EncoderDecoder decodes with greedy_seq2seq or beam_search"
        raise TypeError(f"generate continues prompts with a DecoderLM; got a {type(model).__name__} ({hint})")
    cfg = model.cfg
    check_max_new_tokens(max_new_tokens)
    check_sampling_args(temperature, top_k, top_p, greedy)
    max_new_tokens, top_k = int(max_new_tokens), None if top_k is None else int(top_k)  # NumPy's integers too
    prompts = _prompt_lists(prompt_ids, cfg.vocab_size)
    stopper = Stopper(stop, eos_id, tokenizer, cfg.vocab_size)
    B = len(prompts)
    seeds = row_seeds(seed, B)
    outputs: list[list[int]] = [[] for _ in range(B)]
    if max_new_tokens == 0:
        return outputs
    device = next(model.parameters()).device
    ids, mask = pad_left(prompts, cfg.pad_id or 0, device)
    rule = SamplingRule(temperature, top_k, top_p, greedy, _generators(seeds, device))
    was_training = model.training
    accelerate(model.eval())
    try:
        with torch.inference_mode():
            if (static_cache or compile) and model.taps is not None:  # the growing cache runs every hook point
                warnings.warn("hooks attached: decoding on the growing cache, static_cache/compile aside", stacklevel=2)
                static_cache = compile = False
            if static_cache or compile:
                from tformer.generation.static import StaticLM

                if not use_cache:
                    raise ValueError("static_cache/compile decode with a cache; use_cache=False contradicts them")
                lm = StaticLM(model, ids, mask, max_new_tokens=max_new_tokens, compile=compile)
            else:
                lm = IncrementalLM(model, ids, mask, max_new_tokens=max_new_tokens, use_cache=use_cache)
            if not stopper.active and on_token is None:  # no row can end early: no host sync until the end
                return _decode_block(lm, rule, max_new_tokens).tolist()
            _decode_rows(lm, rule, max_new_tokens, stopper, on_token, outputs)
            return outputs
    finally:
        model.train(was_training)


def _decode_block(lm: IncrementalLM, rule: SamplingRule, max_new_tokens: int) -> Tensor:
    """``max_new_tokens`` steps for every row; returns the new tokens ``(B, N)``."""
    logits = check_finite_logits(lm.prefill())
    for n in range(max_new_tokens):
        token = rule.pick(logits)  # (B,)
        if n < max_new_tokens - 1:
            logits = lm.step(token)
        else:  # the last token is kept, not fed
            lm.keep(token)
    return lm.ids[:, lm.length - max_new_tokens : lm.length]


def _decode_rows(
    lm: IncrementalLM,
    rule: SamplingRule,
    max_new_tokens: int,
    stopper: Stopper,
    on_token: Callable[[int, int], None] | None,
    outputs: list[list[int]],
) -> None:
    """Steps until every row has ended or ``max_new_tokens``; each row's kept tokens go to ``outputs[row]``,
    and to ``on_token`` once no stop can claim them."""
    B = lm.ids.shape[0]
    done, shown = [False] * B, [0] * B  # shown: tokens of the row already passed to on_token
    logits = check_finite_logits(lm.prefill())
    for n in range(max_new_tokens):
        token = rule.pick(logits)  # (B,)
        last = n == max_new_tokens - 1
        for b, t in enumerate(token.tolist()):
            if done[b]:
                continue
            row = outputs[b]
            row.append(t)
            end = stopper.end(row) if stopper.active else None
            if end is not None:
                del row[end:]
                done[b] = True
            settled = len(row) if done[b] or last else stopper.settled(row)
            if on_token is not None:
                for tok in row[shown[b] : settled]:
                    on_token(b, tok)
            shown[b] = max(shown[b], settled)
        if all(done) or last:
            return
        logits = lm.step(token)
