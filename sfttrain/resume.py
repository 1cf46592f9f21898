"""A run folder at start-up: one run at a time in it, the checkpoint the start resumes from (the rule:
sfttrain.checkpoint_folder.choose_resume, which the faults' messages ask too) and what a changed config
may change of it.

One run at a time: rank 0 holds flock(2) on `<run folder>/.sfttrain.lock` for its process's life (the
kernel drops it however the process ends; NFS carries it between nodes), the file naming its holder.
Two runs in one folder would resume and overwrite each other's checkpoints.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from sfttrain.checkpoint_folder import Resume, choose_resume, read_state
from sfttrain.config import Config, ConfigError, TrainerConfig
from sfttrain.distributed import decided_by_rank0
from sfttrain.data.prepare import RENDERING_KEY, ROWS_KEY, differences
from sfttrain.data.render import RENDERING_CHANGE, RENDERING_VERSION
from sfttrain.export import HF_EXPORT_DIR
from sfttrain.lora import check_base
from sfttrain.metrics import rewind_metrics

LOCK_FILE = ".sfttrain.lock"
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)  # how filesystems without flock(2) answer
ROWS_UNCHECKED = ("; a data file rewritten with other rows of the same size would go unseen. Where it was, start "
                  "afresh (trainer.resume_mode=disable)")


def lock_run_folder(run_dir: str, held: dict[str, int]) -> list[str]:
    """Collective: rank 0 takes the run folder's lock into `held` (sfttrain.runtime's, released when the
    run ends); if another run holds it, every rank raises the same ConfigError. Returns start-up lines
    (a warning where the filesystem has no locks)."""
    def take() -> list[str]:
        fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        if (e := _flock(run_dir, fd, fcntl.LOCK_EX)) is not None:
            os.close(fd)
            return [f"  WARNING: the run folder's filesystem has no file locks ({e.strerror}): a second run started "
                    f"in {run_dir} while this one runs would not be refused, and the two would save over each other"]
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                                 "slurm_job": os.environ.get("SLURM_JOB_ID")}).encode())
        held[os.path.realpath(run_dir)] = fd
        return []

    return decided_by_rank0(take)


def check_not_in_use(run_dir: str) -> None:
    """The preflight's look: raises the ConfigError a run would stop on, without keeping the lock."""
    try:
        fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDONLY)
    except OSError:  # no run has held it yet (or it cannot be read: the run's own start-up says what then)
        return
    _flock(run_dir, fd, fcntl.LOCK_SH)  # shared: two preflights do not see each other
    os.close(fd)


def _flock(run_dir: str, fd: int, operation: int) -> OSError | None:
    """flock(2) without waiting: None once taken, the error where the filesystem has no locks; where another
    run holds it, fd is closed and the ConfigError raised, naming the holder."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        os.close(fd)
        try:
            with open(os.path.join(run_dir, LOCK_FILE)) as f:
                holder = json.load(f)
            who = f"rank 0 on {holder['host']}, pid {holder['pid']}, since {holder['since']}"
            who += f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
        except (OSError, ValueError, KeyError, TypeError):  # written just now, or by another version
            who = "its holder did not say who it is"
        raise ConfigError(f"trainer.default_local_dir={run_dir} is in use by another sfttrain run ({who}): two runs "
                          "in one folder would resume each other's checkpoints and save the same steps over each "
                          "other. Let that run finish or stop it, or give this run another trainer.default_local_dir"
                          ) from None
    except OSError as e:
        if e.errno not in NO_LOCKS:
            os.close(fd)
            raise
        return e


def find_resume(t: TrainerConfig, run_dir: str) -> Resume:
    """Collective, decided by rank 0. A fresh start moves aside metrics.jsonl records of an earlier attempt."""
    def decide() -> Resume:
        chosen = choose_resume(t, run_dir)
        if chosen.path is None:
            rewind_metrics(run_dir, 0)
        return chosen

    return decided_by_rank0(decide)


def check_resume(path: str, cfg: Config, current) -> list[str]:
    notes, refused = review_resume(path, cfg, current)
    if refused:
        raise ConfigError("\n".join(refused))
    return notes


def review_resume(path: str, cfg: Config, current) -> tuple[list[str], list[str]]:
    """(what resuming from `path` changes, what it refuses), against `current` (a TrainState)."""
    saved = read_state(path)
    checks = [lambda: check_data(path, saved, current.data, cfg.trainer.resume_allow_data_change),
              lambda: check_schedule(path, saved, current.schedule)]
    if current.base is not None:
        checks.insert(0, lambda: check_base(saved.get("base"), current.base, f"resuming from {path}") or [])
    notes, refused = [], []
    for check in checks:
        try:
            notes += check()
        except ConfigError as e:
            refused.append(str(e))
    return notes, refused


def check_data(path: str, saved: dict, fingerprint: dict, allow_change: bool) -> list[str]:
    legacy = saved.get("data") is None  # an older sfttrain's
    recorded = {"data.train_batch_size": saved["global_batch"], "trainer.seed": saved["seed"]} if legacy \
        else {RENDERING_KEY: 1, **saved["data"]}  # version 1 recorded none
    changed = differences(recorded, fingerprint)
    notes = [f"data: {path} records no data fingerprint (an older sfttrain): only the batch size and seed "
             "were checked"] if legacy else [f"data: {path} records no '{key}' (an older sfttrain): not checked" +
                                              (ROWS_UNCHECKED if key == ROWS_KEY else "")
                                              for key in fingerprint if key not in recorded]
    if ROWS_KEY in recorded and recorded[ROWS_KEY] == fingerprint.get(ROWS_KEY):  # the tokens say it all
        notes += [f"data: {c} (the rows' tokens are the same)" for c in changed if c.startswith(RENDERING_KEY)]
        changed = [c for c in changed if not c.startswith(RENDERING_KEY)]
    if changed and not allow_change:
        raise ConfigError(f"{path} was written with other data settings; resuming would silently change which "
                          "rows come next or how they are tokenized:\n    " + "\n    ".join(changed) +
                          (f"\n(the sfttrain that wrote the checkpoint rendered rows otherwise; since version "
                           f"{RENDERING_VERSION}, {RENDERING_CHANGE})"
                           if any(c.startswith(RENDERING_KEY) for c in changed) else "") +
                          "\nUse the checkpoint's values; or set trainer.resume_allow_data_change=true to continue "
                          "from its data position (epoch, samples consumed) on the new data; or "
                          "trainer.resume_mode=disable (or a new trainer.default_local_dir) to start afresh")
    return notes + [f"data (allowed by trainer.resume_allow_data_change) {c}" for c in changed]


def check_schedule(path: str, saved: dict, schedule: dict) -> list[str]:
    """The config's optimizer and schedule apply; one that ends at the checkpoint's step would train nothing."""
    step, total = saved["step"], schedule["total steps"]
    old = saved.get("schedule")
    if step >= total and (old is None or old["total steps"] != total):
        raise ConfigError(f"{path} is at step {step}, but this run's schedule ends at step {total} "
                          "(trainer.total_training_steps, or trainer.total_epochs x steps per epoch): nothing "
                          f"would be trained. Set trainer.total_training_steps above {step} to continue, or "
                          "trainer.resume_mode=disable (or a new trainer.default_local_dir) to start afresh")
    if old is None:
        return [f"optimizer: {path} records no optimizer settings (an older sfttrain): the config's apply"]
    notes = [f"optimizer (the config's apply) {c}" for c in differences(old, schedule)]
    if step < total:
        return notes
    exported = os.path.join(path, HF_EXPORT_DIR)
    export = (f"its Hugging Face export is {exported}" if os.path.isdir(exported) else
              f"it has no Hugging Face export (trainer.save_hf=true exports it now; `python -m sfttrain.export {path} "
              "OUT_DIR` does too)")
    return notes + [f"the checkpoint is this run's last step ({step}): nothing left to train. The run finished: its "
                    f"last checkpoint is {path}, and {export}. To train longer, raise trainer.total_training_steps (or "
                    "trainer.total_epochs); to start afresh, set trainer.default_local_dir to a new folder"]
