"""The ``circuits`` experiment: induction heads found, ablated against random heads, and direct logit attribution.

On a model whose induction circuit is set by hand (:func:`circuits.planted_model`) the statistics must find the
planted head, the ablation must separate it from random heads, and the attribution must credit it; on the real
SmolLM2 (slow) the published finding must hold.
"""

from __future__ import annotations

import re

import pytest
import torch

from tformer.circuits import ablate_heads, induction_scores, repeated_loss
from tformer.experiments import EXPERIMENTS, circuits, run_experiment


@pytest.fixture(scope="module")
def quick() -> circuits.CircuitsResult:
    return run_experiment("circuits", "quick")


def test_circuits_is_an_experiment_of_the_report():
    assert EXPERIMENTS["circuits"] == "tformer.experiments.circuits"
    assert circuits.SIZES["quick"]["models"] == ("toy",)


def test_the_planted_model_holds_one_induction_head():
    model = circuits.planted_model()
    gen = torch.Generator().manual_seed(3)
    half = torch.stack([torch.randperm(63, generator=gen)[:12] + 1 for _ in range(8)])  # no token twice in a row
    ids = torch.cat([torch.zeros(8, 1, dtype=torch.long), half, half], dim=1)  # BOS 0, then the tokens twice
    scores = induction_scores(model, ids, 12, prefix=1)  # (L, H)
    assert tuple(scores.shape) == (2, 8)
    assert float(scores[1, 0]) > 0.99
    scores[1, 0] = 0.0
    assert float(scores.max()) < 0.1  # the previous-token head and the zero heads attend elsewhere
    clean = repeated_loss(model, ids, 12, prefix=1)
    assert clean < 0.01
    assert repeated_loss(model, ids, 12, 1, ablate_heads(model, [(1, 0)])) > clean + 3.0  # ln 64 = 4.16: chance
    assert repeated_loss(model, ids, 12, 1, ablate_heads(model, [(0, 0)])) > clean + 3.0  # its previous-token head
    assert repeated_loss(model, ids, 12, 1, ablate_heads(model, [(0, 3), (1, 5)])) == pytest.approx(clean, abs=1e-5)


def test_quick_finds_the_planted_head_and_separates_it_from_random_heads(quick):
    (toy,) = quick.models
    assert toy.name == "toy" and not toy.skipped
    assert len(toy.scores) == 2 and all(len(row) == 8 for row in toy.scores)
    assert toy.ranked()[0][:2] == (1, 0) and toy.ranked()[0][2] > 0.8
    assert toy.clean_loss < 0.6 < 3.0 < toy.first_loss
    assert [(a.kind, a.k) for a in toy.ablations] == [("zero", 1), ("zero", 2), ("mean", 1), ("mean", 2)]
    for a in toy.ablations:
        assert len(a.random) == 10
        assert a.random_mean == pytest.approx(sum(a.random) / 10)
        assert a.top - toy.clean_loss > 3.0
        assert a.top - toy.clean_loss > 3 * (a.random_mean - toy.clean_loss)
        # a random draw that holds L1H0 (or L0H0) is as bad; one that holds neither changes nothing
        assert min(a.random) == pytest.approx(toy.clean_loss, abs=1e-5)
        assert max(a.random) >= a.top - 1e-5 or a.kind == "mean"


def test_quick_attribution_credits_the_planted_head_and_sums_to_the_logit(quick):
    at = quick.models[0].attribution
    assert at.rank == 1 and at.prob > 0.99
    assert at.labels[at.top(1)[0]] == "L1H0"
    assert at.diff[at.labels.index("L1H0")] == pytest.approx(at.model_diff, rel=1e-3)
    assert sum(at.logit) == pytest.approx(at.model_logit, abs=1e-4 * abs(at.model_logit))
    assert sum(at.diff) == pytest.approx(at.model_diff, abs=1e-4 * abs(at.model_diff))
    assert {"embed", "pos_embed", "L0.mlp", "L1.mlp"} <= set(at.labels)


def test_quick_tables_findings_and_figure(quick, tmp_path):
    heads, ablation, dla = quick.tables()
    assert heads.columns == ("model", "rank", "head", "induction score") and len(heads.rows) == circuits.TOP_HEADS
    assert heads.rows[0][2] == "L1H0"
    assert len(ablation.rows) == 4 and ablation.columns[-1] == "rise top / rise random"
    assert len(dla.rows) == circuits.TOP_COMPONENTS + 2 and dla.rows[0][1] == "L1H0"
    findings = quick.findings()
    assert re.match(
        r"toy \(2 layers x 8 heads, .*\): the top induction head is L1H0 \(score 0\.[89]\d; the next 0\.0\d\)",
        findings[0],
    )
    assert "sum to the model's own values within" in findings[-1]
    (png,) = quick.plot(tmp_path)
    assert png.name == "circuits.png" and png.stat().st_size > 1000


def test_the_same_seed_draws_the_same_heads():
    again = circuits.run(models=("toy",), batch=2, length=8, ks=(2,), draws=4, kinds=("zero",), seed=5)
    other = circuits.run(models=("toy",), batch=2, length=8, ks=(2,), draws=4, kinds=("zero",), seed=5)
    assert again.models[0].ablations == other.models[0].ablations


def test_a_missing_demo_checkpoint_is_skipped_with_the_way_to_make_it(tmp_path):
    result = circuits.run(models=("demo",), batch=2, length=8, ks=(1,), draws=2, demo_path=tmp_path / "none")
    (demo,) = result.models
    assert demo.skipped and "make demo" in demo.skipped and str(tmp_path / "none") in demo.skipped
    assert result.findings() == [f"demo: not measured: {demo.skipped}"]
    assert result.tables() == []
    assert result.plot(tmp_path)[0].is_file()
    with pytest.raises(ValueError, match="unknown model 'gpt9'"):
        circuits.run(models=("gpt9",))


@pytest.mark.slow
def test_smollm2_induction_heads_matter_far_more_than_random_heads():
    result = circuits.run(models=("smollm2",), batch=4, length=50, ks=(5,), draws=10, kinds=("zero",))
    (m,) = result.models
    if m.skipped:
        pytest.skip(m.skipped)
    assert m.ranked()[0][2] > 0.5  # a head that attends to the induction target more than half the time
    assert m.clean_loss < m.first_loss - 3.0  # the repeat is predicted from the first half
    (a,) = m.ablations
    assert a.top - m.clean_loss > 3 * (a.random_mean - m.clean_loss)
    at = m.attribution
    assert at.token == " Paris" and at.rank == 1 and at.model_diff > 0
    assert sum(at.logit) == pytest.approx(at.model_logit, abs=1e-3 * abs(at.model_logit))
    assert sum(at.diff) == pytest.approx(at.model_diff, abs=1e-3 * max(1.0, abs(at.model_diff)))
