"""The command line: bad flags end in one line on stderr naming the flag (exit 2) before any training, a run that
cannot go on exits 1, Ctrl-C anywhere exits 130, and the help texts are plain and complete."""

import ast
import errno
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tformer import cli
from tformer.cli import main
from tformer.training import TrainConfig, TrainingError, run_lock, train
from tformer.training.demos import DemoResult


@pytest.fixture
def no_training(monkeypatch):
    """Make any call of ``tformer.training.train`` fail the test: errors must come before training."""
    module = importlib.import_module("tformer.training.trainer")
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
        (["--seed", "-1"], "seed must be an integer in [0, 2**63) (--seed); got -1"),
        (["--keep", "0"], "keep must be a positive integer (--keep); got 0"),
        (["--heads", "3"], "TransformerConfig.d_model=128 is not divisible by num_heads=3"),
        (["--kv-heads", "5"], "TransformerConfig.num_kv_heads=5 must divide num_heads=4 (--heads, --kv-heads)"),
        (["--dropout", "nan"], "TransformerConfig.dropout must be in [0, 1); got nan (--dropout)"),
        (["--batch-size", "7", "--grad-accum", "2"], "batch_size=7 must divide evenly into grad_accum=2 micro-batches"),
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
    assert _error_line(capsys) == (
        "tformer train: error: device 'cuda' is not available here "
        "(torch.cuda.is_available() is False); use --device cpu"
    )


def test_train_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "x.py").write_text("")
    assert main(["train", "--out", str(tmp_path / "x.py")]) == 2
    assert _error_line(capsys) == f"tformer train: error: --out {tmp_path / 'x.py'} is a file; give a directory"


def test_train_into_a_locked_out_exits_1(tiny_flags, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("abc\n" * 200)
    with run_lock(tmp_path / "run"):
        code = main(["train", "--out", str(tmp_path / "run"), "--data", str(corpus), *tiny_flags, "--no-progress"])
    assert code == 1
    assert "another tformer run is writing to" in _error_line(capsys)


def test_resume_notes_each_setting_the_flags_change(tiny_flags, tmp_path, capsys):
    corpus, out = tmp_path / "c.txt", str(tmp_path / "run")
    corpus.write_text("abc\n" * 200)
    common = ["--data", str(corpus), *tiny_flags, "--no-progress", "--warmup", "0"]
    assert main(["train", "--out", out, "--steps", "2", *common]) == 0
    capsys.readouterr()
    assert main(["train", "--out", out, "--resume", "--steps", "3", "--lr", "0.002", *common]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == [  # the flags given again with the saved values (--data, the model's, ...) are not noted
        "note: --resume with --lr 0.002 (the run had 0.001)",
        "note: --resume with --steps 3 (the run had 2)",
    ]


def test_resume_of_a_run_that_has_not_saved_yet_names_the_run_not_a_missing_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    with run_lock(out):  # a fresh run, writing, before its first checkpoint
        assert main(["train", "--out", str(out), "--resume", "--steps", "5"]) == 1
        assert _error_line(capsys) == (
            f"tformer train: error: --resume: another tformer run is writing to {out} (pid {os.getpid()}) and has "
            "saved no checkpoint yet; wait for it to save one (or to end), or choose another --out"
        )
    assert main(["train", "--out", str(out), "--resume", "--steps", "5"]) == 2  # no run there any more
    assert _error_line(capsys) == (
        f"tformer train: error: --resume: no checkpoint in {out / 'checkpoints'}; train without --resume first"
    )


def test_train_into_an_out_that_cannot_be_made_exits_1_and_leaves_nothing(tiny_flags, tmp_path, capsys, monkeypatch):
    corpus = tmp_path / "c.txt"
    corpus.write_text("abc\n" * 200)
    out, real_mkdir = tmp_path / "runs" / "today" / "first", os.mkdir

    def mkdir(path, *args, **kwargs):  # the parents can be made, OUT itself not (as in a folder one may not write)
        if str(path) == str(out):
            raise PermissionError(13, "Permission denied", str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    code = main(["train", "--out", str(out), "--data", str(corpus), *tiny_flags, "--no-progress"])
    assert code == 1
    assert _error_line(capsys) == (
        f"tformer train: error: cannot write the run directory {out} (Permission denied); choose an --out you can "
        "write to"
    )
    assert not (tmp_path / "runs").exists()  # the parents the run made are gone again


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
        (["--lr", "nan"], "lr must be a finite number (--lr); got nan"),
        (["--lr", "0"], "lr must be in (0, 1] (--lr; AdamW moves each weight by about lr per step); got 0"),
        (["--steps", "0"], "steps must be a positive integer (--steps); got 0"),
        (["--batch-size", "-3"], "batch_size must be a positive integer (--batch-size); got -3"),
        (["--seed", "-1"], "seed must be an integer in [0, 2**63) (--seed); got -1"),
    ],
)
def test_demo_flag_errors_are_one_line(capsys, monkeypatch, flags, message):
    demos = importlib.import_module("tformer.training.demos")
    monkeypatch.setattr(demos, "run_demo", lambda **kwargs: pytest.fail("trained despite a bad flag"))
    assert main(["demo", *flags]) == 2
    assert _error_line(capsys) == f"tformer demo: error: {message}"


def test_ctrl_c_outside_the_training_loop_exits_130(tmp_path, capsys, monkeypatch):
    def interrupted(cfg):
        raise KeyboardInterrupt  # as during imports or tokenization

    monkeypatch.setattr(importlib.import_module("tformer.training.trainer"), "train", interrupted)
    assert main(["train", "--out", str(tmp_path / "run")]) == 130
    assert _error_line(capsys) == "tformer: interrupted"


@pytest.mark.subprocess
def test_ctrl_c_while_torch_loads_exits_130_without_a_traceback(tmp_path):
    """``import tformer`` does not load torch, so the CLI holds Ctrl-C back before torch's ~1 s import starts
    (Python itself is up in ~0.1 s), and ends the command with 130 once the imports are done."""
    command = [sys.executable, "-m", "tformer", "train", "--out", str(tmp_path / "run"), "--no-progress"]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(0.4)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr


def test_ctrl_c_is_held_back_until_the_block_ends():
    """A KeyboardInterrupt inside an extension's import can be swallowed by its C code (torch's NumPy bridge) or
    leave a module half-built; the CLI's imports therefore finish first, then the interrupt is raised. (The test sets
    Python's own handler first: a suite started in the background of a shell inherits SIGINT ignored.)"""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        finished = False
        with pytest.raises(KeyboardInterrupt), cli._ctrl_c_held_back():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # Python runs signal handlers between bytecodes: here, inside the block
            finished = True
        assert finished and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job: stays ignored
        with cli._ctrl_c_held_back():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.subprocess
def test_package_names_load_lazily_and_match_the_type_checking_imports():
    """``import tformer`` alone imports no torch; every name of ``__all__`` resolves to its module's object; the
    ``TYPE_CHECKING`` imports of ``tformer/__init__.py`` (for type checkers) name exactly ``__all__``."""
    code = (
        "import sys, tformer\n"
        "assert 'torch' not in sys.modules, 'import tformer imported torch'\n"
        "print(' '.join(tformer.__all__))\n"
    )
    names = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    tformer = importlib.import_module("tformer")
    assert sorted(names) == sorted(tformer.__all__) and "train" in names and "DecoderLM" in names
    for name in names:
        module = importlib.import_module(tformer._EXPORTS[name])
        assert getattr(tformer, name) is (module if module.__name__ == f"tformer.{name}" else getattr(module, name))
    tree = ast.parse(Path(tformer.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    imported = {alias.asname or alias.name for n in block.body for alias in n.names}
    assert imported == set(tformer.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = tformer.nope
    for name in tformer.SUBPACKAGES:  # tformer.engine.accelerate works after import tformer alone
        assert getattr(tformer, name) is importlib.import_module(f"tformer.{name}")


def test_help_is_plain_and_complete(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and "The tformer command line" in text
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "sequences per step (default 64)" in text and "(default 2e-3)" in text and "(default 0)" in text


def test_triton_backend_off_cuda_is_a_one_line_error(tiny_flags, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["train", "--out", str(tmp_path / "run"), "--attn-backend", "triton", *tiny_flags]) == 2
    assert _error_line(capsys) == (
        "tformer train: error: attn_backend 'triton' (--attn-backend triton) runs on CUDA GPUs, and this run is "
        "on cpu; use --attn-backend auto (or sdpa, tiled)"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", [["sample", "--prompt", "x"], ["translate"]])
def test_sample_and_translate_check_the_device_first(tmp_path, capsys, monkeypatch, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([command[0], "--checkpoint", str(tmp_path), *command[1:], "--device", "cuda"]) == 2
    assert _error_line(capsys) == (
        f"tformer {command[0]}: error: device 'cuda' is not available here "
        "(torch.cuda.is_available() is False); use --device cpu"
    )


def test_pairs_that_is_a_folder_says_so(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "run"), "--pairs", str(tmp_path)]) == 2
    assert _error_line(capsys) == (
        f"tformer train: error: pairs file {tmp_path} is a directory; pass a file of source<TAB>target lines (--pairs)"
    )


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--data", "data must be a text file or a folder (--data); got '' (use --data . for the current folder)"),
        ("--pairs", "pairs must be a file of source<TAB>target lines (--pairs); got ''"),
        ("--cache-dir", "cache_dir must be a folder (--cache-dir); got '' (use --cache-dir . for the current folder)"),
    ],
)
def test_an_empty_path_is_refused_not_read_as_the_current_folder(tmp_path, capsys, flag, message):
    assert main(["train", "--out", str(tmp_path / "run"), flag, ""]) == 2
    assert _error_line(capsys) == f"tformer train: error: {message}"
    assert not (tmp_path / "run").exists()


def test_a_pairs_file_that_is_not_utf8_leaves_no_out(tmp_path, capsys):
    (tmp_path / "pairs.tsv").write_bytes(b"one\tuno\ntwo\tdos \xe9\n")
    assert main(["train", "--out", str(tmp_path / "run"), "--pairs", str(tmp_path / "pairs.tsv"), "--steps", "2"]) == 2
    assert "is not UTF-8 text (line 2: byte 0xe9 at offset 16)" in _error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_train_on_a_folder_without_text_leaves_no_out(tiny_flags, tmp_path, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0")
    assert main(["train", "--out", str(tmp_path / "run"), "--data", str(tmp_path / "data"), *tiny_flags]) == 2
    assert "holds no text files" in _error_line(capsys)
    assert not (tmp_path / "run").exists()


def _fake_checkpoint(out, kind: str, train_config: dict, step: int) -> None:
    """What train-demo reads of a checkpoint: its manifest."""
    folder = out / "checkpoints" / f"step-{step:06d}"
    folder.mkdir(parents=True)
    (folder / "checkpoint.json").write_text(json.dumps({"kind": kind, "train_config": train_config}))


def _demo_config(out) -> dict:
    from tformer.training.demos import DEMO, DEMO_MODEL

    return TrainConfig(out=str(out), model=dict(DEMO_MODEL), **DEMO).to_dict()


def test_train_demo_refuses_to_replace_another_run(tmp_path, capsys, no_training):
    out = tmp_path / "run"
    model = dict(d_model=16, num_heads=2, num_layers=1, d_ff=32)
    train(
        TrainConfig(
            out=str(out),
            task="reverse",
            task_max_len=3,
            task_held_out=10,
            steps=2,
            warmup=1,
            save_every=1,
            batch_size=4,
            model=model,
            progress=False,
        )
    )
    assert main(["train-demo", "--out", str(out)]) == 2
    assert _error_line(capsys) == (
        f"tformer train-demo: error: --out {out} holds another run (kind 'seq2seq', 2 "
        "checkpoints); train-demo only replaces its own runs: choose another --out or "
        "delete it"
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    lm = tmp_path / "lm"  # an LM, but not with the demo's settings
    _fake_checkpoint(lm, "lm", {**_demo_config(lm), "block_size": 64}, 5)
    assert main(["train-demo", "--out", str(lm)]) == 2
    assert "holds another run (kind 'lm', 1 checkpoint);" in _error_line(capsys)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.md").write_text("mine")
    assert main(["train-demo", "--out", str(notes)]) == 2
    assert _error_line(capsys) == (
        f"tformer train-demo: error: --out {notes} is not empty and holds no train-demo run "
        "(1 other entry: todo.md); choose another --out or delete it"
    )
    assert [p.name for p in notes.iterdir()] == ["todo.md"]  # not even a .lock left behind


@pytest.mark.parametrize("earlier", ["demo run", "leftovers"])
def test_train_demo_replaces_its_own_runs(tmp_path, capsys, monkeypatch, earlier):
    out = tmp_path / "demo"
    if earlier == "demo run":  # an earlier, longer demo (its step count may differ)
        _fake_checkpoint(out, "lm", {**_demo_config(out), "steps": 3000}, 3000)
    else:  # a run killed before its first checkpoint
        out.mkdir()
        (out / ".lock").write_text("")
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "loss.png").write_bytes(b"png")
    seen = []

    def fake_train(cfg):
        seen.append(sorted(p.name for p in out.iterdir()))
        raise TrainingError("stop here")

    monkeypatch.setattr(importlib.import_module("tformer.training.trainer"), "train", fake_train)
    assert main(["train-demo", "--out", str(out)]) == 1
    assert seen == [[".lock"]]  # the earlier run's files were removed before training
    assert "stop here" in capsys.readouterr().err


def _fake_demo(monkeypatch, predicted=(5, 4, 3)) -> None:
    result = DemoResult(
        accuracy=0.0, final_loss=1.0, steps=1, seconds=0.0, examples=[([3, 4, 5], [5, 4, 3], list(predicted))]
    )
    monkeypatch.setattr(importlib.import_module("tformer.training.demos"), "run_demo", lambda **kwargs: result)


def test_demo_shows_special_tokens_by_name(capsys, monkeypatch):
    _fake_demo(monkeypatch, predicted=[1, 5, 2, 0])  # <bos> 2 <eos> <pad>: what an untrained model may say
    assert main(["demo"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.split() == ["0", "1", "2", "->", "<bos>", "2", "<eos>", "<pad>", "WRONG,", "expected", "2", "1", "0"]


class _FailingStdout:
    def __init__(self, error: OSError) -> None:
        self.error = error

    def write(self, text):
        raise self.error

    def flush(self):
        raise self.error


def test_output_that_cannot_be_written_is_one_line_not_a_traceback(capsys, monkeypatch):
    _fake_demo(monkeypatch)
    monkeypatch.setattr(sys, "stdout", _FailingStdout(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    assert main(["demo"]) == 1
    assert _error_line(capsys) == f"tformer: error writing output: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}"
    monkeypatch.setattr(sys, "stdout", _FailingStdout(BrokenPipeError(errno.EPIPE, "Broken pipe")))
    assert main(["demo"]) == 141  # the reader went away (| head): quietly, as a process stopped by SIGPIPE
    assert capsys.readouterr().err == ""


@pytest.mark.subprocess
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_and_a_closed_pipe_end_the_process_without_a_traceback(tmp_path):
    command = [sys.executable, "-m", "tformer", "--help"]  # output buffered until the exit: the hardest case
    with open("/dev/full", "w") as full:
        proc = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr == f"tformer: error writing output: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}\n"
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte
    try:
        proc = subprocess.run(command, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")


def test_a_system_error_inside_a_command_is_one_line_and_exit_1(capsys):
    from tformer.cli.common import report_errors

    def disk_full() -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    assert report_errors("convert", disk_full) == 1
    assert capsys.readouterr().err == f"tformer convert: error: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}\n"

    def reader_gone() -> int:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    with pytest.raises(BrokenPipeError):  # left to main(), which ends quietly with 141 (the test above)
        report_errors("sample", reader_gone)


@pytest.mark.subprocess
def test_the_cli_module_itself_imports_no_torch():
    """Ctrl-C while torch loads must reach main()'s handler; the command modules are imported inside main() (the
    package's __init__, imported first by the console script, still imports torch)."""
    from tformer import cli

    code = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('cli', sys.argv[1]); "
        "spec.loader.exec_module(importlib.util.module_from_spec(spec)); print(sorted({'torch', 'numpy'} & "
        "set(sys.modules)))"
    )
    proc = subprocess.run([sys.executable, "-c", code, cli.__file__], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "[]\n"), proc.stderr


@pytest.mark.subprocess
def test_help_and_a_mistyped_command_answer_without_importing_torch():
    """Every command's parser is built from modules that import no torch (it loads inside the commands), so
    ``tformer --help``, ``tformer COMMAND --help`` and a mistyped command answer at once."""
    code = (
        "import sys\n"
        "from tformer.cli import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit as done:\n"
        "    print('exit', done.code)\n"
        "print(sorted({'torch', 'numpy'} & set(sys.modules)))\n"
    )
    for args in (
        ["--help"],
        ["sampel"],
        *([name, "--help"] for name in cli.build_parser()._subparsers._actions[1].choices),
    ):
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout.endswith("[]\n"), (args, proc.stdout, proc.stderr)
        if args == ["sampel"]:
            assert "exit 2" in proc.stdout
            assert proc.stderr.startswith("tformer: error: argument COMMAND: invalid choice: 'sampel' (choose from")
        else:
            assert "exit 0" in proc.stdout and "usage: tformer" in proc.stdout


def test_the_sample_help_shows_the_default_length_generation_uses():
    from tformer.cli.sample import DEFAULT_NEW_TOKENS
    from tformer.generation import text

    assert DEFAULT_NEW_TOKENS == text.DEFAULT_NEW_TOKENS


def test_resume_can_turn_off_what_the_run_turned_on_and_notes_a_new_attention_backend(tiny_flags, tmp_path, capsys):
    """Every on/off setting has both flags (--compile/--no-compile, --progress/--no-progress), so a resumed run can
    undo what the saved run set (it takes the saved values otherwise); a new --attn-backend, the one model flag a
    resume may change (all backends are exact), is noted like the other changed settings."""
    from tformer.cli.train import config_from_args

    corpus, out = tmp_path / "c.txt", tmp_path / "run"
    corpus.write_text("abc\n" * 200)
    common = ["--data", str(corpus), *tiny_flags, "--warmup", "0", "--attn-backend", "reference"]
    assert main(["train", "--out", str(out), "--steps", "1", "--no-progress", *common]) == 0
    manifest = out / "checkpoints" / "step-000001" / "checkpoint.json"
    saved = json.loads(manifest.read_text())
    saved["train_config"]["compile"] = True  # as a run with --compile saves it (compiling here would take a minute)
    manifest.write_text(json.dumps(saved))
    capsys.readouterr()

    def resumed(*flags: str) -> TrainConfig:
        return config_from_args(cli.build_parser().parse_args(["train", "--out", str(out), "--resume", *flags]))

    assert (resumed().compile, resumed().progress) == (True, False)  # the saved values
    with pytest.raises(SystemExit):  # --resume is what the command does, not a setting with an off form
        cli.build_parser().parse_args(["train", "--out", str(out), "--no-resume"])
    assert "unrecognized arguments: --no-resume" in capsys.readouterr().err
    cfg = resumed("--no-compile", "--progress", "--attn-backend", "sdpa")
    assert (cfg.compile, cfg.progress, cfg.model["attn_backend"]) == (False, True, "sdpa")
    assert capsys.readouterr().err.splitlines() == [
        "note: --resume with --no-compile (the run had --compile)",
        "note: --resume with --attn-backend sdpa (the run had reference)",
    ]


def test_the_summary_says_what_each_figure_covers(tmp_path):
    """The validation loss of a run stopped between evaluations names its step; a seq2seq training loss names its
    label smoothing (the validation loss has none); tokens/s is of the training steps alone."""
    from tformer.cli.train import summary
    from tformer.training import TrainResult

    result = TrainResult(
        out=tmp_path,
        kind="seq2seq",
        step=25,
        losses={24: 2.0, 25: 1.0},
        val_losses={10: 3.0, 20: 2.5},
        val_accuracy=None,
        tokens_per_s=1234.4,
        seconds=10.0,
        checkpoint=tmp_path / "checkpoints" / "step-000025",
        interrupted=False,
        num_parameters=1000,
        label_smoothing=0.1,
    )
    lines = summary(result).splitlines()
    assert lines[:3] == [
        "trained to step 25 in 10 s (1,234 tokens/s while training, 1,000 parameters)",
        "training loss 1.5000 (mean of the last 2 steps, label smoothing 0.1)",
        "validation loss 2.5000 (at step 20, the last evaluation)",
    ]
    result.val_losses[25], result.label_smoothing = 2.25, 0.0
    assert summary(result).splitlines()[1:3] == [
        "training loss 1.5000 (mean of the last 2 steps)",
        "validation loss 2.2500",
    ]
    result.val_accuracy, result.trained_held_out = 0.5, 12
    assert summary(result).splitlines()[3] == (
        "held-out exact match 50.0% (12 held-out examples have sources too short to keep out of training: it may "
        "have seen them)"
    )


def test_tokens_per_second_leaves_out_evaluations(tiny_run, monkeypatch):
    """A run's tokens/s counts the time of its training steps: four evaluations made 0.5 s slower each take at
    least 2 s of the run's time and none of its rate (256 tokens: 4 steps of 4 windows of 16)."""
    from tformer.training import trainer

    evaluate = trainer.Trainer.evaluate

    def slow(self):
        time.sleep(0.5)
        evaluate(self)

    monkeypatch.setattr(trainer.Trainer, "evaluate", slow)
    result = train(tiny_run(steps=4, eval_every=1))
    assert sorted(result.val_losses) == [1, 2, 3, 4]
    assert result.tokens_per_s >= 256 / (result.seconds - 2.0) * (1 - 1e-9)  # counted over at most seconds - 2


def test_resuming_a_run_with_data_of_the_other_kind_names_the_kind(tiny_flags, tmp_path, capsys):
    """An LM run resumed with --task (or a seq2seq run with --data) is refused for what it is, not for the saved
    LM-only settings (--block-size) that a seq2seq run would ignore."""
    corpus, out = tmp_path / "c.txt", str(tmp_path / "run")
    corpus.write_text("abc\n" * 200)
    assert main(["train", "--out", out, "--steps", "1", "--no-progress", "--data", str(corpus), *tiny_flags]) == 0
    capsys.readouterr()
    assert main(["train", "--out", out, "--resume", "--steps", "2", "--task", "reverse"]) == 2
    assert capsys.readouterr().err == (
        f"tformer train: error: --resume: {out} holds a language-model run (--data), and --task trains the other "
        "kind; resume it with its own kind of data, or train into another --out\n"
    )
