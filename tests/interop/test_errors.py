"""Bad input: a missing file, a truncated safetensors file, an unknown ``model_type``, a setting tformer does not
implement, a tensor that fits nowhere: each an ``InteropError`` naming the file or the field (never an approximated
model); from the command line one line on stderr, exit 2, nothing written."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tformer.cli import main
from tformer.interop import InteropError, load_pretrained, save_pretrained
from tformer.training.checkpoint import Checkpoint, CheckpointError, load_checkpoint


@pytest.fixture
def gpt2_dir(saved, tmp_path):
    """A copy of the tiny GPT-2 directory to damage."""
    return shutil.copytree(saved("gpt2").path, tmp_path / "gpt2")


def edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    (directory / "config.json").write_text(json.dumps(config))


def test_missing_files_are_named(tmp_path, gpt2_dir):
    with pytest.raises(InteropError, match=f"{tmp_path / 'nope'}: no such file or directory"):
        load_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InteropError, match="no config.json, so not a Hugging Face model directory"):
        load_pretrained(tmp_path / "empty")
    (gpt2_dir / "model.safetensors").unlink()
    with pytest.raises(InteropError, match="no model.safetensors or model.safetensors.index.json"):
        load_pretrained(gpt2_dir)


def test_a_missing_shard_is_named(saved, tmp_path):
    saved("llama").hf.save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(InteropError, match=f"{shard}: no such file \\(listed in model.safetensors.index.json\\)"):
        load_pretrained(tmp_path)


def test_a_truncated_safetensors_file_is_named(gpt2_dir):
    weights = gpt2_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(InteropError, match=f"{weights}: cannot read the weights \\(truncated or not safetensors"):
        load_pretrained(gpt2_dir)


def test_a_config_that_is_not_json_is_named(gpt2_dir):
    (gpt2_dir / "config.json").write_text("{not json")
    with pytest.raises(InteropError, match="config.json: not valid JSON"):
        load_pretrained(gpt2_dir)


@pytest.mark.parametrize(
    ("case", "changes", "message"),
    [
        ("gpt2", {"model_type": "t5"}, "model_type 't5' is not supported; tformer loads gpt2, bert, llama"),
        ("gpt2", {"n_embd": None}, "config.json lacks 'n_embd'"),
        ("gpt2", {"activation_function": "quick_gelu"}, "activation_function='quick_gelu' is not supported"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True is not supported"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}},
            "rope_type='linear' is not supported: tformer implements the unscaled RoPE only",
        ),
        (  # transformers 5 reads rope_scaling beside a default rope_parameters: it scales, so this must refuse
            "llama",
            {"rope_scaling": {"type": "linear", "factor": 2.0}},
            "rope_type='linear' is not supported: tformer implements the unscaled RoPE only",
        ),
        ("llama", {"rope_scaling": {"factor": 4.0}}, "rope_scaling.factor=4.0 is not supported"),
        ("llama", {"head_dim": 16}, "head_dim=16 is not supported: tformer's heads are d_model / heads = 8 wide"),
        # values of the wrong kind: named with the file (they were a TypeError, a ZeroDivisionError, a float() error)
        ("llama", {"hidden_size": "32"}, "hidden_size='32' must be a positive integer"),
        ("llama", {"num_attention_heads": 0}, "num_attention_heads=0 must be a positive integer"),
        ("llama", {"num_hidden_layers": 2.0}, "num_hidden_layers=2.0 must be a positive integer"),
        ("llama", {"rms_norm_eps": "1e-5"}, "rms_norm_eps='1e-5' must be a positive number"),
        ("llama", {"rope_parameters": {"rope_theta": "abc"}}, "rope_theta='abc' must be a number > 1"),
        ("llama", {"tie_word_embeddings": "false"}, "tie_word_embeddings='false' must be true or false"),
        ("llama", {"attention_bias": True}, "attention_bias=True is not supported"),
        ("mistral", {"sliding_window": 16}, "sliding_window=16 is not supported"),
        # a window as long as every trained position: transformers drops keys past it, tformer runs on unwindowed
        ("mistral", {"sliding_window": 64, "max_position_embeddings": 64}, "sliding_window=64 is not supported"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True is not supported"),
        ("bert", {"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key' is not"),
        ("marian", {"decoder_layers": 3, "decoder_ffn_dim": 64}, "decoder_ffn_dim=64 is not supported"),
    ],
)
def test_unsupported_settings_are_refused_by_name(saved, tmp_path, case, changes, message):
    directory = shutil.copytree(saved(case).path, tmp_path / case)
    edit_config(directory, **changes)
    with pytest.raises(InteropError, match=message) as err:
        load_pretrained(directory)
    assert str(directory) in str(err.value)


def test_tensors_that_fit_nowhere_are_named(gpt2_dir):
    weights = gpt2_dir / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({**tensors, "transformer.h.0.attn.rotary.weight": torch.zeros(3)}, str(weights))
    with pytest.raises(InteropError, match="the tensor transformer.h.0.attn.rotary.weight has no place"):
        load_pretrained(gpt2_dir)
    save_file({k: v for k, v in tensors.items() if k != "transformer.h.1.ln_2.bias"}, str(weights))
    with pytest.raises(InteropError, match="the tensor transformer.h.1.ln_2.bias is missing"):
        load_pretrained(gpt2_dir)
    save_file(tensors, str(weights))
    edit_config(gpt2_dir, n_inner=64)  # the file's feed-forward is 48 wide
    with pytest.raises(InteropError, match=r"give decoder\.stack\.blocks\.0\.ff\.up\.weight the shape \(48, 32\)"):
        load_pretrained(gpt2_dir)


def test_old_gpt2_files_load(saved, tmp_path):
    """The original release: no ``transformer.`` prefix, the causal-mask buffers stored, no lm_head."""
    s = saved("gpt2")
    tensors = load_file(str(s.path / "model.safetensors"))
    old = {k.removeprefix("transformer."): v for k, v in tensors.items() if k != "lm_head.weight"}
    old |= {f"h.{i}.attn.bias": torch.tril(torch.ones(1, 1, 64, 64)) for i in range(2)}
    directory = shutil.copytree(s.path, tmp_path / "old")
    save_file(old, str(directory / "model.safetensors"))
    a, b = load_pretrained(directory).model.state_dict(), load_pretrained(s.path).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_tied_copy_that_differs_is_refused(gpt2_dir):
    weights = gpt2_dir / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + 1
    save_file(tensors, str(weights))
    with pytest.raises(InteropError, match="lm_head.weight differs from transformer.wte.weight"):
        load_pretrained(gpt2_dir)


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.strip()


@pytest.mark.parametrize("command", ["sample", "translate", "embed", "convert"])
def test_the_cli_answers_bad_checkpoints_with_one_line_and_exit_2(gpt2_dir, tmp_path, capsys, monkeypatch, command):
    edit_config(gpt2_dir, model_type="t5")
    monkeypatch.setattr(sys, "stdin", io.StringIO("a line\n"))
    args = {
        "sample": ["sample", "--checkpoint", str(gpt2_dir), "--prompt", "x"],
        "translate": ["translate", "--checkpoint", str(gpt2_dir)],
        "embed": ["embed", "--checkpoint", str(gpt2_dir)],
        "convert": ["convert", str(gpt2_dir), "--out", str(tmp_path / "out")],
    }[command]
    assert main(args) == 2
    assert one_line(capsys).startswith(f"tformer {command}: error: {gpt2_dir / 'config.json'}: model_type 't5'")
    assert not (tmp_path / "out").exists()


def test_convert_to_a_path_below_a_file_is_one_line_and_exit_2(gpt2_dir, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["convert", str(gpt2_dir), "--out", str(tmp_path / "notes.txt" / "sub")]) == 2
    assert one_line(capsys) == (
        f"tformer convert: error: --out {tmp_path / 'notes.txt' / 'sub'}: {tmp_path / 'notes.txt'} is a file, so no "
        "folder can be made under it; choose another path"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2", "notes.txt"]


def test_embed_refuses_a_decoder_even_with_no_lines_to_embed(gpt2_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["embed", "--checkpoint", str(gpt2_dir)]) == 2
    assert one_line(capsys).endswith(
        "sentence embeddings need an encoder with a tokenizer (a BERT model); this is a gpt2 model"
    )


def test_sample_given_an_encoder_names_embed(minilm_dir, capsys):
    assert main(["sample", "--checkpoint", str(minilm_dir), "--prompt", "a"]) == 2
    assert one_line(capsys) == (
        f"tformer sample: error: {minilm_dir} holds an encoder (bert); `tformer sample` needs a language model: use "
        "`tformer embed`"
    )


def test_embed_names_the_first_line_that_is_not_utf8_and_prints_nothing(minilm_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok\n\xff\nfine\n")))
    assert main(["embed", "--checkpoint", str(minilm_dir)]) == 2
    printed = capsys.readouterr()
    assert printed == ("", "tformer embed: error: line 2 is not valid UTF-8 (byte 0xff at offset 0)\n")


def test_embed_names_a_missing_tokenizer_json(saved, capsys, monkeypatch):
    bert = saved("bert").path  # HF's tiny BERT, saved without a tokenizer
    assert not (bert / "tokenizer.json").exists()
    monkeypatch.setattr(sys, "stdin", io.StringIO("a\n"))
    assert main(["embed", "--checkpoint", str(bert)]) == 2
    assert one_line(capsys).endswith(
        f"{bert}: no tokenizer.json, and sentence embeddings need the model's tokenizer: put the tokenizer.json the "
        "model was trained with beside its weights"
    )


def test_the_python_api_names_common_mistakes(saved, minilm, tmp_path, monkeypatch):
    from tformer import embed, generate

    monkeypatch.chdir(tmp_path)  # where a wrongly accepted save_pretrained would write

    with pytest.raises(TypeError, match=r"texts must be a list of strings; got a str \(wrap one text: \[text\]\)"):
        embed(minilm, "A man is eating food.")
    with pytest.raises(TypeError, match=r"^texts must be strings; texts\[1\] is a NoneType: None$"):
        embed(minilm, ["a", None])
    with pytest.raises(TypeError, match=r"^texts must be strings; texts\[0\] is a bytes: b'abc'$"):
        embed(minilm, [b"abc"])
    with pytest.raises(ValueError, match=r"^texts\[1\] is not Unicode text: '\\ud800' at index 2 is a lone surrogate$"):
        embed(minilm, ["a", "ab\ud800"])  # what the tokenizer would refuse with its own type error
    texts = ["A man is eating food.", "A man is eating a piece of bread."]
    assert torch.equal(embed(minilm, (t for t in texts)), embed(minilm, texts))  # any iterable of strings
    with pytest.raises(ValueError, match="batch_size must be >= 1; got 0"):
        embed(minilm, ["a"], batch_size=0)
    with pytest.raises(TypeError, match="embed needs what tformer.load_pretrained returns .*; got Encoder"):
        embed(minilm.model, ["a"])
    model = load_pretrained(saved("gpt2").path, dtype="bfloat16").model
    assert next(model.parameters()).dtype == torch.bfloat16  # a dtype's name works as well as the dtype
    with pytest.raises(InteropError, match="dtype='int8' is not a floating-point dtype"):
        load_pretrained(saved("gpt2").path, dtype="int8")
    with pytest.raises(InteropError, match=r"dtype=torch.int8 is not a floating-point dtype; .*tformer.quantize"):
        load_pretrained(saved("gpt2").path, dtype=torch.int8)
    with pytest.raises(InteropError, match=r"dtype='bf16' is not the name of a torch dtype; use 'float32', 'bfloat16'"):
        load_pretrained(saved("gpt2").path, dtype="bf16")  # it said "not a floating-point dtype"
    with pytest.raises(InteropError, match="device='meta' holds no data: the weights would be dropped"):
        load_pretrained(saved("gpt2").path, device="meta")
    with pytest.raises(InteropError, match="device='gpu' is not a torch device; use e.g. 'cpu' or 'cuda'"):
        load_pretrained(saved("gpt2").path, device="gpu")
    if not torch.cuda.is_available():  # a machine without CUDA: the error comes before loading, naming the device
        with pytest.raises(InteropError, match=r"device='cuda' is not available here .*; use device='cpu'"):
            load_pretrained(saved("gpt2").path, device="cuda")
    missing = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda:0"
    with pytest.raises(InteropError, match=f"device='{missing}' is not available here"):
        load_pretrained(saved("gpt2").path, device=missing)
    with pytest.raises(TypeError, match="pass pretrained.model .*, not the Pretrained"):
        save_pretrained(minilm, "never-written")
    with pytest.raises(TypeError, match="save_pretrained takes a tformer model .*; got dict"):
        save_pretrained({}, "never-written")
    with pytest.raises(
        TypeError, match=r"save_pretrained takes a tformer model .*; got Checkpoint \(pass its \.model\)$"
    ):
        save_pretrained(
            Checkpoint(model, None, "lm", model.cfg, 0, {}, Path()), "never-written"
        )  # what load_checkpoint returns
    with pytest.raises(TypeError, match=r"prompt_ids must be a list of prompts.*wrap one prompt, \[ids\]"):
        generate(model, [3, 4, 5], max_new_tokens=2)


@pytest.mark.parametrize("command", ["sample", "convert"])
def test_weights_without_config_json_are_named_as_a_hugging_face_directory_missing_it(
    gpt2_dir, tmp_path, capsys, command
):
    (gpt2_dir / "config.json").unlink()
    args = {
        "sample": ["sample", "--checkpoint", str(gpt2_dir), "--prompt", "x"],
        "convert": ["convert", str(gpt2_dir), "--out", str(tmp_path / "out")],
    }[command]
    assert main(args) == 2
    assert one_line(capsys).endswith(
        "(it holds model.safetensors but no config.json, which a Hugging Face model directory needs beside its weights)"
    )
    assert not (tmp_path / "out").exists()


def test_a_folder_it_cannot_write_is_one_error_naming_it(saved, tmp_path, read_only):
    model = load_pretrained(saved("gpt2").path).model
    with pytest.raises(InteropError, match=r"/ro/out: cannot write there \(Permission denied\); choose a folder"):
        save_pretrained(model, read_only / "out")
    assert os.listdir(tmp_path) == []


def test_a_path_under_a_file_is_named_as_such(saved, tmp_path):
    """It said "cannot write there (File exists)", naming neither the file nor why."""
    model = load_pretrained(saved("gpt2").path).model
    (tmp_path / "afile").write_text("x")
    with pytest.raises(InteropError, match=rf"sub/out: {tmp_path / 'afile'} is a file, so no folder can be made"):
        save_pretrained(model, tmp_path / "afile" / "sub" / "out")
    assert os.listdir(tmp_path) == ["afile"]


def test_a_hugging_face_directory_given_to_load_checkpoint_names_load_pretrained(gpt2_dir):
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(gpt2_dir)
    assert str(error.value).endswith(
        "(it is a Hugging Face model directory (config.json): load it with tformer.load_pretrained)"
    )


def test_a_file_given_as_a_run_names_the_formats_that_load(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    assert main(["sample", "--checkpoint", str(notes), "--prompt", "x"]) == 2
    line = one_line(capsys)
    assert f"{notes}: not a checkpoint" in line and "a .gguf file" in line


def test_special_ids_that_are_not_token_ids_are_named(saved, tmp_path):
    """2.7 was read as 2 and "2" as 2 without a word."""
    directory = shutil.copytree(saved("llama").path, tmp_path / "llama")
    for value, shown in ((2.7, "2.7"), ("2", "'2'"), ([2, True], r"\[2, True\]")):
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
        with pytest.raises(InteropError, match=rf"eos_token_id={shown} must be a token id \(an integer\) or a list"):
            load_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5], "pad_token_id": -1}))
    assert load_pretrained(directory).generation.eos == (2, 5)  # a pad of -1 (old Llama conversions) is kept
