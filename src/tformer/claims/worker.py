"""Run one claim snippet in a locked-down child process: the worker side of ``tformer verify-claims``.

The parent (:mod:`tformer.claims`) starts ``python -I path/to/tformer/claims/worker.py`` once per claim, writes one
JSON request on its stdin and reads JSON lines back from its stdout. The file is run as a script, not as
``tformer.claims.worker``, so the ``tformer`` package (which imports torch) is never imported here; it
imports only the standard library, RestrictedPython and, lazily, sympy.

Security model: defense in depth, not a container
--------------------------------------------------
A claims file may come from a stranger, so every snippet is treated as hostile. Five layers stand between
a snippet and the machine; each is meant to hold on its own, and none is claimed to be perfect.

1. Compile-time policy (:func:`check_source`, run in the parent *and* again here). The snippet is rejected,
   without being run, if it imports anything, uses a name or attribute starting with ``_``, names a
   forbidden builtin (``open``, ``eval``, ``exec``, ``getattr``, ``type``, ...) or a string-evaluating
   sympy function (``sympify``, ``lambdify``, ...), touches a frame/code/generator attribute (``gi_frame``,
   ``f_globals``, ``mro``, ``format``, ...), assigns attributes or a reserved name (``print``, ``printed``),
   defines classes, or reads a name that is neither assigned in the snippet nor on the allow-list. It is
   then compiled by RestrictedPython's ``compile_restricted``, which rewrites every attribute access,
   subscript, iteration, unpacking and in-place operator into a call to a guard; on top of that every call
   result goes through ``_checked_``.
2. Restricted namespace (:func:`build_globals`). ``__builtins__`` holds only an allow-list (``range``,
   ``len``, ``sum``, ...) and the globals an explicit allow-list of sympy math names (:data:`SYMPY_NAMES`),
   never ``from sympy import *``. The guards refuse underscore attributes and ``str.format`` (which can
   read attributes: ``"{0.__class__}".format(x)``), and refuse to hand the snippet a module, frame, code
   object, traceback, file object or a dangerous function, whichever attribute, item, iteration or call
   produced it. sympy itself evaluates strings with ``eval`` (``S("...")`` and every function that
   sympifies its arguments), so :func:`harden_sympy_parser` replaces the final ``eval`` of sympy's parser
   with one that refuses underscore names and every name that is not a sympy object.
3. A separate process per claim, in isolated mode (``-I``), with an empty environment, working directory
   ``/`` and its stdin at ``/dev/null`` once the request is read.
4. OS limits (:func:`set_limits`), set just before the snippet runs: RLIMIT_CPU (SIGXCPU ends a runaway
   computation, even one stuck inside a single C call such as ``10**10**10``), RLIMIT_AS (allocations
   beyond it raise MemoryError), RLIMIT_FSIZE=0 (no byte can be written to a file), RLIMIT_NOFILE,
   RLIMIT_NPROC (not enforced when running as root) and RLIMIT_CORE=0. The parent adds a wall-clock limit
   and kills the worker when it passes.
5. An audit hook (:func:`install_audit_hook`, PEP 578; it cannot be removed once added). While the
   snippet runs it refuses: opening files for writing, reading files outside the Python installation,
   listing directories outside it, changing directory, spawning processes, sending signals, sockets and
   network clients, ctypes, mmap, changing resource limits, building code or function objects by hand,
   ``gc`` object-graph walks and importing process/network modules.

What it is not: a container. The worker runs as the same user with the same view of the filesystem; a
bug in CPython, sympy or RestrictedPython that gets past every layer above could read what that user can
read, and it could forge its own result line. Check claims files from strangers as an unprivileged user,
or in a container, if that matters to you.

Protocol: request ``{"code", "filename", "cpu_s", "memory_mb"}`` on stdin; replies, one JSON object per
line on stdout: ``{"event": "ready"}`` when the snippet is about to start (the parent's wall clock starts
there), then ``{"event": "result", "status", "message", "seconds", "output", "output_truncated"}``. ``output`` is what
the snippet printed; past :data:`MAX_OUTPUT_CHARS` characters it is cut, ends with :data:`OUTPUT_CUT_MARKER`
and ``output_truncated`` is true.
"""

from __future__ import annotations

import ast
import builtins
import io
import json
import operator
import os
import sys
import sysconfig
import time
import types
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from RestrictedPython import compile_restricted_exec
from RestrictedPython.Guards import guarded_iter_unpack_sequence, guarded_unpack_sequence
from RestrictedPython.PrintCollector import PrintCollector
from RestrictedPython.transformer import INSPECT_ATTRIBUTES, RestrictingNodeTransformer, copy_locations

MAX_CODE_CHARS = 100_000
MAX_MESSAGE_CHARS = 2_000
MAX_OUTPUT_CHARS = 4_000
# Ends a snippet's printed output that was cut at MAX_OUTPUT_CHARS (the reply also says "output_truncated": true).
OUTPUT_CUT_MARKER = f"\n... [output cut at {MAX_OUTPUT_CHARS} characters]"


def _names(words: str) -> frozenset[str]:
    """A set of names written as whitespace-separated words (easier to read and diff than a list)."""
    return frozenset(words.split())


# The sympy names a snippet may use: symbols, numbers, functions and classes for mathematics only.
# Left out on purpose: sympify/parse_expr (eval strings), lambdify/nsolve (exec generated code),
# nsimplify (mpmath.identify evals formulas), var (writes the caller's globals), plot*/preview/
# init_printing/pprint (files, subprocesses, terminals), sympy.utilities, sympy.core.cache, sympy.stats.
SYMPY_NAMES: frozenset[str] = _names(
    """
    symbols Symbol Dummy Wild Function Lambda IndexedBase Idx Indexed
    Integer Rational Float S N pi E I oo zoo nan true false
    exp log ln sqrt cbrt root real_root sin cos tan cot sec csc asin acos atan acot atan2
    sinh cosh tanh coth asinh acosh atanh Abs sign floor ceiling frac Min Max Piecewise
    KroneckerDelta Heaviside DiracDelta factorial binomial gamma beta erf re im conjugate arg Mod gcd lcm
    diff Derivative integrate Integral limit Limit series O Order Sum Product summation product Subs
    simplify expand factor collect cancel apart together trigsimp expand_trig powsimp powdenest radsimp
    ratsimp logcombine expand_log expand_mul expand_power_base expand_func expand_complex combsimp
    gammasimp exptrigsimp sqrtdenest numer denom fraction count_ops
    solve solveset linsolve roots Poly degree
    Eq Ne Lt Le Gt Ge And Or Not Xor Implies
    Matrix ImmutableMatrix MatrixSymbol Identity ZeroMatrix eye zeros ones diag det trace transpose
    Tuple FiniteSet Interval Union Intersection Complement EmptySet Reals
    """
)

BUILTIN_NAMES: frozenset[str] = _names(
    """
    abs all any bool callable chr complex dict divmod enumerate filter float frozenset int isinstance
    issubclass len list map max min ord pow range repr reversed round set slice sorted str sum tuple zip
    ArithmeticError AssertionError AttributeError Exception IndexError KeyError NotImplementedError
    OverflowError RuntimeError StopIteration TypeError ValueError ZeroDivisionError
    """
)

_NO_FILES = "claims cannot touch files"
_NO_EVAL = "claims cannot run code built from strings"
_NO_INTROSPECTION = "claims cannot use introspection; use plain attribute access such as x.args"
_NO_STRINGS = "it evaluates strings with eval; build expressions from symbols(...) and sympy functions"
FORBIDDEN_NAMES: dict[str, str] = {
    "open": _NO_FILES,
    "input": "claims cannot read the terminal",
    "breakpoint": "claims cannot start a debugger",
    "help": "claims cannot start the help system",
    "exec": _NO_EVAL,
    "eval": _NO_EVAL,
    "compile": _NO_EVAL,
    "getattr": _NO_INTROSPECTION,
    "setattr": _NO_INTROSPECTION,
    "delattr": _NO_INTROSPECTION,
    "hasattr": _NO_INTROSPECTION,
    "globals": _NO_INTROSPECTION,
    "locals": _NO_INTROSPECTION,
    "vars": _NO_INTROSPECTION,
    "dir": _NO_INTROSPECTION,
    "type": _NO_INTROSPECTION,
    "object": _NO_INTROSPECTION,
    "super": _NO_INTROSPECTION,
    "memoryview": _NO_INTROSPECTION,
    "id": _NO_INTROSPECTION,
    "classmethod": _NO_INTROSPECTION,
    "staticmethod": _NO_INTROSPECTION,
    "property": _NO_INTROSPECTION,
    "iter": "use a for loop or a comprehension",
    "next": "use a for loop or a comprehension",
    "exit": "claims cannot end the process",
    "quit": "claims cannot end the process",
    "sympify": _NO_STRINGS + " (use S(2), Integer(2) or Rational(1, 2) for numbers)",
    "parse_expr": _NO_STRINGS,
    "lambdify": "it runs generated code with exec",
    "nsolve": "it runs generated code with exec (through lambdify)",
    "nsimplify": "it evaluates formula strings (through mpmath.identify)",
    "var": "it writes into the caller's globals; use a, b = symbols('a b')",
    "preview": _NO_FILES,
    "plot": _NO_FILES,
    "init_printing": "claims cannot change the printing system",
    "pprint": "claims report through `result`, not through printing",
}

# Names a snippet may read but never assign (RestrictedPython reserves them too: print goes to `printed`).
RESERVED_NAMES: dict[str, str] = {
    "print": "it is the print function (what it prints is collected in `printed`)",
    "printed": "it holds what the code printed",
    "builtins": "the name is reserved",
    "breakpoint": "the name is reserved",
}

# Attribute names refused on every object, on top of any name starting with "_".
FORBIDDEN_ATTRIBUTES: frozenset[str] = INSPECT_ATTRIBUTES | _names(
    """
    format format_map mro gi_frame gi_code gi_yieldfrom cr_frame cr_code cr_await ag_frame ag_code
    ag_await tb_frame tb_next f_back f_builtins f_code f_globals f_locals f_trace co_code func_globals
    """
)


class PolicyError(ValueError):
    """The snippet breaks the compile-time policy; it was rejected without being run."""


class SandboxError(PermissionError):
    """The running snippet tried to reach something claims may not use."""


# --------------------------------------------------------------------------- compile-time policy


class _PolicyChecker(ast.NodeVisitor):
    """Our own AST checks, run before RestrictedPython's (clearer messages, a few stricter rules)."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.bound: set[str] = set()
        self.loaded: dict[str, int] = {}

    def flag(self, node: ast.AST, message: str) -> None:
        self.problems.append(f"line {getattr(node, 'lineno', '?')}: {message}")

    def check_name(self, node: ast.AST, name: str) -> None:
        if name.startswith("_") and name != "_":
            self.flag(node, f"names starting with '_' are not allowed ({name!r})")

    def bind(self, node: ast.AST, name: str) -> None:
        """``name`` is assigned, deleted or defined here (a variable, function, argument or ``except`` name)."""
        self.check_name(node, name)
        if name in RESERVED_NAMES:
            self.flag(node, f"{name!r} cannot be assigned in claims: {RESERVED_NAMES[name]}")
        self.bound.add(name)

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        self.flag(node, "import statements are not allowed; the allowed sympy names are already in scope")

    visit_ImportFrom = visit_Import

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.flag(node, "class definitions are not allowed in claims")

    def visit_Global(self, node: ast.Global | ast.Nonlocal) -> None:
        self.flag(node, "global/nonlocal statements are not allowed in claims")

    visit_Nonlocal = visit_Global

    def visit_Yield(self, node: ast.AST) -> None:
        self.flag(node, "generator functions (yield) and async code are not allowed in claims")

    visit_YieldFrom = visit_Await = visit_AsyncFunctionDef = visit_AsyncFor = visit_AsyncWith = visit_Yield

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.check_name(node, node.id)
            self.loaded.setdefault(node.id, node.lineno)
        else:
            self.bind(node, node.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr.startswith("_"):
            self.flag(node, f"attributes starting with '_' are not allowed (.{node.attr})")
        elif node.attr in FORBIDDEN_ATTRIBUTES:
            self.flag(node, f"attribute .{node.attr} is not available in claims")
        if not isinstance(node.ctx, ast.Load):
            self.flag(node, f"assigning or deleting attributes is not allowed (.{node.attr})")
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.bind(node, node.name)
        self.generic_visit(node)

    def visit_arg(self, node: ast.arg) -> None:
        self.bind(node, node.arg)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.bind(node, node.name)
        self.generic_visit(node)

    def unknown_names(self) -> list[str]:
        """Names read but neither assigned in the snippet nor available (forbidden ones with the reason)."""
        known = SYMPY_NAMES | BUILTIN_NAMES | self.bound | {"True", "False", "None", "print", "printed"}
        problems = []
        for name, line in self.loaded.items():
            if name in known or name.startswith("_"):
                continue
            if name in FORBIDDEN_NAMES:
                problems.append(f"line {line}: {name!r} is not available in claims: {FORBIDDEN_NAMES[name]}")
            else:
                problems.append(
                    f"line {line}: name {name!r} is not available in claims (neither an allowed sympy "
                    "name or builtin nor assigned in the code)"
                )
        return problems


class _ClaimPolicy(RestrictingNodeTransformer):
    """RestrictedPython's policy, plus: every call's result goes through ``_checked_``."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        node = super().visit_Call(node)
        checker = ast.Name("_checked_", ast.Load())
        wrapped = ast.Call(func=checker, args=[node], keywords=[])
        copy_locations(checker, node)
        copy_locations(wrapped, node)
        return wrapped


def check_source(code: str, filename: str = "<claim>") -> types.CodeType:
    """Apply the compile-time policy to ``code`` and compile it; raise :class:`PolicyError` on any problem.

    Runs our AST checks, then RestrictedPython's ``compile_restricted`` with the call-result wrapper.
    The returned code object must be executed in :func:`build_globals`'s namespace.
    """
    if not isinstance(code, str):
        raise PolicyError(f"the code must be a string, got {type(code).__name__}")
    if len(code) > MAX_CODE_CHARS:
        raise PolicyError(f"the code is {len(code)} characters long; the limit is {MAX_CODE_CHARS}")
    try:
        tree = ast.parse(code, filename, "exec")
    except SyntaxError as exc:
        where = f" at line {exc.lineno}, column {exc.offset}" if exc.lineno is not None else ""
        raise PolicyError(f"syntax error{where}: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise PolicyError(f"cannot parse the code: {type(exc).__name__}: {exc}") from None
    checker = _PolicyChecker()
    try:
        checker.visit(tree)
    except RecursionError:
        raise PolicyError("the code is nested too deeply to check") from None
    problems = list(dict.fromkeys(checker.problems + checker.unknown_names()))
    if problems:
        raise PolicyError("; ".join(problems))
    try:
        compiled = compile_restricted_exec(tree, filename=filename, policy=_ClaimPolicy)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise PolicyError(f"cannot compile the code: {type(exc).__name__}: {exc}") from None
    if compiled.errors or compiled.code is None:
        # RestrictedPython writes "Line 3: ..."; ours read "line 3: ..."
        errors = [error[:1].lower() + error[1:] if error.startswith("Line ") else error for error in compiled.errors]
        raise PolicyError("; ".join(errors) or "RestrictedPython refused the code")
    return compiled.code


# --------------------------------------------------------------------------- restricted namespace


_FORBIDDEN_TYPES: tuple[type, ...] = (
    types.ModuleType,
    types.FrameType,
    types.CodeType,
    types.TracebackType,
    io.IOBase,
)

_INPLACE_OPERATORS: dict[str, Callable[[Any, Any], Any]] = {
    "+=": operator.iadd,
    "-=": operator.isub,
    "*=": operator.imul,
    "/=": operator.itruediv,
    "//=": operator.ifloordiv,
    "%=": operator.imod,
    "**=": operator.ipow,
    "@=": operator.imatmul,
    "<<=": operator.ilshift,
    ">>=": operator.irshift,
    "&=": operator.iand,
    "^=": operator.ixor,
    "|=": operator.ior,
}


def _forbidden_objects(sympy: types.ModuleType) -> list[object]:
    """Callables a snippet must never hold, even if some attribute or call would return one."""
    names = [*FORBIDDEN_NAMES, "__import__", "__build_class__"]
    found = [getattr(builtins, n) for n in names if hasattr(builtins, n)]
    found += [getattr(sympy, n) for n in names if hasattr(sympy, n)]
    found += [builtins]  # the module itself is also caught by the ModuleType check
    return found


def build_globals(sympy: types.ModuleType) -> dict[str, Any]:
    """The namespace a snippet runs in: allow-listed builtins and sympy names, and RestrictedPython's guards.

    Every value the snippet obtains through an attribute, a subscript, an iteration, an in-place operator
    or a call passes :func:`check_value`, which refuses modules, frames, code objects, tracebacks,
    generators, file objects and the functions of :data:`FORBIDDEN_NAMES`.
    """
    forbidden = _forbidden_objects(sympy)
    forbidden_ids = frozenset(id(obj) for obj in forbidden)
    mutable_matrix: type = sympy.MutableDenseMatrix

    def check_value(value: Any) -> Any:
        if isinstance(value, _FORBIDDEN_TYPES) or id(value) in forbidden_ids:
            raise SandboxError(f"claims may not use a {type(value).__name__} object")
        return value

    def guarded_getattr(obj: Any, name: str, *default: Any) -> Any:
        if not isinstance(name, str):
            raise TypeError(f"attribute names must be strings, got {type(name).__name__}")
        if name.startswith("_") or name in FORBIDDEN_ATTRIBUTES:
            raise SandboxError(f"attribute .{name} is not available in claims")
        return check_value(getattr(obj, name, *default))

    def guarded_getitem(obj: Any, key: Any) -> Any:
        return check_value(obj[key])

    def guarded_iter(obj: Any) -> Iterator[Any]:
        for item in obj:
            yield check_value(item)

    def guarded_write(obj: Any) -> Any:
        if isinstance(obj, (list, dict, set, bytearray, mutable_matrix)):
            return obj
        raise SandboxError(f"claims may assign items of lists, dicts and Matrix only, not {type(obj).__name__}")

    def guarded_inplace(op: str, target: Any, value: Any) -> Any:
        if op not in _INPLACE_OPERATORS:
            raise SandboxError(f"in-place operator {op!r} is not supported")
        return check_value(_INPLACE_OPERATORS[op](target, value))

    def guarded_apply(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # f(*args, **kwargs): keyword names come from data here, so apply the underscore rule to them too
        hidden = sorted(name for name in kwargs if name.startswith("_"))
        if hidden:
            raise SandboxError(f"keyword arguments starting with '_' are not allowed ({hidden[0]!r})")
        return func(*args, **kwargs)

    safe_builtins = {name: getattr(builtins, name) for name in sorted(BUILTIN_NAMES)}
    namespace: dict[str, Any] = {
        "__builtins__": safe_builtins,
        "__name__": "claim",
        "_getattr_": guarded_getattr,
        "_getitem_": guarded_getitem,
        "_getiter_": guarded_iter,
        "_write_": guarded_write,
        "_inplacevar_": guarded_inplace,
        "_unpack_sequence_": guarded_unpack_sequence,
        "_iter_unpack_sequence_": guarded_iter_unpack_sequence,
        "_apply_": guarded_apply,
        "_print_": PrintCollector,
        "_checked_": check_value,
    }
    for name in sorted(SYMPY_NAMES):
        namespace[name] = getattr(sympy, name)
    return namespace


def harden_sympy_parser(sympy: types.ModuleType) -> None:
    """Make sympy's string parser refuse anything but sympy names (this process only).

    ``sympify("...")`` (and so ``S("...")`` and every sympy function given a string) ends in
    ``sympy.parsing.sympy_parser.eval_expr``, a plain ``eval`` whose globals include ``__import__``,
    ``open``, ``eval`` and ``lambdify``. sympy also parses its own fixed strings lazily, so the parser is not
    removed; its ``eval`` is replaced by one that first checks every name the compiled expression uses:
    no leading ``_``, and each name that resolves must be a sympy expression, a sympy class, a number or
    one of the allowed sympy functions. Builtins are removed from the evaluation.
    """
    from sympy.parsing import sympy_parser

    allowed_callables = {id(getattr(sympy, name)) for name in SYMPY_NAMES}

    def acceptable(value: object) -> bool:
        if isinstance(value, (sympy.Basic, int, float, complex)) or id(value) in allowed_callables:
            return True
        return isinstance(value, type) and issubclass(value, sympy.Basic)

    def check_code(code: types.CodeType, local_dict: dict, global_dict: dict) -> None:
        for name in code.co_names:  # global names and attribute names alike
            if name.startswith("_") or name in FORBIDDEN_ATTRIBUTES or name in FORBIDDEN_NAMES:
                raise SandboxError(f"sympy string parsing refused the name {name!r}")
            for scope in (local_dict, global_dict):
                if name in scope:
                    if not acceptable(scope[name]):
                        raise SandboxError(f"sympy string parsing refused {name!r}: not a sympy object")
                    break
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                raise SandboxError("sympy string parsing refused a nested function")

    def safe_eval_expr(code: str | types.CodeType, local_dict: dict, global_dict: dict) -> Any:
        if isinstance(code, str):
            code = compile(code, "<sympy string>", "eval")
        check_code(code, local_dict, global_dict)
        scope = {name: value for name, value in global_dict.items() if not name.startswith("_")}
        scope["__builtins__"] = {}
        return eval(code, scope, local_dict)

    sympy_parser.eval_expr = safe_eval_expr


# --------------------------------------------------------------------------- OS limits and audit hook


def set_limits(cpu_s: float, memory_mb: int) -> None:
    """Apply the per-snippet resource limits to this process (they cannot be raised again)."""
    import math
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_soft = math.ceil(usage.ru_utime + usage.ru_stime + cpu_s)
    limits = [
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_CPU, cpu_soft, cpu_soft + 1),  # SIGXCPU at the soft limit, SIGKILL at the hard
        (resource.RLIMIT_AS, memory_mb * 2**20, memory_mb * 2**20),
        (resource.RLIMIT_FSIZE, 0, 0),
        (resource.RLIMIT_NOFILE, 32, 32),
        (resource.RLIMIT_NPROC, 0, 0),
    ]
    for which, soft, hard in limits:
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError):
            if which in (resource.RLIMIT_CPU, resource.RLIMIT_AS):
                raise  # the limits the verdicts depend on must hold; the others are extra layers


_DENIED_EVENTS = _names(
    """
    os.system os.fork os.forkpty os.kill os.killpg os.startfile os.chdir os.remove os.rename os.rmdir
    os.mkdir os.chmod os.chown os.chflags os.lchflags os.link os.symlink os.truncate os.utime os.putenv
    os.unsetenv os.listxattr os.getxattr os.setxattr os.removexattr os.add_dll_directory
    sys.addaudithook sys.settrace sys.setprofile sys._current_frames sys.remote_exec
    code.__new__ function.__new__ pickle.find_class builtins.input
    builtins.breakpoint
    """
)
_DENIED_PREFIXES = (
    "os.exec",
    "os.spawn",
    "os.posix_spawn",
    "subprocess.",
    "pty.",
    "socket.",
    "ssl.",
    "ctypes.",
    "mmap.",
    "resource.",
    "signal.",
    "gc.",
    "shutil.",
    "tempfile.",
    "glob.",
    "urllib.",
    "http.",
    "ftplib.",
    "smtplib.",
    "poplib.",
    "imaplib.",
    "nntplib.",
    "telnetlib.",
    "webbrowser.",
    "sqlite3.",
    "syslog.",
    "fcntl.",
    "winreg.",
    "msvcrt.",
)
_DENIED_IMPORTS = _names(
    """
    ctypes _ctypes subprocess _posixsubprocess socket _socket ssl _ssl asyncio multiprocessing
    _multiprocessing pty mmap urllib http ftplib smtplib webbrowser sqlite3 fcntl termios
    """
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def python_roots() -> tuple[str, ...]:
    """Directories the running snippet may read (lazy imports of sympy and the standard library)."""
    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    for module_name in ("sympy", "mpmath", "RestrictedPython"):
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, "__file__", None):
            roots.add(os.path.realpath(os.path.dirname(os.path.dirname(module.__file__))))
    return tuple(sorted(roots))


def install_audit_hook(readable_roots: tuple[str, ...]) -> None:
    """Refuse, from now on and for good, every audited operation a claim has no business doing."""

    def inside_roots(path: object) -> bool:
        if not isinstance(path, (str, bytes)):
            return False
        real = os.path.realpath(os.fsdecode(path))
        return any(real == root or real.startswith(root + os.sep) for root in readable_roots)

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event in _DENIED_EVENTS or event.startswith(_DENIED_PREFIXES):
            raise SandboxError(f"sandbox: {event} is not allowed in claims")
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            if writing or not inside_roots(path):
                raise SandboxError(f"sandbox: opening {path!r} is not allowed in claims")
        elif event in ("os.listdir", "os.scandir"):
            if not inside_roots(args[0] if args else None):
                raise SandboxError(f"sandbox: listing {args[0]!r} is not allowed in claims")
        elif event == "import":
            name = args[0] if args else ""
            if isinstance(name, str) and name.split(".")[0] in _DENIED_IMPORTS:
                raise SandboxError(f"sandbox: importing {name} is not allowed in claims")

    sys.addaudithook(hook)


# --------------------------------------------------------------------------- running one snippet


def _short(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def classify_result(namespace: dict[str, Any], sympy: types.ModuleType) -> tuple[str, str]:
    """``(status, message)`` from the snippet's ``result``: a bool or sympy true/false, nothing else."""
    if "result" not in namespace:
        return "ERROR", "the code never set `result`; end it with e.g. result = simplify(lhs - rhs) == 0"
    result = namespace["result"]
    if type(result) is bool:
        return ("PASS", "") if result else ("FAIL", "")
    if result is sympy.true:
        return "PASS", ""
    if result is sympy.false:
        return "FAIL", ""
    kind = type(result).__name__
    if isinstance(result, sympy.core.relational.Relational):
        return "ERROR", (
            f"`result` is the unevaluated sympy relational {_short(result)} ({kind}), not a bool: sympy "
            "could not decide it. Compare a simplified difference instead, e.g. "
            "result = simplify(lhs - rhs) == 0"
        )
    if isinstance(result, sympy.logic.boolalg.Boolean):
        return "ERROR", (
            f"`result` is the undecided sympy boolean {_short(result)} ({kind}), not true/false; "
            "simplify it or compare expressions with simplify(lhs - rhs) == 0"
        )
    return "ERROR", (
        f"`result` must be a bool or sympy true/false, got {kind}: {_short(result)}; "
        "compare explicitly, e.g. result = (simplify(expr) == 0)"
    )


def run_snippet(request: dict[str, Any], send: Callable[[dict[str, Any]], None]) -> None:
    """Check, limit, run and judge one snippet; report through ``send`` (``ready``, then ``result``)."""

    def result(status: str, message: str, seconds: float = 0.0, output: str = "") -> None:
        cut = len(output) > MAX_OUTPUT_CHARS
        send(
            {
                "event": "result",
                "status": status,
                "message": message[:MAX_MESSAGE_CHARS],
                "seconds": seconds,
                "output": output[:MAX_OUTPUT_CHARS] + OUTPUT_CUT_MARKER if cut else output,
                "output_truncated": cut,
            }
        )

    try:
        code = check_source(request["code"], str(request.get("filename", "<claim>")))
    except PolicyError as exc:
        result("ERROR", f"rejected before running: {exc}")
        return
    import sympy

    harden_sympy_parser(sympy)
    namespace = build_globals(sympy)
    roots = python_roots()
    set_limits(float(request["cpu_s"]), int(request["memory_mb"]))
    install_audit_hook(roots)
    send({"event": "ready"})
    start = time.perf_counter()
    try:
        exec(code, namespace)
        status, message = classify_result(namespace, sympy)
    except MemoryError:
        status, message = (
            "ERROR",
            f"MemoryError: the claim went past the memory limit ({request['memory_mb']} MiB)",
        )
    except BaseException as exc:  # every failure of the snippet is an ERROR row
        status, message = "ERROR", f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - start
    printed = namespace.get("_print")
    output = printed() if isinstance(printed, PrintCollector) else ""
    result(status, message, seconds, output)


def main() -> NoReturn:
    """Worker entry point: read the request, detach stdio, run, reply on the saved stdout."""
    raw = sys.stdin.buffer.read()
    reply = os.fdopen(os.dup(1), "w", encoding="utf-8")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    sys.stdout = io.StringIO()  # stray prints (sympy warnings, snippet output) go nowhere

    def send(message: dict[str, Any]) -> None:
        reply.write(json.dumps(message) + "\n")
        reply.flush()

    os.chdir("/")
    try:
        request = json.loads(raw.decode("utf-8"))
        run_snippet(request, send)
    except BaseException as exc:  # report it; never leave the parent waiting
        send({"event": "result", "status": "ERROR", "message": f"worker failure: {type(exc).__name__}: {exc}"})
    reply.flush()
    os._exit(0)  # skip interpreter teardown (sympy caches): the reply is all that matters


if __name__ == "__main__":
    main()
