"""Command-line flags derived from :class:`tformer.training.TrainConfig`: each field's flag, type, choices, default and
help come from the field itself (:mod:`tformer.training.settings`), the model flags from ``MODEL_FLAGS`` and the
fields of :class:`tformer.config.TransformerConfig`.

Flags left out of the command line do not reach the namespace at all (``argparse.SUPPRESS``), so that ``--resume``
can tell the flags given now from the saved run's settings. Each flag's ``dest`` is its field's name (model flags:
``model.<field>``), so the namespace is read without a table of names.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from typing import Any, Literal, get_args, get_origin

from tformer.config import TransformerConfig
from tformer.training.config import LM_MODEL, MODEL_FLAGS, SEQ2SEQ_MODEL, ModelFlag, TrainConfig
from tformer.training.settings import field_types, flag_of, info

MODEL_DEST = "model."
TOP_LEVEL_GROUPS = ("run", "source")  # the flags of these groups are listed first, under no title; the others
# under their group's name


def _plain(annotation: Any) -> Any:
    """``X`` for ``X | None``."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 and get_origin(annotation) is not Literal else annotation


def _argument(flag: str, dest: str, annotation: Any, help_text: str, default: Any) -> tuple[list[str], dict]:
    """``add_argument`` arguments for a field of type ``annotation``."""
    kind = _plain(annotation)
    kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS}
    shown = "" if default is None or isinstance(default, bool) else f" (default {_show(default)})"
    if kind is bool and dest == "resume":  # what this command does, not a setting a run keeps: no --no-resume
        kwargs["action"] = "store_true"
    elif kind is bool:  # --x and --no-x: a resumed run can turn off what the saved run turned on, and back
        kwargs["action"] = argparse.BooleanOptionalAction
        flag = "--" + flag.removeprefix("--").removeprefix("no-")
    elif get_origin(kind) is Literal:
        kwargs["choices"] = list(get_args(kind))
    elif get_origin(kind) is tuple:
        items = get_args(kind)
        kwargs.update(
            nargs=len(items), type=items[0], metavar=tuple(f"{dest.upper()}{i + 1}" for i in range(len(items)))
        )
    else:
        kwargs["type"] = kind
    kwargs["help"] = help_text + shown
    return [flag], kwargs


def _show(default: Any) -> str:
    """A default as one would type it: ``2e-3``, ``0.1``, ``0.9 0.99``."""
    if isinstance(default, tuple):
        return " ".join(map(_show, default))
    if isinstance(default, float) and default and not 1e-2 <= abs(default) < 1e5:
        mantissa, exponent = f"{default:e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return f"{default:g}" if isinstance(default, float) else str(default)


def _words(words: dict[str, Any]):
    def convert(text: str) -> Any:
        if text not in words:
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(map(repr, words))})")
        return words[text]

    return convert


def add_train_flags(
    parser: argparse.ArgumentParser, *, only: Iterable[str] | None = None, defaults: dict[str, Any] | None = None
) -> None:
    """Add the flags of TrainConfig's fields (all, or ``only`` these) and the model flags, grouped as the fields say.
    ``defaults`` changes the default a help text shows (e.g. the demo's own)."""
    types, defaults = field_types(TrainConfig), defaults or {}
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(TrainConfig):
        if only is not None and f.name not in only:
            continue
        meta = info(f)
        group = groups.get(meta.group)
        if group is None:
            if meta.group == "source":  # one of --data, --task, --pairs
                group = parser.add_mutually_exclusive_group()
            else:
                group = parser if meta.group in TOP_LEVEL_GROUPS else parser.add_argument_group(meta.group)
            groups[meta.group] = group
        if f.name == "model":
            _add_model_flags(group)
            continue
        if not flag_of(f):
            continue
        default = defaults.get(f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
        names, kwargs = _argument(flag_of(f), f.name, types[f.name], meta.help, default)
        if meta.choices is not None:
            kwargs["choices"] = list(meta.choices)
        if meta.required and only is None:
            kwargs.update(required=True)
            kwargs.pop("default")
        group.add_argument(*names, **kwargs)


def _add_model_flags(group) -> None:
    types = field_types(TransformerConfig)
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    for name, spec in MODEL_FLAGS.items():
        _add_model_flag(group, name, spec, types[name], fields[name].metadata["help"], fields[name].default)


def _add_model_flag(group, name: str, spec: ModelFlag, annotation: Any, help_text: str, default: Any) -> None:
    dest = MODEL_DEST + name
    if name in LM_MODEL and name in SEQ2SEQ_MODEL:  # the kinds' own defaults
        lm, s2s = (_said(model[name], spec) for model in (LM_MODEL, SEQ2SEQ_MODEL))
        help_text += f" (default {lm})" if lm == s2s else f" (default {lm} for LMs, {s2s} for seq2seq)"
    elif default is not None:  # TransformerConfig's
        help_text += f" (default {_said(default, spec)})"
    if spec.words is not None:
        group.add_argument(
            spec.flag,
            dest=dest,
            type=_words(spec.words),
            default=argparse.SUPPRESS,
            metavar="{" + ",".join(spec.words) + "}",
            help=help_text,
        )
        return
    names, kwargs = _argument(spec.flag, dest, annotation, help_text, None)
    if "choices" not in kwargs:
        kwargs["metavar"] = spec.flag.lstrip("-").upper().replace("-", "_")
    group.add_argument(*names, **kwargs)


def _said(value: Any, spec: ModelFlag) -> str:
    """A model default as it is typed (``--norm pre`` for ``norm_first=True``)."""
    if spec.words is not None:
        return next(word for word, v in spec.words.items() if v == value)
    return _show(value)


def given_settings(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The TrainConfig fields and the model fields given on the command line."""
    given = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    model = {k[len(MODEL_DEST) :]: given.pop(k) for k in list(given) if k.startswith(MODEL_DEST)}
    if "betas" in given:
        given["betas"] = tuple(given["betas"])
    return given, model


def flag_of_setting(name: str) -> str:
    """The flag of a TrainConfig field (for messages)."""
    return flag_of(next(f for f in dataclasses.fields(TrainConfig) if f.name == name))
