"""Checkpoints: exact round trips, tied weights stored once, torch.compile key prefixes both ways, clear errors
for truncated/corrupted/foreign directories, pruning, and crash safety under kill -9 at random moments."""

import hashlib
import json
import os
import random
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tformer import DecoderLM, EncoderDecoder, TransformerConfig
from tformer.tokenizers import SEQ2SEQ_SPECIALS, ByteTokenizer, CharTokenizer
from tformer.training.checkpoint import (
    CheckpointError,
    find_latest,
    list_checkpoints,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
)


def _save(out, kind="lm", step=7, **kwargs):
    tok = ByteTokenizer(SEQ2SEQ_SPECIALS if kind == "seq2seq" else ())
    torch.manual_seed(step)
    model = (DecoderLM if kind == "lm" else EncoderDecoder)(TransformerConfig.tiny(vocab_size=tok.vocab_size))
    path = save_checkpoint(out, model=model, tokenizer=tok, kind=kind, step=step, train_config={"lr": 0.5}, **kwargs)
    return model, path


@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
def test_round_trip(tmp_path, kind):
    model, path = _save(tmp_path, kind, trainer_state={"optimizer": {"x": torch.arange(3)}})
    assert path == tmp_path / "checkpoints" / "step-000007"
    ckpt = load_checkpoint(tmp_path, with_state=True)
    assert (ckpt.kind, ckpt.step, ckpt.train_config, ckpt.path) == (kind, 7, {"lr": 0.5}, path)
    assert ckpt.config == model.cfg and not ckpt.model.training and isinstance(ckpt.model, type(model))
    for (name, a), (_, b) in zip(model.state_dict().items(), ckpt.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert ckpt.tokenizer.vocab_size == model.cfg.vocab_size
    assert torch.equal(ckpt.trainer_state["optimizer"]["x"], torch.arange(3))
    assert load_checkpoint(path).step == 7  # the step directory itself works too
    assert load_checkpoint(tmp_path / "checkpoints").step == 7
    if kind == "seq2seq":  # one tied matrix stored once, and tied again after loading
        keys = load_file(str(path / "model.safetensors")).keys()
        assert sum(k.endswith("embed.tokens.weight") for k in keys) == 1
        assert ckpt.model.encoder.embed.tokens.weight is ckpt.model.decoder.embed.tokens.weight
        assert (ckpt.tokenizer.bos_id, ckpt.tokenizer.eos_id, ckpt.tokenizer.pad_id) == (1, 2, 0)


def test_compiled_and_plain_models_exchange_weights(tmp_path):
    cfg = TransformerConfig.tiny(vocab_size=256)
    torch.manual_seed(0)
    plain = DecoderLM(cfg)
    compiled = torch.compile(DecoderLM(cfg))  # lazy: nothing is compiled unless it runs
    assert next(iter(compiled.state_dict())).startswith("_orig_mod.")
    # saved from the compiled model: plain keys on disk, loads into a plain model
    path = save_checkpoint(
        tmp_path / "a", model=compiled, tokenizer=ByteTokenizer(), kind="lm", step=1, train_config={}
    )
    assert not any(k.startswith("_orig_mod.") for k in load_file(str(path / "model.safetensors")))
    ckpt = load_checkpoint(path)
    torch.testing.assert_close(ckpt.model.state_dict(), compiled._orig_mod.state_dict(), rtol=0, atol=0)
    # a foreign file with prefixed keys loads into plain and compiled models alike
    prefixed = tmp_path / "prefixed.safetensors"
    save_file({k: v.contiguous() for k, v in torch.compile(plain).state_dict().items()}, str(prefixed))
    for target in (DecoderLM(cfg), torch.compile(DecoderLM(cfg))):
        load_model_weights(target, prefixed)
        torch.testing.assert_close(
            getattr(target, "_orig_mod", target).state_dict(), plain.state_dict(), rtol=0, atol=0
        )


def test_weights_of_another_model_are_refused(tmp_path):
    _, path = _save(tmp_path)
    with pytest.raises(CheckpointError, match="shape"):
        load_model_weights(DecoderLM(TransformerConfig.tiny(vocab_size=256, d_model=64)), path / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing"):
        load_model_weights(EncoderDecoder(TransformerConfig.tiny(vocab_size=256)), path / "model.safetensors")


def test_a_quantized_model_is_refused_before_anything_is_written(tmp_path):
    """int8 codes and scales are not the weights a checkpoint's model is built with: ``load_checkpoint`` could not
    read them back, so saving refuses them (as ``save_pretrained`` does) and leaves no directory behind."""
    from tformer import quantize

    model = quantize(DecoderLM(TransformerConfig.tiny(vocab_size=256)))
    with pytest.raises(ValueError, match=r"quantized \(int8\) model cannot be saved as a checkpoint"):
        save_checkpoint(tmp_path / "run", model=model, tokenizer=ByteTokenizer(), kind="lm", step=1, train_config={})
    assert not (tmp_path / "run").exists()


def test_truncated_corrupted_and_foreign_directories_are_clear_errors(tmp_path):
    _, path = _save(tmp_path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: \d+ bytes, the manifest says \d+"):
        load_checkpoint(tmp_path)
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupted: its SHA-256 differs"):
        load_checkpoint(tmp_path)
    weights.write_bytes(data)
    manifest = path / "checkpoint.json"
    text = manifest.read_text()
    manifest.write_text(text[:40])
    with pytest.raises(CheckpointError, match=r"checkpoint\.json: not valid JSON"):
        load_checkpoint(path)
    manifest.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="not a tformer checkpoint manifest"):
        load_checkpoint(path)
    manifest.write_text(text)
    (path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: missing"):
        load_checkpoint(path)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "pytorch_model.bin").write_bytes(b"\0" * 10)
    with pytest.raises(CheckpointError, match="foreign: not a tformer checkpoint"):
        load_checkpoint(foreign)
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="holds no trainer_state.pt"):
        _save(tmp_path / "w")
        load_checkpoint(tmp_path / "w", with_state=True)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda m: m["files"].update({"model.safetensors": {}}),
            r'field "files"\["model.safetensors"\]\["bytes"\] is missing',
        ),
        (
            lambda m: m["files"]["model.safetensors"].update(bytes="72944"),
            r'field "files"\["model.safetensors"\]\["bytes"\] must be a non-negative integer; got "72944"',
        ),
        (
            lambda m: m["files"]["tokenizer.json"].update(sha256=None),
            r'field "files"\["tokenizer.json"\]\["sha256"\] must be 64 lowercase hex digits; got null',
        ),
        (
            lambda m: m["files"].update({"model.safetensors": [1]}),
            r'field "files"\["model.safetensors"\] must be an object',
        ),
        (lambda m: m.update(step="abc"), r'field "step" must be a non-negative integer; got "abc"'),
        (lambda m: m.update(step=True), r'field "step" must be a non-negative integer; got true'),
        (lambda m: m.update(files=[]), r'field "files" must be an object; got \[\]'),
        (lambda m: m.update(train_config="lr=1"), r'field "train_config" must be an object'),
        (
            lambda m: m["files"].update({"../../../../etc/hostname": m["files"]["tokenizer.json"]}),
            r'field "files"\["../../../../etc/hostname"\]: a file name must be a plain name inside the checkpoint',
        ),
        (lambda m: m["files"].update({"..": m["files"]["tokenizer.json"]}), r'field "files"\[".."\]: a file name'),
    ],
)
def test_hand_edited_manifests_are_errors_naming_the_manifest_and_field(tmp_path, edit, message):
    _, path = _save(tmp_path)
    manifest = json.loads((path / "checkpoint.json").read_text())
    edit(manifest)
    (path / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"step-000007/checkpoint\.json: " + message):
        load_checkpoint(tmp_path)


def test_a_folder_it_cannot_write_is_a_checkpoint_error_naming_it(tmp_path, read_only):
    message = r"/ro/run: cannot write a checkpoint there \(Permission denied\); choose another"
    with pytest.raises(CheckpointError, match=message):
        _save(read_only / "run")
    assert os.listdir(tmp_path) == []


def test_every_checkpoint_file_gets_the_mode_open_gives(tmp_path):
    old = os.umask(0o027)
    try:
        _, path = _save(tmp_path / "a", trainer_state={"x": 1})
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}
    assert modes == dict.fromkeys(["checkpoint.json", "model.safetensors", "tokenizer.json", "trainer_state.pt"], 0o640)


def test_tokenizer_of_a_different_model_is_refused(tmp_path):
    _, path = _save(tmp_path)
    tok = CharTokenizer([chr(i) for i in range(300, 700)])  # 401 tokens for a 256-token model
    tok.save(path)
    manifest = json.loads((path / "checkpoint.json").read_text())
    blob = (path / "tokenizer.json").read_bytes()
    manifest["files"]["tokenizer.json"] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (path / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="tokenizer has 401 tokens but the model only 256"):
        load_checkpoint(path)
    manifest["files"].pop("tokenizer.json")
    (path / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not list tokenizer.json"):
        load_checkpoint(path)


def test_pruning_keeps_the_newest_and_ignores_leftovers(tmp_path):
    for step in (1, 2, 3, 10):
        _save(tmp_path, step=step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step-000003", "step-000010"]
    (tmp_path / "checkpoints" / ".tmp-step-000011-123-abc").mkdir()  # a crash mid-write
    assert find_latest(tmp_path).name == "step-000010"
    assert load_checkpoint(tmp_path).step == 10
    _save(tmp_path, step=10)  # the same step again replaces it
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step-000003", "step-000010"]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # the leftover is cleaned by the next save


def test_a_run_read_while_its_training_prunes_the_checkpoint_gives_the_newer_one(tmp_path, monkeypatch):
    """The reader picks step 1; before it reads the weights, the live run saves steps 2 and 3 and prunes step 1
    (keep=1). Reading the run directory gives step 3; reading step 1's own directory stays an error."""
    from tformer.training import checkpoint

    _save(tmp_path, step=1, keep=1)
    read, calls = checkpoint.load_model_weights, []

    def racing_read(model, path):
        calls.append(path.parent.name)
        if len(calls) == 1:
            first = tmp_path / "checkpoints" / "step-000001"
            _save(tmp_path, step=2, keep=1)
            _save(tmp_path, step=3, keep=1)
            assert not first.exists()
        read(model, path)

    monkeypatch.setattr(checkpoint, "load_model_weights", racing_read)
    assert load_checkpoint(tmp_path).step == 3
    assert calls == ["step-000001", "step-000003"]
    monkeypatch.setattr(checkpoint, "load_model_weights", read)
    with pytest.raises(CheckpointError, match="step-000001: no such file"):
        load_checkpoint(tmp_path / "checkpoints" / "step-000001")


def _train_command(out, corpus, cache, *extra):
    return [
        sys.executable,
        "-m",
        "tformer",
        "train",
        "--out",
        str(out),
        "--data",
        str(corpus),
        "--steps",
        "100000",
        "--batch-size",
        "4",
        "--block-size",
        "16",
        "--d-model",
        "32",
        "--layers",
        "1",
        "--heads",
        "2",
        "--d-ff",
        "32",
        "--save-every",
        "1",
        "--eval-every",
        "0",
        "--log-every",
        "1",
        "--no-progress",
        "--cache-dir",
        str(cache),
        *extra,
    ]


@pytest.mark.slow
def test_kill_9_at_random_moments_leaves_a_loadable_checkpoint(tmp_path):
    """Checkpoint after every step, kill -9 at random moments (mostly mid-write), each time load and resume."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abcdefghij klmnop\n" * 200)
    out, rng = tmp_path / "run", random.Random(0)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    last_step = 0
    for attempt in range(3):
        extra = ["--resume"] if attempt else []
        proc = subprocess.Popen(
            _train_command(out, corpus, tmp_path / "cache", *extra),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 60
        # the step from the newest directory's name: loading it here would race the live run, which prunes old ones
        while (latest := find_latest(out)) is None or int(latest.name.removeprefix("step-")) <= last_step:
            assert time.monotonic() < deadline, "no new checkpoint within 60 s"
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ckpt = load_checkpoint(out, with_state=True)  # never half-written
        moments = ckpt.trainer_state["optimizer"]["state"].values()  # AdamW's state of this very step
        assert ckpt.step > last_step and all(int(m["step"]) == ckpt.step for m in moments)
        last_step = ckpt.step


def test_a_triton_model_loads_on_the_cpu_with_an_exact_backend(tmp_path):
    tok = ByteTokenizer()
    model = DecoderLM(TransformerConfig.tiny(vocab_size=tok.vocab_size, attn_backend="triton"))
    save_checkpoint(tmp_path, model=model, tokenizer=tok, kind="lm", step=1, train_config={})
    assert load_checkpoint(tmp_path).config.attn_backend == "auto"  # the Triton kernels need a CUDA device
    assert load_checkpoint(tmp_path, attn_backend="tiled").model.cfg.attn_backend == "tiled"
    with pytest.raises(ValueError, match="attn_backend='flash' is unknown"):
        load_checkpoint(tmp_path, attn_backend="flash")
