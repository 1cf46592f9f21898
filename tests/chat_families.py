"""Chat templates of the major model families, each applied to a copy of the Qwen2.5 tokenizer.

Each `chat_templates/<name>.jinja` is the family's template reproduced (written out again, not
copied from the hub, which the tests cannot reach) from the `chat_template` of the named model's
tokenizer_config.json. The tokenizer copy gets the family's BOS/EOS and control tokens as special
tokens, so that the template's markers are single tokens as in the family's own vocabulary.

`Family` also states, from knowledge of each template, what the model must write for an answer:
`turn(content)` (the content as the template renders it), then `end` (what it writes after it,
through its end-of-turn token) and, after the conversation's last answer, `tail` (text generation
never writes: glue before the next turn's header, or an end-of-conversation token).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

QWEN25 = Path(__file__).parents[1] / "assets/tokenizers/qwen2.5-instruct"
TEMPLATES = Path(__file__).parent / "chat_templates"


@dataclass(frozen=True)
class Family:
    name: str  # the template file's name
    model: str  # whose tokenizer_config.json the template reproduces
    bos: str | None
    eos: str
    special: tuple[str, ...]  # control tokens, special in the family's tokenizer
    turn: Callable[[str], str]  # an answer's content as the template renders it
    end: str  # what the template writes after an answer, through its end-of-turn token
    tail: str = ""  # what follows the conversation's last answer
    plain: tuple[str, ...] = field(default=())  # tokens the family's tokenizer holds as non-special tokens
    system: bool = True  # renders a system message where the trained conversations have one
    unrendered: str = ""  # the end of the generation prompt that a rendered answer does not start with

    @property
    def template(self) -> str:
        return (TEMPLATES / f"{self.name}.jinja").read_text(encoding="utf-8")


def _strip(c: str) -> str:
    return c.strip()


def _as_is(c: str) -> str:
    return c


LLAMA3_CONTROL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>")
MISTRAL_CONTROL = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                   "[/TOOL_RESULTS]")
GEMMA_CONTROL = ("<start_of_turn>", "<end_of_turn>")
DEEPSEEK_PLAIN = ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")

FAMILIES = [
    Family("llama3.1", "meta-llama/Llama-3.1-8B-Instruct", "<|begin_of_text|>", "<|eot_id|>", LLAMA3_CONTROL,
           _strip, "<|eot_id|>"),
    Family("llama2", "meta-llama/Llama-2-7b-chat-hf", "<s>", "</s>", (), lambda c: " " + c.strip(), " </s>"),
    Family("mistral-v1", "mistralai/Mistral-7B-Instruct-v0.1", "<s>", "</s>", (), _as_is, "</s>", system=False),
    Family("mistral-v3", "mistralai/Mistral-7B-Instruct-v0.3", "<s>", "</s>", MISTRAL_CONTROL,
           lambda c: " " + c.strip(), "</s>", system=False),
    Family("mistral-tekken", "mistralai/Mistral-Nemo-Instruct-2407", "<s>", "</s>", MISTRAL_CONTROL, _as_is, "</s>",
           system=False),
    Family("gemma2", "google/gemma-2-9b-it", "<bos>", "<eos>", GEMMA_CONTROL, _strip, "<end_of_turn>", "\n",
           system=False),
    Family("gemma3", "google/gemma-3-4b-it", "<bos>", "<eos>", GEMMA_CONTROL, _strip, "<end_of_turn>", "\n"),
    Family("phi3", "microsoft/Phi-3-mini-4k-instruct", "<s>", "<|endoftext|>",
           ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), _as_is, "<|end|>", "\n<|endoftext|>"),
    Family("phi4", "microsoft/phi-4", "<|endoftext|>", "<|endoftext|>", ("<|im_start|>", "<|im_sep|>", "<|im_end|>"),
           _as_is, "<|im_end|>"),
    Family("deepseek-r1", "deepseek-ai/DeepSeek-R1", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", (),
           lambda c: c.split("</think>")[-1], "<｜end▁of▁sentence｜>", plain=DEEPSEEK_PLAIN,
           unrendered="<think>\n"),
    Family("zephyr", "HuggingFaceH4/zephyr-7b-beta", "<s>", "</s>", (), _as_is, "</s>", "\n"),
]


@functools.cache
def _qwen25_bpe() -> tuple[dict, list]:
    """Qwen2.5's byte-level BPE: its vocabulary and merges, read once."""
    vocab = json.loads((QWEN25 / "vocab.json").read_text(encoding="utf-8"))
    merges = [tuple(line.split()) for line in (QWEN25 / "merges.txt").read_text(encoding="utf-8").splitlines()[1:]]
    return vocab, merges


@functools.cache
def family_tokenizer(family: Family) -> Qwen2Tokenizer:
    """Qwen2.5's tokenizer (its BPE, pre-tokenizer and normaliser) with the family's chat template,
    BOS, EOS and control tokens instead of Qwen's: built from the vocabulary files, a fraction of
    the time a copy of a loaded tokenizer takes."""
    vocab, merges = _qwen25_bpe()
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, bos_token=family.bos, eos_token=family.eos,
                         additional_special_tokens=list(family.special), chat_template=family.template,
                         clean_up_tokenization_spaces=False)
    tok.add_tokens(list(family.plain))
    return tok
