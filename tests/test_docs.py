"""The documents hold: every Python block of README.md and of the docs pages runs as written, on its own; README's
and the pages' commands write only under ignored paths; README stays a short guide and BENCHMARKS.md a page of
current figures.

Each ```python block runs in its own interpreter in an empty temporary folder, so a missing import, a placeholder
path or a file the block expects to find fails it. Blocks that load the shipped models (``load_pretrained("smollm2")``,
``"minilm"``) run in the ``slow`` tier; the others are written to run in seconds. The dated files of docs/history/
(archives, not instructions) and the generated docs/report/ are not read.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
SKIPPED_DOCS = ("history", "report")  # archives and the generated report
PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md") if p.relative_to(ROOT / "docs").parts[0] not in SKIPPED_DOCS)
DOCUMENTS = [README, *PAGES]

README_LINES = 250
BENCHMARKS_LINES = 200
PARAGRAPH_WORDS = 120
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
SHIPPED = re.compile(r"""load_pretrained\(\s*["'](smollm2|minilm)["']""")
FAST_TIMEOUT_S = 300
SLOW_TIMEOUT_S = 900


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def blocks(path: Path, language: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each fenced block of ``language`` in ``path`` (line: where the code starts, 1-based)."""
    text = path.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        if match.group(1) == language:
            found.append((text.count("\n", 0, match.start(2)) + 1, match.group(2)))
    return found


def python_blocks():
    params = []
    for path in DOCUMENTS:
        for line, code in blocks(path, "python"):
            marks = [pytest.mark.slow] if SHIPPED.search(code) else []
            params.append(pytest.param(path, line, code, marks=marks, id=f"{relative(path)}:{line}"))
    return params


def test_the_documents_have_python_blocks_to_run():
    # the extraction itself: a changed fence syntax must not leave the test below with nothing to run
    assert len(python_blocks()) >= 5, [p.id for p in python_blocks()]
    assert any(p.marks for p in python_blocks()), "no block loads a shipped model: the slow tier checks nothing"


@pytest.mark.subprocess
@pytest.mark.parametrize(("path", "line", "code"), python_blocks())
def test_every_python_block_runs_as_written(path: Path, line: int, code: str, tmp_path: Path):
    timeout = SLOW_TIMEOUT_S if SHIPPED.search(code) else FAST_TIMEOUT_S
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg"}
    try:
        run = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{relative(path)}:{line}: the block ran past {timeout} s; make it run in seconds")
    assert run.returncode == 0, f"{relative(path)}:{line} failed (exit {run.returncode}):\n{run.stderr[-4000:]}"


# Paths a command may write to: git ignores runs/ (.gitignore), and nothing of the repository lives in /tmp
WRITABLE = ("runs/", "/tmp/", "/dev/null")
OUT_FLAG = re.compile(r"--out[ =](\S+)")
REDIRECT = re.compile(r"(?<![0-9&])>>?\s*(\S+)")


def command_targets(code: str) -> list[str]:
    """The paths a shell block names as outputs: ``--out PATH`` and ``> PATH`` (comments dropped)."""
    lines = [line.split(" #", 1)[0] for line in code.splitlines() if not line.lstrip().startswith("#")]
    text = "\n".join(lines)
    return OUT_FLAG.findall(text) + REDIRECT.findall(text)


def test_command_targets_are_read_from_out_flags_and_redirections():
    code = "tformer report --out runs/report   # --out docs/x\ntformer embed --checkpoint m > emb.jsonl 2>/dev/null\n"
    assert command_targets(code) == ["runs/report", "emb.jsonl"]


@pytest.mark.parametrize("path", [README, *PAGES], ids=relative)
def test_the_commands_write_only_under_ignored_paths(path: Path):
    targets = [t for _, code in blocks(path, "bash") for t in command_targets(code)]
    stray = [t for t in targets if not t.startswith(WRITABLE)]
    assert not stray, f"{relative(path)}: commands write outside runs/ (into the repository's tracked tree): {stray}"
    ignored = (ROOT / ".gitignore").read_text(encoding="utf-8").split()
    assert "runs/" in ignored


def paragraphs(markdown: str) -> list[str]:
    """The prose paragraphs of ``markdown``: code blocks, tables and headings left out, each list item on its own."""
    prose = FENCE.sub("", markdown)
    found = []
    for block in re.split(r"\n\s*\n", prose):
        lines = [line for line in block.splitlines() if not line.lstrip().startswith(("|", "#"))]
        item: list[str] = []
        for line in lines:
            if re.match(r"\s*([-*]|\d+\.)\s", line) and item:
                found.append(" ".join(item))
                item = []
            item.append(line.strip())
        if item:
            found.append(" ".join(item))
    return found


def test_paragraphs_are_split_at_blank_lines_and_list_items():
    text = "one two\nthree\n\n- a b\n- c\n\n```python\nx = 1\n```\n\n| t | u |\n"
    assert paragraphs(text) == ["one two three", "- a b", "- c"]


def test_the_readme_is_a_short_guide():
    text = README.read_text(encoding="utf-8")
    lines = text.count("\n")
    assert lines <= README_LINES, f"README.md has {lines} lines; at most {README_LINES}: move detail to docs/"
    long = [(len(p.split()), p[:80]) for p in paragraphs(text) if len(p.split()) > PARAGRAPH_WORDS]
    assert not long, f"README paragraphs over {PARAGRAPH_WORDS} words: {long}"


def test_benchmarks_holds_the_current_figures_only():
    lines = BENCHMARKS.read_text(encoding="utf-8").count("\n")
    assert lines <= BENCHMARKS_LINES, (
        f"BENCHMARKS.md has {lines} lines; at most {BENCHMARKS_LINES}: the history goes to dated files in docs/history/"
    )
    history = sorted((ROOT / "docs" / "history").glob("20*.md"))
    assert history, "docs/history/ holds no dated file"
    assert all(re.match(r"\d{4}-\d{2}-\d{2}-", p.name) for p in history), [p.name for p in history]


def test_the_readme_links_point_to_files_that_exist():
    text = FENCE.sub("", README.read_text(encoding="utf-8"))
    targets = [t.split("#", 1)[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)]
    missing = [t for t in targets if t and "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README links to paths that do not exist: {missing}"
