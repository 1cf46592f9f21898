"""(prompt, response) pairs as token ids and a loss mask. With a chat template the trained answer
ends with the template's end-of-turn token, not the tokenizer's EOS where they differ: the served
model stops where its template ends a turn. Otherwise the response is followed by EOS."""

from __future__ import annotations

from dataclasses import dataclass

from sfttrain.config import ConfigError, rendering_problems
from sfttrain.data.template import (DROPPED_FIX, TEMPLATE_FIX, AnswerNotLocated, TemplateFailed, TurnEnd, answer_span,
                                    apply_template, check_no_end_token, dropped, turn_end)

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


def check_answer(response: str, answer: str, apart_prompt: str | None) -> None:
    """The trained answer is all of the response, and nothing the template writes before it."""
    if apart_prompt is not None and not answer.lstrip().startswith(response.lstrip()[:1]):
        raise AnswerNotLocated(f"the chat template's generation prompt {apart_prompt!r} is not in its rendering of "
                               f"the row, which has {answer[:40]!r} where the answer goes: the answer cannot be told "
                               f"from what the template writes before it; {TEMPLATE_FIX}")
    if lost := dropped([response], answer):
        raise AnswerNotLocated(f"the chat template renders this row's response as {answer[:80]!r}, without part of "
                               f"it ({lost[:80]!r}): what would be trained is not the response. {DROPPED_FIX}")


class RowError(ValueError):
    def __init__(self, row: int, message: str):
        super().__init__(message)
        self.row = row


def each_row(rows: list[tuple], render_one) -> list:
    """render_one of each row tuple (its last item the row id); a failure is a RowError naming it."""
    out = []
    for r in rows:
        try:
            out.append(render_one(r))
        except RowError:
            raise
        except ValueError as e:
            raise RowError(r[-1], str(e)) from e
    return out


class Renderer:
    def __init__(self, tokenizer, *, max_length: int, truncation: str, apply_chat_template: bool = True,
                 chat_template: str | None = None):
        for problem in rendering_problems(max_length, truncation):
            raise ConfigError(problem)
        if apply_chat_template and chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat template; set data.apply_chat_template=false to use the "
                              "raw prompt text, or pass a Jinja template with data.chat_template=...")
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

    def render_many(self, rows: list[tuple[str, str, int]]) -> list[RenderedSample]:
        """One tokenizer call for the contexts and one for the answers: a fast tokenizer uses every core."""
        if not rows:
            return []
        texts = each_row(rows, lambda r: self._texts(r[0], r[1]))
        # special tokens (e.g. BOS) for a plain prompt; a chat template writes its own
        contexts = self.tokenizer([c for c, _ in texts], add_special_tokens=not self.apply_chat_template)["input_ids"]
        answers = self.tokenizer([a for _, a in texts], add_special_tokens=False)["input_ids"]
        return each_row(list(zip(contexts, answers, (r[2] for r in rows))), lambda t: self._pair(*t))

    def _texts(self, prompt: str, response: str) -> tuple[str, str]:
        """(context, answer) as text: the template's rendering of one user turn and its answer, split."""
        if not self.apply_chat_template:
            return prompt, response
        check_no_end_token([response], self.turn_end, "this row's response")
        user = [{"role": "user", "content": prompt}]
        generation = self._template(user, True, "prompt (as one user turn)")
        text = self._template(user + [{"role": "assistant", "content": response}], False,
                              "response (as the answer to its prompt)")
        span = answer_span(self.tokenizer, text, generation, self.turn_end,
                           lambda: self._template(user, False, "prompt"), "this row's answer", prompt_apart_ok=True)
        answer = text[span.start:span.stop]
        check_answer(response, answer, generation[span.start:] if span.prompt_apart else None)
        return (generation if span.prompt_apart else text[:span.start]), answer

    def _template(self, messages: list[dict], generation_prompt: bool, part: str) -> str:
        try:
            return apply_template(self.tokenizer, messages, add_generation_prompt=generation_prompt,
                                  chat_template=self.chat_template)  # None: the tokenizer's own
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
