"""``evaluation``: published benchmark scores reproduced by ``tformer eval`` (:mod:`tformer.evaluation`).

Claim: a model card's zero-shot scores come from a protocol that can be written down rule by rule; run by those
rules on the same model, the published figures come back within two standard errors of a 200-example slice (the
full sets, in BENCHMARKS.md, resolve the Q4_1 model's gaps of 0.8-2.5 points). The figures
(``PUBLISHED``): SmolLM2-135M-Instruct's model card (lighteval, acc_norm_nospace): HellaSwag 40.9, PIQA 66.3, ARC
(the mean of Easy and Challenge) 37.3, MMLU cloze 29.3; community lm-evaluation-harness runs of the same model:
HellaSwag acc_norm 42.9, PIQA acc_norm 66.8, ARC-Challenge acc_norm 27.7, ARC-Easy acc 54.1; MTEB's result for
all-MiniLM-L6-v2 on the STS Benchmark test set: Spearman 0.8203.

Measured: :func:`tformer.evaluation.evaluate` on ``smollm2`` (the shipped Q4_1 GGUF dequantized to float32, not the
card's bfloat16 weights), each task under the protocol of its published figure, on the first ``limit`` examples of
each set (all of them when ``limit`` is None), and ``minilm`` on the STS-B test csv at ``sts`` when that file exists
(it is workplace data, not shipped). Each figure comes with its standard error and its distance from the published
one in standard errors; a first-``limit`` MMLU slice holds its first subjects only. The full sets, with
``transformers``' scores on the same requests, take hours: they are the benchmark's (``benchmarks/eval.py --full
--record``), and their recorded figures, run times and CPU (``full``, the file ``FULL_RECORD``) are shown beside.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from tformer.experiments._common import Table, fmt, new_figure, save_figure

QUESTION = "Q+ evaluation"  # beyond the source's questions: published benchmark tables
TITLE = "Benchmark scores against the model cards"
CLAIM = (
    "Run by the protocol a model card used (lighteval's, or lm-evaluation-harness's), the same model gets the "
    "published zero-shot scores back within two standard errors of the first 200 examples of each set: "
    "SmolLM2-135M-Instruct's card and community lm-eval runs, and all-MiniLM-L6-v2's STS Benchmark result. "
    "The full sets (the benchmark's record, shown beside), with standard errors two to seven times smaller, put "
    "the Q4_1 SmolLM2 0.8-2.5 points under the published figures."
)
STS_TEST = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "stsbenchmark" / "sts-test.csv"
FULL_RECORD = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "eval-full.json"
SIZES: dict[str, dict] = {
    "quick": dict(
        protocols=("lighteval", "lm-eval"), tasks=("arc_easy", "arc_challenge"), limit=6, sts=None, full=None
    ),
    "report": dict(
        protocols=("lighteval", "lm-eval"),
        tasks=("arc_easy", "arc_challenge", "piqa", "hellaswag", "mmlu"),
        limit=200,
        sts=STS_TEST,
        full=FULL_RECORD,
    ),
}


@dataclass(frozen=True)
class Published:
    """One published figure: ``protocol``'s ``figure`` on ``tasks`` (two tasks: their mean), in %."""

    protocol: str
    tasks: tuple[str, ...]
    figure: str
    value: float
    source: str


PUBLISHED = (
    Published("lighteval", ("hellaswag",), "acc_norm_nospace", 40.9, "SmolLM2-135M-Instruct card"),
    Published("lighteval", ("piqa",), "acc_norm_nospace", 66.3, "SmolLM2-135M-Instruct card"),
    Published("lighteval", ("arc_easy", "arc_challenge"), "acc_norm_nospace", 37.3, "SmolLM2-135M-Instruct card"),
    Published("lighteval", ("mmlu",), "acc_norm_nospace", 29.3, "SmolLM2-135M-Instruct card"),
    Published("lm-eval", ("hellaswag",), "acc_norm", 42.9, "community lm-eval run"),
    Published("lm-eval", ("piqa",), "acc_norm", 66.8, "community lm-eval run"),
    Published("lm-eval", ("arc_challenge",), "acc_norm", 27.7, "community lm-eval run"),
    Published("lm-eval", ("arc_easy",), "acc", 54.1, "community lm-eval run"),
)
STS_PUBLISHED = Published("sts", ("sts-test",), "spearman", 82.03, "MTEB")


@dataclass
class Row:
    """tformer's figure (in %) beside a published one."""

    published: Published
    value: float
    stderr: float
    examples: int
    seconds: float

    @property
    def label(self) -> str:
        return " + ".join(self.published.tasks) if len(self.published.tasks) == 1 else "arc (mean of easy, challenge)"

    def cells(self) -> tuple[str, ...]:
        """The table cells that say which figure this is and what tformer and the publication measured."""
        stats = (f"{self.value:.2f} ± {self.stderr:.2f}", str(self.examples), f"{self.published.value:.2f}")
        return (self.published.protocol, self.label, self.published.figure, *stats)

    @property
    def distance(self) -> float:
        """(tformer - published) / tformer's standard error."""
        return (self.value - self.published.value) / self.stderr if self.stderr > 0 else math.nan


@dataclass
class FullRow(Row):
    """A full set's figure as the benchmark recorded it, with ``transformers``' on the same requests where it ran."""

    transformers: float | None = None  # in %
    transformers_seconds: float | None = None
    argmax_differs: int | None = None  # questions whose most likely choice differs between the two
    transformers_scorer: str = ""  # "HFLM" (lm-eval's) or "cache" (transformers' own key/value cache)
    cpu: str = ""


@dataclass
class EvaluationResult:
    rows: list[Row] = field(default_factory=list)
    full: list[FullRow] = field(default_factory=list)
    limit: int | None = None
    skipped: list[str] = field(default_factory=list)

    def tables(self) -> list[Table]:
        examples = "all examples" if self.limit is None else f"first {self.limit} examples of each set"
        rows = tuple((*r.cells(), r.published.source, f"{r.distance:+.2f}", f"{r.seconds:.0f}") for r in self.rows)
        columns = ("protocol", "task", "figure", "tformer (%)", "n", "published", "source", "(ours - pub) / SE", "s")
        out = [Table(columns, rows, f"Scores on the {examples}, against the published figures")] if rows else []
        if self.full:
            cpus = ", ".join(dict.fromkeys(r.cpu for r in self.full))
            columns = ("protocol", "task", "figure", "tformer (%)", "n", "published", "(ours - pub) / SE")
            columns += ("transformers (%)", "argmax differs", "tformer s", "transformers s")
            full = tuple(
                (
                    *r.cells(),
                    f"{r.distance:+.2f}",
                    "not run" if r.transformers is None else f"{r.transformers:.2f} ({r.transformers_scorer})",
                    "" if r.argmax_differs is None else str(r.argmax_differs),
                    f"{r.seconds:.0f}",
                    "" if r.transformers_seconds is None else f"{r.transformers_seconds:.0f}",
                )
                for r in self.full
            )
            title = (
                f"The full sets, recorded by benchmarks/eval.py --full on {cpus} (transformers on the same GGUF "
                "file and requests, through lm-eval's HFLM or its own key/value cache), against the published figures"
            )
            out.append(Table(columns, full, title))
        return out

    def findings(self) -> list[str]:
        if not self.rows and not self.full:
            return ["not measured: " + "; ".join(self.skipped)]
        return self._sliced() + self._full() + [f"skipped: {s}" for s in self.skipped]

    def _full(self) -> list[str]:
        if not self.full:
            return []
        gaps = [r.value - r.published.value for r in self.full]
        ran = [r for r in self.full if r.transformers is not None]
        same = [r for r in ran if round(r.transformers, 2) == round(r.value, 2)]
        return [
            f"full sets (recorded): {sum(abs(r.distance) <= 2 for r in self.full)} of {len(self.full)} published "
            f"figures within 2 standard errors; tformer - published from {min(gaps):+.2f} to {max(gaps):+.2f} "
            f"points; transformers on the same requests: the same figure on {len(same)} of the {len(ran)} it ran "
            f"on, {sum(r.argmax_differs or 0 for r in ran)} questions with another most likely choice"
        ]

    def _sliced(self) -> list[str]:
        if not self.rows:
            return []
        near = [r for r in self.rows if abs(r.distance) <= 2]
        worst = max(self.rows, key=lambda r: abs(r.distance))
        out = [
            f"{len(near)} of {len(self.rows)} published figures within 2 standard errors of tformer's "
            f"({'all examples' if self.limit is None else f'first {self.limit} examples'}); the farthest: "
            f"{worst.published.protocol} {worst.label} {worst.value:.2f} ± {worst.stderr:.2f} against "
            f"{worst.published.value:.2f} ({worst.distance:+.2f} SE)"
        ]
        out += [
            f"{r.published.protocol} {r.label} {r.published.figure}: {r.value:.2f} ± {r.stderr:.2f} "
            f"(n = {r.examples}, {fmt(r.seconds)} s) against {r.published.value:.2f} ({r.published.source})"
            for r in self.rows
        ]
        return out

    def plot(self, out_dir: Path) -> list[Path]:
        shown = list(dict.fromkeys(r.published for r in self.rows + self.full))
        fig, axes = new_figure(1, 1, (7.5, 0.45 * max(len(shown), 2) + 1.2))
        ax = axes.flat[0]
        if not self.rows and not self.full:
            ax.text(0.5, 0.5, "not measured: " + "; ".join(self.skipped), ha="center", va="center", wrap=True)
            ax.set_axis_off()
            return [save_figure(fig, out_dir, "evaluation")]
        y = {p: i for i, p in enumerate(shown)}
        for rows, shift, label in ((self.rows, -0.15, "first slice"), (self.full, 0.15, "full set")):
            if rows:
                values, errors = [r.value for r in rows], [2 * r.stderr for r in rows]
                at = [y[r.published] + shift for r in rows]
                ax.errorbar(values, at, xerr=errors, fmt="o", capsize=3, label=f"tformer, {label} ± 2 SE")
        ax.scatter([p.value for p in shown], list(y.values()), marker="x", color="C3", zorder=3, label="published")
        label = {r.published: r.label for r in self.rows + self.full}
        ax.set_yticks(list(y.values()), [f"{p.protocol}: {label[p]}" for p in shown])
        ax.invert_yaxis()
        ax.set_xlim(0, 100)  # scores are percentages; the left margin holds the legend
        ax.set_xlabel("score (%)")
        ax.set_title("tformer's scores against the published ones")
        ax.legend(loc="lower left", fontsize=8)
        return [save_figure(fig, out_dir, "evaluation")]


def _row(results: dict, published: Published, seconds: float) -> Row:
    figures = [results["tasks"][t]["figures"][published.figure] for t in published.tasks]
    value = 100 * sum(f["value"] for f in figures) / len(figures)
    stderr = 100 * math.sqrt(sum(f["stderr"] ** 2 for f in figures)) / len(figures)  # the sets are independent
    return Row(published, value, stderr, sum(f["n"] for f in figures), seconds)


RECORD_ABOUT = "benchmarks/eval.py --full --record: tformer's full-set scores, transformers' on the same requests"
RECORD_KEYS = ("protocol", "task", "n", "seconds", "figures", "cpu", "date")  # and "transformers" where it ran


def record_full_set(path: str | Path, entry: dict) -> None:
    """One full set's ``entry`` (``RECORD_KEYS``: ``figures`` maps each figure's name to ``[value, stderr]``, as
    fractions; ``transformers``, optional: ``figures`` (name to value), ``seconds``, ``max_abs_dll``,
    ``argmax_differs``, ``scorer``: ``HFLM`` or ``cache``) put into the record at ``path``, replacing the same
    protocol's and task's earlier one. Written whole: a temporary file beside it, renamed over the old."""
    absent = [k for k in RECORD_KEYS if k not in entry]
    if absent:
        raise ValueError(f"a full set's record entry needs {', '.join(absent)}; got keys {', '.join(entry)}")
    path = Path(path)
    sets = _read(path) if path.exists() else {}
    sets[entry["protocol"], entry["task"]] = entry
    lines = ",\n".join(f"  {json.dumps(sets[key])}" for key in sorted(sets))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f'{{"about": {json.dumps(RECORD_ABOUT)},\n "rows": [\n{lines}\n]}}\n')  # a set per line
    tmp.replace(path)


def _read(path: Path) -> dict[tuple[str, str], dict]:
    """The record's sets by (protocol, task); ``ValueError`` naming the file when it is not a record."""
    try:
        return {(r["protocol"], r["task"]): r for r in json.loads(path.read_text())["rows"]}
    except (KeyError, TypeError, ValueError) as err:  # json's errors are ValueErrors
        raise ValueError(_not_a_record(path, err)) from None


def _not_a_record(path: str | Path, err: Exception) -> str:
    return (
        f"{path} is not a record of benchmarks/eval.py --full --record ({type(err).__name__}: {err}); "
        "write it again with that command"
    )


def full_rows(path: str | Path, wanted: list[Published]) -> tuple[list[FullRow], list[str]]:
    """The ``wanted`` figures from the benchmark's record at ``path`` (``benchmarks/eval.py --full --record``), and
    the figures whose sets it does not hold yet. ``ValueError`` naming the file when it is not such a record."""
    sets = _read(Path(path))
    try:
        rows, missing = [], []
        for p in wanted:
            recs = [sets.get((p.protocol, t)) for t in p.tasks]
            if None in recs:
                missing.append(f"{p.protocol} {' + '.join(p.tasks)}")
                continue
            results = {  # shaped as evaluate()'s, for _row
                t: {"figures": {n: {"value": v, "stderr": e, "n": r["n"]} for n, (v, e) in r["figures"].items()}}
                for t, r in zip(p.tasks, recs, strict=True)
            }
            row = _row({"tasks": results}, p, sum(r["seconds"] for r in recs))
            hf = [r.get("transformers") for r in recs]
            full = FullRow(**vars(row), cpu=", ".join(dict.fromkeys(r["cpu"] for r in recs)))
            if None not in hf:
                full.transformers = 100 * sum(h["figures"][p.figure] for h in hf) / len(hf)
                full.transformers_seconds = sum(h["seconds"] for h in hf)
                full.argmax_differs = sum(h["argmax_differs"] for h in hf)
                full.transformers_scorer = " + ".join(dict.fromkeys(h.get("scorer", "HFLM") for h in hf))
            rows.append(full)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(_not_a_record(path, err)) from None
    return rows, missing


def run(
    protocols: tuple[str, ...] = ("lighteval", "lm-eval"),
    tasks: tuple[str, ...] = ("arc_easy", "arc_challenge", "piqa", "hellaswag", "mmlu"),
    limit: int | None = 200,
    sts: str | Path | None = STS_TEST,
    batch_size: int = 16,
    full: str | Path | None = FULL_RECORD,
) -> EvaluationResult:
    """Score ``smollm2`` on the ``tasks`` of each published figure under ``protocols`` (first ``limit`` examples)
    and ``minilm`` on the STS-B csv ``sts`` when it exists, and read the same figures' full sets from the
    benchmark's record ``full`` (:func:`full_rows`); a missing model, data package or record is a skipped entry."""
    from tformer.evaluation import EvalError, evaluate
    from tformer.interop import load_pretrained, shipped

    wanted = [p for p in PUBLISHED if p.protocol in protocols and set(p.tasks) <= set(tasks)]
    out = EvaluationResult(limit=limit)
    if full is not None and Path(full).exists():
        out.full, missing = full_rows(full, wanted)
        out.skipped += [f"full set of {m}: not in {full} yet" for m in missing]
    elif full is not None:
        out.skipped.append(f"full sets: no record at {full} (benchmarks/eval.py --full --record writes it)")
    if wanted and not shipped.locate("smollm2").exists():
        out.skipped.append(shipped.missing("smollm2"))
        wanted = []
    model = load_pretrained("smollm2") if wanted else None
    for protocol in protocols:
        mine = [p for p in wanted if p.protocol == protocol]
        names = list(dict.fromkeys(t for p in mine for t in p.tasks))
        if not names:
            continue
        try:
            results = evaluate(model, names, protocol=protocol, limit=limit, batch_size=batch_size)
        except EvalError as err:
            out.skipped.append(f"{protocol}: {err}")
            continue
        for p in mine:
            out.rows.append(_row(results, p, sum(results["tasks"][t]["seconds"] for t in p.tasks)))
    if sts is not None and Path(sts).exists():
        if not shipped.locate("minilm").exists():
            out.skipped.append(shipped.missing("minilm"))
        else:
            results = evaluate("minilm", f"sts:{sts}")
            (task,) = results["tasks"].values()
            f = task["figures"]["spearman"]
            out.rows.append(Row(STS_PUBLISHED, 100 * f["value"], 100 * f["stderr"], f["n"], task["seconds"]))
    elif sts is not None:
        out.skipped.append(f"STS-B: no file at {sts} (the workplace's shared data)")
    return out


__all__ = [
    "FULL_RECORD",
    "PUBLISHED",
    "EvaluationResult",
    "FullRow",
    "Published",
    "Row",
    "full_rows",
    "record_full_set",
    "run",
]
