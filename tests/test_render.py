"""Renderer tests on real tokenizers (Qwen2.5-Instruct, Qwen3, stories260K) and real GSM8K rows."""

import dataclasses
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sfttrain.config import ConfigError
from sfttrain.data.render import RenderedSample, Renderer, RowError
from tests.conftest import STORIES

ASSETS = Path(__file__).parents[1] / "assets"
QWEN_TOKENIZERS = ["qwen2.5-instruct", "qwen3"]
N_ROWS = 100  # rows checked per tokenizer; the whole sample passes too, this keeps the file fast


def _rows(split="train", n=N_ROWS):
    with open(ASSETS / "data/gsm8k" / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


ROWS = _rows()


@pytest.fixture(scope="module", params=QWEN_TOKENIZERS)
def qwen(request):
    return AutoTokenizer.from_pretrained(ASSETS / "tokenizers" / request.param)


@pytest.fixture(scope="module")
def qwen25():
    return AutoTokenizer.from_pretrained(ASSETS / "tokenizers/qwen2.5-instruct")


@pytest.fixture(scope="module")
def stories():
    return AutoTokenizer.from_pretrained(ASSETS / "models/stories260K")


def supervised(tok, s):
    return tok.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m])


def reference_prompt_ids(tok, question):
    """Independent path: transformers' own tokenizing chat template (the renderer renders the
    template's text and tokenizes a block of such texts at once)."""
    turn = [{"role": "user", "content": question}]
    ids = tok.apply_chat_template(turn, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 returns a BatchEncoding
    return tok.apply_chat_template(turn, add_generation_prompt=True, tokenize=False), list(ids)


def test_qwen_mask_covers_exactly_the_response_and_eos(qwen):
    r = Renderer(qwen, max_length=4096, truncation="error")
    im_end = qwen.convert_tokens_to_ids("<|im_end|>")
    # Qwen3's template opens the answer with an empty think block (test_qwen3_trains_its_empty_think_block)
    think = "<think>\n\n</think>\n\n" if "qwen3" in qwen.name_or_path else ""
    for i, row in enumerate(ROWS):
        q, a = row["question"], row["answer"]
        s = r.render(q, a, row=i)
        assert isinstance(s.input_ids, list) and all(type(t) is int for t in s.input_ids)
        assert len(s.input_ids) == len(s.loss_mask) and s.row == i

        # the prompt part is the chat template's generation prompt for one user turn
        prompt_text, prompt_ids = reference_prompt_ids(qwen, q)
        assert prompt_text.endswith(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
        n_prompt = len(prompt_ids)
        assert s.input_ids[:n_prompt] == prompt_ids
        assert qwen.decode(s.input_ids[:n_prompt]) == prompt_text

        # the response ids sit at the end of the sequence, found by searching for them
        resp_ids = qwen.encode(think + a, add_special_tokens=False) + [im_end]
        assert s.input_ids[-len(resp_ids):] == resp_ids
        assert len(s.input_ids) == n_prompt + len(resp_ids)

        # no prompt token is trained; every response token is, the first one and the EOS included
        assert s.loss_mask == [0] * n_prompt + [1] * len(resp_ids)
        assert s.loss_mask[n_prompt] == 1 and (think + a).startswith(qwen.decode(s.input_ids[n_prompt]))
        assert s.input_ids[-1] == im_end and s.loss_mask[-1] == 1
        assert qwen.convert_ids_to_tokens(s.input_ids[-1]) == "<|im_end|>" == qwen.eos_token
        assert supervised(qwen, s) == think + a + "<|im_end|>"


@pytest.mark.parametrize("eos", ["<|im_end|>", "<|endoftext|>"], ids=["instruct", "base"])
def test_qwen25_matches_the_templates_own_training_rendering(eos):
    """Qwen2.5's template renders [user, assistant] as our prompt + answer + "<|im_end|>\n", whatever
    the tokenizer's EOS: the instruct tokenizer's is <|im_end|>, the base model's (Qwen2.5-0.5B) is
    <|endoftext|>, and a base model fine-tuned on the template must still end its answers as every
    conversation it is served in does."""
    tok = AutoTokenizer.from_pretrained(ASSETS / "tokenizers/qwen2.5-instruct", eos_token=eos)
    r = Renderer(tok, max_length=4096, truncation="error")
    assert (r.end_token, tok.eos_token) == ("<|im_end|>", eos)
    for i, row in enumerate(ROWS[:20]):
        conv = [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]
        full = tok.apply_chat_template(conv, tokenize=False)
        s = r.render(row["question"], row["answer"], i)
        assert tok.decode(s.input_ids) + "\n" == full
        assert supervised(tok, s) == row["answer"] + "<|im_end|>"


def test_qwen3_trains_its_empty_think_block():
    """Qwen3's template writes an empty think block before the last answer, after its generation
    prompt ("assistant\n"): the block is part of the answer as the template renders it, so it is
    trained, as in a conversation's last turn (tests/test_chat.py), and the ids are the template's
    own rendering of the row up to the newline after <|im_end|>."""
    tok = AutoTokenizer.from_pretrained(ASSETS / "tokenizers/qwen3")
    row = ROWS[0]
    conv = [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]
    full = tok.apply_chat_template(conv, tokenize=False)
    s = Renderer(tok, max_length=4096, truncation="error").render(row["question"], row["answer"], 0)
    prompt_text, _ = reference_prompt_ids(tok, row["question"])
    assert full == prompt_text + "<think>\n\n</think>\n\n" + row["answer"] + "<|im_end|>\n"
    assert s.input_ids == tok(full[:-1], add_special_tokens=False)["input_ids"]
    assert supervised(tok, s) == "<think>\n\n</think>\n\n" + row["answer"] + "<|im_end|>"


def test_no_template_path_stories260k(stories):
    r = Renderer(stories, max_length=4096, truncation="error", apply_chat_template=False)
    for i, row in enumerate(ROWS):
        q, a = row["question"], row["answer"]
        s = r.render(q, a, row=i)
        prompt_ids = stories(q)["input_ids"]
        assert s.input_ids[0] == stories.bos_token_id == 1  # BOS first, from the normal special tokens
        assert s.input_ids[: len(prompt_ids)] == prompt_ids
        assert s.loss_mask == [0] * len(prompt_ids) + [1] * (len(s.input_ids) - len(prompt_ids))
        assert s.input_ids[-1] == stories.eos_token_id == 2 and s.loss_mask[-1] == 1
        assert s.input_ids.count(stories.bos_token_id) == 1  # no BOS in front of the response
        assert supervised(stories, s) == a + "</s>"


def test_token_ids_past_the_models_embedding_are_refused_with_the_row():
    """stories260K embeds 512 ids; its tokenizer with one token added ("Natalia", id 512) makes 513.
    Exactly the rows whose text holds the word are refused, naming the id and the token; the same
    tokenizer with an embedding resized to 513 rows, or the model's own tokenizer, refuses none."""
    tok = AutoTokenizer.from_pretrained(STORIES)
    tok.add_tokens(["Natalia"])
    r = Renderer(tok, max_length=4096, truncation="error", apply_chat_template=False)
    r.limit_ids(512)
    refused = []
    for i, row in enumerate(ROWS):
        try:
            r.render(row["question"], row["answer"], row=i)
        except ValueError as e:
            refused.append(i)
            assert f"row {i} has token ids [512] (['Natalia']) at or past the model's 512 embedding rows" in str(e)
            assert "the tokenizer has 513 tokens" in str(e) and "resize_token_embeddings" in str(e)
    assert refused == [i for i, row in enumerate(ROWS) if "Natalia" in row["question"] + row["answer"]] != []
    r.limit_ids(513)
    assert r.id_limit is None  # no id the tokenizer makes reaches past a resized embedding
    own = Renderer(AutoTokenizer.from_pretrained(STORIES), max_length=4096, truncation="error",
                   apply_chat_template=False)
    own.limit_ids(512)
    assert own.id_limit is None


def test_missing_chat_template_is_an_error(stories):
    with pytest.raises(ValueError, match="no chat template") as e:
        Renderer(stories, max_length=512, truncation="error")
    assert "data.apply_chat_template=false" in str(e.value) and "data.chat_template" in str(e.value)


CUSTOM_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_chat_template_override(stories, qwen25):
    # a tokenizer without a template works once one is given
    s = Renderer(stories, max_length=4096, truncation="error",
                 chat_template=CUSTOM_TEMPLATE).render("Hi there", "Hello", 7)
    n_prompt = s.loss_mask.index(1)
    assert stories.decode(s.input_ids[:n_prompt]) == "user: Hi there\nassistant: "
    assert supervised(stories, s) == "Hello</s>"
    # and it replaces a tokenizer's own template (no Qwen system prompt, no <|im_start|>)
    r = Renderer(qwen25, max_length=4096, truncation="error", chat_template=CUSTOM_TEMPLATE)
    s = r.render("Hi there", "Hello", 7)
    n_prompt = s.loss_mask.index(1)
    assert qwen25.decode(s.input_ids[:n_prompt]) == "user: Hi there\nassistant: "
    assert supervised(qwen25, s) == "Hello<|im_end|>"
    # the template writes a newline after an answer, no special token: the answer ends with EOS, as the line says
    assert r.describe_end([r.end_token_id]) == ("  answers end with    : <|im_end|> (the tokenizer's EOS: the chat "
                                                "template writes no end-of-turn token after an answer); "
                                                "generation_config.json stops at ids [151645] (<|im_end|>)")


# a template that writes its generation prompt for generation only: in a conversation the answer follows directly
PROMPT_APART = ("{% for m in messages %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}Answer: {% endif %}")


def test_a_generation_prompt_written_for_generation_only_is_the_rows_context(qwen25):
    """A prompt/response row trains what the model does at inference: the generation prompt, then
    the answer as the template writes it, whole ('Alright' shares an 'A' with 'Answer: ', which is
    no part of the prompt). A template that writes something else where the answer goes (a header
    other than its generation prompt) cannot be told apart from the answer: refused."""
    s = Renderer(qwen25, max_length=4096, truncation="error", chat_template=PROMPT_APART).render("Q?", "Alright, 4.", 0)
    n = s.loss_mask.index(1)
    assert qwen25.decode(s.input_ids[:n]) == "Q?<|im_end|>\nAnswer: "
    assert supervised(qwen25, s) == "Alright, 4.<|im_end|>"
    header = PROMPT_APART.replace("{{ m['content'] }}", "{{ m['role'] + ': ' if m['role'] == 'assistant' }}"
                                                        "{{ m['content'] }}")
    with pytest.raises(RowError, match=r"the chat template's generation prompt 'Answer: ' is not in its rendering of "
                                       r"the row, which has 'assistant: Alright, 4.<\|im_end\|>' where the answer "
                                       r"goes"):
        Renderer(qwen25, max_length=4096, truncation="error", chat_template=header).render("Q?", "Alright, 4.", 0)


def test_a_response_holding_the_end_of_turn_token_is_refused_with_the_row(qwen25):
    """A response with '<|im_end|>' pasted into it would end there in the template's text: the rest
    could not be trained, and the model would learn to stop mid-answer. Refused naming the row and
    where the token is, not trained around nor taken for a template that drops text."""
    renderer = Renderer(qwen25, max_length=512, truncation="error")
    with pytest.raises(RowError, match=r"this row's response holds the chat template's end-of-turn token "
                                       r"'<\|im_end\|>' as text \(at character 2: 'a <\|im_end\|> b'\)"):
        renderer.render_many([("q", "a <|im_end|> b", 7)])


def test_a_template_ending_answers_with_text_and_no_special_token_is_refused(qwen25):
    """Qwen's tokenizer has no '</s>' of its own (it reads the text as pieces): a template that ends
    every answer with that text ends it where generation cannot stop. It is refused at start-up,
    naming the text and the ways out, rather than training each answer to end with EOS, which the
    template never writes."""
    template = CUSTOM_TEMPLATE.replace("{{ m['content'] }}\n", "{{ m['content'] }}</s>\n")
    with pytest.raises(ConfigError, match=r"the chat template writes '</s>\\n' after an answer, which the tokenizer "
                                          r"reads as \['</', 's', '>Ċ'\], no token of its own \(an added "
                                          r"token\) that generation can stop at: add it to the tokenizer as a "
                                          r"special token .* or set data.chat_template=\.\.\. to a template that "
                                          r"ends an answer with one"):
        Renderer(qwen25, max_length=512, truncation="error", chat_template=template)


@pytest.fixture(scope="module")
def long_row(qwen25):
    row = ROWS[3]
    full = Renderer(qwen25, max_length=4096, truncation="error").render(row["question"], row["answer"], 3)
    return row, full


def test_truncation_error_names_the_row(qwen25, long_row):
    row, full = long_row
    n = len(full.input_ids)
    r = Renderer(qwen25, max_length=n - 5, truncation="error")
    with pytest.raises(ValueError) as e:
        r.render(row["question"], row["answer"], row=1234)
    msg = str(e.value)
    assert "row 1234" in msg and str(n) in msg and f"data.max_length={n - 5}" in msg
    assert "data.truncation=left|right" in msg
    # exactly at the limit is fine
    assert Renderer(qwen25, max_length=n, truncation="error").render(row["question"], row["answer"], 3) == full


def test_truncation_left_keeps_the_end(qwen25, long_row):
    row, full = long_row
    n, n_resp = len(full.input_ids), sum(full.loss_mask)
    # cut inside the prompt: the whole response and its EOS survive
    m = n - 5
    s = Renderer(qwen25, max_length=m, truncation="left").render(row["question"], row["answer"], 3)
    assert len(s.input_ids) == len(s.loss_mask) == m
    assert s.input_ids == full.input_ids[-m:] and s.loss_mask == full.loss_mask[-m:]
    assert s.input_ids[-1] == qwen25.eos_token_id and s.loss_mask[-1] == 1
    assert supervised(qwen25, s) == row["answer"] + "<|im_end|>"
    # cut inside the response: token 0 has no predecessor, so it is not a target
    m = n_resp - 10
    s = Renderer(qwen25, max_length=m, truncation="left").render(row["question"], row["answer"], 3)
    assert s.input_ids == full.input_ids[-m:]
    assert s.loss_mask == [0] + [1] * (m - 1)
    assert s.input_ids[-1] == qwen25.eos_token_id


def test_truncation_right_keeps_the_start(qwen25, long_row):
    row, full = long_row
    n = len(full.input_ids)
    m = n - 5
    s = Renderer(qwen25, max_length=m, truncation="right").render(row["question"], row["answer"], 3)
    assert len(s.input_ids) == len(s.loss_mask) == m
    assert s.input_ids == full.input_ids[:m] and s.loss_mask == full.loss_mask[:m]
    assert qwen25.eos_token_id not in s.input_ids[-5:]  # the EOS was dropped with the end
    assert row["answer"].startswith(supervised(qwen25, s))


def test_missing_eos_is_an_error():
    tok = AutoTokenizer.from_pretrained(ASSETS / "models/stories260K", eos_token=None)
    assert tok.eos_token_id is None
    with pytest.raises(ValueError, match="no eos_token_id"):
        Renderer(tok, max_length=512, truncation="error", apply_chat_template=False)


def test_rendered_sample_is_frozen():
    s = RenderedSample(input_ids=[1, 2], loss_mask=[0, 1], row=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.row = 1


def test_max_length_beyond_the_models_positions_is_refused():
    """stories260K was trained on 512 positions: max_length=513 is refused naming both, unless allowed."""
    from sfttrain.config import ConfigError, load_config
    from sfttrain.model import check_max_length

    def cfg(*extra):
        return load_config(None, ["data.train_files=x.parquet", f"model.partial_pretrain={STORIES}", *extra])

    check_max_length(cfg("data.max_length=512"), str(STORIES))
    with pytest.raises(ConfigError, match="data.max_length=513 is above the model's max_position_embeddings=512 "
                                          r"\(.*stories260K\).*data.allow_beyond_max_position=true"):
        check_max_length(cfg("data.max_length=513"), str(STORIES))
    check_max_length(cfg("data.max_length=513", "data.allow_beyond_max_position=true"), str(STORIES))


def test_the_saved_tokenizer_carries_the_template_trained_with(stories, tmp_path):
    """stories260K has no template; trained with data.chat_template, the checkpoint's hf/ tokenizer
    and the export's render a prompt to the ids the training rendered it to."""
    import yaml

    from tests.conftest import BASE_OVERRIDES, run_sfttrain

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"chat_template": CUSTOM_TEMPLATE, "apply_chat_template": True}}))
    run_dir = tmp_path / "run"
    run_sfttrain(1, [str(recipe), *[o for o in BASE_OVERRIDES if not o.startswith("data.apply_chat_template")],
                     f"data.train_files={ASSETS / 'data/gsm8k/test.jsonl'}", f"trainer.default_local_dir={run_dir}",
                     "data.train_batch_size=4", "data.micro_batch_size_per_gpu=4", "trainer.total_training_steps=1"])
    run_sfttrain(1, [str(run_dir / "global_step_1"), str(tmp_path / "out")], module="sfttrain.export")
    trained = Renderer(stories, max_length=4096, truncation="error",
                       chat_template=CUSTOM_TEMPLATE).render("Hi", "Yo", 0)
    prompt = trained.input_ids[:trained.loss_mask.index(1)]
    for folder in (run_dir / "global_step_1" / "hf", tmp_path / "out"):
        saved = AutoTokenizer.from_pretrained(folder)
        assert saved.chat_template == CUSTOM_TEMPLATE
        ids = saved.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True)
        assert list(ids["input_ids"] if hasattr(ids, "keys") else ids) == prompt, folder


@pytest.mark.parametrize("tokenizer, chat", [("tokenizers/qwen2.5-instruct", True), ("tokenizers/qwen3", True),
                                             ("models/stories260K", False)])
def test_a_block_renders_as_its_rows_one_at_a_time(tokenizer, chat):
    """render_many tokenizes a block's texts in one call each: every sample equals the row's own
    render; with data.truncation=error the first row over max_length stops the block, named."""
    tok = AutoTokenizer.from_pretrained(ASSETS / tokenizer)
    rows = [(r["question"], r["answer"], i) for i, r in enumerate(ROWS)]
    r = Renderer(tok, max_length=4096, truncation="error", apply_chat_template=chat)
    assert r.render_many(rows) == [r.render(*row) for row in rows]
    lengths = [len(s.input_ids) for s in r.render_many(rows)]
    limit = sorted(lengths)[-3]  # the two longest rows do not fit
    first = next(i for i, n in enumerate(lengths) if n > limit)
    with pytest.raises(RowError, match=f"^row {first} has {lengths[first]} tokens") as e:
        Renderer(tok, max_length=limit, truncation="error", apply_chat_template=chat).render_many(rows)
    assert e.value.row == first
