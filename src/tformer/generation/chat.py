"""A conversation as the prompt text a chat model was trained on: its tokenizer's chat template, rendered.

An instruction-tuned model (SmolLM2-135M-Instruct, Qwen2-Instruct, ...) was trained on conversations laid out with
markers of its own, e.g. ``<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n``; given the bare question it
continues it as plain text. The layout is a Jinja template shipped with the model (``chat_template`` in
``tokenizer_config.json``; in a GGUF file, ``tokenizer.chat_template``, which the conversion writes there).
:func:`chat_prompt` renders it the way ``transformers``' ``apply_chat_template(..., tokenize=False)`` does, so that
the model sees the text it was trained on:

* Jinja's sandbox (a template is code from a file: it may not reach Python's internals), blocks trimmed
  (``trim_blocks``, ``lstrip_blocks``) and ``break``/``continue`` in loops;
* ``raise_exception(message)`` (templates refuse what they cannot lay out), ``strftime_now(format)``, and a
  ``tojson`` filter that keeps non-ASCII text as it is;
* the variables ``messages``, ``add_generation_prompt`` and the tokenizer's special tokens by name
  (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``).

The rendered text holds the template's special tokens already, so it is encoded without adding any
(``add_special_tokens=False``), as ``transformers`` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template, the messages are not a conversation, or the template refused them."""


def chat_template(tokenizer: Any) -> str | None:
    """The Jinja chat template of ``tokenizer`` (a :class:`tformer.tokenizers.HFTokenizer` loaded with its
    ``tokenizer_config.json``), or ``None``. A ``tokenizer_config.json`` may hold several named templates (a list of
    ``{"name", "template"}``): the one named ``default`` is used, as ``transformers`` does."""
    template = getattr(tokenizer, "settings", {}).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def chat_prompt(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
    """The prompt text of ``messages`` (``[{"role": "system" | "user" | "assistant", "content": str}, ...]``) in the
    layout of ``tokenizer``'s chat template (module docstring); ``add_generation_prompt`` ends it with the opening
    of the assistant's turn, so that what the model generates next is its answer. Encode the result with
    ``tokenizer.encode(text, add_special_tokens=False)``.

    Raises :class:`ChatTemplateError` (a ``ValueError``) when the tokenizer has no chat template, when a message is
    not a mapping with a string ``role`` and ``content``, or when the template itself refuses the conversation
    (its ``raise_exception`` message, e.g. roles out of order)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not all(callable(getattr(tokenizer, name, None)) for name in ("encode", "decode")):
        raise TypeError(f"chat_prompt needs the model's tokenizer (Pretrained.tokenizer); got {tokenizer!r}")
    template = chat_template(tokenizer)
    if template is None:
        raise ChatTemplateError(
            "the model's tokenizer has no chat template (tokenizer_config.json's chat_template); it is not a chat "
            "model, or its folder lacks that file: give it the prompt text itself"
        )
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError(f"messages must be a non-empty list of {{'role', 'content'}} dicts; got {messages!r}")
    for i, message in enumerate(messages):
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ChatTemplateError(f"message {i} must be a dict with a string 'role' and 'content'; got {message!r}")

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    specials = {name: _token_text(tokenizer.settings.get(name)) for name in SPECIAL_TOKENS}
    try:
        return env.from_string(template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **{name: text for name, text in specials.items() if text is not None},
        )
    except jinja2.exceptions.TemplateError as err:
        raise ChatTemplateError(f"the model's chat template could not lay out the conversation: {err}") from None


def _token_text(token: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or an object with its ``content``."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


__all__ = ["ChatTemplateError", "chat_prompt", "chat_template"]
