"""Scale-out bench (issue 11): W1 on 1 and 2 GPUs, elastic resume 1->2, W2b (8.2B) settings on 2 GPUs.

Each run is `torchrun -m sfttrain.run` in a subprocess of its own with a timeout, so one failure
loses only its own record. One JSON line per run goes to --out: total real tokens/s and MFU over
the timed steps (from the run's metrics.jsonl, each step timed on the device), peak GPU memory,
the time from launch to the start-up report (model loaded and sharded) and to the first logged
step, and every rank's peak host memory at start-up. Then summary lines: W1's 2-GPU/1-GPU ratio.

    python3 -m bench.scale --part w1  --data .bench_data/train.jsonl --out $OUT/scale.jsonl   # ~8 min
    python3 -m bench.scale --part w2b --data .bench_data/train.jsonl --out $OUT/scale.jsonl   # ~8 min
    python3 -m bench.scale --tiny --part all --out /tmp/scale.jsonl                          # CPU smoke run

W2b (docs/workloads.md): W2's Llama-3-8B shape with the Qwen2.5 vocabulary, a model
folder of config.json and tokenizer only, weights from model.random_init (meta-device init: each
rank draws only its shards).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

from bench.common import MFU_FORMULA, default_data, timed_mfu, w2b_config
from bench.jobs import NO_SAVE_ON_STOP, stop, why_it_failed
from bench.w1_data import load_rows, load_tokenizer, model_config, write_parquet

RECIPE = os.path.join(os.path.dirname(__file__), "..", "recipes", "w1_qwen2.5-0.5b.yaml")
# W2b on W1's recipe: W2's max_length and 128 sequences per step, FULL_SHARD over the 2 GPUs
W2B = ["data.max_length=4096", "data.train_batch_size=128", "data.max_token_len_per_gpu=16384",
       "model.enable_gradient_checkpointing=true"]

# --tiny on CPU: eager, fp32 (bf16 on a CPU is slow), and steps of 2 short samples (a CPU computes
# 152k-vocab logits slowly); no_loss_rows=drop: GSM8K has prompts over 128 tokens
TINY = ["model.compile=false", "model.fsdp_config.mixed_precision=false", "data.train_batch_size=2",
        "data.max_length=128", "data.max_token_len_per_gpu=1024", "data.no_loss_rows=drop"]


def runs(tiny: bool) -> dict[str, dict]:
    """name -> part, model, GPUs, overrides, optimizer steps, untimed warm-up steps, timeout."""
    steps, w2b_steps, offload_steps = (6, 4, 3) if tiny else (60, 15, 6)
    resume_at = steps - (2 if tiny else 10)
    return {
        # a checkpoint at step 50: the one resumed on 2 GPUs below (a save is not step time)
        "w1_1gpu": dict(part="w1", model="w1", gpus=1, overrides=[f"trainer.save_freq={resume_at}"], steps=steps,
                        warmup=10, timeout=250),
        "w1_2gpu_full_shard": dict(part="w1", model="w1", gpus=2, overrides=[], steps=steps, warmup=10, timeout=250),
        # the whole model on each GPU, gradients all-reduced by DDP during backward (W1's 494M
        # parameters, gradients and AdamW state take ~8 GB: they fit)
        "w1_2gpu_ddp": dict(part="w1", model="w1", gpus=2, overrides=["model.fsdp_config.sharding_strategy=NO_SHARD"],
                            steps=steps, warmup=10, timeout=250),
        # steps 51-60 again, on 2 GPUs, from the 1-GPU run's step-50 checkpoint (eager: start-up
        # without compilation)
        "w1_resume_1to2": dict(part="w1", model="w1", gpus=2, overrides=["trainer.resume_mode=auto",
                                                                         "model.compile=false"],
                               steps=steps, warmup=resume_at, timeout=150, resume_of="w1_1gpu", resume_at=resume_at),
        "w1_2gpu_shard_grad_op": dict(part="w1", model="w1", gpus=2,
                                      overrides=["model.fsdp_config.sharding_strategy=SHARD_GRAD_OP"],
                                      steps=steps, warmup=10, timeout=200),
        "w2b_full_shard_ckpt": dict(part="w2b", model="w2b", gpus=2, overrides=W2B, steps=w2b_steps, warmup=5,
                                    timeout=170),
        "w2b_cpu_offload": dict(part="w2b", model="w2b", gpus=2, overrides=[*W2B, "model.fsdp_config.cpu_offload=true"],
                                steps=offload_steps, warmup=2, timeout=180),
        # recompute half the layers: W2b's fp32 weights and AdamW state take ~66 GB per GPU, the
        # other half's activations (~40 GB at 16k tokens) fit beside them, and half the
        # recomputation goes
        "w2b_ckpt_half_layers": dict(part="w2b", model="w2b", gpus=2,
                                     overrides=[*W2B, "model.gradient_checkpointing_ratio=0.5"], steps=w2b_steps,
                                     warmup=5, timeout=170),
    }


def prepare(args) -> dict[str, str]:
    """The W1 and W2b model folders (config and tokenizer) and the data."""
    tokenizer = load_tokenizer(args.tokenizer)
    w2b = w2b_config(tokenizer, tiny=args.tiny)
    paths = {"w1": os.path.join(args.work, "w1_model"), "w2b": os.path.join(args.work, "w2b_model"),
             "data": os.path.join(args.work, "train.parquet")}
    for name, config in (("w1", model_config(tiny=args.tiny)), ("w2b", w2b)):
        config.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    write_parquet(load_rows(args.data, args.rows), paths["data"])
    return paths


def launch(name: str, spec: dict, args, paths: dict, timeout: float) -> dict:
    run_dir = os.path.join(args.work, "runs", spec.get("resume_of", name))
    overrides = [f"model.partial_pretrain={paths[spec['model']]}", f"data.train_files={paths['data']}",
                 f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={spec['steps']}",
                 f"trainer.device={args.device}", NO_SAVE_ON_STOP, *spec["overrides"], *(TINY if args.tiny else [])]
    if "resume_of" in spec:  # the later checkpoints go: auto-resume takes the one at resume_at
        for later in range(spec["resume_at"] + 1, spec["steps"] + 1):
            shutil.rmtree(os.path.join(run_dir, f"global_step_{later}"), ignore_errors=True)
    else:
        overrides.append("trainer.resume_mode=disable")
        shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={spec['gpus']}",
           "-m", "sfttrain.run", RECIPE, *overrides]
    log_path = os.path.join(args.work, f"{name}.log")
    # torchrun would set 1: the host's cores shared by the ranks (CPU offload runs AdamW there)
    threads = str(max(1, (os.cpu_count() or 1) // spec["gpus"]))
    print("+", " ".join(cmd), flush=True)
    start = time.monotonic()
    marks: dict[str, float] = {}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": threads})
        metrics_path = os.path.join(run_dir, "metrics.jsonl")
        while proc.poll() is None and time.monotonic() - start < timeout:
            _mark_progress(marks, start, log_path, metrics_path, spec)
            # the last step is logged before the final checkpoint, which no run here needs (W2b's
            # would be 131 GB): stop there (once started: a resumed run first cuts its metrics back)
            if "ready_s" in marks and spec["steps"] in _steps(metrics_path):
                marks["stopped_before_final_save"] = True
                break
            time.sleep(0.25)
        stop(proc, stacks="stopped_before_final_save" not in marks)  # still running at its timeout: where it waits
    record = {"run": name, "gpus": spec["gpus"], "overrides": spec["overrides"], "rc": proc.returncode,
              "wall_s": round(time.monotonic() - start, 1), "timeout_s": round(timeout), **marks}
    return {**record, **_summary(run_dir, log_path, spec)}


def _mark_progress(marks: dict, start: float, log_path: str, metrics_path: str, spec: dict) -> None:
    """Seconds from launch to the start-up report, and to the first step this run logs."""
    now = round(time.monotonic() - start, 1)
    if "ready_s" not in marks and "host memory" in _read(log_path):
        marks["ready_s"] = now
    # after the start-up report: by then a resumed run has cut its metrics back to its checkpoint
    if "ready_s" in marks and "first_step_s" not in marks and _steps(metrics_path, after=spec.get("resume_at", 0)):
        marks["first_step_s"] = now


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _steps(metrics_path: str, after: int = 0) -> dict[int, dict]:
    """step -> its record (the last one written for it)."""
    steps = {}
    for line in _read(metrics_path).splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "loss" in m and m["step"] > after:
            steps[m["step"]] = m
    return steps


def _summary(run_dir: str, log_path: str, spec: dict) -> dict:
    steps = _steps(os.path.join(run_dir, "metrics.jsonl"))
    timed = [m for s, m in sorted(steps.items()) if s > spec["warmup"]]
    out: dict = {"steps_logged": len(steps)}
    memory = re.search(r"host memory\s*: peak ([\d., ]+) GiB per rank \(VmHWM\); before the model ([\d., ]+) GiB",
                       _read(log_path))
    if memory:
        out["host_peak_gib_per_rank"], out["host_before_model_gib_per_rank"] = (
            [float(x) for x in group.split(",")] for group in memory.groups())
    if timed:
        seconds = sum(m["step_time_s"] for m in timed)
        tokens = sum(m["tokens"] for m in timed)
        out.update(timed_steps=f"{timed[0]['step']}-{timed[-1]['step']}", real_tokens_per_s=round(tokens / seconds, 1),
                   real_tokens_per_s_per_gpu=round(tokens / seconds / spec["gpus"], 1),
                   mfu=timed_mfu(timed),
                   median_step_s=round(sorted(m["step_time_s"] for m in timed)[len(timed) // 2], 4),
                   peak_alloc_gib=max(m.get("mem_peak_alloc_gib", 0) for m in timed),
                   peak_reserved_gib=max(m.get("mem_peak_reserved_gib", 0) for m in timed),
                   losses={s: m["loss"] for s, m in steps.items()
                           if s > max(spec["steps"] - 10, spec.get("resume_at", 0))})
    if "resume_at" in spec:
        out["resumed_from_step"] = spec["resume_at"] if f"global_step_{spec['resume_at']}" in _read(log_path) else None
    if not timed or len(steps) < spec["steps"]:
        log = _read(log_path)
        out["errors"] = list(dict.fromkeys(line for line in log.splitlines() if re.search(r"Error\b|error:", line)))[:6]
        out["log_tail"] = why_it_failed(log_path)
    return out


def _resume_comparison(records: dict) -> dict | None:
    """The 2-GPU continuation's losses against the 1-GPU run's own for the same steps."""
    one, two = records.get("w1_1gpu", {}).get("losses"), records.get("w1_resume_1to2", {}).get("losses")
    if not one or not two:
        return None
    shared = sorted(set(one) & set(two))
    rel = max((abs(two[s] - one[s]) / abs(one[s]) for s in shared), default=None)
    return {"summary": "w1_resume_1to2_vs_1gpu", "steps_compared": len(shared), "max_rel_loss_diff": rel}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["w1", "w2b", "all"], required=True)
    p.add_argument("--data", default=default_data(), help="GSM8K train.jsonl (docs/workloads.md)")
    p.add_argument("--tokenizer", default="assets/tokenizers/qwen2.5-instruct")
    p.add_argument("--out", required=True, help="JSON lines file to append to")
    p.add_argument("--work", default="/tmp/sfttrain_scale")
    p.add_argument("--run", nargs="*", help="only these runs of the part")
    p.add_argument("--budget_s", type=float, default=530, help="wall-clock budget of this call; runs that "
                                                               "would start with under 60 s left are skipped")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny models, 2 CPU ranks, a few steps")
    p.add_argument("--rows", type=int)
    args = p.parse_args()
    args.device = "cpu" if args.tiny else "cuda"
    args.rows = args.rows or (256 if args.tiny else None)
    start = time.monotonic()
    paths = prepare(args)
    records: dict[str, dict] = {}
    for name, spec in runs(args.tiny).items():
        if (args.part != "all" and spec["part"] != args.part) or (args.run and name not in args.run):
            continue
        if args.tiny:
            spec["warmup"] = min(spec["warmup"], spec.get("resume_at", 1))
        left = args.budget_s - (time.monotonic() - start)
        if left < 60:
            records[name] = {"run": name, "skipped": f"{left:.0f} s of the call's budget left"}
        else:
            records[name] = launch(name, spec, args, paths, min(spec["timeout"] * (3 if args.tiny else 1), left))
        _emit(records[name], args.out)
    for summary in (_ratio(records), _resume_comparison(records)):
        if summary:
            _emit(summary, args.out)


def _ratio(records: dict) -> dict | None:
    """Each 2-GPU W1 layout's total real tokens/s over the 1-GPU run's."""
    one = records.get("w1_1gpu", {}).get("real_tokens_per_s")
    two = {name: r["real_tokens_per_s"] for name, r in records.items()
           if name.startswith("w1_2gpu") and r.get("real_tokens_per_s")}
    if not one or not two:
        return None
    return {"summary": "w1_2gpu_over_1gpu", "ratios": {name: round(t / one, 3) for name, t in two.items()},
            "target": 1.8, "mfu_formula": MFU_FORMULA}


def _emit(record: dict, out: str) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    with open(out, "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    main()
