"""The two scoring protocols, rule by rule, each with its source.

**lm-evaluation-harness** (EleutherAI, v0.4.13: ``lm_eval/api/model.py`` ``TemplateLM._encode_pair`` and
``loglikelihood``; ``lm_eval/api/task.py`` ``ConfigurableTask.process_results``; ``lm_eval/utils.py``
``get_rolling_token_windows``; ``lm_eval/api/metrics.py``):

* a request is ``(context, continuation)``; whitespace at the end of the context is moved to the front of the
  continuation; ``whole = encode(context + continuation)``, ``ctx = encode(context)`` and the continuation's tokens
  are ``whole[len(ctx):]`` (the split is at the encoded context's length); the model reads ``ctx + cont``;
* an empty context becomes the prefix token (BOS, else EOS): :func:`split_pair`;
* the log-likelihood of a continuation is ``sum_k log p(cont_k | ctx, cont_<k)``, and it is greedy when every
  ``cont_k`` is the argmax;
* ``acc = [argmax_i ll_i == gold]``; ``acc_norm = [argmax_i ll_i / len(choice_i) == gold]`` with ``len`` in
  characters of the choice text (without the space that joins it to the context); ties go to the first;
* perplexity of a text: ``loglikelihood_rolling``, disjoint windows of at most ``max_length`` tokens, the first
  conditioned on the prefix token, each later one on the tokens before it (:func:`rolling_windows`);
  ``word_perplexity = exp(-sum ll / sum words)``, ``byte_perplexity = exp(-sum ll / sum bytes)``,
  ``bits_per_byte = -sum ll / sum bytes / ln 2`` (words: ``len(re.split(r"\\s+", text))``; bytes: UTF-8).

**lighteval** as the SmolLM2 model cards used it (huggingface/smollm ``evaluation/tasks.py``, lighteval's
``default_prompts.py`` and ``metrics_sample.py``): the same context/continuation split (lighteval's
``tok_encode_pair``), the card's prompts per task (``tasks.py``), the instruct model's chat template around the
question (``--use_chat_template``: the context is the template's text of one user turn with the assistant's
opening; whitespace at its end moves into the continuation as above) and ``loglikelihood_acc_norm_nospace``:
``argmax_i ll_i / n_i`` with ``n_i = len(choice_i) - 1`` when the choice starts with a space, else ``len(choice_i)``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

PROTOCOLS = ("lm-eval", "lighteval")

Encode = Callable[[str], list[int]]


def split_pair(encode: Encode, context: str, continuation: str, prefix: int) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's ``(context ids, continuation ids)`` of one request (module docstring)."""
    if context == "":
        cont = encode(continuation)
        return ([prefix], cont) if cont and cont[0] != prefix else (cont[:1], cont[1:])
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = encode(context + continuation)
    ctx = encode(context)
    return ctx, whole[len(ctx) :]


def truncate(ctx: list[int], cont: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """Drop tokens from the left of the context so that the model reads at most ``max_length`` tokens (lm-eval:
    ``(ctx + cont)[-(max_length + 1):][:-1]``); the continuation is kept whole, and so is the context's last token
    (a continuation longer than ``max_length`` is then read whole: lm-eval would misalign it)."""
    over = len(ctx) + len(cont) - 1 - max_length
    return (ctx[min(over, len(ctx) - 1) :], cont) if over > 0 else (ctx, cont)


def rolling_windows(tokens: Sequence[int], prefix: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's ``loglikelihood_rolling`` windows of ``tokens`` as disjoint ``(context, continuation)`` pairs: every
    token is predicted once; the first window reads ``[prefix] + tokens[:max_length - 1]``, each later one the
    ``max_length`` tokens before its last prediction (``get_rolling_token_windows`` with ``context_len=1``, then
    ``make_disjoint_window``)."""
    tokens = list(tokens)
    if not tokens:
        return []
    first = min(max_length, len(tokens))
    windows = [([prefix] + tokens[: first - 1], tokens[:first])]
    predicted = first
    while predicted < len(tokens):
        n = min(len(tokens) - predicted, max_length)
        end = predicted + n
        windows.append((tokens[max(end - max_length - 1, 0) : end - 1], tokens[end - n : end]))
        predicted += n
    return [(inp[: len(inp) - (len(pred) - 1)], pred) for inp, pred in windows]


def argmax(values: Sequence[float]) -> int:
    """The index of the largest value, the first on a tie (``numpy.argmax``)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def acc(lls: Sequence[float], gold: int) -> float:
    """``1`` when the most likely choice is the gold one, else ``0``."""
    return float(argmax(lls) == gold)


def acc_norm(lls: Sequence[float], choices: Sequence[str], gold: int) -> float:
    """lm-eval's ``acc_norm``: log-likelihood per character of the choice text."""
    return float(argmax([ll / len(c) for ll, c in zip(lls, choices, strict=True)]) == gold)


def acc_norm_nospace(lls: Sequence[float], choices: Sequence[str], gold: int) -> float:
    """lighteval's ``loglikelihood_acc_norm_nospace``: per character, a leading space not counted."""
    lengths = [len(c) - 1 if c.startswith(" ") else len(c) for c in choices]
    return float(argmax([ll / max(n, 1) for ll, n in zip(lls, lengths, strict=True)]) == gold)


def words(text: str) -> int:
    """lm-eval's word count of a document: ``len(re.split(r"\\s+", text))``."""
    return len(re.split(r"\s+", text))


def utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8"))


LN2 = math.log(2)
