"""Experiments that check the source document's claims on running tformer code.

Each experiment is one small module holding the claim it shows (``QUESTION``, ``TITLE``, ``CLAIM``), the sizes
the report runs it at (``SIZES["quick"]``, ``SIZES["report"]``) and a typed ``run(...)`` returning a dataclass
with the measured figures as data plus ``tables()``, ``findings()`` and ``plot(out_dir)``. Tests call ``run``
directly on tiny sizes; ``tformer experiment NAME`` and ``tformer report`` are thin skins over it.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from tformer.experiments._common import ExperimentResult, Table, fit_power_law

Size = Literal["quick", "report"]
SIZE_NAMES: tuple[str, ...] = ("quick", "report")

# name -> module, in the order of the source document's questions
EXPERIMENTS: dict[str, str] = {
    "scaling": "tformer.experiments.scaling",  # Q1(a)
    "saturation": "tformer.experiments.saturation",  # Q1(b)
    "complexity": "tformer.experiments.complexity",  # Q1(c), Q1(d)
    "mha-params": "tformer.experiments.mha_params",  # Q2(a)
    "positions": "tformer.experiments.positions",  # Q2(b), Q2(c)
    "masking": "tformer.experiments.masking",  # Q3(a)
    "layernorm": "tformer.experiments.layernorm",  # Q3(b)
    "attention-maps": "tformer.experiments.attention_maps",  # Q3(c)
    "circuits": "tformer.experiments.circuits",  # beyond the source: induction heads, logit attribution
    "evaluation": "tformer.experiments.evaluation",  # beyond the source: benchmark scores against model cards
}


def load(name: str) -> ModuleType:
    """The module of experiment ``name``; a clear error listing the known names otherwise."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; known experiments: {', '.join(EXPERIMENTS)}")
    return importlib.import_module(EXPERIMENTS[name])


def run_experiment(name: str, size: Size = "report", **overrides: Any) -> ExperimentResult:
    """Run experiment ``name`` at the preset ``size`` (``"quick"`` or ``"report"``), with keyword overrides."""
    if size not in SIZE_NAMES:
        raise ValueError(f"unknown size {size!r}; choose one of {SIZE_NAMES}")
    module = load(name)
    return module.run(**{**module.SIZES[size], **overrides})


def __getattr__(name: str) -> Any:
    """``ExperimentResult``, ``Table`` and ``fit_power_law`` on first use: the command line lists the experiments
    (``EXPERIMENTS``) without importing torch."""
    if name in ("ExperimentResult", "Table", "fit_power_law"):
        from tformer.experiments import _common

        return getattr(_common, name)
    raise AttributeError(f"module 'tformer.experiments' has no attribute {name!r}")


__all__ = ["EXPERIMENTS", "ExperimentResult", "Size", "Table", "fit_power_law", "load", "run_experiment"]
