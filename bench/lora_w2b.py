"""W2b (docs/workloads.md, 8.2B parameters) with the seed article's LoRA settings on ONE
GPU: sfttrain, then TRL's SFTTrainer with peft on the same model and data, in one call.

The seed article claims LoRA + FSDP2 trains a 7B model in under 25 GB; this measures peak memory
and tokens/s for W2b's 8.2B model. The model is drawn once (torch.manual_seed(0)) directly on the
GPU in bf16 and saved as a model folder (16.4 GB; no fp32 copy anywhere): LoRA adapts saved
weights, and both systems load the folder as a user would (sfttrain: frozen base straight in bf16,
fp32 adapters; TRL: `from_pretrained(dtype=bfloat16)` with `peft_config`). Data: W1's rows,
max_length 4096, 128 sequences per optimizer step; gradient checkpointing on (the article's).
Fewer steps than W2's 11-30 so that one call fits in 8 minutes; say so beside the numbers.

QLoRA (issue 60): sfttrain_nf4 and sfttrain_fp8 are sfttrain's run with the frozen base quantized as it
loads (model.base_quant=nf4 | fp8); trl_qlora is TRL + peft over the base loaded in 4-bit NF4 through
bitsandbytes (bench.trl_w1 --qlora: no double quantization, bf16 compute), CUDA only.

    python3 -m bench.lora_w2b --out results.jsonl [--data train.jsonl] \\
        [--systems sfttrain sfttrain_nf4 sfttrain_fp8 trl trl_qlora] [--steps 16 --warmup 5] \\
        [--trl_steps 8 --trl_warmup 3] [--run_timeout SECONDS] [--device cpu --tiny]

The model folder in --work is named by its shape (a --tiny run and a full one never share one); a
run that would train a second epoch of --data is refused.
"""

import argparse
import os
import subprocess
import sys

from bench.common import LORA, add_sfttrain_args, emit, require_qlora_device, save_model, w2b_config
from bench.sfttrain_w1 import apply_tiny, require_one_epoch, run_variant
from bench.w1_data import load_rows, load_tokenizer, write_parquet

SFTTRAIN = ["model.enable_gradient_checkpointing=true", "data.max_length=4096",
            "data.train_batch_size=128", "data.max_token_len_per_gpu=8192", *LORA]
# sfttrain's systems: the frozen base as saved (bf16) or quantized as it loads
BASES = {"sfttrain": [], "sfttrain_nf4": ["model.base_quant=nf4"], "sfttrain_fp8": ["model.base_quant=fp8"]}


def run_sfttrain(args, model_dir: str, parquet: str, system: str) -> dict:
    """The run's record, named lora_w2b, lora_w2b_nf4 or lora_w2b_fp8."""
    return run_variant("lora_w2b" + system.removeprefix("sfttrain"), args, model_dir, parquet,
                       [*SFTTRAIN, *BASES[system]], timeout=args.run_timeout)


def run_trl(args, model_dir: str, qlora: bool) -> None:
    """bench.trl_w1 on the saved model with --peft (or --qlora): 16 x 8 sequences per step, max_length 4096."""
    cmd = [sys.executable, "-m", "bench.trl_w1", "--data", args.data, "--tokenizer", args.tokenizer, "--out", args.out,
           "--device", args.device, "--model_dir", model_dir, "--qlora" if qlora else "--peft",
           "--gradient_checkpointing", "on",
           "--max_length", "4096", "--steps", str(args.trl_steps), "--warmup", str(args.trl_warmup),
           *(["--tiny"] if args.tiny else ["--micro_batch", "16", "--grad_accum", "8"])]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=args.run_timeout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sfttrain_args(p, work="/tmp/sfttrain_w2b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--systems", nargs="*", default=["sfttrain", "trl"], choices=[*BASES, "trl", "trl_qlora"])
    p.add_argument("--steps", type=int, help="sfttrain's optimizer steps in all (default 16; --tiny: 4)")
    p.add_argument("--warmup", type=int, help="sfttrain's untimed steps (default 5; --tiny: 1)")
    p.add_argument("--trl_steps", type=int, default=8)
    p.add_argument("--trl_warmup", type=int, default=3)
    p.add_argument("--run_timeout", type=float, help="seconds each system may take (start-up included); one "
                   "killed at it, or failing, is recorded as failed and the next one runs")
    p.add_argument("--tiny", action="store_true",
                   help="smoke run: tiny model, 4 sequences a step (use with --device cpu)")
    args = p.parse_args()
    if "trl_qlora" in args.systems:  # before anything is drawn or trained
        require_qlora_device(args.device)
    apply_tiny(args, steps=16, warmup=5)
    os.makedirs(args.work, exist_ok=True)
    parquet = os.path.join(args.work, "train.parquet")
    write_parquet(load_rows(args.data, args.rows), parquet)
    if set(BASES) & set(args.systems):  # before the model is drawn
        require_one_epoch(args, parquet, [*SFTTRAIN, *args.override])
    tokenizer = load_tokenizer(args.tokenizer)
    model_dir = save_model(args.work, w2b_config(tokenizer, tiny=args.tiny), tokenizer, args.device)
    for system in args.systems:
        try:
            if system in BASES:
                emit(run_sfttrain(args, model_dir, parquet, system), args.out)
            else:
                run_trl(args, model_dir, qlora=system == "trl_qlora")
        except subprocess.CalledProcessError as e:
            emit({"system": system, "status": "failed", "rc": e.returncode}, args.out)
        except subprocess.TimeoutExpired as e:
            emit({"system": system, "status": "failed", "error": f"killed at {e.timeout:.0f} s"}, args.out)


if __name__ == "__main__":
    main()
