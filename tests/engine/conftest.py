"""The engine's tests: those marked ``kernels`` build tformer's C++ kernels first, or skip saying why."""

from __future__ import annotations

import pytest

from tformer.engine import kernels

NO_COMPILER = "no C++ compiler here (CXX, else c++ on PATH): the kernels cannot be built"


@pytest.fixture(scope="module")
def kernels_built() -> None:
    """Build the kernels before a module's first test (a test run alone with ``-k`` does not depend on an earlier
    one having built them); without a compiler, skip it, saying so."""
    if kernels.compiler() is None:
        pytest.skip(NO_COMPILER)
    assert kernels.ready(), kernels.build_error()
