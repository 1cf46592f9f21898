"""W2b (../shared/bench/WORKLOADS.md, 8.2B parameters) with the seed article's LoRA settings on ONE
GPU: sfttrain, then TRL's SFTTrainer with peft on the same model and data, in one call.

The seed article claims LoRA + FSDP2 trains a 7B model in under 25 GB; this measures peak memory
and tokens/s for W2b's 8.2B model. The model is drawn once (torch.manual_seed(0)) directly on the
GPU in bf16 and saved as a model folder (16.4 GB; no fp32 copy anywhere): LoRA adapts saved
weights, and both systems load the folder as a user would (sfttrain: frozen base straight in bf16,
fp32 adapters; TRL: `from_pretrained(dtype=bfloat16)` with `peft_config`). Data: W1's rows,
max_length 4096, 128 sequences per optimizer step; gradient checkpointing on (the article's).
Fewer steps than W2's 11-30 so that one call fits in 8 minutes; say so beside the numbers.

    python3 -m bench.lora_w2b --data ../shared/data/gsm8k/train.jsonl --out results.jsonl \\
        [--systems sfttrain trl] [--steps 16 --warmup 5] [--trl_steps 8 --trl_warmup 3] [--device cpu --tiny]
"""

import argparse
import os
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bench.common import add_sfttrain_args, emit
from bench.sfttrain_w1 import run_variant
from bench.w1_data import load_rows, load_tokenizer, write_parquet

W2B_SHAPE = dict(vocab_size=151936, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY_SHAPE = dict(W2B_SHAPE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
LORA = ["model.lora_rank=64", "model.lora_alpha=32", "model.target_modules=all-linear"]
SFTTRAIN = ["model.random_init=false", "model.enable_gradient_checkpointing=true", "data.max_length=4096",
            "data.train_batch_size=128", "data.max_token_len_per_gpu=8192", *LORA]


def save_model(args, tokenizer) -> str:
    """The W2b model folder, drawn on the device in bf16 (skipped if already there)."""
    model_dir = os.path.join(args.work, "model")
    if os.path.isfile(os.path.join(model_dir, "config.json")):
        return model_dir
    config = LlamaConfig(**(TINY_SHAPE if args.tiny else W2B_SHAPE), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    del model
    return model_dir


def run_sfttrain(args, model_dir: str, parquet: str) -> dict:
    return run_variant("lora_w2b", args, model_dir, parquet, SFTTRAIN)


def run_trl(args, model_dir: str) -> None:
    """bench.trl_w1 on the saved model with --peft: 16 x 8 sequences per step, max_length 4096."""
    cmd = [sys.executable, "-m", "bench.trl_w1", "--data", args.data, "--tokenizer", args.tokenizer, "--out", args.out,
           "--device", args.device, "--model_dir", model_dir, "--peft", "--gradient_checkpointing", "on",
           "--max_length", "4096", "--steps", str(args.trl_steps), "--warmup", str(args.trl_warmup),
           *(["--tiny"] if args.tiny else ["--micro_batch", "16", "--grad_accum", "8"])]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sfttrain_args(p, work="/tmp/sfttrain_w2b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--systems", nargs="*", default=["sfttrain", "trl"], choices=["sfttrain", "trl"])
    p.add_argument("--steps", type=int, default=16, help="sfttrain's optimizer steps in all")
    p.add_argument("--warmup", type=int, default=5, help="sfttrain's untimed steps")
    p.add_argument("--trl_steps", type=int, default=8)
    p.add_argument("--trl_warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, batch of 8")
    args = p.parse_args()
    if args.tiny:
        args.override = ["data.train_batch_size=8", "data.max_token_len_per_gpu=4096", "model.compile=false",
                         *args.override]
    tokenizer = load_tokenizer(args.tokenizer)
    model_dir = save_model(args, tokenizer)
    parquet = os.path.join(args.work, "train.parquet")
    write_parquet(load_rows(args.data, args.rows), parquet)
    if "sfttrain" in args.systems:
        emit(run_sfttrain(args, model_dir, parquet), args.out)
    if "trl" in args.systems:
        run_trl(args, model_dir)


if __name__ == "__main__":
    main()
