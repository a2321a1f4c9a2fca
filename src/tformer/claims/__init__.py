"""Check the symbolic claims of a derivation with sympy, safely: ``tformer verify-claims``.

A claims file is a JSON list of objects ``{"claim": "<text>", "code": "<python>"}``. Each ``code`` may use
an allow-list of sympy names without importing them (``symbols``, ``exp``, ``diff``, ``simplify``,
``Matrix``, ``limit``, ``oo``, ...; see :data:`tformer.claims.worker.SYMPY_NAMES`) and harmless builtins
(``range``, ``len``, ``sum``, comprehensions, lambdas, ...), and must set ``result`` to a Python bool or a
sympy ``true``/``false``. Each claim gets one of four verdicts:

* ``PASS`` / ``FAIL``: ``result`` is true / false;
* ``ERROR``: the code was rejected before running, raised, never set ``result`` or set it to anything else
  (an unevaluated ``Eq(...)`` included: sympy could not decide it; compare ``simplify(lhs - rhs) == 0``);
* ``TIMEOUT``: it ran past the wall-clock or CPU-time limit.

Security model (details in :mod:`tformer.claims.worker`): claims files may come from strangers, so each
snippet is checked against a compile-time policy here (our AST rules, then RestrictedPython's
``compile_restricted``), and only then run in its own ``python -I`` process with a restricted namespace,
CPU/memory/file-size limits and an audit hook, while this process enforces the wall-clock limit. Defense
in depth, not a container.

Usage::

    tformer verify-claims claims.json [--json] [--timeout 10] [--memory-mb 1024] [--jobs N]
    tformer verify-claims --builtin seed          # or: --builtin derivations
    python -m tformer.claims claims.json

Exit codes: 0 every claim passed; 1 some claim failed, errored or timed out; 2 unusable input: no such file,
malformed JSON, an entry that is not a ``{"claim": str, "code": str}`` object, an empty list (nothing checked
is not a pass), or a bad option.
"""

from tformer.claims.checker import (
    BUILTIN_CLAIMS,
    DEFAULT_MEMORY_MB,
    DEFAULT_TIMEOUT_S,
    STATUSES,
    Claim,
    ClaimResult,
    ClaimsInputError,
    Limits,
    builtin_claims,
    check_claim,
    check_claims,
    format_row,
    iter_check_claims,
    load_claims,
    parse_claims,
    summarize,
    summary_line,
)

__all__ = [
    "BUILTIN_CLAIMS",
    "DEFAULT_MEMORY_MB",
    "DEFAULT_TIMEOUT_S",
    "STATUSES",
    "Claim",
    "ClaimResult",
    "ClaimsInputError",
    "Limits",
    "builtin_claims",
    "check_claim",
    "check_claims",
    "format_row",
    "iter_check_claims",
    "load_claims",
    "parse_claims",
    "summarize",
    "summary_line",
]
