"""The run folder's checkpoint layout, as the checkpointer, the resume rules and the exporter all
read it: which `global_step_N` folders are committed, the atomic renames that commit and delete
them, retention, and the fsync helpers. A leaf: torch-free, it imports nothing of sfttrain's but
its errors.

A `global_step_N` either does not exist or is complete (it holds COMPLETE, written last, which lists
every file of the checkpoint with its size: `damage` finds a file changed after the commit). Saves
are written into `.global_step_N.tmp`; deletions go through `.global_step_N.trash`; replacing a
committed step moves the old one to `.global_step_N.old` first. At start-up `remove_stale_tmp`
deletes `.tmp` and `.trash` debris (and `write_atomically`'s temporary files) and puts back an `.old`
whose replacement never arrived.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Callable, Optional

from sfttrain.errors import ConfigError

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
DEBRIS = re.compile(r"^\.global_step_\d+(\.old)?\.(tmp|trash)$")
ASIDE = re.compile(r"^\.(global_step_\d+)\.old$")
ATOMIC_TMP = re.compile(r"^[^.].*\.\d+\.tmp(\.npz)?$")  # a temporary file of `write_atomically` (or numpy's), left by a crash mid-write
VERL_SHARD = re.compile(r"^model_world_size_\d+_rank_\d+\.pt$")  # verl's FSDP checkpoint shards


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE))


def step_folders(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every `global_step_N` folder in the run folder, committed or not, oldest first."""
    if not os.path.isdir(run_dir):
        return []
    return sorted((int(m.group(1)), os.path.join(run_dir, name)) for name in os.listdir(run_dir)
                  if (m := STEP_DIR.match(name)))


def complete_checkpoints(run_dir: str, run_id: Optional[str] = None) -> list[tuple[int, str]]:
    """(step, path) of every committed checkpoint in the run folder, oldest first; with run_id,
    only that run's (see `run_id_of`)."""
    return [(step, path) for step, path in step_folders(run_dir)
            if is_complete(path) and (run_id is None or run_id_of(path) == run_id)]


def write_complete(tmp: str) -> int:
    """The commit's marker, written last into a checkpoint whose every file is on disk: COMPLETE
    holds each file's path and size. A size is read through an open file: on NFS a stat alone may
    answer from a cache that predates another node's write. Returns the checkpoint's bytes."""
    files = {}
    for folder, _, names in os.walk(tmp):
        for name in names:
            path = os.path.join(folder, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                files[os.path.relpath(path, tmp)] = os.fstat(fd).st_size
            finally:
                os.close(fd)
    listing = json.dumps({"files": files}, indent=1, sort_keys=True)
    write_synced(os.path.join(tmp, COMPLETE), listing)
    return sum(files.values()) + len(listing.encode())


def damage(path: str) -> list[str]:
    """How a committed checkpoint's files differ from the list in its COMPLETE (one line per file
    missing or of another size: a partial copy, a failing disk, a file removed by hand), and a
    trainer_state.json that no longer reads. Empty for an intact checkpoint."""
    return listed_damage(path) + state_damage(path)


def listed_damage(path: str) -> list[str]:
    """`damage` against COMPLETE's list; none for a checkpoint committed before COMPLETE held it."""
    with open(os.path.join(path, COMPLETE)) as f:
        text = f.read()
    if not text.strip():
        return []
    try:
        files = dict(json.loads(text)["files"])
    except (ValueError, KeyError, TypeError):
        return [f"its {COMPLETE} does not hold the list of its files"]
    found = []
    for name, size in sorted(files.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            found.append(f"{name} is missing")
        elif os.path.getsize(file) != size:
            found.append(f"{name} has {os.path.getsize(file)} bytes, {size} when it was committed")
    return found


def state_damage(path: str) -> list[str]:
    """trainer_state.json changed in place (its size kept, which COMPLETE's list cannot see): the
    resume reads it before anything else. A missing one is `listed_damage`'s to say."""
    if not os.path.isfile(os.path.join(path, STATE_FILE)):
        return []
    try:
        read_state(path)
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return [f"{STATE_FILE} does not read back as JSON ({e})"]
    return []


def damaged_error(path: str, problem: str) -> ConfigError:
    """The error of a checkpoint that does not read back as it was committed, with the newest intact
    checkpoint of its run before it to resume from instead."""
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
    """Raises `damaged_error` for a checkpoint whose files are not those its COMPLETE lists."""
    problems = damage(path)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise damaged_error(path, "; ".join(problems[:3]) + more)


def read_state(path: str) -> dict:
    """A checkpoint's trainer_state.json."""
    with open(os.path.join(path, STATE_FILE)) as f:
        return json.load(f)


def run_id_of(path: str) -> Optional[str]:
    """The id of the run that wrote a checkpoint (None: written before checkpoints held one)."""
    try:
        return read_state(path).get("run_id")
    except (OSError, ValueError):
        return None


def runs(run_dir: str) -> dict[Optional[str], list[int]]:
    """run id -> the steps of its committed checkpoints, the run of the newest checkpoint last."""
    by_run: dict[Optional[str], list[tuple[float, int]]] = {}
    for step, path in complete_checkpoints(run_dir):
        by_run.setdefault(run_id_of(path), []).append((os.path.getmtime(os.path.join(path, COMPLETE)), step))
    ordered = sorted(by_run.items(), key=lambda item: max(item[1]))
    return {run: sorted(step for _, step in marks) for run, marks in ordered}


def latest_of_newest_run(run_dir: str) -> Optional[tuple[int, str]]:
    """The latest checkpoint of the run that committed last (a folder may hold several runs)."""
    by_run = runs(run_dir)
    if not by_run:
        return None
    run_id = list(by_run)[-1]
    step = by_run[run_id][-1]
    return step, os.path.join(run_dir, f"global_step_{step}")


def resolve(path: str) -> str:
    """A checkpoint folder, or a run folder (the latest checkpoint of its newest run). Raises
    ConfigError for anything that is not a complete sfttrain checkpoint."""
    path = os.path.abspath(os.path.expanduser(path))
    if is_complete(path):
        return path
    found = latest_of_newest_run(path)
    if found:
        return found[1]
    raise ConfigError(f"{path!r} {_what_instead(path)}")


def holds_weights(folder: str) -> bool:
    """A folder with a Hugging Face model's weight files (safetensors, or PyTorch's .bin)."""
    return bool(weight_files(folder))


def weight_files(folder: str) -> list[str]:
    """A Hugging Face model folder's weight files (safetensors, or PyTorch's .bin)."""
    if not os.path.isdir(folder):
        return []
    return [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith((".safetensors", ".bin"))]


def _what_instead(path: str) -> str:
    """What a path that holds no sfttrain checkpoint is instead, and what to do with it."""
    if not os.path.exists(path):
        return "does not exist"
    names = set(os.listdir(path)) if os.path.isdir(path) else set()
    if any(VERL_SHARD.match(name) for name in names):
        hf = os.path.join(path, "huggingface")
        start = (f"set model.partial_pretrain={hf} (its weights, saved beside the shards)" if holds_weights(hf) else
                 f"merge its shards into a Hugging Face folder (verl: `python -m verl.model_merger merge --backend fsdp "
                 f"--local_dir {path} --target_dir OUT`) and set model.partial_pretrain=OUT")
        return ("is a verl checkpoint (model_world_size_*_rank_*.pt): sfttrain resumes its own runs only (their "
                f"optimizer, schedule and data position). To fine-tune on from its weights, {start}, without "
                "trainer.resume_from_path")
    if "config.json" in names and holds_weights(path):
        return ("is a Hugging Face model folder, not a checkpoint: to start from its weights, set "
                f"model.partial_pretrain={path}; trainer.resume_from_path continues a sfttrain run (its optimizer, "
                "schedule and data position)")
    if STEP_DIR.match(os.path.basename(path)):
        return (f"has no {COMPLETE} marker: its save (or copy) did not finish; resume from an earlier "
                "global_step_N beside it, or finish copying it")
    return (f"is neither a complete sfttrain checkpoint (a global_step_N folder with a {COMPLETE} marker) nor a run "
            "folder that holds one")


def not_a_model_folder(path: str) -> Optional[str]:
    """What a folder given as model.partial_pretrain (which needs a config.json) is instead, and what to set: a
    checkpoint of sfttrain's (or its run folder) or of verl's, or a peft adapter. None for anything else."""
    names = set(os.listdir(path)) if os.path.isdir(path) else set()
    latest = latest_of_newest_run(path)  # a run folder's; None for a checkpoint itself
    checkpoint = path if is_complete(path) else latest[1] if latest else None
    if checkpoint:
        export = os.path.join(checkpoint, "huggingface")
        weights = (f"set model.partial_pretrain={export} (trainer.save_hf's export of it)" if holds_weights(export) else
                   f"export them (`python -m sfttrain.export {checkpoint} OUT`) and set model.partial_pretrain=OUT")
        return (f"is a sfttrain {'checkpoint' if checkpoint == path else f'run folder (its latest checkpoint: {checkpoint})'},"
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
    """The commit: `tmp` (complete, fsynced) becomes `final`. An older `final` (the same step of an
    earlier save) is renamed aside first and deleted only once the new one is in place, so at
    every moment one of them is committed (`remove_stale_tmp` puts an aside copy back if the
    new one never arrived)."""
    parent, name = os.path.split(final)
    aside = os.path.join(parent, f".{name}.old")
    if os.path.lexists(final):
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_path(parent)
    if os.path.lexists(aside):
        remove(aside)


def enforce_retention(run_dir: str, keep: Optional[int], run_id: Optional[str] = None,
                      delete: Optional[Callable[[str], None]] = None) -> list[int]:
    """Keeps the newest `keep` complete checkpoints of the run `run_id` (every checkpoint when
    None or 0), judged by what is on disk (so it holds across resumes); returns the steps deleted."""
    if not keep:
        return []
    doomed = complete_checkpoints(run_dir, run_id)[:-keep]
    for _, path in doomed:
        (delete or remove)(path)
    return [step for step, _ in doomed]


def describe_retention(keep: Optional[int]) -> list[str]:
    """The start-up's (and the preflight's) line for trainer.max_ckpt_to_keep=0, which reads like "keep
    none" but keeps every checkpoint, as in verl: said, where a filling disk would otherwise say it."""
    if keep != 0:
        return []
    return ["  checkpoints kept    : every one (trainer.max_ckpt_to_keep=0 means what null does, as in verl; "
            "N > 0 keeps this run's newest N)"]


def remove_stale_tmp(run_dir: str, caches: tuple[str, ...] = ()) -> list[str]:
    """Deletes the debris of interrupted saves and deletions (never a committed checkpoint) and the
    temporary files that a crash mid-write left of the run folder's own files (`write_atomically`:
    config.yaml, data_report.json, metrics.jsonl) and of its cache subfolders `caches` (a conversion, a
    length cache: as large as the data), and puts back a checkpoint set aside by a replacement (`publish`)
    that did not finish; returns a line per checkpoint put back. Called under the run folder's lock, so
    no other run is writing any of them."""
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
    """Atomically makes `path` invisible (one rename), then deletes it."""
    shutil.rmtree(hide(path), ignore_errors=True)


def hide(path: str) -> str:
    """Renames `path` to its `.trash` name (which the next start deletes); returns that name."""
    parent, name = os.path.split(path)
    trash = os.path.join(parent, f".{name.lstrip('.')}.trash")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    fsync_path(parent)
    return trash


def write_synced(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_atomically(path: str, text: str) -> None:
    """`text` as the file `path`, whole or not at all: written under a temporary name, fsynced, renamed
    (`replace_synced`). For the run folder's files written once per start (config.yaml, data_report.json):
    after a crash or a power loss the old file or the new one is there, never a torn or empty one; a
    write that fails (a full disk) leaves the old one and no temporary file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        write_synced(tmp, text)
        replace_synced(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def replace_synced(tmp: str, path: str) -> None:
    """`tmp` (written whole) becomes `path`: fsynced first, so that the rename never reaches the disk
    before the bytes it names (a crash would leave `path` empty or short, with its old content gone),
    then the folder, so that the rename itself survives one."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def tree_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, name)) for folder, _, files in os.walk(root) for name in files)


def fsync_tree(root: str) -> None:
    """fsyncs the small files written outside DCP (DCP fsyncs its own shards) and every folder,
    so COMPLETE never reaches the disk before what it vouches for."""
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".distcp"):
                fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def fsync_path(path: str) -> None:
    """fsyncs a file, or a folder: the names in it (a rename into it) reach the disk."""
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
    """`path` made absolute, or the nearest of its parents that exists: where a folder `path` would be made."""
    there = os.path.abspath(os.path.expanduser(path))
    while not os.path.lexists(there):
        there = os.path.dirname(there)
    return there


def room_problem(run_dir: str, free: int, need: int, estimated: bool) -> Optional[str]:
    """What stops a run whose folder's disk cannot take its next checkpoint (None if it can): at
    start-up, not at that save, when the training before it would be lost. `estimated`: no
    checkpoint of the run exists yet, `need` is the estimate of the first."""
    if free >= need:
        return None
    size = (f"this run's first checkpoint will take about {size_text(need)} (the trained weights and their AdamW "
            "moments)" if estimated else f"this run's checkpoints take {size_text(need)}")
    return (f"trainer.default_local_dir={run_dir!r} has {size_text(free)} free and {size}: the next save would fail, "
            "and the training before it would be lost. Free space there, or set trainer.default_local_dir to a "
            "folder on a larger disk")

