"""Fine-tuning (``init_from`` / ``tformer train --init-from``): a run starts from another model's architecture,
weights and tokenizer (a tformer run, or a GGUF file read by the interop code), resumes exactly, and refuses what
would not be that model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import TINY_MODEL
from tests.interop.gguf_files import write_llama_gguf
from tests.interop.hf_models import tiny_hf
from tformer import load_pretrained
from tformer.cli import main
from tformer.config import ConfigError
from tformer.training import TrainConfig, train
from tformer.training.checkpoint import load_checkpoint

TEXT = "the cat sat on the mat. the dog sat on the log. a cat and a dog met on a mat by a log.\n" * 40
LR = 1e-6


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "cache"))  # token caches and the GGUF conversion
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture
def source_run(corpus, tmp_path):
    """A tformer LM run (learned positions, 16 of them; its own BPE tokenizer)."""
    cfg = TrainConfig(
        out=str(tmp_path / "source"), data=str(corpus), steps=2, tokenizer="bpe", vocab_size=300, model=TINY_MODEL,
        block_size=16, batch_size=4, progress=False, eval_every=0, warmup=0,
    )  # fmt: skip
    train(cfg)
    return tmp_path / "source"


@pytest.fixture
def source_gguf(tmp_path):
    """A tiny Llama GGUF file with its tokenizer (rotary positions; Hugging Face's tokenizer)."""
    return write_llama_gguf(tmp_path / "tiny.gguf", tiny_hf("llama-tied", seed=1))


def finetune(corpus, out, start, **changes) -> TrainConfig:
    settings = dict(
        out=str(out), data=str(corpus), init_from=start, steps=2, lr=LR, min_lr=0.0, warmup=0,  # a Path init_from
        block_size=16, batch_size=4, progress=False, eval_every=0,
    )  # fmt: skip
    return TrainConfig(**{**settings, **changes})


def source_model(path):
    if path.suffix == ".gguf":
        pretrained = load_pretrained(path, dtype=torch.float32)
        return pretrained.model, pretrained.tokenizer
    ckpt = load_checkpoint(path)
    return ckpt.model, ckpt.tokenizer


@pytest.mark.parametrize("source", ["source_run", "source_gguf"])
def test_a_run_starts_from_the_models_weights_and_tokenizer(corpus, tmp_path, request, source):
    path = request.getfixturevalue(source)
    model, tokenizer = source_model(path)
    result = train(finetune(corpus, tmp_path / "ft", path))
    # the starting model's loss on the new data first (step 0); lr 1e-6 barely moves it by step 2
    assert set(result.val_losses) == {0, 2} and abs(result.val_losses[0] - result.val_losses[2]) < 1e-3
    run = load_checkpoint(tmp_path / "ft")
    assert run.config == model.cfg and run.step == 2
    assert run.tokenizer.encode("the cat met a dog") == tokenizer.encode("the cat met a dog")
    start, now = model.state_dict(), run.model.state_dict()
    assert start.keys() == now.keys()
    moved = max((now[k].float() - start[k].float()).abs().max().item() for k in start)
    # two AdamW steps of lr move a weight by at most ~2 lr (|m/sqrt(v)| <= 1 at these steps) plus the decay's
    # lr * 0.1 * |w|: a fresh model would be O(1) away; and the steps did move the weights
    assert 0 < moved <= 3 * LR


def test_a_finetuning_run_resumes_exactly(corpus, tmp_path, source_gguf):
    straight = train(finetune(corpus, tmp_path / "straight", source_gguf, steps=3, lr=1e-3))
    train(finetune(corpus, tmp_path / "split", source_gguf, steps=3, lr=1e-3, stop_after=1))
    source_gguf.rename(tmp_path / "moved.gguf")  # a resumed run reads its own checkpoint, not the starting model
    resumed = train(finetune(corpus, tmp_path / "split", source_gguf, steps=3, lr=1e-3, resume=True))
    assert resumed.step == straight.step == 3 and resumed.losses[3] == straight.losses[3]
    split, whole = (load_checkpoint(tmp_path / d).model.state_dict() for d in ("split", "straight"))
    assert all(torch.equal(split[k], whole[k]) for k in whole)


def test_dropout_may_change_and_the_shape_and_tokenizer_may_not(corpus, tmp_path, source_run):
    train(finetune(corpus, tmp_path / "ft", source_run, model={"dropout": 0.2}))
    assert load_checkpoint(tmp_path / "ft").config.dropout == 0.2
    refusals = [
        ({"model": {"d_model": 64}}, r"^--d-model: the model's shape comes from --init-from; leave it out$"),
        ({"tokenizer": "char", "vocab_size": 9}, r"^--tokenizer, --vocab-size: the tokenizer comes from --init-from; "),
        ({"block_size": 32}, r"^block_size=32 is longer than the 16 learned positions of --init-from .*source; use "),
        ({"init_from": str(tmp_path / "none")}, r"^init_from .*none does not exist \(--init-from\); give a tformer"),
    ]
    for changes, message in refusals:
        with pytest.raises(ConfigError, match=message):
            train(finetune(corpus, tmp_path / "bad", source_run, **changes))
        assert not (tmp_path / "bad").exists()
    with pytest.raises(ConfigError, match="init re-initializes a fresh model; init_from starts from a model's"):
        train(finetune(corpus, tmp_path / "bad", source_run), init=lambda model: None)


def test_the_cli_refuses_an_encoder_and_a_seq2seq_run_in_one_line(corpus, tmp_path, capsys, minilm_dir):
    out = str(tmp_path / "bad")
    assert main(["train", "--out", out, "--data", str(corpus), "--init-from", str(minilm_dir)]) == 2
    assert capsys.readouterr().err == (
        f"tformer train: error: --init-from {minilm_dir} holds an encoder (a BERT model); a language-model run "
        "(--data) starts from a decoder-only language model (GPT-2, Llama, Qwen2, Mistral or a tformer LM run)\n"
    )
    assert main(["train", "--out", out, "--task", "reverse", "--init-from", str(minilm_dir)]) == 2
    assert "--init-from does not apply to --task runs" in capsys.readouterr().err
    for flags in (["--tokenizer", "byte"], ["--vocab-size", "500", "--unknown", "skip"]):  # even at a default
        assert main(["train", "--out", out, "--data", str(corpus), "--init-from", str(minilm_dir), *flags]) == 2
        named, them = ", ".join(flags[::2]), "them" if len(flags) > 2 else "it"
        assert capsys.readouterr().err == (
            f"tformer train: error: {named}: the tokenizer comes from --init-from; leave {them} out\n"
        )
    assert not (tmp_path / "bad").exists()


def test_a_converted_run_is_not_resumed_but_fine_tuned(corpus, tmp_path, capsys, source_gguf):
    run = tmp_path / "converted"
    assert main(["convert", str(source_gguf), "--out", str(tmp_path / "hf")]) == 0  # GGUF -> Hugging Face
    assert main(["convert", str(tmp_path / "hf"), "--out", str(run)]) == 0  # Hugging Face -> a tformer run
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--steps", "3"]) == 2
    assert capsys.readouterr().err == (
        f"tformer train: error: --resume: {run}/checkpoints/step-000000 holds weights only (no optimizer state; e.g. "
        "written by tformer convert): there is no training run to continue; to train the model further, start a run "
        f"from it (--init-from {run})\n"
    )
    train(finetune(corpus, tmp_path / "ft", run, steps=1))
    assert load_checkpoint(tmp_path / "ft").config == load_checkpoint(run).config


@pytest.mark.subprocess
def test_the_command_line_fine_tunes_a_gguf_file_in_a_fresh_interpreter(corpus, tmp_path, source_gguf):
    # a new process has not imported tformer.interop (import tformer is lazy): the reader must be found anyway
    out = tmp_path / "ft"
    flags = ["--block-size", "16", "--batch-size", "2", "--steps", "1", "--warmup", "0", "--no-progress"]
    command = ["train", "--out", str(out), "--init-from", str(source_gguf), "--data", str(corpus), *flags]
    done = subprocess.run([sys.executable, "-m", "tformer", *command], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert load_checkpoint(out).config == load_pretrained(source_gguf).model.cfg
