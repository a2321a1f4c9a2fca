"""Evaluation: the benchmarks' scores of any model tformer loads, under lm-evaluation-harness's or lighteval's
protocol, each figure with its standard error (``tformer eval``, :func:`evaluate`).

Modules: ``data`` (the sets, read from files), ``tasks`` (documents -> requests, per protocol), ``protocols`` (the
rules, with their sources), ``scoring`` (log-likelihoods, one pass per shared context), ``metrics`` (figures and
standard errors), ``model`` (what is evaluated), ``runner`` (:func:`evaluate`), ``lm_eval`` (the
lm-evaluation-harness model ``tformer``). docs/evaluation.md describes them. The names below are imported on first
use, so that the command line lists the tasks without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EvalError": "tformer.evaluation.data",
    "PROTOCOLS": "tformer.evaluation.protocols",
    "TASKS": "tformer.evaluation.tasks",
    "evaluate": "tformer.evaluation.runner",
    "table": "tformer.evaluation.runner",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tformer.evaluation' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
