"""Loading, checking and reporting claims files: the API of ``tformer verify-claims`` (see :mod:`tformer.claims`)."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tformer.claims import worker as _claim_worker

Status = Literal["PASS", "FAIL", "ERROR", "TIMEOUT"]
STATUSES: tuple[Status, ...] = ("PASS", "FAIL", "ERROR", "TIMEOUT")

DATA_DIR = Path(__file__).resolve().parent / "files"
BUILTIN_CLAIMS: dict[str, Path] = {
    "seed": DATA_DIR / "seed_claims.json",
    "derivations": DATA_DIR / "derivations.json",
}
WORKER_PATH = Path(_claim_worker.__file__).resolve()

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_MB = 1024
MIN_MEMORY_MB = 128  # the interpreter with sympy loaded needs about 60 MiB of address space
STARTUP_TIMEOUT_S = 60.0  # to import sympy and get ready; not counted in the claim's own limits
_MAX_WORKER_STDOUT = 1 << 20
_MAX_WORKER_STDERR = 1 << 16


class ClaimsInputError(ValueError):
    """The claims input is unusable (missing file, malformed JSON, wrong shape); CLI exit code 2."""


@dataclass(frozen=True)
class Claim:
    """One claim: its text, the code that checks it, and its position in the file (0-based)."""

    claim: str
    code: str
    index: int = 0


@dataclass(frozen=True)
class ClaimResult:
    """The verdict on one claim. ``seconds`` is the snippet's own run time (0 if it never started).

    ``output`` is what the snippet printed (``print(...)``), at most ``MAX_OUTPUT_CHARS`` (4,000) characters of
    it: when it printed more, ``output_truncated`` is true and ``output`` ends with the marker
    ``"\\n... [output cut at 4000 characters]"``.
    """

    index: int
    claim: str
    status: Status
    seconds: float
    message: str = ""
    output: str = ""
    output_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "PASS"


@dataclass(frozen=True)
class Limits:
    """Per-claim limits: wall clock (from the snippet's start), CPU time and address space."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    cpu_s: float = DEFAULT_TIMEOUT_S
    memory_mb: int = DEFAULT_MEMORY_MB

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if not self.cpu_s > 0:
            raise ValueError(f"cpu_s must be > 0, got {self.cpu_s!r}")
        if self.memory_mb < MIN_MEMORY_MB:
            raise ValueError(f"memory_mb must be at least {MIN_MEMORY_MB}, got {self.memory_mb!r}")


# --------------------------------------------------------------------------- loading


def _json_type(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def parse_claims(data: object, source: str = "<claims>") -> list[Claim]:
    """Validate decoded JSON (a non-empty list of ``{"claim": str, "code": str}``) into :class:`Claim` objects."""
    if not isinstance(data, list):
        raise ClaimsInputError(
            f'{source}: expected a JSON list of {{"claim", "code"}} objects, got a JSON {_json_type(data)}'
        )
    if not data:
        raise ClaimsInputError(f'{source}: the claims list is empty; give at least one {{"claim", "code"}} object')
    claims = []
    for index, entry in enumerate(data):
        where = f"{source}: claim at index {index}"
        if not isinstance(entry, dict):
            raise ClaimsInputError(f'{where} must be an object with "claim" and "code", got a JSON {_json_type(entry)}')
        for key in ("claim", "code"):
            if key not in entry:
                raise ClaimsInputError(f'{where} has no "{key}" key (keys present: {sorted(entry)})')
            if not isinstance(entry[key], str):
                raise ClaimsInputError(f'{where}: "{key}" must be a string, got a JSON {_json_type(entry[key])}')
        claims.append(Claim(claim=entry["claim"], code=entry["code"], index=index))
    return claims


def parse_claims_text(text: str, source: str = "<claims text>") -> list[Claim]:
    """Decode JSON claims text (a leading byte-order mark is ignored) and validate it (see :func:`parse_claims`)."""
    try:
        data = json.loads(text.removeprefix("\ufeff"))
    except json.JSONDecodeError as exc:
        raise ClaimsInputError(
            f"{source}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
    return parse_claims(data, source)


def load_claims(source: str | os.PathLike[str]) -> list[Claim]:
    """Load claims from a path, or from JSON text (a ``str`` whose first non-blank character is ``[`` or ``{``).

    Files are read as UTF-8, with or without a byte-order mark (Windows Notepad writes one). Raises
    :class:`ClaimsInputError` naming the file, the line and column of malformed JSON, or the index of a
    bad entry.
    """
    if isinstance(source, str) and source.removeprefix("\ufeff").lstrip()[:1] in ("[", "{"):
        return parse_claims_text(source)
    path = Path(source)
    name = str(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ClaimsInputError(f"claims file not found: {name}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ClaimsInputError(f"cannot read claims file {name}: {exc}") from None
    return parse_claims_text(text, name)


def builtin_claims(name: str) -> list[Claim]:
    """The claims shipped with tformer: ``seed`` (the source document's four) or ``derivations``."""
    if name not in BUILTIN_CLAIMS:
        raise ClaimsInputError(f"unknown builtin claims {name!r}; choose from {sorted(BUILTIN_CLAIMS)}")
    return load_claims(BUILTIN_CLAIMS[name])


# --------------------------------------------------------------------------- checking


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass
class _Exchange:
    """What came back from one worker: its JSON replies, its stderr tail and how the exchange ended."""

    replies: list[dict[str, Any]] = field(default_factory=list)
    stderr: bytes = b""
    started_at: float | None = None  # when the worker said "ready": the snippet's wall clock starts
    timed_out: bool = False
    too_chatty: bool = False
    unreadable: str = ""


def _exchange(proc: subprocess.Popen[bytes], request: bytes, limits: Limits) -> _Exchange:
    """Send the request, then read replies until the worker closes its pipes or a deadline passes."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    result = _Exchange()
    out, err = bytearray(), bytearray()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        proc.stdin.write(request)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        selector.register(proc.stderr, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                result.timed_out = True
                break
            for key, _ in selector.select(timeout=remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                if key.fileobj is proc.stderr:
                    err = (err + chunk)[-_MAX_WORKER_STDERR:]
                    continue
                out += chunk
                *lines, rest = out.split(b"\n")
                out = bytearray(rest)
                for line in lines:
                    try:
                        reply = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                        result.unreadable = str(exc)
                        return result
                    if not isinstance(reply, dict):
                        result.unreadable = f"expected a JSON object, got {line[:80]!r}"
                        return result
                    result.replies.append(reply)
                    if reply.get("event") == "ready" and result.started_at is None:
                        result.started_at = time.monotonic()
                        deadline = result.started_at + limits.timeout_s
                if len(out) > _MAX_WORKER_STDOUT:
                    result.too_chatty = True
                    return result
    result.stderr = bytes(err)
    return result


def _run_worker(claim: Claim, limits: Limits) -> ClaimResult:
    def verdict(
        status: Status, message: str, seconds: float = 0.0, output: str = "", output_truncated: bool = False
    ) -> ClaimResult:
        return ClaimResult(claim.index, claim.claim, status, round(seconds, 4), message, output, output_truncated)

    filename = f"<claim {claim.index}>"
    try:
        _claim_worker.check_source(claim.code, filename)
    except _claim_worker.PolicyError as exc:
        return verdict("ERROR", f"rejected before running: {exc}")

    request = json.dumps(
        {"code": claim.code, "filename": filename, "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb}
    ).encode("utf-8")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", str(WORKER_PATH)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={},
            cwd="/",
        )
    except OSError as exc:
        return verdict("ERROR", f"cannot start the worker {sys.executable!r}: {exc}")
    exchange: _Exchange | None = None
    try:
        exchange = _exchange(proc, request, limits)
    finally:
        if exchange is not None and not (exchange.timed_out or exchange.too_chatty or exchange.unreadable):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)  # it closed its pipes, so it is exiting
        proc.kill()  # a no-op once it has exited; ends it on a timeout or a bad reply
        returncode = proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()

    elapsed = time.monotonic() - exchange.started_at if exchange.started_at is not None else 0.0
    if exchange.timed_out and exchange.started_at is not None:
        return verdict("TIMEOUT", f"wall-clock limit of {limits.timeout_s:g} s exceeded", elapsed)
    if exchange.timed_out:
        return verdict("ERROR", f"the worker did not start within {STARTUP_TIMEOUT_S:g} s")
    if exchange.too_chatty:
        return verdict("ERROR", "the worker sent more than 1 MiB of replies")
    if exchange.unreadable:
        return verdict("ERROR", f"the worker sent an unreadable reply: {exchange.unreadable}")
    for reply in exchange.replies:
        if reply.get("event") == "result" and reply.get("status") in STATUSES:
            return verdict(
                reply["status"],
                str(reply.get("message", "")),
                float(reply.get("seconds", elapsed)),
                str(reply.get("output", "")),
                reply.get("output_truncated") is True,
            )
    if exchange.started_at is not None and returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        how = _describe_exit(returncode)
        return verdict("TIMEOUT", f"CPU-time limit of {limits.cpu_s:g} s exceeded ({how})", elapsed)
    tail = exchange.stderr.decode("utf-8", "replace").strip()[-500:]
    detail = f"; its stderr ends with: {tail}" if tail else ""
    return verdict("ERROR", f"the worker {_describe_exit(returncode)} without reporting a result{detail}", elapsed)


def make_limits(timeout_s: float, memory_mb: int, cpu_s: float | None) -> Limits:
    return Limits(timeout_s=timeout_s, cpu_s=timeout_s if cpu_s is None else cpu_s, memory_mb=memory_mb)


def check_claim(
    claim: Claim,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    cpu_s: float | None = None,
) -> ClaimResult:
    """Check one claim in its own sandboxed worker process (``cpu_s`` defaults to ``timeout_s``)."""
    return _run_worker(claim, make_limits(timeout_s, memory_mb, cpu_s))


def iter_check_claims(
    claims: Iterable[Claim],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    cpu_s: float | None = None,
    jobs: int | None = None,
) -> Iterator[ClaimResult]:
    """Check claims, ``jobs`` at a time (default: CPU count), yielding results in the input order."""
    limits = make_limits(timeout_s, memory_mb, cpu_s)
    claims = list(claims)
    workers = max(1, min(jobs or os.cpu_count() or 1, len(claims) or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="claim") as pool:
        yield from pool.map(lambda claim: _run_worker(claim, limits), claims)


def check_claims(
    claims: Iterable[Claim],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    cpu_s: float | None = None,
    jobs: int | None = None,
) -> list[ClaimResult]:
    """Check every claim (see :func:`iter_check_claims`); results follow the input order."""
    return list(iter_check_claims(claims, timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s, jobs=jobs))


# --------------------------------------------------------------------------- reporting


def summarize(results: Sequence[ClaimResult]) -> dict[str, int]:
    """Counts per verdict: ``passed``, ``failed``, ``errors``, ``timeouts`` and ``total``."""
    counts = {status: sum(r.status == status for r in results) for status in STATUSES}
    return {
        "passed": counts["PASS"],
        "failed": counts["FAIL"],
        "errors": counts["ERROR"],
        "timeouts": counts["TIMEOUT"],
        "total": len(results),
    }


def summary_line(results: Sequence[ClaimResult]) -> str:
    """E.g. ``4 passed, 0 failed`` (errors and timeouts are added when there are any)."""
    counts = summarize(results)
    line = f"{counts['passed']} passed, {counts['failed']} failed"
    if counts["errors"]:
        line += f", {counts['errors']} error{'s' if counts['errors'] != 1 else ''}"
    if counts["timeouts"]:
        line += f", {counts['timeouts']} timed out"
    return line


def _printable(text: str) -> str:
    """``text`` with control characters escaped: claim texts and messages come from strangers, and an
    escape sequence printed raw could rewrite the user's terminal."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def format_row(result: ClaimResult) -> str:
    """One human-readable row; the message (ERROR/TIMEOUT reason) goes on an indented second line."""
    row = f"{result.status:<7} {result.seconds:7.2f}s  [{result.index}] {_printable(result.claim)}"
    if result.message:
        row += "\n" + " " * 19 + _printable(result.message)
    return row
