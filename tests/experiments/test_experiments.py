"""The experiments of ``tformer experiment`` / ``tformer report``: at tiny sizes each one's data shows its claim.

Every test asserts numbers; the tolerances are stated next to them with the figure they guard.
"""

import math
import re

import pytest
import torch

from tformer import MultiHeadAttention
from tformer.cli import main
from tformer.experiments import (
    EXPERIMENTS,
    attention_maps,
    complexity,
    fit_power_law,
    layernorm,
    load,
    masking,
    mha_params,
    positions,
    run_experiment,
    saturation,
    scaling,
)
from tformer.experiments._common import Table, layer_attention_probs


def test_fit_power_law_recovers_exponents():
    n = [128, 256, 512, 1024]
    assert fit_power_law(n, [3.0 * x**2 for x in n]) == pytest.approx(2.0, abs=1e-12)
    assert fit_power_law(n, [0.5 * x + 0 * x for x in n]) == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(ValueError, match="positive"):
        fit_power_law(n, [0.0, 1.0, 2.0, 3.0])


def test_unknown_experiment_lists_the_known_ones():
    with pytest.raises(ValueError, match="known experiments: scaling, saturation"):
        load("nope")
    with pytest.raises(ValueError, match="unknown size"):
        run_experiment("scaling", "huge")


def test_every_experiment_states_its_claim_and_sizes():
    for name in EXPERIMENTS:
        module = load(name)
        assert module.QUESTION.startswith("Q") and module.CLAIM and module.TITLE
        assert set(module.SIZES) == {"quick", "report"}
        assert "Claim" in module.__doc__ and "Measured" in module.__doc__


def test_layer_attention_probs_reproduce_the_layer_output():
    """The recomputed weights, applied to the layer's values and output projection, give the layer's output."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).double()
    x, ctx = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 7, 16, dtype=torch.float64)
    for context, causal in ((None, True), (ctx, False)):
        probs = layer_attention_probs(mha, x, context, is_causal=causal)  # (B, H, T, S)
        v = torch.nn.functional.linear(
            x if context is None else context, mha.in_proj.weight[32:], mha.in_proj.bias[32:]
        )
        v = v.view(2, -1, 4, 4).transpose(1, 2)  # (B, S, C) -> (B, H, S, D)
        out = mha.out_proj((probs @ v).transpose(1, 2).reshape(2, 5, 16))
        torch.testing.assert_close(out, mha(x, context, is_causal=causal), rtol=1e-12, atol=1e-12)


def test_scaling_slopes_are_one_zero_minus_one():
    r = scaling.run(dims=(4, 16, 64, 256), num_queries=64, num_keys=64)
    # 4096 logits per d_k: each variance is within a few % of its expectation, so slopes within 0.05
    assert r.slopes["raw (scale 1)"] == pytest.approx(1.0, abs=0.05)
    assert r.slopes["1/sqrt(d_k)"] == pytest.approx(0.0, abs=0.05)
    assert r.slopes["1/d_k"] == pytest.approx(-1.0, abs=0.05)
    assert all(0.85 < v < 1.15 for v in r.variances["1/sqrt(d_k)"])


def test_saturation_jacobian_vanishes_and_unscaled_attention_collapses():
    r = saturation.run(sigmas=(1.0, 4.0, 16.0, 64.0), dims=(8, 256), num_rows=64, seq_len=32)
    # beyond the peak (logit std ~ 3-4) the Jacobian norm and the logit gradient fall with the logit scale
    assert r.jacobian_norm[1] > r.jacobian_norm[2] > r.jacobian_norm[3]
    assert r.jacobian_norm[3] < 0.25 * r.jacobian_norm[0]
    assert r.logit_grad_norm[3] < 0.25 * r.logit_grad_norm[0]
    assert r.max_prob[3] > 0.95  # saturated: one weight takes nearly everything
    # an untrained layer: with 1/sqrt(d_k) attention stays near uniform; without, it collapses at large d_k
    assert r.entropy_scaled[-1] > 0.9 * math.log(32)
    assert r.entropy_unscaled[-1] < 0.5 * r.entropy_scaled[-1]
    # the layer's Jacobians, read against the claim: which is smaller decides the words
    reading = r.findings()[-1]
    smaller = r.jacobian_unscaled[-1] < r.jacobian_scaled[-1]
    assert reading.endswith(": unscaled, the smaller, as the claim says") == smaller
    assert ("against the claim at this size" in reading) == (not smaller)
    r.jacobian_unscaled[-1] = 2 * r.jacobian_scaled[-1]  # as at the report's sizes: past the peak, not saturated
    assert r.findings()[-1].endswith("(the sweep's norm falls below its std-1 value only past std 16)")


def test_complexity_reference_memory_grows_faster_than_fused():
    """Peak memory from the allocator's accounting (exact, the same on a busy machine): the reference holds
    (B, H, n, n) float32 score and weight tensors at its peak (measured 3 of them, 192 MiB at n = 2048), so its
    exponent is 2; SDPA needs its output plus per-call buffers that grow with n (exponent 1)."""
    r = complexity.run(sizes=(512, 1024, 2048), backends=["reference", "sdpa"], heads=4, repeats=1)
    assert r.memory_exponent["reference"] > 1.5
    assert abs(r.memory_exponent["reference"] - 2) < 0.05 and abs(r.memory_exponent["sdpa"] - 1) < 0.1
    assert r.peak_mib["reference"][-1] > 2 * r.score_matrix_mib(2048)
    for n, peak in zip(r.sizes, r.peak_mib["sdpa"], strict=True):  # O(n): a few output-sized buffers at every n
        output_mib = r.batch * r.heads * n * r.head_dim * 4 / 2**20
        assert output_mib <= peak < 3 * output_mib + 1.0, (n, peak)
    assert r.peak_mib["reference"][-1] > 10 * r.peak_mib["sdpa"][-1]
    assert r.max_abs_error["sdpa"] < 1e-4
    assert all(t > 0 for ts in r.seconds.values() for t in ts)


def test_mha_params_are_four_d_model_squared_for_every_head_count():
    r = mha_params.run(d_models=(32, 64), max_heads=32)
    assert r.heads[64] == [1, 2, 4, 8, 16, 32]
    for d in (32, 64):
        assert r.weights[d] == [4 * d * d] * len(r.heads[d])
        assert r.with_bias[d] == [4 * d * d + 4 * d] * len(r.heads[d])
        assert all(per == {"W^Q": d * d, "W^K": d * d, "W^V": d * d, "W^O": d * d} for per in r.per_matrix[d])
    assert r.all_equal_4d2()


def test_positions_rotation_and_rope_relative_invariance():
    r = positions.run(num_positions=128, d_model=32, offsets=(1, 7, 100), rope_dim=16, rope_positions=24)
    assert max(r.rotation_error_f64) < 1e-12  # machine precision (float64 eps ~ 2.2e-16, angles up to ~128)
    assert max(r.rotation_error_f32) < 1e-5
    assert max(r.rope_spread_f64.values()) < 1e-12 * r.score_scale * 100
    assert r.absolute_spread > 1.0  # absolute codes are not a function of n - m
    with pytest.raises(ValueError, match="offsets"):
        positions.run(num_positions=10, offsets=(10,))


def test_masking_before_softmax_never_leaks_after_softmax_does():
    r = masking.run(seq_len=8, d_model=16)
    assert r.leakage[masking.BEFORE] == 0.0  # exactly: masked weights are exp(-inf) = 0
    assert all(v == 0.0 for k, v in r.leakage.items() if k.startswith("library"))
    assert r.leakage[masking.AFTER] > 1e-3
    assert r.leakage[masking.RENORM] < 1e-13  # renormalised: only rounding differs
    assert max(abs(s - 1) for s in r.row_sums[masking.BEFORE]) < 1e-12
    assert min(r.row_sums[masking.AFTER]) < 0.99


def test_layernorm_gradients_at_init_have_the_documented_direction():
    r = layernorm.run(depths=(6, 12), train_depths=(2,), steps=15, warmup_steps=5)
    assert all(len(r.grad_norms[p][d]) == d for p in ("Pre-LN", "Post-LN") for d in (6, 12))
    # as measured in tests/core/test_layers.py at 12 layers: Post-LN ~1.7, Pre-LN ~0.43, top-layer ratio ~6.6
    assert r.top_over_bottom("Post-LN", 12) > 1.3
    assert r.top_over_bottom("Pre-LN", 12) < 0.8
    assert r.post_over_pre_top(12) > 3
    assert r.top_over_bottom("Pre-LN", 6) < 1 < r.top_over_bottom("Post-LN", 6)
    for key, curve in r.curves.items():
        assert len(curve) == 15 and all(math.isfinite(v) for v in curve), key
        assert curve[-1] < curve[0], key  # ~4.9 (uniform over 128 characters) falls within 15 steps


def test_attention_maps_cross_attention_learns_the_anti_diagonal():
    r = attention_maps.run(steps=1000, max_len=6, d_model=32, num_heads=2, num_layers=1, d_ff=64, held_out=200)
    assert r.cross.shape == (1, 2, 7, 6) and r.decoder_self.shape == (1, 2, 7, 7)
    assert max(max(heads) for heads in r.anti_diagonal) > 0.5  # measured ~0.95 for the best head
    assert r.best_anti_diagonal > 2 / 6  # heads averaged, twice uniform (measured ~0.69)
    assert r.decoder_future_mass == 0.0
    assert r.cross_context_error == 0.0  # keys and values come from the encoder output itself
    torch.testing.assert_close(r.cross.sum(-1), torch.ones(1, 2, 7), rtol=1e-5, atol=1e-5)


def test_anti_diagonal_mass_of_a_perfect_reversal_is_one():
    S = 5
    perfect = torch.zeros(S + 1, S)
    perfect[torch.arange(S), S - 1 - torch.arange(S)] = 1.0
    assert float(attention_maps.anti_diagonal_mass(perfect)) == 1.0


def test_table_markdown_escapes_pipes():
    text = Table(("a", "b"), (("x|y", "1"),), "t").markdown()
    assert "x\\|y" in text and text.count("\n") == 4


def test_cli_experiment_prints_a_table_and_writes_a_png(tmp_path, capsys):
    assert main(["experiment", "scaling", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| d_k" in out and "fitted slope" in out
    assert (tmp_path / "scaling.png").stat().st_size > 1000
    assert main(["experiment", "nope"]) == 2
    assert "known experiments: scaling" in capsys.readouterr().err


@pytest.mark.subprocess
def test_cli_report_quick_writes_report_referencing_existing_pngs(tmp_path, capsys):
    assert main(["report", "--quick", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert len(images) == len(EXPERIMENTS)
    assert all((tmp_path / image).is_file() for image in images)
    for name in EXPERIMENTS:
        assert load(name).CLAIM in report
    assert report.count("\n## Q") == len(EXPERIMENTS)
    assert f"\n    tformer report --quick --out {tmp_path.name}\n" in report  # every experiment: no --only to rerun it
