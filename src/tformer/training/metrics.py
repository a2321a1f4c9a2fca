"""Loss curves: training and validation loss against step, read from ``metrics.jsonl``, drawn to a PNG.

Uses matplotlib's non-interactive Agg backend (no display needed). The PNG is written to a temporary file and
renamed, so an interrupted run never leaves half an image.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PLOT_FILE = "loss.png"  # drawn next to metrics.jsonl when the log closes


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (a torn last line from a crash is skipped)."""
    records = []
    path = Path(path)
    if not path.is_file():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def plot_loss(records: list[dict[str, Any]], png: str | os.PathLike, title: str = "") -> Path | None:
    """Draw ``loss`` (train) and ``val_loss`` records against ``step`` into ``png``; ``None`` if nothing to draw."""
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if not train and not val:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train, strict=True), label="train", linewidth=1.2, color="tab:blue")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation", linewidth=1.5, markersize=3, color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(title or "loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    tmp = png.with_name(f".{png.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp)
    os.replace(tmp, png)
    return png


class MetricsLog:
    """``OUT/metrics.jsonl``, one JSON record per line, flushed as written (rank 0 of a run writes it).

    On resume from step ``start`` the records of steps after it are dropped (they are redone), and so is the loss
    record of a stop between log boundaries (``mid_window``): the window it averaged goes on, and the next record
    covers the steps it would have.
    """

    def __init__(self, path: Path, *, start: int = 0, mid_window: bool = False) -> None:
        self.path = path
        kept = (
            [
                r
                for r in read_metrics(path)
                if r.get("step", 0) < start or (r.get("step") == start and not (mid_window and "loss" in r))
            ]
            if start
            else []
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, path)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115  (closed by close())

    def record(self, entry: dict[str, Any]) -> None:
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()

    def close(self, title: str) -> None:
        """Close the file and draw the loss plot next to it (:data:`PLOT_FILE`)."""
        self._file.close()
        plot_loss(read_metrics(self.path), self.path.parent / PLOT_FILE, title=title)
