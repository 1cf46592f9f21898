"""`python -m sfttrain.run --help [section or word]`: every config key with its default and help."""

from __future__ import annotations

import shutil
import textwrap

from sfttrain.config import ALIASES, CHECKPOINT_KEYS, IGNORED_VERL_KEYS, NULL_ONLY_VERL_KEYS, ConfigError
from sfttrain.config.compat import FOREIGN_NAMES
from sfttrain.config.schema import default_of, schema_fields


def schema_keys() -> list[tuple[str, object, str]]:
    """(key, default, help) of every key of the schema, the help led by the values it takes where they are few."""
    keys = []
    for key, f in schema_fields():
        choices = " | ".join(str(c).lower() if isinstance(c, bool) else c for c in f.metadata["choices"])
        keys.append((key, default_of(key), f"{choices}; {f.metadata['help']}" if choices else f.metadata["help"]))
    return keys


def _select(keys: list[tuple[str, object, str]], word: str) -> list[tuple[str, object, str]]:
    """A section's keys; else those whose name (or another trainer's name) holds the word, then its help."""
    if section := [k for k in keys if k[0].startswith(word + ".")]:
        return section
    word = word.lower()
    foreign = {key for name, key in FOREIGN_NAMES.items() if word in name}
    named = [k for k in keys if word in k[0] or k[0] in foreign]
    return named + [k for k in keys if word in k[2].lower() and k not in named]


def format_help(section: str | None = None) -> str:
    keys = schema_keys() if section is None else _select(schema_keys(), section)
    if not keys:
        sections = sorted({key.rsplit(".", 1)[0] for key, _, _ in schema_keys() if "." in key})
        raise ConfigError(f"--help {section}: no such section or key; sections: {', '.join(sections)}")
    width = max(shutil.get_terminal_size((100, 20)).columns, 80)
    column = min(max(len(f"  {key}={default!r}") for key, default, _ in keys), 44) + 2
    lines = [(f"usage: torchrun --nproc_per_node=N -m sfttrain.run [recipe.yaml] key=value ...\n"
              f"keys{' for ' + section if section else ''} (key=default, meaning):")]
    for key, default, meaning in keys:
        head = f"  {key}={default!r}"
        if len(head) >= column:  # a long default: the meaning goes on the next line
            lines.append(head)
            head = ""
        lines.append(textwrap.fill(meaning or "-", width, initial_indent=head.ljust(column),
                                   subsequent_indent=" " * column))
    if section is None:
        lines.append("verl spellings accepted: " + ", ".join(f"{old} -> {new}" for old, new in ALIASES.items()))
        lines.append("verl keys accepted and ignored (each said at start-up): " + ", ".join(IGNORED_VERL_KEYS))
        lines.append("verl keys accepted and ignored where null (a value is refused): "
                     + ", ".join(NULL_ONLY_VERL_KEYS))
        lines.append(f"verl's {' and '.join(CHECKPOINT_KEYS)}: accepted and ignored (a checkpoint always holds the "
                     "model, optimizer and extra state); hf_model among the contents sets trainer.save_hf=true")
    return "\n".join(lines)
