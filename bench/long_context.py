"""W3 (docs/workloads.md): long samples with Ulysses sequence parallelism on 2 GPUs.

W2b's model (Llama-3-8B shape, Qwen2.5's vocabulary; config.json only, model.random_init=true).
A sample joins consecutive GSM8K rows into one prompt (every question and answer but the last
answer, in order) and one response (the last answer) until it reaches the target length; the
chat-templated sample is then cut to exactly that length from the left (data.truncation=left),
so the response and the end of the prompt stay. One sample per data-parallel rank per step.

For each length (ascending) and each sequence-parallel size, one `torchrun -m sfttrain.run` in a
subprocess with a timeout; its metrics.jsonl gives real tokens/s and MFU (sfttrain's formula,
printed beside the numbers) over the timed steps; the job is stopped once they are logged (no
final checkpoint of an 8B model). An sp size that fails at a length (out of memory, timeout) is
not tried at longer ones. Each result is appended to --out as it comes, and a call skips
(model, sp, length) already there: the same command, run again, continues where the last stopped.

    python3 -m bench.long_context --out w3.jsonl                  # 8B, 16k..128k, sp 1 and 2
    python3 -m bench.long_context --out w3.jsonl --model small    # Qwen2.5-0.5B shape: a result within minutes
    python3 -m bench.long_context --out w3.jsonl --tiny           # CPU smoke run (2 gloo ranks)
    python3 -m bench.long_context --out lora.jsonl --gpus 1 --sp 1 --lengths 65536 --lora   # W2b LoRA, one GPU
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import transformers
from bench.common import LORA, MFU_FORMULA, save_model as save_weights, timed_mfu, w2b_config
from bench.jobs import NO_SAVE_ON_STOP, read_jsonl, wait_for_steps, why_it_failed
from bench.w1_data import load_rows, load_tokenizer, model_config, write_parquet

LENGTHS = (16384, 32768, 65536, 131072)
# the W2b measurement's settings (FULL_SHARD, activation checkpointing, bf16 compute, fp32 master
# weights), one sample per micro-batch
COMMON = ["data.prompt_key=question", "data.response_key=answer", "data.truncation=left", "data.shuffle=false",
          "data.micro_batch_size_per_gpu=1", "model.random_init=true", "model.enable_gradient_checkpointing=true",
          "model.fsdp_config.model_dtype=fp32", "model.fsdp_config.mixed_precision=true", "optim.lr=1e-5",
          "optim.lr_warmup_steps_ratio=0", "optim.lr_scheduler=constant", "optim.weight_decay=0",
          "trainer.seed=0", "trainer.resume_mode=disable", "trainer.save_freq=-1", "trainer.log_freq=1",
          # a worker renders the next sample while a step runs: rendered in the loop, a 128k-token
          # sample took 0.6 s of each step
          "data.num_workers=1"]
# --lora: the seed article's adapters (bench.common.LORA), so the model folder is saved with weights drawn once


def save_model(args, tokenizer, max_length: int) -> str:
    """The model folder in --work: config.json only (model.random_init=true), or with weights for
    --lora. max_position_embeddings is raised to the longest length (RoPE has no table: only the
    config's stated limit changes, not the parameters or the flops)."""
    if args.model == "w2b":
        config = w2b_config(tokenizer, max_position_embeddings=max(8192, max_length))
    else:  # "small": W1's Qwen2.5-0.5B shape; "tiny": its CPU-sized sibling
        config = model_config(tiny=args.model == "tiny")
        config.max_position_embeddings = max(config.max_position_embeddings, max_length)
    if args.lora:
        return save_weights(args.work, config, tokenizer, args.device)
    path = os.path.join(args.work, f"model_{args.model}")
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def long_samples(rows: list[dict], tokenizer, length: int, count: int) -> list[dict]:
    """`count` samples of at least `length` tokens (before the chat template), each from the
    rows after the previous one's (wrapping around the file)."""
    questions = tokenizer([r["question"] for r in rows], add_special_tokens=False)["input_ids"]
    answers = tokenizer([r["answer"] for r in rows], add_special_tokens=False)["input_ids"]
    samples, i = [], 0
    for _ in range(count):
        parts, tokens = [], 0
        while tokens < length:
            parts.append(i % len(rows))
            tokens += len(questions[i % len(rows)]) + len(answers[i % len(rows)]) + 2  # + the "\n\n" joints
            i += 1
        text = [f"{rows[j]['question']}\n{rows[j]['answer']}" for j in parts[:-1]] + [rows[parts[-1]]["question"]]
        samples.append({"question": "\n\n".join(text), "answer": rows[parts[-1]]["answer"]})
    return samples


def run_one(args, model_dir: str, length: int, sp: int, timeout: float) -> dict:
    """One torchrun job; stopped once the timed steps are logged or after --run_timeout."""
    work = os.path.join(args.work, f"{args.model}_L{length}_sp{sp}")
    dp = args.gpus // sp
    parquet = os.path.join(work, "train.parquet")
    os.makedirs(work, exist_ok=True)
    rows = load_rows(args.data)
    write_parquet(long_samples(rows, load_tokenizer(model_dir), length, dp * args.steps), parquet)
    overrides = [*COMMON, f"model.partial_pretrain={model_dir}", f"data.train_files={parquet}",
                 f"data.max_length={length}", f"data.max_token_len_per_gpu={length}", f"data.train_batch_size={dp}",
                 f"ulysses_sequence_parallel_size={sp}", f"model.compile={str(args.compile).lower()}",
                 f"trainer.device={args.device}", f"trainer.default_local_dir={work}/run",
                 # beyond the timed steps: the job is stopped before it ends, so no final checkpoint
                 f"trainer.total_training_steps={args.steps + 1000}", NO_SAVE_ON_STOP, *(LORA if args.lora else []),
                 *args.override]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
           "-m", "sfttrain.run", *overrides]
    print("+", " ".join(cmd), flush=True)
    metrics = os.path.join(work, "run", "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    with open(os.path.join(work, "log.txt"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        status = wait_for_steps(proc, metrics, args.steps, timeout)
    steps = [m for m in read_jsonl(metrics) if "loss" in m and args.warmup < m["step"] <= args.steps]
    record = {"model": args.model, "length": length, "sp": sp, "dp": dp, "gpus": args.gpus, "status": status,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "compile": args.compile,
              "lora": args.lora, "override": args.override}
    if status == "trained":
        record.update(summary(steps))
    else:
        record["log_tail"] = why_it_failed(os.path.join(work, "log.txt"))
    return record


def summary(steps: list[dict]) -> dict:
    seconds = sum(m["step_time_s"] for m in steps)
    return {"timed_steps": [m["step"] for m in steps],
            "real_tokens_per_s": round(sum(m["tokens"] for m in steps) / seconds, 1),
            "s_per_step": round(seconds / len(steps), 3),
            # per-step MFU weighted by step time = MFU of the whole timed window
            "mfu": timed_mfu(steps),
            "peak_allocated_gib": round(max(m.get("mem_peak_alloc_gib", 0) for m in steps), 2),
            "mfu_formula": MFU_FORMULA}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="assets/data/gsm8k/train.jsonl", help="GSM8K train.jsonl")
    p.add_argument("--tokenizer", default="assets/tokenizers/qwen2.5-instruct")
    p.add_argument("--out", required=True, help="JSON lines file the results are appended to")
    p.add_argument("--work", default="/tmp/sfttrain_w3")
    p.add_argument("--model", default="w2b", choices=["w2b", "small", "tiny"])
    p.add_argument("--lengths", type=int, nargs="*", help=f"sample lengths (default {LENGTHS}; --tiny: 256 512)")
    p.add_argument("--sp", type=int, nargs="*", default=[1, 2])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="optimizer steps run; those after --warmup are timed")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile", type=int, default=1, help="model.compile (1/0)")
    p.add_argument("--run_timeout", type=float, default=420, help="seconds one run may take, start-up included")
    p.add_argument("--budget", type=float, default=460,
                   help="seconds for the whole call's runs (each stopped by then; one stop may take 60 s more)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--override", nargs="*", default=[], help="extra key=value for every run")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (r64/a32, all-linear) on saved weights")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, eager, 256/512 tokens, 2 gloo ranks")
    args = p.parse_args()
    if args.tiny:
        # eager: inductor's C++ build on a CPU would take most of the smoke run
        args.model, args.device, args.steps, args.warmup, args.compile = "tiny", "cpu", 3, 1, 0
        args.lengths = args.lengths or [256, 512]
        # bf16 on a CPU is slow; a data worker would cost a process start per rank for 3 short samples
        args.override = [*args.override, "model.fsdp_config.mixed_precision=false", "data.num_workers=0"]
    args.lengths = args.lengths or list(LENGTHS)
    start = time.monotonic()
    model_dir = save_model(args, load_tokenizer(args.tokenizer), max(args.lengths))
    # --out may also hold other benches' records (one results file per call): only this bench's count
    done = {(r["model"], r["sp"], r["length"]): r["status"] for r in read_jsonl(args.out) if "length" in r}
    failed_at = {sp: min([n for (m, s, n), st in done.items() if m == args.model and s == sp and st != "trained"],
                         default=None) for sp in args.sp}
    for length in sorted(args.lengths):
        for sp in args.sp:
            if (args.model, sp, length) in done or (failed_at[sp] is not None and length > failed_at[sp]):
                continue
            left = args.budget - (time.monotonic() - start)
            if left < 60:
                print(f"budget of {args.budget}s spent: run the same command again to continue", flush=True)
                return
            record = run_one(args, model_dir, length, sp, min(args.run_timeout, left))
            if record["status"] != "trained":
                failed_at[sp] = length
            print(json.dumps(record), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
