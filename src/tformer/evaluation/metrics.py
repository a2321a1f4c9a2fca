"""The figures of an evaluation and their standard errors.

Every figure is a statistic of per-example values, and each comes with its standard error (SE) over examples:

* accuracy: the mean of 0/1 values; ``SE = s / sqrt(n)`` with ``s`` the sample standard deviation (``n - 1``), as
  lm-evaluation-harness's ``mean_stderr``;
* a ratio of sums, ``R = sum(a) / sum(b)`` (log-likelihood per word or byte: perplexities and bits per byte): the
  delta method, ``SE(R) = sqrt(sum((a_i - R b_i)^2) / (n (n - 1))) / mean(b)``; a monotone function ``f(R)`` of it
  (``exp(-R)``) has ``SE = |f'(R)| SE(R)``;
* Spearman's rho between two lists: the Pearson correlation of their ranks (ties share the mean rank); its SE by
  Fisher's z with Bonett and Wright's variance (Psychometrika 65, 2000): ``var(z) = (1 + rho^2 / 2) / (n - 3)`` and
  ``SE(rho) = (1 - rho^2) sqrt(var(z))``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    """One reported number: its value, its standard error and the examples it was computed on."""

    value: float
    stderr: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        return {"value": self.value, "stderr": self.stderr, "n": self.n}


def mean_figure(values: Sequence[float]) -> Figure:
    """The mean of ``values`` with ``SE = s / sqrt(n)`` (``s`` with ``n - 1``; ``nan`` for fewer than 2 values)."""
    n = len(values)
    if n == 0:
        return Figure(math.nan, math.nan, 0)
    mu = sum(values) / n
    if n < 2:
        return Figure(mu, math.nan, n)
    var = sum((x - mu) ** 2 for x in values) / (n - 1)
    return Figure(mu, math.sqrt(var / n), n)


def ratio_figure(a: Sequence[float], b: Sequence[float]) -> Figure:
    """``R = sum(a) / sum(b)`` with its delta-method standard error (module docstring)."""
    n = len(a)
    if n == 0 or sum(b) == 0:
        return Figure(math.nan, math.nan, n)
    r = sum(a) / sum(b)
    if n < 2:
        return Figure(r, math.nan, n)
    mean_b = sum(b) / n
    var = sum((ai - r * bi) ** 2 for ai, bi in zip(a, b, strict=True)) / (n * (n - 1))
    return Figure(r, math.sqrt(var) / mean_b, n)


def exp_neg(fig: Figure) -> Figure:
    """``exp(-x)`` of a figure (a perplexity from a mean log-likelihood): ``SE = exp(-x) SE(x)``."""
    value = math.exp(-fig.value)
    return Figure(value, value * fig.stderr, fig.n)


def scaled(fig: Figure, factor: float) -> Figure:
    """``factor * x`` (bits per byte from nats per byte: ``-1 / ln 2``); the SE scales by ``|factor|``."""
    return Figure(factor * fig.value, abs(factor) * fig.stderr, fig.n)


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of ``values``; tied values share the mean of their ranks (as ``scipy.stats.rankdata``)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else math.nan


def spearman_figure(x: Sequence[float], y: Sequence[float]) -> Figure:
    """Spearman's rho of ``x`` and ``y`` with its Fisher-z standard error (module docstring)."""
    n = len(x)
    if n < 4:
        raise ValueError(f"Spearman's rho needs at least 4 pairs; got {n}")
    rho = pearson(ranks(x), ranks(y))
    return Figure(rho, (1 - rho**2) * math.sqrt((1 + rho**2 / 2) / (n - 3)), n)
