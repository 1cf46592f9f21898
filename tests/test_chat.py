"""Multi-turn chat rendering (sfttrain/data/render.py) on the real Qwen2.5 and Qwen3 templates, the
messages reader, and a training run on conversations whose loss-token count is checked."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from sfttrain.config import ConfigError, load_config
from sfttrain.data.render import ChatRenderer, build_renderer
from sfttrain.data.files import open_source
from sfttrain.data.parquet import ChatMessages, ParquetSource, PromptResponse
from sfttrain.errors import DataError
from tests.conftest import REPO, read_metrics, run_sfttrain

TOKENIZERS = REPO / "assets" / "tokenizers"
EOT = "<|im_end|>"
EXPR = {"type": "object", "properties": {"expr": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluates arithmetic", "parameters": EXPR}}]
CALL = {"type": "function", "function": {"name": "calc", "arguments": {"expr": "17*3"}}}
CALL_TEXT = '<tool_call>\n{"name": "calc", "arguments": {"expr": "17*3"}}\n</tool_call>'
# system, a tool loop, a second question: every role, and contents that appear nowhere else
CONVERSATION = [
    {"role": "system", "content": "System says be brief."},
    {"role": "user", "content": "User asks seventeen times three."},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "Tool returns fifty-one."},
    {"role": "assistant", "content": "Assistant answers 51."},
    {"role": "user", "content": "User asks plus one."},
    {"role": "assistant", "content": "Assistant answers 52."},
]
NOT_TRAINED = ["System says be brief.", "User asks seventeen times three.", "Tool returns fifty-one.",
               "User asks plus one."]
# the non-prefix-stable template: every header counts the whole conversation's messages
COUNTING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ loop.index }}/{{ messages | length }}\n"
                     "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% endif %}")
PLAIN_TEMPLATE = COUNTING_TEMPLATE.replace(" {{ loop.index }}/{{ messages | length }}", "")
# a template that renders the last answer otherwise than the earlier ones: it ends it with another token
LAST_ENDS_OTHERWISE = PLAIN_TEMPLATE.replace("{{ m.content }}<|im_end|>", "{{ m.content }}{{ '<|endoftext|>' if "
                                             "loop.last and m.role == 'assistant' else '<|im_end|>' }}")


@pytest.fixture(scope="module", params=["qwen2.5-instruct", "qwen3"])
def tokenizer(request):
    return AutoTokenizer.from_pretrained(TOKENIZERS / request.param)


@pytest.fixture(scope="module")
def qwen3():
    return AutoTokenizer.from_pretrained(TOKENIZERS / "qwen3")


def renderer(tok, **kw):
    return ChatRenderer(tok, max_length=kw.pop("max_length", 4096), truncation=kw.pop("truncation", "error"), **kw)


def trained_runs(tok, sample) -> list[str]:
    """The decoded text of each run of consecutive trained tokens."""
    pairs = zip(sample.input_ids, sample.loss_mask)
    return [tok.decode([t for t, _ in run]) for trained, run in itertools.groupby(pairs, key=lambda p: p[1]) if trained]


def untrained_text(tok, sample) -> str:
    return tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if not m])


def test_assistant_turns_only_with_system_and_tools(tokenizer):
    sample = renderer(tokenizer).render(CONVERSATION, {"tools": TOOLS}, row=0)
    # the ids are the template's one rendering of the conversation, tokenized once
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert sample.input_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    last = "Assistant answers 52." + EOT
    if "qwen3" in tokenizer.name_or_path:  # the last turn opens with its (empty) think block; see chat.py
        last = "<think>\n\n</think>\n\n" + last
    assert trained_runs(tokenizer, sample) == [CALL_TEXT + EOT, "Assistant answers 51." + EOT, last]
    untrained = untrained_text(tokenizer, sample)
    assert all(content in untrained for content in NOT_TRAINED)
    assert sample.loss_mask[-1] == 0 and tokenizer.decode(sample.input_ids[-1]) == "\n"  # the newline after EOT


def test_qwen3_thinking(qwen3):
    """History turns: the template drops the reasoning, so it is neither seen nor trained; the last
    turn: its think block is trained, whether given as reasoning_content or inside content."""
    for last in ({"role": "assistant", "content": "Final answer.", "reasoning_content": "Last reasoning."},
                 {"role": "assistant", "content": "<think>\nLast reasoning.\n</think>\n\nFinal answer."}):
        conversation = [{"role": "user", "content": "First question."},
                        {"role": "assistant", "content": "<think>\nOld reasoning.\n</think>\n\nFirst answer."},
                        {"role": "user", "content": "Second question."}, last]
        sample = renderer(qwen3).render(conversation, {}, row=0)
        assert trained_runs(qwen3, sample) == ["First answer." + EOT,
                                               "<think>\nLast reasoning.\n</think>\n\nFinal answer." + EOT]
        assert "Old reasoning" not in qwen3.decode(sample.input_ids)


def test_qwen3_thinking_off_puts_the_empty_block_in_the_prompt(qwen3):
    conversation = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                    {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]
    on = renderer(qwen3).render(conversation, {}, row=0)
    off = renderer(qwen3).render(conversation, {"enable_thinking": False}, row=0)
    assert on.input_ids == off.input_ids  # enable_thinking only changes the generation prompt
    assert trained_runs(qwen3, on) == ["A1" + EOT, "<think>\n\n</think>\n\nA2" + EOT]
    assert trained_runs(qwen3, off) == ["A1" + EOT, "A2" + EOT]


def test_qwen3_thinking_off_with_reasoning_is_refused(qwen3):
    conversation = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "R"}]
    with pytest.raises(ValueError, match="row 4: enable_thinking is false, but assistant message 1 has reasoning"):
        renderer(qwen3).render(conversation, {"enable_thinking": False}, row=4)


def test_not_prefix_stable_template_is_named_with_the_row(tokenizer):
    conversation = CONVERSATION[:2] + [{"role": "assistant", "content": "A1"}]
    assert trained_runs(tokenizer, renderer(tokenizer, chat_template=PLAIN_TEMPLATE).render(conversation, {}, 3)) \
        == ["A1" + EOT]
    with pytest.raises(ValueError, match=r"row 41: the chat template is not prefix-stable at assistant message 2: it "
                                         r"renders the messages before it as '[^']*system 1/2[^']*' from character 1 "
                                         r"when the conversation ends there \(as for generation\), but as "
                                         r"'[^']*system 1/3[^']*' in the whole conversation"):
        renderer(tokenizer, chat_template=COUNTING_TEMPLATE).render(conversation, {}, row=41)


def test_a_generation_prompt_a_conversation_does_not_hold_is_refused_with_the_row(tokenizer):
    """A template whose conversations do not hold its generation prompt ('Answer: ' at generation,
    '<|im_start|>assistant' before a conversation's answers) would train every turn in a context the
    model is never given at inference: refused, naming the row, the turn and both texts."""
    apart = PLAIN_TEMPLATE.replace("{% if add_generation_prompt %}<|im_start|>assistant\n", "{% if "
                                   "add_generation_prompt %}Answer: ")
    with pytest.raises(ValueError, match=r"row 6: assistant message 2: the chat template's generation prompt "
                                         r"'Answer: ' is not how it starts the answer \('<\|im_start\|>assistant"):
        renderer(tokenizer, chat_template=apart).render(CONVERSATION[:2] + [{"role": "assistant", "content": "A1"}],
                                                        {}, 6)


def test_a_template_that_ends_earlier_answers_otherwise_is_refused_with_the_row(tokenizer):
    """The end-of-turn token is the one the template writes after a conversation's last answer (a
    probe's): an earlier answer that the template ends with another one would run on through the
    next user message to a later answer's end, training the user's text. The row is refused."""
    conversation = [CONVERSATION[1], {"role": "assistant", "content": "A1"}, CONVERSATION[5],
                    {"role": "assistant", "content": "A2"}]
    r = renderer(tokenizer, chat_template=LAST_ENDS_OTHERWISE)
    assert trained_runs(tokenizer, r.render(conversation[:2], {}, 0)) == ["A1<|endoftext|>"]
    with pytest.raises(ValueError, match=r"row 8: assistant message 1 does not end with '<\|endoftext\|>' \(the "
                                         r"end-of-turn token the chat template writes after a conversation's last "
                                         r"answer\) before the next assistant turn"):
        r.render(conversation, {}, 8)


def test_a_prompt_response_template_that_cannot_be_trained_is_refused_at_start_up(tokenizer):
    """build_renderer renders a probe row: a template whose rendering of the prompt changes once the
    answer follows stops the start naming the key and why."""
    d = load_config(None, ["data.train_files=x.parquet", "model.partial_pretrain=m",
                           f"data.chat_template={COUNTING_TEMPLATE}"]).data
    with pytest.raises(ConfigError, match=r"data.chat_template='.*' cannot be trained on: the chat template is not "
                                          r"prefix-stable at this row's answer: it renders the messages before it as "
                                          r"'<\|im_start\|>user 1/1\\nhi<\|im_end\|>.*' from character 0 when"):
        build_renderer(d, tokenizer, None)


def test_a_template_failing_on_one_conversation_is_named_with_the_row(tokenizer):
    """A template that raises (anything: here a ZeroDivisionError) in a branch only some rows take is
    that row's problem, said with the row, not the template's traceback."""
    failing = PLAIN_TEMPLATE.replace("{% for m in messages %}",
                                     "{% for m in messages %}{% if m.tool_calls %}{{ 1 / 0 }}{% endif %}")
    r = renderer(tokenizer, chat_template=failing)
    assert r.render(CONVERSATION[:2] + [{"role": "assistant", "content": "A1"}], {}, row=0)
    with pytest.raises(ValueError, match=r"row 7: the chat template failed on this conversation: ZeroDivisionError: "
                                         r"division by zero; fix the template"):
        r.render_many([(CONVERSATION, {}, 7)])


def test_qwen3_tool_loop_reasoning_then_a_new_question_is_refused(qwen3):
    """Qwen3 shows a tool loop's reasoning until the next user message, then drops it: the turn
    after the tool result was answered seeing reasoning that the one rendering no longer has."""
    conversation = [CONVERSATION[1], {**CONVERSATION[2], "reasoning_content": "Use the tool."}, *CONVERSATION[3:]]
    with pytest.raises(ValueError, match="row 5: the chat template is not prefix-stable at assistant message 3"):
        renderer(qwen3).render(conversation, {}, row=5)
    assert renderer(qwen3).render(conversation[:4], {}, row=5)  # the loop on its own renders


def test_an_answer_holding_the_end_of_turn_token_is_refused_with_the_row(tokenizer):
    """An earlier answer with '<|im_end|>' pasted into it would end there: the rest of it would be
    context, untrained, and the model would learn to stop mid-answer. Refused naming the row and turn."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": f"a {EOT} b"},
                {"role": "user", "content": "more"}, {"role": "assistant", "content": "c"}]
    with pytest.raises(ValueError, match=r"row 3: assistant message 1 holds the chat template's end-of-turn token "
                                         r"'<\|im_end\|>' as text"):
        renderer(tokenizer).render(messages, {}, 3)


def test_bad_conversations_are_named():
    tok = AutoTokenizer.from_pretrained(TOKENIZERS / "qwen2.5-instruct")
    r = renderer(tok)
    cases = [([{"role": "user", "content": "hi"}], "row 2: the conversation has no assistant message"),
             ([{"role": "bot", "content": "hi"}], "row 2: message 0 has role 'bot'"),
             ([{"role": "assistant", "content": "hi"}], "row 2: message 0 is an assistant turn"),
             ([{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}], "message 0 content is int"),
             ([{"role": "user", "content": "hi"}, {"role": "assistant"}],
              "row 2: assistant message 1 has no content"),
             ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": " \n"}],
              r"row 2: assistant message 1 has no content \(null, missing or empty\); it would train the model to "
              "answer nothing")]
    for messages, message in cases:
        with pytest.raises(ValueError, match=message):
            r.render(messages, {}, row=2)


def test_assistant_message_with_null_content_is_named(tmp_path):
    """A null content in a Parquet messages column (the reader drops null keys) is refused with
    the row; a tool-calling turn with a null content is not."""
    tok = AutoTokenizer.from_pretrained(TOKENIZERS / "qwen2.5-instruct")
    null = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    calls = [{**m, "content": None} if m.get("tool_calls") else m for m in CONVERSATION]
    write_chat_parquet(tmp_path / "chat.parquet", [calls, null])
    source = ParquetSource([str(tmp_path / "chat.parquet")], ChatMessages(["messages"], None, None))
    (messages, kwargs, row), (null_messages, _, null_row) = source.read(np.array([0, 1]))
    assert renderer(tok).render(messages, kwargs, row).loss_mask  # tool calls without content train
    with pytest.raises(ValueError, match="row 1: assistant message 1 has no content"):
        renderer(tok).render(null_messages, {}, null_row)


def test_truncation(tokenizer):
    full = renderer(tokenizer).render(CONVERSATION, {}, row=9)
    n = len(full.input_ids)
    with pytest.raises(ValueError, match=rf"row 9 has {n} tokens \(3 assistant turns of 7 messages"):
        renderer(tokenizer, max_length=n - 1).render(CONVERSATION, {}, row=9)
    left = renderer(tokenizer, max_length=n - 10, truncation="left").render(CONVERSATION, {}, row=9)
    assert left.input_ids == full.input_ids[10:] and left.loss_mask == full.loss_mask[10:]


def write_chat_parquet(path: Path, conversations: list[list[dict]], **columns) -> None:
    """Messages as Parquet structs: every message gets the union of all keys, absent ones null."""
    pq.write_table(pa.table({"messages": conversations, **columns}), path, row_group_size=2)


def test_reader_yields_the_messages_and_template_arguments(tokenizer, tmp_path):
    plain = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    conversations = [CONVERSATION, plain, plain]
    write_chat_parquet(tmp_path / "chat.parquet", conversations,
                       tools=[json.dumps(TOOLS), None, None], enable_thinking=[None, False, True])
    source = ParquetSource([str(tmp_path / "chat.parquet")], ChatMessages(["messages"], "tools", "enable_thinking"))
    rows = source.read(source.epoch_order(seed=0, epoch=0, shuffle=False))
    assert [r[0] for r in rows] == conversations  # null-filled struct keys dropped again
    assert [r[1] for r in rows] == [{"tools": TOOLS}, {"enable_thinking": False}, {"enable_thinking": True}]
    r = renderer(tokenizer)
    assert r.render(*rows[0]) == r.render(CONVERSATION, {"tools": TOOLS}, 0)


def test_trls_prompt_completion_lists_are_one_conversation(tokenizer, tmp_path):
    """TRL's conversational prompt-completion rows (a prompt's messages, then the completion's) read
    with data.multiturn.messages_key=[prompt,completion] as the conversation they join into, written
    as one messages column: the same messages, the same tokens and loss masks. A file of that form
    read with the default key says which key to set."""
    split = [(CONVERSATION[:2], CONVERSATION[2:]), ([{"role": "user", "content": "Q"}], [{"role": "assistant",
                                                                                         "content": "A"}])]
    pq.write_table(pa.table({"prompt": [p for p, _ in split], "completion": [c for _, c in split]}),
                   tmp_path / "trl.parquet")
    write_chat_parquet(tmp_path / "joined.parquet", [p + c for p, c in split])
    trl = ParquetSource([str(tmp_path / "trl.parquet")], ChatMessages(["prompt", "completion"], None, None))
    joined = ParquetSource([str(tmp_path / "joined.parquet")], ChatMessages(["messages"], None, None))
    order = np.arange(len(split))
    assert [m for m, *_ in trl.read(order)] == [m for m, *_ in joined.read(order)] == [p + c for p, c in split]
    r = renderer(tokenizer)
    assert [r.render(*row) for row in trl.read(order)] == [r.render(*row) for row in joined.read(order)]
    with pytest.raises(ConfigError, match=r"no column 'messages' .*data.multiturn.messages_key=\[prompt,completion\]"):
        ParquetSource([str(tmp_path / "trl.parquet")], ChatMessages(["messages"], None, None))
    with pytest.raises(ConfigError,
                       match=r"no column 'question' .*data.prompt_key=prompt data.response_key=completion"):
        ParquetSource([str(tmp_path / "trl.parquet")], PromptResponse(["question"], ["answer"]))


def test_sharegpt_turns_are_the_messages_they_name(tokenizer, tmp_path):
    """ShareGPT's rows ({"conversations": [{"from": "human", "value": ...}, ...]}) read as the
    role/content messages they name (system, human -> user, gpt -> assistant): the same messages,
    tokens and loss masks as those messages written as such; so do other formats' role names
    (OpenAI's developer, Gemini's model). The default keys on a file of that form name the key to set."""
    role_of = {"system": "system", "user": "human", "assistant": "gpt"}
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"},
             {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"},
             {"role": "assistant", "content": "A2"}]
    sharegpt = [{"from": role_of[m["role"]], "value": m["content"]} for m in plain]
    (tmp_path / "sharegpt.jsonl").write_text(json.dumps({"conversations": sharegpt}) + "\n")
    source = open_source([str(tmp_path / "sharegpt.jsonl")], ChatMessages(["conversations"], None, None),
                         str(tmp_path / "run"))
    (messages, kwargs, row), = source.read(np.arange(1))
    assert messages == plain
    r = renderer(tokenizer)
    assert r.render(messages, kwargs, row) == r.render(plain, {}, 0)
    other = [{**m, "role": {"system": "developer", "assistant": "model"}.get(m["role"], m["role"])} for m in plain]
    (tmp_path / "other.jsonl").write_text(json.dumps({"messages": other}) + "\n")
    assert open_source([str(tmp_path / "other.jsonl")], ChatMessages(["messages"], None, None),
                       str(tmp_path / "run")).read(np.arange(1))[0][0] == plain
    for fields in (ChatMessages(["messages"], None, None), PromptResponse(["question"], ["answer"])):
        with pytest.raises(ConfigError, match="data.multiturn.messages_key=conversations"):
            open_source([str(tmp_path / "sharegpt.jsonl")], fields, str(tmp_path / "run"))


def test_function_calls_tools_and_content_parts_read_as_openai_messages(tokenizer, tmp_path):
    """LLaMA-Factory's (and glaive's) ShareGPT tool rows: a function_call turn (its value the call as
    JSON) is the assistant turn making that call, an observation the tool's result, and the tools
    column a JSON string, or "" where a row has none (the template's default then, as for null).
    OpenAI's content parts read as their texts joined by newlines. Each renders as the same
    conversation written in OpenAI's form; an image part is refused with its line."""
    role_of = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}
    sharegpt = [{"from": "function_call", "value": json.dumps(m["tool_calls"][0]["function"])} if m.get("tool_calls")
                else {"from": role_of[m["role"]], "value": m["content"]} for m in CONVERSATION]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "text", "text": "2+2?"}]},
             {"role": "assistant", "content": "4"}]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}, parts[1]]
    rows = [{"conversations": sharegpt, "tools": json.dumps(TOOLS)}, {"conversations": sharegpt, "tools": ""},
            {"conversations": parts, "tools": ""}, {"conversations": image, "tools": ""}]
    (tmp_path / "tools.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = open_source([str(tmp_path / "tools.jsonl")], ChatMessages(["conversations"], "tools", None),
                         str(tmp_path / "run"))
    r = renderer(tokenizer)
    openai = [{k: v for k, v in m.items() if not (k == "content" and m.get("tool_calls"))} for m in CONVERSATION]
    joined = [{"role": "user", "content": "Look:\n2+2?"}, parts[1]]
    assert [r.render(*row) for row in source.read(np.arange(3))] == [
        r.render(openai, {"tools": TOOLS}, 0), r.render(openai, {}, 1), r.render(joined, {}, 2)]
    assert CALL_TEXT in tokenizer.decode(r.render(*source.read(np.arange(1))[0]).input_ids)
    with pytest.raises(DataError, match=r"tools.jsonl line 4: conversations\[0\]: content parts of types "
                                        r"\['image_url'\]: sfttrain trains on text alone"):
        source.read(np.array([3]))


def test_a_system_column_is_the_conversations_system_message(tokenizer, tmp_path):
    """LLaMA-Factory's ShareGPT rows keep the system prompt in a column beside the conversation: it
    renders as the conversation's first message would (not the template's default system prompt); a
    null or empty cell leaves the template's default; a system message in both places is refused."""
    turns = [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]
    rows = [{"conversations": turns, "system": "You are a math tutor."}, {"conversations": turns, "system": None},
            {"conversations": turns, "system": ""},
            {"conversations": [{"from": "system", "value": "Be brief."}, *turns], "system": "Twice."}]
    (tmp_path / "sharegpt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fields = ChatMessages(["conversations"], None, None, "system")
    source = open_source([str(tmp_path / "sharegpt.jsonl")], fields, str(tmp_path / "run"))
    plain = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    r = renderer(tokenizer)
    tutor = r.render([{"role": "system", "content": "You are a math tutor."}, *plain], {}, 0)
    assert "You are a math tutor." in tokenizer.decode(tutor.input_ids)
    assert [r.render(*row) for row in source.read(np.arange(3))] == [tutor, r.render(plain, {}, 1),
                                                                      r.render(plain, {}, 2)]
    with pytest.raises(DataError, match=r"sharegpt.jsonl line 4: a system prompt both in the system column and as the "
                                        r"conversation's first message; keep one \(data.multiturn.system_key=null"):
        source.read(np.array([3]))
    unread = open_source([str(tmp_path / "sharegpt.jsonl")], ChatMessages(["conversations"], None, None),
                         str(tmp_path / "run"))
    assert [m for m, *_ in unread.read(np.arange(1))] == [plain]


def test_messages_without_multiturn_get_a_hint(tmp_path):
    write_chat_parquet(tmp_path / "chat.parquet", [CONVERSATION])
    source = ParquetSource([str(tmp_path / "chat.parquet")], PromptResponse(["messages"], ["messages"]))
    with pytest.raises(ConfigError, match="chat.parquet row 0: messages is list, expected a string; for "
                                          "conversations set data.multiturn.enable=true"):
        source.read(np.array([0]))


def test_config_keys():
    base = ["data.train_files=x.parquet", "model.partial_pretrain=m"]
    cfg = load_config(None, base + ["data.multiturn.enable=true", "data.multiturn.messages_key=conv",
                                    "data.multiturn.tools_key=null"])
    m = cfg.data.multiturn
    assert m.enable and m.messages_key == "conv" and m.tools_key is None
    with pytest.raises(ConfigError, match="data.multiturn.messages_key"):
        load_config(None, base + ["data.multiturn.message_key=conv"])
    with pytest.raises(ConfigError, match="data.multiturn.enable=true renders conversations with a chat template"):
        load_config(None, base + ["data.multiturn.enable=true", "data.apply_chat_template=false"])
    assert list(load_config(None, base + ["data.multiturn.messages_key=[prompt,completion]"]).data.multiturn
                .messages_key) == ["prompt", "completion"]
    with pytest.raises(ConfigError, match="data.multiturn.messages_key=\\[\\]: give a column name"):
        load_config(None, base + ["data.multiturn.messages_key=[]"])


def test_gsm8k_messages_data_prep(tmp_path):
    subprocess.run([sys.executable, str(REPO / "data_prep/gsm8k.py"), "--messages", "--input_dir",
                    str(REPO / "assets/data/gsm8k"), "--local_dir", str(tmp_path)], check=True, capture_output=True)
    first = json.loads((REPO / "assets/data/gsm8k/test.jsonl").read_text().splitlines()[0])
    messages = pq.read_table(tmp_path / "test.parquet").column("messages").to_pylist()
    assert len(messages) == 200
    assert messages[0] == [{"role": "user", "content": first["question"]},
                           {"role": "assistant", "content": first["answer"]}]


def _assistant_labels(tok, conversation: list[dict]) -> tuple[list[int], list[int]]:
    """The template's rendering of a conversation tokenized, and its labels located here in the ids: each
    '<|im_start|>assistant\n' header's following tokens through its '<|im_end|>' (IGNORE elsewhere)."""
    ids = tok(tok.apply_chat_template(conversation, tokenize=False), add_special_tokens=False)["input_ids"]
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids(EOT)
    labels, i = [-100] * len(ids), 0
    while i < len(ids):
        if ids[i:i + len(header)] == header:
            i += len(header)
            while ids[i] != end:
                labels[i] = ids[i]
                i += 1
            labels[i] = end
        i += 1
    return ids, labels


def test_training_on_conversations_counts_assistant_tokens(tiny_qwen_dir, tmp_path):
    """Two ranks, the chat recipe, 8 multi-turn rows: every row's loss tokens counted another way,
    by tokenizing each assistant content alone (+1 for <|im_end|>), must add up in metrics.jsonl.
    Validation on 7 three-turn conversations with a system prompt (token-budget micro-batches, 3 and 4
    a rank): val/loss against a plain loop on the final weights, the supervised tokens located in the
    template's rendering here (`_assistant_labels`: each assistant turn's content and <|im_end|>, nothing
    of the system and user turns), sum of token losses / sum of tokens. fp32, packed rows on two ranks
    against one row at a time: another summation order, 1e-5 relative. optim.lr=0.1: two steps take the
    random model's token losses apart (at the recipe's 1e-5 all sit near ln(vocab), and no mask mistake
    would show); the mask shifted by one token (each '\n' of a header trained in place of the turn's
    <|im_end|>, the same count) moves val/loss by 1e-3 relative."""
    import torch
    from transformers import Qwen2ForCausalLM

    from tests.conftest import load_checkpoint_model

    tok = AutoTokenizer.from_pretrained(tiny_qwen_dir)
    questions = [json.loads(line) for line in (REPO / "assets/data/gsm8k/train.jsonl").read_text().splitlines()[:16]]
    conversations = [[{"role": "system", "content": "Solve the problem."},
                      {"role": "user", "content": a["question"]}, {"role": "assistant", "content": a["answer"]},
                      {"role": "user", "content": b["question"]}, {"role": "assistant", "content": b["answer"]}]
                     for a, b in zip(questions[::2], questions[1::2])]
    write_chat_parquet(tmp_path / "train.parquet", conversations)
    tests = [json.loads(line) for line in (REPO / "assets/data/gsm8k/test.jsonl").read_text().splitlines()[:21]]
    val = []
    for i in range(7):  # every other conversation answers with the final number alone: rows of unequal weight
        turns = [(q["question"], q["answer"].split("####")[-1].strip() if i % 2 else q["answer"])
                 for q in tests[3 * i:3 * i + 3]]
        val.append([{"role": "system", "content": "Answer briefly."},
                    *(m for q, a in turns
                      for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a}))])
    write_chat_parquet(tmp_path / "val.parquet", val)
    expected = sum(len(tok(m["content"], add_special_tokens=False)["input_ids"]) + 1
                   for c in conversations for m in c if m["role"] == "assistant")
    run_dir = tmp_path / "run"
    run_sfttrain(2, [str(REPO / "recipes/qwen2.5-0.5b_multiturn_chat.yaml"), f"model.partial_pretrain={tiny_qwen_dir}",
                     f"data.train_files={tmp_path / 'train.parquet'}", f"data.val_files={tmp_path / 'val.parquet'}",
                     "data.train_batch_size=4", "data.max_token_len_per_gpu=2048", "data.max_length=2048",
                     "data.num_workers=0", "optim.lr=1e-1", "optim.lr_warmup_steps_ratio=0",
                     "model.enable_gradient_checkpointing=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
                     "model.fsdp_config.mixed_precision=false", "trainer.device=cpu", "trainer.total_epochs=1",
                     f"trainer.default_local_dir={run_dir}"], timeout=600)
    steps = [m for m in read_metrics(run_dir) if "loss" in m]
    assert len(steps) == 2 and sum(m["loss_tokens"] for m in steps) == expected
    model = Qwen2ForCausalLM.from_pretrained(tiny_qwen_dir, attn_implementation="eager").eval()
    missing, unexpected = model.load_state_dict(load_checkpoint_model(run_dir / "global_step_2"), strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied to the embedding
    total, count = 0.0, 0
    with torch.no_grad():
        for conversation in val:
            ids, labels = _assistant_labels(tok, conversation)
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            targets = torch.tensor(labels[1:])
            total += torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").item()
            count += int((targets != -100).sum())
    assert count == sum(len(tok(m["content"], add_special_tokens=False)["input_ids"]) + 1
                        for c in val for m in c if m["role"] == "assistant")
    assert [m["val/loss"] for m in read_metrics(run_dir) if "val/loss" in m] == [pytest.approx(total / count, rel=1e-5)]


def test_the_offline_chat_recipe_trains_through_eos_and_its_export_applies_the_template(gsm8k_dir, tmp_path):
    """recipes/chat_demo_cpu.yaml: the demo's model, which has no chat template, with the shipped tiny template:
    each answer is supervised through the tokenizer's own EOS (the run's `answers end with` line), and the
    exported tokenizer renders a conversation with that template (trainer.save_hf writes the export)."""
    run = tmp_path / "run"
    proc = run_sfttrain(2, [str(REPO / "recipes" / "chat_demo_cpu.yaml"), f"data.train_files={gsm8k_dir}/train.parquet",
                            f"data.val_files={gsm8k_dir}/test.parquet", f"trainer.default_local_dir={run}",
                            "trainer.total_training_steps=2", "trainer.save_hf=true"])
    assert "answers end with    : </s> (the tokenizer's EOS)" in proc.stdout, proc.stdout[-3000:]
    exported = AutoTokenizer.from_pretrained(next(run.glob("global_step_2/huggingface")))
    conversation = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert exported.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True) == "Q: 2+2?\nA: "
    assert exported.apply_chat_template(conversation, tokenize=False) == "Q: 2+2?\nA: 4</s>\n"
