"""Checkpoint stall: periodic saves with trainer.async_save=true against false, on W1's model.

Runs W1 (recipe w1_qwen2.5-0.5b.yaml, eager so that start-up is short) through torchrun on
--gpus GPUs, saving every --save_freq steps, once per setting, and prints per setting what each
checkpoint's metrics.jsonl record says (bytes, seconds the loop stalled, seconds until written,
GB/s, seconds to commit) and the median step time of the steps with and without a save in
flight, as JSON lines.

    python3 -m bench.async_ckpt --data assets/data/gsm8k/train.jsonl --out ckpt.jsonl [--gpus 2]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

from bench.common import add_sfttrain_args, emit
from bench.sfttrain_w1 import RECIPE, prepare

SAVE_KEYS = ("step", "async", "bytes", "stall_s", "written_s", "commit_s", "gb_per_s")  # of a checkpoint record


def run(setting: bool, args, model_dir: str, parquet: str) -> dict:
    run_dir = os.path.join(args.work, "runs", f"async_{setting}_{args.gpus}gpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
           "-m", "sfttrain.run", RECIPE, f"model.partial_pretrain={model_dir}", f"data.train_files={parquet}",
           f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable", "model.compile=false",
           f"trainer.total_training_steps={args.steps}", f"trainer.save_freq={args.save_freq}",
           f"trainer.async_save={str(setting).lower()}", "trainer.log_freq=5", *args.override]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"})
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    saves = [m for m in records if m.get("event") == "checkpoint"]
    times = {m["step"]: m["step_time_s"] for m in records if "loss" in m and m["step"] > 2}
    after_save = {s + 1 for s in range(args.save_freq, args.steps, args.save_freq)}  # a write in flight
    return {"async_save": setting, "gpus": args.gpus, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "steps": args.steps, "save_freq": args.save_freq,
            "saves": [{k: m[k] for k in SAVE_KEYS} for m in saves],
            "median_step_s_after_save": statistics.median([t for s, t in times.items() if s in after_save]),
            "median_step_s_other": statistics.median([t for s, t in times.items() if s not in after_save])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sfttrain_args(p, work="/tmp/sfttrain_ckpt")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save_freq", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="CPU-sized model (still needs CUDA)")
    args = p.parse_args()
    model_dir, parquet = prepare(args)
    for setting in (True, False):
        emit(run(setting, args, model_dir, parquet), args.out)


if __name__ == "__main__":
    main()
