"""Chat templates (tformer.generation.chat) on small templates written here; the real one (SmolLM2's) is compared
with transformers' apply_chat_template in tests/interop/test_real_checkpoints.py."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from tformer import ChatTemplateError, chat_prompt
from tformer.tokenizers import HFTokenizer

USER = [{"role": "user", "content": "Hi"}]


def tokenizer(template, **specials) -> HFTokenizer:
    settings = {"chat_template": template, **specials} if template is not None else specials
    return HFTokenizer(Tokenizer(WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")), settings=settings)


def test_blocks_are_trimmed_and_special_tokens_given_by_name():
    template = (
        "{% for m in messages %}\n"
        "    {{ bos_token }}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tok = tokenizer(template, bos_token={"content": "<s>", "lstrip": False}, eos_token="</s>")  # both forms
    chat = [{"role": "system", "content": "Be brief."}, *USER]
    assert chat_prompt(tok, chat) == "    <s>system: Be brief.</s>\n    <s>user: Hi</s>\nassistant:"
    assert chat_prompt(tok, chat, add_generation_prompt=False) == "    <s>system: Be brief.</s>\n    <s>user: Hi</s>\n"


def test_loop_controls_and_a_tojson_that_keeps_text_as_it_is():
    template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}{{ m | tojson }}{% endfor %}"
    )
    chat = [{"role": "system", "content": "x"}, {"role": "user", "content": "é <b>"}]
    assert (
        chat_prompt(tokenizer(template), chat) == '{"role": "user", "content": "é <b>"}'
    )  # Jinja's own: \u003cb\u003e


def test_the_template_can_refuse_a_conversation():
    template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message comes first') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match=r"could not lay out the conversation: a system message comes first"):
        chat_prompt(tokenizer(template), USER)


def test_the_sandbox_keeps_a_template_away_from_pythons_internals():
    with pytest.raises(ChatTemplateError, match=r"could not lay out the conversation"):
        chat_prompt(tokenizer("{{ ''.__class__.__mro__[1].__subclasses__() }}"), USER)


def test_of_several_named_templates_the_default_one_is_used():
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages[0]['content'] }}"}]
    assert chat_prompt(tokenizer(named), USER) == "Hi"


@pytest.mark.parametrize(
    ("template", "messages", "message"),
    [
        (None, USER, r"^the model's tokenizer has no chat template \(tokenizer_config.json's chat_template\)"),
        ("x", [], r"messages must be a non-empty list of \{'role', 'content'\} dicts; got \[\]"),
        ("x", "Hi", r"messages must be a non-empty list .*; got 'Hi'"),
        (
            "x",
            [{"role": "user"}],
            r"message 0 must be a dict with a string 'role' and 'content'; got \{'role': 'user'\}",
        ),
        ("x", [*USER, {"role": "user", "content": 3}], r"message 1 must be a dict with a string 'role' and 'content'"),
    ],
)
def test_bad_input_is_a_chat_template_error_naming_it(template, messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        chat_prompt(tokenizer(template), messages)


@pytest.mark.parametrize("wrong", [None, "x", {"chat_template": "{{ 1 }}"}])
def test_something_that_is_not_a_tokenizer_is_a_type_error_not_a_missing_template(wrong):
    with pytest.raises(TypeError, match=r"chat_prompt needs the model's tokenizer \(Pretrained.tokenizer\); got "):
        chat_prompt(wrong, USER)
