"""Settings described once: a dataclass field's type, default and :class:`Setting` metadata give its checks, its
error messages and (in :mod:`tformer.cli.flags`) its command-line flag, help text and choices.

``x: int = setting(1, "what it does", group="optimization", rule=positive)`` declares a setting ``x`` with the flag
``--x``; a ``bool`` that defaults to ``True`` gets ``--no-x``. Types are read from the annotations
(:func:`type_problem`): ``int``, ``float`` (an int is a number too), ``str``, ``bool``, ``None``, unions of them,
``Literal[...]``, ``tuple[float, float]`` and ``dict``. A rule is a function of the value that returns ``None``
or what the value must be, optionally with a note (``("in (0, 1]", "AdamW moves each weight by about lr")``).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

Rule = Callable[[Any], "str | tuple[str, str] | None"]


@dataclass(frozen=True)
class Setting:
    """What a field means to users: its help, its group of flags, and how it is checked.

    ``sources`` and ``tokenizers``: the kinds of run the setting applies to (empty: all), and ``why`` it does not
    apply to the others; giving its flag to another kind of run is an error (a setting that would do nothing).
    """

    help: str
    group: str
    rule: Rule | None = None
    expected: str | None = None  # how errors say the type ("a path"); default: from the annotation
    flag: str | None = None  # default: --name-with-dashes (--no-name for a bool that defaults to True); "": none
    required: bool = False  # on the command line (the Python default may mean something else, e.g. None)
    choices: tuple[str, ...] | None = None  # the values a string setting takes (checked, and the flag's choices)
    sources: tuple[str, ...] = ()
    tokenizers: tuple[str, ...] = ()
    why: str = ""


def setting(default: Any, help: str, *, group: str, **meta: Any) -> Any:
    """A dataclass field with :class:`Setting` metadata (a mutable default is copied per instance)."""
    info = Setting(help=help, group=group, **meta)
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"setting": info})
    return dataclasses.field(default=default, metadata={"setting": info})


def info(f: dataclasses.Field) -> Setting:
    return f.metadata["setting"]


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of field ``f``."""
    meta = info(f)
    if meta.flag is not None:
        return meta.flag
    dashed = f.name.replace("_", "-")
    return f"--no-{dashed}" if f.default is True else f"--{dashed}"


def field_types(cls: type) -> dict[str, Any]:
    """Field name -> its resolved annotation."""
    return typing.get_type_hints(cls)


# --------------------------------------------------------------------------------------------------
# Types
# --------------------------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _alternatives(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) in (Union, types.UnionType):
        return get_args(annotation)
    return (annotation,)


def describe(annotation: Any) -> str:
    """How an error message says what a value of ``annotation`` is: ``"an integer"``, ``"'a', 'b' or 'c'"``..."""
    words = []
    for alt in _alternatives(annotation):
        if alt is type(None):
            continue
        if get_origin(alt) is Literal:
            choices = [repr(c) for c in get_args(alt)]
            words.append(", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else choices[0])
        elif get_origin(alt) is tuple:
            words.append(f"{len(get_args(alt))} numbers" if get_args(alt) else "a list")
        else:
            words.append(
                {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a dict"}.get(
                    get_origin(alt) or alt, str(alt)
                )
            )
    return " or ".join(dict.fromkeys(words))


def matches(value: Any, annotation: Any) -> bool:
    """Whether ``value`` is a value of ``annotation`` (JSON's lists count as tuples)."""
    for alt in _alternatives(annotation):
        origin = get_origin(alt) or alt
        if alt is type(None) and value is None:
            return True
        if origin is Literal and any(value == c and type(value) is type(c) for c in get_args(alt)):
            return True
        if origin is int and _is_int(value) or origin is float and _is_number(value):
            return True
        if origin is str and isinstance(value, str) or origin is bool and isinstance(value, bool):
            return True
        if origin is dict and isinstance(value, dict):
            return True
        if origin is tuple and isinstance(value, (tuple, list)):
            items = get_args(alt)
            if len(value) == len(items) and all(matches(v, t) for v, t in zip(value, items, strict=True)):
                return True
    return False


def type_problem(f: dataclasses.Field, annotation: Any, value: Any) -> str | None:
    """``"warmup must be an integer (--warmup); got 'many'"``, or ``None`` when ``value`` fits ``annotation``."""
    if matches(value, annotation):
        return None
    expected = info(f).expected or describe(annotation)
    return f"{f.name} must be {expected}{where(f)}; got {value!r}"


# --------------------------------------------------------------------------------------------------
# Rules and messages
# --------------------------------------------------------------------------------------------------
def where(f: dataclasses.Field, note: str = "") -> str:
    """``" (--flag)"`` or ``" (--flag; note)"``: where the user changes the setting, for error messages (``""``
    or ``" (note)"`` for a setting without a flag)."""
    flag = flag_of(f)
    parts = "; ".join(part for part in (flag, note) if part)
    return f" ({parts})" if parts else ""


def show(value: Any) -> str:
    """A value as error messages print it: floats with ``:g`` (``1e+09``, ``inf``), the rest as ``repr``."""
    return f"{value:g}" if isinstance(value, float) else repr(value)


def rule_problem(f: dataclasses.Field, value: Any) -> str | None:
    """``"lr must be in (0, 1] (--lr; note); got 2"``, or ``None`` when the field's rule holds."""
    meta = info(f)
    if meta.choices is not None and value is not None and value not in meta.choices:
        choices = ", ".join(map(repr, meta.choices))
        return f"{f.name} must be one of {choices}{where(f)}; got {show(value)}"
    verdict = None if meta.rule is None else meta.rule(value)
    if verdict is None:
        return None
    what, note = (verdict, "") if isinstance(verdict, str) else verdict
    return f"{f.name} must be {what}{where(f, note)}; got {show(value)}"


def positive(value: int) -> str | None:
    return None if value >= 1 else "a positive integer"


def non_negative(off: str) -> Rule:
    """``>= 0``, where 0 means ``off`` (said in the message)."""
    return lambda value: None if value >= 0 else (">= 0", off)


def finite_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False, note: str = "") -> Rule:
    """A finite number in the interval from ``low`` to ``high`` (each end closed unless said open)."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def rule(value: float):
        if not math.isfinite(value):
            return "a finite number"
        inside = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
        return None if inside else ((f"in {interval}", note) if note else f"in {interval}")

    return rule


def finite_at_least(low: float, off: str) -> Rule:
    def rule(value: float):
        if not math.isfinite(value):
            return "a finite number"
        return None if value >= low else (f">= {low:g}", off)

    return rule
