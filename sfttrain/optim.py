"""AdamW and the learning-rate schedule (a pure function of the step)."""

from __future__ import annotations

import math
from dataclasses import asdict

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from sfttrain.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """Weight decay on matrices only: norms and biases (1-D) are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrices, vectors = group_settings(cfg)
    # fused: one kernel per dtype and device, which also applies clipped_step's clip factor and skip
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], **matrices},
                              {"params": [p for p in params if p.ndim < 2], **vectors}], lr=cfg.lr, fused=True)


def group_settings(cfg: OptimConfig) -> list[dict]:  # matrices, then norms and biases
    common = {"betas": tuple(cfg.betas), "eps": cfg.eps}
    return [{**common, "weight_decay": cfg.weight_decay}, {**common, "weight_decay": 0.0}]


def clipped_step(optimizer: torch.optim.AdamW, params: list[torch.Tensor], max_norm: float,
                 loss_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Clips the gradients to a total 2-norm of max_norm (inf: no clipping) and steps the fused AdamW unless
    the loss or the norm is not finite; returns the (global) gradient norm and whether the step was taken.

    The clip factor and the skip reach the fused kernel as device tensors through the attributes AMP's
    GradScaler sets (`grad_scale` divides the gradients; `found_inf` skips the whole update): no host sync,
    no extra pass over the gradients. torch does not document them: tests/test_optim.py fails on a torch
    whose fused AdamW stops reading them. DTensor and offloaded parameters take them too."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2: the all-reduce of the partial norms
        norm = norm.full_tensor()
    full_norm = norm.to(loss_sum.device, non_blocking=True)  # on the host when offloaded
    finite = torch.isfinite(full_norm) & torch.isfinite(loss_sum)
    coef = torch.clamp(max_norm / (full_norm.float() + 1e-6), max=1.0)  # clip_grads_with_norm_'s
    optimizer.grad_scale, optimizer.found_inf = 1.0 / coef, (~finite).float()
    optimizer.step()
    return full_norm, finite


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    return cfg.lr_warmup_steps if cfg.lr_warmup_steps > 0 else int(cfg.lr_warmup_steps_ratio * total_steps)


def describe_schedule(cfg: OptimConfig, total_steps: int) -> list[str]:
    """The start-up's lr and weight-decay lines and warnings, saying where they differ from verl's SFT
    trainer (whose command lines run here unchanged)."""
    warmup = warmup_steps(cfg, total_steps)
    first = f" (the first at lr x 1/{warmup}; verl's starts at 0)" if warmup > 1 else ""
    lines = [f"  lr                  : {cfg.lr} {cfg.lr_scheduler}, {warmup} warmup steps{first}"]
    if cfg.weight_decay > 0:
        lines.append(f"  weight decay        : {cfg.weight_decay} on matrices, none on norms and biases (verl decays "
                     "every parameter)")
    return [*lines, *schedule_warnings(cfg, total_steps)]


def schedule_warnings(cfg: OptimConfig, total_steps: int) -> list[str]:
    """A learning rate that trains less than asked (start-up and preflight): zero, or a warmup longer than
    the run (a verl command line cut short, or steps meant as a ratio)."""
    if cfg.lr == 0:
        return ["  WARNING: optim.lr=0: no weight changes (AdamW's steps and its weight decay both scale with the "
                "rate), so the run trains nothing; set optim.lr (verl's default is 1e-5)"]
    warmup = warmup_steps(cfg, total_steps)
    if warmup <= total_steps:
        return []
    return [f"  WARNING: optim.lr_warmup_steps={warmup} is more than the run's {total_steps} steps: the learning rate "
            f"is still warming up at the last step, at {total_steps / warmup:.0%} of optim.lr. Lower it, or set "
            "optim.lr_warmup_steps=0 and optim.lr_warmup_steps_ratio (a share of the run's steps)"]


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of optim.lr at optimizer step `step` (0-based): warmup (step + 1) / warmup, so that the first
    step trains (transformers' and verl's step / warmup start at 0), then their cosine down to min_lr_ratio
    (one step past the last), or constant."""
    warmup = warmup_steps(cfg, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.lr_scheduler == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total_steps - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def schedule_settings(cfg: OptimConfig, total_steps: int) -> dict:
    """What the optimizer and the LR of every step follow, as recorded in a checkpoint."""
    return {**{f"optim.{k}": v for k, v in asdict(cfg).items()}, "total steps": total_steps}


def set_step(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, cfg: OptimConfig, total_steps: int,
             step: int) -> None:
    """After a resume: the loaded optimizer's and scheduler's settings (the checkpoint's lr, betas, eps,
    weight decay, base LRs, position) replaced by the current config's at `step`."""
    lr = cfg.lr * lr_factor(step, cfg, total_steps)
    for group, settings in zip(optimizer.param_groups, group_settings(cfg)):
        group.update(settings, lr=lr, initial_lr=cfg.lr)
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    scheduler.last_epoch = step  # (its get_last_lr() stays stale: the loop reads the groups' lr)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
