"""Issue 60.3: the loss of LoRA over a quantized frozen base (model.base_quant=nf4, fp8) against the
same run over the unquantized base, same data, seed and adapters' init; every run sfttrain as a user
runs it (`python -m sfttrain.run`, logging every step).

One record per base: the loss at each step and at step --steps, and for each quantized base its
relative difference to none's at step --steps and over the mean of the last 10 steps. Both runs
train on the same batches, but how far their losses lie apart still varies from batch to batch: a
single step's difference is the issue's figure, the 10-step mean the one that says more.

    # the issue's measurement: W2b (random weights drawn from seed 0 and saved, as bench.lora_w2b does),
    # W2b's LoRA settings, the base in bf16 (NF4 dequantizes to bf16); 60 x 128 sequences start GSM8K's
    # second epoch, in the same order for each base. A later call adds a base against none's record:
    python3 -m bench.base_quant_loss --out r.jsonl --device cuda --bases none nf4
    python3 -m bench.base_quant_loss --out r.jsonl --device cuda --bases fp8
    # a real pretrained model on a CPU (fp32 base and compute, as recipes/demo_cpu.yaml; fp8 refused there)
    python3 -m bench.base_quant_loss --out r.jsonl --device cpu --model ../shared/assets/models/stories260K
"""

import argparse
import os
import statistics

from bench.common import LORA, add_sfttrain_args, emit, save_model, w2b_config
from bench.fp8_w2b import run
from bench.jobs import read_jsonl
from bench.lora_w2b import SFTTRAIN
from bench.w1_data import load_rows, load_tokenizer, write_parquet

# a CPU run of a small pretrained Llama (no chat template, 512-token context), fp32 as the CPU demo, with a
# learning rate at which its loss moves within a few dozen steps
CPU = [*LORA, "model.compile=false", "model.fsdp_config.mixed_precision=false", "data.apply_chat_template=false",
       "data.max_length=512", "data.truncation=left", "data.train_batch_size=16", "optim.lr=3e-3"]
LAST = 10  # steps of the mean


def record(run_record: dict, metrics: str, none: dict | None, steps: int) -> dict:
    """A trained run's losses and, against the unquantized base's, their relative differences."""
    losses = {m["step"]: m["loss"] for m in read_jsonl(metrics) if "loss" in m and m["step"] <= steps}
    out = {**run_record, "loss_by_step": losses,
           "loss_mean_last": statistics.fmean(losses[s] for s in range(max(steps - LAST, 0) + 1, steps + 1))}
    if none is not None:
        out["rel_diff_last_step"] = round(out["loss_last_step"] / none["loss_last_step"] - 1, 5)
        out["rel_diff_mean_last"] = round(out["loss_mean_last"] / none["loss_mean_last"] - 1, 5)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sfttrain_args(p, work="/tmp/sfttrain_base_quant")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", help="a model folder to adapt (default: W2b's, drawn and saved in --work)")
    p.add_argument("--bases", nargs="*", default=["none", "nf4"], choices=["none", "nf4", "fp8"],
                   help="model.base_quant values, none (the reference) first")
    p.add_argument("--steps", type=int, default=60, help="the step whose loss is compared")
    p.add_argument("--run_timeout", type=float, default=570, help="seconds one run may take, start-up included")
    args = p.parse_args()
    if args.steps < 2:
        p.error("--steps is at least 2")
    os.makedirs(args.work, exist_ok=True)
    parquet = os.path.join(args.work, "train.parquet")
    write_parquet(load_rows(args.data, args.rows), parquet)
    if args.model is None:
        tokenizer = load_tokenizer(args.tokenizer)
        args.model = save_model(args.work, w2b_config(tokenizer), tokenizer, args.device)
    overrides = SFTTRAIN if args.device == "cuda" else CPU
    none = next((r for r in read_jsonl(args.out) if r.get("bench") == "base_quant_loss" and r["base_quant"] == "none"
                 and r["model"] == args.model and r.get("last_step") == args.steps), None)
    if "none" not in args.bases and none is None:
        p.error(f"no run over the unquantized base of {args.model} to {args.steps} steps in {args.out}: add none to "
                "--bases")
    for base in args.bases:
        name = f"base_quant_{base}"
        result = run(args, name, args.model, parquet, [*overrides, f"model.base_quant={base}"], args.steps,
                     max(args.steps - LAST, 1))
        result = {**result, "bench": "base_quant_loss", "base_quant": base, "model": args.model}
        if result["status"] == "trained":
            result = record(result, os.path.join(args.work, "runs", name, "metrics.jsonl"), none, args.steps)
            none = result if base == "none" else none
        emit(result, args.out)


if __name__ == "__main__":
    main()
