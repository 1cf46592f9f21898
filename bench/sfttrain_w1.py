"""W1 (docs/workloads.md) for sfttrain itself, as a user would run it.

Builds the W1 model folder (Qwen2.5-0.5B config + tokenizer; weights drawn at start-up with
model.random_init and trainer.seed=0) and the W1 Parquet, runs `python -m sfttrain.run` for each
variant, and summarises optimizer steps 11-60 from the run's metrics.jsonl, where each step's time
is read after a device synchronisation.

    python3 -m bench.sfttrain_w1 --out results.jsonl [--data train.jsonl] [--variant NAME ...] [--device cpu --tiny]
        [--baseline_tree OTHER_CHECKOUT]

A run that would train a second epoch of --data (W1 is 3840 distinct samples) is refused.

--baseline_tree compares two versions of the code in one call: each variant runs first with that
checkout's sfttrain (`git worktree add /tmp/base <commit>`, or `git archive <commit> | tar -x -C DIR`),
then with this one's, on the same model folder, Parquet and recipe. Across calls W1 LoRA's host-bound
step moved by 15-20% where full fine-tuning's moved by 2% (docs/benchmarks.md, runs CG-CN): a change
to the code is shown only against its baseline in the same call.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

import pyarrow.parquet as pq
import torch
import transformers
from omegaconf import OmegaConf

from bench.common import LORA, MFU_FORMULA, add_sfttrain_args, emit, require_samples, timed_mfu
from bench.w1_data import build_model, load_rows, load_tokenizer, model_config, write_parquet
from sfttrain.metrics import commit_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(REPO, "recipes", "w1_qwen2.5-0.5b.yaml")
# --tiny: a CPU smoke run of the same code paths, eager and fp32 (bf16 on a CPU is slow), 4 sequences a step
TINY = ["model.compile=false", "model.fsdp_config.mixed_precision=false", "data.train_batch_size=4",
        "data.max_token_len_per_gpu=4096"]

# LoRA adapts saved weights: W1's, drawn once by prepare. Its head is frozen, so the recipe's large loss
# chunks (fewer passes over the head's weight gradient) would only cost memory: the default's 1024 ran as
# fast as 4096 at 1.7 GiB less (run BL, docs/benchmarks.md)
LORA_W1 = [*LORA, "model.loss_chunk_tokens=1024"]
# name -> overrides on top of the recipe (the recipe itself is the fastest setting)
VARIANTS = {
    "compile": [],
    "compile_chunk4096": ["model.loss_chunk_tokens=4096"],
    "compile_chunk2048": ["model.loss_chunk_tokens=2048"],
    "compile_chunk1024": ["model.loss_chunk_tokens=1024"],
    "compile_fused": ["model.fuse_projections=true"],
    "compile_torch_loss": ["model.loss_kernel=torch"],
    "eager": ["model.compile=false"],
    "eager_liger": ["model.compile=false", "model.use_liger=true"],
    "compile_2micro": ["data.max_token_len_per_gpu=8192"],
    "grad_ckpt": ["model.enable_gradient_checkpointing=true"],
    "lora": LORA_W1,
    "lora_fused": [*LORA_W1, "model.fuse_projections=true"],
    "lora_unfolded": [*LORA_W1, "model.fold_lora=false"],  # peft's adapters as they are (sfttrain/fuse_projections.py)
    "lora_2micro": [*LORA_W1, "data.max_token_len_per_gpu=8192"],
    "lora_grad_ckpt": [*LORA_W1, "model.enable_gradient_checkpointing=true"],
}


def prepare(args, saved_weights: bool = False) -> tuple[str, str]:
    """The W1 model folder and Parquet in args.work. saved_weights: the folder gets weights (for
    LoRA to adapt); otherwise a config only (the runs draw them with model.random_init)."""
    model_dir, parquet = os.path.join(args.work, "model"), os.path.join(args.work, "train.parquet")
    shutil.rmtree(model_dir, ignore_errors=True)  # written anew: nothing of another shape's folder is left
    os.makedirs(model_dir)
    if saved_weights:
        # the weights W1 draws (seed 0, fp32, as bench.trl_w1 builds them), saved for LoRA to adapt
        build_model(model_config(tiny=args.tiny), "cpu").save_pretrained(model_dir)
    else:
        model_config(tiny=args.tiny).save_pretrained(model_dir)
    load_tokenizer(args.tokenizer).save_pretrained(model_dir)
    write_parquet(load_rows(args.data, args.rows), parquet)
    return model_dir, parquet


def apply_tiny(args, steps: int, warmup: int) -> None:
    """Fills --steps/--warmup (the workload's, or a few for --tiny) and puts TINY before the user's overrides."""
    args.steps = args.steps or (4 if args.tiny else steps)
    args.warmup = args.warmup or (1 if args.tiny else warmup)
    if args.tiny:
        args.rows = args.rows or 64
        args.override = [*TINY, *args.override]


def require_one_epoch(args, parquet: str, overrides: list[str]) -> None:
    """sfttrain would start a second epoch where the data runs out: refused, W1 is distinct samples."""
    batch = OmegaConf.merge(OmegaConf.load(RECIPE), OmegaConf.from_dotlist(overrides)).data.train_batch_size
    require_samples(pq.ParquetFile(parquet).metadata.num_rows, args.steps, batch, args.data)


def run_variant(name: str, args, model_dir: str, parquet: str, variant: list[str] | None = None,
                timeout: float | None = None, tree: str = REPO) -> dict:
    """Runs the recipe with the variant's overrides (default VARIANTS[name]) and summarises it; a run
    past `timeout` seconds is killed (subprocess.TimeoutExpired). `tree`: the checkout whose sfttrain
    runs (`python -m` imports the package of the folder it starts in)."""
    run_dir = os.path.join(args.work, "runs", name if tree == REPO else f"{name}@baseline")
    variant = VARIANTS[name] if variant is None else variant
    overrides = [f"model.partial_pretrain={model_dir}", f"data.train_files={parquet}",
                 f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable",
                 f"trainer.total_training_steps={args.steps}",
                 f"trainer.device={args.device}", *variant, *args.override]
    require_one_epoch(args, parquet, overrides)
    cmd = [sys.executable, "-m", "sfttrain.run", RECIPE, *overrides]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=timeout, cwd=tree)
    return summarise(name, args, run_dir, variant)


def summarise(name: str, args, run_dir: str, variant: list[str]) -> dict:
    """The record of a run's timed steps (args.warmup + 1 .. args.steps), from its metrics.jsonl."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if "loss" in m and args.warmup < m["step"] <= args.steps]
    times = [m["step_time_s"] for m in steps]
    seconds = sum(times)
    real = sum(m["tokens"] for m in steps)
    return {
        "system": "sfttrain", "variant": name, "overrides": variant + args.override,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "gpus": 1,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "timed_steps": f"{args.warmup + 1}-{args.steps}", "real_tokens": real,
        "real_tokens_per_s": round(real / seconds, 1),
        "supervised_tokens_per_s": round(sum(m["loss_tokens"] for m in steps) / seconds, 1),
        "mean_s_per_step": round(seconds / len(times), 4), "median_s_per_step": round(statistics.median(times), 4),
        # a step of the window over twice the median (a recompilation, say) counts in the window's figures;
        # named here so that a mean far from the median explains itself
        "slow_steps": {m["step"]: round(m["step_time_s"], 3) for m in steps
                       if m["step_time_s"] > 2 * statistics.median(times)},
        "peak_allocated_gib": round(max(m.get("mem_peak_alloc_gib", 0) for m in steps), 2),
        "peak_reserved_gib": round(max(m.get("mem_peak_reserved_gib", 0) for m in steps), 2),
        # per-step MFU weighted by step time = MFU of the whole timed window
        "mfu": timed_mfu(steps),
        "data_wait_s_per_step": round(sum(m["data_wait_s"] for m in steps) / len(steps), 5),
        "mfu_formula": MFU_FORMULA,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sfttrain_args(p, work="/tmp/sfttrain_w1")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--variant", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--steps", type=int, help="optimizer steps in all (default 60; --tiny: 4)")
    p.add_argument("--warmup", type=int, help="untimed steps at the start (default 10; --tiny: 1)")
    p.add_argument("--run_timeout", type=float, help="seconds one variant may take, start-up included; past them it "
                   "is stopped, recorded as such, and the next variant runs")
    p.add_argument("--tiny", action="store_true",
                   help="smoke run: tiny model, 4 sequences a step (use with --device cpu)")
    p.add_argument("--baseline_tree", help="another checkout: each variant runs with its sfttrain first, then with "
                   "this one's, in the same call (see above)")
    args = p.parse_args()
    apply_tiny(args, steps=60, warmup=10)
    args.work = os.path.abspath(args.work)  # the runs of --baseline_tree start in that checkout
    trees = [os.path.abspath(args.baseline_tree), REPO] if args.baseline_tree else [REPO]
    model_dir, parquet = prepare(args, saved_weights=any(name.startswith("lora") for name in args.variant))
    for name in args.variant:
        for tree in trees:
            code = {"code": {"tree": tree, "commit": commit_of(tree)}}  # the checkout whose sfttrain ran
            try:
                emit({**run_variant(name, args, model_dir, parquet, timeout=args.run_timeout, tree=tree), **code},
                     args.out)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
                # the other variants still run; the failure is recorded
                failure = ({"rc": e.returncode} if isinstance(e, subprocess.CalledProcessError)
                           else {"timeout_s": args.run_timeout})
                emit({"system": "sfttrain", "variant": name, "overrides": VARIANTS[name] + args.override, **failure,
                      **code}, args.out)


if __name__ == "__main__":
    main()
