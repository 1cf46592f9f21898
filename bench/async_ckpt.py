"""Checkpoint stall: W1 with a save every --save_freq steps, per save setting, beside the disk's
own sequential write speed for a checkpoint's size, measured in the same call.

Runs W1 (recipe w1_qwen2.5-0.5b.yaml, eager so that start-up is short) through torchrun on
--gpus GPUs once per setting of SETTINGS and per sfttrain tree (--tree: this checkout by default;
another checkout, e.g. one with the former writer, to compare in the same call), and prints per
run (as JSON lines) the periodic saves' median stall, the step after a save against the median
step, and the write GB/s against the disk's (`dd oflag=direct` of the first run's checkpoint size
into the run folder's filesystem).

    python3 -m bench.async_ckpt --out ckpt.jsonl [--gpus 2] [--setting process_pinned ...] [--tree . /old/tree]
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

from bench.common import REPO, add_sfttrain_args, emit
from bench.sfttrain_w1 import RECIPE, prepare

# of a checkpoint record (`awaited`: the loop waited for the write; absent from older trees' records)
SAVE_KEYS = ("step", "async", "bytes", "stall_s", "waited_previous_s", "written_s", "write_s", "commit_s", "gb_per_s",
             "awaited")
# name -> the save keys it runs with (keys every tree takes)
SETTINGS = {
    # DCP's async_save with its writer process, staged into pinned host memory (the default on CUDA)
    "process_pinned": ["trainer.async_save=true", "trainer.async_save_writer=process", "trainer.async_save_pinned=true",
                       "trainer.save_thread_count=4"],
    # the same, staged into pageable shared memory (no page locking; a slower device-to-host copy)
    "process_pageable": ["trainer.async_save=true", "trainer.async_save_writer=process",
                         "trainer.async_save_pinned=false", "trainer.save_thread_count=4"],
    # written by a thread of the training process (it shares the GIL with the kernel launches)
    "thread_pinned": ["trainer.async_save=true", "trainer.async_save_writer=thread", "trainer.async_save_pinned=true",
                      "trainer.save_thread_count=4"],
    "sync": ["trainer.async_save=false", "trainer.save_thread_count=4"],
}
TINY = ["trainer.device=cpu", "data.train_batch_size=2", "data.max_token_len_per_gpu=1024", "data.max_length=256",
        "model.fsdp_config.mixed_precision=false"]


def disk_write_gb_per_s(folder: str, size: int) -> dict:
    """Sequential write speed of the filesystem holding `folder` for `size` bytes: dd with O_DIRECT
    (the page cache would measure memory), fsynced; without O_DIRECT where the filesystem refuses it (tmpfs)."""
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, "dd.bin")
    count = max(1, round(size / 2**24))  # 16 MiB blocks
    for flags in (["oflag=direct"], []):
        start = time.perf_counter()
        done = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={count}", "conv=fsync", *flags],
                              capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if done.returncode == 0:
            os.remove(target)
            return {"disk_gb_per_s": round(count * 2**24 / 1e9 / seconds, 3), "dd_flags": flags,
                    "dd_bytes": count * 2**24}
    raise RuntimeError(f"dd into {folder} failed: {done.stderr.strip()}")


def run(name: str, tree: str, args, model_dir: str, parquet: str) -> tuple[list[dict], str]:
    """One run of W1 with setting `name` by the sfttrain of `tree`: its metrics.jsonl records and git revision."""
    run_dir = os.path.join(args.work, "runs", f"{name}_{args.gpus}gpu_{os.path.basename(os.path.abspath(tree))}")
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}"] if args.gpus > 1 else []
    cmd = [sys.executable, *launcher, "-m", "sfttrain.run", RECIPE, f"model.partial_pretrain={model_dir}",
           f"data.train_files={parquet}", f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable",
           "model.compile=false", f"trainer.total_training_steps={args.steps}", f"trainer.save_freq={args.save_freq}",
           "trainer.log_freq=5", *SETTINGS[name], *(TINY if args.tiny else []), *args.override]
    print("+", " ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", "PYTHONPATH": os.pathsep.join(  # the tree first, then what the caller set (wheels carried to a GPU machine)
        filter(None, [os.path.abspath(tree), os.environ.get("PYTHONPATH")]))}
    subprocess.run(cmd, check=True, env=env, cwd=os.path.abspath(tree))
    rev = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], rev.strip() or None


def summary(records: list[dict], args, disk: dict) -> dict:
    """The periodic saves' stall, the step after each against the median step, the write against dd."""
    periodic = [m for m in records if m.get("event") == "checkpoint" and m["step"] < args.steps]
    times = {m["step"]: m["step_time_s"] for m in records if "loss" in m and m["step"] > 2}
    after_save = {m["step"] + 1 for m in periodic}
    median_step = statistics.median(times.values())
    after = statistics.median([t for s, t in times.items() if s in after_save])
    # steps differ in length (packed tokens): the same comparison per token, as tokens/s
    rates = {m["step"]: m["tokens_per_s"] for m in records if "loss" in m and m["step"] > 2}
    rate_after = statistics.median([r for s, r in rates.items() if s in after_save])
    write = statistics.median([m["gb_per_s"] for m in periodic])
    return {"stall_s_median": round(statistics.median([m["stall_s"] for m in periodic]), 3),
            "stall_s_max": round(max(m["stall_s"] for m in periodic), 3),
            # a save due while the previous one is written waits for it (the disk): --save_freq steps should take
            # longer than a write; the rest of the stall is the staging copy
            "waited_previous_s_median": round(statistics.median([m["waited_previous_s"] for m in periodic]), 3),
            "staging_s_median": round(statistics.median([m["stall_s"] - m["waited_previous_s"] for m in periodic]), 3),
            "step_after_save_s_median": round(after, 4), "step_s_median": round(median_step, 4),
            "step_after_save_vs_median": round(after / median_step, 3),
            "tokens_per_s_after_save_vs_median": round(rate_after / statistics.median(rates.values()), 3),
            "write_gb_per_s_median": round(write, 3), **disk, "write_vs_disk": round(write / disk["disk_gb_per_s"], 3),
            "saves": [{k: m.get(k) for k in SAVE_KEYS} for m in periodic],
            # each step's time and tokens/s (from step 3): what runs beside the saves shows where it lands
            "step_s_tokens_per_s": {s: [round(times[s], 4), round(rates[s])] for s in sorted(times)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sfttrain_args(p, work="/tmp/sfttrain_ckpt")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save_freq", type=int, default=10)
    p.add_argument("--setting", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--tree", nargs="*", default=[REPO], help="sfttrain checkouts to run, each in turn per setting")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, 5 steps, a save every 2")
    args = p.parse_args()
    if args.tiny:
        args.steps, args.save_freq, args.rows = 5, 2, args.rows or 16
    model_dir, parquet = prepare(args)
    disk = None
    for name in args.setting:
        for tree in args.tree:
            records, rev = run(name, tree, args, model_dir, parquet)
            if disk is None:  # the disk's speed for a checkpoint's size, measured once
                size = max(m["bytes"] for m in records if m.get("event") == "checkpoint")
                disk = disk_write_gb_per_s(os.path.join(args.work, "runs"), size)
                print(f"disk: {disk['disk_gb_per_s']} GB/s sequential write of {size / 1e9:.3g} GB "
                      f"({' '.join(disk['dd_flags']) or 'page cache'})", flush=True)
            result = {"setting": name, "overrides": SETTINGS[name], "tree": os.path.abspath(tree), "rev": rev,
                      "gpus": args.gpus, "torch": torch.__version__, "steps": args.steps, "save_freq": args.save_freq,
                      "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu",
                      **summary(records, args, disk)}
            emit(result, args.out)
            print(f"{name} ({rev}): stall {result['stall_s_median']} s per periodic save (median; "
                  f"{result['waited_previous_s_median']} s of it waiting for the previous save's write), step after a "
                  f"save {result['step_after_save_vs_median']}x the median step (tokens/s: "
                  f"{result['tokens_per_s_after_save_vs_median']}x the median), writes {result['write_gb_per_s_median']} "
                  f"GB/s = {result['write_vs_disk']:.0%} of the disk's {disk['disk_gb_per_s']} GB/s", flush=True)


if __name__ == "__main__":
    main()
