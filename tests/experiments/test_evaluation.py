"""The ``evaluation`` experiment: tformer's scores set beside the published ones, the ARC mean and its standard error
combined as the card combines the sets, and a missing model reported rather than failed on."""

from __future__ import annotations

import json
import math

import pytest

from tformer.experiments import EXPERIMENTS, evaluation, run_experiment


def _needs_data() -> None:
    from tformer.evaluation import EvalError, data
    from tformer.interop import shipped

    pytest.importorskip("pyarrow", reason="the sets are Arrow files")
    try:
        data.data_root()
    except EvalError as err:
        pytest.skip(str(err))
    if not shipped.locate("smollm2").exists():
        pytest.skip(shipped.missing("smollm2"))


def test_evaluation_is_an_experiment_of_the_report():
    assert EXPERIMENTS["evaluation"] == "tformer.experiments.evaluation"
    figures = {(p.protocol, p.tasks, p.figure): p.value for p in evaluation.PUBLISHED}
    assert figures[("lighteval", ("arc_easy", "arc_challenge"), "acc_norm_nospace")] == 37.3
    assert figures[("lm-eval", ("hellaswag",), "acc_norm")] == 42.9


def test_the_arc_mean_is_the_mean_of_the_sets_with_their_errors_added_in_quadrature():
    results = {
        "tasks": {
            "arc_easy": {"figures": {"acc_norm_nospace": {"value": 0.5, "stderr": 0.03, "n": 100}}},
            "arc_challenge": {"figures": {"acc_norm_nospace": {"value": 0.3, "stderr": 0.04, "n": 50}}},
        }
    }
    arc = next(p for p in evaluation.PUBLISHED if len(p.tasks) == 2)
    row = evaluation._row(results, arc, seconds=3.0)
    assert row.value == pytest.approx(40.0) and row.examples == 150
    assert row.stderr == pytest.approx(100 * math.sqrt(0.03**2 + 0.04**2) / 2)  # SE(mean of 2) = sqrt(a^2 + b^2) / 2
    assert row.distance == pytest.approx((40.0 - 37.3) / row.stderr)


def test_quick_scores_each_published_figure_it_has_the_sets_for(tmp_path):
    _needs_data()
    r = run_experiment("evaluation", "quick")
    shown = {(row.published.protocol, row.label) for row in r.rows}
    assert shown == {
        ("lighteval", "arc (mean of easy, challenge)"),
        ("lm-eval", "arc_easy"),
        ("lm-eval", "arc_challenge"),
    }
    for row in r.rows:
        assert 0 <= row.value <= 100 and row.stderr >= 0 and row.examples == 6 * len(row.published.tasks)
    (table,) = r.tables()
    assert len(table.rows) == 3 and "first 6 examples" in table.title
    assert r.findings()[0].startswith(f"{sum(abs(x.distance) <= 2 for x in r.rows)} of 3 published figures")
    (png,) = r.plot(tmp_path)
    assert png.name == "evaluation.png" and png.stat().st_size > 0


def test_a_missing_model_is_reported_not_raised(monkeypatch, tmp_path):
    from tformer.interop import shipped

    monkeypatch.setattr(shipped, "locate", lambda name: tmp_path / "absent")
    r = evaluation.run(protocols=("lm-eval",), tasks=("arc_easy",), limit=2, sts=tmp_path / "none.csv", full=None)
    assert r.rows == [] and r.tables() == []
    assert r.findings()[0].startswith("not measured: ") and "STS-B: no file at" in r.findings()[0]
    (png,) = r.plot(tmp_path)
    assert png.is_file()


def _entry(protocol: str, task: str, figure: str, value: float, stderr: float, n: int, hf: float | None = None):
    entry = {
        "protocol": protocol,
        "task": task,
        "n": n,
        "seconds": 10.0,
        "figures": {"acc": [0.25, 0.01], figure: [value, stderr]},
        "cpu": "a CPU",
        "date": "2026-12-07",
    }
    if hf is not None:
        figures = {"acc": 0.25, figure: hf}
        entry["transformers"] = {
            "figures": figures,
            "seconds": 30.0,
            "max_abs_dll": 1e-4,
            "argmax_differs": 2,
            "scorer": "HFLM" if task == "arc_easy" else "cache",
        }
    return entry


def test_the_full_sets_are_read_from_the_benchmarks_record(tmp_path):
    path = tmp_path / "results" / "full.json"
    evaluation.record_full_set(path, _entry("lighteval", "arc_easy", "acc_norm_nospace", 0.9, 0.01, 100, hf=0.0))
    evaluation.record_full_set(path, _entry("lighteval", "arc_challenge", "acc_norm_nospace", 0.3, 0.04, 50, 0.3))
    evaluation.record_full_set(path, _entry("lighteval", "arc_easy", "acc_norm_nospace", 0.5, 0.03, 100, hf=0.52))
    evaluation.record_full_set(path, _entry("lm-eval", "piqa", "acc_norm", 0.6, 0.02, 80))
    assert [p.name for p in path.parent.iterdir()] == ["full.json"]  # the temporary file renamed, none left
    sets = [(r["protocol"], r["task"]) for r in json.loads(path.read_text())["rows"]]
    assert sets == [("lighteval", "arc_challenge"), ("lighteval", "arc_easy"), ("lm-eval", "piqa")]

    wanted = [p for p in evaluation.PUBLISHED if p.protocol == "lighteval" or "piqa" in p.tasks]
    rows, missing = evaluation.full_rows(path, wanted)
    assert missing == ["lighteval hellaswag", "lighteval piqa", "lighteval mmlu"]
    arc, piqa = rows
    assert arc.label == "arc (mean of easy, challenge)" and arc.examples == 150 and arc.seconds == 20.0
    assert arc.value == pytest.approx(40.0)  # the second arc_easy entry replaced the first
    assert arc.stderr == pytest.approx(100 * math.sqrt(0.03**2 + 0.04**2) / 2)
    assert arc.transformers == pytest.approx(41.0) and arc.transformers_seconds == 60.0 and arc.argmax_differs == 4
    assert piqa.published.protocol == "lm-eval" and piqa.value == pytest.approx(60.0) and piqa.transformers is None

    result = evaluation.EvaluationResult(limit=200, full=rows)
    (table,) = result.tables()
    assert table.title.startswith("The full sets, recorded by benchmarks/eval.py --full on a CPU (transformers")
    cells = dict(zip(table.columns, table.rows[1], strict=True))
    assert cells["transformers (%)"] == "not run" and cells["tformer (%)"] == "60.00 ± 2.00"
    assert cells["(ours - pub) / SE"] == f"{(60.0 - 66.8) / 2.0:+.2f}"
    assert dict(zip(table.columns, table.rows[0], strict=True))["transformers (%)"] == "41.00 (HFLM + cache)"
    (line,) = result.findings()
    assert "1 of 2 published figures within 2 standard errors" in line and "from -6.80 to +2.70 points" in line
    assert "the same figure on 0 of the 1 it ran on, 4 questions" in line


def test_a_record_that_is_not_one_is_named_with_the_fix(tmp_path):
    path = tmp_path / "full.json"
    path.write_text('{"rows": [{"protocol": "lm-eval"}]}')
    with pytest.raises(ValueError, match=r"full\.json is not a record of benchmarks/eval\.py --full --record"):
        evaluation.full_rows(path, list(evaluation.PUBLISHED))
    with pytest.raises(ValueError, match="needs n, seconds, figures, cpu, date"):
        evaluation.record_full_set(path, {"protocol": "lm-eval", "task": "piqa"})
    assert path.read_text() == '{"rows": [{"protocol": "lm-eval"}]}'


def test_the_full_sets_are_shown_without_the_model(monkeypatch, tmp_path):
    from tformer.interop import shipped

    path = tmp_path / "full.json"
    evaluation.record_full_set(path, _entry("lm-eval", "arc_easy", "acc", 0.5, 0.01, 100, hf=0.5))
    monkeypatch.setattr(shipped, "locate", lambda name: tmp_path / "absent")
    r = evaluation.run(protocols=("lm-eval",), tasks=("arc_easy", "piqa"), limit=2, sts=None, full=path)
    assert r.rows == [] and [row.label for row in r.full] == ["arc_easy"]
    assert r.findings()[0].startswith("full sets (recorded): 0 of 1 published figures within 2 standard errors")
    assert f"skipped: full set of lm-eval piqa: not in {path} yet" in r.findings()
    (png,) = r.plot(tmp_path)
    assert png.is_file()
    absent = evaluation.run(protocols=("lm-eval",), tasks=("arc_easy",), limit=2, sts=None, full=tmp_path / "no.json")
    assert absent.full == [] and "full sets: no record at" in absent.findings()[0]
