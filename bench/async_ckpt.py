"""Checkpoint stall: W1 with a save every --save_freq steps, per save setting, beside the disk's
own sequential write speed measured in the same call.

Runs W1 (recipe w1_qwen2.5-0.5b.yaml, eager so that start-up is short) through torchrun on
--gpus GPUs once per setting of SETTINGS, and prints per setting (as JSON lines) the periodic
saves' median stall, the step after a save against the median step, and the write GB/s against
the disk's (`dd oflag=direct` into the run folder's filesystem, before the runs).

    python3 -m bench.async_ckpt --out ckpt.jsonl [--gpus 2] [--setting async_pinned ...]
    python3 -m bench.async_ckpt --tiny --out /tmp/ckpt.jsonl   # CPU smoke run: tiny model, a few steps
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from bench.common import add_sfttrain_args, emit
from bench.sfttrain_w1 import RECIPE, prepare

# of a checkpoint record
SAVE_KEYS = ("step", "async", "bytes", "stall_s", "waited_previous_s", "written_s", "write_s", "commit_s", "gb_per_s")
# name -> the save keys it runs with
SETTINGS = {
    "async_pinned": ["trainer.async_save=true", "trainer.async_save_pinned=true", "trainer.save_thread_count=4"],
    # room for every periodic save of the default 40 steps: saves due faster than the disk writes them queue
    # (auto staging: each save's copy on the GPU where its memory holds 4, W1's case)
    "async_pinned_4": ["trainer.async_save=true", "trainer.async_save_pinned=true", "trainer.save_thread_count=4",
                       "trainer.async_save_in_flight=4"],
    # the same, each save's copy taken straight into pinned host memory
    "async_pinned_4_host": ["trainer.async_save=true", "trainer.async_save_pinned=true", "trainer.save_thread_count=4",
                            "trainer.async_save_in_flight=4", "trainer.async_save_staging=host"],
    # the same, written by a thread of the training process instead of a writer process (auto's choice on CUDA)
    "async_pinned_4_thread": ["trainer.async_save=true", "trainer.async_save_pinned=true",
                              "trainer.save_thread_count=4", "trainer.async_save_in_flight=4",
                              "trainer.async_save_writer=thread"],
    # 4 in flight, staged into pageable shared memory (no page locking to wait for; a slower copy)
    "async_pageable_4": ["trainer.async_save=true", "trainer.async_save_pinned=false", "trainer.save_thread_count=4",
                         "trainer.async_save_in_flight=4"],
    "async_pageable_1thread": ["trainer.async_save=true", "trainer.async_save_pinned=false",
                               "trainer.save_thread_count=1"],
    "sync": ["trainer.async_save=false", "trainer.save_thread_count=4"],
}
TINY = ["trainer.device=cpu", "data.train_batch_size=2", "data.max_token_len_per_gpu=1024", "data.max_length=256",
        "model.fsdp_config.mixed_precision=false"]


def disk_write_gb_per_s(folder: str, gigabytes: float) -> dict:
    """Sequential write speed of the filesystem holding `folder`: dd with O_DIRECT (the page cache
    would measure memory), fsynced; without O_DIRECT where the filesystem refuses it (tmpfs)."""
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, "dd.bin")
    count = max(1, round(gigabytes * 1024 / 64))
    for flags in (["oflag=direct"], []):
        start = time.perf_counter()
        done = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=64M", f"count={count}", "conv=fsync", *flags],
                              capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if done.returncode == 0:
            os.remove(target)
            return {"disk_gb_per_s": round(count * 64 * 2**20 / 1e9 / seconds, 3), "dd_flags": flags,
                    "dd_bytes": count * 64 * 2**20}
    raise RuntimeError(f"dd into {folder} failed: {done.stderr.strip()}")


def run(name: str, args, model_dir: str, parquet: str, disk: dict) -> dict:
    run_dir = os.path.join(args.work, "runs", f"{name}_{args.gpus}gpu")
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}"] if args.gpus > 1 else []
    cmd = [sys.executable, *launcher, "-m", "sfttrain.run", RECIPE, f"model.partial_pretrain={model_dir}",
           f"data.train_files={parquet}", f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable",
           "model.compile=false", f"trainer.total_training_steps={args.steps}", f"trainer.save_freq={args.save_freq}",
           "trainer.log_freq=5", *SETTINGS[name], *(TINY if args.tiny else []), *args.override]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"})
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    periodic = [m for m in records if m.get("event") == "checkpoint" and m["step"] < args.steps]
    staging = sorted({m["staging"] for m in periodic})  # where their copies were taken: device | host
    times = {m["step"]: m["step_time_s"] for m in records if "loss" in m and m["step"] > 2}
    after_save = {m["step"] + 1 for m in periodic}
    median_step = statistics.median(times.values())
    after = statistics.median([t for s, t in times.items() if s in after_save])
    # steps differ in length (packed tokens): the same comparison per token, as tokens/s
    rates = {m["step"]: m["tokens_per_s"] for m in records if "loss" in m and m["step"] > 2}
    rate_after = statistics.median([r for s, r in rates.items() if s in after_save])
    write = statistics.median([m["gb_per_s"] for m in periodic])
    return {"setting": name, "overrides": SETTINGS[name], "gpus": args.gpus,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu",
            "torch": torch.__version__, "steps": args.steps, "save_freq": args.save_freq,
            "stall_s_median": round(statistics.median([m["stall_s"] for m in periodic]), 3),
            # a save finding trainer.async_save_in_flight saves in flight waits for the oldest: the disk
            "waited_previous_s_median": round(statistics.median([m["waited_previous_s"] for m in periodic]), 3),
            "step_after_save_s_median": round(after, 4), "step_s_median": round(median_step, 4),
            "step_after_save_vs_median": round(after / median_step, 3),
            "tokens_per_s_after_save_vs_median": round(rate_after / statistics.median(rates.values()), 3),
            "write_gb_per_s_median": round(write, 3), **disk,
            "write_vs_disk": round(write / disk["disk_gb_per_s"], 3), "staging": staging,
            "saves": [{k: m[k] for k in SAVE_KEYS} for m in periodic],
            # each step's time and tokens/s (from step 3): what runs beside the saves shows where it lands
            "step_s_tokens_per_s": {s: [round(times[s], 4), round(rates[s])] for s in sorted(times)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sfttrain_args(p, work="/tmp/sfttrain_ckpt")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save_freq", type=int, default=10)
    p.add_argument("--setting", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--dd_gb", type=float, default=8.0, help="GB dd writes to measure the disk")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, 5 steps, a save every 2")
    args = p.parse_args()
    if args.tiny:
        args.steps, args.save_freq, args.dd_gb, args.rows = 5, 2, 0.0625, args.rows or 16
    model_dir, parquet = prepare(args)
    disk = disk_write_gb_per_s(os.path.join(args.work, "runs"), args.dd_gb)
    print(f"disk: {disk['disk_gb_per_s']} GB/s sequential write ({' '.join(disk['dd_flags']) or 'page cache'})")
    for name in args.setting:
        result = run(name, args, model_dir, parquet, disk)
        emit(result, args.out)
        print(f"{name}: stall {result['stall_s_median']} s per periodic save (median; "
              f"{result['waited_previous_s_median']} s of it waiting for older saves' writes), step after a save "
              f"{result['step_after_save_vs_median']}x the median step (tokens/s: "
              f"{result['tokens_per_s_after_save_vs_median']}x the median), writes {result['write_gb_per_s_median']} "
              f"GB/s = {result['write_vs_disk']:.0%} of the disk's {disk['disk_gb_per_s']} GB/s", flush=True)


if __name__ == "__main__":
    main()
