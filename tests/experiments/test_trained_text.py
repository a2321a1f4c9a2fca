"""The text the trained-weights section measures on: the English paragraph (:data:`trained.TEXT`) wherever the
tokenizer encodes it, and for a char tokenizer that lacks some of its characters (a ``--task`` model's digits) a
seeded probe of the tokenizer's own characters, named in the section."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.experiments.test_report import tiny_run
from tformer import EncoderDecoder, TransformerConfig
from tformer.cli import main
from tformer.experiments import trained
from tformer.tokenizers import SEQ2SEQ_SPECIALS, ByteTokenizer, CharTokenizer
from tformer.training.checkpoint import load_checkpoint, save_checkpoint
from tformer.training.tasks import SequenceTask


def task_run(out: Path, task: str = "reverse") -> Path:
    """A run shaped as ``tformer train --task TASK`` writes it: an encoder-decoder whose char tokenizer is the
    task's alphabet (unknown characters are an error), untrained."""
    tok = CharTokenizer(SequenceTask(task).alphabet, SEQ2SEQ_SPECIALS, unknown="error")
    torch.manual_seed(0)
    model = EncoderDecoder(TransformerConfig.tiny(vocab_size=tok.vocab_size))
    save_checkpoint(out, model=model, tokenizer=tok, kind="seq2seq", step=1, train_config={"task": task})
    return out


@pytest.mark.parametrize("task", ["reverse", "add"])
def test_a_task_checkpoint_is_measured_on_a_probe_of_its_own_characters(tmp_path, task):
    path = task_run(tmp_path / task, task)
    alphabet = SequenceTask(task).alphabet
    result = trained.run(path, seq_len=32)
    assert result.text == trained.probe_text(alphabet) != trained.TEXT
    assert set(result.text) <= set(alphabet) and len(result.text) == len(trained.TEXT)
    assert result.probe_reason.startswith(f"its char tokenizer ({len(alphabet)} characters) lacks ")
    assert result.tokens == 32 and result.family == "tformer seq2seq"
    assert len(result.layers) == 2  # the encoder's self-attention layers
    for layer in result.layers:
        values = [layer.var_raw, layer.var_scaled, layer.var_q, layer.var_k, *layer.entropy]
        assert all(math.isfinite(v) for v in values) and layer.var_scaled > 0
        assert abs(layer.var_raw / layer.var_scaled - result.head_dim) < 1e-9
        assert len(layer.entropy) == 4 and all(0 <= h <= 1 + 1e-9 for h in layer.entropy)
    assert len(result.grad_norms) == 2 and all(math.isfinite(g) and g > 0 for g in result.grad_norms)
    assert result.objective == "1 - cos of the two halves' mean-pooled embeddings"
    assert result.findings()[-1] == (
        f"measured on a probe text, not the English paragraph, as {result.probe_reason}: 32 of the tokenizer's own "
        f"characters drawn uniformly (seed 0), {result.text[:32]!r}"
    )
    assert result.tables()[0].title.endswith("per layer (32 tokens of a probe text)")
    again = trained.run(path, seq_len=32)  # a fixed seed: the same tokens, the same figures
    assert again.text == result.text and again.layers == result.layers and again.grad_norms == result.grad_norms


@pytest.mark.subprocess
def test_a_task_checkpoint_gets_its_report_section(tmp_path, monkeypatch, capsys):
    """The new user's commands (``tformer train --task reverse``, then ``report --only trained``) exit 0."""
    monkeypatch.chdir(tmp_path)
    task_run(Path("x/rev"))
    assert main(["report", "--quick", "--only", "trained", "--checkpoint", "x/rev", "--out", "x/r4"]) == 0
    page = Path("x/r4/report.md").read_text()
    assert "## Trained: The claims on trained weights: rev" in page and "**rev: per layer (32 tokens of a probe" in page
    assert "- measured on a probe text, not the English paragraph, as its char tokenizer (10 characters) lacks " in page
    assert "(the first: 'T'): 32 of the tokenizer's own characters drawn uniformly (seed 0), '" in page
    assert Path("x/r4/trained-rev.png").is_file()
    assert "error" not in capsys.readouterr().err


def test_a_byte_lm_is_still_measured_on_the_paragraph(tmp_path):
    """The figures are those of the paragraph's first tokens, as before the probe existed."""
    path = tiny_run(tmp_path / "lm")
    result = trained.run(path, seq_len=32)
    assert result.text == trained.TEXT and result.probe_reason == "" and result.tokens == 32
    assert result.findings()[-1] == "measured on the first 32 tokens of the English paragraph (trained.TEXT)"
    assert result.tables()[0].title.endswith("per layer (32 tokens of the paragraph)")

    model = load_checkpoint(path).model.float().eval()
    ids = torch.tensor([ByteTokenizer().encode(trained.TEXT)[:32]])
    with torch.no_grad():
        calls = trained._capture(model, lambda: model(ids))
    assert result.layers == [trained._layer_stats(m, x, mask, causal) for m, x, mask, causal in calls]
    assert result.grad_norms == trained._grad_norms(model, ids)[0]


@pytest.mark.parametrize("unknown", ["unk", "skip", "error"])
def test_a_char_tokenizer_gets_the_paragraph_only_when_it_knows_every_character(unknown):
    every = CharTokenizer.train([trained.TEXT], unknown=unknown)
    assert trained.choose_text(every) == (trained.TEXT, "")
    chars = [c for c in every.chars if c != ";"]  # one character short: read as <unk>, skipped or refused
    text, reason = trained.choose_text(CharTokenizer(chars, unknown=unknown))
    assert text == trained.probe_text(chars) and set(text) <= set(chars)
    assert reason == (
        f"its char tokenizer ({len(chars)} characters) lacks 1 of the paragraph's {len(chars) + 1} characters (the "
        "first: ';')"
    )
    assert trained.choose_text(ByteTokenizer()) == (trained.TEXT, "")


def test_the_probe_is_fixed_by_its_seed_and_needs_a_character():
    assert trained.probe_text("ab", 20) == trained.probe_text("ab", 20) != trained.probe_text("ab", 20, seed=1)
    assert set(trained.probe_text("ab", 200)) == {"a", "b"}  # uniform: both drawn
    assert trained.probe_text("a", 5) == "aaaaa"
    with pytest.raises(ValueError, match="needs at least one character"):
        trained.probe_text("", 5)
