"""Tests for ``tformer verify-claims``: verdicts, the CLI contract and the sandbox.

Every claim costs a worker process (about half a second of start-up), so claims are checked in batches:
one batch of false claims and bad results, one batch of hostile snippets interleaved with benign ones.
The layers behind the compile-time policy (value guards, audit hook) are also tested on their own,
because the policy stops the listed attacks before those layers are ever reached.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tformer.claims import (
    Claim,
    ClaimResult,
    ClaimsInputError,
    builtin_claims,
    check_claim,
    check_claims,
    format_row,
    load_claims,
)
from tformer.claims import worker as _claim_worker
from tformer.cli.claims import add_cli, main, run_cli

SRC_DIR = Path(_claim_worker.__file__).resolve().parents[2]
SEED_TEXTS = [
    "Raw dot-product of two iid unit-variance d_k-dim vectors has variance d_k",
    "Softmax Jacobian diagonal is a_i(1-a_i)",
    "MHA total projection params = 4*d_model^2 independent of h",
    "Rotation composition R(a)^T R(b) = R(b-a) gives relative dependence",
]
SOFTMAX2 = "z1, z2 = symbols('z1 z2')\na1 = exp(z1)/(exp(z1) + exp(z2))\n"
BENIGN = "a, b = symbols('a b')\nresult = simplify((a + b)**2 - (a**2 + 2*a*b + b**2)) == 0"


def batch(codes: list[str]) -> list[Claim]:
    return [Claim(claim=f"claim {i}", code=code, index=i) for i, code in enumerate(codes)]


def write_claims(path: Path, entries: object) -> str:
    path.write_text(json.dumps(entries), encoding="utf-8")
    return str(path)


# --------------------------------------------------------------------------- the shipped claims


@pytest.mark.subprocess
def test_seed_claims_are_the_source_documents_four_and_pass_via_the_api():
    claims = builtin_claims("seed")
    assert [c.claim for c in claims] == SEED_TEXTS
    results = check_claims(claims, jobs=2)
    assert [(r.index, r.status, r.message) for r in results] == [(i, "PASS", "") for i in range(4)]


@pytest.mark.subprocess
def test_the_seed_variance_claim_fails_when_its_claim_or_its_assumption_changes():
    """The check derives Var(q.k) from the moments; it is not true whatever the claimed value (no tautology)."""
    code = builtin_claims("seed")[0].code
    assert "mean, claimed = 0, dk" in code
    mutants = [
        code.replace("mean, claimed = 0, dk", "mean, claimed = 0, 2*dk"),  # a wrong variance
        code.replace("mean, claimed = 0, dk", "mean, claimed = 1, dk"),  # drop "zero-mean": it is 3 d_k then
        code.replace("mean, claimed = 0, dk", "mean, claimed = 1, 3*dk"),  # ... as the same derivation finds
    ]
    results = check_claims(batch(mutants), timeout_s=20, jobs=2)
    assert [(r.status, r.message) for r in results] == [("FAIL", ""), ("FAIL", ""), ("PASS", "")]


@pytest.mark.slow
def test_seed_claims_pass_via_python_m_tformer_claims():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC_DIR), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "tformer.claims", "--builtin", "seed", "--jobs", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASS ") == 4
    assert "4 passed, 0 failed" in proc.stdout


@pytest.mark.slow
def test_every_derivation_claim_passes():
    results = check_claims(builtin_claims("derivations"), jobs=2)
    assert len(results) >= 25
    assert [(r.index, r.status, r.message) for r in results if r.status != "PASS"] == []


# --------------------------------------------------------------------------- verdicts


@pytest.mark.subprocess
def test_false_claims_fail_and_bad_results_are_errors_that_say_what_was_found():
    codes = [
        # Var(s) = d_k, not d_k**2
        "dk = symbols('d_k', positive=True)\nm = symbols('m', integer=True)\n"
        "result = simplify(summation(1, (m, 1, dk)) - dk**2) == 0",
        SOFTMAX2 + "result = simplify(diff(a1, z1) - a1*(1 + a1)) == 0",  # the diagonal is a(1-a)
        "dm, h = symbols('d_model h', positive=True)\ndk = dm/h\n"
        "result = simplify(3*dm*(h*dk) + (h*dk)*dm - 3*dm**2) == 0",  # it is 4 d_model^2
        "result = Eq(1, 2)",  # sympy false
        "result = 1",
        "x = symbols('x')\nresult = x + 1",
        "a, b = symbols('a b')\nresult = Eq(a, b)",
        "x = 1",
        "result = 1/0",
        "x = symbols('x', positive=True)\nresult = x > 0",  # sympy true
    ]
    results = check_claims(batch(codes), timeout_s=20, jobs=2)
    assert [r.status for r in results] == ["FAIL"] * 4 + ["ERROR"] * 5 + ["PASS"]
    int_msg, add_msg, eq_msg, missing_msg, zero_msg = (r.message for r in results[4:9])
    assert "got int" in int_msg
    assert "got Add" in add_msg
    assert "Eq(a, b)" in eq_msg and "Equality" in eq_msg and "simplify(lhs - rhs) == 0" in eq_msg
    assert "never set `result`" in missing_msg
    assert zero_msg.startswith("ZeroDivisionError")


@pytest.mark.subprocess
def test_check_claim_reports_the_index_and_text_and_its_own_time():
    result = check_claim(Claim("text", BENIGN, index=7), timeout_s=20)
    assert (result.index, result.claim, result.status, result.ok) == (7, "text", "PASS", True)
    assert 0 <= result.seconds < 20


def test_policy_rejections_happen_before_anything_runs():
    result = check_claim(Claim("t", "import os\nresult = True"))
    assert result.status == "ERROR"
    assert result.message.startswith("rejected before running:") and "import" in result.message
    assert result.seconds == 0.0


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("print = 1", "line 1: 'print' cannot be assigned in claims: it is the print function"),
        ("x = 1\ndef printed():\n    return 1", "line 2: 'printed' cannot be assigned in claims: it holds what"),
        ("f = lambda builtins: 1", "line 1: 'builtins' cannot be assigned in claims: the name is reserved"),
        ("x__roles__ = 1", 'line 1: "x__roles__" is an invalid variable name'),  # RestrictedPython's own check
    ],
)
def test_reserved_names_are_rejected_in_the_style_of_the_other_policy_messages(code, message):
    with pytest.raises(_claim_worker.PolicyError) as excinfo:
        _claim_worker.check_source(code + "\nresult = True")
    assert str(excinfo.value).startswith(message)
    assert "Line " not in str(excinfo.value)


# --------------------------------------------------------------------------- hostile snippets


@pytest.mark.slow
def test_hostile_snippets_are_errors_or_timeouts_and_the_benign_claims_still_pass(tmp_path):
    written = tmp_path / "written.txt"
    marker = tmp_path / "marker"
    hostile: list[tuple[str, tuple[str, ...], str]] = [
        ("import os\nresult = True", ("ERROR",), "import statements"),
        ("result = len(open('/etc/passwd').read()) > 0", ("ERROR",), "'open'"),
        ("result = __import__('os') is None", ("ERROR",), "'__import__'"),
        ("result = len(().__class__.__mro__[1].__subclasses__()) > 0", ("ERROR",), "__subclasses__"),
        ("x = 1\nresult = getattr(x, '__class__') is None", ("ERROR",), "'getattr'"),
        ("exec('result = True')", ("ERROR",), "'exec'"),
        ("result = eval('1 == 1')", ("ERROR",), "'eval'"),
        ("result = '{0.__class__}'.format(1) != ''", ("ERROR",), ".format"),
        ("f = str.format\nresult = f('{0.__globals__}', len) != ''", ("ERROR",), ".format"),
        ("result = sympify('__import__(\"os\")') is None", ("ERROR",), "'sympify'"),
        ("result = S('__import__(\"os\").getcwd()') is None", ("ERROR",), "string parsing refused"),
        (
            f'result = simplify(\'__import__("os").system("touch {marker}")\') == 0',
            ("ERROR",),
            "string parsing refused",
        ),
        ("x = symbols('x')\nresult = diff('lambdify(x, x)', x) == 0", ("ERROR",), "string parsing refused"),
        ("g = (i for i in range(3))\nresult = g.gi_frame.f_globals is None", ("ERROR",), "gi_frame"),
        ("x = symbols('x')\nresult = x.func.mro() is None", ("ERROR",), ".mro"),
        ("result = type(1) is None", ("ERROR",), "'type'"),
        ("f = lambda: 0\nresult = f.__globals__ is None", ("ERROR",), "__globals__"),
        ("class A:\n    pass\nresult = True", ("ERROR",), "class definitions"),
        ("s = socket.socket()\nresult = True", ("ERROR",), "'socket'"),
        (f"f = open({str(written)!r}, 'w')\nf.write('x')\nresult = True", ("ERROR",), "'open'"),
        ("while True:\n    pass", ("TIMEOUT",), "limit"),
        ("x = [0] * 10**10\nresult = True", ("ERROR", "TIMEOUT"), ""),
        ("result = 10**10**10 > 0", ("ERROR", "TIMEOUT"), ""),
        ("f = lambda n: f(n + 1)\nresult = f(0)", ("ERROR",), "RecursionError"),
        ("f = Function('f', **{'__eq__': lambda a, b: True})\nresult = True", ("ERROR",), "keyword arguments"),
    ]
    codes: list[str] = []
    hostile_at: list[int] = []
    for i, (code, _, _) in enumerate(hostile):
        hostile_at.append(len(codes))
        codes.append(code)
        if i % 4 == 3:  # benign claims between (and after) the hostile ones
            codes.append(BENIGN)
    results = check_claims(batch(codes), timeout_s=2.5, memory_mb=512, jobs=2)

    assert [r.index for r in results] == list(range(len(codes)))
    benign = [r.status for i, r in enumerate(results) if i not in hostile_at]
    assert benign == ["PASS"] * (len(hostile) // 4)
    for (code, statuses, fragment), at in zip(hostile, hostile_at):
        assert results[at].status in statuses, (code, results[at])
        assert fragment in results[at].message, (code, results[at].message)
    memory = next(results[at] for (code, _, _), at in zip(hostile, hostile_at) if code.startswith("x = [0]"))
    assert memory.status == "TIMEOUT" or "MemoryError" in memory.message
    assert not written.exists()
    assert not marker.exists()


@pytest.mark.subprocess
def test_cpu_time_limit_ends_a_computation_stuck_in_one_c_call():
    codes = ["result = 10**10**10 > 0", "while True:\n    pass"]
    results = check_claims(batch(codes), timeout_s=60, cpu_s=1, memory_mb=4096, jobs=2)
    assert [r.status for r in results] == ["TIMEOUT", "TIMEOUT"]
    assert all("CPU-time limit of 1 s exceeded" in r.message for r in results)


def test_value_guards_refuse_modules_frames_and_forbidden_functions():
    import sympy

    ns = _claim_worker.build_globals(sympy)
    x = sympy.Symbol("x")
    assert ns["_getattr_"](x, "name") == "x"
    assert ns["_getitem_"]([1, 2], 0) == 1
    refused = [
        lambda: ns["_getattr_"](sympy, "core"),  # a module
        lambda: ns["_getattr_"](x, "__class__"),
        lambda: ns["_getattr_"]("{}", "format"),
        lambda: ns["_getattr_"](sympy.Symbol, "mro"),
        lambda: ns["_getitem_"]({"m": os}, "m"),
        lambda: list(ns["_getiter_"]([1, sys._getframe()])),
        lambda: ns["_checked_"](eval),
        lambda: ns["_checked_"](sympy.sympify),
        lambda: ns["_checked_"](sys.stdout),
        lambda: ns["_write_"](x),
    ]
    for attempt in refused:
        with pytest.raises(_claim_worker.SandboxError):
            attempt()
    assert set(ns["__builtins__"]) == _claim_worker.BUILTIN_NAMES
    assert not {"open", "eval", "exec", "getattr", "type", "__import__"} & set(ns["__builtins__"])


@pytest.mark.subprocess
def test_audit_hook_and_limits_stop_effects_even_past_the_namespace(tmp_path):
    """Run plain (unrestricted) Python after the worker's hardening, as an escaped snippet would."""
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    script = textwrap.dedent(
        f"""
        import importlib.util, json, os, subprocess, sys
        spec = importlib.util.spec_from_file_location("w", {str(Path(_claim_worker.__file__))!r})
        w = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(w)
        import sympy
        w.harden_sympy_parser(sympy)
        w.set_limits(20, 1024)
        w.install_audit_hook(w.python_roots())
        tmp = {str(tmp_path)!r}
        attempts = {{
            "write": lambda: open(os.path.join(tmp, "new.txt"), "w"),
            "os.open": lambda: os.open(os.path.join(tmp, "new2.txt"), os.O_WRONLY | os.O_CREAT),
            "read outside": lambda: open({str(outside)!r}).read(),
            "remove": lambda: os.remove({str(outside)!r}),
            "listdir": lambda: os.listdir(tmp),
            "system": lambda: os.system("true"),
            "subprocess": lambda: subprocess.run(["true"]),
            "fork": lambda: os.fork(),
            "socket": lambda: __import__("socket").socket(),
            "raise limits": lambda: __import__("resource").setrlimit(__import__("resource").RLIMIT_AS, (-1, -1)),
            "sympify eval": lambda: sympy.sympify("__import__('os').getpid()"),
        }}
        outcome = {{}}
        for name, attempt in attempts.items():
            try:
                attempt()
                outcome[name] = "allowed"
            except Exception as exc:
                outcome[name] = type(exc).__name__
        outcome["sympify numbers"] = str(sympy.sympify("2*x + 1/2"))
        print(json.dumps(outcome))
        """
    )
    proc = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout)
    assert outcome.pop("sympify numbers") == "2*x + 1/2"
    assert outcome == {name: "SandboxError" for name in outcome}
    assert outside.read_text() == "secret"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside.txt"]


@pytest.mark.subprocess
def test_worker_script_speaks_the_protocol_without_importing_torch_or_tformer():
    request = json.dumps({"code": "result = 1 + 1 == 2", "cpu_s": 10, "memory_mb": 1024})
    proc = subprocess.run(
        [sys.executable, "-I", "-X", "importtime", str(Path(_claim_worker.__file__))],
        input=request,
        capture_output=True,
        text=True,
        timeout=60,
    )
    replies = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["event"] for r in replies] == ["ready", "result"]
    assert replies[1]["status"] == "PASS"
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "sympy" in imported
    assert not {name for name in imported if name.split(".")[0] in ("torch", "tformer")}


# --------------------------------------------------------------------------- input handling and CLI


def test_load_claims_accepts_text_and_paths(tmp_path):
    entries = [{"claim": "c", "code": "result = True", "note": "extra keys are ignored"}]
    from_text = load_claims(json.dumps(entries))
    from_path = load_claims(Path(write_claims(tmp_path / "c.json", entries)))
    assert from_text == from_path == [Claim("c", "result = True", 0)]


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        ('[\n  {"claim": "a", "code": "result = True"},\n  {"claim": "b" "code": "x"}\n]', ["line 3, column"]),
        ('{"claim": "a", "code": "result = True"}', ["list", "object"]),
        ('["result = True"]', ["index 0", "string"]),
        ('[{"claim": "a", "code": "result = True"}, {"claim": "b"}]', ["index 1", '"code"']),
        ('[{"claim": "a", "code": "result = True"}, {"code": "result = True"}]', ["index 1", '"claim"']),
        ('[{"claim": "a", "code": 1}]', ["index 0", '"code" must be a string', "number"]),
        ('[{"claim": null, "code": "result = True"}]', ["index 0", '"claim" must be a string', "null"]),
        ("[]", ["claims list is empty", "at least one"]),
    ],
)
def test_unusable_input_exits_2_with_a_message_naming_the_problem(tmp_path, capsys, content, fragments):
    path = tmp_path / "claims.json"
    path.write_text(content, encoding="utf-8")
    assert main([str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    for fragment in fragments:
        assert fragment in captured.err
    with pytest.raises(ClaimsInputError):
        load_claims(path)


@pytest.mark.subprocess
def test_claims_files_and_stdin_with_a_utf8_byte_order_mark_verify(tmp_path, monkeypatch, capsys):
    text = json.dumps([{"claim": "with a BOM", "code": BENIGN}])
    path = tmp_path / "notepad.json"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    assert load_claims(path) == load_claims("\ufeff" + text) == [Claim("with a BOM", BENIGN, 0)]
    assert main([str(path), "--timeout", "20"]) == 0
    assert "PASS" in capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(path.read_bytes()), encoding="latin-1"))
    assert main(["-", "--timeout", "20"]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out


@pytest.mark.subprocess
def test_json_results_mark_output_cut_at_the_limit(tmp_path, capsys):
    limit = _claim_worker.MAX_OUTPUT_CHARS
    path = write_claims(
        tmp_path / "chatty.json",
        [
            {"claim": "long", "code": f"print('x' * {limit + 500})\nresult = True"},
            {"claim": "short", "code": "print('hello')\nresult = True"},
        ],
    )
    assert main([path, "--json", "--jobs", "2", "--timeout", "20"]) == 0
    long, short = json.loads(capsys.readouterr().out)["results"]
    assert long["output_truncated"] is True
    assert long["output"] == "x" * limit + f"\n... [output cut at {limit} characters]"
    assert short["output_truncated"] is False
    assert short["output"] == "hello\n"


def test_an_empty_claims_list_on_stdin_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("[]\n"))
    assert main(["-"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("python -m tformer.claims: error: <stdin>: the claims list is empty")


def test_missing_file_and_missing_source_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "nope.json")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main([]) == 2
    assert "--builtin" in capsys.readouterr().err
    assert main(["--builtin", "seed", "--timeout", "0"]) == 2
    assert "--timeout must be a number of seconds > 0; got 0" in capsys.readouterr().err


@pytest.mark.subprocess
def test_cli_rows_follow_the_file_and_json_output_parses(tmp_path, capsys):
    path = write_claims(
        tmp_path / "mixed.json",
        [
            {"claim": "true claim", "code": BENIGN},
            {"claim": "false claim", "code": "result = 1 + 1 == 3"},
            {"claim": "bad claim", "code": "import os"},
        ],
    )
    assert main([path, "--jobs", "2", "--timeout", "20"]) == 1
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:1].isupper() and "[" in line]
    assert [row.split()[0] for row in rows] == ["PASS", "FAIL", "ERROR"]
    assert out.index("true claim") < out.index("false claim") < out.index("bad claim")
    assert "1 passed, 1 failed, 1 error" in out

    assert main([path, "--json", "--jobs", "2", "--timeout", "20"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [r["status"] for r in report["results"]] == ["PASS", "FAIL", "ERROR"]
    assert [r["claim"] for r in report["results"]] == ["true claim", "false claim", "bad claim"]
    assert report["summary"] == {"passed": 1, "failed": 1, "errors": 1, "timeouts": 0, "total": 3}
    assert report["ok"] is False


def test_rows_escape_control_characters_from_the_claims_file():
    row = format_row(ClaimResult(3, "title\x1b[2J", "ERROR", 0.0, "ValueError: \x1b[31mred\x07"))
    assert "\x1b" not in row and "\x07" not in row
    assert "title\\x1b[2J" in row and "\\x1b[31mred\\x07" in row


def test_add_cli_registers_verify_claims_on_the_lead_parser():
    parser = argparse.ArgumentParser(prog="tformer")
    subparsers = parser.add_subparsers(dest="command")
    add_cli(subparsers)
    args = parser.parse_args(["verify-claims", "--builtin", "seed", "--timeout", "5", "--memory-mb", "512"])
    assert args.func is run_cli
    assert (args.command, args.builtin, args.timeout, args.memory_mb, args.json) == (
        "verify-claims",
        "seed",
        5.0,
        512,
        False,
    )
