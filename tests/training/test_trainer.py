"""Training: exact resume (bitwise), Ctrl-C saves and exits cleanly, metrics/plot files, the schedule and the
optimizer groups, gradient accumulation, LM and seq2seq (task, pairs) training, bfloat16 autocast, the CLI and
clear errors: settings out of range, a diverging loss, a locked or damaged run directory, unavailable devices."""

import importlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tformer.cli import build_parser
from tformer.cli.train import config_from_args
from tformer.config import ConfigError
from tformer.runtime import resolve_device
from tformer.training import TrainConfig, TrainingError, run_lock, train
from tformer.training.checkpoint import CheckpointError, find_latest, load_checkpoint, read_manifest
from tformer.training.datasets import task_held_out
from tformer.training.demos import sample_text
from tformer.training.optim import lr_at, make_optimizer
from tformer.training.tasks import SequenceTask


def test_resume_is_bitwise_identical_to_training_straight_through(tiny_run, tmp_path, corpus):
    model = dict(dropout=0.2)  # dropout draws random numbers every step
    straight = train(tiny_run("straight", model=model))
    first = train(tiny_run("split", model=model, stop_after=5))
    assert first.step == 5 and sorted(first.losses) == [1, 2, 3, 4, 5]
    second = train(tiny_run("split", model=model, resume=True))
    assert sorted(second.losses) == list(range(6, 13))
    assert {**first.losses, **second.losses} == straight.losses  # float equality: bitwise
    assert second.val_losses == {k: v for k, v in straight.val_losses.items() if k > 5}
    a = load_checkpoint(tmp_path / "straight").model.state_dict()
    b = load_checkpoint(tmp_path / "split").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    records = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 13))  # one record per step, no repeats


def test_outputs_metrics_plot_and_checkpoints(tiny_run, tmp_path, corpus):
    result = train(tiny_run(save_every=5))
    out = tmp_path / "run"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert all(r["tokens_per_s"] > 0 and r["lr"] > 0 and r["tokens"] == r["step"] * 4 * 16 for r in steps)
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8, 12]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-000010", "step-000012"]
    assert result.losses[12] < result.losses[1] and result.val_losses[12] < result.val_losses[4] < 5.545  # ln 256
    assert result.tokens_per_s > 0
    assert not result.interrupted and result.checkpoint == out / "checkpoints" / "step-000012"


def test_learning_rate_schedule():
    cfg = TrainConfig(out="x", steps=100, warmup=10, lr=1e-3, min_lr=1e-4)
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(55, cfg) == pytest.approx(0.55e-3)  # halfway down the cosine: (lr + min_lr) / 2
    assert lr_at(100, cfg) == pytest.approx(1e-4)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 100))


def test_weight_decay_only_on_matrices():
    from tformer import DecoderLM, TransformerConfig

    model = DecoderLM(TransformerConfig.tiny(position="learned"))
    decayed, plain = make_optimizer(model, TrainConfig(out="x", weight_decay=0.1)).param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_gradient_accumulation_matches_one_big_batch(tiny_run, tmp_path, corpus):
    one = train(tiny_run("one", steps=4, batch_size=8))
    accumulated = train(tiny_run("acc", steps=4, batch_size=8, grad_accum=4))
    for step, loss in one.losses.items():  # same examples; only the summation order differs
        assert accumulated.losses[step] == pytest.approx(loss, rel=1e-5)


def test_seq2seq_task_trains_and_its_tokenizer_speaks_the_task(tmp_path):
    cfg = TrainConfig(
        out=str(tmp_path / "add"),
        task="add",
        task_max_len=2,
        task_held_out=50,
        steps=40,
        batch_size=16,
        model={},
        warmup=5,
        eval_every=20,
        lr=3e-3,
        progress=False,
    )
    result = train(cfg)
    assert result.kind == "seq2seq" and 0.0 <= result.val_accuracy <= 1.0
    assert result.losses[40] < result.losses[1]
    held_out = task_held_out(cfg)  # the summary's count: the held-out sources of lengths with < 1000 sources
    task = SequenceTask("add", max_len=2)
    assert 0 < result.trained_held_out == sum(not task.can_withhold(s) for s in held_out) < len(held_out)
    ckpt = load_checkpoint(tmp_path / "add")
    assert ckpt.kind == "seq2seq" and ckpt.tokenizer.encode("12+3") == [4, 5, 13, 6]  # the task's own ids
    assert (ckpt.tokenizer.bos_id, ckpt.tokenizer.eos_id, ckpt.tokenizer.pad_id) == (1, 2, 0)
    assert ckpt.train_config["task"] == "add" and ckpt.config.vocab_size == 14


def test_a_bpe_vocabulary_smaller_than_asked_is_noted(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat and the dog\n" * 50)  # a handful of merges, far from 1000 tokens
    cfg = TrainConfig(
        out=None, data=str(corpus), tokenizer="bpe", vocab_size=1000, steps=1, batch_size=2, block_size=8,
        model={"d_model": 16, "num_heads": 2, "num_layers": 1, "d_ff": 32}, warmup=0, progress=False,
    )  # fmt: skip
    size = train(cfg).model.cfg.vocab_size
    note = f"note: the BPE vocabulary has {size} tokens, fewer than --vocab-size 1000: the data has no more pairs to "
    note += "merge"
    assert size < 1000 and note in capsys.readouterr().err.splitlines()


def test_seq2seq_pairs_with_bpe(tmp_path):
    pairs = tmp_path / "pairs.tsv"
    words = ["cat", "dog", "house", "tree", "book", "water", "sun", "moon", "star", "road"]
    pairs.write_text("".join(f"the {a} and the {b}\t{b} {a}\n" for a in words for b in words))
    cfg = TrainConfig(
        out=str(tmp_path / "p"),
        pairs=str(pairs),
        tokenizer="bpe",
        vocab_size=300,
        steps=6,
        batch_size=8,
        model={},
        warmup=2,
        progress=False,
    )
    result = train(cfg)
    ckpt = load_checkpoint(tmp_path / "p")
    assert ckpt.tokenizer.kind == "bpe" and ckpt.config.vocab_size == ckpt.tokenizer.vocab_size <= 300
    assert ckpt.tokenizer.decode(ckpt.tokenizer.encode("the moon and the sun")) == "the moon and the sun"
    assert len(result.losses) == 6 and result.val_accuracy is not None


def test_char_tokenizer_lm_and_bfloat16_autocast(tiny_run, tmp_path, corpus):
    result = train(tiny_run(tokenizer="char", dtype="bfloat16", steps=6, eval_every=0))
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt.tokenizer.kind == "char" and ckpt.config.vocab_size == ckpt.tokenizer.vocab_size < 40
    assert all(torch.isfinite(torch.tensor(v)) for v in result.losses.values())
    assert next(ckpt.model.parameters()).dtype == torch.float32  # autocast leaves the weights in float32


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_without_native_cpu_support_says_float32_is_faster(
    tiny_run, tmp_path, corpus, capsys, monkeypatch, native
):
    monkeypatch.setattr(importlib.import_module("tformer.training.trainer"), "cpu_has_native_bfloat16", lambda: native)
    train(tiny_run(dtype="bfloat16", steps=2, eval_every=0, device="cpu"))
    said = "no native bfloat16 arithmetic" in capsys.readouterr().err
    assert said is not native


def test_clear_errors(tiny_run, tmp_path, corpus):
    with pytest.raises(ValueError, match=r"steps must be a positive integer \(--steps\); got 0"):
        train(tiny_run(steps=0))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(tiny_run(data=str(tmp_path / "missing.txt")))
    assert not (tmp_path / "run").exists()  # checked before the run directory (and its lock) is created
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint"):
        train(tiny_run(resume=True))
    with pytest.raises(ValueError, match="give one of data, task, pairs"):
        train(tiny_run(task="reverse"))
    with pytest.raises(ValueError, match="batch_size=4 must divide evenly"):
        train(tiny_run(grad_accum=3))
    train(tiny_run(steps=2))
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        train(tiny_run(steps=2))
    with pytest.raises(ValueError, match="a 'lm' model but this run trains a 'seq2seq'"):
        train(TrainConfig(out=str(tmp_path / "run"), task="reverse", resume=True, progress=False))
    with pytest.raises(ValueError, match="block_size: saved 16, now 32"):
        train(tiny_run(block_size=32, resume=True, steps=4))
    with pytest.raises(ValueError, match="already at step 2 >= steps=2"):
        train(tiny_run(steps=2, resume=True))


def test_cli_resume_takes_the_saved_settings(tmp_path, corpus):
    parser = build_parser()
    common = ["train", "--out", str(tmp_path / "cli"), "--no-progress"]
    flags = [
        "--data",
        str(corpus),
        "--steps",
        "3",
        "--block-size",
        "16",
        "--d-model",
        "32",
        "--layers",
        "1",
        "--batch-size",
        "4",
        "--cache-dir",
        str(tmp_path / "c"),
    ]
    args = parser.parse_args([*common, *flags])
    assert args.func(args) == 0
    resumed = config_from_args(parser.parse_args([*common, "--resume", "--steps", "5", "--lr", "5e-4"]))
    assert (resumed.block_size, resumed.model["d_model"], resumed.steps, resumed.lr) == (16, 32, 5, 5e-4)
    assert resumed.data == str(corpus) and resumed.resume
    assert args.func(parser.parse_args([*common, "--resume", "--steps", "5"])) == 0
    assert load_checkpoint(tmp_path / "cli").step == 5


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path, corpus):
    out = tmp_path / "sigint"
    command = [
        sys.executable,
        "-m",
        "tformer",
        "train",
        "--out",
        str(out),
        "--data",
        str(corpus),
        "--steps",
        "1000000",
        "--batch-size",
        "4",
        "--block-size",
        "16",
        "--d-model",
        "32",
        "--layers",
        "1",
        "--save-every",
        "0",
        "--eval-every",
        "0",
        "--log-every",
        "1",
        "--no-progress",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    proc = subprocess.Popen(
        command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.exists() and metrics.stat().st_size > 0) and time.monotonic() < deadline:
        assert proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in stderr
    assert "interrupted at step" in stdout and "--resume" in stdout
    ckpt = load_checkpoint(out, with_state=True)
    assert ckpt.step >= 1 and find_latest(out).name == f"step-{ckpt.step:06d}"
    assert (out / "loss.png").exists()
    last = json.loads(metrics.read_text().splitlines()[-1])
    assert last["step"] == ckpt.step  # the saved step is the last one logged


def test_demo_sampler_runs_past_the_context(tiny_run, tmp_path, corpus):
    train(tiny_run(steps=2, model=dict(position="learned")))
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt.config.max_seq_len == 16
    text = sample_text(ckpt.model, ckpt.tokenizer, "def ", max_new_tokens=40, temperature=1.0)
    assert text.startswith("def ") and len(text.encode()) >= 40  # 44 bytes, some may merge into U+FFFD
    assert text == sample_text(ckpt.model, ckpt.tokenizer, "def ", max_new_tokens=40, temperature=1.0)


def _loss_records(out) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_resume_mid_window_logs_what_a_straight_run_logs(tiny_run, tmp_path, corpus):
    straight = tiny_run("straight", log_every=4)
    train(straight)
    train(tiny_run("split", log_every=4, stop_after=6))
    assert sorted(_loss_records(tmp_path / "split")) == [4, 6]  # the stop is logged ...
    train(tiny_run("split", log_every=4, resume=True))
    # ... and replaced after the resume by the record of step 8, which averages steps 5-8 as a straight run does
    assert _loss_records(tmp_path / "split") == _loss_records(tmp_path / "straight")
    assert sorted(_loss_records(tmp_path / "split")) == [4, 8, 12]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(lr=float("inf")), r"lr must be a finite number \(--lr\); got inf"),
        (dict(lr=float("nan")), r"lr must be a finite number \(--lr\); got nan"),
        (dict(lr=1e9), r"lr must be in \(0, 1\] \(--lr; .*got 1e\+09"),
        (dict(lr=0.0), r"lr must be in \(0, 1\]"),
        (dict(min_lr=2e-3), r"min_lr must be in \[0, lr=0.001\] \(--min-lr\); got 0.002 \(e.g. --min-lr 0.0001, a"),
        (dict(weight_decay=-1.0), r"weight_decay must be >= 0 \(--weight-decay; 0 = no decay\); got -1"),
        (dict(grad_clip=-1.0), r"grad_clip must be >= 0 \(--grad-clip; 0 = off\); got -1"),
        (dict(grad_clip=float("nan")), r"grad_clip must be a finite number"),
        (dict(label_smoothing=float("nan")), r"label_smoothing must be a finite number"),
        (dict(betas=(0.9, 1.5)), r"betas must be two numbers in \[0, 1\)"),
        (dict(warmup=-1), r"warmup must be >= 0 \(--warmup; 0 turns it off\)"),
        (dict(device="foo"), r"unknown device 'foo'; use --device auto, cpu, cuda or cuda:N"),
        (dict(seed=-1), r"^seed must be an integer in \[0, 2\*\*63\) \(--seed\); got -1$"),
        (dict(seed=2**63), r"^seed must be an integer in \[0, 2\*\*63\) \(--seed\); got 9223372036854775808$"),
        (dict(keep=0), r"^keep must be a positive integer \(--keep\); got 0$"),
        (dict(task_held_out=0), r"^task_held_out must be a positive integer \(--task-held-out\); got 0$"),
        (
            dict(batch_size=7, grad_accum=2),
            r"^batch_size=7 must divide evenly into grad_accum=2 micro-batches \(--batch-size, --grad-accum\)$",
        ),
        (
            dict(model=dict(num_heads=3)),
            r"^TransformerConfig.d_model=32 is not divisible by num_heads=3; .* \(--d-model, --heads\)$",
        ),
        (
            dict(model=dict(num_kv_heads=3)),
            r"^TransformerConfig.num_kv_heads=3 must divide num_heads=4 \(--heads, --kv-heads\)$",
        ),
        (
            dict(model=dict(dropout=float("nan"))),
            r"^TransformerConfig.dropout must be in \[0, 1\); got nan \(--dropout\)$",
        ),
        (dict(model=dict(position="learned", max_seq_len=8)), r"model max_seq_len=8 is shorter than the 16 positions"),
        (dict(betas=5), r"^betas must be two numbers \(--betas\); got 5$"),
        (dict(data=5), r"^data must be a path \(--data\); got 5$"),
        (dict(model="x"), r"^model must be a dict of TransformerConfig fields; got 'x'$"),
    ],
)
def test_settings_out_of_range_are_rejected_before_training(tiny_run, tmp_path, corpus, changes, message):
    with pytest.raises(ValueError, match=message):
        train(tiny_run(**changes))
    assert not (tmp_path / "run").exists()


def test_devices_are_checked(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    message = r"device 'cuda' is not available here \(torch.cuda.is_available\(\) is False\); use --device cpu"
    with pytest.raises(ValueError, match=message):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="device 'cuda:1' is not available here"):
        TrainConfig(out="x", device="cuda:1").validate()
    with pytest.raises(ValueError, match="unknown device 'foo'"):
        resolve_device("foo")
    with pytest.raises(ValueError, match="device 'meta' is not supported"):
        resolve_device("meta")


def test_divergence_stops_before_saving_broken_weights(tiny_run, tmp_path, corpus, monkeypatch):
    module = importlib.import_module("tformer.training.losses")
    calls = []
    real = module.lm_loss_sum

    def poisoned(model, x, y):
        # from step 7 on, the loss (and so every gradient) is NaN
        calls.append(1)
        s = real(model, x, y)
        return s * float("nan") if len(calls) >= 7 else s

    monkeypatch.setattr(module, "lm_loss_sum", poisoned)
    message = (
        r"training diverged: the training loss is nan at step 7; lower --lr \(now 0.001\), raise --warmup "
        r"\(now 3\) or lower --grad-clip \(now 1\); checkpoints up to step-000006 are intact"
    )
    with pytest.raises(TrainingError, match=message):
        train(tiny_run(eval_every=0, save_every=2, log_every=4))
    out = tmp_path / "run"
    assert find_latest(out).name == "step-000006"  # step 8 (a log step) found the NaN before its save
    assert all(torch.isfinite(p).all() for p in load_checkpoint(out).model.parameters())
    for line in (out / "metrics.jsonl").read_text().splitlines():  # strict JSON: no NaN/Infinity
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))
    assert sorted(_loss_records(out)) == [4]


class _NanGradient(torch.autograd.Function):
    """Identity forward, NaN backward: a finite loss whose update breaks the weights."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def test_weights_broken_by_the_update_of_a_save_step_are_not_saved(tiny_run, tmp_path, corpus, monkeypatch):
    module = importlib.import_module("tformer.training.losses")
    calls = []
    real = module.lm_loss_sum

    def poisoned(model, x, y):
        calls.append(1)
        s = real(model, x, y)
        return _NanGradient.apply(s) if len(calls) == 6 else s

    monkeypatch.setattr(module, "lm_loss_sum", poisoned)
    with pytest.raises(TrainingError, match=r"training diverged: a weight is nan at step 6; .*--grad-clip"):
        train(tiny_run(eval_every=0, save_every=2, log_every=4, grad_clip=0.0))
    assert find_latest(tmp_path / "run").name == "step-000004"


def test_a_second_run_on_the_same_out_fails_at_once(tiny_run, tmp_path, corpus):
    cfg = tiny_run(steps=2)
    with run_lock(cfg.out):  # as another process would hold it
        with pytest.raises(
            TrainingError,
            match=rf"another tformer run is writing to .*run \(pid {os.getpid()}\); "
            "wait for it or choose another --out",
        ):
            train(cfg)
        assert not (tmp_path / "run" / "checkpoints").exists()
    assert train(cfg).step == 2  # released when the holder is done


def test_out_that_is_a_file_is_rejected_up_front(tmp_path):
    file = tmp_path / "x.py"
    file.write_text("")
    with pytest.raises(ValueError, match=r"--out .*x.py is a file; give a directory"):
        TrainConfig(out=str(file)).validate()
    with pytest.raises(ValueError, match=r"--out .*x.py/run lies under .*x.py, which is a file"):
        TrainConfig(out=str(file / "run")).validate()


def test_damaged_latest_checkpoint_names_the_newest_good_one(tiny_run, tmp_path, corpus):
    train(tiny_run(steps=4, save_every=2, eval_every=0))
    out = tmp_path / "run"
    weights = out / "checkpoints" / "step-000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    message = (
        r"checkpoint step-000004 is damaged \(.*model.safetensors: truncated.*\); delete it to resume from "
        r"step-000002"
    )
    with pytest.raises(CheckpointError, match=message):
        train(tiny_run(steps=6, save_every=2, eval_every=0, resume=True))
    parser = build_parser()
    with pytest.raises(CheckpointError, match=message):  # the CLI reads the saved settings first
        config_from_args(parser.parse_args(["train", "--out", str(out), "--resume", "--steps", "6"]))
    assert weights.exists()  # nothing is deleted
    (out / "checkpoints" / "step-000002" / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no earlier checkpoint verifies"):
        train(tiny_run(steps=6, save_every=2, eval_every=0, resume=True))


def test_relative_data_path_resumes_from_another_directory(tmp_path, corpus, monkeypatch):
    parser = build_parser()
    monkeypatch.chdir(tmp_path)
    flags = [
        "--data",
        corpus.name,
        "--block-size",
        "16",
        "--d-model",
        "32",
        "--layers",
        "1",
        "--batch-size",
        "4",
        "--cache-dir",
        "cache",
        "--no-progress",
    ]
    args = parser.parse_args(["train", "--out", "run", "--steps", "2", *flags])
    assert args.func(args) == 0
    saved = read_manifest(find_latest(tmp_path / "run"))["train_config"]
    assert saved["data"] == str(corpus) and saved["cache_dir"] == str(tmp_path / "cache")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    args = parser.parse_args(["train", "--out", "../run", "--resume", "--steps", "3", "--no-progress"])
    assert args.func(args) == 0
    assert load_checkpoint(tmp_path / "run").step == 3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            [
                "--task",
                "reverse",
                "--tokenizer",
                "bpe",
                "--vocab-size",
                "5000",
                "--unknown",
                "skip",
                "--block-size",
                "7",
            ],
            r"^--tokenizer, --vocab-size, --unknown do not apply to --task runs \(their tokenizer is the task's "
            r"alphabet\); --block-size does not apply to --task runs \(.*\); leave them out$",
        ),
        (["--task", "reverse", "--tokenizer", "byte"], r"^--tokenizer does not apply to --task runs .*; leave it out$"),
        (["--pairs", "p.tsv", "--block-size", "7"], r"^--block-size does not apply to --pairs runs"),
        (["--label-smoothing", "0.2"], r"^--label-smoothing does not apply to language-model \(--data\) runs"),
        (["--tokenizer", "char", "--vocab-size", "300"], r"^--vocab-size does not apply .*tokenizer is char\)"),
    ],
)
def test_flags_that_do_not_apply_to_the_run_are_errors(flags, message):
    with pytest.raises(ValueError, match=message):
        config_from_args(build_parser().parse_args(["train", "--out", "x", *flags]))


def test_flags_that_apply_are_accepted():
    for flags in (
        ["--task", "add", "--task-max-len", "3", "--label-smoothing", "0"],
        ["--pairs", "p.tsv", "--tokenizer", "bpe", "--vocab-size", "300"],
        ["--tokenizer", "char", "--unknown", "skip", "--block-size", "64"],
    ):
        config_from_args(build_parser().parse_args(["train", "--out", "x", *flags]))


def test_every_train_config_field_is_typed_documented_and_checked():
    """Types come from the annotations: every field's default fits its own annotation, a value of another type is
    caught, and every field says what it does (its flag's help)."""
    from dataclasses import MISSING, fields

    from tformer.training.settings import field_types, info, matches, type_problem

    types = field_types(TrainConfig)
    for f in fields(TrainConfig):
        default = f.default if f.default is not MISSING else f.default_factory()
        assert matches(default, types[f.name]), f.name
        assert type_problem(f, types[f.name], object()) is not None, f.name
        assert info(f).help and info(f).group, f.name
    TrainConfig(out="x").validate()  # the defaults pass their own checks


def test_a_run_that_fails_before_training_removes_the_out_it_created(tiny_run, tmp_path, corpus):
    out = tmp_path / "new" / "run"
    with pytest.raises(ValueError, match="too short for windows of block_size=5000"):  # found after tokenizing
        train(tiny_run(out=str(out), block_size=5000))
    assert not (tmp_path / "new").exists()  # OUT and the parent the run created, with its .lock
    folder = tmp_path / "no_text"
    folder.mkdir()
    (folder / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0")
    with pytest.raises(ValueError, match="holds no text files"):  # found before OUT is created
        train(tiny_run(data=str(folder), out=str(out)))
    assert not (tmp_path / "new").exists()
    out.mkdir(parents=True)  # a folder that was there before the run is never removed
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="too short"):
        train(tiny_run(out=str(out), block_size=5000))
    assert (out / "notes.txt").read_text() == "mine"


def test_ctrl_c_before_training_removes_the_out_it_created(tiny_run, tmp_path, corpus, monkeypatch):
    module = importlib.import_module("tformer.training.trainer")

    def interrupted(*args):
        raise KeyboardInterrupt  # a second Ctrl-C during tokenization

    monkeypatch.setattr(module, "prepare_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_run())
    assert not (tmp_path / "run").exists()


def test_a_run_that_logged_steps_keeps_its_out_when_it_fails(tiny_run, tmp_path, corpus, monkeypatch):
    module = importlib.import_module("tformer.training.losses")
    calls = []
    real = module.lm_loss_sum

    def poisoned(model, x, y):
        # NaN from step 3 on, before any checkpoint (save_every=0)
        calls.append(1)
        return real(model, x, y) * (float("nan") if len(calls) >= 3 else 1.0)

    monkeypatch.setattr(module, "lm_loss_sum", poisoned)
    with pytest.raises(TrainingError, match="no checkpoint was written"):
        train(tiny_run(eval_every=0))
    assert sorted(_loss_records(tmp_path / "run")) == [1, 2]  # what happened is still there to read
    assert (tmp_path / "run" / "loss.png").exists()


def test_skipped_files_of_a_data_folder_are_reported_once(tiny_run, tmp_path, corpus, capsys):
    folder = tmp_path / "folder"
    (folder / ".git").mkdir(parents=True)
    (folder / "code.py").write_text(corpus.read_text())
    (folder / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0")
    (folder / "latin1.txt").write_bytes(b"caf\xe9\n")
    train(tiny_run(data=str(folder), steps=1, warmup=1, eval_every=0))
    assert capsys.readouterr().err == (
        f"data: skipped 1 hidden entry (.git) and 2 files that are not UTF-8 text "
        f"(image.png, latin1.txt) under {folder}\n"
    )
    train(tiny_run("clean", steps=1, warmup=1, eval_every=0))
    assert capsys.readouterr().err == ""  # nothing skipped, nothing said


def _edit_manifests(out, edit) -> None:
    for manifest in (out / "checkpoints").glob("step-*/checkpoint.json"):
        data = json.loads(manifest.read_text())
        edit(data)
        manifest.write_text(json.dumps(data))


def test_a_run_trained_with_triton_resumes_on_the_cpu(tmp_path, corpus, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parser = build_parser()
    common = ["train", "--out", str(tmp_path / "run"), "--no-progress"]
    flags = [
        "--data",
        str(corpus),
        "--block-size",
        "16",
        "--d-model",
        "32",
        "--layers",
        "1",
        "--batch-size",
        "4",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--eval-every",
        "0",
    ]
    args = parser.parse_args([*common, *flags, "--steps", "2"])
    assert args.func(args) == 0

    def to_triton(manifest):
        # as a run on a GPU with --attn-backend triton saves it
        manifest["model_config"]["attn_backend"] = "triton"
        manifest["train_config"]["model"]["attn_backend"] = "triton"

    _edit_manifests(tmp_path / "run", to_triton)
    args = parser.parse_args([*common, "--resume", "--steps", "3"])  # no --attn-backend: triton becomes auto here
    assert config_from_args(args).model["attn_backend"] == "auto"
    assert args.func(args) == 0
    _edit_manifests(tmp_path / "run", to_triton)
    args = parser.parse_args([*common, "--resume", "--steps", "4", "--attn-backend", "sdpa"])
    assert args.func(args) == 0
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt.step == 4 and ckpt.config.attn_backend == "sdpa" == ckpt.train_config["model"]["attn_backend"]
    with pytest.raises(ValueError, match="attn_backend 'triton' .* runs on CUDA GPUs"):  # asked for: still an error
        train(config_from_args(parser.parse_args([*common, "--resume", "--steps", "5", "--attn-backend", "triton"])))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("model", "x", r"malformed train_config: model must be a dict of TransformerConfig fields; got 'x'$"),
        (
            "model",
            {"num_heads": "x"},
            r"malformed train_config: model: TransformerConfig.num_heads must be a positive "
            r"integer; got 'x' \(--heads\)$",
        ),
        ("betas", 5, r"malformed train_config: betas must be two numbers \(--betas\); got 5$"),
        ("data", 5, r"malformed train_config: data must be a path \(--data\); got 5$"),
        ("warmup", "many", r"malformed train_config: warmup must be an integer \(--warmup\); got 'many'$"),
    ],
)
def test_a_malformed_saved_train_config_names_the_manifest_and_the_field(
    tiny_run, tmp_path, corpus, field, value, message
):
    train(tiny_run(steps=2, eval_every=0))
    _edit_manifests(tmp_path / "run", lambda manifest: manifest["train_config"].update({field: value}))
    args = build_parser().parse_args(["train", "--out", str(tmp_path / "run"), "--resume", "--steps", "3"])
    with pytest.raises(CheckpointError, match=r"^\S*run/checkpoints/step-000002/checkpoint.json: " + message):
        config_from_args(args)


def test_a_saved_value_out_of_range_is_fixed_by_its_flag(tiny_run, tmp_path, corpus):
    train(tiny_run(steps=2, eval_every=0))
    _edit_manifests(tmp_path / "run", lambda manifest: manifest["train_config"].update(keep=0))
    common = ["train", "--out", str(tmp_path / "run"), "--resume", "--steps", "3", "--no-progress"]
    with pytest.raises(ValueError, match=r"^keep must be a positive integer \(--keep\); got 0$"):
        train(config_from_args(build_parser().parse_args(common)))
    assert train(config_from_args(build_parser().parse_args([*common, "--keep", "1"]))).step == 3
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-000003"]


def test_resume_refuses_a_corpus_changed_since_the_run_and_takes_one_only_touched(tiny_run, corpus):
    """The checkpoint keeps the SHA-256 of the token ids the run trained on: a corpus edited between stop and resume
    is refused (the run would go on over other text), a file touched but not changed resumes."""
    train(tiny_run(stop_after=4, save_every=2))
    text = corpus.read_text()
    corpus.write_text(text.replace("return", "yield"))
    with pytest.raises(ValueError, match=r"holds other text than the run trained on .*--init-from"):
        train(tiny_run(resume=True, stop_after=6))
    corpus.write_text(text)
    os.utime(corpus, (1e9, 1e9))  # the same text, another modification time: retokenized, the same ids
    assert train(tiny_run(resume=True, stop_after=6)).step == 6


def test_resume_refuses_an_edited_pairs_file(tmp_path):
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("".join(f"{a} {b}\t{b} {a}\n" for a in "abcdef" for b in "ghijk"))
    cfg = dict(out=str(tmp_path / "p"), pairs=str(pairs), steps=4, batch_size=4, model={}, warmup=1, progress=False)
    train(TrainConfig(**cfg, stop_after=2))
    pairs.write_text(pairs.read_text().replace("a g\tg a", "a g\tg b"))
    with pytest.raises(
        ValueError, match=r"--pairs .*pairs\.tsv holds other text .* train a new run into another --out$"
    ):
        train(TrainConfig(**cfg, resume=True))


def test_an_out_folder_inside_the_data_folder_is_refused_before_anything_is_written(tiny_run, tmp_path, corpus):
    """Its checkpoints and metrics.jsonl would be scanned as training text; a hidden folder is not scanned."""
    data = tmp_path / "data"
    data.mkdir()
    corpus.rename(data / "corpus.txt")
    with pytest.raises(ConfigError, match=r"--out .*data/runs/a is inside --data .*: the run's own files"):
        train(tiny_run("data/runs/a", data=str(data)))
    assert not (data / "runs").exists()
    assert train(tiny_run("data/.runs/a", data=str(data), stop_after=1)).step == 1


def test_a_fresh_run_does_not_overwrite_the_metrics_of_a_run_that_saved_no_checkpoint(tiny_run, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (out / "loss.png").write_bytes(b"png")
    with pytest.raises(FileExistsError, match=r"holds metrics\.jsonl and loss\.png of a run that saved no checkpoint"):
        train(tiny_run())
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n' and sorted(os.listdir(out)) == [
        ".lock",
        "loss.png",
        "metrics.jsonl",
    ]
    (out / "metrics.jsonl").write_text("")  # empty: nothing to lose (a run that failed before its first step)
    (out / "loss.png").unlink()
    assert train(tiny_run(stop_after=1)).step == 1
