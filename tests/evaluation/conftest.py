"""Fixtures of the evaluation tests: a tiny Llama written as a GGUF file (read by tformer and by ``transformers``),
a small multiple-choice file and a text file in its 26-letter vocabulary."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="the reference model of these tests is transformers' (the dev extra)")

# Contexts and choices in the tiny vocabulary (lowercase letters and spaces); one choice shares its first letters
# with another (the length normalizations then disagree with the raw sums on some rows)
QUESTIONS = [
    ("the cat sat on the", ["mat", "hat", "theory"], 0),
    ("a dog ran in", ["the park", "a car", "there"], 1),
    ("she ate an", ["apple", "orange", "egg"], 2),
    ("when it rains we", ["run inside", "get wet", "sing"], 0),
    ("in winter the", ["snow falls", "sun burns"], 1),
    ("quiet", ["river", "mountain", "sea", "lake"], 3),
]
TEXT = "the quick brown fox jumps over the lazy dog\n\nthen there were three in the thin hut\n\nan ant and an owl"


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """A tiny random Llama (tests/interop's) as a float32 GGUF file with its byte-level BPE vocabulary."""
    from tests.interop.gguf_files import write_llama_gguf
    from tests.interop.hf_models import tiny_hf

    folder = tmp_path_factory.mktemp("tiny-gguf")
    return write_llama_gguf(folder / "tiny.gguf", tiny_hf("llama", seed=3))


@pytest.fixture(scope="session")
def tiny(tiny_gguf, tmp_path_factory):
    """tformer's reading of the tiny GGUF (its conversion cached in a session folder, never in ~/.cache)."""
    from tformer import load_pretrained

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TFORMER_CACHE", str(tmp_path_factory.mktemp("tformer-cache")))
        yield load_pretrained(tiny_gguf)


@pytest.fixture(scope="session")
def hf_tiny(tiny_gguf):
    """The reference: ``transformers`` reading the same GGUF file, float32."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    return model.eval(), tok


@pytest.fixture(scope="session")
def choices_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "mc.jsonl"
    lines = [json.dumps({"context": c, "choices": ch, "gold": g}) for c, ch, g in QUESTIONS]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path
