"""The chat template: rendering a conversation with it."""

from __future__ import annotations

PROBE = "\x00sfttrain-probe\x00"  # an assistant content no real text contains
TEMPLATE_FIX = "fix the template (data.chat_template=... replaces the tokenizer's) or the row"


class TemplateFailed(ValueError):
    """The chat template raised while rendering (a row's texts, or the start-up's probe): the
    template's own exception, whatever its type, as one line (a ValueError, which each_row names
    the row of)."""


def apply_template(tokenizer, messages: list[dict], **kwargs) -> str:
    """tokenizer.apply_chat_template(messages, tokenize=False, **kwargs). A template is user code
    (Jinja) that may raise anything on some rows only, in a branch the others never take: a
    TemplateError from raise_exception, an undefined attribute, a ZeroDivisionError, a TypeError on
    a number where it expects text. Each is TemplateFailed, so the run and the preflight stop
    naming the row instead of ending in the template's traceback."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 (the template's own code: any exception is its failure)
        raise TemplateFailed(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
