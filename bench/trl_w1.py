"""TRL's SFTTrainer on W1, one GPU, configured as a user would.

The dataset is TRL's conversational prompt-completion format (a user message as ``prompt``, an
assistant message as ``completion``), so TRL renders the chat template and masks the prompt itself
(``completion_only_loss=True``). Note that the template ends the assistant turn with
``<|im_end|>\\n``: TRL trains on one token per sample more than W1 (the ``\\n``); the token counts
below are those TRL actually fed the model. Otherwise TRL's defaults: fp32 weights + bf16
autocast (``bf16=True``), AdamW (its default fused torch AdamW), linear decay, grad-norm clip 1.0,
shuffled order, its fused chunked LM-head loss. SDPA attention, 16 x 4 sequences per step,
lr 1e-5, max_length 1024.

Counting: a forward pre-hook on the model records, for every micro-batch of the timed steps, the
real length of each sample (attention mask, or the padding-free sequence boundaries) and the
number of labelled tokens, as tensors read only after training.

    python3 -m bench.trl_w1 --data DATA.jsonl --tokenizer DIR --out RESULTS.jsonl \\
        [--gradient_checkpointing {on,off}] [--liger {on,off}] [--padding_free] [--peft | --qlora] \\
        [--device cpu --tiny] [--model_dir DIR] [--deadline SECONDS]

--peft trains LoRA adapters through TRL's own peft integration (``SFTTrainer(peft_config=...)``)
with the seed article's settings, the same as sfttrain's LoRA variant (`LORA` below); the base
stays as built here (fp32 weights, bf16 autocast), as TRL does it by default. --qlora is --peft over
the --model_dir base loaded in 4 bits through bitsandbytes (QLoRA: NF4, no double quantization, bf16
compute), which TRL prepares for k-bit training itself; on a CUDA GPU only (bitsandbytes' CUDA kernels).

--model_dir trains a saved model folder (bench.lora_w2b's, bench.moe_w4's) instead of building W1's.
--deadline bounds the run for a caller with a time budget (bench.moe_w4): past it, training stops at
the end of the next optimizer step once a step has been timed, and the record times the steps up
to there. A run that runs out of GPU memory writes a record saying so (``"status": "oom"``) instead
of results: for a model that does not fit, that is the result.
"""

import argparse
import importlib.metadata
import tempfile
import time

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import SFTConfig, SFTTrainer

from bench.common import (StepClock, TokenLedger, add_common_args, apply_tiny, emit, memory_gib, require_qlora_device,
                          require_samples, result)
from bench.w1_data import build_model, load_rows, load_tokenizer, model_config


# the seed article's LoRA keys (model.lora_rank=64 lora_alpha=32 target_modules=all-linear)
LORA = dict(r=64, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)


def peft_config(enabled: bool):
    if not enabled:
        return None
    from peft import LoraConfig

    return LoraConfig(**LORA, bias="none", task_type="CAUSAL_LM")


def prompt_completion(rows: list[dict]) -> Dataset:
    return Dataset.from_list([
        {"prompt": [{"role": "user", "content": r["question"]}],
         "completion": [{"role": "assistant", "content": r["answer"]}]}
        for r in rows
    ])


def sft_config(args: argparse.Namespace, output_dir: str) -> SFTConfig:
    return SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        max_steps=args.steps,
        # TRL refuses padding_free without packing when max_length is set, since it would not
        # truncate: W1's longest sample is 566 tokens, far below 1024, so None changes nothing
        max_length=None if args.padding_free else args.max_length,
        padding_free=args.padding_free,
        completion_only_loss=True,
        # no router load-balancing loss, as the workloads define it (W4: output_router_logits=false) and
        # sfttrain runs them: TRL 1.16 would add it to any MoE model whose config has a coefficient,
        # whatever output_router_logits says; a dense model has none either way
        router_aux_loss_coef=0.0,
        bf16=True,
        gradient_checkpointing=args.gradient_checkpointing == "on",
        use_liger_kernel=args.liger == "on",
        use_cpu=args.device == "cpu",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,  # a progress bar per step would flood the log; no effect on speed
    )


class Timing(TrainerCallback):
    """Reads the clock at the end of every optimizer step (the clock synchronizes first); past
    ``deadline`` (time.monotonic(); None: none), ends training and the timed window at the first
    step end after a timed step."""

    def __init__(self, clock: StepClock, ledger: TokenLedger, deadline: float | None = None):
        self.clock, self.ledger, self.deadline = clock, ledger, deadline
        self.stopped_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        self.clock.step_end(step)
        past = self.deadline is not None and time.monotonic() > self.deadline
        if past and self.clock.warmup < step < self.clock.steps:
            self.clock.end_at(step)
            self.ledger.end_at(step)
            self.stopped_at = step
            control.should_training_stop = True


def load_model(model_dir: str, device: str, peft: bool, qlora: bool = False):
    """A saved model as a user loads it, SDPA, no KV cache: LoRA's frozen base straight in bf16 (QLoRA:
    in NF4, quantized as it loads); for full fine-tuning fp32 weights (trained under bf16 autocast),
    which is also what TRL itself loads a model path in (its default dtype) and what sfttrain keeps as
    master weights."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = torch.bfloat16 if peft or qlora else torch.float32
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
                               bnb_4bit_compute_dtype=torch.bfloat16) if qlora else None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa", device_map=device,
                                                 quantization_config=quant)
    model.config.use_cache = False
    return model


def count_tokens(trainer: SFTTrainer, ledger: TokenLedger):
    """Forward pre-hook recording each micro-batch the model receives into ``ledger``.

    During the forwards of optimizer step k, ``trainer.state.global_step`` is still k - 1.
    """

    def hook(module, args, kwargs):
        if "attention_mask" in kwargs:  # right-padded batch
            lengths = kwargs["attention_mask"].sum(dim=1)
        else:  # padding-free: one row, samples delimited by cu_seq_lens_q
            lengths = kwargs["cu_seq_lens_q"].diff()
        ledger.add(trainer.state.global_step + 1, lengths, (kwargs["labels"] != -100).sum())

    return trainer.model.register_forward_pre_hook(hook, with_kwargs=True)


def train(trainer: SFTTrainer, args: argparse.Namespace, variant: dict) -> bool:
    """``trainer.train()``; False, with a record saying so in --out, where it ran out of GPU memory."""
    try:
        trainer.train()
    except torch.OutOfMemoryError as e:
        emit({"system": "trl", **variant, "status": "oom", "step": trainer.state.global_step + 1,
              **memory_gib(args.device), "error": str(e).splitlines()[0]}, args.out)
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--liger", choices=["on", "off"], default="off", help="use_liger_kernel=True (needs CUDA)")
    parser.add_argument("--padding_free", action="store_true", help="TRL's padding_free=True (no packing)")
    parser.add_argument("--peft", action="store_true", help="LoRA (r 64, alpha 32, all-linear) through peft")
    parser.add_argument("--qlora", action="store_true", help="--peft over the --model_dir base in 4-bit NF4 "
                        "(bitsandbytes, CUDA only)")
    parser.add_argument("--model_dir", help="train this saved model (e.g. bench.lora_w2b's; loaded in bf16 with "
                        "--peft, else in fp32) instead of building W1's")
    parser.add_argument("--deadline", type=float, help="seconds after start-up past which training stops at the next "
                        "step end once a step has been timed (the record times the steps up to there)")
    args = parser.parse_args()
    if args.qlora:
        if not args.model_dir:
            parser.error("--qlora quantizes a saved base as it loads: pass --model_dir")
        require_qlora_device(args.device)
        args.peft = True
    deadline = None if args.deadline is None else time.monotonic() + args.deadline
    apply_tiny(args)

    rows = load_rows(args.data, args.rows)
    require_samples(len(rows), args.steps, args.micro_batch * args.grad_accum, args.data)
    tokenizer = load_tokenizer(args.tokenizer)
    precision = "fp32 weights + bf16 autocast"
    if args.model_dir and args.peft:
        precision = "nf4 base (bitsandbytes), bf16 compute" if args.qlora else "bf16 weights"
    variant = dict(trl_liger=args.liger, trl_padding_free=args.padding_free, peft=LORA if args.peft else None,
                   model_dir=args.model_dir, precision=precision,
                   **({"bitsandbytes": importlib.metadata.version("bitsandbytes")} if args.qlora else {}))
    if args.model_dir:
        model = load_model(args.model_dir, args.device, args.peft, args.qlora)
    else:
        model = build_model(model_config(args.tiny), args.device)
    clock, ledger = StepClock(args.device, args.warmup, args.steps), TokenLedger(args.warmup, args.steps)
    timing = Timing(clock, ledger, deadline)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = SFTTrainer(
            model=model,
            args=sft_config(args, output_dir),
            train_dataset=prompt_completion(rows),
            processing_class=tokenizer,
            callbacks=[timing],
            peft_config=peft_config(args.peft),
        )
        count_tokens(trainer, ledger)
        if not train(trainer, args, variant):
            return
    emit(result("trl", args, trainer.model, clock, ledger, **variant, stopped_by_deadline_at=timing.stopped_at),
         args.out)


if __name__ == "__main__":
    main()
