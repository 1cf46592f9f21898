"""Pad-to-max-length baseline on W1: what verl's legacy SFT trainer does by default.

A plain PyTorch loop on one GPU. Every sequence is right-padded to max_length (1024) and masked
with an attention mask (so SDPA cannot take its flash path). Precision as verl's default FSDP
mixed precision: fp32 weights, gradients and AdamW state, bf16 compute (here ``torch.autocast``).
16 sequences per micro-batch x 4 accumulation, AdamW lr 1e-5 constant, weight decay 0.01 and
grad-norm clip 1.0 as verl's defaults. Loss: response-token cross-entropy summed over the step,
divided by the step's response tokens. Samples in a seeded random order (verl shuffles too).

    python3 -m bench.padded_w1 --data DATA.jsonl --tokenizer DIR --out RESULTS.jsonl \\
        [--gradient_checkpointing off] [--device cpu --tiny]
"""

import argparse

import torch
import torch.nn.functional as F

from bench.common import StepClock, TokenLedger, add_common_args, apply_tiny, emit, require_samples, result
from bench.w1_data import Sample, build_model, load_w1, model_config


def step_batches(samples: list[Sample], args: argparse.Namespace):
    """Yield, per optimizer step, its ``grad_accum`` micro-batches of ``micro_batch`` samples."""
    per_step = args.micro_batch * args.grad_accum
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0)).tolist()
    for step in range(args.steps):
        chosen = [samples[i] for i in order[step * per_step:(step + 1) * per_step]]
        yield [chosen[i:i + args.micro_batch] for i in range(0, per_step, args.micro_batch)]


def collate(batch: list[Sample], max_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad every sample to max_length: pad tokens get attention 0 and label -100."""
    input_ids = torch.full((len(batch), max_length), pad_id)
    attention_mask = torch.zeros((len(batch), max_length), dtype=torch.long)
    labels = torch.full((len(batch), max_length), -100)
    for row, s in enumerate(batch):
        n = len(s.input_ids)
        input_ids[row, :n] = torch.tensor(s.input_ids)
        attention_mask[row, :n] = 1
        labels[row, :n] = torch.tensor(s.labels)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def train_step(model, optimizer, micro_batches: list[list[Sample]], args, pad_id: int) -> None:
    # the step's response-token count is known on the host: normalising by it needs no sync
    supervised = sum(s.supervised for batch in micro_batches for s in batch)
    for batch in micro_batches:
        inputs = {k: v.to(args.device) for k, v in collate(batch, args.max_length, pad_id).items()}
        with torch.autocast(args.device, dtype=torch.bfloat16):
            logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
            # token at t predicts t + 1; autocast runs the cross-entropy in fp32, as verl's does
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), inputs["labels"][:, 1:].flatten(),
                                   ignore_index=-100, reduction="sum") / supervised
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    args = parser.parse_args()
    apply_tiny(args)

    tokenizer, _, samples = load_w1(args.data, args.tokenizer, args.max_length, args.rows)
    require_samples(len(samples), args.steps, args.micro_batch * args.grad_accum, args.data)
    model = build_model(model_config(args.tiny), args.device)
    if args.gradient_checkpointing == "on":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as verl
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    clock, ledger = StepClock(args.device, args.warmup, args.steps), TokenLedger(args.warmup, args.steps)
    for step, micro_batches in enumerate(step_batches(samples, args), start=1):
        train_step(model, optimizer, micro_batches, args, tokenizer.pad_token_id)
        for batch in micro_batches:
            ledger.add(step, torch.tensor([len(s.input_ids) for s in batch]),
                       torch.tensor(sum(s.supervised for s in batch)))
        clock.step_end(step)
    emit(result("padded", args, model, clock, ledger, precision="fp32 weights + bf16 autocast"), args.out)


if __name__ == "__main__":
    main()
