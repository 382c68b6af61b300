"""A foreign model whose chat template cannot be used is refused at load, in one line naming its folder (issue
#30 item 11): no template at all, a template that raises, reads an undefined variable or does not parse, and
one that cannot render (or drops) the `tool` turn, found by a tool round trip on a probe."""

import pytest
from _foreign_tokenizers import HERMES_TEMPLATE, hermes_tokenizer
from test_chat_templates import tiny_model

from lopd_core.config import ModelConfig
from lopd_core.model.chat.template import TemplateChat
from lopd_core.model.loading import load_policy

TOOL_TURN = (
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
)
BROKEN = {
    "no template": None,
    "raises": "{{ raise_exception('this template refuses everything') }}",
    "undefined variable": "{{ messages[0].content }}{{ settings.style.name }}",
    "syntax error": "{% for m in messages %}{{ m.content }}",
    "tool role raises": HERMES_TEMPLATE.replace(
        TOOL_TURN, "{%- elif m.role == 'tool' %}{{ raise_exception('Unknown role: ' + m.role) }}"
    ),
    "tool role dropped": HERMES_TEMPLATE.replace(TOOL_TURN, ""),
}


def _folder(tmp_path, template):
    tok = hermes_tokenizer()
    tok.chat_template = template
    tiny_model(len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return tmp_path


def test_the_broken_templates_do_differ_from_the_working_one():
    assert TOOL_TURN in HERMES_TEMPLATE  # else the two tool-role cases would test the working template


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_an_unusable_chat_template_is_one_line_naming_the_model_folder(tmp_path, case):
    folder = _folder(tmp_path / "model", BROKEN[case])
    with pytest.raises(ValueError) as caught:
        load_policy(ModelConfig(name_or_path=str(folder), device="cpu"))
    message = str(caught.value)
    assert type(caught.value).__name__ == "ChatTemplateError"  # a StateError: the command line prints one line
    assert message.startswith(f"model {str(folder)!r}: ") and "\n" not in message
    if case.startswith("tool role"):
        assert "tool" in message


def test_a_working_template_loads_and_speaks_its_own_format(tmp_path):
    folder = _folder(tmp_path / "model", HERMES_TEMPLATE)
    _, tokenizer = load_policy(ModelConfig(name_or_path=str(folder), device="cpu"))
    assert isinstance(TemplateChat(tokenizer), TemplateChat)
