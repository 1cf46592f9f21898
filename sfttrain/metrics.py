"""What the user sees: a progress bar, one console line per step, metrics.jsonl, wandb.

Throughput is honest: real (non-pad) input tokens and supervised tokens per second, timed
between the completions of consecutive steps on the device; MFU by the formula in sfttrain/flops.py.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

import torch
from tqdm import tqdm

from sfttrain.checkpoint_folder import write_atomically
from sfttrain.config import Config, logger_names, to_yaml
from sfttrain.errors import DependencyError
from sfttrain.flops import ModelShape, mfu, peak_flops

METRICS = "metrics.jsonl"
REWOUND = "metrics_rewound.jsonl"


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


def throughput(lengths: list[int], loss_tokens: int, seconds: float, shape: ModelShape, num_gpus: int,
               device: torch.device) -> dict:
    """Tokens/s, and MFU against this device's peak (omitted where the peak is unknown, CPU included)."""
    tokens = sum(lengths)
    out = {"tokens": tokens, "loss_tokens": loss_tokens, "step_time_s": seconds,
           "tokens_per_s": tokens / seconds, "loss_tokens_per_s": loss_tokens / seconds}
    peak = peak_flops(device)
    if peak:
        out["mfu"] = mfu(shape.flops_per_token(lengths), tokens / seconds, num_gpus, peak)
    return out


def memory_stats(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    gib = 2**30
    return {"mem_peak_alloc_gib": torch.cuda.max_memory_allocated(device) / gib,
            "mem_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / gib}


def require_loggers(cfg: Config) -> None:
    """wandb is imported at start-up, before the model loads: a missing or broken install is one
    clear error instead of a traceback once the model is on the GPU."""
    if "wandb" not in logger_names(cfg.trainer):
        return
    try:
        import wandb  # noqa: F401
    except Exception as e:  # an ImportError, or a broken install failing on import
        raise DependencyError(f"trainer.logger includes wandb but `import wandb` fails ({type(e).__name__}: {e}); "
                              "pip install wandb, or set trainer.logger=console") from None


def start_wandb(cfg: Config, run_dir: str, run_id: Optional[str]):
    """Rank 0's wandb run (trainer.logger includes wandb), started before the model loads: a missing
    login is one message, not a traceback once the model is loaded. `run_id`: the resumed run's."""
    import wandb  # checked at start-up by require_loggers; WANDB_MODE=offline works without a network
    from omegaconf import OmegaConf

    os.makedirs(run_dir, exist_ok=True)
    try:
        return wandb.init(project=cfg.trainer.project_name, name=cfg.trainer.experiment_name, dir=run_dir,
                          id=run_id, resume="allow", config=OmegaConf.to_container(OmegaConf.structured(cfg)))
    except wandb.errors.Error as e:  # no API key (no terminal to ask for one on), a bad key, no server
        raise DependencyError(f"trainer.logger includes wandb, and wandb could not start a run: {e} Log in once "
                              "with `wandb login` (or set WANDB_API_KEY), log offline with WANDB_MODE=offline, "
                              "or set trainer.logger=console") from None


class ProgressBar:
    """A tqdm bar on a terminal; plain periodic lines elsewhere (SLURM logs, pipes). The rate and
    ETA come from the device-timed step times, not tqdm's clock: the bar starts after start-up
    and after a resume, where tqdm's own rate would mix in the loading time or the skipped steps."""

    def __init__(self, start_step: int, total_steps: int, interactive: bool):
        self.total = total_steps
        # the median of the recent step times: the first step after a start (compilation) or a
        # checkpoint is an outlier that an average would carry for dozens of steps
        self.recent: collections.deque[float] = collections.deque(maxlen=20)
        self.bar = None
        if interactive:
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} {postfix}")

    @property
    def step_time(self) -> float | None:
        return statistics.median(self.recent) if self.recent else None

    def advance(self, step: int, seconds: float) -> None:
        self.recent.append(seconds)
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(self.eta(step), refresh=True)

    def eta(self, step: int) -> str:
        if self.step_time is None:
            return ""
        left = int(self.step_time * (self.total - step))
        return f"{self.step_time:.3g} s/step, ETA {left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}"

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def describe_software(device: torch.device) -> str:
    """The start-up line of the libraries and the code that ran: what a bug report or a rerun needs."""
    runtime = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {torch.version.hip}"
    accelerator = f", {runtime} on {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder sfttrain/ is in
    code = commit_of(checkout)
    return (f"  software            : torch {torch.__version__}{accelerator}, transformers {installed('transformers')}, "
            f"peft {installed('peft')}; sfttrain from {checkout}" + (f" at {code}" if code else ""))


def installed(package: str) -> str:
    """A package's installed version, read from its metadata (no import), or "not installed"."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def commit_of(checkout: str) -> str | None:
    """The git commit of a checkout, "+changes" where tracked files differ from it; None where the folder
    is no git checkout's top (an installed package: git would answer for a repository around it) or git
    is missing."""
    if not os.path.exists(os.path.join(checkout, ".git")):
        return None
    try:
        head = subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        changed = subprocess.run(["git", "-C", checkout, "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if changed.stdout.strip() else "")


def host_memory_gib() -> dict:
    """This process's resident host memory now (VmRSS) and its high-water mark (VmHWM), Linux."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    except OSError:
        return {}
    return {"host_rss_gib": int(fields["VmRSS"].split()[0]) / 2**20, "host_peak_gib": int(fields["VmHWM"].split()[0]) / 2**20}


def describe_host_memory(per_rank: list[dict]) -> str:
    """The start-up line of every rank's host memory: its peak, and its resident memory before the
    model was built (the difference is what loading the model cost)."""
    if not all(per_rank):
        return "not measured (no /proc/self/status)"
    peaks = ", ".join(f"{m['host_peak_gib']:.2f}" for m in per_rank)
    before = ", ".join(f"{m['before_model_gib']:.2f}" for m in per_rank)
    return f"peak {peaks} GiB per rank (VmHWM); before the model {before} GiB"


class MetricsLogger:
    """Rank 0 only: every other rank gets a logger that does nothing."""

    def __init__(self, cfg: Config, run_dir: str, enabled: bool, total_steps: int, start_step: int,
                 wandb_id: Optional[str] = None, wandb_run=None):
        self.enabled = enabled
        self.log_freq = cfg.trainer.log_freq
        self.total_steps = total_steps
        self.wandb = wandb_run  # start_wandb's, on rank 0 with trainer.logger including wandb
        self.seen: dict[str, tuple[int, float]] = {}  # "first loss", "last loss", "last val/loss": (step, value)
        # what checkpoints keep, so that a resume continues the same wandb run (also through a resume without wandb)
        self.wandb_id = wandb_run.id if wandb_run else wandb_id
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        write_atomically(os.path.join(run_dir, "config.yaml"), to_yaml(cfg))
        self.jsonl = open(os.path.join(run_dir, METRICS), "a")
        self.progress = ProgressBar(start_step, total_steps, interactive=sys.stderr.isatty())

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
            self.progress.advance(step, metrics["step_time_s"])
        if "val/loss" in metrics or step % self.log_freq == 0:
            line = format_line(record, self.total_steps)
            self.progress.write(line if self.progress.bar is not None else f"{line} | {self.progress.eta(step)}")

    def event(self, record: Optional[dict], line: str) -> None:
        """A record that is not a step's metrics (a checkpoint committed): metrics.jsonl (if any) and one line.
        metrics.jsonl is fsynced with it: a checkpoint's commit is where a crash's resume goes back to, so the
        records up to it survive a power loss as the checkpoint does (one fsync per save; one per step, or per
        log_freq steps, would keep records that the resume rewinds anyway)."""
        if self.enabled:
            if record is not None:
                self._append(record)
                self._sync()
            tqdm.write(line)

    def _append(self, record: dict) -> None:
        try:
            if os.fstat(self.jsonl.fileno()).st_nlink == 0:
                # deleted under the run, its records going to no file: a new one, or (its run folder gone
                # too) FileNotFoundError, which sfttrain.run says at once rather than at the next save
                fresh = open(self.jsonl.name, "a")
                self.jsonl.close()
                self.jsonl = fresh
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        except OSError as e:  # a full disk (sfttrain.run says it): the error names the file
            e.filename = e.filename or self.jsonl.name
            raise

    def _sync(self) -> None:
        try:
            os.fsync(self.jsonl.fileno())
        except OSError as e:  # a failing disk (sfttrain.run says it): the error names the file
            e.filename = e.filename or self.jsonl.name
            raise

    def summary(self, steps: int, seconds: float, run_dir: str, final: Optional[str], exported: Optional[str]) -> str:
        """The run's end: what this start trained, and the commands that take its result further
        (`exported`: trainer.save_hf's Hugging Face folder, when there is one)."""
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

    def info(self, text: str) -> None:
        if self.enabled:
            self.progress.write(text)

    def close(self) -> None:
        """Idempotent: the entry point also calls it when training stops on an error, so that the
        error is printed below a finished bar, not glued onto it."""
        if not self.enabled or self.jsonl.closed:
            return
        self.progress.close()
        # every record was flushed when written: closing fails only on the one whose write failed, and that
        # error is already on its way (a second one would hide it)
        with contextlib.suppress(OSError):
            os.fsync(self.jsonl.fileno())  # the run's last records, after its final checkpoint
            self.jsonl.close()
        if self.wandb:
            self.wandb.finish()


def format_line(record: dict, total_steps: int) -> str:
    keys = ("epoch", "loss", "val/loss", "lr", "grad_norm", "router_aux", "expert_load", "tokens_per_s", "loss_tokens_per_s", "mfu",
            "step_time_s", "data_wait_s", "mem_peak_alloc_gib")
    parts = [f"step {record['step']}/{total_steps}"]
    for k in keys:
        if k in record:
            v = record[k]
            parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    return " | ".join(parts)


def rewind_metrics(run_dir: str, step: int, note: Optional[dict] = None, own: bool = False) -> None:
    """Makes metrics.jsonl the history of the state being resumed: records of steps after `step`
    (logged by an attempt that crashed or was stopped after its last checkpoint; the resumed run
    logs those steps again) and lines that do not read (a last line cut short by a crash or a full
    disk) move to metrics_rewound.jsonl; `note` is appended. What a crash took is said in one line:
    lines that did not read, or (`own`: the checkpoint resumed is this run folder's, whose records
    up to it were written here) the records up to `step` gone, metrics.jsonl missing or empty."""
    path = os.path.join(run_dir, METRICS)
    keep, dropped, torn = [], [], 0
    if os.path.isfile(path):
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line) if line.endswith("\n") else None
                except json.JSONDecodeError:
                    record = None
                ok = isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step
                torn += not isinstance(record, dict) and bool(line.strip())
                (keep if ok else dropped).append(line if line.endswith("\n") else line + "\n")
    _say_lost(path, step, torn, len(keep), own)
    if note is not None:
        keep.append(json.dumps(note) + "\n")
    if not dropped and note is None:
        return
    if dropped:
        with open(os.path.join(run_dir, REWOUND), "a") as f:
            f.writelines(dropped)
            f.flush()
            os.fsync(f.fileno())  # on the disk before metrics.jsonl's replacement drops them
    write_atomically(path, "".join(keep))  # the rewound history, not the old one, after a crash of the resumed run


def _say_lost(path: str, step: int, torn: int, kept: int, own: bool) -> None:
    """A resume's note of what a crash (or a full disk) took from metrics.jsonl: lines cut short, moved
    aside so that the resumed run's records follow whole lines; or every record up to the checkpoint
    (the file missing or empty: its bytes never reached the disk), which no curve will show."""
    say = logging.getLogger("sfttrain").warning
    if torn and kept:
        say(f"{path}: {torn} line(s) cut short (a crash or a full disk while the run wrote them) moved to "
            f"{REWOUND}; the records before them are kept and the resumed run's follow them")
    if own and step > 0 and kept == 0:
        gone = "is empty" if os.path.isfile(path) else "is missing"
        say(f"{path} {gone} (lost in a crash before it reached the disk, or deleted): the records of steps 1-{step} "
            f"are gone, and its curves (python -m sfttrain.plot) start at step {step + 1}, where this run resumes")
