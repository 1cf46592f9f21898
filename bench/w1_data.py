"""Workload W1 of docs/workloads.md: GSM8K on a Qwen2.5-0.5B-shaped model.

Prompt: the question as one user message, rendered with the tokenizer's chat template with the
generation prompt. Response: the answer, then ``<|im_end|>``. Loss on response tokens only;
max_length 1024 (no GSM8K sample comes near it). The model is the Qwen2.5-0.5B architecture,
randomly initialised after ``torch.manual_seed(0)``.

Paths are arguments because they differ between this machine and the GPU machine.

    python3 -m bench.w1_data --data DATA.jsonl --tokenizer DIR [--parquet OUT.parquet]

prints the workload's token statistics and, with ``--parquet``, writes the rows (columns
``question``, ``answer``) for sfttrain to render itself.
"""

import argparse
import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from bench.common import TINY_SIZES

MAX_LENGTH = 1024
EOS = "<|im_end|>"

W1_SHAPE = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
TINY_SHAPE = dict(W1_SHAPE, **TINY_SIZES)


@dataclass(frozen=True)
class Sample:
    input_ids: list[int]
    labels: list[int]  # -100 on prompt tokens

    @property
    def supervised(self) -> int:
        return sum(label != -100 for label in self.labels)


def load_rows(path: str, limit: int | None = None) -> list[dict]:
    """The GSM8K rows, in file order, as dicts with ``question`` and ``answer``."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:limit]


def load_tokenizer(path: str):
    return AutoTokenizer.from_pretrained(path)


def render(tokenizer, question: str, answer: str, max_length: int = MAX_LENGTH) -> Sample:
    """One W1 sample: chat-templated prompt (labels -100), then answer + EOS, truncated at the end."""
    # render to text then encode: apply_chat_template(tokenize=True) returns a list or a dict
    # depending on the transformers version
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    response = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids(EOS)]
    input_ids = (prompt + response)[:max_length]
    labels = ([-100] * len(prompt) + response)[:max_length]
    return Sample(input_ids, labels)


def load_w1(data: str, tokenizer_dir: str, max_length: int = MAX_LENGTH, limit: int | None = None):
    """(tokenizer, rows, samples) of W1; samples[i] renders rows[i]."""
    tokenizer = load_tokenizer(tokenizer_dir)
    rows = load_rows(data, limit)
    samples = [render(tokenizer, r["question"], r["answer"], max_length) for r in rows]
    return tokenizer, rows, samples


def model_config(tiny: bool = False) -> Qwen2Config:
    return Qwen2Config(**(TINY_SHAPE if tiny else W1_SHAPE))


def build_model(config: Qwen2Config, device: str):
    """Random init after torch.manual_seed(0), fp32 weights, SDPA attention, no KV cache."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.config.use_cache = False
    return model.to(device)


def write_parquet(rows: list[dict], path: str) -> None:
    table = pa.table({"question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows]})
    pq.write_table(table, path)


def stats(samples: list[Sample], max_length: int) -> dict:
    lengths = [len(s.input_ids) for s in samples]
    return {
        "samples": len(samples),
        "real_tokens": sum(lengths),
        "supervised_tokens": sum(s.supervised for s in samples),
        "mean_length": sum(lengths) / len(lengths),
        "min_length": min(lengths),
        "max_length": max(lengths),
        "truncated": sum(n == max_length for n in lengths),  # at the cap: possibly cut
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="GSM8K train.jsonl")
    parser.add_argument("--tokenizer", required=True, help="Qwen2.5-Instruct tokenizer directory")
    parser.add_argument("--max_length", type=int, default=MAX_LENGTH)
    parser.add_argument("--parquet", help="also write the rows here (columns question, answer)")
    args = parser.parse_args()
    _, rows, samples = load_w1(args.data, args.tokenizer, args.max_length)
    print(json.dumps(stats(samples, args.max_length)))
    if args.parquet:
        write_parquet(rows, args.parquet)


if __name__ == "__main__":
    main()
