"""Multi-turn chat rows: a conversation rendered once by its chat template, loss on the assistant turns.

The loss mask comes from the rendered text, not from tokenizing messages one by one (which can
disagree with what the template writes): the whole conversation is rendered to one string, each
assistant turn's character span in it is located, and the string is tokenized in pieces cut at the
spans' edges (one call for all of them), the spans' tokens trained. Cut there, no token holds both an
answer's text and its context's, as at inference, where the model continues from the generation
prompt's tokens: tokenized whole, a plain-text header's end and the answer's start can merge (Mistral
v1's '[/INST]' and an answer's '<b>' make one ']<' in Qwen's vocabulary), which would train a piece
of the prompt. Elsewhere the ids are those of the text tokenized whole.

An assistant turn's span is located as a prompt/response row's answer is (`sfttrain.data.template`):
from where the template's generation prompt ends (the text the model is given before it answers)
through the template's end-of-turn token (`<|im_end|>` for Qwen), which is trained so the model
learns to stop. The newline the template writes after it is not trained: generation stops at the
end-of-turn token, so the model never writes that newline; it is glue the template puts before the
next turn's header.

Locating a span needs the template to render the messages before an assistant turn the same way
whether or not more messages follow, and to end every assistant turn with the token it ends the
last one with. A template that does not (one that counts the turns in a header, Mistral's v3 and
Tekken templates with a system message, which they write into the last user turn only) gives a
clear error naming the row. The trained tokens are those of the one rendering, so an earlier turn
trains as the template renders it for the turns after it; the last answer, which nothing follows,
must render all of its content and reasoning, or the row is refused (DeepSeek-R1's template keeps
only what follows `</think>` in every answer). Qwen3's template renders every assistant turn before
the last user message without its reasoning (its <think> block is dropped), and the turns after it
(the last answer, and the steps of a final tool loop) with it; the trained tokens are exactly those
of the one rendering, so:
  - an earlier turn trains its answer without reasoning, as the model sees it in later contexts;
  - the last turn trains `<think>\\n{reasoning}\\n</think>\\n\\n{answer}<|im_end|>`, the reasoning
    from `reasoning_content` or a `<think>...</think>` prefix of `content` (an empty block when
    there is none);
  - with `enable_thinking=false` (a row's enable_thinking_key column) the empty think block is part
    of Qwen3's generation prompt, so it is context, not trained, as at inference with thinking off;
    such a row whose last turns carry reasoning contradicts itself and is refused with its row.
Qwen3 renders a tool loop's reasoning while the loop lasts and drops it once a later user message
follows, so such a conversation is not prefix-stable there and is refused with its row: split it
at that user message (one row per question) or drop the earlier turns' reasoning.
"""

from __future__ import annotations

import os

from jinja2 import TemplateError

from sfttrain.config import ConfigError
from sfttrain.data.render import Renderer, RenderedSample, RowError, each_row
from sfttrain.data.template import (DROPPED_FIX, TEMPLATE_FIX, AnswerNotLocated, TemplateFailed, answer_span,
                                    apply_template, check_no_end_token, dropped)

ROLES = ("system", "user", "assistant", "tool")
ROLE_HINTS = {  # other formats' names of these roles, and what to do
    "model": " ('model' is Gemini's name for the assistant: rename it 'assistant')",
    "function": " ('function' is OpenAI's former name for a tool's result: rename it 'tool')",
    "ipython": " ('ipython' is Llama 3's name for a tool's result: rename it 'tool')",
    "developer": " ('developer' is OpenAI's newer name for the system message: rename it 'system')",
}


class ChatRenderer(Renderer):
    """Renders rows (messages, template kwargs, row) of data.multiturn data."""

    def __init__(self, tokenizer, *, max_length: int, truncation: str, chat_template: str | None = None):
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ConfigError("data.multiturn.enable=true renders each conversation with a chat template, and the "
                              "tokenizer has none: set data.chat_template to a template file (.jinja) or its text, "
                              "e.g. the template of the model's instruct version")
        super().__init__(tokenizer, max_length=max_length, truncation=truncation, chat_template=chat_template)
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError("data.multiturn needs a fast tokenizer (character offsets of the rendered text); "
                              f"{type(tokenizer).__name__} is not one")
        if self.turn_end.token is None:
            raise ConfigError(f"the chat template writes {self.turn_end.tail[:20]!r} after an assistant message, no "
                              "token of the tokenizer's own; data.multiturn needs a template that ends each assistant "
                              "turn with one, where the next turn's text starts (set data.chat_template=...)")

    def _render(self, messages: list[dict], kwargs: dict, generation_prompt: bool) -> str:
        return apply_template(self.tokenizer, messages, add_generation_prompt=generation_prompt,
                              chat_template=self.chat_template, **kwargs)

    def render_many(self, rows: list[tuple[list[dict], dict, int]]) -> list[RenderedSample]:
        """A conversation's masks come from its own rendering: one at a time."""
        return each_row(rows, lambda r: self.render(*r))

    def render(self, messages: list[dict], kwargs: dict, row: int) -> RenderedSample:
        check_messages(messages, row)
        check_thinking_off(messages, kwargs, row)
        messages = [{**m, "content": m.get("content", "")} for m in messages]  # Qwen3's template needs a string
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        try:
            for i in turns:
                check_no_end_token([t for t in (messages[i].get("reasoning_content"), messages[i]["content"])
                                    if isinstance(t, str)], self.turn_end, f"assistant message {i}")
        except AnswerNotLocated as e:
            raise ValueError(f"row {row}: {e}") from None
        try:
            text = self._render(messages, kwargs, False)
            spans = [self._assistant_span(text, messages, kwargs, i, row) for i in turns]
        except TemplateFailed as e:
            raise ValueError(f"row {row}: the chat template failed on this conversation: {e}; "
                             f"{TEMPLATE_FIX}") from None
        check_turns_apart(spans, turns, self.end_token, row)
        check_last_answer(messages[turns[-1]], text[slice(*spans[-1])], turns[-1], row)
        edges = [0, *(k for span in spans for k in span), len(text)]
        pieces = self.tokenizer([text[a:b] for a, b in zip(edges, edges[1:])], add_special_tokens=False)["input_ids"]
        input_ids = [t for piece in pieces for t in piece]
        loss_mask = [k % 2 for k, piece in enumerate(pieces) for _ in piece]  # every other piece is an answer
        n = len(spans)
        return self.fit(input_ids, loss_mask, row, f"{n} assistant turn{'s' * (n != 1)} of {len(messages)} "
                                                   f"messages, {sum(loss_mask)} trained")

    def _assistant_span(self, text: str, messages: list[dict], kwargs: dict, i: int, row: int) -> tuple[int, int]:
        """Character span in `text` of assistant message i: after the generation prompt, through the
        end-of-turn token (`sfttrain.data.template.answer_span`)."""
        try:
            span = answer_span(self.tokenizer, text, self._render(messages[:i], kwargs, True), self.turn_end,
                               lambda: self._render(messages[:i], kwargs, False), f"assistant message {i}")
            return span.start, span.stop
        except AnswerNotLocated as e:
            raise ValueError(f"row {row}: {e}") from None


def check_turns_apart(spans: list[tuple[int, int]], turns: list[int], end_token: str, row: int) -> None:
    """Each turn's span ends before the next one starts: a template that ends earlier turns with
    another token than the conversation's last answer (found by the probe) would otherwise have a
    turn run on through the next user message to a later turn's end."""
    for (_, stop), (start, _), i in zip(spans, spans[1:], turns):
        if stop > start:
            raise ValueError(f"row {row}: assistant message {i} does not end with {end_token!r} (the end-of-turn "
                             "token the chat template writes after a conversation's last answer) before the next "
                             "assistant turn: the template ends earlier turns otherwise, and the turn cannot be "
                             f"located; {TEMPLATE_FIX}")


def check_last_answer(message: dict, rendered: str, i: int, row: int) -> None:
    """The conversation's last answer is what the model is trained to generate: a template that
    renders it without part of its content or reasoning (DeepSeek-R1's drops what precedes
    </think>) would train something else than the row says, so it is refused. Earlier turns are
    trained as the template renders them in later contexts (Qwen3 drops their reasoning there)."""
    texts = [t for t in (message.get("reasoning_content"), message["content"]) if t]
    if lost := dropped(texts, rendered):
        raise ValueError(f"row {row}: the chat template renders assistant message {i}, the last answer, as "
                         f"{rendered[:80]!r}, without part of its content or reasoning ({lost[:80]!r}): what would be "
                         f"trained is not the row's answer. {DROPPED_FIX}")


def check_messages(messages: list[dict], row: int) -> None:
    """A conversation the templates can render: known roles, string contents, an assistant turn to
    train, each with content (or tool calls), and a message before the first one (the prompt it
    answers). The reader has dropped null keys, so a null content arrives here as a missing one."""
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            hint = ROLE_HINTS.get(m.get("role"), "")
            raise ValueError(f"row {row}: message {i} has role {m.get('role')!r}; expected one of {list(ROLES)}{hint}")
        if not isinstance(m.get("content", ""), str):
            raise ValueError(f"row {row}: message {i} content is {type(m['content']).__name__}, expected a string")
        # a turn that only calls tools has no text (OpenAI's format leaves content null); any other
        # assistant turn without content would train an empty answer without a word
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
    """With enable_thinking=false Qwen3's generation prompt holds an empty, closed think block, but
    the template still renders the reasoning of the turns after the last user message: such a turn
    would be trained from the middle of its think block, so the row is refused."""
    if kwargs.get("enable_thinking") is not False:
        return
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    for i, m in enumerate(messages[last_user + 1:], start=last_user + 1):
        if m["role"] == "assistant" and (m.get("reasoning_content") or "</think>" in m.get("content", "")):
            raise ValueError(f"row {row}: enable_thinking is false, but assistant message {i} has reasoning "
                             "(reasoning_content or a <think> block) that the template renders after the closed think "
                             "block of the prompt; drop its reasoning or set the row's enable_thinking to true")


def resolve_chat_template(d) -> str | None:
    """data.chat_template as template text: the file's contents where it names a file (any existing
    path, or a name ending in .jinja), else the text itself; None: the tokenizer's own template."""
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
    """The renderer the data config asks for (`sfttrain.config.DataConfig`): conversations with
    data.multiturn.enable, else prompt/response pairs, refusing token ids past the model's
    `embedding_rows` (`Renderer.limit_ids`). The chat template renders a probe conversation here,
    so that one that does not parse or render stops the start (and the preflight) naming the key,
    not the first row."""
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
