"""What the user sees: a progress bar, one console line per step, metrics.jsonl, wandb.

Throughput is honest: real (non-pad) input tokens and supervised tokens per second, timed
between the completions of consecutive steps on the device; MFU by the formula in sfttrain/flops.py.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import torch
from tqdm import tqdm

from sfttrain.config import Config, logger_names, to_yaml
from sfttrain.flops import ModelShape, mfu


class StepEnd:
    """The end of a step's work on the device: the step's numbers, copied to host memory behind
    that work, and when it finished. On CUDA an event marks it: read() waits for that work only
    (a .tolist() would wait for everything queued since, so the host could not queue the next
    step while the GPU finishes this one), and time is taken between two ends' events on the
    GPU's clock. On CPU the work is done when the call returns: the host's clock."""

    def __init__(self, device: torch.device, values: torch.Tensor | None = None):
        # into pinned memory when values are on CUDA; no values: a mark in time only
        self.host = values.to("cpu", non_blocking=True) if values is not None else None
        self.clock = time.perf_counter()
        self.event = None
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()

    def read(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()

    def seconds_since(self, earlier: StepEnd) -> float:
        """Both ends must have been read (or be known finished)."""
        if self.event is not None and earlier.event is not None:
            return earlier.event.elapsed_time(self.event) / 1e3
        return self.clock - earlier.clock


class StepTimer:
    """A step's time runs from the end of the previous step's work on the device to the end of
    its own, whenever the host reads them, so it includes the data wait and logging between
    them (all that the GPU waited for), and nothing of the next step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.restart()

    def restart(self) -> None:
        """The next step's time starts now (after start-up, validation, checkpointing)."""
        self.last = StepEnd(self.device)

    def lap(self, end: StepEnd) -> float:
        seconds, self.last = end.seconds_since(self.last), end
        return seconds


def throughput(lengths: list[int], loss_tokens: int, seconds: float, shape: ModelShape, num_gpus: int) -> dict:
    tokens = sum(lengths)
    fpt = shape.flops_per_token(lengths)
    return {"tokens": tokens, "loss_tokens": loss_tokens, "step_time_s": seconds,
            "tokens_per_s": tokens / seconds, "loss_tokens_per_s": loss_tokens / seconds,
            "mfu": mfu(fpt, tokens / seconds, num_gpus)}


def memory_stats(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    gib = 2**30
    return {"mem_peak_alloc_gib": torch.cuda.max_memory_allocated(device) / gib,
            "mem_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / gib}


class MetricsLogger:
    """Rank 0 only: every other rank gets a logger that does nothing."""

    def __init__(self, cfg: Config, run_dir: str, enabled: bool, total_steps: int, start_step: int,
                 wandb_id: Optional[str] = None):
        self.enabled = enabled
        self.log_freq = cfg.trainer.log_freq
        self.wandb = None
        self.wandb_id = wandb_id
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self.bar_range = (start_step, total_steps)
        self.bar = None  # created at the first step, so the start-up lines print above it
        if "wandb" in logger_names(cfg.trainer):
            self._init_wandb(cfg, run_dir)

    def _init_wandb(self, cfg: Config, run_dir: str) -> None:
        import wandb  # optional dependency; WANDB_MODE=offline works without a network

        from omegaconf import OmegaConf

        run = wandb.init(project=cfg.trainer.project_name, name=cfg.trainer.experiment_name, dir=run_dir,
                         id=self.wandb_id, resume="allow",
                         config=OmegaConf.to_container(OmegaConf.structured(cfg)))
        self.wandb, self.wandb_id = wandb, run.id

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.wandb:
            self.wandb.log(metrics, step=step)
        if self.bar is None:
            self.bar = tqdm(total=self.bar_range[1], initial=self.bar_range[0], desc="train", dynamic_ncols=True)
        if "loss" in metrics:
            self.bar.update(1)
        if "val/loss" in metrics or step % self.log_freq == 0:
            self.bar.write(format_line(record))

    def event(self, record: dict, line: str) -> None:
        """A record that is not a step's metrics (a checkpoint committed): metrics.jsonl and one line."""
        if self.enabled:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
            tqdm.write(line)

    def info(self, text: str) -> None:
        if self.enabled:
            tqdm.write(text)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        self.jsonl.close()
        if self.wandb:
            self.wandb.finish()


def format_line(record: dict) -> str:
    keys = ("step", "epoch", "loss", "val/loss", "lr", "grad_norm", "tokens_per_s", "loss_tokens_per_s", "mfu",
            "step_time_s", "data_wait_s", "mem_peak_alloc_gib")
    parts = []
    for k in keys:
        if k in record:
            v = record[k]
            parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    return " | ".join(parts)
