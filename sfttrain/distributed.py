"""Ranks, the process group and the DeviceMesh: `dp_replicate` (HSDP replicas) x `dp_shard` (FSDP
shards) x `sp` (Ulysses, innermost: one node's neighbours). The data is split over world / sp ranks;
FSDP shards over dp_shard x sp flattened (`fsdp_mesh`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from sfttrain.checkpoint_folder import write_synced
from sfttrain.config import Config, ConfigError, check_sequence_parallel_size, shard_group_size
from sfttrain.errors import UserError
from sfttrain.faults import check_writable

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    sp_size: int = 1  # ulysses_sequence_parallel_size: ranks that share each micro-batch

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_size  # sp is the mesh's innermost dimension

    @property
    def row_slice(self) -> tuple[int, int]:
        """(this rank's slice, slices) of every packed row (sfttrain.data.pack.local_slice)."""
        return (self.rank % self.sp_size, self.sp_size)

    def fsdp_mesh(self) -> DeviceMesh:
        """dp_shard x sp as one shard dimension (sp ranks hold a share of each gradient); 2-D with HSDP."""
        shard = self.mesh["dp_shard"] if self.sp_size == 1 else self.mesh["dp_shard", "sp"]._flatten("dp_shard_sp")
        if self.mesh["dp_replicate"].size() == 1:
            return shard
        return self.mesh["dp_replicate", shard.mesh_dim_names[0]]


def init_world(cfg: Config) -> World:
    rank, local_rank, world_size = (int(os.environ.get(k, d)) for k, d in
                                    (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    check_one_launcher_per_node()
    check_cuda_visible(cfg)
    use_cuda = wants_cuda(cfg)
    mesh_shape = check_world(cfg, world_size)
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible on this node; "
                              "start at most that many ranks per node (torchrun --nproc_per_node), or "
                              "trainer.device=cpu")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # one process without torchrun: a rendezvous without a port, which could collide with another job's
        store = dist.HashStore() if world_size == 1 and "MASTER_PORT" not in os.environ else None
        # offloaded parameters also need gloo: FSDP reduces host tensors
        backend = ("cuda:nccl,cpu:gloo" if cfg.model.fsdp_config.offloaded() else "nccl") if use_cuda else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=cfg.trainer.nccl_timeout),
                                device_id=device if use_cuda else None)
    sp = cfg.ulysses_sequence_parallel_size
    names = ("dp_replicate", "dp_shard", "sp")[:2 if sp == 1 else 3]
    mesh = init_device_mesh(device.type, (*mesh_shape, sp)[:len(names)], mesh_dim_names=names)
    return World(rank, local_rank, world_size, device, mesh, sp)


def wants_cuda(cfg: Config) -> bool:
    """Whether the ranks run on GPUs: trainer.device=cuda, or auto where this machine has one."""
    return cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())


def describe_auto_cpu(cfg: Config, device: torch.device) -> list[str]:
    """A start-up line where trainer.device=auto runs on the CPU: a torch that sees no GPU would otherwise
    train there at a fraction of the speed unsaid."""
    if cfg.trainer.device != "auto" or device.type != "cpu":
        return []
    why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
           else f"torch {torch.__version__} sees no CUDA device (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return [f"  NOTE: trainer.device=auto runs on the CPU: {why}. Set trainer.device=cuda to stop instead where "
            "a GPU is meant, or trainer.device=cpu to say the CPU is"]


def check_cuda_visible(cfg: Config) -> None:
    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu")


def ranks_of_this_launcher() -> int:
    """The ranks torchrun started beside this one on its node (its --nproc_per_node; 1 without torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def check_one_launcher_per_node() -> None:
    """Refuses srun starting several torchruns on a node (`--ntasks-per-node=8` with `--nproc_per_node=8`):
    tasks x nproc_per_node ranks would share its GPUs."""
    steps = os.environ.get("SLURM_STEP_TASKS_PER_NODE", "")  # srun's step: "8(x2)", "2,1", "1(x4)"
    tasks = max((int(n) for n in re.findall(r"(\d+)(?:\(x\d+\))?", steps)), default=1)
    per_launcher = ranks_of_this_launcher()
    if tasks > 1 and per_launcher > 1:
        raise ConfigError(f"srun started {tasks} tasks on a node (SLURM_STEP_TASKS_PER_NODE={steps}), each running "
                          f"torchrun with --nproc_per_node={per_launcher}: {tasks * per_launcher} ranks per node on "
                          "its GPUs. Start one torchrun per node (#SBATCH --ntasks-per-node=1, or srun "
                          "--ntasks-per-node=1 torchrun ...), as slurm/sft_multinode.sbatch does")


def check_world(cfg: Config, world_size: int) -> tuple[int, int]:
    """The mesh shape for world_size ranks, (replicas, shards) of the data-parallel ranks; a ConfigError
    where the config does not fit them."""
    t, fsdp, sp = cfg.trainer, cfg.model.fsdp_config, cfg.ulysses_sequence_parallel_size
    # verl users set trainer.nnodes / n_gpus_per_node; torchrun decides, so they must agree
    if t.nnodes is not None and t.n_gpus_per_node is not None and t.nnodes * t.n_gpus_per_node != world_size:
        raise ConfigError(f"trainer.nnodes * trainer.n_gpus_per_node = {t.nnodes * t.n_gpus_per_node} but torchrun "
                          f"started {world_size} ranks; fix the keys or the torchrun flags (or remove the keys)")
    dp = data_parallel_size(world_size, sp)
    ranks = f"{dp} data-parallel ranks ({world_size} ranks / ulysses_sequence_parallel_size={sp})" if sp > 1 else \
        f"world size {world_size}"
    shard = shard_group_size(fsdp, dp)
    if shard > dp or dp % shard:
        raise ConfigError(f"model.fsdp_config.fsdp_size={fsdp.fsdp_size} must divide the {ranks} "
                          "(or be -1 for all of them)")
    if fsdp.sharding_strategy == "HYBRID_SHARD" and shard == dp:
        raise ConfigError(f"sharding_strategy=HYBRID_SHARD needs model.fsdp_config.fsdp_size smaller than the "
                          f"{ranks} (e.g. the GPUs of one node)")
    return (dp // shard, shard)


def data_parallel_size(world_size: int, sp: int) -> int:  # world / sp groups of sp ranks
    check_sequence_parallel_size(sp)
    if world_size % sp:
        raise ConfigError(f"ulysses_sequence_parallel_size={sp} must divide the world size {world_size}: "
                          f"each group of {sp} ranks shares one sequence")
    return world_size // sp


@contextlib.contextmanager
def one_rank_group():
    """A process group of this process alone, for the preflight's collectives; nothing when one is up."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def shutdown(world: World) -> None:
    # gloo aborts a rank that exits while another still writes a checkpoint
    dist.barrier(device_ids=[world.local_rank] if world.device.type == "cuda" else None)
    dist.destroy_process_group()


def decided_by_rank0(decide: Callable[[], T], group=None) -> T:
    """Collective: rank 0 runs `decide`; every rank returns its value or raises its UserError (a rank
    that raised alone would leave the others waiting in their next collective). `group` must hold
    global rank 0; without a process group this process decides alone."""
    outcome: tuple[Any, Optional[UserError]] = (None, None)
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            outcome = (decide(), None)
        except UserError as e:
            outcome = (None, e)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        box = [outcome]
        dist.broadcast_object_list(box, src=0, group=group)
        outcome = box[0]
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


def from_every_rank(value: Any, group=None) -> list:
    """Collective: every rank's `value`, by rank, on every rank (this one's alone without a process group)."""
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def agree_on_errors(error: Optional[str], group=None) -> list[str]:
    """Collective: the errors of the ranks that had one, by rank, the same list on every rank, so that
    every rank raises (or goes on) together."""
    return [e for e in from_every_rank(error, group) if e is not None]


def check_shared_run_dir(run_dir: str, world: World, patience_s: float = 10.0) -> None:
    """Collective, at start-up: every rank must see the run folder rank 0 commits to. Rank 0 writes a file
    named by a random token there, once this user may write it; a rank that cannot see it within patience_s
    (a node-local disk) stops every rank."""
    def write_probe() -> str:
        token = uuid.uuid4().hex
        try:
            check_writable(run_dir)
            os.makedirs(run_dir, exist_ok=True)
            write_synced(os.path.join(run_dir, f".shared-check-{token}"), token)
        except OSError as e:
            raise ConfigError(f"trainer.default_local_dir={run_dir!r} cannot be written: {e}") from None
        return token

    probe = os.path.join(run_dir, f".shared-check-{decided_by_rank0(write_probe)}")
    deadline = time.monotonic() + patience_s
    while not os.path.exists(probe) and time.monotonic() < deadline:
        time.sleep(0.5)
    seen = from_every_rank((os.path.exists(probe), socket.gethostname(), os.path.abspath(run_dir)))
    if world.is_main:
        os.remove(probe)
    blind = [f"rank {r} on {host} ({path})" for r, (ok, host, path) in enumerate(seen) if not ok]
    if blind:
        raise ConfigError(f"trainer.default_local_dir={run_dir!r} is not one folder shared by every node: "
                          f"rank 0 on {seen[0][1]} wrote a file into {seen[0][2]} that {', '.join(blind[:4])} "
                          "cannot see. Put the run folder on storage every node mounts (not a node-local "
                          "disk such as /tmp or $TMPDIR), with a path that names it on every node")
