"""The ``evaluation`` experiment: tformer's scores set beside the published ones, the ARC mean and its standard error
combined as the card combines the sets, and a missing model reported rather than failed on."""

from __future__ import annotations

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
    r = evaluation.run(protocols=("lm-eval",), tasks=("arc_easy",), limit=2, sts=tmp_path / "none.csv")
    assert r.rows == [] and r.tables() == []
    assert r.findings()[0].startswith("not measured: ") and "STS-B: no file at" in r.findings()[0]
    (png,) = r.plot(tmp_path)
    assert png.is_file()
