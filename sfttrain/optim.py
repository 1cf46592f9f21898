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
    groups = [{"params": [p for p in params if p.ndim >= 2]}, {"params": [p for p in params if p.ndim < 2]}]
    for group, settings in zip(groups, group_settings(cfg)):
        group.update(settings)
    # fused: one kernel per dtype and device (CUDA and CPU), which also applies the clip factor and
    # skips a non-finite step on the device (clipped_step)
    return torch.optim.AdamW(groups, lr=cfg.lr, fused=True)


def group_settings(cfg: OptimConfig) -> list[dict]:
    """The config's AdamW settings of each parameter group (matrices, then norms and biases)."""
    common = {"betas": tuple(cfg.betas), "eps": cfg.eps}
    return [{**common, "weight_decay": cfg.weight_decay}, {**common, "weight_decay": 0.0}]


def clipped_step(optimizer: torch.optim.AdamW, params: list[torch.Tensor], max_norm: float,
                 loss_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Clips the gradients to a total 2-norm of max_norm (inf: no clipping) and steps build_optimizer's fused
    AdamW, unless the loss or the norm is not finite. Returns the gradient norm (global under FSDP) and whether
    the step was taken, both on loss_sum's device.

    The clip factor and the skip reach the fused kernel as device tensors, through the attributes torch's AMP
    GradScaler sets (gradients divided by `grad_scale`; nothing updated, not even the step count, when
    `found_inf` is set): no host sync between backward and the update, and no extra pass over the gradients.
    torch does not document them: tests/test_optim.py fails on a torch whose fused AdamW stops reading them.
    FSDP's DTensor parameters take them too (0-dim tensors replicate implicitly), and so do parameters
    offloaded to the host (the kernel copies both to each parameter's device)."""
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
    """The start-up's lr and weight-decay lines, and its warnings (`schedule_warnings`). Both say where
    they differ from verl's SFT trainer, whose command lines run here unchanged: its scheduler (transformers'
    formula) trains the first warmup step at lr 0, and its AdamW decays every parameter."""
    warmup = warmup_steps(cfg, total_steps)
    first = f" (the first at lr x 1/{warmup}; verl's starts at 0)" if warmup > 1 else ""
    lines = [f"  lr                  : {cfg.lr} {cfg.lr_scheduler}, {warmup} warmup steps{first}"]
    if cfg.weight_decay > 0:
        lines.append(f"  weight decay        : {cfg.weight_decay} on matrices, none on norms and biases (verl decays "
                     "every parameter)")
    return [*lines, *schedule_warnings(cfg, total_steps)]


def schedule_warnings(cfg: OptimConfig, total_steps: int) -> list[str]:
    """Warnings of a learning rate that trains less than asked, said at start-up and by the preflight:
    optim.lr=0 (no weight moves: a throughput or data test can mean it, a fine-tune cannot), and
    optim.lr_warmup_steps outlasting the run (a verl command line cut to a few steps for a test, or steps
    meant as a ratio), where the rate never reaches optim.lr."""
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
    """Multiplier of optim.lr for optimizer step `step` (0-based): linear warmup, (step + 1) / warmup, so that
    the first step trains and the last warmup step is at optim.lr (transformers' and verl's get_cosine_schedule_
    with_warmup give step / warmup: the first step at 0, which moves no weight), then the cosine of those
    schedulers down to min_lr_ratio (reached one step past the last), or constant."""
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
    """After a resume: the LR is a pure function of (step, the current config), and so are the
    other settings. A loaded optimizer state brings the checkpoint's lr, betas, eps and weight
    decay, and a loaded scheduler its base LRs and its old schedule's position: both are
    replaced by the current config's, at `step`."""
    lr = cfg.lr * lr_factor(step, cfg, total_steps)
    for group, settings in zip(optimizer.param_groups, group_settings(cfg)):
        group.update(settings, lr=lr, initial_lr=cfg.lr)
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    scheduler.last_epoch = step
    scheduler._last_lr = [lr] * len(optimizer.param_groups)  # what get_last_lr() reads


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
