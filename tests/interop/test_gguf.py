"""GGUF files: llama.cpp's Q/K row permutation undone, the hyper-parameters read from the metadata, quantized tensors
dequantized as ``transformers`` dequantizes them, the tokenizer from ``tokenizer.ggml.*``, the conversion cached, and
files tformer cannot read refused by field. The files are tiny ones written with the ``gguf`` package's writer
(tests/interop/gguf_files.py); the real SmolLM2 file is in test_real_checkpoints.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import pytest
import torch
import transformers

from tests.interop.gguf_files import write_llama_gguf
from tests.interop.hf_models import TOL, batch, ours, real_error, theirs, tiny_hf
from tformer.functional import apply_rotary
from tformer.interop import InteropError, load_pretrained, save_pretrained
from tformer.interop.gguf import cache_folder, cached_directory, permute, unpermute
from tformer.tokenizers import tokenizer_from_dict

Q8_0 = gguf.GGMLQuantizationType.Q8_0


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Each test converts into its own cache (never the user's ~/.cache)."""
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_unpermute_inverts_llama_cpps_permutation_and_turns_adjacent_pairs_into_halves():
    """llama.cpp permutes each head's q/k rows so that RoPE on adjacent pairs of the permuted projection is RoPE
    on halves of the original one: the permutation is the whole difference between the two pair layouts."""
    heads, D, C, T = 3, 8, 5, 7
    w = torch.randn(heads * D, C, dtype=torch.float64)
    assert torch.equal(unpermute(permute(w, heads), heads), w)
    assert not torch.equal(permute(w, heads), w)
    x = torch.randn(T, C, dtype=torch.float64)
    positions = torch.arange(T)
    half = apply_rotary((x @ w.T).view(T, heads, D).transpose(0, 1), positions, interleaved=False)  # (H, T, D)
    pairs = apply_rotary((x @ permute(w, heads).T).view(T, heads, D).transpose(0, 1), positions, interleaved=True)
    assert torch.allclose(pairs, half.view(heads, T, 2, D // 2).transpose(-1, -2).reshape(heads, T, D))


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F32, Q8_0])
def test_a_gguf_llama_equals_transformers_loading_the_same_file(tmp_path, qtype):
    hf = tiny_hf("llama-tied")
    path = write_llama_gguf(tmp_path / "tiny.gguf", hf, qtype=qtype)
    pretrained = load_pretrained(path)
    assert pretrained.family == "llama" and pretrained.path == path
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()
    b = batch("lm")
    assert real_error("lm", b, ours(pretrained.model, "lm", b), theirs(reference, "lm", b)) < TOL
    quantized = real_error("lm", b, ours(pretrained.model, "lm", b), theirs(hf, "lm", b))
    assert (quantized < TOL) == (qtype != Q8_0)  # Q8_0 rounds the weights: the float32 original is not matched


def test_a_gguf_file_without_tokenizer_metadata_loads_its_model_alone(tmp_path):
    """No tokenizer and no llama.vocab_size: the vocabulary is the embedding's rows (it was "vocab_size ... got 0")."""
    hf = tiny_hf("llama-tied")
    pretrained = load_pretrained(write_llama_gguf(tmp_path / "bare.gguf", hf, tokenizer=False))
    assert pretrained.tokenizer is None and pretrained.model.cfg.vocab_size == hf.config.vocab_size
    b = batch("lm")
    assert real_error("lm", b, ours(pretrained.model, "lm", b), theirs(hf, "lm", b)) < TOL


def test_the_gguf_tokenizer_matches_transformers(tmp_path):
    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_hf("llama-tied"))
    ours_tok = load_pretrained(path).tokenizer
    theirs_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["the ther in", "an inert thing", " leading space", "<|im_start|>the<|im_end|>"]:
        ids = ours_tok.encode(text)
        assert ids == theirs_tok(text, add_special_tokens=False).input_ids
        assert ours_tok.decode(ids) == theirs_tok.decode(ids) == text
    assert (ours_tok.bos_id, ours_tok.eos_id) == (1, 2)


def test_an_export_of_the_loaded_model_keeps_the_files_chat_template(tmp_path):
    """What the file's tokenizer_config.json holds besides the special tokens (here its chat template) reaches
    ``save_pretrained``'s directory, whether the tokenizer comes from the load or from a tformer run's record of it."""
    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_hf("llama-tied"), chat_template=template)
    pretrained = load_pretrained(path)
    assert pretrained.tokenizer.settings["chat_template"] == template
    recorded = tokenizer_from_dict(json.loads(json.dumps(pretrained.tokenizer.to_dict())))  # as a run stores it
    chat = [{"role": "user", "content": "the"}]
    for name, tokenizer in [("loaded", pretrained.tokenizer), ("recorded", recorded)]:
        out = save_pretrained(pretrained.model, tmp_path / name, tokenizer=tokenizer)
        theirs_tok = transformers.AutoTokenizer.from_pretrained(out)
        assert theirs_tok.chat_template == template
        assert theirs_tok.apply_chat_template(chat, tokenize=False) == "<|im_start|>the<|im_end|>"
        assert (theirs_tok.bos_token, theirs_tok.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_the_conversion_is_cached_and_renewed_when_the_file_changes(tmp_path, cache):
    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_hf("llama-tied"))
    first = cached_directory(path)
    assert first.parent == cache / "gguf" and (first / "model.safetensors").is_file()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert cached_directory(path) == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))  # the file changed (its mtime): a new conversion
    assert cached_directory(path) != first
    a, b = load_pretrained(path).model.state_dict(), load_pretrained(first).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_damaged_cached_conversion_is_converted_again_with_a_warning(tmp_path):
    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_hf("llama-tied"))
    folder = cached_directory(path)
    weights = folder / "model.safetensors"
    whole = weights.read_bytes()
    expected = load_pretrained(path).model.state_dict()
    weights.write_bytes(whole[:100])  # e.g. a disk that filled up after the rename
    with pytest.warns(RuntimeWarning, match="the cached conversion of .*tiny.gguf could not be read .*converting it"):
        model = load_pretrained(path).model
    assert all(torch.equal(t, expected[k]) for k, t in model.state_dict().items())
    assert cached_directory(path) == folder and weights.read_bytes() == whole
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # the damaged copy is gone


@pytest.mark.subprocess
def test_a_conversion_killed_midway_leaves_a_folder_the_next_one_removes(tmp_path):
    """A ``kill -9`` leaves ``.tmp-NAME-PID-HEX`` (an interrupted write removes its own): the next write of NAME
    removes those of processes that no longer run, and leaves a running one's and other names' alone."""
    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_hf("llama-tied"))
    folder = cache_folder(path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)  # a process that has exited (and been waited for)
    abandoned = folder.with_name(f".tmp-{folder.name}-{dead}-0123abcd")
    running = folder.with_name(f".tmp-{folder.name}-{os.getpid()}-0123abcd")
    other = folder.with_name(f".tmp-{folder.name}x-{dead}-0123abcd")
    for leftover in (abandoned, running, other):
        leftover.mkdir(parents=True)
        (leftover / "model.safetensors").write_bytes(b"half")
    assert cached_directory(path) == folder
    assert not abandoned.exists() and running.is_dir() and other.is_dir()


def test_without_a_writable_cache_it_converts_for_the_one_load(tmp_path, monkeypatch):
    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_hf("llama-tied"))
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "not-a-folder"))  # mkdir inside it fails
    b = batch("lm")
    model = load_pretrained(path).model
    assert real_error("lm", b, ours(model, "lm", b), theirs(tiny_hf("llama-tied"), "lm", b)) < TOL


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"arch": "gpt2"}, "general.architecture='gpt2' is not supported: tformer reads GGUF files of the llama"),
        ({"rope_scaling": "linear"}, "llama.rope.scaling.type='linear' is not supported"),
        ({"rope_factor": 4.0}, "llama.rope.scaling.factor=4.0 is not supported"),  # a factor without a type
    ],
)
def test_gguf_files_tformer_cannot_read_are_refused_by_field(tmp_path, changes, message):
    path = write_llama_gguf(tmp_path / "x.gguf", tiny_hf("llama-tied"), **changes)
    with pytest.raises(InteropError, match=message) as err:
        load_pretrained(path)
    assert str(path) in str(err.value)
    assert not any((tmp_path / "cache").rglob("model.safetensors"))


def test_a_damaged_gguf_file_is_refused(tmp_path):
    path = write_llama_gguf(tmp_path / "x.gguf", tiny_hf("llama-tied"))
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(InteropError, match=f"{path}: not a readable GGUF file"):
        load_pretrained(path)
