"""`python -m sfttrain.run --help [section]`: every config key with its default and meaning,
read from the schema in sfttrain/config.py (its dataclasses and their comments), so the help
cannot drift from the code.

A key's meaning is its trailing `# comment`; a key without one takes the comment lines right
above it (the schema's style for longer explanations); a key with neither is listed bare.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import shutil
import textwrap
import tokenize
from typing import Any, NamedTuple

from sfttrain.config import ALIASES, CHECKPOINT_KEYS, IGNORED_VERL_KEYS, NULL_ONLY_VERL_KEYS, Config, ConfigError


class KeyHelp(NamedTuple):
    key: str
    default: Any
    meaning: str


def _comments_by_line(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line (without '#')."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}


def _field_meanings(cls: type) -> dict[str, str]:
    """Field name -> its comment, for one schema dataclass."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = _comments_by_line(source)
    lines = source.splitlines()
    meanings = {}
    for node in ast.parse(source).body[0].body:
        if not isinstance(node, ast.AnnAssign):
            continue
        text = comments.get(node.end_lineno)  # a field line holds code, so its comment trails it
        if text is None:  # else the comment block right above the field
            above, line = [], node.lineno - 1
            while line in comments and lines[line - 1].lstrip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            text = " ".join(above)
        meanings[node.target.id] = text
    return meanings


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def schema_keys(cls: type = Config, prefix: str = "") -> list[KeyHelp]:
    """Every key of the schema, depth first in the order config.py declares them."""
    meanings = _field_meanings(cls)
    keys = []
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if dataclasses.is_dataclass(_default(f)):  # a section (f.type is a string here)
            keys.extend(schema_keys(type(_default(f)), key + "."))
        else:
            keys.append(KeyHelp(key, _default(f), meanings.get(f.name, "")))
    return keys


def format_help(section: str | None = None) -> str:
    keys = schema_keys()
    if section is not None:
        keys = [k for k in keys if k.key.startswith(section + ".")]
        if not keys:
            sections = sorted({k.key.rsplit(".", 1)[0] for k in schema_keys() if "." in k.key})
            raise ConfigError(f"--help {section}: no such section; sections: {', '.join(sections)}")
    width = max(shutil.get_terminal_size((100, 20)).columns, 80)
    column = min(max(len(f"  {k.key}={k.default!r}") for k in keys), 44) + 2
    lines = [(f"usage: torchrun --nproc_per_node=N -m sfttrain.run [recipe.yaml] key=value ...\n"
              f"keys{' of ' + section if section else ''} (key=default, meaning; from sfttrain/config.py):")]
    for k in keys:
        head = f"  {k.key}={k.default!r}"
        if len(head) >= column:  # a long default: the meaning goes on the next line
            lines.append(head)
            head = ""
        if k.meaning or head:
            lines.append(textwrap.fill(k.meaning or "-", width, initial_indent=head.ljust(column),
                                       subsequent_indent=" " * column))
    if section is None:
        lines.append("verl spellings accepted: " + ", ".join(f"{old} -> {new}" for old, new in ALIASES.items()))
        lines.append("verl keys accepted and ignored (each said at start-up): " + ", ".join(IGNORED_VERL_KEYS))
        lines.append("verl keys accepted and ignored where null (a value is refused): " + ", ".join(NULL_ONLY_VERL_KEYS))
        # verl command lines carry them; the README says what they do, and --help must name them too
        lines.append(f"verl's {' and '.join(CHECKPOINT_KEYS)}: accepted and ignored (a checkpoint always holds the "
                     "model, optimizer and extra state); hf_model among the contents sets trainer.save_hf=true")
    return "\n".join(lines)


def print_help(section: str | None = None) -> None:
    print(format_help(section))

