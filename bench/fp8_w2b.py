"""model.fp8 on one GPU (issue 26): W2b full fine-tuning with and without FP8 GEMMs, then W1 the
same way, in one call; every run sfttrain as a user runs it (`python -m sfttrain.run`).

W2b (docs/workloads.md): the Llama-3-8B shape with the Qwen2.5 vocabulary (8.2B parameters), a
model folder of config.json and tokenizer only (model.random_init: the same weights from
trainer.seed in both runs), W1's recipe and data with W2's max_length 4096 and 128 sequences per
step, activation checkpointing, layers compiled, fp32 master weights and AdamW state, bf16
compute. 60 steps of 128 sequences are 7680 samples, GSM8K's train file has 7473: the last two
steps start the second epoch, in the same order for both runs (the A/B needs the same data, not
fresh data). Each run is stopped once its last step is logged: a final checkpoint (~99 GB of fp32
weights and AdamW state) is not part of the workload and would fill the GPU machine's disk.

One record per run (tokens/s over steps warmup+1..steps from the run's metrics.jsonl, each step
timed on the device; the loss at the last step; peak memory; the start-up's fp8 line), then one
summary per workload: FP8's speed-up and the relative difference of the last step's loss
(the issue's targets on W2b: >= 1.25x, within 1%).

    python3 -m bench.fp8_w2b --data .bench_data/train.jsonl --out $OUT/fp8.jsonl [--token_budget 16384]
        [--parts w2b w1] [--w2b_fp8 tensorwise rowwise] [--steps 60 --warmup 10] [--w1_steps 20 --w1_warmup 10]
    python3 -m bench.fp8_w2b --tiny --device cpu --out /tmp/fp8.jsonl   # CPU smoke run: FP8 refused there

--token_budget (data.max_token_len_per_gpu, both runs of a workload alike): W2b's bf16 run peaked
at 130.5 of the H200's ~139 GiB with 16384; lower it for both if the FP8 run does not fit.
"""

import argparse
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

from bench.common import add_sfttrain_args, emit, w2b_config
from bench.jobs import NO_SAVE_ON_STOP, read_jsonl, stop, wait_for_steps
from bench.sfttrain_w1 import RECIPE, require_one_epoch, summarise
from bench.w1_data import load_rows, load_tokenizer, model_config, write_parquet

W2B = ["model.enable_gradient_checkpointing=true", "data.max_length=4096", "data.train_batch_size=128"]
# --tiny: a CPU smoke run of the same plumbing (eager, fp32, 4 short sequences a step)
TINY = ["model.compile=false", "model.fsdp_config.mixed_precision=false", "data.train_batch_size=4",
        "data.max_length=256", "data.max_token_len_per_gpu=1024", "data.no_loss_rows=drop"]


def save_models(args, tokenizer) -> dict[str, str]:
    """W2b's and W1's model folders (config.json and tokenizer; the runs draw the weights)."""
    folders = {}
    for name, config in (("w2b", w2b_config(tokenizer, tiny=args.tiny)), ("w1", model_config(tiny=args.tiny))):
        folders[name] = os.path.join(args.work, f"{name}_tiny" if args.tiny else name)
        config.save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    return folders


def run(args, name: str, model_dir: str, parquet: str, overrides: list[str], steps: int, warmup: int) -> dict:
    """One sfttrain job, stopped once step `steps` is logged; its record."""
    run_dir = os.path.join(args.work, "runs", name)
    shutil.rmtree(run_dir, ignore_errors=True)  # no resume from an earlier call's run
    overrides = [*overrides, *args.override]
    # a constant LR (W1's recipe): the step count beyond `steps` changes nothing but the save it never reaches
    cmd = [sys.executable, "-m", "sfttrain.run", RECIPE, f"model.partial_pretrain={model_dir}",
           f"data.train_files={parquet}", f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable",
           f"trainer.total_training_steps={steps + 1000}", f"trainer.device={args.device}", "trainer.log_freq=1",
           NO_SAVE_ON_STOP, *overrides]
    print("+", " ".join(cmd), flush=True)
    log = os.path.join(args.work, f"{name}.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            status = wait_for_steps(proc, os.path.join(run_dir, "metrics.jsonl"), steps, args.run_timeout)
        finally:
            stop(proc)
    with open(log) as f:
        text = f.read()
    print(text[-4000:], flush=True)
    base = {"system": "sfttrain", "variant": name, "overrides": overrides, "status": status,
            "fp8_line": next((line.strip() for line in text.splitlines() if line.startswith("  fp8 ")), None)}
    if status != "trained":
        return {**base, "rc": proc.returncode,
                "error": next((line for line in text.splitlines() if line.startswith("sfttrain: ")), text[-500:])}
    window = SimpleNamespace(steps=steps, warmup=warmup, override=[], device=args.device)
    last = next(m for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if m.get("step") == steps and "loss" in m)
    return {**summarise(name, window, run_dir, overrides), **base, "last_step": steps, "loss_last_step": last["loss"]}


def compare(workload: str, records: list[dict]) -> dict:
    """FP8's speed-up and loss difference against the bf16 run, per FP8 run."""
    bf16 = records[0]
    out = {"summary": workload, "bf16_real_tokens_per_s": bf16.get("real_tokens_per_s"),
           "bf16_loss_last_step": bf16.get("loss_last_step")}
    for r in records[1:]:
        if "real_tokens_per_s" in r and "real_tokens_per_s" in bf16:
            out[r["variant"]] = {"speedup": round(r["real_tokens_per_s"] / bf16["real_tokens_per_s"], 3),
                                 "loss_rel_diff": round(abs(r["loss_last_step"] / bf16["loss_last_step"] - 1), 4),
                                 "peak_allocated_gib": r["peak_allocated_gib"]}
        else:
            out[r["variant"]] = {"status": r["status"], "error": r.get("error")}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sfttrain_args(p, work="/tmp/sfttrain_fp8")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--parts", nargs="*", default=["w2b", "w1"], choices=["w2b", "w1"])
    p.add_argument("--w2b_fp8", nargs="*", default=["tensorwise"], choices=["tensorwise", "rowwise", "auto"],
                   help="model.fp8 values to run W2b with, after its bf16 run")
    p.add_argument("--token_budget", type=int, default=16384, help="W2b's data.max_token_len_per_gpu, both runs")
    p.add_argument("--steps", type=int, default=60, help="W2b's steps; the loss compared is the last one's")
    p.add_argument("--warmup", type=int, default=10, help="W2b's untimed steps")
    p.add_argument("--w1_steps", type=int, default=20)
    p.add_argument("--w1_warmup", type=int, default=10)
    p.add_argument("--run_timeout", type=float, default=330, help="seconds one job may take, start-up included")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny models, 3 steps (FP8 is refused on CPU)")
    args = p.parse_args()
    if args.tiny:
        args.steps, args.warmup, args.w1_steps, args.w1_warmup, args.rows = 3, 1, 3, 1, args.rows or 64
        args.override = [*TINY, *args.override]
    os.makedirs(args.work, exist_ok=True)
    folders = save_models(args, load_tokenizer(args.tokenizer))
    parquet = os.path.join(args.work, "train.parquet")
    write_parquet(load_rows(args.data, args.rows), parquet)
    workloads = {
        "w2b": (folders["w2b"], [*W2B, f"data.max_token_len_per_gpu={args.token_budget}"], args.steps, args.warmup,
                args.w2b_fp8),
        # W1's recipe as it is; tensorwise asked for explicitly (auto keeps it off for this shape)
        "w1": (folders["w1"], [], args.w1_steps, args.w1_warmup, ["tensorwise"]),
    }
    for part in args.parts:
        model_dir, overrides, steps, warmup, modes = workloads[part]
        if part == "w1":  # W1 is distinct samples; W2b's 60 x 128 wraps into a second epoch (docstring)
            require_one_epoch(SimpleNamespace(steps=steps, data=args.data), parquet, [*overrides, *args.override])
        records = []
        for mode in ["off", *modes]:
            name = f"{part}_{'bf16' if mode == 'off' else 'fp8_' + mode}"
            records.append(run(args, name, model_dir, parquet, [*overrides, f"model.fp8={mode}"], steps, warmup))
            emit(records[-1], args.out)
        emit(compare(part, records), args.out)


if __name__ == "__main__":
    main()
