"""W4 (docs/workloads.md): a mixture-of-experts model on one GPU, sfttrain and TRL's SFTTrainer on
the same saved model folder, in one call.

Qwen3-30B-A3B's shape cut to 10 of its 48 layers (128 experts, 8 active per token; 6.85B parameters,
~1.19B active per token), drawn once after torch.manual_seed(0) on the device in bf16 and saved with
the tokenizer (13.7 GB; reused by a later call with the same --work); both systems load it as a user
would, into fp32 weights trained under bf16 autocast. W1's data and template, max_length 4096, 128
sequences per optimizer step, full fine-tuning, activation checkpointing:

- sfttrain: W1's recipe with a 16384-token micro-batch budget (about two micro-batches a step), timed over
  optimizer steps 6 to 20 (bench.sfttrain_w1's summary of metrics.jsonl). The job is stopped once
  the timed steps are logged: its final checkpoint (fp32 weights and AdamW state, ~110 GB) is not
  part of the workload and would fill the GPU machine's 64 GB disk.
- TRL (bench.trl_w1 --model_dir --padding_free): 64 sequences per micro-batch, 2 per step (the same
  128 sequences a step, ~13.6k tokens a micro-batch), transformers' own MoE code path, SDPA with
  the packed-sequence mask transformers builds (the GPU image has no flash-attn: attention runs over
  the whole micro-batch, masked; MFU counts only each sample's own), no checkpoint saved; timed over
  steps 4 to 10, fewer than sfttrain's to fit the call (say so beside the numbers). Its run is bounded
  twice: past --trl_timeout minus a minute it stops at the next step end with the steps timed so far,
  and at --trl_timeout it is killed; a model that does not fit in the GPU's memory is recorded as such
  (bench.trl_w1's "oom" record).

MFU of both counts the active parameters (sfttrain.flops: the non-expert ones and top_k /
num_experts of the experts'). The records, one JSON line each in --out: sfttrain's, TRL's, then
both side by side with the ratio of real tokens/s.

    python3 -m bench.moe_w4 --data train.jsonl --out results.jsonl [--systems sfttrain trl] [--override key=value ...]
    python3 -m bench.moe_w4 --out results.jsonl --device cpu --tiny   # CPU smoke run: 2 layers of 8 experts
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

from transformers import Qwen3MoeConfig

from bench.common import TINY_SIZES, add_sfttrain_args, emit, save_model
from bench.jobs import NO_SAVE_ON_STOP, stop, wait_for_steps
from bench.sfttrain_w1 import RECIPE, require_one_epoch, summarise
from bench.w1_data import load_rows, load_tokenizer, write_parquet

W4_SHAPE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                num_hidden_layers=10, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                num_experts_per_tok=8, norm_topk_prob=True, output_router_logits=False, tie_word_embeddings=False,
                max_position_embeddings=8192, rope_theta=1e6)
TINY_SHAPE = dict(W4_SHAPE, **TINY_SIZES, moe_intermediate_size=32, head_dim=16, num_experts=8, num_experts_per_tok=2)
W4 = ["model.random_init=false", "model.enable_gradient_checkpointing=true", "data.max_length=4096",
      "data.train_batch_size=128", "data.max_token_len_per_gpu=16384"]
# TRL's 128 sequences a step: 2 micro-batches of 64, as sfttrain's 16384-token budget splits them
TRL = ["--padding_free", "--gradient_checkpointing", "on", "--max_length", "4096", "--micro_batch", "64",
       "--grad_accum", "2"]
TRL_STOP_MARGIN_S = 60  # before its timeout, TRL stops at a step end: time for the step in flight and the record


def w4_config(tokenizer, tiny: bool) -> Qwen3MoeConfig:
    """W4's config (or its --tiny sibling) with the tokenizer's special-token ids."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return Qwen3MoeConfig(**(TINY_SHAPE if tiny else W4_SHAPE), bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                          pad_token_id=tokenizer.pad_token_id)


def run_sfttrain(args, model_dir: str, parquet: str) -> dict:
    """One sfttrain job, stopped once the timed steps are logged."""
    run_dir = os.path.join(args.work, "runs", "w4")
    overrides = [f"model.partial_pretrain={model_dir}", f"data.train_files={parquet}",
                 f"trainer.default_local_dir={run_dir}",
                 "trainer.resume_mode=disable", f"trainer.total_training_steps={args.steps + 1000}",
                 f"trainer.device={args.device}", NO_SAVE_ON_STOP, *W4, *args.override]
    cmd = [sys.executable, "-m", "sfttrain.run", RECIPE, *overrides]
    print("+", " ".join(cmd), flush=True)
    shutil.rmtree(run_dir, ignore_errors=True)  # an earlier job's metrics.jsonl would read as this one's steps
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        status = wait_for_steps(proc, os.path.join(run_dir, "metrics.jsonl"), args.steps, args.run_timeout)
    finally:
        stop(proc)
    if status != "trained":
        record = {"system": "sfttrain", "variant": "w4", "overrides": W4 + args.override, "status": status}
    else:
        record = summarise("w4", args, run_dir, W4)
    return {**record, "model_dir": model_dir}


def run_trl(args, model_dir: str) -> dict:
    """bench.trl_w1 on the saved model in a process of its own, bounded by --trl_timeout."""
    out = os.path.join(args.work, "trl.jsonl")
    if os.path.exists(out):
        os.remove(out)
    cmd = [sys.executable, "-m", "bench.trl_w1", "--data", args.data, "--tokenizer", args.tokenizer, "--out", out,
           "--device", args.device, "--model_dir", model_dir, "--deadline", str(args.trl_timeout - TRL_STOP_MARGIN_S),
           "--steps", str(args.trl_steps), "--warmup", str(args.trl_warmup), *TRL,
           *(["--rows", str(args.rows)] if args.rows else []), *(["--tiny"] if args.tiny else [])]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        proc.wait(timeout=args.trl_timeout)
    except subprocess.TimeoutExpired:
        return {"system": "trl", "model_dir": model_dir, "status": "timeout", "timeout_s": args.trl_timeout}
    finally:
        stop(proc)
    if proc.returncode != 0 or not os.path.exists(out):
        return {"system": "trl", "model_dir": model_dir, "status": "failed", "rc": proc.returncode}
    with open(out) as f:
        (record,) = map(json.loads, f)
    return record


def side_by_side(sfttrain: dict, trl: dict) -> dict:
    """The two records' throughput, memory and MFU, and sfttrain's real tokens/s over TRL's (None
    where one of them has no result)."""
    both = all("real_tokens_per_s" in r for r in (sfttrain, trl))
    record = {"system": "sfttrain vs trl", "workload": "w4", "model_dir": sfttrain["model_dir"]}
    for name, result in (("sfttrain", sfttrain), ("trl", trl)):
        record[f"{name}_status"] = result.get("status", "trained")  # only a run without results has one
        record.update({f"{name}_{key}": result.get(key) for key in ("timed_steps", "real_tokens_per_s",
                                                                    "peak_allocated_gib", "mfu")})
    record["sfttrain_over_trl"] = round(sfttrain["real_tokens_per_s"] / trl["real_tokens_per_s"], 2) if both else None
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sfttrain_args(p, work="/tmp/sfttrain_w4")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--systems", nargs="*", default=["sfttrain", "trl"], choices=["sfttrain", "trl"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--run_timeout", type=float, default=220, help="seconds sfttrain's job may take, start-up included")
    p.add_argument("--trl_steps", type=int, default=10)
    p.add_argument("--trl_warmup", type=int, default=3)
    p.add_argument("--trl_timeout", type=float, default=220, help="seconds TRL's run may take, start-up included")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny MoE, batch of 4, 3 steps (TRL: "
                   "bench.trl_w1 --tiny's 2 x 2 sequences, 3 steps)")
    args = p.parse_args()
    if args.tiny:
        args.steps, args.warmup, args.rows = 3, 1, args.rows or 64
        args.override = ["data.train_batch_size=4", "data.max_length=256", "data.max_token_len_per_gpu=1024",
                         "model.compile=false", "model.fsdp_config.mixed_precision=false", *args.override]
    os.makedirs(args.work, exist_ok=True)
    parquet = os.path.join(args.work, "train.parquet")
    write_parquet(load_rows(args.data, args.rows), parquet)
    if "sfttrain" in args.systems:  # before the model is drawn
        require_one_epoch(args, parquet, [*W4, *args.override])
    tokenizer = load_tokenizer(args.tokenizer)
    model_dir = save_model(args.work, w4_config(tokenizer, args.tiny), tokenizer, args.device)
    if "sfttrain" in args.systems:
        sfttrain = run_sfttrain(args, model_dir, parquet)
        emit(sfttrain, args.out)
    if "trl" in args.systems:
        trl = run_trl(args, model_dir)
        emit(trl, args.out)
    if {"sfttrain", "trl"} <= set(args.systems):
        emit(side_by_side(sfttrain, trl), args.out)


if __name__ == "__main__":
    main()
