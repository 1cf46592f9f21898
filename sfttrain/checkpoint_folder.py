"""The run folder's checkpoint layout: which `global_step_N` folders are committed, the atomic
renames that commit and delete them, retention, and the fsync helpers. Torch-free.

A `global_step_N` either does not exist or holds COMPLETE, written last, which lists every file with
its size. Saves are written into `.global_step_N.tmp`, deletions go through `.global_step_N.trash`,
and a replaced step is moved to `.global_step_N.old` first; `remove_stale_tmp` clears what a crash left.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from sfttrain.errors import ConfigError

if TYPE_CHECKING:
    from sfttrain.config import TrainerConfig

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
DEBRIS = re.compile(r"^\.global_step_\d+(\.old)?\.(tmp|trash)$")
ASIDE = re.compile(r"^\.(global_step_\d+)\.old$")
# a temporary file of `write_atomically` (or numpy's), left by a crash mid-write
ATOMIC_TMP = re.compile(r"^[^.].*\.\d+\.tmp(\.npz)?$")
VERL_SHARD = re.compile(r"^model_world_size_\d+_rank_\d+\.pt$")  # verl's FSDP checkpoint shards


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE))


def step_folders(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every `global_step_N` folder, committed or not, oldest first."""
    if not os.path.isdir(run_dir):
        return []
    return sorted((int(m.group(1)), os.path.join(run_dir, name)) for name in os.listdir(run_dir)
                  if (m := STEP_DIR.match(name)))


def complete_checkpoints(run_dir: str, run_id: Optional[str] = None) -> list[tuple[int, str]]:
    """(step, path) of every committed checkpoint, oldest first; with run_id, only that run's."""
    return [(step, path) for step, path in step_folders(run_dir)
            if is_complete(path) and (run_id is None or run_id_of(path) == run_id)]


def write_complete(tmp: str) -> int:
    """The commit's marker, listing each file's size; returns the checkpoint's bytes. Sizes are read
    through an open file: on NFS a stat alone may answer from a cache older than another node's write."""
    files = {}
    for folder, _, names in os.walk(tmp):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, tmp)] = os.fstat(f.fileno()).st_size
    listing = json.dumps({"files": files}, indent=1, sort_keys=True)
    write_synced(os.path.join(tmp, COMPLETE), listing)
    return sum(files.values()) + len(listing.encode())


def damage(path: str) -> list[str]:
    """A line per file missing or of another size than COMPLETE lists (an older sfttrain's lists none),
    and for a trainer_state.json changed at its size, which the list cannot see."""
    with open(os.path.join(path, COMPLETE)) as f:
        text = f.read()
    found = []
    try:
        files = dict(json.loads(text)["files"]) if text.strip() else {}
    except (ValueError, KeyError, TypeError):
        files, found = {}, [f"its {COMPLETE} does not hold the list of its files"]
    for name, size in sorted(files.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            found.append(f"{name} is missing")
        elif os.path.getsize(file) != size:
            found.append(f"{name} has {os.path.getsize(file)} bytes, {size} when it was committed")
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        try:
            read_state(path)
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            found.append(f"{STATE_FILE} does not read back as JSON ({e})")
    return found


def damaged_error(path: str, problem: str) -> ConfigError:
    """With the newest intact checkpoint of its run before it to resume from instead."""
    earlier = [p for step, p in complete_checkpoints(os.path.dirname(path), run_id_of(path))
               if step < step_of(path) and not damage(p)]
    then = (f"The newest intact checkpoint before it is {earlier[-1]} (to resume from it: trainer.resume_mode="
            f"resume_path trainer.resume_from_path={earlier[-1]}; or move {path} out of the run folder, and "
            "trainer.resume_mode=auto resumes from it)" if earlier else
            "No earlier checkpoint of its run is intact: trainer.resume_mode=disable (or a new "
            "trainer.default_local_dir) starts afresh")
    return ConfigError(f"the checkpoint {path} is damaged: {problem}. It was whole when it was committed; its files "
                       f"changed since (a partial copy, a failing disk, a file removed by hand). {then}")


def check_intact(path: str) -> None:
    problems = damage(path)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise damaged_error(path, "; ".join(problems[:3]) + more)


def read_state(path: str) -> dict:
    with open(os.path.join(path, STATE_FILE)) as f:
        return json.load(f)


def run_id_of(path: str) -> Optional[str]:
    """None: written before checkpoints held one."""
    try:
        return read_state(path).get("run_id")
    except (OSError, ValueError):
        return None


def runs(run_dir: str) -> dict[Optional[str], list[int]]:
    """run id -> the steps of its committed checkpoints, the run of the newest commit last."""
    by_run: dict[Optional[str], list[tuple[float, int]]] = {}
    for step, path in complete_checkpoints(run_dir):
        by_run.setdefault(run_id_of(path), []).append((os.path.getmtime(os.path.join(path, COMPLETE)), step))
    ordered = sorted(by_run.items(), key=lambda item: max(item[1]))
    return {run: sorted(step for _, step in marks) for run, marks in ordered}


def latest_of_newest_run(run_dir: str) -> Optional[tuple[int, str]]:
    by_run = list(runs(run_dir).values())
    return (by_run[-1][-1], os.path.join(run_dir, f"global_step_{by_run[-1][-1]}")) if by_run else None


def resolve(path: str) -> str:
    """A checkpoint folder, or a run folder's latest checkpoint of its newest run; else a ConfigError."""
    path = os.path.abspath(os.path.expanduser(path))
    if is_complete(path):
        return path
    found = latest_of_newest_run(path)
    if found:
        return found[1]
    raise ConfigError(f"{path!r} {_what_instead(path)}")


def weight_files(folder: str) -> list[str]:
    """A Hugging Face model folder's weight files (safetensors, or PyTorch's .bin)."""
    return sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors")) +
                  glob.glob(os.path.join(glob.escape(folder), "*.bin")))


def _what_instead(path: str) -> str:
    if not os.path.exists(path):
        return "does not exist"
    names = set(os.listdir(path)) if os.path.isdir(path) else set()
    if any(VERL_SHARD.match(name) for name in names):
        hf = os.path.join(path, "huggingface")
        start = (f"set model.partial_pretrain={hf} (its weights, saved beside the shards)" if weight_files(hf) else
                 f"merge its shards into a Hugging Face folder (verl: `python -m verl.model_merger merge "
                 f"--backend fsdp --local_dir {path} --target_dir OUT`) and set model.partial_pretrain=OUT")
        return ("is a verl checkpoint (model_world_size_*_rank_*.pt): sfttrain resumes its own runs only (their "
                f"optimizer, schedule and data position). To fine-tune on from its weights, {start}, without "
                "trainer.resume_from_path")
    if "config.json" in names and weight_files(path):
        return ("is a Hugging Face model folder, not a checkpoint: to start from its weights, set "
                f"model.partial_pretrain={path}; trainer.resume_from_path continues a sfttrain run (its optimizer, "
                "schedule and data position)")
    if STEP_DIR.match(os.path.basename(path)):
        return (f"has no {COMPLETE} marker: its save (or copy) did not finish; resume from an earlier "
                "global_step_N beside it, or finish copying it")
    return (f"is neither a complete sfttrain checkpoint (a global_step_N folder with a {COMPLETE} marker) nor a run "
            "folder that holds one")


def not_a_model_folder(path: str) -> Optional[str]:
    """What a folder given as model.partial_pretrain is instead (a checkpoint or run folder of sfttrain's or
    verl's, a peft adapter), and what to set; None for anything else."""
    names = set(os.listdir(path)) if os.path.isdir(path) else set()
    latest = latest_of_newest_run(path)  # a run folder's; None for a checkpoint itself
    checkpoint = path if is_complete(path) else latest[1] if latest else None
    if checkpoint:
        export = os.path.join(checkpoint, "huggingface")
        weights = (f"set model.partial_pretrain={export} (trainer.save_hf's export of it)" if weight_files(export) else
                   f"export them (`python -m sfttrain.export {checkpoint} OUT`) and set model.partial_pretrain=OUT")
        return (f"is a sfttrain "
                f"{'checkpoint' if checkpoint == path else f'run folder (its latest checkpoint: {checkpoint})'},"
                f" not a model folder: to fine-tune from its weights, {weights}; to go on with its run, keep its own "
                f"model.partial_pretrain and set trainer.resume_mode=resume_path trainer.resume_from_path={checkpoint}")
    if any(VERL_SHARD.match(name) for name in names):
        return _what_instead(path)
    if "adapter_config.json" in names:
        try:
            with open(os.path.join(path, "adapter_config.json")) as f:
                base = json.load(f).get("base_model_name_or_path")
        except (OSError, ValueError):
            base = "not readable there"
        return (f"is a peft adapter (adapter_config.json; its base: {base}), not a model folder: set "
                "model.partial_pretrain to the base to train new adapters on it, or merge these into the base first "
                "(peft's merge_and_unload, then save_pretrained) and fine-tune the merged folder")
    return None


def step_of(path: str) -> int:
    m = STEP_DIR.match(os.path.basename(path))
    return int(m.group(1)) if m else int(read_state(path)["step"])


def publish(tmp: str, final: str) -> None:
    """The commit: `tmp` becomes `final`. An older `final` is renamed aside first and deleted only once
    the new one is in place, so one of them is committed at every moment."""
    parent, name = os.path.split(final)
    aside = os.path.join(parent, f".{name}.old")
    if os.path.lexists(final):
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_path(parent)
    if os.path.lexists(aside):
        remove(aside)


def describe_retention(keep: Optional[int]) -> list[str]:
    """trainer.max_ckpt_to_keep=0 reads like "keep none" but keeps every one, as in verl: said."""
    if keep != 0:
        return []
    return ["  checkpoints kept    : every one (trainer.max_ckpt_to_keep=0 means what null does, as in verl; "
            "N > 0 keeps this run's newest N)"]


def remove_stale_tmp(run_dir: str, caches: tuple[str, ...] = ()) -> list[str]:
    """Deletes the debris of interrupted saves and deletions and the temporary files of `write_atomically`
    in the run folder and its cache subfolders `caches`, and puts back a checkpoint set aside by a
    replacement that did not finish; returns a line per one put back. Called under the run folder's lock."""
    restored = []
    if not os.path.isdir(run_dir):
        return restored
    for cache in (os.path.join(run_dir, c) for c in caches if os.path.isdir(os.path.join(run_dir, c))):
        for name in filter(ATOMIC_TMP.match, os.listdir(cache)):
            os.remove(os.path.join(cache, name))
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        if DEBRIS.match(name):
            shutil.rmtree(path, ignore_errors=True)
        elif ATOMIC_TMP.match(name) and os.path.isfile(path):
            os.remove(path)
        elif ASIDE.match(name):
            final = os.path.join(run_dir, ASIDE.match(name).group(1))
            if os.path.lexists(final):
                remove(path)  # the replacement is in place: the old one was being deleted
            else:
                os.replace(path, final)
                fsync_path(run_dir)
                restored.append(f"put back {final}: a save replacing it had stopped before its commit")
    return restored


def remove(path: str) -> None:
    shutil.rmtree(hide(path), ignore_errors=True)


def hide(path: str) -> str:
    parent, name = os.path.split(path)
    trash = os.path.join(parent, f".{name.lstrip('.')}.trash")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    fsync_path(parent)
    return trash


def write_synced(path: str, text: str | bytes) -> None:
    with open(path, "wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_atomically(path: str, text: str | bytes) -> None:
    """`text` as the file `path`, whole or not at all, also after a power loss; a failed write leaves
    the old one and no temporary file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        write_synced(tmp, text)
        replace_synced(tmp, path)
    except OSError as error:
        if os.path.exists(tmp):
            os.remove(tmp)
        error.filename = path  # a failed write names no file; the temporary one is gone
        raise


def replace_synced(tmp: str, path: str) -> None:
    """`tmp` becomes `path`: fsynced first, so the rename never reaches the disk before the bytes it
    names, then the folder, so the rename survives a crash."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def tree_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, name)) for folder, _, files in os.walk(root) for name in files)


def fsync_tree(root: str) -> None:
    """fsyncs the files DCP does not (its own shards) and every folder."""
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".distcp"):
                fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def fsync_path(path: str) -> None:
    """A file, or a folder: the names in it (a rename into it) reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def size_text(n: int) -> str:
    """Bytes as people write them: 3.25 MB, 850 MB, 12.5 GB, 1.5 TB (not 1.5e+03 GB)."""
    for unit, scale in (("MB", 1e6), ("GB", 1e9), ("TB", 1e12), ("PB", 1e15)):
        if float(f"{n / scale:.3g}") < 1000:
            break
    return f"{n / scale:.3g} {unit}"


def nearest_existing(path: str) -> str:
    """`path` made absolute, or the nearest of its parents that exists."""
    there = os.path.abspath(os.path.expanduser(path))
    while not os.path.lexists(there):
        there = os.path.dirname(there)
    return there


def room_problem(run_dir: str, free: int, need: int, estimated: bool) -> Optional[str]:
    """What stops a run whose disk cannot take its next checkpoint (`estimated`: `need` estimates the first)."""
    if free >= need:
        return None
    size = (f"this run's first checkpoint will take about {size_text(need)} (the trained weights and their AdamW "
            "moments)" if estimated else f"this run's checkpoints take {size_text(need)}")
    return (f"trainer.default_local_dir={run_dir!r} has {size_text(free)} free and {size}: the next save would fail, "
            "and the training before it would be lost. Free space there, or set trainer.default_local_dir to a "
            "folder on a larger disk")


# The resume rule: which checkpoint a start takes (the run, the preflight and faults.what_next ask it)

@dataclass
class Resume:
    path: Optional[str]  # the checkpoint to resume from; None: a fresh start
    run_id: str  # the id this run's checkpoints get
    notes: list[str] = field(default_factory=list)  # what start-up found in the run folder and did about it
    passed_over: str = ""  # a checkpoint the config names that `path` was chosen over, and why

    def line(self, chosen: str) -> str:
        return f"  resume              : {chosen}{f'; {self.passed_over}' if self.passed_over else ''}"


def choose_resume(t: TrainerConfig, run_dir: str) -> Resume:
    """auto: the latest checkpoint of the run folder's newest run, else trainer.resume_from_path. A
    checkpoint whose files changed since its commit is refused. Changes nothing (the preflight asks it too)."""
    newest = latest_of_newest_run(run_dir)
    path, passed_over = None, ""
    if t.resume_mode == "auto" and newest:
        path = os.path.abspath(newest[1])
        given = t.resume_from_path and os.path.abspath(os.path.expanduser(t.resume_from_path))
        if given and given not in (path, os.path.dirname(path)):  # not that checkpoint, nor this run folder
            passed_over = (f"the run folder's latest checkpoint, not trainer.resume_from_path={t.resume_from_path}: "
                           "resume_mode=auto resumes the run folder's own checkpoints first (a restart continues its "
                           "progress) and starts from the path only where the run folder has none; "
                           "trainer.resume_mode=resume_path resumes from the path")  # (verl's auto takes the path)
    elif t.resume_mode != "disable" and t.resume_from_path:
        try:
            path = resolve(t.resume_from_path)
        except ConfigError as e:
            raise ConfigError(f"trainer.resume_from_path: {e}") from None
    if path:
        check_intact(path)  # before the model loads
    # the resumed checkpoint's run id; a new one on a fresh start, for an older checkpoint, or for a branch
    run_id = run_id_of(path) if path else None
    if run_id is None or any(step > step_of(path) for step, _ in complete_checkpoints(run_dir, run_id)):
        run_id = uuid.uuid4().hex[:12]
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


def _describe_others(run_dir: str, run_id: str, start: int) -> list[str]:
    notes = []
    for other, steps in runs(run_dir).items():
        if other == run_id:
            continue
        replaced = [s for s in steps if s > start]
        some = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]} ({len(steps)} checkpoints)"
        notes.append(f"found {some} of another run (id {other or 'none: an older sfttrain'}): kept, not "
                     "counted for max_ckpt_to_keep nor resumed by resume_mode=auto" +
                     (f"; a save of this run at one of steps {replaced} replaces that one" if replaced else "") +
                     ". A new trainer.default_local_dir keeps runs apart")
    return notes

