"""Multi-turn chat rows: a conversation rendered once by its chat template, loss on the assistant turns.

Each assistant turn's span is located in the rendered text as a prompt/response row's answer is
(`sfttrain.data.render`): after the generation prompt, through the end-of-turn token, which is
trained so the model learns to stop; the newline after it is glue before the next header, never
generated. The text is tokenized in pieces cut at the spans' edges, so no token holds both an
answer's text and its context's (tokenized whole, Mistral v1's '[/INST]' and an answer's '<b>' merge
into one ']<' in Qwen's vocabulary). The trained tokens are those of the one rendering: an earlier
turn trains as the template renders it before later turns (Qwen3 drops its reasoning there), the
last answer must render whole. A template that is not prefix-stable, or a row that contradicts
itself (reasoning with enable_thinking=false), is refused naming the row.
"""

from __future__ import annotations

import os

from jinja2 import TemplateError

from sfttrain.config import ConfigError
from sfttrain.data.render import (TEMPLATE_FIX, AnswerNotLocated, Renderer, RenderedSample, RowError,
                                  TemplateFailed, answer_span, check_no_end_token, check_whole, each_row)

ROLES = ("system", "user", "assistant", "tool")


class ChatRenderer(Renderer):

    def __init__(self, tokenizer, *, max_length: int, truncation: str, chat_template: str | None = None):
        super().__init__(tokenizer, max_length=max_length, truncation=truncation, chat_template=chat_template)
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError("data.multiturn needs a fast tokenizer (character offsets of the rendered text); "
                              f"{type(tokenizer).__name__} is not one")
        if self.turn_end.token is None:
            raise ConfigError(f"the chat template writes {self.turn_end.tail[:20]!r} after an assistant message, no "
                              "token of the tokenizer's own; data.multiturn needs a template that ends each assistant "
                              "turn with one, where the next turn's text starts (set data.chat_template=...)")

    def render_many(self, rows: list[tuple[list[dict], dict, int]],
                    failed: list[RowError] | None = None) -> list[RenderedSample]:
        return each_row(rows, lambda r: self.render(*r), failed)

    def render(self, messages: list[dict], kwargs: dict, row: int) -> RenderedSample:
        check_messages(messages, row)
        check_thinking_off(messages, kwargs, row)
        messages = [{**m, "content": m.get("content", "")} for m in messages]  # Qwen3's template needs a string
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        try:
            for i in turns:
                check_no_end_token([t for t in (messages[i].get("reasoning_content"), messages[i]["content"])
                                    if isinstance(t, str)], self.turn_end, f"assistant message {i}")
            text = self._apply(messages, False, **kwargs)
            spans = [self._assistant_span(text, messages, kwargs, i) for i in turns]
            last = messages[turns[-1]]  # an earlier turn trains as later turns see it; the last, whole
            check_whole([t for t in (last.get("reasoning_content"), last["content"]) if t], text[slice(*spans[-1])],
                        f"assistant message {turns[-1]}, the last answer,")
        except AnswerNotLocated as e:
            raise ValueError(f"row {row}: {e}") from None
        except TemplateFailed as e:
            raise ValueError(f"row {row}: the chat template failed on this conversation: {e}; "
                             f"{TEMPLATE_FIX}") from None
        check_turns_apart(spans, turns, self.end_token, row)
        edges = [0, *(k for span in spans for k in span), len(text)]
        pieces = self.tokenizer([text[a:b] for a, b in zip(edges, edges[1:])], add_special_tokens=False)["input_ids"]
        input_ids = [t for piece in pieces for t in piece]
        loss_mask = [k % 2 for k, piece in enumerate(pieces) for _ in piece]  # every other piece is an answer
        n = len(spans)
        return self.fit(input_ids, loss_mask, row, f"{n} assistant turn{'s' * (n != 1)} of {len(messages)} "
                                                   f"messages, {sum(loss_mask)} trained")

    def _assistant_span(self, text: str, messages: list[dict], kwargs: dict, i: int) -> tuple[int, int]:
        return answer_span(self.tokenizer, text, self._apply(messages[:i], True, **kwargs), self.turn_end,
                           lambda: self._apply(messages[:i], False, **kwargs), f"assistant message {i}")[:2]


def check_turns_apart(spans: list[tuple[int, int]], turns: list[int], end_token: str, row: int) -> None:
    """A template that ends earlier turns otherwise than the last one would run a turn on into the next."""
    for (_, stop), (start, _), i in zip(spans, spans[1:], turns):
        if stop > start:
            raise ValueError(f"row {row}: assistant message {i} does not end with {end_token!r} (the end-of-turn "
                             "token the chat template writes after a conversation's last answer) before the next "
                             "assistant turn: the template ends earlier turns otherwise, and the turn cannot be "
                             f"located; {TEMPLATE_FIX}")


def check_messages(messages: list[dict], row: int) -> None:
    """Known roles, string contents, an assistant turn with content (or tool calls) after a prompt.
    The reader has dropped null keys: a null content arrives as a missing one."""
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise ValueError(f"row {row}: message {i} has role {m.get('role')!r}; expected one of {list(ROLES)}")
        if not isinstance(m.get("content", ""), str):
            raise ValueError(f"row {row}: message {i} content is {type(m['content']).__name__}, expected a string")
        # a turn that only calls tools has no text; any other would train an empty answer
        if m["role"] == "assistant" and not m.get("content", "").strip() and not (m.get("tool_calls") or
                                                                             m.get("reasoning_content")):
            raise ValueError(f"row {row}: assistant message {i} has no content (null, missing or empty); it would "
                             "train the model to answer nothing: give it the answer's text, or drop the turn (or the "
                             "row)")
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise ValueError(f"row {row}: the conversation has no assistant message, so nothing to train on")
    if roles[0] == "assistant":
        raise ValueError(f"row {row}: message 0 is an assistant turn; a conversation starts with a system or user "
                         "message")


def check_thinking_off(messages: list[dict], kwargs: dict, row: int) -> None:
    """With enable_thinking=false Qwen3's generation prompt closes an empty think block, yet renders the
    reasoning of turns after the last user message: they would train from inside their think block."""
    if kwargs.get("enable_thinking") is not False:
        return
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    for i, m in enumerate(messages[last_user + 1:], start=last_user + 1):
        if m["role"] == "assistant" and (m.get("reasoning_content") or "</think>" in m.get("content", "")):
            raise ValueError(f"row {row}: enable_thinking is false, but assistant message {i} has reasoning "
                             "(reasoning_content or a <think> block) that the template renders after the closed think "
                             "block of the prompt; drop its reasoning or set the row's enable_thinking to true")


def resolve_chat_template(d) -> str | None:
    """data.chat_template as template text (a file's contents or the text); None: the tokenizer's."""
    value = d.chat_template
    if value is None:
        return None
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if value.endswith((".jinja", ".jinja2", ".j2")) or "{" not in value:  # a template without {{ }} or {% %}: a path
        raise ConfigError(f"data.chat_template={value!r}: no such file; give an existing template file or the "
                          "template text itself")
    return value


def build_renderer(d, tokenizer, embedding_rows: int | None) -> Renderer:
    """Conversations (data.multiturn.enable) or prompt/response pairs, refusing ids past the model's
    `embedding_rows`. A probe renders here, so a template that fails stops the start naming the key."""
    template = resolve_chat_template(d)
    try:
        if d.multiturn.enable:  # renders a probe turn itself (its end-of-turn token)
            renderer = ChatRenderer(tokenizer, max_length=d.max_length, truncation=d.truncation,
                                    chat_template=template)
        else:
            renderer = Renderer(tokenizer, max_length=d.max_length, truncation=d.truncation,
                                apply_chat_template=d.apply_chat_template, chat_template=template)
            if d.apply_chat_template:
                renderer.render("hi", "hello", row=-1)
        renderer.limit_ids(embedding_rows)  # after the probe: a template's token past them is the first row's problem
        return renderer
    except ConfigError:
        raise
    except (TemplateError, TypeError, KeyError, ValueError, IndexError) as e:
        while isinstance(e, (RowError, TemplateFailed)) and e.__cause__ is not None:  # what the template raised
            e = e.__cause__
        source = (f"data.chat_template={d.chat_template!r}" if d.chat_template is not None
                  else "the tokenizer's chat template (data.chat_template=... replaces it)")
        if isinstance(e, AnswerNotLocated):  # it renders, but not so that an answer can be trained
            raise ConfigError(f"{source} cannot be trained on: {e}") from None
        raise ConfigError(f"{source} does not parse or render: {type(e).__name__}: {str(e).splitlines()[0]}; fix "
                          "the template") from None
