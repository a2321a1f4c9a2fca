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
one in standard errors. The full sets, with ``transformers``' scores on the same requests, are the benchmark's
(``benchmarks/eval.py --full``, BENCHMARKS.md); a first-``limit`` MMLU slice holds its first subjects only.
"""

from __future__ import annotations

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
    "The full sets (BENCHMARKS.md), with standard errors two to seven times smaller, put the Q4_1 SmolLM2 "
    "0.8-2.5 points under the published figures."
)
STS_TEST = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "stsbenchmark" / "sts-test.csv"
SIZES: dict[str, dict] = {
    "quick": dict(protocols=("lighteval", "lm-eval"), tasks=("arc_easy", "arc_challenge"), limit=6, sts=None),
    "report": dict(
        protocols=("lighteval", "lm-eval"),
        tasks=("arc_easy", "arc_challenge", "piqa", "hellaswag", "mmlu"),
        limit=200,
        sts=STS_TEST,
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

    @property
    def distance(self) -> float:
        """(tformer - published) / tformer's standard error."""
        return (self.value - self.published.value) / self.stderr if self.stderr > 0 else math.nan


@dataclass
class EvaluationResult:
    rows: list[Row] = field(default_factory=list)
    limit: int | None = None
    skipped: list[str] = field(default_factory=list)

    def tables(self) -> list[Table]:
        examples = "all examples" if self.limit is None else f"first {self.limit} examples of each set"
        rows = tuple(
            (
                r.published.protocol,
                r.label,
                r.published.figure,
                f"{r.value:.2f} ± {r.stderr:.2f}",
                str(r.examples),
                f"{r.published.value:.2f}",
                r.published.source,
                f"{r.distance:+.2f}",
                f"{r.seconds:.0f}",
            )
            for r in self.rows
        )
        columns = ("protocol", "task", "figure", "tformer (%)", "n", "published", "source", "(ours - pub) / SE", "s")
        return [Table(columns, rows, f"Scores on the {examples}, against the published figures")] if rows else []

    def findings(self) -> list[str]:
        if not self.rows:
            return ["not measured: " + "; ".join(self.skipped)]
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
        return out + [f"skipped: {s}" for s in self.skipped]

    def plot(self, out_dir: Path) -> list[Path]:
        fig, axes = new_figure(1, 1, (7.5, 0.45 * max(len(self.rows), 2) + 1.2))
        ax = axes.flat[0]
        if not self.rows:
            ax.text(0.5, 0.5, "not measured: " + "; ".join(self.skipped), ha="center", va="center", wrap=True)
            ax.set_axis_off()
            return [save_figure(fig, out_dir, "evaluation")]
        labels = [f"{r.published.protocol}: {r.label}" for r in self.rows]
        y = list(range(len(self.rows)))
        values, errors = [r.value for r in self.rows], [2 * r.stderr for r in self.rows]
        ax.errorbar(values, y, xerr=errors, fmt="o", capsize=3, label="tformer ± 2 SE")
        ax.scatter([r.published.value for r in self.rows], y, marker="x", color="C3", zorder=3, label="published")
        ax.set_yticks(y, labels)
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


def run(
    protocols: tuple[str, ...] = ("lighteval", "lm-eval"),
    tasks: tuple[str, ...] = ("arc_easy", "arc_challenge", "piqa", "hellaswag", "mmlu"),
    limit: int | None = 200,
    sts: str | Path | None = STS_TEST,
    batch_size: int = 16,
) -> EvaluationResult:
    """Score ``smollm2`` on the ``tasks`` of each published figure under ``protocols`` (first ``limit`` examples)
    and ``minilm`` on the STS-B csv ``sts`` when it exists; a missing model or data package is a skipped entry."""
    from tformer.evaluation import EvalError, evaluate
    from tformer.interop import load_pretrained, shipped

    wanted = [p for p in PUBLISHED if p.protocol in protocols and set(p.tasks) <= set(tasks)]
    out = EvaluationResult(limit=limit)
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


__all__ = ["PUBLISHED", "EvaluationResult", "Published", "Row", "run"]
