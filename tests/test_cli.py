"""The command line: bad flags end in one line on stderr naming the flag (exit 2) before any training, a run that
cannot go on exits 1, Ctrl-C anywhere exits 130, and the help texts are plain and complete."""

import importlib

import pytest
import torch

from tformer.cli import main
from tformer.train import run_lock

TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--d-ff", "64", "--block-size", "16", "--batch-size", "4"]


@pytest.fixture
def no_training(monkeypatch):
    """Make any call of ``tformer.train.train`` fail the test: errors must come before training."""
    module = importlib.import_module("tformer.train")  # the attribute tformer.train is the function train
    monkeypatch.setattr(module, "train", lambda cfg: pytest.fail("trained despite a bad flag"))


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.strip()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "foo"], "unknown device 'foo'; use --device auto, cpu, cuda or cuda:N"),
        (["--lr", "inf"], "lr must be a finite number (--lr); got inf"),
        (["--lr", "1e9"], "lr must be in (0, 1] (--lr; AdamW moves each weight by about lr per step); got 1e+09"),
        (["--grad-clip", "-1"], "grad_clip must be >= 0 (--grad-clip; 0 = off); got -1"),
        (["--task", "reverse", "--tokenizer", "bpe"], "--tokenizer does not apply to --task runs"),
    ],
)
def test_train_flag_errors_are_one_line(tmp_path, capsys, flags, message):
    assert main(["train", "--out", str(tmp_path / "run"), *flags]) == 2
    line = _error_line(capsys)
    assert line.startswith("tformer train: error: ") and message in line
    assert not (tmp_path / "run").exists()


def test_train_device_without_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["train", "--out", str(tmp_path / "run"), "--device", "cuda"]) == 2
    assert _error_line(capsys) == ("tformer train: error: device 'cuda' is not available here "
                                   "(torch.cuda.is_available() is False); use --device cpu")  # fmt: skip


def test_train_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "x.py").write_text("")
    assert main(["train", "--out", str(tmp_path / "x.py")]) == 2
    assert _error_line(capsys) == f"tformer train: error: --out {tmp_path / 'x.py'} is a file; give a directory"


def test_train_into_a_locked_out_exits_1(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("abc\n" * 200)
    with run_lock(tmp_path / "run"):
        code = main(["train", "--out", str(tmp_path / "run"), "--data", str(corpus), *TINY, "--no-progress"])
    assert code == 1
    assert "another tformer run is writing to" in _error_line(capsys)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "0"], "steps must be a positive integer (--steps); got 0"),
        (["--temperature", "0"], "--temperature must be a finite number > 0; got 0"),
        (["--sample-tokens", "-1"], "--sample-tokens must be a positive integer; got -1"),
    ],
)
def test_train_demo_checks_everything_before_training(tmp_path, capsys, no_training, flags, message):
    assert main(["train-demo", "--out", str(tmp_path / "demo"), *flags]) == 2
    assert _error_line(capsys) == f"tformer train-demo: error: {message}"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lr", "nan"], "--lr must be a number in (0, 1]; got nan"),
        (["--lr", "0"], "--lr must be a number in (0, 1]; got 0"),
        (["--steps", "0"], "--steps must be a positive integer; got 0"),
        (["--batch-size", "-3"], "--batch-size must be a positive integer; got -3"),
    ],
)
def test_demo_flag_errors_are_one_line(capsys, monkeypatch, flags, message):
    demo_cli = importlib.import_module("tformer.demo_cli")
    monkeypatch.setattr(demo_cli, "run_demo", lambda **kwargs: pytest.fail("trained despite a bad flag"))
    assert main(["demo", *flags]) == 2
    assert _error_line(capsys) == f"tformer demo: error: {message}"


def test_ctrl_c_outside_the_training_loop_exits_130(tmp_path, capsys, monkeypatch):
    def interrupted(cfg):
        raise KeyboardInterrupt  # as during imports or tokenization

    monkeypatch.setattr(importlib.import_module("tformer.train"), "train", interrupted)
    assert main(["train", "--out", str(tmp_path / "run")]) == 130
    assert _error_line(capsys) == "tformer: interrupted"


def test_help_is_plain_and_complete(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and "The tformer command line" in text
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "sequences per step (default 64)" in text and "(default 2e-3)" in text and "(default 0)" in text


def test_triton_backend_off_cuda_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["train", "--out", str(tmp_path / "run"), "--attn-backend", "triton", *TINY]) == 2
    assert _error_line(capsys) == (
        "tformer train: error: attn_backend 'triton' (--attn-backend triton) runs on CUDA GPUs, and this run is "
        "on cpu; use --attn-backend auto (or sdpa, tiled)"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", [["sample", "--prompt", "x"], ["translate"]])
def test_sample_and_translate_check_the_device_first(tmp_path, capsys, monkeypatch, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([command[0], "--checkpoint", str(tmp_path), *command[1:], "--device", "cuda"]) == 2
    assert _error_line(capsys) == (f"tformer {command[0]}: error: device 'cuda' is not available here "
                                   "(torch.cuda.is_available() is False); use --device cpu")  # fmt: skip


def test_pairs_that_is_a_folder_says_so(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "run"), "--pairs", str(tmp_path)]) == 2
    assert _error_line(capsys) == (f"tformer train: error: pairs file {tmp_path} is a directory; pass a file of "
                                   "source<TAB>target lines (--pairs)")  # fmt: skip
