"""What a run computes, against references computed another way: plain peft + transformers + torch
loops written here (none of sfttrain's functions), on the same rows of the real stories260K model.

One job serves the tests here (`lora_run`): LoRA with peft's defaults (all-linear targets,
lora_dropout=0), 2 FSDP ranks, 4 unshuffled steps of 4 rows through a 2-step warmup and the cosine
(LRs 0.5, 1, 1, 0.55 x optim.lr: each part of the schedule, min_lr_ratio included),
weight decay and clipping, and a validation set of 13 rows (6 and 7 a rank, micro-batches of 2: neither
divides) whose answers alternate between a few words and a whole solution.
"""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import BASE_OVERRIDES, STORIES, load_checkpoint_model, read_metrics, run_sfttrain

STEPS, BATCH, VAL_ROWS = 4, 4, 13
LR, WARMUP, MIN_LR, WD, EPS, CLIP = 0.1, 2, 0.1, 0.01, 1.0, 1.0
LORA = dict(r=8, lora_alpha=16)


def _val_rows(gsm8k_val: Path) -> list[dict]:
    """13 rows: the even ones' answers cut to their first three words (a handful of supervised tokens,
    against a hundred or more of the odd ones')."""
    rows = pq.read_table(gsm8k_val).to_pylist()[:VAL_ROWS]
    return [{**r, "answer": " ".join(r["answer"].split()[:3])} if i % 2 == 0 else r for i, r in enumerate(rows)]


@pytest.fixture(scope="module")
def lora_run(gsm8k_head, gsm8k_val, tmp_path_factory) -> tuple[Path, list[dict], str]:
    import pyarrow as pa

    out = tmp_path_factory.mktemp("reference_loops")
    val = _val_rows(gsm8k_val)
    pq.write_table(pa.Table.from_pylist(val), out / "val.parquet")
    run_dir = out / "run"
    proc = run_sfttrain(2, _job(gsm8k_head, out / "val.parquet", run_dir))
    return run_dir, val, proc.stdout


def _job(train: Path, val: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*BASE_OVERRIDES, f"data.train_files={train}", f"data.val_files={val}",
            f"trainer.default_local_dir={run_dir}",
            f"data.train_batch_size={BATCH}", "data.micro_batch_size_per_gpu=2", "data.max_length=2048",
            "data.truncation=error", "data.allow_beyond_max_position=true", f"trainer.total_training_steps={STEPS}",
            "trainer.save_freq=1", f"model.lora_rank={LORA['r']}", f"model.lora_alpha={LORA['lora_alpha']}",
            f"optim.lr={LR}", f"optim.eps={EPS}", f"optim.weight_decay={WD}", f"optim.clip_grad={CLIP}",
            "optim.lr_scheduler=cosine", f"optim.lr_warmup_steps={WARMUP}", f"optim.min_lr_ratio={MIN_LR}", *extra]


def _example(tok, row: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels) of a row as the parity test in tests/test_trainer.py builds them: the
    prompt with BOS, the answer and EOS supervised."""
    prompt = tok(row["question"])["input_ids"]
    response = tok(row["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return torch.tensor([prompt + response]), torch.tensor([[-100] * len(prompt) + response])


def _token_loss_sum(model, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy of the supervised next tokens, one row, unpacked; and their count."""
    logits = model(input_ids=ids).logits[0, :-1].float()
    target = labels[0, 1:]
    loss_sum = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
    return loss_sum, int((target != -100).sum())


def _lr(step: int) -> float:
    """0-based step's LR: linear warmup reaching LR at its last step (sfttrain's documented choice; verl's and
    transformers' schedulers are this formula at step + 1 during the warmup, 0 at the first step), then the cosine
    of transformers' get_cosine_with_min_lr_schedule_with_warmup (min_lr_rate)."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / (STEPS - WARMUP)
    return LR * (MIN_LR + (1 - MIN_LR) * 0.5 * (1 + math.cos(math.pi * progress)))


def _peft_model(adapters: dict[str, torch.Tensor]):
    """stories260K with peft's LoRA (its defaults: every linear layer but lm_head, no dropout), the
    adapters set to `adapters` (checkpoint names, without peft's 'base_model.model.' prefix)."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(STORIES, attn_implementation="eager", torch_dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(**LORA, lora_dropout=0.0, target_modules="all-linear", bias="none",
                                            task_type="CAUSAL_LM"))
    params = dict(model.named_parameters())
    names = {n.removeprefix("base_model.model."): n for n, p in params.items() if p.requires_grad}
    assert set(names) == set(adapters), sorted(set(names) ^ set(adapters))[:6]
    with torch.no_grad():
        for name, value in adapters.items():
            params[names[name]].copy_(value)
    return model, names


def test_lora_matches_a_plain_peft_loop(lora_run, gsm8k_head):
    """Reference: peft's LoRA on the transformers model, each row unpacked, loss = the step's summed token
    losses / their count over the whole step (HF's num_items_in_batch), torch's clip_grad_norm_ and AdamW
    (decay on every adapter: all are matrices) at the LR of `_lr`. The start adapters are the run's: lora_B
    starts at zero, so step 1 leaves lora_A where it was but for the decay (A1 = A0 (1 - lr wd), exact to a
    rounding). fp32 throughout; two ranks against one process sum in another order (~1e-6 relative per
    gradient, passed on unamplified by eps=1 above every |g| <= 1): losses, grad norms and LRs agree to
    1e-5 relative and adapters to 1e-4 of the update, where a wrong normaliser, scaling, decay or LR is
    off by > 1e-2."""
    run_dir, _, _ = lora_run
    tok = AutoTokenizer.from_pretrained(STORIES)
    one = load_checkpoint_model(run_dir / "global_step_1")
    start = {k: (v / (1 - _lr(0) * WD) if ".lora_A." in k else torch.zeros_like(v)) for k, v in one.items()}
    model, names = _peft_model(start)
    params = dict(model.named_parameters())
    adapters = [params[names[k]] for k in sorted(names)]
    opt = torch.optim.AdamW(adapters, lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=WD, foreach=False)
    rows = pq.read_table(gsm8k_head).to_pylist()
    ref = []
    for step in range(STEPS):
        examples = [_example(tok, r) for r in rows[step * BATCH:(step + 1) * BATCH]]
        n_tokens = sum(int((labels[0, 1:] != -100).sum()) for _, labels in examples)
        total = 0.0
        for ids, labels in examples:
            loss_sum, _ = _token_loss_sum(model, ids, labels)
            (loss_sum / n_tokens).backward()
            total += loss_sum.item()
        norm = torch.nn.utils.clip_grad_norm_(adapters, CLIP).item()
        for group in opt.param_groups:
            group["lr"] = _lr(step)
        opt.step()
        opt.zero_grad()
        ref.append({"loss": total / n_tokens, "grad_norm": norm, "lr": _lr(step)})
    logged = [{k: m[k] for k in ("loss", "grad_norm", "lr")} for m in read_metrics(run_dir) if "loss" in m]
    assert len(logged) == STEPS
    for got, want in zip(logged, ref):
        assert got == pytest.approx(want, rel=1e-5)
    trained = load_checkpoint_model(run_dir / f"global_step_{STEPS}")
    diff = sum((trained[k].double() - params[names[k]].detach().double()).norm() ** 2 for k in names).sqrt()
    update = sum((params[names[k]].detach().double() - start[k].double()).norm() ** 2 for k in names).sqrt()
    assert update > 0 and diff / update < 1e-4, (diff / update).item()


def test_validation_loss_counts_every_row_once(lora_run):
    """val/loss is the token-weighted loss of the whole validation set: every row once, whatever the ranks'
    shares and micro-batches (13 rows: 6 and 7 a rank, 3 and 4 micro-batches of 2), rows with few supervised
    tokens weighing little. Reference: a plain loop over the 13 rows on the final adapters loaded into peft,
    sum of token losses / sum of tokens. fp32, another summation order (packed rows, two ranks): 1e-5
    relative; the classic bug, a rank's share evened out by repeating a row (one of the short ones), moved it
    by 1.5e-3 relative, 150x the tolerance."""
    run_dir, val, _ = lora_run
    model, _ = _peft_model(load_checkpoint_model(run_dir / f"global_step_{STEPS}"))
    logged = [m["val/loss"] for m in read_metrics(run_dir) if "val/loss" in m]
    assert logged == [pytest.approx(reference_val_loss(model, val), rel=1e-5)]


def reference_val_loss(model, val: list[dict]) -> float:
    """The token-weighted loss of the rows `val`, one row at a time (sum of token losses / sum of tokens)."""
    tok = AutoTokenizer.from_pretrained(STORIES)
    model.eval()
    sums, counts = [], []
    with torch.no_grad():
        for row in val:
            loss_sum, n = _token_loss_sum(model, *_example(tok, row))
            sums.append(loss_sum.item())
            counts.append(n)
    assert max(counts) > 10 * min(counts)  # rows of very different weight
    return sum(sums) / sum(counts)


def test_a_resume_inside_the_warmup_goes_on_with_the_schedule(lora_run, gsm8k_head, tmp_path):
    """lora_run's step-1 checkpoint (inside the 2-step warmup) resumed on one rank: steps 2-4 run at
    `_lr` (the warmup's last step, then the cosine's), with the losses of the run that went on.
    LRs are the same floats from one formula (1e-12); losses: 1 rank against 2, fp32 sums in another
    order (1e-5 relative)."""
    run_dir, _, _ = lora_run
    resumed = tmp_path / "run"
    run_sfttrain(1, _job(gsm8k_head, run_dir.parent / "val.parquet", resumed, "trainer.resume_mode=resume_path",
                         f"trainer.resume_from_path={run_dir / 'global_step_1'}"))
    went_on = {m["step"]: m for m in read_metrics(run_dir) if "loss" in m}
    logged = [m for m in read_metrics(resumed) if "loss" in m]
    assert [m["step"] for m in logged] == [2, 3, 4]
    for m in logged:
        assert m["lr"] == pytest.approx(_lr(m["step"] - 1), rel=1e-12)
        assert m["loss"] == pytest.approx(went_on[m["step"]]["loss"], rel=1e-5)


def test_the_start_up_says_where_the_schedule_and_the_decay_differ_from_verl(lora_run):
    """verl's command lines run here unchanged, so what this optimizer does otherwise than verl's is said at
    start-up: the warmup's first step at lr/W (verl's at 0, `_lr`) and no weight decay on norms and biases
    (verl's AdamW decays every parameter)."""
    _, _, out = lora_run
    lr = (f"  lr                  : {LR} cosine, {WARMUP} warmup steps (the first at lr x 1/{WARMUP}; "
          "verl's starts at 0)\n")
    assert lr in out
    decay = f"  weight decay        : {WD} on matrices, none on norms and biases (verl decays every parameter)\n"
    assert decay in out
