"""params.yaml and the settings listing of `lopd COMMAND --help`, written from the definitions.

Why generated rather than checked line by line: each setting's help is written once, beside its default and its
check (lopd_core/settings/), and a file written from them cannot drift from them. `python -m lopd_core.config
--write-params` rewrites params.yaml; tests/pipeline/test_config.py fails while the file differs from what it
would write, so a changed default or help is a changed params.yaml in the same commit.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

import yaml

WIDTH = 118  # params.yaml's line length
COMMENT_COLUMN = 28  # where an inline comment starts when the key and value leave room


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, allow_unicode=True).strip()
    return text[:-3].strip() if text.endswith("...") else text  # a plain scalar is dumped as a document


def _flow_item(value: Any) -> str:
    text = _scalar(value)
    if isinstance(value, str):  # `[`, `,` or `{` inside a flow list need quotes a plain scalar does not
        try:
            plain = yaml.safe_load(f"[{text}]") == [value]
        except yaml.YAMLError:
            plain = False
        if not plain:
            text = "'" + value.replace("'", "''") + "'"
    return text


def _flow(value: Any, column: int) -> str:
    """A list or mapping of scalars in flow style, wrapped after `column` to stay within WIDTH."""
    if isinstance(value, dict):
        items, open_, close = [f"{_flow_item(k)}: {_flow_item(v)}" for k, v in value.items()], "{", "}"
    else:
        items, open_, close = [_flow_item(v) for v in value], "[", "]"
    lines, line, start = [], open_, column
    for i, item in enumerate(items):
        piece = item + (", " if i < len(items) - 1 else close)
        if len(line) > 1 and start + len(line) + len(piece.rstrip()) > WIDTH:
            lines.append(line.rstrip())
            line, start = " " * (column + 1), 0
        line += piece
    if not items:
        line += close
    return "\n".join(lines + [line])


def _commented(line: str, help_text: str, indent: str) -> list[str]:
    """`key: value` with its help: inline where it fits, else as comment lines above the key."""
    if not help_text:
        return [line]
    help_text = " ".join(help_text.split())
    first, _, rest = line.partition("\n")
    inline = (first.ljust(COMMENT_COLUMN) if len(first) < COMMENT_COLUMN else first + "  ") + "# " + help_text
    if len(inline) <= WIDTH:
        return [inline] + ([rest] if rest else [])
    above = textwrap.wrap(help_text, WIDTH - len(indent) - 2)
    return [f"{indent}# {text}" for text in above] + [line]


def _section_lines(section: Any, depth: int) -> list[str]:
    indent = "  " * depth
    out: list[str] = []
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        help_text = field.metadata.get("help", "")
        if depth == 0 and out:
            out.append("")
        if dataclasses.is_dataclass(value):
            out += _commented(f"{indent}{field.name}:", help_text, indent)
            out += _section_lines(value, depth + 1)
        elif isinstance(value, dict) and value and all(dataclasses.is_dataclass(v) for v in value.values()):
            out += _commented(f"{indent}{field.name}:", help_text, indent)
            inner = indent + "  "
            for key, item in value.items():
                out += _commented(f"{inner}{key}:", field.metadata.get("key_help", {}).get(key, ""), inner)
                out += _section_lines(item, depth + 2)
        else:
            head = f"{indent}{field.name}: "
            text = _flow(value, len(head)) if isinstance(value, (list, dict)) else _scalar(value)
            out += _commented(head + text, help_text, indent)
    return out


def params_yaml(params: Any) -> str:
    """The text of params.yaml for `params` (the defaults: `Params()`), every key commented with its help."""
    header = textwrap.wrap(" ".join(type(params).__doc__.split()), WIDTH - 2)
    note = "Written by `python -m lopd_core.config --write-params` from lopd_core/settings/: edit the help there."
    return "\n".join([f"# {line}" for line in header] + [f"# {note}"] + _section_lines(params, 0)) + "\n"


def settings_listing(params: Any, only: tuple[str, ...] = (), prefix: str = "") -> list[str]:
    """Each setting as `key = default` and its help indented below, for `lopd COMMAND --help` and
    `python -m lopd_core.config --list`; `only`: the settings under these dotted names (all when empty)."""
    out: list[str] = []
    for field in dataclasses.fields(params):
        key = f"{prefix}{field.name}"
        if only and not any(key == o or key.startswith(o + ".") or o.startswith(key + ".") for o in only):
            continue
        value = getattr(params, field.name)
        help_text = " ".join(field.metadata.get("help", "").split())
        if dataclasses.is_dataclass(value):
            out += settings_listing(value, only, key + ".")
            continue
        if isinstance(value, dict) and value and all(dataclasses.is_dataclass(v) for v in value.values()):
            shown = "{" + ", ".join(value) + "}"
        else:
            shown = _flow(value, 0).replace("\n", " ") if isinstance(value, (list, dict)) else _scalar(value)
        out.append(f"  {key} = {shown}")
        out += textwrap.wrap(help_text, 100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return out
