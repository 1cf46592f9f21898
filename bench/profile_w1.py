"""Where a W1 step's time goes: torch.profiler over a few sfttrain steps after warm-up.

    python3 -m bench.profile_w1 --work /tmp/sfttrain_w1 [key=value ...]
    python3 -m bench.profile_w1 --work /tmp/sfttrain_w1 --tiny       # CPU smoke run after sfttrain_w1 --tiny
    torchrun --standalone --nproc_per_node=2 -m bench.profile_w1 --work /tmp/sfttrain_w1 [key=value ...]

Under torchrun every rank profiles itself: each prints its one-line summary and writes its own
trace; rank 0 prints the tables and the idle gaps.

Uses the model folder and Parquet that bench.sfttrain_w1 prepared in --work. Prints wall time
per step, GPU kernel time per step (busy fraction), the top kernels, the host's top operators, and
where the GPU sits idle; writes the Chrome trace (--trace).
"""

import argparse
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.sfttrain_w1 import RECIPE, TINY
from sfttrain.config import load_config
from sfttrain.data.loader import step_batches
from sfttrain.distributed import init_world, shutdown
from sfttrain.trainer import FSDPSFTTrainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/sfttrain_w1")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--trace", help="write a Chrome trace here")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: bench.sfttrain_w1 --tiny's folder, 1 + 1 steps")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.tiny:
        args.warmup, args.steps = 1, 1
        args.overrides = [*TINY, "trainer.device=cpu", *args.overrides]
    cfg = load_config(RECIPE, [f"model.partial_pretrain={args.work}/model", f"data.train_files={args.work}/train.parquet",
                               f"trainer.default_local_dir={args.work}/runs/profile", "trainer.resume_mode=disable",
                               *args.overrides])
    world = init_world(cfg)
    trainer = FSDPSFTTrainer(cfg, world)
    batches = iter(step_batches(trainer.data, 0, 0, cfg.data.num_workers, pin_memory=world.device.type == "cuda"))
    queued = None
    for _ in range(args.warmup):
        queued = trainer.step(next(batches), 0.0, queued)
    trainer.finish(queued)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        queued = None
        for _ in range(args.steps):
            queued = trainer.step(next(batches), 0.0, queued)
        trainer.finish(queued)
        wall = (time.perf_counter() - start) / args.steps
    events = prof.key_averages()
    # device kernels only: annotated ranges (Optimizer.step, ...) would count their kernels twice
    gpu = sum(e.self_device_time_total for e in events if e.cpu_time_total == 0) / 1e6 / args.steps
    print(f"rank {world.rank}, overrides {args.overrides}: wall {wall * 1e3:.1f} ms/step, GPU kernels "
          f"{gpu * 1e3:.1f} ms/step ({100 * gpu / wall:.0f}% busy)", flush=True)
    trace = args.trace or "/tmp/profile_w1_trace.json"
    if world.world_size > 1:
        trace = trace.removesuffix(".json") + f".rank{world.rank}.json"
    prof.export_chrome_trace(trace)
    if world.is_main:
        print(events.table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=70))
        print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
        # inclusive host time of the step's phases (compiled forward/backward, loss, optimizer, waits)
        print(events.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70))
        print_idle_gaps(trace, args.steps)
    shutdown(world)


def print_idle_gaps(trace: str, steps: int, top: int = 12) -> None:
    """Where the GPU waits: the gaps between consecutive device activities of the trace, in
    total per step and the largest ones with the kernels on either side."""
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    device = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not device:
        print("no device activity in the trace (a CPU run)")
        return
    gaps, end, before = [], device[0][1], device[0][2]
    for start, stop, name in device[1:]:
        if start > end:
            gaps.append((start - end, before, name))
        if stop > end:
            end, before = stop, name
    print(f"GPU idle between activities: {sum(g[0] for g in gaps) / 1e3 / steps:.1f} ms/step "
          f"({sum(g[0] > 100 for g in gaps) / steps:.0f} gaps over 100 us per step); largest:")
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {gap / 1e3:7.2f} ms after {before[:60]!r} before {after[:60]!r}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
