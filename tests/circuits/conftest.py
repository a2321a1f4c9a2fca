"""The real SmolLM2, loaded once for the slow tests of this folder."""

from __future__ import annotations

import pytest

from tformer import load_pretrained


@pytest.fixture(scope="session")
def smollm(tmp_path_factory):
    """tformer's SmolLM2-135M (float32, dequantized from the installed Q4_1 file; the conversion goes to a session
    folder, never to ~/.cache)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TFORMER_CACHE", str(tmp_path_factory.mktemp("tformer-cache")))
        yield load_pretrained("smollm2")
