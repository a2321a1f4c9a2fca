"""``tformer report`` and ``tformer experiment`` on bad input and on several checkpoints: every check before anything
runs, one line on stderr and exit code 2, nothing left on disk; sections and figures told apart; the trained
sections' numbers written alike."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tformer import DecoderLM, TransformerConfig, save_pretrained
from tformer.cli import main
from tformer.experiments import report, trained
from tformer.experiments._common import fmt_alike, fmt_range
from tformer.experiments.trained import LayerStats, TrainedResult
from tformer.tokenizers import ByteTokenizer
from tformer.training.checkpoint import save_checkpoint

LINUX_PROC = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")


def tiny_run(out: Path, layers: int = 2, seed: int = 0) -> Path:
    """A tformer run at ``out``: an untrained byte-level LM of a few thousand parameters (no training: the report
    only reads the weights)."""
    tok = ByteTokenizer()
    torch.manual_seed(seed)
    model = DecoderLM(TransformerConfig.tiny(vocab_size=tok.vocab_size, num_layers=layers))
    save_checkpoint(out, model=model, tokenizer=tok, kind="lm", step=1, train_config={})
    return out


@pytest.fixture
def nothing_runs(monkeypatch):
    """Any experiment or trained-weights measurement fails the test: the command must stop before them."""

    def ran(*args, **kwargs):
        raise AssertionError("an experiment ran before the input was checked")

    monkeypatch.setattr(report, "run_experiment", ran)
    monkeypatch.setattr(trained, "run", ran)


def sections(page: str) -> list[tuple[str, list[str]]]:
    """Each ``## `` section of a report page: its heading and the images it shows."""
    return [(part.split("\n", 1)[0], re.findall(r"!\[[^\]]*\]\(([^)]+)\)", part)) for part in page.split("\n## ")[1:]]


@pytest.fixture
def minilm_path() -> Path:
    from tformer.interop.shipped import shipped_path

    return shipped_path("minilm")


def one_line_error(err: str, command: str = "report") -> str:
    assert err.startswith(f"tformer {command}: error: ") and err.endswith("\n") and err.count("\n") == 1, err
    return err


# --------------------------------------------------------------------------------------------------
# Several checkpoints
# --------------------------------------------------------------------------------------------------
@pytest.mark.subprocess
def test_checkpoints_of_the_same_folder_name_get_their_own_sections_and_figures(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    tiny_run(Path("runs/a"), layers=1, seed=0)
    tiny_run(Path("other/a"), layers=2, seed=1)
    args = ["report", "--quick", "--only", "trained", "--out", "rep"]
    assert main([*args, "--checkpoint", "runs/a", "--checkpoint", "other/a"]) == 0
    page = Path("rep/report.md").read_text()
    title = "Trained: The claims on trained weights"
    assert sections(page) == [(f"{title}: runs/a", ["trained-a.png"]), (f"{title}: other/a", ["trained-a-2.png"])]
    assert sorted(p.name for p in Path("rep").iterdir()) == ["report.md", "trained-a-2.png", "trained-a.png"]
    assert Path("rep/trained-a.png").read_bytes() != Path("rep/trained-a-2.png").read_bytes()
    assert "**runs/a: per layer" in page and "**other/a: per layer" in page
    anchors = re.findall(r"\]\(#([^)]+)\)", page)
    assert len(set(anchors)) == 2
    capsys.readouterr()

    assert main([*args, "--checkpoint", "runs/a", "--checkpoint", "./runs/a/"]) == 2
    err = one_line_error(capsys.readouterr().err)
    assert err.endswith("checkpoint ./runs/a/ is given twice (also as runs/a); give each checkpoint once\n")


def test_checkpoint_names_number_figures_whose_names_collide():
    # "a.b" and "a-b" are different names with the same file-name form; the names themselves stay as they are
    named = report.checkpoint_names(["x/a.b", "y/a-b", "z/a.b"])
    assert named == [("x/a.b", "trained-a-b"), ("a-b", "trained-a-b-2"), ("z/a.b", "trained-a-b-3")]


# --------------------------------------------------------------------------------------------------
# --out
# --------------------------------------------------------------------------------------------------
@LINUX_PROC
@pytest.mark.parametrize("command", ["report", "experiment"])
def test_an_out_folder_that_cannot_be_made_is_one_line_before_anything_runs(command, tmp_path, capsys, nothing_runs):
    args = ["report", "--only", "mha-params"] if command == "report" else ["experiment", "mha-params"]
    assert main([*args, "--quick", "--out", "/proc/zz"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert one_line_error(err, command) == (
        f"tformer {command}: error: --out /proc/zz: cannot create this folder (No such file or directory); give a "
        "folder you can write to\n"
    )
    assert main([*args, "--quick", "--out", "/proc"]) == 2  # there, but nothing can be written in it
    assert "--out /proc: cannot write in this folder (" in one_line_error(capsys.readouterr().err, command)

    deep = tmp_path / "new" / "deeper" / ("x" * 300)  # new/ and deeper/ can be made, the last name is too long
    assert main([*args, "--quick", "--out", str(deep)]) == 2
    assert "cannot create this folder (File name too long)" in one_line_error(capsys.readouterr().err, command)
    assert list(tmp_path.iterdir()) == []  # the folders made on the way were removed again

    file = tmp_path / "file"
    file.write_text("x")
    assert main([*args, "--quick", "--out", str(file / "sub")]) == 2
    err = one_line_error(capsys.readouterr().err, command)
    assert err.endswith(f"--out {file / 'sub'} lies under {file}, which is a file; give a folder\n")


def test_an_experiment_whose_picture_cannot_be_written_leaves_no_folder(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    with pytest.raises(OSError, match="No space left"):
        main(["experiment", "mha-params", "--quick", "--out", str(tmp_path / "new" / "out")])
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------------
# --checkpoint: checked before anything runs; a late failure writes nothing
# --------------------------------------------------------------------------------------------------
def _hf_folder_without_tokenizer(path: Path) -> Path:
    gpt2 = TransformerConfig.tiny(position="learned", activation="gelu_tanh", norm_first=True)
    return save_pretrained(DecoderLM(gpt2), path)


def _truncated_run(path: Path) -> Path:
    tiny_run(path)
    weights = next(path.glob("checkpoints/step-*/model.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    return path


def _text_file(path: Path) -> Path:
    path.write_text("some text\n")
    return path


def _empty_folder(path: Path) -> Path:
    path.mkdir()
    return path


def _run_without_checkpoints(path: Path) -> Path:
    path.mkdir()
    (path / "metrics.jsonl").write_text("{}\n")
    return path


def _not_gguf(path: Path) -> Path:
    return _text_file(path.with_suffix(".gguf"))


def _unsupported_hf_folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "nope"}')
    return path


BAD_CHECKPOINTS = {
    "a text file": (_text_file, "not a checkpoint: a tformer run or checkpoint is"),
    "an empty folder": (_empty_folder, "not a tformer checkpoint: no checkpoint.json here"),
    "a run without checkpoints": (
        _run_without_checkpoints,
        "not a tformer checkpoint: no checkpoint.json here and no checkpoints/step-* checkpoint inside",
    ),
    "a truncated run": (_truncated_run, "model.safetensors: truncated: 1000 bytes, the manifest says"),
    "a .gguf file that is not one": (
        _not_gguf,
        "not a GGUF file (it does not begin with the bytes 'GGUF'); give a .gguf model file",
    ),
    "a Hugging Face folder without tokenizer.json": (
        _hf_folder_without_tokenizer,
        "no tokenizer.json beside the weights; the trained-weights report needs the checkpoint's tokenizer",
    ),
    "a Hugging Face folder of an unknown family": (_unsupported_hf_folder, "model_type 'nope' is not supported"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_every_checkpoint_is_checked_before_anything_runs(case, tmp_path, capsys, nothing_runs):
    make, message = BAD_CHECKPOINTS[case]
    path = make(tmp_path / "model")
    out = tmp_path / "new" / "rep"
    assert main(["report", "--quick", "--out", str(out), "--checkpoint", str(path)]) == 2  # every experiment, then
    stdout, err = capsys.readouterr()
    assert stdout == "" and message in one_line_error(err) and str(path) in err
    assert not (tmp_path / "new").exists()


def test_a_checkpoint_that_fails_to_load_late_leaves_the_out_folder_as_it_was(tmp_path, monkeypatch, capsys):
    """A damaged GGUF file passes the cheap check (its first bytes) and fails only when loaded, after the
    experiments ran: the page and the pictures of an earlier report stay as they were."""
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(12))
    out = tmp_path / "rep"
    out.mkdir()
    (out / "report.md").write_text("the earlier page")
    (out / "mha-params.png").write_bytes(b"the earlier picture")
    args = ["report", "--quick", "--only", "mha-params", "--checkpoint", str(bad), "--out"]
    assert main([*args, str(out)]) == 2
    stdout, err = capsys.readouterr()
    assert "Q2(a): Parameters of multi-head attention" in stdout  # it failed late, after the experiment ran
    stages, error = err.splitlines(keepends=True)[:-1], err.splitlines(keepends=True)[-1]
    assert [line.split(" ...")[0].split(" done in")[0] for line in stages] == [
        "tformer report: [1/2] mha-params",
        "tformer report: [1/2] mha-params",
        f"tformer report: [2/2] trained: {bad}",
    ]
    assert f"{bad}: not a readable GGUF file" in one_line_error(error)
    assert sorted(p.name for p in out.iterdir()) == ["mha-params.png", "report.md"]
    assert (out / "report.md").read_text() == "the earlier page"
    assert (out / "mha-params.png").read_bytes() == b"the earlier picture"

    assert main([*args, str(tmp_path / "fresh" / "rep")]) == 2
    capsys.readouterr()
    assert not (tmp_path / "fresh").exists()


def test_an_interrupted_report_leaves_nothing(tmp_path, monkeypatch):
    run_and_plot = report.run_and_plot

    def interrupted(name, *args, **kwargs):
        if name == "scaling":
            raise KeyboardInterrupt
        return run_and_plot(name, *args, **kwargs)

    monkeypatch.setattr(report, "run_and_plot", interrupted)
    with pytest.raises(KeyboardInterrupt):
        report.write_report(tmp_path / "rep", "quick", ["mha-params", "scaling"], echo=None)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------------
# --only trained
# --------------------------------------------------------------------------------------------------
@pytest.mark.subprocess
def test_each_stage_says_on_stderr_what_it_runs_and_how_long_it_took(tmp_path, monkeypatch, capsys):
    """Wherever stdout goes (a file, a pipe), stderr says what the report is doing: a line as each stage starts,
    one with its time as it ends; the tables follow on stdout as each is done."""
    monkeypatch.chdir(tmp_path)
    tiny_run(Path("runs/a"))
    assert main(["report", "--quick", "--only", "masking,trained", "--checkpoint", "runs/a", "--out", "rep"]) == 0
    out, err = capsys.readouterr()
    assert re.fullmatch(
        r"tformer report: \[1/2\] masking \.\.\.\n"
        r"tformer report: \[1/2\] masking done in \d+\.\d s\n"
        r"tformer report: \[2/2\] trained: runs/a \.\.\.\n"
        r"tformer report: \[2/2\] trained: runs/a done in \d+\.\d s\n",
        err,
    ), err
    assert out.index("Q3(a)") < out.index("Trained") < out.index("wrote rep/report.md")
    assert main(["experiment", "mha-params", "--quick", "--out", "exp"]) == 0
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"tformer experiment: running mha-params \(quick sizes\) \.\.\.\n"
        r"tformer experiment: mha-params done in \d+\.\d s\n",
        err,
    ), err


def test_the_page_names_a_shipped_model_so_its_command_reruns_anywhere(minilm_path):
    """The page's command, and each section's, names a model tformer ships by its name (``--checkpoint minilm``),
    not by one machine's site-packages folder: rerunning it rebuilds the same sections."""
    assert report.shown_path(minilm_path) == "minilm"
    assert report.shown_path("runs/a") == "runs/a"
    assert report.shown_path("/x/lib/site-packages/pkg/model") == "<site-packages>/pkg/model"


@pytest.mark.subprocess
def test_only_trained_combines_with_experiment_names(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    tiny_run(Path("runs/a"))
    assert main(["report", "--quick", "--only", "trained,mha-params", "--checkpoint", "runs/a", "--out", "rep"]) == 0
    page = Path("rep/report.md").read_text()
    assert [heading for heading, _ in sections(page)] == [
        "Q2(a): Parameters of multi-head attention",
        "Trained: The claims on trained weights: a",
    ]
    assert "\n    tformer report --quick --out rep --only mha-params,trained --checkpoint runs/a\n" in page
    capsys.readouterr()

    assert main(["report", "--quick", "--only", "trained,mha-params", "--out", "rep2"]) == 2
    assert one_line_error(capsys.readouterr().err) == (
        "tformer report: error: --only trained needs at least one --checkpoint PATH\n"
    )
    assert main(["report", "--quick", "--only", "mha-params,nope", "--out", "rep2"]) == 2
    err = one_line_error(capsys.readouterr().err)
    assert "unknown experiment 'nope'; give some of: scaling," in err
    assert "attention-maps, circuits, evaluation, trained" in err
    assert not Path("rep2").exists()

    with pytest.raises(SystemExit):
        main(["report", "--help"])
    assert "e.g. --only scaling,trained" in " ".join(capsys.readouterr().out.split())


# --------------------------------------------------------------------------------------------------
# How the trained sections write their numbers
# --------------------------------------------------------------------------------------------------
def test_numbers_side_by_side_are_written_alike():
    assert fmt_alike([2, 2.13]) == ["2.00", "2.13"]
    assert fmt_alike([3.1, 4.17]) == ["3.10", "4.17"]
    assert fmt_alike([0.0129, 0.014]) == ["0.0129", "0.0140"]
    assert fmt_alike([2.57e-4, 0.014]) == ["2.57e-04", "1.40e-02"]  # one needs exponents: both get them
    assert fmt_alike([999.7, 5]) == ["1000", "5.00"]
    assert fmt_alike([0.0, 1.5]) == ["0", "1.50"]
    assert fmt_range([1.87e-10, 1.87e-10]) == "1.87e-10"
    assert fmt_range([2e-4, 8.4e-5]) == "8.40e-05 to 2.00e-04"


def _result(layers: list[LayerStats], grads: list[float]) -> TrainedResult:
    return TrainedResult("m", "llama", True, 16, layers, 32, grad_norms=grads, objective="next-token cross-entropy")


def test_trained_findings_write_ranges_with_to_and_need_two_layers_for_depth():
    one = _result([LayerStats(16 * 1.87e-10, 1.87e-10, 2.0, 2.13, [0.4, 0.8])], [0.3])
    assert one.findings() == [
        "m (llama, Pre-LN, d_k=16): Var(q.k) / Var(q.k/sqrt(d_k)) is 16.00 across layers (d_k exactly); the scaled "
        "variance is 1.87e-10, not 1, as the query entries' variance is 2.00, not the premise's 1",
        "attention entropy per head, as a share of uniform: 0.40 to 0.80 (mean 0.60); 1 of 2 heads below 0.5",
        "sinusoid shift as a rotation (): max |PE[pos+k] - M_k PE[pos]| = 0.00e+00 (float64)",
        "gradient norm of W_2 across depth: not compared, as depth comparisons need at least 2 layers and this "
        "model has 1",
        "measured on the first 32 tokens of the English paragraph (trained.TEXT)",
    ]
    assert one.tables()[0].rows[0][4] == "2.00 / 2.13"

    two = _result(
        [LayerStats(16 * 8.4e-5, 8.4e-5, 3.1, 4.17, [0.9, 0.9]), LayerStats(16 * 2e-4, 2e-4, 4.2, 3.0, [0.9, 0.9])],
        [1.0, 2.0],
    )
    findings = two.findings()
    assert (
        "the scaled variance is 8.40e-05 to 2.00e-04, not 1, as the query entries' variance is 3.10 to 4.20"
        in (findings[0])
    )
    assert findings[1].startswith("attention entropy per head, as a share of uniform: 0.90 (mean 0.90)")
    assert findings[-2].startswith(
        "gradient norm of W_2 across depth (next-token cross-entropy): top/bottom 2, max/min 2 in this Pre-LN model; "
        "one checkpoint does not test the claim"
    )
    assert [row[4] for row in two.tables()[0].rows] == ["3.10 / 4.17", "4.20 / 3.00"]
