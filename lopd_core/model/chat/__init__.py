"""The chat layer: token-id conversations in the embedded layout (codec.py) or a model's own template
(template.py), and `make_chat`, which picks one for a tokenizer.

Why a package: the codec is the base both formats build on, the template format imports it, and the choice
between them needs both; with the choice here, neither module imports the other's importer (no cycle).
"""

from lopd_core.model.chat.codec import (
    CHAT_TEMPLATE,
    EOS,
    EXP_END,
    EXP_START,
    IM_END,
    IM_START,
    PAD,
    SPECIAL_TOKENS,
    TOOL_CALL,
    TOOL_CALL_END,
    ChatCodec,
    ChatFormat,
    TrajectoryIds,
    experience_block,
    first_turn_text,
    is_embedded_format,
    observation_text,
)
from lopd_core.model.chat.template import TemplateChat

__all__ = [
    "CHAT_TEMPLATE",
    "EOS",
    "EXP_END",
    "EXP_START",
    "IM_END",
    "IM_START",
    "PAD",
    "SPECIAL_TOKENS",
    "TOOL_CALL",
    "TOOL_CALL_END",
    "ChatCodec",
    "ChatFormat",
    "TemplateChat",
    "TrajectoryIds",
    "experience_block",
    "first_turn_text",
    "is_embedded_format",
    "make_chat",
    "observation_text",
]


def make_chat(tokenizer) -> ChatFormat:
    """The chat format a tokenizer speaks: the embedded layout, or its own chat template.

    A foreign tokenizer needs the experience tokens first (`lopd_core.model.loading.add_experience_tokens`,
    which `load_policy` calls)."""
    if is_embedded_format(tokenizer):
        return ChatCodec(tokenizer)
    return TemplateChat(tokenizer)
