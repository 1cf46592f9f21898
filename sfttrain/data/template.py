"""The chat template: rendering a conversation, and where an assistant's answer lies in the text.

An answer's span comes from the template's own text, whatever it does around the content (Llama 3
and Gemma trim it, Mistral v3 and Llama 2 put a space before it): it starts where the generation
prompt for the messages before it ends (or where the two part, as with Qwen3's thinking-off
`<think>` block), and ends with the end-of-turn token (`TurnEnd`, found by rendering a probe), since
generation stops there: what the template writes after it is not trained.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, NamedTuple

from sfttrain.config import ConfigError

PROBE = "\x00sfttrain-probe\x00"  # an assistant content no real text contains
TEMPLATE_FIX = "fix the template (data.chat_template=... replaces the tokenizer's) or the row"
DROPPED_FIX = ("A template that drops reasoning (DeepSeek-R1's keeps what follows </think> only) trains no "
               "reasoning: use one that renders it (data.chat_template=... replaces the tokenizer's), or take it out "
               "of the data")


class TemplateFailed(ValueError):
    """The template's own exception, whatever its type, as one line (a ValueError: each_row names its row)."""


def apply_template(tokenizer, messages: list[dict], **kwargs) -> str:
    """The rendered text. A template is user code that may raise anything on some rows only: each is
    TemplateFailed, so the run and the preflight name the row instead of showing its traceback."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 (the template's own code: any exception is its failure)
        raise TemplateFailed(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


class AnswerNotLocated(ValueError):
    """The template's text does not let an answer be located as the model would generate it."""


@dataclass(frozen=True)
class TurnEnd:
    """What the template writes after an answer: `marker`, through the tokenizer's own `token`, is
    trained with it; `tail` is not."""

    marker: str
    token: str | None
    tail: str


def turn_end(tokenizer, chat_template: str | None) -> TurnEnd:
    """From a probe: through the first added token (`<|im_end|>`, `</s>`) written after the content.
    Text without one is refused: generation could not stop where the template ends an answer."""
    text = apply_template(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": PROBE}],
                          chat_template=chat_template)
    after = text[text.rindex(PROBE) + len(PROBE):]
    added = {t.content for t in tokenizer.added_tokens_decoder.values() if t.content.strip()}  # not a run of spaces
    first = min(((after.find(t), -len(t), t) for t in added if t in after), default=None)  # earliest, then longest
    if first is not None:
        stop = first[0] + len(first[2])
        return TurnEnd(after[:stop], first[2], after[stop:])
    if after.strip():
        pieces = tokenizer.convert_ids_to_tokens(tokenizer(after, add_special_tokens=False)["input_ids"])
        raise ConfigError(f"the chat template writes {after!r} after an answer, which the tokenizer reads as "
                          f"{pieces[:8]}, no token of its own (an added token) that generation can stop at: "
                          "add it to the tokenizer as a special token (and resize the model's embeddings), or set "
                          "data.chat_template=... to a template that ends an answer with one (e.g. the tokenizer's "
                          f"EOS, {tokenizer.eos_token})")
    return TurnEnd("", None, after)  # whitespace only: the renderer appends EOS


class AnswerSpan(NamedTuple):
    start: int  # where the answer starts in the template's text of the conversation
    stop: int  # where it ends: after its end-of-turn token
    prompt_apart: bool  # the template writes its generation prompt for generation only (see answer_span)


def answer_span(tokenizer, text: str, prompt: str, end: TurnEnd, before: Callable[[], str], where: str,
                prompt_apart_ok: bool = False) -> AnswerSpan:
    """The answer's span in `text`, whose messages before it render to `prompt` with the generation
    prompt (`before()`: without). A generation prompt written for generation only (`Answer: `) is
    refused unless `prompt_apart_ok` (a prompt/response row: its context is then what inference sees;
    a conversation's later turns would see the answer without it)."""
    start, apart = ((len(prompt), False) if text.startswith(prompt) else
                    _start_past(tokenizer, text, prompt, before(), where))
    if apart and not prompt_apart_ok:
        raise AnswerNotLocated(f"{where}: the chat template's generation prompt {prompt[start:]!r} is not how it "
                               f"starts the answer ({text[start:start + 40]!r}); the answer cannot be located")
    if end.token is None:  # prompt/response rows only: the answer runs to the template's trailing text
        if not text.endswith(end.tail):
            raise AnswerNotLocated(f"the chat template does not end {where} with {end.tail!r}, as it ends a probe "
                                   "answer")
        return AnswerSpan(start, max(start, len(text) - len(end.tail)), apart)
    stop = text.find(end.token, start)
    if stop < 0:
        raise AnswerNotLocated(f"{where}: no end-of-turn token {end.token!r} after it in the rendered conversation")
    return AnswerSpan(start, stop + len(end.token), apart)


def _start_past(tokenizer, text: str, prompt: str, before: str, where: str) -> tuple[int, bool]:
    """Where the answer starts when `text` lacks the generation prompt whole: past what they share, at
    a token boundary of the prompt ('<b>' shares a '<' with '<think>'), and whether they share nothing
    past the messages before it. Those must be in `text` as they are, or the context is not inference's."""
    stable, shared = len(os.path.commonprefix([before, prompt])), len(os.path.commonprefix([prompt, text]))
    if shared < stable:
        k = max(0, shared - 20)  # some of what they share, then where they part
        raise AnswerNotLocated(
            f"the chat template is not prefix-stable at {where}: it renders the messages before it as "
            f"{prompt[k:k + 60]!r} from character {k} when the conversation ends there (as for generation), but as "
            f"{text[k:k + 60]!r} in the whole conversation, so the answer's context would not be the one the model is "
            "given at inference (Qwen3 drops a tool loop's reasoning once a later user message follows; Mistral's v3 "
            "and Tekken templates write the system message into the last user turn only). Split the conversation "
            "into rows that end at this answer, drop the message the template moves, or replace the template "
            "(data.chat_template=...)")
    if not getattr(tokenizer, "is_fast", False):  # a Python tokenizer has no offsets (prompt/response rows only)
        return shared, shared == stable < len(prompt)
    offsets = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    start = max((b for _, b in offsets if stable < b <= shared), default=stable)
    return start, start == stable < len(prompt)


def check_no_end_token(texts: list[str], end: TurnEnd, where: str) -> None:
    """An answer holding the end-of-turn token as text would teach the model to stop there."""
    for text in texts:
        if end.token is not None and end.token in text:
            k = text.index(end.token)
            raise AnswerNotLocated(f"{where} holds the chat template's end-of-turn token {end.token!r} as text "
                                   f"(at character {k}: {text[max(0, k - 30):k + len(end.token) + 10]!r}); the "
                                   "model would learn to stop there. Remove it from the data")


def dropped(texts: list[str], rendered: str) -> str | None:
    """The first of `texts` that `rendered` does not hold, whitespace aside (templates trim answers)."""
    squeezed = "".join(rendered.split())
    return next((t for t in texts if "".join(t.split()) not in squeezed), None)
