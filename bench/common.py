"""Timing and metrics shared by the W1 baselines, so that every system is measured one way.

The rules (docs/workloads.md): optimizer steps ``warmup + 1 .. steps`` (11 to 60) are
timed, the device synchronized before each clock read; a step's time runs from the clock read
after the previous optimizer step to the one after its own, so it includes everything the system
does in between (data loading, logging). Tokens are those of the samples the timed steps actually
trained on, counted from the batches the model received.
"""

import argparse
import dataclasses
import gc
import hashlib
import json
import os
import platform
import statistics
import time

import torch
import transformers
from transformers import AutoModelForCausalLM

from sfttrain.flops import ModelShape, mfu

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# the seed article's LoRA settings (its keys as sfttrain takes them), on weights loaded from the model
# folder, as a user's LoRA run adapts a saved model
LORA = ["model.random_init=false", "model.lora_rank=64", "model.lora_alpha=32", "model.target_modules=all-linear"]
# GSM8K's whole train file (7473 rows), where this checkout finds one (docs/workloads.md, "The data"):
# .bench_data/ on the GPU machines, the shared folder beside the checkouts here
FULL_GSM8K = (os.path.join(REPO, ".bench_data", "train.jsonl"), os.path.join(REPO, "..", "shared", "data", "gsm8k",
                                                                              "train.jsonl"))
SAMPLE_GSM8K = os.path.join(REPO, "assets", "data", "gsm8k", "train.jsonl")  # its first 2000 rows

# W2b: W2's Llama-3-8B shape with the Qwen2.5 tokenizer's vocabulary (8,224,247,808 parameters)
W2B_SHAPE = dict(vocab_size=151936, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
# what --tiny changes in a workload's shape: the vocabulary stays (the tokenizer's ids must fit),
# the rest is small enough for a CPU smoke run
TINY_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)

MFU_FORMULA = (
    "MFU = (6N + 6*L*H*Dh*sum(s_i^2)/sum(s_i)) * real_tokens_per_s / (989e12 * GPUs); "
    "N all parameters (tied embedding once; a mixture of experts: the non-expert parameters, shared experts "
    "included, + the routed experts' x top_k / num_experts), s_i the lengths of the samples of the timed steps; "
    "LoRA: 4 N_frozen + 6 N_adapters instead of 6N (no weight gradient for frozen weights)"
)


def default_data() -> str:
    """The full GSM8K train file where there is one, else the in-repo sample (enough for --tiny)."""
    return next((path for path in FULL_GSM8K if os.path.isfile(path)), SAMPLE_GSM8K)


def w2b_config(tokenizer, tiny: bool = False, **changes):
    """W2b's LlamaConfig (or its --tiny sibling) with the tokenizer's special-token ids."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**W2B_SHAPE, **(TINY_SIZES if tiny else {}), **changes}, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def model_folder(work: str, config) -> str:
    """A model's folder in --work, named by its config: a folder of another shape is never reused."""
    fields = {k: v for k, v in config.to_diff_dict().items() if k != "transformers_version"}
    return os.path.join(work, "model_" + hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12])


def save_model(work: str, config, tokenizer, device: str) -> str:
    """The model of ``config`` drawn after torch.manual_seed(0) directly on ``device`` in bf16 (no
    fp32 copy anywhere) and saved with the tokenizer as a model folder in ``work``, for the systems
    of one call to load the same weights; skipped if one of this shape is there (W2b: 16 GB)."""
    model_dir = model_folder(work, config)
    if os.path.isdir(model_dir):
        return model_dir
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    partial = model_dir + ".partial"  # renamed once complete: an interrupted save is never reused
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    del model
    gc.collect()
    if device == "cuda":  # the trainers run next, in processes of their own: hand the cached blocks back
        torch.cuda.empty_cache()
    os.replace(partial, model_dir)
    return model_dir


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Flags every W1 baseline takes; defaults are W1's."""
    parser.add_argument("--data", default=default_data(),
                        help="GSM8K train.jsonl: the full 7473 rows (W1 needs 60 x 64 = 3840 samples; default: "
                        "the full file where there is one, docs/workloads.md)")
    parser.add_argument("--tokenizer", default="assets/tokenizers/qwen2.5-instruct")
    parser.add_argument("--out", required=True, help="JSON lines file to append the result to")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true",
                        help="smoke mode: tiny model, first 64 rows, 2x2 sequences per step, 3 steps (1 warm-up), "
                        "max_length 256")
    parser.add_argument("--gradient_checkpointing", choices=["on", "off"], default="on")
    parser.add_argument("--micro_batch", type=int, default=16)
    parser.add_argument("--grad_accum", type=int, default=4)
    parser.add_argument("--max_length", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--rows", type=int, help="use only the first ROWS rows of --data (default all)")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps in all")
    parser.add_argument("--warmup", type=int, default=10, help="untimed optimizer steps at the start")


def apply_tiny(args: argparse.Namespace) -> None:
    """--tiny shrinks the run so that it finishes on a CPU in a few minutes (max_length too: the padded
    baseline pads every sequence to it, and the logits of 152k-token vocabulary rows are large). A warm-up
    step and a window of two timed ones, as the other scripts' --tiny runs have."""
    if args.tiny:
        args.micro_batch, args.grad_accum, args.steps, args.warmup = 2, 2, 3, 1
        args.rows = args.rows or 64
        args.max_length = min(args.max_length, 256)


def require_samples(available: int, steps: int, per_step: int, data: str) -> None:
    """The workloads train on distinct samples: a second epoch would not be the workload."""
    if available < steps * per_step:
        raise SystemExit(f"{steps} steps of {per_step} sequences need {steps * per_step} samples, {data} has "
                         f"{available}: pass GSM8K's full train file as --data (docs/workloads.md, \"The data\")")


def require_qlora_device(device: str) -> None:
    """TRL's QLoRA baseline (bench.trl_w1 --qlora, bench.lora_w2b's trl_qlora) is bitsandbytes' CUDA
    kernels, as its users run them: refused on a CPU before anything is drawn or trained."""
    if device != "cuda":
        raise SystemExit("TRL's QLoRA baseline needs a CUDA GPU: it measures bitsandbytes' CUDA kernels "
                         "(pass --device cuda, or leave trl_qlora out of --systems)")


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_calls(fn, reps: int, warmup: int = 3) -> tuple[float, float]:
    """(host, device) seconds per call of `fn` over `reps` calls after `warmup`: the host's clock while it
    queues them, and CUDA events around them (on a CPU the clock's again: the calls run as queued)."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps
    if not cuda:
        return host, host
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / 1e3 / reps


class StepClock:
    """Clock reads at the end of optimizer steps ``warmup`` .. ``steps``, device synchronized first."""

    def __init__(self, device: str, warmup: int, steps: int):
        if not 1 <= warmup < steps:
            raise ValueError(f"need 1 <= warmup < steps, got warmup={warmup}, steps={steps}")
        self.device, self.warmup, self.steps = device, warmup, steps
        self.marks: list[float] = []

    def step_end(self, step: int) -> None:
        """Call after optimizer step ``step`` (1-based) has been issued."""
        if self.warmup <= step <= self.steps:
            synchronize(self.device)
            self.marks.append(time.perf_counter())

    def end_at(self, step: int) -> None:
        """Training stopped after optimizer step ``step`` (a time budget ran out): the timed window ends there."""
        self.steps = step

    def step_times(self) -> list[float]:
        expected = self.steps - self.warmup
        times = [b - a for a, b in zip(self.marks, self.marks[1:])]
        if len(times) != expected:
            raise RuntimeError(f"timed {len(times)} steps, expected {expected}: did training stop early?")
        return times


class TokenLedger:
    """Lengths and supervised-token counts of the micro-batches of the timed steps.

    Kept as tensors on whatever device they come from and only read at the end, so counting adds
    no host-device sync inside the timed loop.
    """

    def __init__(self, warmup: int, steps: int):
        self.warmup, self.steps = warmup, steps
        self.lengths: list[torch.Tensor] = []  # real (non-pad) length of each sample
        self.supervised: list[torch.Tensor] = []  # tokens with a label, i.e. in the loss
        self.steps_seen: set[int] = set()

    def add(self, step: int, lengths: torch.Tensor, supervised: torch.Tensor) -> None:
        """Record one micro-batch of optimizer step ``step`` (1-based)."""
        if self.warmup < step <= self.steps:
            self.lengths.append(lengths.detach().flatten())
            self.supervised.append(supervised.detach().reshape(()))
            self.steps_seen.add(step)

    def end_at(self, step: int) -> None:
        """As StepClock.end_at: the timed steps end with optimizer step ``step``."""
        self.steps = step

    def totals(self) -> tuple[list[int], int]:
        """(sample lengths, supervised tokens) over the timed steps."""
        if len(self.steps_seen) != self.steps - self.warmup:
            raise RuntimeError(f"tokens seen in {len(self.steps_seen)} timed steps, "
                               f"expected {self.steps - self.warmup}")
        lengths = torch.cat([t.cpu() for t in self.lengths]).tolist()
        return lengths, int(sum(t.item() for t in self.supervised))


def memory_gib(device: str) -> dict:
    if device != "cuda":
        return {"peak_allocated_gib": None, "peak_reserved_gib": None}
    return {
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
    }


def model_shape(model: torch.nn.Module) -> ModelShape:
    """ModelShape.of, with bitsandbytes' 4-bit weights (TRL's QLoRA) counted at their shape: each
    packs two weights a byte, so its numel is half theirs."""
    shape = ModelShape.of(model)
    packed = sum(p.quant_state.shape.numel() - p.numel() for p in model.parameters()
                 if getattr(p, "quant_state", None) is not None)
    return dataclasses.replace(shape, num_params=shape.num_params + packed, active_params=shape.active_params + packed)


def result(system: str, args: argparse.Namespace, model: torch.nn.Module, clock: StepClock,
           ledger: TokenLedger, **variant) -> dict:
    """The benchmark record: throughput, step times, memory and MFU of the timed steps."""
    times = clock.step_times()
    lengths, supervised = ledger.totals()
    seconds = sum(times)
    tokens_per_s = sum(lengths) / seconds
    fpt = model_shape(model).flops_per_token(lengths)
    return {
        "system": system,
        **variant,
        "gradient_checkpointing": args.gradient_checkpointing,
        "tiny": args.tiny,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "gpus": 1,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "max_length": args.max_length,
        "timed_steps": f"{clock.warmup + 1}-{clock.steps}",
        "timed_samples": len(lengths),
        "real_tokens": sum(lengths),
        "supervised_tokens": supervised,
        "real_tokens_per_s": round(tokens_per_s, 1),
        "supervised_tokens_per_s": round(supervised / seconds, 1),
        "mean_s_per_step": round(seconds / len(times), 4),
        "median_s_per_step": round(statistics.median(times), 4),
        **memory_gib(args.device),
        "flops_per_token": round(fpt),
        "mfu": round(mfu(fpt, tokens_per_s, num_gpus=1), 4),
        "mfu_formula": MFU_FORMULA,
    }


def add_sfttrain_args(parser: argparse.ArgumentParser, work: str) -> None:
    """Flags of the benchmarks that run sfttrain itself as a user would (`python -m sfttrain.run`)."""
    parser.add_argument("--data", default=default_data(), help="GSM8K train.jsonl (default: the full file where "
                        "there is one, docs/workloads.md)")
    parser.add_argument("--tokenizer", default="assets/tokenizers/qwen2.5-instruct")
    parser.add_argument("--out", required=True, help="JSON lines file to append the results to")
    parser.add_argument("--work", default=work, help="model folder, Parquet and run folders")
    parser.add_argument("--rows", type=int)
    parser.add_argument("--override", nargs="*", default=[], help="extra key=value for every sfttrain run")


def timed_mfu(steps: list[dict]) -> float | None:
    """The MFU of sfttrain's timed steps (metrics.jsonl records), weighted by step time; None where
    sfttrain logs none (CPU, or a GPU without a known peak)."""
    if not steps or any("mfu" not in m for m in steps):
        return None
    return round(sum(m["mfu"] * m["step_time_s"] for m in steps) / sum(m["step_time_s"] for m in steps), 4)


def host() -> dict:
    """The host a record was taken on: host-bound steps (W1 with LoRA) move with its CPU and with what
    else runs there. The load average is the kernel's, so in a container it counts the neighbours too."""
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    return {"cpu": model, "cpus": os.cpu_count(), "load_avg_1min": round(os.getloadavg()[0], 2)}


def emit(record: dict, out: str) -> None:
    """Print the record, with its host (`host`), as one JSON line and append it to ``out``."""
    line = json.dumps({**record, "host": host()})
    print(line, flush=True)
    with open(out, "a", encoding="utf-8") as f:
        f.write(line + "\n")
