"""Shared fixtures: GSM8K Parquet from the in-repo sample, and a launcher for real torchrun jobs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import contextlib
import fcntl
import itertools
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from bench.jobs import descendants
from tests.forkrank import free_port

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "assets"
STORIES = ASSETS / "models" / "stories260K"


# The test files that take longest, slowest first (CPU-seconds of each alone, the jobs' processes
# included, on 2 cores with AVX-512 bf16). pytest-xdist (--dist loadfile) hands a worker the next file
# when it runs short: started last, one of these would leave the other worker idle for most of its
# length, so they start first and the end is left to files of a few seconds. test_parallel.py and
# test_fuse_projections.py compile layers with inductor, slowest on a fresh clone (no kernels cached).
# A CPU without bf16 instructions runs the bench tests' and the article's bf16 several times slower:
# there the bench files would belong at the front.
SLOWEST_FILES = ["test_checkpoint.py", "test_parallel.py", "test_errors.py", "test_article.py", "test_trainer.py",
                 "test_bench_w2b.py", "test_bench_w1.py", "test_fuse_projections.py", "test_bench_scale.py",
                 "test_files.py", "test_cli.py", "test_bench_moe.py", "test_sequence_parallel.py", "test_multinode.py",
                 "test_bench_w5.py", "test_experts.py", "test_plan.py", "test_hub.py", "test_data_report.py",
                 "test_lora.py", "test_chat.py", "test_plot.py", "test_resume_rules.py", "test_export.py",
                 "test_reference_loops.py", "test_moe.py"]


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, SLOWEST_FILES first (the rest keep their order); a run in one process
    keeps the order it was given."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        first = {name: i for i, name in enumerate(SLOWEST_FILES)}
        items.sort(key=lambda item: first.get(item.path.name, len(first)))


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs the suite on 2 workers), each worker's own torch
    threads get the worker's share of the cores: 2 workers x all cores each would oversubscribe
    them in the in-process tests. OMP_NUM_THREADS, where set, is the caller's choice and stays."""
    if config.getoption("allowed_skips") and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(SkipAudit(Path(config.getoption("allowed_skips"))), "skip_audit")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_addoption(parser):
    parser.addoption("--allowed-skips", metavar="FILE",
                     help="fail the run on a skip of a test that FILE does not list (.ci/run: tests/allowed_skips.txt)")


# where a test that tests/allowed_skips.txt lists may skip: what this machine lacks
SKIP_CONDITIONS = {
    "no-gpu": lambda: not torch.cuda.is_available(),
    "pre-hopper": lambda: not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    "no-flash-attn": lambda: importlib.util.find_spec("flash_attn") is None,
    "no-liger": lambda: importlib.util.find_spec("liger_kernel") is None,
    "no-bitsandbytes": lambda: importlib.util.find_spec("bitsandbytes") is None,
    "no-cpu-fp8-gemm": lambda: not cpu_runs_rowwise_fp8(),
}


def cpu_runs_rowwise_fp8() -> bool:
    """Whether this torch's CPU runs float8 GEMMs with a scale per row (model.base_quant=fp8's): torch
    2.13's does, 2.11's (the GPU image's) does not."""
    from sfttrain.config import ConfigError
    from sfttrain.quant import check_fp8

    try:
        check_fp8("fp8", "cpu")
    except ConfigError:
        return False
    return True


needs_cpu_fp8 = pytest.mark.skipif(not cpu_runs_rowwise_fp8(),
                                   reason="this torch's CPU runs no rowwise-scaled float8 GEMM (torch 2.13's does)")


class SkipAudit:
    """--allowed-skips FILE: a test that skips must match a line of FILE whose condition holds on this machine;
    any other skip fails the run, and so does a line that matches no test of a whole-suite run (a renamed
    test). Registered where every test's report arrives: pytest-xdist's controller, or the one process."""

    def __init__(self, path: Path):
        self.path, self.allowed = path, []
        for line in path.read_text().splitlines():
            if line.split("#", 1)[0].strip():
                pattern, where = line.split("#", 1)[0].split()
                holds = any(SKIP_CONDITIONS[condition]() for condition in where.split("|"))
                self.allowed.append((re.compile(".*".join(map(re.escape, pattern.split("*"))) + "$"), pattern, holds))
        self.ran: set[str] = set()
        self.skipped: dict[str, str] = {}
        self.problems: list[str] = []

    def pytest_runtest_logreport(self, report):
        self.ran.add(report.nodeid)
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skipped[report.nodeid] = (report.longrepr[2] if isinstance(report.longrepr, tuple)
                                           else str(report.longrepr))

    def pytest_sessionfinish(self, session):
        self.problems = [f"{test} skipped ({why}): {self.path} does not allow it on this machine"
                         for test, why in self.skipped.items()
                         if not any(holds and regex.match(test) for regex, _, holds in self.allowed)]
        config = session.config
        if (config.args_source is pytest.Config.ArgsSource.TESTPATHS
                and not (config.option.keyword or config.option.markexpr)):
            self.problems += [f"{self.path}: {pattern} matches no test that ran (renamed or removed?)"
                              for regex, pattern, _ in self.allowed if not any(map(regex.match, self.ran))]
        if self.problems and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        for problem in self.problems:
            terminalreporter.write_line(f"SKIP AUDIT: {problem}", red=True)


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name`, filled by `build` once for the whole test session. Under pytest-xdist each
    worker is a process with session fixtures of its own: the folder lives where all workers see it
    (beside their own base folders), and a worker that needs it while another builds it waits for
    that build (a file lock) rather than repeating an expensive job. A failed build leaves no
    done-marker, so the next worker tries again (and reports its own failure)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def gsm8k_dir(tmp_path_factory) -> Path:
    def build(out: Path) -> None:
        subprocess.run([sys.executable, str(REPO / "data_prep" / "gsm8k.py"), "--input_dir",
                        str(ASSETS / "data" / "gsm8k"), "--local_dir", str(out)], check=True, capture_output=True)

    return built_once(tmp_path_factory, "gsm8k", build)


# The validation rows of the runs that validate (demo_run, tests/test_sequence_parallel.py): the first
# 32 of GSM8K's 200-row test split. Validation is forward passes over every row, a micro-batch at a
# time: the whole split cost ~3 s of a 2-rank job that trains 3 steps in ~2 s. What those runs check of
# validation (it runs when and where it should, its loss falls with training, it is the same under
# sequence parallelism) holds on 32 rows: 16 or 32 a data-parallel rank, several micro-batches each,
# packed or not.
VAL_ROWS = 32


# The training rows of the jobs and preflights that train or plan a few steps and check nothing of
# the rows they never reach: the first HEAD_ROWS of gsm8k_dir's train.parquet, as many as one step of
# the default data.train_batch_size. A start-up renders every row of its files (a preflight too): the
# whole 2000-row split cost ~0.6 s of each such job.
HEAD_ROWS = 256


@pytest.fixture(scope="session")
def gsm8k_head(gsm8k_dir, tmp_path_factory) -> Path:
    """The first HEAD_ROWS rows of gsm8k_dir's train.parquet, as a train.parquet of their own."""
    import pyarrow.parquet as pq

    def build(out: Path) -> None:
        pq.write_table(pq.read_table(gsm8k_dir / "train.parquet").slice(0, HEAD_ROWS), out / "train.parquet")

    return built_once(tmp_path_factory, "gsm8k_head", build) / "train.parquet"


@pytest.fixture(scope="session")
def gsm8k_val(gsm8k_dir, tmp_path_factory) -> Path:
    """The first VAL_ROWS rows of gsm8k_dir's test.parquet, as a Parquet file of their own."""
    import pyarrow.parquet as pq

    def build(out: Path) -> None:
        pq.write_table(pq.read_table(gsm8k_dir / "test.parquet").slice(0, VAL_ROWS), out / "test.parquet")

    return built_once(tmp_path_factory, "gsm8k_val", build) / "test.parquet"


@pytest.fixture()
def verl_home(gsm8k_dir, tmp_path) -> Path:
    """A $HOME laid out as verl's scripts and article 003 expect it: ~/data/gsm8k/{train,test}.parquet, cut to
    the 64 and 8 rows their shortened runs read (every rank renders every row at start-up, and validates on the
    test split in bf16 with a 151k vocabulary: a CPU without bf16 instructions runs it ~9x slower than fp32)."""
    import pyarrow.parquet as pq

    data = tmp_path / "home" / "data" / "gsm8k"
    data.mkdir(parents=True)
    for split, rows in (("train", 64), ("test", 8)):
        pq.write_table(pq.read_table(gsm8k_dir / f"{split}.parquet").slice(0, rows), data / f"{split}.parquet")
    return tmp_path / "home"


# A small, fast CPU job on the real stories260K model: fp32, fixed order, constant LR.
BASE_OVERRIDES = [
    f"model.partial_pretrain={STORIES}",
    "model.enable_gradient_checkpointing=false",
    "model.fsdp_config.mixed_precision=false",
    "data.apply_chat_template=false",
    "data.max_length=256",
    "data.truncation=left",
    "data.shuffle=false",
    "optim.lr=1e-3",
    "optim.lr_warmup_steps_ratio=0",
    "optim.lr_scheduler=constant",
    "optim.weight_decay=0",
    "trainer.device=cpu",
]


# AdamW made linear in the gradient, for tests that compare weights after several steps of runs
# whose gradients differ by float rounding (another rank split, micro-batching, thread count, BLAS
# build). Adam's update m / (sqrt(v) + eps) with the default eps is ~lr * sign(g) where the gradient
# is at rounding-noise level, so noise flips full-size steps. With eps = 1 above every |g| (the
# gradient is clipped to norm 1) the update is ~lr * m: a rounding-level difference in the gradient
# stays a rounding-level difference in the weights.
LINEAR_ADAM = ["optim.eps=1.0", "optim.lr=0.1"]


def update_error(trained: dict, reference: dict, start: dict) -> float:
    """||(trained - start) - (reference - start)|| / ||reference - start|| over all tensors: how far
    two runs' updates from the same start differ, relative to the update itself (comparing the
    weights would hide a wrong update behind the much larger weights)."""
    assert trained.keys() == reference.keys()
    diff = sum(((trained[k].double() - reference[k].double()).norm() ** 2 for k in reference), torch.zeros(()))
    update = sum(((reference[k].double() - start[k].double()).norm() ** 2 for k in reference), torch.zeros(()))
    assert update > 0, "the reference did not move: a comparison that cannot fail"
    return (diff / update).sqrt().item()


def launch(nproc: int, overrides: list[str], log: Path, cwd: Path = REPO, env: dict | None = None,
           torchrun: bool = False, module: str = "sfttrain.run") -> subprocess.Popen:
    """Starts `torchrun --nproc_per_node=nproc -m sfttrain.run ...` as a user would, output to `log`.
    One rank runs as `python -m sfttrain.run ...` (also a user's way; the ~2 s of torchrun's own
    start-up, over the suite's many one-rank jobs, is time spent testing nothing) unless torchrun.
    The ranks of a job that needs neither torchrun (its summary, its error files) nor an environment
    or folder of its own are forked from this process's rank server instead (ForkServer). `module`:
    what runs, sfttrain.run's arguments being `overrides` (or a tool's, sfttrain.export on one rank)."""
    if forks(cwd, env, torchrun):
        return ForkServer.get().launch(nproc, overrides, log, module, env)
    launcher = (["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
                 "--master_port", str(free_port())] if torchrun or nproc > 1 else [])
    cmd = [sys.executable, *launcher, "-m", module, *overrides]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=cwd, env=rank_env(env), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def forks(cwd: Path = REPO, env: dict | None = None, torchrun: bool = False) -> bool:
    """Whether a job started in `cwd` with `env` (rank_env's extra) is forked from the rank server."""
    return FORK_RANKS and not torchrun and Path(cwd).resolve() == REPO and ForkServer.accepts(rank_env(env))


# SFTTRAIN_TEST_FORK=0 starts every rank the usual way (a check that no result depends on the start method)
FORK_RANKS = os.environ.get("SFTTRAIN_TEST_FORK", "1") != "0"


class ForkedJob(subprocess.Popen):
    """The launcher of a job whose ranks the rank server forked (tests/forkrank.py): a Popen whose
    wait/returncode/kill are the job's; `ranks()` are the pids kill_job must stop with it."""

    def __init__(self, cmd: list[str], rank_pid_file: Path, **kwargs):
        super().__init__(cmd, **kwargs)
        self.rank_pid_file = rank_pid_file

    def ranks(self) -> list[int]:
        while not self.rank_pid_file.exists() and self.poll() is None:  # the server forks at once
            time.sleep(0.01)
        return json.loads(self.rank_pid_file.read_text()) if self.rank_pid_file.exists() else []


class ForkServer:
    """This pytest process's rank server (tests/forkserver.py: torch, transformers and sfttrain
    imported once, one fork per rank), started at its first job, stopped when pytest ends (or dies:
    it ends when the pipe it holds from this process closes)."""

    _running: "ForkServer | None" = None
    _starting = threading.Lock()  # tests launch jobs from threads too (test_files, test_errors)

    @classmethod
    def get(cls) -> "ForkServer":
        with cls._starting:
            if cls._running is None:
                cls._running = cls()
        return cls._running

    @classmethod
    def stop(cls) -> None:
        if cls._running is not None:
            cls._running.proc.terminate()
            cls._running.proc.wait()
            shutil.rmtree(cls._running.dir, ignore_errors=True)
            cls._running = None

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="sfttrain-fork-"))
        self.socket = self.dir / "socket"
        self.env = rank_env()
        self.job_ids = itertools.count(1)
        # bound here: clients connect (and queue) at once, while the server still imports
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(str(self.socket))
        listener.listen(64)
        alive, self._alive = os.pipe()
        with open(self.dir / "server.log", "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver", str(listener.fileno()), str(alive)],
                                         cwd=REPO, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, pass_fds=[listener.fileno(), alive])
        listener.close()
        os.close(alive)

    @classmethod
    def accepts(cls, env: dict) -> bool:
        """A rank forked from the server is one started with env only where their environments are
        the same: torch, transformers and their libraries read theirs at import (OMP_NUM_THREADS,
        HF_*, TORCH*, PYTHONPATH, HOME...). PYTEST_CURRENT_TEST, which pytest changes per test, is
        read by none of them. Inductor exports two into this process's environment once an in-process
        test compiles: TORCHINDUCTOR_CACHE_DIR at its default, what every rank computes anyway, and
        _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR, an address in this process that its C++ kernels
        read (meaningless in a rank). Counted, every later job of the worker would start unforked.
        TORCH_LOGS is read again by the forked rank (tests/forkserver.py). (Before the server starts: the
        environment it would start with.)"""
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        def key(e: dict) -> dict:
            return {k: v for k, v in e.items()
                    if k not in ("PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "TORCH_LOGS")
                    and not (k == "TORCHINDUCTOR_CACHE_DIR" and v == default_cache_dir())}
        return key(env) == key(cls._running.env if cls._running else rank_env())

    def launch(self, nproc: int, args: list[str], log: Path, module: str = "sfttrain.run",
               env: dict | None = None) -> ForkedJob:
        cmd, pids = self.command(nproc, args, module)
        with open(log, "w") as f:
            return ForkedJob(cmd, pids, cwd=REPO, env=rank_env(env), stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)

    def command(self, nproc: int, args: list[str], module: str = "sfttrain.run") -> tuple[list[str], Path]:
        """A job's launcher (tests/forkrank.py, run in REPO with rank_env()) and the file of its ranks' pids."""
        pids = self.dir / f"job{next(self.job_ids)}.pids"
        return [sys.executable, str(REPO / "tests" / "forkrank.py"), str(self.socket), str(nproc), str(pids), "-m",
                module, *args], pids


def pytest_unconfigure(config):
    ForkServer.stop()


def rank_env(extra: dict | None = None) -> dict:
    """The environment of a test's torchrun job: CPU ranks (gloo), also on a machine with fewer GPUs
    than ranks; one thread per rank unless the caller's environment says otherwise (the suite is
    also run with OMP_NUM_THREADS=2: results must not depend on the BLAS thread count); this
    checkout first on the import path, then the caller's PYTHONPATH entries (`extra`'s first)."""
    extra = dict(extra or {})
    paths = (extra.pop("PYTHONPATH", None), str(REPO), os.environ.get("PYTHONPATH"))
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "PYTHONPATH": os.pathsep.join(p for p in paths if p), "WANDB_MODE": "offline", "CUDA_VISIBLE_DEVICES": "",
            **extra}


def run_sfttrain(nproc: int, overrides: list[str], check: bool = True, timeout: int = 300, cwd: Path = REPO,
                 env: dict | None = None, torchrun: bool = False,
                 module: str = "sfttrain.run") -> subprocess.CompletedProcess:
    """Runs a job to its end (`launch`); on timeout every rank is killed (none is left running)."""
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        proc = launch(nproc, overrides, Path(log.name), cwd, env, torchrun, module)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_job(proc)
            raise AssertionError(f"sfttrain timed out after {timeout}s:\n{Path(log.name).read_text()[-5000:]}")
        out = Path(log.name).read_text()
    if check and proc.returncode != 0:
        raise AssertionError(f"sfttrain failed ({proc.returncode}):\n{out[-6000:]}")
    # stdout and stderr interleaved in one stream, as a user sees them
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout=out, stderr="")


def run_alone(argv: list[str], limits: dict | None = None, prefix: tuple = (), timeout: int = 300,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m ...argv` in a process of its own (not forked by the rank server), under resource limits
    (`limits`: resource.RLIMIT_* -> (soft, hard), what `ulimit` sets) or run by a command `prefix` (unshare);
    output as one stream. Past `timeout` (a job that hangs) every process of its session is killed."""
    import resource

    def set_limits() -> None:
        for which, (soft, hard) in (limits or {}).items():
            resource.setrlimit(which, (soft, hard))

    with subprocess.Popen([*prefix, sys.executable, "-m", *argv], cwd=REPO, env=rank_env(env), preexec_fn=set_limits,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"{' '.join(argv[:1])} hung: killed after {timeout} s") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout=out)


def run_on_ranks(nproc: int, function: Callable, *args: str) -> None:
    """function(*args) on each of `nproc` ranks in a gloo group of their own (tests/rank_function.py),
    started as a job is (launch: forked from the rank server, not an interpreter each as
    torch.multiprocessing's spawn starts them); a rank that fails fails the test with the job's output."""
    run_sfttrain(nproc, [function.__module__, function.__name__, *args], module="tests.rank_function")


def job_processes(proc: subprocess.Popen) -> list[int]:
    """The launcher and every process of its job: torchrun's ranks are its descendants; the rank
    server's forked ranks are not, and come with their own (DataLoader workers, writers)."""
    ranks = proc.ranks() if isinstance(proc, ForkedJob) else []
    return [proc.pid, *descendants(proc.pid), *ranks, *(d for r in ranks for d in descendants(r))]


def kill_job(proc: subprocess.Popen) -> list[int]:
    """SIGKILL the agent and every rank at one instant. torchrun starts each rank in a session
    of its own, so killing the agent's process group would leave the ranks running: find them
    through /proc, freeze them all (SIGSTOP, so that none reacts to another's death), then kill."""
    if proc.poll() is not None:
        return []
    stopped: set[int] = set()
    while True:
        pids = [p for p in job_processes(proc) if p not in stopped]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            stopped.add(pid)
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    for pid in stopped:  # dead (gone, or a zombie awaiting its reaper) before the next attempt
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.01)
        assert not alive(pid), f"process {pid} survived SIGKILL"
    return sorted(stopped)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def read_metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def running_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl as the running job leaves it (a line being written is skipped)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


def logged_steps(run_dir: Path) -> int:
    return max([0] + [m["step"] for m in running_records(run_dir) if "loss" in m])


def train_losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if "loss" in m]


def checkpoint_tensor_bytes(ckpt_dir: Path) -> int:
    """The bytes of the tensors a DCP checkpoint's metadata lists, AdamW's step counters aside."""
    import math

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = dcp.FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata.items()
    return sum(math.prod(meta.size) * meta.properties.dtype.itemsize for name, meta in entries
               if isinstance(meta, TensorStorageMetadata) and not name.endswith(".step"))


def load_checkpoint_model(ckpt_dir: Path) -> dict:
    """The model weights of a DCP checkpoint as full tensors, read without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt_dir.parent / (ckpt_dir.name + ".pt")
    dcp_to_torch_save(str(ckpt_dir), str(out))
    return torch.load(out, weights_only=False)["model"]


# 2 ranks, 3 shuffled steps of 8 short samples, checkpoints at steps 2 and 3: the reference that
# the same job launched another way (two nodes, the model by hub id) must reproduce
TWO_RANK_STEPS = 3


def two_rank_job(train_file: Path, run_dir, *extra: str) -> list[str]:
    """On gsm8k_head's rows (its 3 steps shuffle them)."""
    return [*BASE_OVERRIDES, f"data.train_files={train_file}", f"trainer.default_local_dir={run_dir}",
            "data.max_length=128", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=2",
            f"trainer.total_training_steps={TWO_RANK_STEPS}", "trainer.save_freq=2", "data.shuffle=true", *extra]


@pytest.fixture(scope="session")
def two_rank_run(gsm8k_head, tmp_path_factory) -> Path:
    """two_rank_job on one node with torchrun, run once for the tests comparing other launches with it."""
    def build(out: Path) -> None:
        run_sfttrain(2, two_rank_job(gsm8k_head, out / "run"))

    return built_once(tmp_path_factory, "two_rank", build) / "run"


@pytest.fixture(scope="session")
def demo_run(gsm8k_dir, gsm8k_val, tmp_path_factory) -> tuple[Path, str]:
    """The demo's settings, shortened (2 ranks, 24 steps of 16 shuffled samples, validation on
    gsm8k_val, a checkpoint and a log line every 12 steps), run once for the tests of what a run
    learns, logs and plots: (its run folder, its output)."""
    def build(out: Path) -> None:
        proc = run_sfttrain(2, [*BASE_OVERRIDES, f"data.train_files={gsm8k_dir}/train.parquet",
                                f"data.val_files={gsm8k_val}", f"trainer.default_local_dir={out / 'run'}",
                                "data.train_batch_size=16", "data.micro_batch_size_per_gpu=8", "data.shuffle=true",
                                "optim.lr=3e-3", "trainer.total_training_steps=24", "trainer.test_freq=12",
                                "trainer.save_freq=12", "trainer.log_freq=12"])
        (out / "output.log").write_text(proc.stdout)

    out = built_once(tmp_path_factory, "demo", build)
    return out / "run", (out / "output.log").read_text()


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory) -> Path:
    """A Qwen2-architecture model with random weights, tiny, beside the real Qwen2.5 tokenizer
    (chat template included): stands in for Qwen/Qwen2.5-0.5B-Instruct on CPU."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    def build(out: Path) -> None:
        tok = AutoTokenizer.from_pretrained(ASSETS / "tokenizers" / "qwen2.5-instruct")
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                             tie_word_embeddings=True, eos_token_id=tok.eos_token_id)
        Qwen2ForCausalLM(config).save_pretrained(out)
        tok.save_pretrained(out)

    return built_once(tmp_path_factory, "tiny_qwen", build)
