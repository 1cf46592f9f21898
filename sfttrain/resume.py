"""The resume rules: which checkpoint a start resumes from, which run it continues (a run folder may
hold several runs' checkpoints, each with its run's id), and what a changed config may change.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Optional

from sfttrain.checkpoint_folder import (COMPLETE, check_intact, complete_checkpoints, is_complete,
                                       latest_of_newest_run, read_state, resolve, run_id_of, runs, step_folders,
                                       step_of)
from sfttrain.config import Config, ConfigError, TrainerConfig
from sfttrain.distributed import decided_by_rank0
from sfttrain.data.fingerprint import RENDERING_KEY, ROWS_KEY, differences
from sfttrain.data.render import RENDERING_CHANGE, RENDERING_VERSION
from sfttrain.export import HF_EXPORT_DIR
from sfttrain.lora import check_base
from sfttrain.metrics import rewind_metrics

ROWS_UNCHECKED = ("; a data file rewritten with other rows of the same size would go unseen. Where it was, start "
                  "afresh (trainer.resume_mode=disable)")


@dataclass
class Resume:
    path: Optional[str]  # the checkpoint to resume from; None: a fresh start
    run_id: str  # the id this run's checkpoints get
    notes: list[str] = field(default_factory=list)  # what start-up found in the run folder and did about it
    passed_over: str = ""  # a checkpoint the config names that `path` was chosen over, and why

    def line(self, chosen: str) -> str:
        return f"  resume              : {chosen}{f'; {self.passed_over}' if self.passed_over else ''}"


def find_resume(t: TrainerConfig, run_dir: str) -> Resume:
    """Collective, decided by rank 0. A fresh start moves aside metrics.jsonl records of an earlier attempt."""
    def decide() -> Resume:
        chosen = choose_resume(t, run_dir)
        if chosen.path is None:
            rewind_metrics(run_dir, 0)
        return chosen

    return decided_by_rank0(decide)


def choose_resume(t: TrainerConfig, run_dir: str) -> Resume:
    """auto: the latest checkpoint of the run folder's newest run, else trainer.resume_from_path. A
    checkpoint whose files changed since its commit is refused. Changes nothing (the preflight asks it too)."""
    newest = latest_of_newest_run(run_dir)
    path, passed_over = None, ""
    if t.resume_mode == "auto" and newest:
        path = newest[1]
        passed_over = _passed_over(t.resume_from_path, path)
    elif t.resume_mode != "disable" and t.resume_from_path:
        try:
            path = resolve(t.resume_from_path)
        except ConfigError as e:
            raise ConfigError(f"trainer.resume_from_path: {e}") from None
    if path:
        check_intact(path)  # before the model loads
    run_id = _run_id(path, run_dir)
    notes = _describe_others(run_dir, run_id, step_of(path) if path else 0)
    if t.resume_mode == "auto":
        notes = _describe_unfinished(run_dir, path) + notes
    return Resume(path, run_id, notes, passed_over)


def _describe_unfinished(run_dir: str, chosen: Optional[str]) -> list[str]:
    """A line per uncommitted `global_step_N` past the chosen one: the user may be waiting for that copy."""
    mine = chosen is not None and os.path.dirname(os.path.abspath(chosen)) == os.path.abspath(run_dir)
    after = step_of(chosen) if mine else 0
    then = f"resuming from {os.path.basename(chosen) if mine else chosen}" if chosen else "starting afresh"
    return [f"{os.path.basename(path)} has no {COMPLETE} marker (a save or copy that did not finish): {then}. To "
            f"resume from it, finish copying it and start again; else delete it (a save of step {step} would "
            "replace it)"
            for step, path in step_folders(run_dir) if step > after and not is_complete(path)]


def _passed_over(resume_from_path: Optional[str], chosen: str) -> str:
    """Said where auto takes the run folder's checkpoint over trainer.resume_from_path (verl's takes the path)."""
    if not resume_from_path:
        return ""
    given, chosen = os.path.abspath(os.path.expanduser(resume_from_path)), os.path.abspath(chosen)
    if given in (chosen, os.path.dirname(chosen)):  # that checkpoint, or this run folder: the same choice
        return ""
    return (f"the run folder's latest checkpoint, not trainer.resume_from_path={resume_from_path}: resume_mode=auto "
            "resumes the run folder's own checkpoints first (a restart continues its progress) and starts from the "
            "path only where the run folder has none; trainer.resume_mode=resume_path resumes from the path")


def _run_id(path: Optional[str], run_dir: str) -> str:
    """The resumed checkpoint's run id; a new one on a fresh start, for an older checkpoint, or for a branch."""
    carried = run_id_of(path) if path else None
    if carried is None:
        return uuid.uuid4().hex[:12]
    later = [step for step, _ in complete_checkpoints(run_dir, carried) if step > step_of(path)]
    return uuid.uuid4().hex[:12] if later else carried


def _describe_others(run_dir: str, run_id: str, start: int) -> list[str]:
    notes = []
    for other, steps in runs(run_dir).items():
        if other == run_id:
            continue
        replaced = [s for s in steps if s > start]
        notes.append(f"found {_steps(steps)} of another run (id {other or 'none: an older sfttrain'}): kept, not "
                     "counted for max_ckpt_to_keep nor resumed by resume_mode=auto" +
                     (f"; a save of this run at one of steps {replaced} replaces that one" if replaced else "") +
                     ". A new trainer.default_local_dir keeps runs apart")
    return notes


def _steps(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]} ({len(steps)} checkpoints)"


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
    if step >= total:
        notes.append(finished(path, step))
    return notes


def finished(path: str, step: int) -> str:
    exported = os.path.join(path, HF_EXPORT_DIR)
    export = (f"its Hugging Face export is {exported}" if os.path.isdir(exported) else
              f"it has no Hugging Face export (trainer.save_hf=true exports it now; `python -m sfttrain.export {path} "
              "OUT_DIR` does too)")
    return (f"the checkpoint is this run's last step ({step}): nothing left to train. The run finished: its last "
            f"checkpoint is {path}, and {export}. To train longer, raise trainer.total_training_steps (or "
            "trainer.total_epochs); to start afresh, set trainer.default_local_dir to a new folder")
