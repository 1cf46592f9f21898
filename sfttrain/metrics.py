"""What the user sees: a progress bar, one console line per step, metrics.jsonl, wandb.

Throughput counts real (non-pad) and supervised tokens, timed between the completions of
consecutive steps on the device; MFU by sfttrain/flops.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from importlib.metadata import version
from typing import Optional

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from sfttrain.checkpoint_folder import write_atomically
from sfttrain.config import Config, logger_names, to_yaml
from sfttrain.errors import DependencyError
from sfttrain.flops import ModelShape, mfu, peak_flops

METRICS = "metrics.jsonl"
REWOUND = "metrics_rewound.jsonl"
LINE_KEYS = ("epoch", "loss", "val/loss", "lr", "grad_norm", "router_aux", "expert_load", "tokens_per_s",
             "loss_tokens_per_s", "mfu", "step_time_s", "data_wait_s", "mem_peak_alloc_gib")


class StepEnd:
    """The end of a step's work on the device, with the step's numbers copied behind it. On CUDA an
    event marks it, so read() waits for that work only (not for the next step the host has queued)
    and times come from the GPU's clock; on CPU the work is done when the call returns."""

    def __init__(self, device: torch.device, values: torch.Tensor | None = None):
        self.host = values.to("cpu", non_blocking=True) if values is not None else None
        self.clock = time.perf_counter()
        self.event = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        if self.event is not None:
            self.event.record()

    def read(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()

    def seconds_since(self, earlier: StepEnd) -> float:
        """A step's time runs from the end of the previous step's work to the end of its own: the data
        wait and logging between them count (the GPU waited for them). Both ends must have been read."""
        if self.event is not None and earlier.event is not None:
            return earlier.event.elapsed_time(self.event) / 1e3
        return self.clock - earlier.clock


def throughput(lengths: list[int], loss_tokens: int, seconds: float, shape: ModelShape, num_gpus: int,
               device: torch.device) -> dict:
    tokens = sum(lengths)
    out = {"tokens": tokens, "loss_tokens": loss_tokens, "step_time_s": seconds,
           "tokens_per_s": tokens / seconds, "loss_tokens_per_s": loss_tokens / seconds}
    if peak := peak_flops(device):
        out["mfu"] = mfu(shape.flops_per_token(lengths), tokens / seconds, num_gpus, peak)
    return out


def memory_stats(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"mem_peak_alloc_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "mem_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}


def require_loggers(cfg: Config) -> None:
    """A missing or broken wandb is one error at start-up, not a traceback once the model is loaded."""
    if "wandb" not in logger_names(cfg.trainer):
        return
    try:
        import wandb  # noqa: F401
    except Exception as e:  # an ImportError, or a broken install failing on import
        raise DependencyError(f"trainer.logger includes wandb but `import wandb` fails ({type(e).__name__}: {e}); "
                              "pip install wandb, or set trainer.logger=console") from None


def start_wandb(cfg: Config, run_dir: str, run_id: Optional[str]):
    """Rank 0's wandb run, started before the model loads; `run_id`: the resumed run's."""
    import wandb

    os.makedirs(run_dir, exist_ok=True)
    try:
        return wandb.init(project=cfg.trainer.project_name, name=cfg.trainer.experiment_name, dir=run_dir,
                          id=run_id, resume="allow", config=OmegaConf.to_container(OmegaConf.structured(cfg)))
    except wandb.errors.Error as e:  # no API key (no terminal to ask for one on), a bad key, no server
        raise DependencyError(f"trainer.logger includes wandb, and wandb could not start a run: {e} Log in once "
                              "with `wandb login` (or set WANDB_API_KEY), log offline with WANDB_MODE=offline, "
                              "or set trainer.logger=console") from None


def describe_software(device: torch.device) -> str:
    """The start-up line of the libraries and the code that ran: what a bug report or a rerun needs."""
    runtime = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {torch.version.hip}"
    gpu = f", {runtime} on {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    libraries = ", ".join(f"{name} {version(name)}" for name in ("transformers", "peft"))
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = commit_of(checkout)
    return (f"  software            : torch {torch.__version__}{gpu}, {libraries}; sfttrain from {checkout}"
            + (f" at {code}" if code else ""))


def commit_of(checkout: str) -> str | None:
    """The checkout's commit, "+changes" where tracked files differ; None where the folder is no
    checkout's top (git would answer for a repository around an installed package) or git is missing."""
    if not os.path.exists(os.path.join(checkout, ".git")):
        return None
    with contextlib.suppress(OSError):  # --exclude=*: the commit, never a tag's name
        done = subprocess.run(["git", "-C", checkout, "describe", "--always", "--exclude=*", "--dirty=+changes"],
                              capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None
    return None


def host_memory_gib() -> dict:
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    except OSError:
        return {}
    return {"host_rss_gib": int(fields["VmRSS"].split()[0]) / 2**20,
            "host_peak_gib": int(fields["VmHWM"].split()[0]) / 2**20}


def describe_host_memory(per_rank: list[dict]) -> str:
    """Every rank's peak, and its memory before the model (the difference: what loading it cost)."""
    if not all(per_rank):
        return "not measured (no /proc/self/status)"
    peaks = ", ".join(f"{m['host_peak_gib']:.2f}" for m in per_rank)
    before = ", ".join(f"{m['before_model_gib']:.2f}" for m in per_rank)
    return f"peak {peaks} GiB per rank (VmHWM); before the model {before} GiB"


class MetricsLogger:
    """Rank 0's; every other rank's does nothing. On a terminal tqdm's bar counts the steps; elsewhere
    (SLURM logs, pipes) tqdm's rate and ETA end the plain step lines. The bar starts at the first step
    logged: start-up and that step's compilation are not its rate."""

    def __init__(self, cfg: Config, run_dir: str, enabled: bool, total_steps: int,
                 wandb_id: Optional[str] = None, wandb_run=None):
        self.enabled = enabled
        self.log_freq = cfg.trainer.log_freq
        self.total_steps = total_steps
        self.wandb = wandb_run
        self.seen: dict[str, tuple[int, float]] = {}  # "first loss", "last val/loss"...: (step, value)
        # kept by checkpoints, so that a resume (even one without wandb) continues the same wandb run
        self.wandb_id = wandb_run.id if wandb_run else wandb_id
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        write_atomically(os.path.join(run_dir, "config.yaml"), to_yaml(cfg))
        self.jsonl = open(os.path.join(run_dir, METRICS), "a")
        self.interactive, self.bar = sys.stderr.isatty(), None

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        self._append(record)
        for key in ("loss", "val/loss"):
            if key in metrics:
                self.seen.setdefault(f"first {key}", (step, metrics[key]))
                self.seen[f"last {key}"] = (step, metrics[key])
        if self.wandb:
            self.wandb.log(metrics, step=step)
        if "loss" in metrics:
            if self.bar is None:  # off a terminal it counts, never drawn (TQDM_DISABLE turns a terminal's off)
                hidden = {} if self.interactive else {"delay": float("inf"), "disable": False}
                self.bar = tqdm(total=self.total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                                **hidden)
            self.bar.update(step - self.bar.n)
        if "val/loss" in metrics or step % self.log_freq == 0:
            line = format_line(record, self.total_steps)
            if self.bar is not None and not self.interactive:
                rate = {**self.bar.format_dict, "bar_format": "{rate_fmt}, ETA {remaining}"}
                line += f" | {tqdm.format_meter(**rate).strip()}"
            self.info(line)

    def event(self, record: Optional[dict], line: str) -> None:
        """A record that is not a step's (a checkpoint committed), fsynced: a crash's resume goes back
        to that checkpoint, so the records up to it survive a power loss as it does."""
        if self.enabled:
            if record is not None:
                self._append(record, sync=True)
            self.info(line)

    def _append(self, record: dict, sync: bool = False) -> None:
        """An OSError (a full or failing disk, which sfttrain.run says) names metrics.jsonl."""
        try:
            if os.fstat(self.jsonl.fileno()).st_nlink == 0:
                # deleted under the run: a new file, or (the run folder gone too) FileNotFoundError now
                fresh = open(self.jsonl.name, "a")
                self.jsonl.close()
                self.jsonl = fresh
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
            if sync:
                os.fsync(self.jsonl.fileno())
        except OSError as e:
            e.filename = e.filename or self.jsonl.name
            raise

    def summary(self, steps: int, seconds: float, run_dir: str, final: Optional[str], exported: Optional[str]) -> str:
        losses = " -> ".join(f"{self.seen[k][1]:.4g} (step {self.seen[k][0]})" for k in ("first loss", "last loss")
                             if k in self.seen)
        val = f"; val/loss {self.seen['last val/loss'][1]:.4g}" if "last val/loss" in self.seen else ""
        lines = [f"done: {steps} steps in {seconds:.0f} s; loss {losses or 'not logged'}{val}"]
        if final:
            lines.append(f"  final checkpoint : {final}")
        if exported:
            lines.append(f"  Hugging Face     : {exported}")
        elif final:
            lines.append(f"  export           : python -m sfttrain.export {final} <hf_folder> [--dtype bf16]")
        lines.append(f"  plot             : python -m sfttrain.plot {run_dir}")
        return "\n".join(lines)

    def info(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None and self.bar.n >= self.total_steps:
            self.close_bar()  # a finished bar stays above what follows, not redrawn under it
        if self.bar is not None and self.interactive:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        """Idempotent: also called when training stops on an error, which then prints below the bar."""
        if not self.enabled or self.jsonl.closed:
            return
        self.close_bar()
        # only the record whose write failed can fail here, and its error is already on its way
        with contextlib.suppress(OSError):
            os.fsync(self.jsonl.fileno())
            self.jsonl.close()
        if self.wandb:
            self.wandb.finish()


def format_line(record: dict, total_steps: int) -> str:
    """Numbers as people read them: 10,590 tokens/s, a loss of 1.234, a learning rate of 2e-05."""
    def readable(v) -> str:
        return (f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}") if isinstance(v, float) else str(v)
    fields = (f"{k} {readable(record[k])}" for k in LINE_KEYS if k in record)
    return " | ".join([f"step {record['step']}/{total_steps}", *fields])


def rewind_metrics(run_dir: str, step: int, note: Optional[dict] = None, own: bool = False) -> None:
    """Makes metrics.jsonl the history of the state resumed: records after `step` (the resumed run
    logs those steps again) and lines that do not read (cut short by a crash or a full disk) move to
    metrics_rewound.jsonl; `note` is appended. `own`: the checkpoint is this run folder's, so records
    up to it that are gone are said."""
    path = os.path.join(run_dir, METRICS)
    keep, dropped, torn = [], [], 0
    with contextlib.suppress(FileNotFoundError), open(path, errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line) if line.endswith("\n") else None
            except json.JSONDecodeError:
                record = None
            ok = isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step
            torn += not isinstance(record, dict) and bool(line.strip())
            (keep if ok else dropped).append(line.rstrip("\n") + "\n")
    say = logging.getLogger("sfttrain").warning
    if torn and keep:
        say(f"{path}: {torn} line(s) cut short (a crash or a full disk while the run wrote them) moved to "
            f"{REWOUND}; the records before them are kept and the resumed run's follow them")
    if own and step > 0 and not keep:
        gone = "is empty" if os.path.isfile(path) else "is missing"
        say(f"{path} {gone} (lost in a crash before it reached the disk, or deleted): the records of steps 1-{step} "
            f"are gone, and its curves (python -m sfttrain.plot) start at step {step + 1}, where this run resumes")
    if dropped:
        with open(os.path.join(run_dir, REWOUND), "a") as f:
            f.writelines(dropped)
            f.flush()
            os.fsync(f.fileno())  # on the disk before metrics.jsonl's replacement drops them
    if dropped or note is not None:
        write_atomically(path, "".join(keep + ([json.dumps(note) + "\n"] if note is not None else [])))
