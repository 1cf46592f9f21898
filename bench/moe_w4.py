"""W4 (docs/workloads.md): a mixture-of-experts model on one GPU, sfttrain as a user would run it.

Qwen3-30B-A3B's shape cut to 10 of its 48 layers (128 experts, 8 active per token; 6.85B parameters,
~1.19B active per token), random init from trainer.seed (model.random_init: only config.json and
the tokenizer are written). W1's data and template, max_length 4096, 128 sequences per optimizer
step, full fine-tuning with W1's recipe, 16384-token micro-batches and activation checkpointing.
Timed over optimizer steps 6 to 20 (bench.sfttrain_w1's summary of metrics.jsonl; sfttrain's MFU
counts the active parameters: the non-expert ones and top_k / num_experts of the experts').

    python3 -m bench.moe_w4 --data train.jsonl --out results.jsonl [--override key=value ...]
    python3 -m bench.moe_w4 --out results.jsonl --device cpu --tiny   # CPU smoke run: 2 layers of 8 experts
"""

import argparse
import os
import subprocess
import sys

from transformers import Qwen3MoeConfig

from bench.common import TINY_SIZES, add_sfttrain_args, emit
from bench.long_context import stop, wait_for_steps
from bench.sfttrain_w1 import RECIPE, require_one_epoch, summarise
from bench.w1_data import load_rows, load_tokenizer, write_parquet

W4_SHAPE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                num_hidden_layers=10, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                num_experts_per_tok=8, norm_topk_prob=True, output_router_logits=False, tie_word_embeddings=False,
                max_position_embeddings=8192, rope_theta=1e6)
TINY_SHAPE = dict(W4_SHAPE, **TINY_SIZES, moe_intermediate_size=32, head_dim=16, num_experts=8, num_experts_per_tok=2)
W4 = ["model.random_init=true", "model.enable_gradient_checkpointing=true", "data.max_length=4096",
      "data.train_batch_size=128", "data.max_token_len_per_gpu=16384"]


def save_model(args, tokenizer) -> str:
    """config.json and the tokenizer, in a folder named by the shape (a --tiny run never reuses W4's)."""
    model_dir = os.path.join(args.work, "tiny" if args.tiny else "w4")
    specials = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                    pad_token_id=tokenizer.pad_token_id)
    Qwen3MoeConfig(**(TINY_SHAPE if args.tiny else W4_SHAPE), **specials).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir


def run(args, model_dir: str, parquet: str) -> dict:
    """One sfttrain job, stopped once the timed steps are logged: a final checkpoint of W4 (fp32
    weights and AdamW state, ~110 GB) is not part of the workload and fills the GPU machine's disk."""
    run_dir = os.path.join(args.work, "runs", "w4")
    overrides = [f"model.partial_pretrain={model_dir}", f"data.train_files={parquet}", f"trainer.default_local_dir={run_dir}",
                 "trainer.resume_mode=disable", f"trainer.total_training_steps={args.steps + 1000}",
                 f"trainer.device={args.device}", *W4, *args.override]
    require_one_epoch(args, parquet, overrides)  # the timed steps; the job is stopped after them
    cmd = [sys.executable, "-m", "sfttrain.run", RECIPE, *overrides]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        status = wait_for_steps(proc, os.path.join(run_dir, "metrics.jsonl"), args.steps, args.run_timeout)
    finally:
        stop(proc)
    if status != "trained":
        return {"system": "sfttrain", "variant": "w4", "overrides": W4 + args.override, "status": status}
    return summarise("w4", args, run_dir, W4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sfttrain_args(p, work="/tmp/sfttrain_w4")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--run_timeout", type=float, default=400, help="seconds the job may take, start-up included")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny MoE, batch of 4, 3 steps")
    args = p.parse_args()
    if args.tiny:
        args.steps, args.warmup, args.rows = 3, 1, args.rows or 64
        args.override = ["data.train_batch_size=4", "data.max_length=256", "data.max_token_len_per_gpu=1024",
                         "model.compile=false", "model.fsdp_config.mixed_precision=false", *args.override]
    model_dir = save_model(args, load_tokenizer(args.tokenizer))
    parquet = os.path.join(args.work, "train.parquet")
    write_parquet(load_rows(args.data, args.rows), parquet)
    emit(run(args, model_dir, parquet), args.out)


if __name__ == "__main__":
    main()
