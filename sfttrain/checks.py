"""The start-up checks: one registry that the run and the preflight run before any compute.

A check is a function of what it needs; it raises a typed error or returns a list of its problems (a
`Note`: not checkable here); any other result is not a problem. A check whose needs are None is
skipped. The run stops after the whole list.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import resource
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Optional

import torch

from sfttrain import fp8, quant
from sfttrain.config import Config, ConfigError, as_list, config_problems, rendering_problems
from sfttrain.data.batching import BatchPlan, batch_problem
from sfttrain.data.render import build_renderer, resolve_chat_template
from sfttrain.data.files import data_files, missing_entries, nearest_name, open_source
from sfttrain.data.loader import open_files_needed, render_share
from sfttrain.data.parquet import hub_id_hint, row_fields
from sfttrain.data.prepare import Rows, plan_and_report, scan_rows
from sfttrain.distributed import World, check_world, data_parallel_size
from sfttrain.errors import DataError, UserError
from sfttrain.faults import OPEN_FILES_FIX, check_writable
from sfttrain.hub import cached_folder, is_repo_id, model_config
from sfttrain.loss import chunk_loss_kernel
from sfttrain.metrics import require_loggers
from sfttrain.model import (attention_backend, check_max_length, check_model_config, check_model_folder, check_weights,
                            check_weights_readable, embedding_rows, liger_patching, load_tokenizer, local_model_folder)
from sfttrain.parallel import check_device, choose_layout
from sfttrain.profiling import check_window
from sfttrain.rope import check_rope

WHERE = {"cuda": "on GPUs", "cpu": "without GPUs (trainer.device=auto; this machine has none)"}


class Note(UserError):
    """What a check cannot decide on this machine: said, not counted."""


@dataclass
class Findings:
    problems: list[UserError] = dataclasses.field(default_factory=list)  # what the run stops on
    notes: list[str] = dataclasses.field(default_factory=list)

    def check(self, run: Callable[[], Any]) -> Any:
        try:
            return run()
        except UserError as e:
            self.add(e)
            return None

    def add(self, problem: UserError | str) -> None:
        if isinstance(problem, Note):
            self.notes.append(str(problem))
        elif str(problem) not in map(str, self.problems):  # one mistake two checks find is said once
            self.problems.append(problem if isinstance(problem, UserError) else ConfigError(problem))


@dataclass
class Startup:
    """What the checks look at. devices: the device types the run may take; planning: the preflight
    (downloads nothing); elsewhere: the plan is for other machines, so a path missing here is a note."""
    cfg: Config
    world_size: int
    devices: tuple[str, ...]
    planning: bool = False
    elsewhere: bool = False
    found: Findings = dataclasses.field(default_factory=Findings)
    folder: Optional[str] = None  # the model folder on this machine, once found

    @cached_property
    def dp_size(self) -> Optional[int]:  # None: the world check lists why
        return Findings().check(lambda: data_parallel_size(self.world_size, self.cfg.ulysses_sequence_parallel_size))


def model_folder(cfg: Config, planning: bool, elsewhere: bool) -> Optional[str]:
    """model.partial_pretrain's folder here; the preflight only looks in the hub cache."""
    m = cfg.model
    if not m.partial_pretrain:  # the config's problem already
        return None
    if not planning:
        return local_model_folder(m)
    folder = cached_folder(m.partial_pretrain) if is_repo_id(m.partial_pretrain) else m.partial_pretrain
    if folder is None:
        raise Note(f"model.partial_pretrain={m.partial_pretrain!r} is a hub id that is not in this machine's hub "
                   f"cache: memory and the rendering of the rows are not checked; fill the cache with `hf download "
                   f"{m.partial_pretrain} --include '*.json' '*.model' '*.jinja'` or add "
                   "model.partial_pretrain=/path/to/a/local/copy to this command")
    if elsewhere and not os.path.exists(os.path.expanduser(folder)):
        raise Note(f"model.partial_pretrain={m.partial_pretrain!r} not on this machine: the model, memory and the "
                   "rendering of the rows are not checked")
    check_model_folder(m, folder)
    return folder


def data_entries(cfg: Config, elsewhere: bool) -> list:
    """Each data file entry that names nothing here (with the nearest name), or that data_files refuses."""
    problems = []
    for key in ("train_files", "val_files"):
        for entry in as_list(getattr(cfg.data, key)):
            # a URL is an entry missing here: the rows are read from files this machine mounts
            if elsewhere and missing_entries([entry]):
                problems.append(Note(f"data.{key}: {entry} not on this machine: its rows are not checked"))
            elif missing_entries([entry]):
                problems.append(DataError(f"data file {entry!r} does not exist (check data.{key}{nearest_name(entry)})"
                                          f"{hub_id_hint(entry)}"))
            else:
                try:
                    data_files([entry])
                except DataError as e:
                    problems.append(e)
    return problems


def run_folder(cfg: Config, elsewhere: bool) -> None:
    """This user can write the run folder; a note where it is not here in a plan of other machines."""
    try:
        check_writable(cfg.trainer.default_local_dir)
    except ConfigError as e:
        raise Note(str(e)) if elsewhere and not os.path.exists(cfg.trainer.default_local_dir) else e


def open_files(cfg: Config, dp_size: int, planning: bool) -> list[str]:
    """The data workers' handover needs file descriptors: the run raises its soft limit to the hard one,
    the preflight only checks that one."""
    need, (soft, hard) = open_files_needed(cfg.data, dp_size), resource.getrlimit(resource.RLIMIT_NOFILE)
    raised = max(soft, 1 << 20) if hard == resource.RLIM_INFINITY else hard  # unlimited: the kernel's nr_open caps it
    if not planning:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    if hard != resource.RLIM_INFINITY and hard < need:
        return [f"the open files limit of this job is {hard} (`ulimit -Hn`, the most `ulimit -n` may be raised to), "
                f"and a rank and each of its data workers need up to about {need} here. {OPEN_FILES_FIX}"]
    return []


def weights_present(cfg: Config, folder: str, planning: bool) -> None:
    """A folder of config files only is how the preflight plans a model that lives elsewhere."""
    try:
        check_weights(cfg.model, folder)
    except ConfigError as e:
        raise Note(f"{e} (a problem only if the folder has none where the run starts)") if planning else e


def fp8_ready(cfg: Config, device: str) -> list:
    if cfg.model.fp8 != "off" and device == "cuda" and not torch.cuda.is_available():  # planned elsewhere
        found = Findings()
        found.check(fp8.float8_api)
        return [*found.problems, Note(f"model.fp8={cfg.model.fp8}: whether the GPUs have FP8 tensor cores (compute "
                                      "capability >= 8.9: H100/H200, L40S) is checked at start-up")]
    fp8.check_available(cfg.model, torch.device(device))
    return []


def lora_base_ready(cfg: Config) -> None:
    """What LoRA's frozen base needs: adapters to quantize it for, torchao, and weight files to merge into."""
    m = cfg.model
    if m.base_quant != "none" and m.lora_rank <= 0:
        raise ConfigError(f"model.base_quant={m.base_quant} quantizes the frozen base under LoRA adapters, but "
                          "model.lora_rank=0 trains every weight (a quantized weight takes no update); set "
                          "model.lora_rank > 0, or model.base_quant=none")
    if m.lora_rank > 0 and m.random_init and cfg.trainer.save_hf:
        raise ConfigError("trainer.save_hf=true with LoRA on model.random_init=true: the merged export adds the "
                          "adapters to the base's weight files, and a random base has none; set trainer.save_hf="
                          "false (its checkpoints resume: the base is drawn again from trainer.seed)")
    if m.base_quant == "nf4":
        quant.torchao_nf4()


def layout_ready(cfg: Config, world_size: int, device: str) -> None:
    """What the layout needs of the device; without a mesh (the world's problem) only what needs none."""
    mesh = Findings().check(lambda: check_world(cfg, world_size))
    sp, offload = cfg.ulysses_sequence_parallel_size, cfg.model.fsdp_config.offloaded()
    check_device(cfg, "sharded" if mesh is None else choose_layout(world_size, mesh[1], sp, offload), device)


def batch_split(cfg: Config, dp_size: int) -> list[str]:
    d = cfg.data
    problem = batch_problem(d.train_batch_size, d.micro_batch_size_per_gpu, dp_size, d.max_token_len_per_gpu,
                            sp_size=cfg.ulysses_sequence_parallel_size)
    return [problem] if problem else []


# a check's parameters are Startup's attributes ("device": each of its devices)
REGISTRY = (config_problems, check_world, require_loggers, open_files, run_folder, model_folder,
            lambda cfg, folder: check_weights_readable(cfg.model, folder), weights_present,
            check_rope,  # RoPE that packing would make depend on the batch
            check_max_length, check_model_config,  # its family, router loss and Ulysses heads
            fp8_ready, lora_base_ready, lambda cfg, device: quant.check_fp8(cfg.model.base_quant, device),
            lambda cfg, device: cfg.model.use_liger and device == "cuda" and liger_patching(),
            lambda cfg, folder, device: attention_backend(cfg.model, model_config(folder, cfg.model.trust_remote_code),
                                                          device),
            lambda cfg, device: chunk_loss_kernel(cfg.model.loss_kernel, device), layout_ready, data_entries,
            batch_split)


def run_checks(s: Startup) -> Findings:
    for check in REGISTRY:
        needs = inspect.signature(check).parameters
        args = [getattr(s, name) for name in needs if name != "device"]
        if any(a is None for a in args):
            continue
        devices = s.devices if "device" in needs else (None,)
        result = on_devices(s, devices, lambda device: check(*args, *([device] if device else [])))
        if check is model_folder:
            s.folder = result
    return s.found


def on_devices(s: Startup, devices: tuple, run: Callable[[Optional[str]], Any]) -> Any:
    """run(device) for each device, its problems recorded: a note where another device takes the
    run, a problem where none does. The last result."""
    result, refusals = None, []
    for device in devices:
        found = Findings()
        result = found.check(lambda: run(device))
        for problem in result if isinstance(result, list) else []:
            found.add(problem)
        s.found.notes += found.notes
        refusals.append([(device, p) for p in found.problems])
    for device, problem in [r for refused in refusals for r in refused]:
        kind = type(problem) if all(refusals) else Note
        s.found.add(kind(f"if this runs {WHERE[device]}: {problem}") if len(devices) > 1 else problem)
    return result


def read_rows(s: Startup, scan: tuple[int, int], val_share: tuple[int, int]) -> Optional[Rows]:
    """The tokenizer and the rows rendered as the run renders them, problems recorded; None where
    they cannot be read here. scan, val_share: this process's (rank, ranks)."""
    cfg, d, run_dir = s.cfg, s.cfg.data, s.cfg.trainer.default_local_dir
    files = as_list(d.train_files)
    if s.folder is None or not files or missing_entries(files) or any(rendering_problems(d.max_length, d.truncation)):
        return None
    tokenizer = s.found.check(lambda: load_tokenizer(dataclasses.replace(cfg.model, partial_pretrain=s.folder),
                                                     resolve_chat_template(d) if d.apply_chat_template else None))
    renderer = None if tokenizer is None else s.found.check(
        lambda: build_renderer(d, tokenizer, embedding_rows(cfg.model, s.folder)))
    if renderer is None:
        return None
    fields = row_fields(d)
    source = s.found.check(lambda: open_source(files, fields, run_dir))
    scanned = None if source is None else s.found.check(
        lambda: scan_rows(cfg, source, renderer, tokenizer, scan, run_dir, fill_cache=not s.planning))
    rows = Rows(tokenizer, renderer, source, *scanned) if scanned else None
    val_files = as_list(d.val_files)
    if val_files and not missing_entries(val_files):
        val_source = s.found.check(lambda: open_source(val_files, fields, run_dir))
        val = None if val_source is None else s.found.check(lambda: render_share(val_source, renderer, *val_share))
        if rows is not None and val is not None:
            rows.val_source, rows.val_samples = val_source, val
    return rows


@contextlib.contextmanager
def config_first(s: Startup):
    """A value the config refuses (a micro-batch of 0) that a later check cannot take: the config's problems
    are said, not that check's traceback (without them, a bug's)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001
        if not config_problems(s.cfg):
            raise
        s.found.notes.append(f"the rest of the plan needs the config's problems fixed first ({type(e).__name__}: "
                             f"{e}): fix them and run the preflight again")


def start_run(cfg: Config, world: World) -> tuple[str, Rows, BatchPlan, dict]:
    """The run's start-up before the model: (folder, rows, plan, report), or every problem as one error."""
    s = Startup(cfg, world.world_size, (world.device.type,))
    with config_first(s):
        run_checks(s)
        rows = read_rows(s, (world.rank, world.world_size), (world.dp_rank, world.dp_size))
        planned = None if rows is None else s.found.check(
            lambda: plan_and_report(cfg, rows, world.dp_size, cfg.trainer.default_local_dir))
        if planned is not None:
            s.found.check(lambda: check_window(cfg.trainer.profile_steps, planned[0].total_steps))
    if problems := s.found.problems:  # every problem, one a line, as an error of the first one's kind (its exit code)
        raise problems[0] if len(problems) == 1 else type(problems[0])("\n".join(map(str, problems)))
    return s.folder, rows, *planned
