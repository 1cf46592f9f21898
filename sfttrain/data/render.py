"""(prompt, response) pairs as token ids and a loss mask. With a chat template the trained answer
ends with the template's end-of-turn token, not the tokenizer's EOS where they differ: the served
model stops where its template ends a turn. Otherwise the response is followed by EOS.

An answer's span comes from the template's own text, whatever it does around the content (Llama 3
and Gemma trim it, Mistral v3 and Llama 2 put a space before it): it starts where the generation
prompt for the messages before it ends (or where the two part, as with Qwen3's thinking-off
`<think>` block), and ends with the end-of-turn token (`TurnEnd`, found by rendering a probe), since
generation stops there: what the template writes after it is not trained.

Multi-turn chat rows: a conversation rendered once by its chat template, loss on the assistant turns.

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
from dataclasses import dataclass
from typing import Callable

from jinja2 import TemplateError

from sfttrain.config import ConfigError

PROBE = "\x00sfttrain-probe\x00"  # an assistant content no real text contains
TEMPLATE_FIX = "fix the template (data.chat_template=... replaces the tokenizer's) or the row"


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


def answer_span(tokenizer, text: str, prompt: str, end: TurnEnd, before: Callable[[], str], where: str,
                prompt_apart_ok: bool = False) -> tuple[int, int, bool]:
    """The answer's span in `text` (start, stop after its end-of-turn token, and whether the generation
    prompt is apart), whose messages before it render to `prompt` with the generation prompt
    (`before()`: without). A generation prompt written for generation only (`Answer: `) is
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
        return start, max(start, len(text) - len(end.tail)), apart
    stop = text.find(end.token, start)
    if stop < 0:
        raise AnswerNotLocated(f"{where}: no end-of-turn token {end.token!r} after it in the rendered conversation")
    return start, stop + len(end.token), apart


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


def check_whole(texts: list[str], rendered: str, what: str) -> None:
    """The trained answer holds each of `texts`, whitespace aside (templates trim answers)."""
    squeezed = "".join(rendered.split())
    if lost := next((t for t in texts if "".join(t.split()) not in squeezed), None):
        raise AnswerNotLocated(f"the chat template renders {what} as {rendered[:80]!r}, without part of it "
                               f"({lost[:80]!r}): what would be trained is not the row's answer. A template that "
                               "drops reasoning (DeepSeek-R1's keeps what follows </think> only) trains no reasoning: "
                               "use one that renders it (data.chat_template=... replaces the tokenizer's), or take it "
                               "out of the data")


# in the data fingerprint: raised with every change that renders the same rows to other tokens
RENDERING_VERSION = 2
RENDERING_CHANGE = ("an answer is written as the chat template writes it: ended with its end-of-turn token where the "
                    "tokenizer's EOS differs, trimmed or spaced where the template trims or spaces it, Qwen3's with "
                    "its empty think block")  # said where a resume meets the old version


@dataclass(frozen=True)
class RenderedSample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where token t is a training target (predicted from token t-1), else 0
    row: int  # global row id of the source row (for error messages)
    full_length: int = 0  # tokens before truncation


class RowError(ValueError):
    def __init__(self, row: int, message: str):
        super().__init__(message)
        self.row = row


def each_row(rows: list[tuple], render_one, failed: list[RowError] | None = None) -> list:
    """render_one of each row tuple (its last item the row id); a failure is a RowError naming it,
    raised, or with `failed` added to it and the row left out."""
    out = []
    for r in rows:
        try:
            out.append(render_one(r))
        except ValueError as e:
            if failed is None:
                raise RowError(r[-1], str(e)) from e
            failed.append(RowError(r[-1], str(e)))
    return out


class Renderer:
    def __init__(self, tokenizer, *, max_length: int, truncation: str, apply_chat_template: bool = True,
                 chat_template: str | None = None):
        if apply_chat_template and chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat template; pass a Jinja template (a file or its text) with "
                              "data.chat_template=..., e.g. that of the model's instruct version (or, for "
                              "prompt/response rows, set data.apply_chat_template=false to use the raw prompt text)")
        self.tokenizer, self.max_length, self.truncation = tokenizer, max_length, truncation
        self.apply_chat_template, self.chat_template = apply_chat_template, chat_template
        self.turn_end = turn_end(tokenizer, chat_template) if apply_chat_template else TurnEnd("", None, "")
        if self.turn_end.token is None and tokenizer.eos_token_id is None:
            raise ConfigError("the tokenizer has no eos_token_id; every response is trained to end with EOS, "
                              "so set an eos token on the tokenizer")
        self.end_token = self.turn_end.token or tokenizer.eos_token  # trained after every answer
        self.end_token_id = int(tokenizer.convert_tokens_to_ids(self.end_token))
        self.id_limit: int | None = None  # set by `limit_ids`

    def describe_end(self, stop_ids: list[int]) -> str:
        eos, end = self.tokenizer.eos_token, self.turn_end
        source = ("the tokenizer's EOS" if self.end_token == eos else
                  f"the chat template's end of turn; the tokenizer's EOS is {eos}")
        if end.marker not in ("", end.token):  # text before the token, trained with it (Llama 2's ' </s>')
            source = f"{self.end_token} and the {end.marker[:-len(end.token)]!r} before it: {source}"
        elif self.apply_chat_template and end.token is None:
            source += ": the chat template writes no end-of-turn token after an answer"
        shown = self.end_token if end.marker in ("", end.token) else repr(end.marker)
        return (f"  answers end with    : {shown} ({source}); generation_config.json stops at ids {stop_ids} "
                f"({', '.join(self.tokenizer.convert_ids_to_tokens(stop_ids))})")

    def limit_ids(self, embedding_rows: int | None) -> None:
        """Token ids past the model's embedding rows are refused (a CUDA device-side assert otherwise)."""
        reachable = embedding_rows is not None and len(self.tokenizer) > embedding_rows
        self.id_limit = embedding_rows if reachable else None

    def render(self, prompt: str, response: str, row: int) -> RenderedSample:
        return self.render_many([(prompt, response, row)])[0]

    def render_many(self, rows: list[tuple[str, str, int]],
                    failed: list[RowError] | None = None) -> list[RenderedSample]:
        """One tokenizer call for the contexts and one for the answers: a fast tokenizer uses every core.
        `failed`: as each_row's."""
        texts = each_row(rows, lambda r: (*self._texts(r[0], r[1]), r[2]), failed)
        if not texts:
            return []
        # special tokens (e.g. BOS) for a plain prompt; a chat template writes its own
        contexts = self.tokenizer([t[0] for t in texts], add_special_tokens=not self.apply_chat_template)["input_ids"]
        answers = self.tokenizer([t[1] for t in texts], add_special_tokens=False)["input_ids"]
        return each_row(list(zip(contexts, answers, (t[2] for t in texts))), lambda t: self._pair(*t), failed)

    def _texts(self, prompt: str, response: str) -> tuple[str, str]:
        """(context, answer) as text: the template's rendering of one user turn and its answer, split."""
        if not self.apply_chat_template:
            return prompt, response
        check_no_end_token([response], self.turn_end, "this row's response")
        user = [{"role": "user", "content": prompt}]
        generation = self._template(user, True, "prompt (as one user turn)")
        text = self._template(user + [{"role": "assistant", "content": response}], False,
                              "response (as the answer to its prompt)")
        start, stop, apart = answer_span(self.tokenizer, text, generation, self.turn_end,
                                         lambda: self._template(user, False, "prompt"), "this row's answer",
                                         prompt_apart_ok=True)
        answer = text[start:stop]
        # the trained answer is all of the response, and nothing the template writes before it
        if apart and not answer.lstrip().startswith(response.lstrip()[:1]):
            raise AnswerNotLocated(f"the chat template's generation prompt {generation[start:]!r} is not in its "
                                   f"rendering of the row, which has {answer[:40]!r} where the answer goes: the answer "
                                   f"cannot be told from what the template writes before it; {TEMPLATE_FIX}")
        check_whole([response], answer, "this row's response")
        return (generation if apart else text[:start]), answer

    def _apply(self, messages: list[dict], generation_prompt: bool, **kwargs) -> str:
        return apply_template(self.tokenizer, messages, add_generation_prompt=generation_prompt,
                              chat_template=self.chat_template, **kwargs)  # None: the tokenizer's own

    def _template(self, messages: list[dict], generation_prompt: bool, part: str) -> str:
        try:
            return self._apply(messages, generation_prompt)
        except TemplateFailed as e:
            raise TemplateFailed(f"the chat template failed on this row's {part}: {e}; "
                                 f"{TEMPLATE_FIX}") from e.__cause__

    def _pair(self, context_ids: list[int], answer_ids: list[int], row: int) -> RenderedSample:
        # tokenized apart: joined, tokens could merge across the boundary, unlike inference, which
        # continues from the generation prompt. The end token is trained so that the model stops.
        if self.turn_end.token is None:  # the template's answer (or the plain response) ends without one
            answer_ids = [*answer_ids, self.end_token_id]
        input_ids = [*context_ids, *answer_ids]
        loss_mask = [0] * len(context_ids) + [1] * len(answer_ids)
        return self.fit(input_ids, loss_mask, row, f"{len(context_ids)} prompt + {len(answer_ids)} response")

    def fit(self, input_ids: list[int], loss_mask: list[int], row: int, parts: str) -> RenderedSample:
        """data.max_length / data.truncation; `parts` says in the error what the tokens are made of."""
        n = len(input_ids)
        if n > self.max_length:
            if self.truncation == "error":
                raise ValueError(f"row {row} has {n} tokens ({parts}), more than data.max_length={self.max_length}; "
                                 "raise data.max_length or set data.truncation=left|right")
            if self.truncation == "left":  # keep the end, so the EOS survives
                input_ids, loss_mask = input_ids[-self.max_length :], loss_mask[-self.max_length :]
            else:  # right: keep the start; the EOS (and maybe the whole response) is lost
                input_ids, loss_mask = input_ids[: self.max_length], loss_mask[: self.max_length]
        # token 0 has no predecessor, so it is never a target: sum(loss_mask) stays an exact count
        if loss_mask and loss_mask[0]:
            loss_mask = [0] + loss_mask[1:]
        if self.id_limit is not None and max(input_ids, default=0) >= self.id_limit:
            beyond = sorted({t for t in input_ids if t >= self.id_limit})
            tokens = self.tokenizer.convert_ids_to_tokens(beyond[:5])
            raise ValueError(f"row {row} has token ids {beyond[:5]} ({tokens}) at or past the model's {self.id_limit} "
                             f"embedding rows (config.json vocab_size); the tokenizer has {len(self.tokenizer)} "
                             "tokens. Resize the model's embeddings to the tokenizer (model.resize_token_embeddings("
                             "len(tokenizer)), then save_pretrained), or use the tokenizer the model was trained with")
        return RenderedSample(input_ids=input_ids, loss_mask=loss_mask, row=row, full_length=n)


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
