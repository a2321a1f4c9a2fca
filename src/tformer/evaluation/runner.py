"""``tformer.evaluate``: run tasks on a model, each figure with its standard error, every example on record.

The results (a dict; ``json_out`` writes it) hold, per task, its figures (``value``, ``stderr``, ``n``), the
examples, the seconds and examples per second; ``records`` (JSONL) gets one line per example with the log-likelihood
of each choice, so a score can be audited. Both files are written whole or not at all: to a temporary file beside
the target, renamed over it once complete (an interrupted run leaves no partial file).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tformer.evaluation import data, metrics, protocols
from tformer.evaluation import tasks as catalog
from tformer.evaluation.data import EvalError
from tformer.evaluation.model import EvalModel, load
from tformer.evaluation.protocols import PROTOCOLS
from tformer.evaluation.scoring import score_requests

Progress = Callable[[str, int, int], Any]  # (task, total units, examples) -> an object with update(n) and close()


def evaluate(
    checkpoint: Any,
    tasks: str | Sequence[str],
    *,
    protocol: str = "lm-eval",
    limit: int | None = None,
    batch_size: int = 16,
    chat: bool | None = None,
    max_length: int | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    json_out: str | os.PathLike | None = None,
    records: str | os.PathLike | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Scores of ``checkpoint`` (a path, a shipped model's name or a loaded ``Pretrained``) on ``tasks`` (names or a
    comma list: ``"piqa,arc_easy"``, ``"perplexity:FILE"``, ``"sts:FILE"``, ``"choices:FILE.jsonl"``) under
    ``protocol`` (``lm-eval`` or ``lighteval``, :mod:`tformer.evaluation.protocols`). ``limit``: the first N examples
    of each task; ``chat``: the lighteval protocol's chat template (default: when the tokenizer has one);
    ``max_length``: the longest input (default: the model's). Raises :class:`EvalError` on bad input."""
    names = [t for t in (tasks.split(",") if isinstance(tasks, str) else list(tasks)) if t.strip()]
    if not names:
        raise EvalError(f"no task given; known tasks: {catalog.known()}")
    parsed = [catalog.parse_task(t) for t in names]  # every name checked before the model loads
    if protocol not in PROTOCOLS:
        raise EvalError(f"unknown protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}")
    for value, what in ((limit, "limit"), (batch_size, "batch_size"), (max_length, "max_length")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise EvalError(f"{what} must be a positive integer; got {value!r}")
    for out in (json_out, records):
        if out is not None and Path(out).is_dir():
            raise EvalError(f"{out} is a folder; give a file name for the results (results.json)")
    if chat and protocol != "lighteval":
        raise EvalError("chat templates belong to the lighteval protocol here: add protocol='lighteval'")
    lm = load(checkpoint, device=device, dtype=dtype)
    run = _Run(lm, protocol, limit, batch_size, chat, max_length or lm.max_length, progress)
    results: dict[str, Any] = {"model": lm.name, "protocol": protocol, "limit": limit, "tasks": {}}
    lines: list[dict[str, Any]] = []
    for (name, path), text in zip(parsed, names, strict=True):
        start = time.perf_counter()
        figures, recs = run.task(name, path, text.strip())
        seconds = time.perf_counter() - start
        results["tasks"][text.strip()] = {
            "figures": {k: f.as_dict() for k, f in figures.items()},
            "examples": len(recs),
            "seconds": round(seconds, 3),
            "examples_per_s": round(len(recs) / seconds, 2) if seconds > 0 else None,
        }
        results["tasks"][text.strip()].update(run.notes.pop(text.strip(), {}))
        lines.extend(recs)
    if json_out is not None:
        write_whole(json_out, json.dumps(results, indent=2) + "\n")
    if records is not None:
        write_whole(records, "".join(json.dumps(r) + "\n" for r in lines))
    return results


class _Run:
    def __init__(self, lm: EvalModel, protocol: str, limit, batch_size: int, chat, max_length: int, progress: bool):
        self.lm, self.protocol, self.limit, self.batch_size = lm, protocol, limit, batch_size
        self.max_length, self.progress = max_length, progress
        self.chat = chat
        self.notes: dict[str, dict[str, Any]] = {}
        self.rendered: dict[str, str] = {}

    def task(self, name: str, path: str | None, label: str):
        if name == "sts":
            return self.sts(path, label)
        self.lm.require("lm", label)
        if name == "perplexity":
            return self.perplexity(path, label)
        examples = (
            catalog.user_choices(path, self.protocol) if name == "choices" else catalog.TASKS[name].build(self.protocol)
        )
        examples = examples[: self.limit] if self.limit else examples
        if name == "lambada":
            return self.lambada(examples, label)
        return self.choice(examples, label)

    # ---- the language-model tasks ------------------------------------------------------------------------
    def _use_chat(self) -> bool:
        from tformer.generation.chat import chat_template

        if self.protocol != "lighteval":
            return False
        has = chat_template(self.lm.tokenizer) is not None
        if self.chat and not has:
            raise EvalError(f"{self.lm.name}: its tokenizer has no chat template; run without chat")
        return has if self.chat is None else bool(self.chat)

    def _context(self, text: str, chat: bool) -> str:
        """The context as the model reads it: ``text``, or under the chat template one user turn of it (rendered
        once per distinct text: the choices of a question share it)."""
        from tformer.generation.chat import chat_prompt

        if not chat:
            return text
        if text not in self.rendered:
            self.rendered[text] = chat_prompt(self.lm.tokenizer, [{"role": "user", "content": text}])
        return self.rendered[text]

    def _score(self, label: str, pairs: list[tuple[str, str]], examples: int):
        ids = [protocols.split_pair(self.lm.encode, c, x, self.lm.prefix) for c, x in pairs]
        ids = [protocols.truncate(c, x, self.max_length) for c, x in ids]
        return self._score_ids(label, ids, examples)

    def _score_ids(self, label: str, ids, examples: int):
        bar = _bar(label, len(ids), examples) if self.progress else None
        try:
            return score_requests(
                self.lm.model,
                ids,
                batch_size=self.batch_size,
                pad_id=self.lm.pad_id,
                progress=bar.update if bar else None,
            )
        finally:
            if bar is not None:
                bar.close()

    def choice(self, examples: list[catalog.Example], label: str):
        chat = self._use_chat()
        pairs = [(self._context(c, chat), x) for ex in examples for c, x in ex.requests]
        scored = iter(self._score(label, pairs, len(examples)))
        asked = iter(pairs)
        norm_name = "acc_norm" if self.protocol == "lm-eval" else "acc_norm_nospace"
        norm = protocols.acc_norm if self.protocol == "lm-eval" else protocols.acc_norm_nospace
        recs, accs, norms = [], [], []
        for ex in examples:
            lls = [next(scored).logprob for _ in ex.requests]
            accs.append(protocols.acc(lls, ex.gold))
            norms.append(norm(lls, ex.choices, ex.gold))
            recs.append(
                {
                    "task": label,
                    "id": ex.id,
                    "gold": ex.gold,
                    "loglikelihoods": lls,
                    "pred": protocols.argmax(lls),
                    "acc": accs[-1],
                    norm_name: norms[-1],
                    "requests": [next(asked) for _ in ex.requests],
                    **ex.extra,
                }
            )
        self.notes[label] = {"chat_template": chat}
        return {"acc": metrics.mean_figure(accs), norm_name: metrics.mean_figure(norms)}, recs

    def lambada(self, examples: list[catalog.Example], label: str):
        pairs = [ex.requests[0] for ex in examples]
        scored = self._score(label, pairs, len(examples))
        lls = [s.logprob for s in scored]
        recs = [
            {"task": label, "id": ex.id, "request": ex.requests[0], "loglikelihood": s.logprob, "greedy": s.greedy}
            for ex, s in zip(examples, scored, strict=True)
        ]
        return {
            "acc": metrics.mean_figure([float(s.greedy) for s in scored]),
            "perplexity": metrics.exp_neg(metrics.mean_figure(lls)),
        }, recs

    def perplexity(self, path: str, label: str):
        """The file's documents (paragraphs: text between blank lines), each scored by rolling windows."""
        text = data.read_text(path)
        docs = [d for d in re.split(r"\n\s*\n", text) if d.strip()]
        docs = docs[: self.limit] if self.limit else docs
        if not docs:
            raise EvalError(f"{path}: no text to score")
        windows, owner = [], []
        for i, doc in enumerate(docs):
            for w in protocols.rolling_windows(self.lm.encode(doc), self.lm.prefix, self.max_length):
                windows.append(w)
                owner.append(i)
        scored = self._score_ids(label, windows, len(docs))
        lls = [0.0] * len(docs)
        for i, s in zip(owner, scored, strict=True):
            lls[i] += s.logprob
        nwords = [protocols.words(d) for d in docs]
        nbytes = [protocols.utf8_bytes(d) for d in docs]
        per_word = metrics.ratio_figure(lls, nwords)
        per_byte = metrics.ratio_figure(lls, nbytes)
        recs = [
            {"task": label, "id": i, "loglikelihood": ll, "words": w, "bytes": b}
            for i, (ll, w, b) in enumerate(zip(lls, nwords, nbytes, strict=True))
        ]
        figures = {
            "word_perplexity": metrics.exp_neg(per_word),
            "byte_perplexity": metrics.exp_neg(per_byte),
            "bits_per_byte": metrics.scaled(per_byte, -1 / math.log(2)),
        }
        return figures, recs

    # ---- the embedding task ----------------------------------------------------------------------------
    def sts(self, path: str, label: str):
        from tformer.interop import embed

        self.lm.require("encoder", label)
        if self.lm.pretrained is None:
            raise EvalError(f"{self.lm.name}: sts needs a Hugging Face sentence-embedding checkpoint (minilm)")
        pairs = data.read_sts(path)
        pairs = pairs[: self.limit] if self.limit else pairs
        bar = _bar(label, 2 * len(pairs), len(pairs)) if self.progress else None
        embedded = []
        for side in (0, 1):
            texts = [p[side] for p in pairs]
            for start in range(0, len(texts), 64):
                embedded.append(embed(self.lm.pretrained, texts[start : start + 64], batch_size=self.batch_size))
                if bar is not None:
                    bar.update(len(texts[start : start + 64]))
        if bar is not None:
            bar.close()
        import torch

        a, b = torch.cat(embedded).split(len(pairs))
        cosine = (a * b).sum(-1).tolist()  # the embeddings are unit vectors
        gold = [p[2] for p in pairs]
        recs = [
            {"task": label, "id": i, "sentence1": p[0], "sentence2": p[1], "gold": p[2], "cosine": c}
            for i, (p, c) in enumerate(zip(pairs, cosine, strict=True))
        ]
        return {"spearman": metrics.spearman_figure(cosine, gold)}, recs


def _bar(label: str, units: int, examples: int):
    """A progress bar counted in examples (``units`` requests or windows shown as ``examples``), with examples/s."""
    from tqdm import tqdm

    return tqdm(total=units, desc=label, unit="ex", unit_scale=examples / max(units, 1), file=sys.stderr, leave=False)


def write_whole(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a temporary file beside it, flushed to disk, then renamed."""
    target = Path(path)
    if target.is_dir():
        raise EvalError(f"{path} is a folder; give a file name (results.json)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def table(results: dict[str, Any]) -> str:
    """The results as a text table: task, figure, value ± standard error, examples, seconds."""
    rows = [("task", "figure", "value", "± stderr", "n", "s")]
    for task, res in results["tasks"].items():
        for name, f in res["figures"].items():
            rows.append((task, name, f"{f['value']:.4f}", f"{f['stderr']:.4f}", str(f["n"]), f"{res['seconds']:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(row: tuple[str, ...]) -> str:  # names left-aligned, numbers right-aligned
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    return "\n".join(line(r) for r in rows)
