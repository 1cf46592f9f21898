"""W5 (docs/workloads.md): Llama-3.1-70B's shape on ONE GPU, LoRA (r64, alpha 32, every linear layer)
over a frozen base held in 4-bit NF4 (model.base_quant=nf4; one H100) or in float8 e4m3 with float8
GEMMs (--base_quant fp8; one H200, with --compile), gradient checkpointing, W1's data at max_length
4096, 128 sequences per optimizer step.

The base is drawn at start-up (model.random_init, trainer.seed=0) module by module on the GPU and each
linear weight quantized as it is drawn: a 70B model's 141 GB of bf16 weights exist one matrix at a
time, and its folder here holds its config and tokenizer only. sfttrain runs as a user would
(`python -m sfttrain.run` on the W1 recipe); the record has real tokens/s, MFU (the LoRA formula),
peak memory of the timed steps and the start-up time (launch to the first step, plus the exit).

    python3 -m bench.qlora_w5 --out results.jsonl [--data train.jsonl] [--steps 6 --warmup 2] \\
        [--base_quant nf4|fp8] [--compile] [--token_budget 8192] [--override key=value ...] [--device cpu --tiny]
"""

import argparse
import os
import shutil
import threading
import time
from types import SimpleNamespace

from bench.common import add_sfttrain_args, emit, model_folder, w2b_config
from bench.fp8_w2b import TINY, run
from bench.jobs import read_jsonl
from bench.sfttrain_w1 import require_one_epoch
from bench.w1_data import load_rows, load_tokenizer, write_parquet

# Llama-3.1-70B's shape; the vocabulary is the Qwen2.5 tokenizer's (as W2b's): sfttrain tokenizes W1's
# rows itself, and Qwen's special tokens lie above Llama's 128256 ids
W5_SHAPE = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, max_position_embeddings=131072)
W5 = ["model.random_init=true", "model.lora_rank=64", "model.lora_alpha=32", "model.target_modules=all-linear",
      "model.enable_gradient_checkpointing=true", "data.max_length=4096",
      "data.train_batch_size=128", "model.loss_chunk_tokens=1024"]


def save_config(work: str, tokenizer, tiny: bool) -> str:
    """A model folder of W5's config.json and the tokenizer, no weights (they are drawn at start-up)."""
    config = w2b_config(tokenizer, tiny=tiny, **({} if tiny else W5_SHAPE))
    folder = model_folder(work, config)
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def watch_start_up(metrics: str, started: float, out: dict) -> None:
    """out["startup_s"]: from the launch to the start of step 1 (its end, when it is logged, less its time)."""
    while not (first := [m for m in read_jsonl(metrics) if m.get("step") == 1 and "loss" in m]):
        time.sleep(0.25)
    out["startup_s"] = round(time.perf_counter() - started - first[0]["step_time_s"], 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sfttrain_args(p, work="/tmp/sfttrain_w5")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=6, help="optimizer steps in all")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps")
    p.add_argument("--token_budget", type=int, default=8192, help="data.max_token_len_per_gpu")
    p.add_argument("--base_quant", default="nf4", choices=["nf4", "fp8"], help="model.base_quant (the record's "
                   "name: qlora_w5 or qlora_w5_fp8)")
    p.add_argument("--compile", action="store_true", help="model.compile=true (off by default: NF4's dequantize "
                   "runs as torchao's eager code; fp8's per-row quantization fuses into the layers with it)")
    p.add_argument("--run_timeout", type=float, default=570, help="seconds the job may take, start-up included")
    p.add_argument("--tiny", action="store_true", help="smoke run: tiny model, 3 steps (with --device cpu)")
    args = p.parse_args()
    if args.tiny:
        args.steps, args.warmup, args.rows = 3, 1, args.rows or 64
        args.override = [*TINY, *args.override]
    os.makedirs(args.work, exist_ok=True)
    parquet = os.path.join(args.work, "train.parquet")
    write_parquet(load_rows(args.data, args.rows), parquet)
    overrides = [*W5, f"model.base_quant={args.base_quant}", f"data.max_token_len_per_gpu={args.token_budget}",
                 f"model.compile={str(args.compile).lower()}"]
    name = "qlora_w5" + ("_fp8" if args.base_quant == "fp8" else "")
    require_one_epoch(SimpleNamespace(steps=args.steps, data=args.data), parquet, [*overrides, *args.override])
    model_dir = save_config(args.work, load_tokenizer(args.tokenizer), args.tiny)
    start_up: dict = {}
    metrics = os.path.join(args.work, "runs", name, "metrics.jsonl")
    shutil.rmtree(os.path.dirname(metrics), ignore_errors=True)  # no metrics of an earlier call's run
    started = time.perf_counter()
    threading.Thread(target=watch_start_up, args=(metrics, started, start_up), daemon=True).start()
    record = run(args, name, model_dir, parquet, overrides, args.steps, args.warmup)
    emit({**record, "workload": "W5", **start_up}, args.out)


if __name__ == "__main__":
    main()
