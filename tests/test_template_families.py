"""The chat templates of every major model family (tests/chat_families.py) train exactly the
assistant's tokens: each answer as the template renders it, through the end-of-turn marker the
template writes after it, and nothing of the prompt, the role headers or the generation prompt;
the ids are those of the template's own rendering of the conversation, tokenized.

The reference is computed without the renderers: the template renders the whole conversation and,
for each assistant turn, the messages before it with the generation prompt; the answer starts where
that generation prompt ends in the whole text (string positions) and is `Family.turn(content) +
Family.end`, what each family is known to write, checked against the template's own text."""

import itertools

import pytest

from sfttrain.data.render import ChatRenderer
from sfttrain.data.render import Renderer
from tests.chat_families import FAMILIES, Family, family_tokenizer

PAIRS = [("What is 2+2?", "2+2 is 4."),
         ("  Name a colour.\n", "  Blue, said with spaces around it.\n\n"),
         ("Two lines?", "First line.\n\nSecond line."),
         ("Markup?", "<b>Bold</b> starts like DeepSeek-R1's <think>.")]
TURNS = [{"role": "user", "content": "First question?"},
         {"role": "assistant", "content": " First answer, spaced.\n"},
         {"role": "user", "content": "Second question?"},
         {"role": "assistant", "content": "Second answer."}]
SYSTEM = {"role": "system", "content": "Answer briefly."}
REASONING = {"role": "assistant", "content": "<think>\nOld reasoning.\n</think>\n\nFirst answer."}


@pytest.fixture(params=FAMILIES, ids=lambda f: f.name)
def family(request) -> Family:
    return request.param


def render(tok, messages, generation_prompt=False) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def reference_answers(family: Family, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The template's text of the conversation and each assistant answer's span in it, from the
    template's renderings of the conversation's prefixes."""
    tok = family_tokenizer(family)
    text, spans = render(tok, messages), []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(tok, messages[:i], generation_prompt=True)
        assert prompt.endswith(family.unrendered)
        prompt = prompt[:len(prompt) - len(family.unrendered)]
        answer = family.turn(m["content"]) + family.end
        assert text.startswith(prompt) and text[len(prompt):].startswith(answer), (family.name, i)
        spans.append((len(prompt), len(prompt) + len(answer)))
    return text, spans


def trained_runs(tok, sample) -> list[str]:
    """The text of each run of consecutive trained tokens."""
    pairs = zip(sample.input_ids, sample.loss_mask)
    return [tok.decode([t for t, _ in run]) for trained, run in itertools.groupby(pairs, key=lambda p: p[1]) if trained]


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def spans_boundary(tok, text: str, k: int) -> bool:
    """Whether a token of `text` tokenized whole holds characters on both sides of position k."""
    return any(a < k < b for a, b in tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"])


def test_prompt_response_rows_train_the_answer_as_the_template_renders_it(family):
    tok = family_tokenizer(family)
    renderer = Renderer(tok, max_length=4096, truncation="error")
    for row, (prompt, response) in enumerate(PAIRS):
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        text, [(start, end)] = reference_answers(family, messages)
        assert text[end:] == family.tail
        sample = renderer.render(prompt, response, row)
        assert trained_runs(tok, sample) == [text[start:end]]
        # the template's text through the answer's end, the generation prompt tokenized apart: the model continues
        # from its tokens. That is the text tokenized whole where no token of it spans the two (Mistral v1's
        # '[/INST]', plain text, and '<b>' make ']<' in Qwen's vocabulary)
        assert sample.input_ids == ids(tok, text[:start]) + ids(tok, text[start:end])
        assert (sample.input_ids == ids(tok, text[:end])) != spans_boundary(tok, text[:end], start)


def conversations(family: Family) -> list[list[dict]]:
    with_system = [[SYSTEM, *TURNS]] if family.system else []
    history = [[TURNS[0], REASONING, *TURNS[2:]]] if family.unrendered else []
    return [TURNS, TURNS + [{"role": "user", "content": "Third question?"},
                            {"role": "assistant", "content": "<b>Third</b> answer.  "}], *with_system, *history]


def test_conversations_train_every_answer_as_the_template_renders_it(family):
    tok = family_tokenizer(family)
    renderer = ChatRenderer(tok, max_length=4096, truncation="error")
    for row, messages in enumerate(conversations(family)):
        text, spans = reference_answers(family, messages)
        sample = renderer.render(messages, {}, row)
        assert trained_runs(tok, sample) == [text[a:b] for a, b in spans], row
        # the text tokenized in pieces cut at the answers' edges, as a prompt/response row's; whole, where no token
        # spans an edge
        edges = [0, *(k for span in spans for k in span), len(text)]
        assert sample.input_ids == [t for a, b in zip(edges, edges[1:]) for t in ids(tok, text[a:b])]
        assert (sample.input_ids == ids(tok, text)) != any(spans_boundary(tok, text, k) for k in edges)


def test_the_start_up_line_names_the_families_end_of_turn(family):
    tok = family_tokenizer(family)
    renderer = Renderer(tok, max_length=4096, truncation="error")
    end_token = family.end.strip()
    assert renderer.end_token == end_token
    line = renderer.describe_end([renderer.end_token_id])
    source = "the tokenizer's EOS" if end_token == family.eos else f"the tokenizer's EOS is {family.eos}"
    assert line.startswith(f"  answers end with    : {end_token if end_token == family.end else repr(family.end)} (")
    assert source in line and line.endswith(f"stops at ids [{tok.convert_tokens_to_ids(end_token)}] ({end_token})")


REFUSED = [  # conversations a family's template cannot render as trained, and what the row's refusal says
    ("gemma2", [SYSTEM, *TURNS], r"row 7: the chat template failed on this conversation: TemplateError: System role "
                                 r"not supported; fix the template \(data.chat_template=\.\.\. replaces the "
                                 r"tokenizer's\) or the row"),
    ("mistral-v1", [SYSTEM, *TURNS], r"row 7: the chat template failed on this conversation: TemplateError: "
                                     r"Conversation roles must alternate user/assistant/user/assistant/\.\.\.;"),
    ("llama2", [TURNS[0], *TURNS[2:]], r"row 7: the chat template failed on this conversation: TemplateError: "
                                       r"Conversation roles must alternate user/assistant/user/assistant/\.\.\.;"),
    # the system message goes into the last user turn only, where generation starts: a trained conversation drops it
    ("mistral-v3", [SYSTEM, *TURNS], r"row 7: the chat template is not prefix-stable at assistant message 2: it "
                                     r"renders the messages before it as '<s>\[INST\] Answer briefly.\\n\\nFirst "
                                     r"question\?\[/INST\]' from character 0 .* but as '<s>\[INST\] First "
                                     r"question\?\[/INST\] First answer, spaced.</s>\[I' in the whole conversation"),
    ("mistral-tekken", [SYSTEM, *TURNS], r"row 7: the chat template is not prefix-stable at assistant message 2: .*"
                                         r"Mistral's v3 and Tekken templates write the system message into the last "
                                         r"user turn only\)\. Split the conversation into rows that end at this "
                                         r"answer, drop the message the template moves, or replace the template "
                                         r"\(data.chat_template=\.\.\.\)"),
]


@pytest.mark.parametrize("name, messages, refusal", REFUSED, ids=[name for name, *_ in REFUSED])
def test_a_conversation_the_template_cannot_render_as_trained_is_refused_with_the_row(name, messages, refusal):
    family = next(f for f in FAMILIES if f.name == name)
    renderer = ChatRenderer(family_tokenizer(family), max_length=4096, truncation="error")
    assert renderer.render(TURNS, {}, 6)
    with pytest.raises(ValueError, match=refusal):
        renderer.render(messages, {}, 7)


def test_an_answers_reasoning_that_the_template_drops_is_refused():
    """DeepSeek-R1's template keeps what follows </think> in every answer: an earlier turn trains
    without its reasoning (as later turns see it), but a row whose trained answer, a prompt/response
    row's or a conversation's last, carries reasoning is refused rather than trained without it."""
    family = next(f for f in FAMILIES if f.name == "deepseek-r1")
    tok = family_tokenizer(family)
    with pytest.raises(ValueError, match=r"the chat template renders this row's response as '\\n\\nFinal answer.<｜end"
                                         r"▁of▁sentence｜>', without part of it \('<think>\\nLast reasoning.*"
                                         r"DeepSeek-R1's keeps what follows </think> only"):
        Renderer(tok, max_length=4096, truncation="error").render(
            "Q?", "<think>\nLast reasoning.\n</think>\n\nFinal answer.", 0)
    chat = ChatRenderer(tok, max_length=4096, truncation="error")
    for last in ({"role": "assistant", "content": "<think>\nLast reasoning.\n</think>\n\nFinal answer."},
                 {"role": "assistant", "content": "Final answer.", "reasoning_content": "Last reasoning."}):
        with pytest.raises(ValueError, match=r"row 4: the chat template renders assistant message 3, the last "
                                             r"answer, as '(\\n)*Final answer.<｜end▁of▁sentence｜>', without part "
                                             r"of it"):
            chat.render([*TURNS[:3], last], {}, 4)
