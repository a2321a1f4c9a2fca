"""What a family of Hugging Face models is to tformer: how its ``config.json`` maps onto a :class:`TransformerConfig`
(refusing by name what tformer does not implement, never approximating it), which tformer model it becomes, and its
key table (:mod:`tformer.interop.keys`). The families themselves are small declarative modules: :mod:`.gpt2`,
:mod:`.bert`, :mod:`.llama` (Llama, Qwen2, Mistral), :mod:`.marian`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tformer.config import TransformerConfig
from tformer.interop.keys import InteropError, KeyTable

Kind = Literal["lm", "encoder", "seq2seq"]
REQUIRED = object()

# Hugging Face activation names -> tformer's (only exact equivalents)
ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


@dataclass(frozen=True)
class GenerationIds:
    """The special token ids generation needs: ``eos`` may hold several ids (any of them ends a row)."""

    bos: int | None = None
    eos: tuple[int, ...] = ()
    pad: int | None = None
    decoder_start: int | None = None

    @property
    def eos_id(self) -> int | None:
        return self.eos[0] if self.eos else None


class Family:
    """One family; subclasses set the class attributes and implement the four methods."""

    name: str = ""
    architecture: str = ""  # the HF class written into an exported config.json
    model_types: tuple[str, ...] = ()
    kind: Kind = "lm"

    def config(self, hf: dict[str, Any], source: str) -> TransformerConfig:
        """tformer's config of the HF ``config.json`` ``hf`` (``InteropError`` naming a setting tformer refuses)."""
        raise NotImplementedError

    def keys(self, cfg: TransformerConfig) -> KeyTable:
        raise NotImplementedError

    def rename(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """The file's tensors under the names of the key table (a prefix some files lack or add)."""
        return tensors

    def fit(self, cfg: TransformerConfig, names: set[str]) -> TransformerConfig:
        """``cfg`` with the optional parts the file's tensors (``names``, renamed) lack left out (default: as is)."""
        return cfg

    def mismatches(self, cfg: TransformerConfig) -> list[str]:
        """Why ``cfg`` cannot be written as this family (empty: it can)."""
        raise NotImplementedError

    def hf_config(self, cfg: TransformerConfig, generation: GenerationIds) -> dict[str, Any]:
        """The ``config.json`` of ``cfg`` for this family (after :meth:`mismatches` came back empty)."""
        raise NotImplementedError


def setting(hf: dict[str, Any], name: str, source: str, default: Any = REQUIRED) -> Any:
    """``hf[name]``, or ``default``; ``InteropError`` naming the file and the field when it is required and absent,
    or not of its kind: a required setting or one with an integer default is a size (a positive integer), one with a
    float default a positive number (an epsilon)."""
    if name in hf and hf[name] is not None:
        value = hf[name]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if (default is REQUIRED or type(default) is int) and not (number and isinstance(value, int) and value >= 1):
            raise InteropError(f"{source}: {name}={value!r} must be a positive integer")
        if type(default) is float and not (number and value > 0):
            raise InteropError(f"{source}: {name}={value!r} must be a positive number")
        return value
    if default is REQUIRED:
        raise InteropError(f"{source}: config.json lacks {name!r}")
    return default


def refuse(condition: bool, source: str, field: str, value: Any, why: str) -> None:
    """``InteropError`` when ``condition``: tformer refuses the setting ``field=value``, and says why."""
    if condition:
        raise InteropError(f"{source}: {field}={value!r} is not supported: {why}")


def activation(hf: dict[str, Any], name: str, source: str, default: str) -> str:
    value = setting(hf, name, source, default)
    refuse(value not in ACTIVATIONS, source, name, value, f"tformer implements {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[value]


def head_dim_must_split(hf: dict[str, Any], d_model: int, heads: int, source: str) -> None:
    head_dim = hf.get("head_dim")
    refuse(d_model % heads != 0, source, "num_attention_heads", heads, f"it must divide the width {d_model}")
    refuse(
        head_dim is not None and head_dim != d_model // heads,
        source,
        "head_dim",
        head_dim,
        f"tformer's heads are d_model / heads = {d_model // heads} wide",
    )


def differences(cfg: TransformerConfig, wanted: dict[str, Any], family: str) -> list[str]:
    """``"TransformerConfig.position='sinusoidal' (GPT-2 needs 'learned')"`` for each field of ``wanted`` that ``cfg``
    does not have (a value of ``wanted`` may be a tuple of allowed values)."""
    out = []
    for name, allowed in wanted.items():
        value = getattr(cfg, name)
        ok = value in allowed if isinstance(allowed, tuple) else value == allowed
        if not ok:
            need = " or ".join(map(repr, allowed)) if isinstance(allowed, tuple) else repr(allowed)
            out.append(f"TransformerConfig.{name}={value!r} ({family} needs {need})")
    return out


def reverse_activation(name: str, preferred: dict[str, str] | None = None) -> str:
    """The HF name of tformer's activation ``name`` (``preferred`` first: GPT-2 calls its tanh GELU ``gelu_new``)."""
    if preferred and name in preferred:
        return preferred[name]
    return next(hf for hf, ours in ACTIVATIONS.items() if ours == name)
