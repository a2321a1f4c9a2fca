"""``tformer report``: run every experiment and write one page, ``report.md``, answering the source's questions.

Each section quotes the claim, says how it was measured (the experiment module's docstring), lists the measured
figures, shows the tables and the picture. ``size="quick"`` runs tiny sizes (seconds); ``"report"`` the sizes of
the committed report (a few minutes on two CPU cores).
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import platform
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from tformer.experiments import EXPERIMENTS, ExperimentResult, Size, load, run_experiment
from tformer.experiments._common import single_thread

REPORT = "report.md"


class OutputFolderError(ValueError):
    """The output folder cannot be made or written (the message names it: ``FOLDER: why; what to do``)."""


class Staging:
    """A hidden folder inside ``out_dir`` to write a run's files into, so that a run that fails or is interrupted
    leaves ``out_dir`` as it was: when the ``with`` block ends normally its files move into ``out_dir`` (those
    named in ``last`` last: the page after the pictures it shows); when it raises they are deleted, with every
    folder made for ``out_dir``.

    Made before anything runs: :class:`OutputFolderError` when ``out_dir`` lies under a file or cannot be made or
    written (nothing is left behind then either)."""

    def __init__(self, out_dir: Path, last: Sequence[str] = ()) -> None:
        self.out_dir, self.last = out_dir, tuple(last)
        self.made: list[Path] = []  # the folders made for out_dir, outermost first
        missing = []
        folder = out_dir
        while not folder.exists() and folder != folder.parent:
            missing.append(folder)
            folder = folder.parent
        if not folder.is_dir():
            where = "" if folder == out_dir else f" lies under {folder}, which"
            raise OutputFolderError(f"{out_dir}{where} is a file; give a folder")
        try:
            for folder in reversed(missing):
                folder.mkdir()
                self.made.append(folder)
        except OSError as err:
            self._remove_made()
            raise OutputFolderError(
                f"{out_dir}: cannot create this folder ({err.strerror}); give a folder you can write to"
            ) from None
        try:
            self.path = Path(tempfile.mkdtemp(prefix=".tformer-partial-", dir=out_dir))
        except OSError as err:
            self._remove_made()
            raise OutputFolderError(
                f"{out_dir}: cannot write in this folder ({err.strerror}); give a folder you can write to"
            ) from None

    def final(self, path: Path) -> Path:
        """Where the file ``path`` written into :attr:`path` will be once moved."""
        return self.out_dir / path.relative_to(self.path)

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is not None:
            self._discard()
            return
        try:
            self._move_in()
        except BaseException:
            self._discard()
            raise
        shutil.rmtree(self.path, ignore_errors=True)  # empty by now

    def _discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._remove_made()

    def _move_in(self) -> None:
        files = sorted(self.path.iterdir(), key=lambda f: (f.name in self.last, f.name))
        for f in files:
            if self.final(f).is_dir():
                raise ValueError(f"{self.final(f)} is a folder; move it away: the report writes a file of that name")
        for f in files:
            os.replace(f, self.final(f))

    def _remove_made(self) -> None:
        for folder in reversed(self.made):
            with contextlib.suppress(OSError):  # not empty: something else wrote there meanwhile
                folder.rmdir()


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


def write_experiment(
    name: str,
    out_dir: Path,
    size: Size = "report",
    seed: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> ExperimentRun:
    """:func:`run_and_plot` into ``out_dir`` (made when missing) through a :class:`Staging` folder: if the run fails,
    ``out_dir`` is left as it was. :class:`OutputFolderError` before the run when ``out_dir`` cannot be written.
    ``progress`` gets a line as the run starts and one as it ends (with its time)."""
    load(name)
    with Staging(out_dir) as staging:
        if progress:
            progress(f"running {name} ({size} sizes) ...")
        run = run_and_plot(name, staging.path, size, seed)
        if progress:
            progress(f"{name} done in {run.seconds:.1f} s")
    run.pngs = [staging.final(p) for p in run.pngs]
    return run


def shown_path(path: str | Path) -> str:
    """``path`` as the report prints it: a model tformer ships by its name (``smollm2``), which reruns anywhere it
    is installed; another path inside an installed package from ``<site-packages>`` on, so the page does not name
    one machine's folders."""
    from tformer.interop.shipped import name_of

    name = name_of(path)
    if name is not None:
        return name
    parts = Path(path).parts
    if "site-packages" in parts:
        return "/".join(("<site-packages>", *parts[parts.index("site-packages") + 1 :]))
    return str(path)


def checkpoint_names(checkpoints: Sequence[str | Path]) -> list[tuple[str, str]]:
    """Each checkpoint's section name and PNG name (no ``.png``), told apart: the name is the checkpoint's
    :func:`~tformer.experiments.trained.display_name`, or, where two checkpoints share it, the path as given
    (``runs/a`` and ``other/a``); the PNG is ``trained-NAME``, numbered from the second on (``trained-a-2``).
    ``ValueError`` for a checkpoint given twice."""
    from tformer.experiments.trained import _slug, display_name

    given: dict[Path, str] = {}
    for checkpoint in checkpoints:
        key = Path(checkpoint).resolve()
        if key in given:
            also = "" if given[key] == str(checkpoint) else f" (also as {given[key]})"
            raise ValueError(f"checkpoint {checkpoint} is given twice{also}; give each checkpoint once")
        given[key] = str(checkpoint)
    bases = [display_name(c) for c in checkpoints]
    names, figures, taken = [], [], set()
    for checkpoint, base in zip(checkpoints, bases, strict=True):
        names.append(base if bases.count(base) == 1 else shown_path(Path(checkpoint)))
        stem, n = f"trained-{_slug(base)}", 1
        while (figure := stem if n == 1 else f"{stem}-{n}") in taken:
            n += 1
        taken.add(figure)
        figures.append(figure)
    return list(zip(names, figures, strict=True))


def run_trained(
    checkpoint: str | Path, out_dir: Path, size: Size = "report", name: str | None = None, figure: str = ""
) -> ExperimentRun:
    """The trained-weights section of one checkpoint (:mod:`tformer.experiments.trained`), with its PNG
    (``figure``.png; default ``trained-NAME.png``). ``name``: the section's (default: the checkpoint's own)."""
    from tformer.experiments import trained

    start = time.perf_counter()
    result = trained.run(checkpoint, **trained.SIZES[size], name=name)
    result.figure = figure
    seconds = time.perf_counter() - start
    command = f"tformer report --only trained --checkpoint {shown_path(checkpoint)}"
    title = f"{trained.TITLE}: {result.name}"
    return ExperimentRun("trained", trained, result, result.plot(out_dir), seconds, command, title, str(checkpoint))


def format_console(run: ExperimentRun, files: bool = True) -> str:
    """What ``tformer experiment NAME`` prints: the claim, the tables, the measured figures, the files (unless
    ``files=False``: a report names them once they are all written)."""
    lines = [
        f"{run.heading}  [{run.name}, {run.seconds:.1f} s]",
        f"claim: {run.module.CLAIM}",
    ]
    for table in run.result.tables():
        lines += ["", table.markdown()]
    lines += ["", "measured:"] + [f"  - {f}" for f in run.result.findings()]
    lines += [f"wrote {p}" for p in run.pngs] if files else []
    return "\n".join(lines)


def _method(module: ModuleType) -> str:
    """The "Measured..." paragraphs of an experiment's docstring, with Sphinx roles turned into code spans."""
    doc = inspect.getdoc(module) or ""
    paragraphs = doc.split("\n\n")
    start = next((i for i, p in enumerate(paragraphs) if p.startswith("Measured")), len(paragraphs))
    text = "\n\n".join(p for p in paragraphs[start:] if not p.startswith("Shapes:"))  # the legend is for code
    text = re.sub(r":(?:func|class|mod|meth|data|attr|obj):`~?([^`]+)`", r"`\1`", text)
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
        selected = ran + (["trained"] if any(r.checkpoint for r in runs) else [])
        command += f" --only {','.join(selected)}"
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
    anchors: dict[str, int] = {}
    for run in runs:
        anchor = re.sub(r"[^a-z0-9 _-]", "", run.heading.lower()).replace(" ", "-")
        seen = anchors[anchor] = anchors.get(anchor, -1) + 1
        anchor += f"-{seen}" * (seen > 0)  # as GitHub numbers a repeated heading's anchor
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
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Run the experiments ``names`` (default: all, in the source's order) and write ``out_dir/report.md``; then
    one trained-weights section per checkpoint in ``checkpoints`` (``names=[]`` for those alone). ``echo`` gets
    each section's tables as it is done, ``progress`` a line as each stage starts and ends (with its time).

    Everything that can be checked is checked before anything runs (``ValueError``; ``CheckpointError`` for a
    tformer run; :class:`OutputFolderError` for ``out_dir``): the names, each checkpoint's kind
    (:func:`tformer.experiments.trained.check`), that ``out_dir`` can be made and written. The files are written
    through a :class:`Staging` folder, so a run that fails later (a checkpoint that does not load) or is interrupted
    leaves ``out_dir`` as it was."""
    from tformer.experiments import trained

    names = list(dict.fromkeys(EXPERIMENTS if names is None else names))
    for name in names:
        load(name)  # fail on an unknown name before running anything
    for checkpoint in checkpoints:
        trained.check(checkpoint)
    sections = checkpoint_names(checkpoints)
    start = time.perf_counter()
    runs = []
    stages = [*names, *checkpoints]
    with Staging(out_dir, last=[REPORT]) as staging:
        for i, stage in enumerate(stages):
            what = f"[{i + 1}/{len(stages)}] " + (stage if i < len(names) else f"trained: {shown_path(stage)}")
            if progress:
                progress(f"{what} ...")
            if i < len(names):
                runs.append(run_and_plot(stage, staging.path, size, seed))
            else:
                name, figure = sections[i - len(names)]
                runs.append(run_trained(stage, staging.path, size, name, figure))
            runs[-1].pngs = [staging.final(p) for p in runs[-1].pngs]
            if progress:
                progress(f"{what} done in {runs[-1].seconds:.1f} s")
            if echo:
                echo(format_console(runs[-1], files=False) + "\n")
        page = render_report(runs, out_dir, size, time.perf_counter() - start, seed)
        (staging.path / REPORT).write_text(page, encoding="utf-8")
    path = out_dir / REPORT
    if echo:
        echo("\n".join(f"wrote {p}" for run in runs for p in run.pngs) + f"\nwrote {path}")
    return path
