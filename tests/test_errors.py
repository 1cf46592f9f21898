"""The catalogue of user mistakes: one clean message, printed once, the exit code of its kind
(sfttrain/run.py), and no traceback from sfttrain's ranks. Every mistake ends through the one path,
sfttrain.run.stop; one case of each exit kind, of one rank and of two, runs under torchrun, whose
summary must show the message as the root cause (torchrun's launcher prints its own traceback for
any failed child: that one is allowed, and only that one). The rest run on the suite's forked ranks
(`python -m sfttrain.run` for one: no torchrun start-up per case), and print no traceback.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from tests.conftest import (BASE_OVERRIDES, REPO, STORIES, ForkedJob, descendants, kill_job, launch, logged_steps,
                            run_alone, run_sfttrain)

CONFIG, DATA, NON_FINITE, DEPENDENCY = 2, 3, 4, 5


@dataclass
class Case:
    overrides: list[str]
    needles: list[str]
    code: int
    nproc: int = 1  # 2 where ranks matter (said once; batch arithmetic)
    env: dict = field(default_factory=dict)
    yaml: str | None = None  # a recipe file's text, passed before the overrides
    torchrun: bool | None = None  # launched by torchrun, its summary checked (default: where two ranks run)

    def __post_init__(self):
        self.torchrun = self.nproc > 1 if self.torchrun is None else self.torchrun


def catalogue(tmp: Path) -> dict[str, Case]:
    empty, zero = tmp / "empty.parquet", tmp / "zero.parquet"
    pq.write_table(pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), empty)
    zero.write_bytes(b"")
    messages = tmp / "messages.parquet"
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]]}),
                   messages)
    (tmp / "broken.jinja").write_text("{% for m in messages %}{{ m.content }}")  # no endfor
    # parses, renders the start-up's probe, and fails in a branch that only GSM8K's row 1 ("Weng earns...") takes
    (tmp / "weng.jinja").write_text("{% for m in messages %}{% if 'Weng' in m.content %}{{ 1 // 0 }}{% endif %}"
                                    "{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}Answer: {% endif %}")
    dynamic = tmp / "dynamic_rope"  # stories260K with dynamic-NTK RoPE beyond 128 positions
    shutil.copytree(STORIES, dynamic)
    config = json.loads((dynamic / "config.json").read_text())
    (dynamic / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128,
                                                     "rope_scaling": {"type": "dynamic", "factor": 2.0}}))
    added = tmp / "added_token"  # stories260K whose tokenizer has one token more than its 512 embedding rows
    shutil.copytree(STORIES, added)
    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    tokenizer.add_tokens(["Natalia"])  # in the first GSM8K row
    tokenizer.save_pretrained(added)
    home = tmp / "home"
    home.mkdir()
    shim = tmp / "no_wandb"
    shim.mkdir()
    (shim / "wandb.py").write_text("raise ImportError('No module named wandb (test shim)')\n")
    return {
        "misspelled_key": Case(["data.micro_batch_sise_per_gpu=2"], [
            "unknown config key 'data.micro_batch_sise_per_gpu'; did you mean data.micro_batch_size_per_gpu?"],
            CONFIG, nproc=2, torchrun=False),
        "wrong_type": Case(["data.max_length=long"], ["data.max_length", "long"], CONFIG),
        "yaml_syntax": Case([], ["is not valid YAML", "line 3"], CONFIG, yaml="data:\n  train_files: [a\n  x: 1\n"),
        "nan_lr": Case(["optim.lr=nan"], ["optim.lr=nan is not a finite number"], CONFIG),
        "missing_wandb": Case(["trainer.logger=wandb"], ["trainer.logger includes wandb but `import wandb` fails",
                                                         "pip install wandb", "trainer.logger=console"],
                              DEPENDENCY, env={"PYTHONPATH": f"{shim}:{REPO}"}, torchrun=True),
        # wandb installed, online, without a key (an empty HOME: no ~/.netrc) and without a terminal to ask on:
        # said before the model loads
        "wandb_not_logged_in": Case(["trainer.logger=wandb"], [
            "trainer.logger includes wandb, and wandb could not start a run", "wandb login", "WANDB_MODE=offline",
            "trainer.logger=console"], DEPENDENCY,
            env={"WANDB_MODE": "online", "WANDB_API_KEY": "", "HOME": str(home), "NETRC": str(home / ".netrc")}),
        "non_divisible_batch": Case(["data.train_batch_size=10", "data.micro_batch_size_per_gpu=4"], [
            "data.train_batch_size=10 gives 5 samples per data-parallel rank over 2 data-parallel ranks, "
            "not divisible by data.micro_batch_size_per_gpu=4; use data.train_batch_size=8 or 16"], CONFIG, nproc=2,
            torchrun=False),
        "missing_model": Case([f"model.partial_pretrain={tmp}/no_model"], ["no_model", "not a local model folder"],
                              CONFIG),
        "missing_chat_template": Case(["data.apply_chat_template=true"], [
            "the tokenizer has no chat template", "data.apply_chat_template=false"], CONFIG),
        # a template file that does not parse; the template text itself on the command line (YAML
        # cannot read it: it must reach the check as text, not end in a ScannerError)
        "template_file_fails": Case(["data.apply_chat_template=true", f"data.chat_template={tmp}/broken.jinja"], [
            "data.chat_template=", "broken.jinja", "does not parse or render", "TemplateSyntaxError"], CONFIG),
        "template_text_fails": Case(["data.apply_chat_template=true",
                                     "data.chat_template={% for m in messages %}{{ m.content }"],
                                    ["data.chat_template='{% for m in messages %}{{ m.content }'",
                                     "does not parse or render"], CONFIG),
        "template_fails_on_a_row": Case(["data.apply_chat_template=true", f"data.chat_template={tmp}/weng.jinja"], [
            "train.parquet row 1: the chat template failed on this row's prompt (as one user turn): ZeroDivisionError: "
            "integer division or modulo by zero; fix the template"], DATA),
        "multiturn_without_template": Case(["data.multiturn.enable=true", "data.apply_chat_template=true"], [
            "the tokenizer has no chat template; pass a Jinja template (a file or its text) with data.chat_template="],
            CONFIG),
        "messages_read_as_prompt": Case([f"data.train_files={messages}"], [
            "no column 'question'", "data.multiturn.enable=true"], DATA),
        "batch_dependent_rope": Case([f"model.partial_pretrain={dynamic}"], [
            "rope_scaling rope_type='dynamic'", "data.max_length=256 above original_max_position_embeddings=128",
            "Set data.max_length<=128"], CONFIG),
        "token_past_the_embedding": Case([f"model.partial_pretrain={added}"], [
            "train.parquet",
            "row 0: the row has token ids [512] (['Natalia']) at or past the model's 512 embedding rows",
            "resize_token_embeddings"], DATA),
        # a seed article's sbatch: `#SBATCH --ntasks-per-node=8`, then `srun torchrun --nproc_per_node=8 ...`
        "torchrun_per_task": Case([], ["srun started 8 tasks on a node (SLURM_STEP_TASKS_PER_NODE=8(x2))",
                                       "--nproc_per_node=2: 16 ranks per node", "--ntasks-per-node=1"], CONFIG,
                                  nproc=2, env={"SLURM_STEP_TASKS_PER_NODE": "8(x2)"}),
        "missing_column": Case(["data.prompt_key=prompt"], ["train.parquet", "no column 'prompt'", "'question'"],
                               DATA),
        "profile_beyond_the_run": Case(["trainer.profile_steps=[3,4]"], [
            "trainer.profile_steps=[3, 4]: the run has 3 steps"], CONFIG),
        "missing_path": Case([f"data.val_files={tmp}/nope.parquet"], [f"{tmp}/nope.parquet", "does not exist"], DATA),
        # TRL takes a hub dataset's id where sfttrain (as verl) takes files
        "hub_dataset_id": Case(["data.train_files=openai/gsm8k"], [
            "data file 'openai/gsm8k' does not exist", "looks like a Hugging Face hub dataset id",
            "datasets.load_dataset('openai/gsm8k', split='train').to_parquet('train.parquet')"], DATA),
        "empty_file": Case([f"data.val_files={empty}"], [str(empty), "has no rows"], DATA),
        "zero_byte_parquet": Case([f"data.val_files={zero}"], [str(zero), "not a readable Parquet file (0 bytes"],
                                  DATA),
        "over_length_row": Case(["data.truncation=error"], [
            "row", "more than data.max_length=256", "data.truncation=left|right"], DATA, nproc=2),
        # step 1 is finite and moves every weight by ~lr; step 2 is the first to be named, though
        # the trainer reads a step's numbers only once the next step is queued
        "non_finite_loss": Case(["optim.lr=1e30", "optim.clip_grad=0", "data.train_batch_size=4",
                                 "data.micro_batch_size_per_gpu=4"],
                                ["non-finite loss", "at step 2 ", "NOT applied",
                                 "The same command then starts afresh: no checkpoint was committed yet"],
                                NON_FINITE, torchrun=True),
    }


def _run(name: str, case: Case, tmp: Path, train_file: Path):
    run_dir = tmp / name
    args = [*BASE_OVERRIDES, f"data.train_files={train_file}", f"trainer.default_local_dir={run_dir}",
            "trainer.total_training_steps=3", *case.overrides]
    if case.yaml is not None:
        recipe = tmp / f"{name}.yaml"
        recipe.write_text(case.yaml)
        args.insert(0, str(recipe))
    return run_sfttrain(case.nproc, args, check=False, env=case.env, timeout=400, torchrun=case.torchrun)


@pytest.fixture(scope="module")
def outcomes(gsm8k_head, tmp_path_factory):
    """Every case's output, the cases run three at a time (most stop before the model loads, so
    each is mostly start-up: overlapping them keeps the suite fast), on conftest's gsm8k_head (the
    rows the cases name, 0 and 1, and rows over 256 tokens are among its rows)."""
    tmp = tmp_path_factory.mktemp("errors")
    cases = catalogue(tmp)
    assert sorted(cases) == sorted(CASES)
    with ThreadPoolExecutor(3) as pool:
        procs = {name: pool.submit(_run, name, case, tmp, gsm8k_head) for name, case in cases.items()}
        return {name: (cases[name], procs[name].result(), tmp / name) for name in cases}


def launcher_traceback_only(out: str) -> bool:
    """Every traceback in `out` is torchrun's own (frames in torch.distributed and runpy only)."""
    for block in out.split("Traceback (most recent call last):")[1:]:
        frames = re.findall(r'^\s*File "([^"]+)"', block.split("ChildFailedError")[0], re.MULTILINE)
        if not frames or any("torch/distributed/" not in f and "<frozen" not in f for f in frames):
            return False
    return True


CASES = ["misspelled_key", "wrong_type", "yaml_syntax", "nan_lr", "missing_wandb", "wandb_not_logged_in",
         "non_divisible_batch",
         "missing_model", "missing_chat_template", "template_file_fails", "template_text_fails",
         "template_fails_on_a_row",
         "multiturn_without_template", "messages_read_as_prompt", "batch_dependent_rope", "profile_beyond_the_run",
         "token_past_the_embedding", "torchrun_per_task",
         "missing_column", "missing_path", "hub_dataset_id", "empty_file", "zero_byte_parquet", "over_length_row",
         "non_finite_loss"]


@pytest.mark.parametrize("name", CASES)
def test_user_mistake_ends_in_one_clean_message(outcomes, name):
    case, proc, run_dir = outcomes[name]
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    printed = [line for line in out.splitlines() if line.startswith("sfttrain: ")]
    assert len(printed) == 1, out[-3000:]  # once, by rank 0, at the start of its own line
    for needle in case.needles:
        assert needle in printed[0], out[-3000:]
    if case.torchrun:
        summary = out.split("sfttrain.run FAILED")[1]
        assert summary.count(printed[0]) == 1, summary  # only the rank that reports it wrote its error file
        root_cause = out.split("Root Cause (first observed failure):")[1]
        assert f"traceback : {printed[0]}" in root_cause, out[-3000:]
        codes = [int(c) for c in re.findall(r"exitcode\s+: (-?\d+)", out)]
        assert case.code in codes and set(codes) <= {case.code, -15}, codes  # -15: stopped by torchrun after the first
        assert launcher_traceback_only(out), out[-5000:]
    else:
        assert proc.returncode == case.code, out[-3000:]
        assert "Traceback" not in out, out[-5000:]
    assert not list(run_dir.glob("global_step_*"))  # nothing saved


def test_every_exit_kind_and_rank_count_reaches_torchrun_summary(tmp_path):
    """The catalogue runs under torchrun at least one case of each exit kind, of one rank and of two."""
    cases = catalogue(tmp_path).values()
    under_torchrun = [case for case in cases if case.torchrun]
    assert {case.code for case in under_torchrun} == {case.code for case in cases}
    assert {case.nproc for case in under_torchrun} == {1, 2}


def test_each_kind_has_its_own_exit_code():
    """The codes the catalogue expects are the ones sfttrain/errors.py gives each kind."""
    from sfttrain import errors
    from sfttrain.errors import ConfigError, DataError, DependencyError, NonFiniteLossError

    codes = [cls.exit_code for cls in (ConfigError, DataError, NonFiniteLossError, DependencyError)]
    assert codes == [CONFIG, DATA, NON_FINITE, DEPENDENCY]
    kinds = [k for k in vars(errors).values() if isinstance(k, type) and issubclass(k, errors.UserError)
             and k is not errors.UserError]
    assert sorted(k.exit_code for k in kinds) == list(range(2, 10)), kinds  # each kind its own code


def test_a_missing_gpu_package_is_a_missing_dependency(monkeypatch):
    """model.use_liger=true on a GPU without liger-kernel ends with exit code 5, a missing dependency as
    wandb's and torchao's are (it was a config error, 2), and names the install of the README's GPU
    extras into the checkout: sfttrain is no package on PyPI, so `pip install 'sfttrain[gpu]'`, which it
    named, would look for it there."""
    from sfttrain.errors import GPU_INSTALL, DependencyError
    from sfttrain.model import apply_liger

    assert f"`{GPU_INSTALL}`" in (REPO / "README.md").read_text()
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)  # not importable
    with pytest.raises(DependencyError, match=re.escape(f"liger-kernel is not installed: {GPU_INSTALL}")) as e:
        apply_liger(torch.nn.Module(), torch.device("cuda"), compile_layers=False)
    assert e.value.exit_code == DEPENDENCY


def rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    """The pid of a job's rank: forked by the suite's rank server, or a torchrun child whose
    environment says RANK (where SFTTRAIN_TEST_FORK=0 starts ranks the usual way)."""
    if isinstance(launcher, ForkedJob):
        return launcher.ranks()[rank]
    for pid in descendants(launcher.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"sfttrain.run" in cmdline and b"torch.distributed.run" not in cmdline:
            return pid
    return None


def test_collective_timeout_names_the_phase(gsm8k_head, tmp_path):
    """Two gloo ranks; rank 1 is frozen (SIGSTOP, a real stall) once training runs: rank 0's
    collective times out after trainer.nccl_timeout and it says which rank it is and the step it
    was in. Then rank 1 gets a segmentation fault (SIGSEGV, as from a kernel library): its log
    shows its Python stack in the trainer, not only the signal's number (torch's `record`, which
    sfttrain.run wraps the training in, turns on faulthandler)."""
    run_dir, log = tmp_path / "run", tmp_path / "log"
    proc = launch(2, [*BASE_OVERRIDES, f"data.train_files={gsm8k_head}", f"trainer.default_local_dir={run_dir}",
                      "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2",
                      "trainer.total_training_steps=100000", "trainer.nccl_timeout=20"],
                  log)
    try:
        deadline = time.monotonic() + 300
        while logged_steps(run_dir) < 1 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)  # a step logged: the ranks are past start-up's collectives
        assert logged_steps(run_dir) >= 1, log.read_text()[-3000:]
        os.kill(rank_pid(proc, 1), signal.SIGSTOP)
        deadline = time.monotonic() + 200
        while "sfttrain: rank 0 has been in" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        # a stopped rank takes its signals once continued, the fault first (it is synchronous)
        os.kill(rank_pid(proc, 1), signal.SIGSEGV)
        os.kill(rank_pid(proc, 1), signal.SIGCONT)
        deadline = time.monotonic() + 60
        while "Fatal Python error: Segmentation fault" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        kill_job(proc)
    out = log.read_text()
    fault = out.find("Fatal Python error: Segmentation fault")
    assert fault >= 0 and re.search(r"sfttrain/trainer\.py\", line \d+ in ", out[fault:]), out[-5000:]
    said = [line for line in out.splitlines() if line.startswith("sfttrain: rank 0 has been in")]
    assert len(said) == 1, out[-5000:]
    assert re.match(r"sfttrain: rank 0 has been in step \d+ for \d+ s, the collective timeout "
                    r"\(trainer.nccl_timeout=20\)", said[0]), said[0]


def ctrl_c_job(gsm8k_head: Path, run_dir: Path, log: Path, *overrides: str) -> tuple[int, str]:
    """A 2-rank job given SIGINT at both ranks at once, as a terminal's Ctrl-C reaches them, once a step is
    logged: (its exit code, its output)."""
    proc = launch(2, [*BASE_OVERRIDES, f"data.train_files={gsm8k_head}", f"trainer.default_local_dir={run_dir}",
                      "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2",
                      "trainer.total_training_steps=100000", *overrides], log)
    try:
        deadline = time.monotonic() + 300
        while logged_steps(run_dir) < 1 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert logged_steps(run_dir) >= 1, log.read_text()[-3000:]
        for pid in [rank_pid(proc, rank) for rank in (0, 1)]:
            os.kill(pid, signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        kill_job(proc)
    out = log.read_text()
    if not isinstance(proc, ForkedJob):  # torchrun's summary names the first failing rank's exit code
        code = int(re.findall(r"exitcode\s+: (-?\d+)", out)[0])
    return code, out


def test_ctrl_c_saves_and_stops_as_sigterm_does(gsm8k_head, tmp_path):
    """A first Ctrl-C in training saves the step in flight on every rank and stops: one message naming the
    step and its committed checkpoint, exit code 8. Before, it stopped at once and lost the steps since the
    last save, saying the same command resumes from "the last checkpoint committed"."""
    from sfttrain.checkpoint_folder import is_complete

    run_dir = tmp_path / "run"
    code, out = ctrl_c_job(gsm8k_head, run_dir, tmp_path / "log", "trainer.save_freq=100000")
    said = [line for line in out.splitlines() if line.startswith("sfttrain: ")]
    assert len(said) == 1 and code == 8, out[-3000:]
    stopped = re.search(rf"training stopped after step (\d+) of 100000, whose checkpoint "
                        rf"{run_dir}/global_step_(\d+) is committed\. ", said[0])
    assert stopped and stopped[1] == stopped[2], said[0]
    assert is_complete(str(run_dir / f"global_step_{stopped[1]}")), said[0]


def test_a_ctrl_c_that_stops_at_once_says_what_the_same_command_does(gsm8k_head, tmp_path):
    """Without trainer.save_on_sigterm a Ctrl-C stops every rank at once: one line, exit code 130, no
    traceback of either rank (one may have been in a collective with the other), saying what the same
    command does in a run folder with no checkpoint (it said "resumes from the last checkpoint committed")."""
    run_dir = tmp_path / "run"
    code, out = ctrl_c_job(gsm8k_head, run_dir, tmp_path / "log", "trainer.save_on_sigterm=false")
    said = [line for line in out.splitlines() if line.startswith("sfttrain: ")]
    assert len(said) == 1 and code == 130, out[-3000:]
    assert re.fullmatch(r"sfttrain: interrupted \(Ctrl-C\) in step \d+, without a save\. The same command then "
                        "starts afresh: no checkpoint was committed yet", said[0]), said[0]
    assert "Traceback" not in out.split("Root Cause")[0], out[-3000:]


def test_a_first_ctrl_c_is_noted_and_a_second_stops_at_once(monkeypatch):
    """In the training loop (Runtime.noting): a first Ctrl-C is noted for a save and stop, as a SIGTERM is;
    another within ECHO_S (torchrun passing the terminal's on) changes nothing; a later one raises
    KeyboardInterrupt; outside the loop, Ctrl-C has its previous action again."""
    from sfttrain import runtime

    monkeypatch.setattr(runtime, "ECHO_S", 0.5)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    outside = []
    signal.signal(signal.SIGINT, lambda *_: outside.append("SIGINT"))
    run = runtime.Runtime()
    try:
        with run.noting(True):
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            assert run.received == ["Ctrl-C (SIGINT)"] and not run.interrupted and not outside
            time.sleep(0.5)
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
            assert run.interrupted
        signal.raise_signal(signal.SIGINT)
        assert outside == ["SIGINT"]
    finally:
        run.close()
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])


def test_a_runtime_restores_what_it_changed(tmp_path):
    """A run's Runtime takes SIGINT, SIGTERM and SIGUSR1 and the run folder's lock; closed, the process has
    its handlers back and the folder is free (tests, and tools, run several runs in one process)."""
    from sfttrain.errors import ConfigError
    from sfttrain.resume import check_not_in_use, lock_run_folder
    from sfttrain.runtime import Runtime

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    run = Runtime().start()
    assert lock_run_folder(str(tmp_path), run.locks) == [] and len(run.locks) == 1
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) != before
    with pytest.raises(ConfigError, match="is in use by another sfttrain run"):
        check_not_in_use(str(tmp_path))
    run.close()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    check_not_in_use(str(tmp_path))
    again = Runtime().start()
    assert lock_run_folder(str(tmp_path), again.locks) == []
    again.close()


@functools.cache
def memory_limit() -> int:
    """A rank's address space (RLIMIT_AS; one thread for torch, two malloc arenas): 16 GiB more than an
    interpreter maps once it has imported sfttrain's trainer. A CUDA build of torch maps its libraries there,
    gigabytes of address space (none of it memory) that a fixed limit counted against the rank."""
    probe = subprocess.run([sys.executable, "-c", "import sfttrain.trainer; print(open('/proc/self/status').read())"],
                           cwd=REPO, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
                           check=True)
    return (int(re.search(r"VmPeak:\s+(\d+) kB", probe.stdout).group(1)) << 10) + (16 << 30)


def run_under_memory_limit(tmp_path: Path, train_file: Path, name: str, shape: dict, *overrides: str,
                           limit_host: bool = True):
    """One rank (`python -m sfttrain.run`) of a model built from stories260K's config with `shape`
    (random weights, its tokenizer), its address space limited (`memory_limit`; unless not limit_host: CUDA
    reserves more address space than that, and the GPUs are hidden where it is limited): an allocation past it
    fails in the allocator as on a host whose memory is used up, without touching that memory."""
    import resource

    limit_bytes = memory_limit() if limit_host else None

    folder = tmp_path / name
    folder.mkdir()
    for file in STORIES.glob("tokenizer*"):
        shutil.copy(file, folder)
    shutil.copy(STORIES / "special_tokens_map.json", folder)
    config = json.loads((STORIES / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1, **shape}))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    command = [sys.executable, "-m", "sfttrain.run", *BASE_OVERRIDES, f"model.partial_pretrain={folder}",
               "model.random_init=true", f"data.train_files={train_file}",
               f"trainer.default_local_dir={tmp_path / name}_run", *overrides]
    hidden = {"CUDA_VISIBLE_DEVICES": ""} if limit_host else {}
    return subprocess.run(command, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2", **hidden},
                          preexec_fn=limit if limit_host else None, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("where, shape, overrides, asked, fix", [
    # a 2^26 x 256 embedding: 64 GiB of fp32 in one tensor, made when the model is materialised
    ("start-up", {"vocab_size": 1 << 26, "hidden_size": 256, "head_dim": 32}, [], "64.00 GiB asked for",
     "model.fsdp_config.offload_params=true"),
    # a 2^20-token vocabulary: the loss's logits of an 8192-target-token chunk take 32 GiB
    ("step 1", {"vocab_size": 1 << 20}, ["model.loss_chunk_tokens=8192", "data.train_batch_size=128",
                                         "data.micro_batch_size_per_gpu=128"], "32.00 GiB asked for",
     "lower data.micro_batch_size_per_gpu=128"),
])
def test_out_of_memory_is_one_message_naming_the_phase_and_the_keys(gsm8k_head, tmp_path, where, shape, overrides,
                                                                      asked, fix):
    """A rank whose allocation fails (here the host's, past its address-space limit; a GPU's raises
    torch.OutOfMemoryError, read the same way) ends with one message, exit code 9: the phase, the size
    asked for, and the keys that shrink what that phase holds."""
    proc = run_under_memory_limit(tmp_path, gsm8k_head, "model", shape, *overrides)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 9 and "Traceback" not in out, out[-3000:]
    assert f"sfttrain: out of memory: rank 0 ran out of host memory in {where} ({asked})" in out, out[-3000:]
    assert fix in out, out[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's allocator")
def test_out_of_gpu_memory_is_the_same_one_message(gsm8k_head, tmp_path):
    """On a GPU: a 2^24-token vocabulary, whose loss logits for a chunk of ~12k target tokens take
    ~400 GB in bf16, more than any GPU holds: torch.OutOfMemoryError, said as one message (exit code
    9) with CUDA's own account of the memory."""
    proc = run_under_memory_limit(tmp_path, gsm8k_head, "model", {"vocab_size": 1 << 24}, "trainer.device=cuda",
                                  "model.fsdp_config.mixed_precision=true", "model.loss_chunk_tokens=16384",
                                  "data.train_batch_size=128", "data.micro_batch_size_per_gpu=128", limit_host=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 9 and "Traceback" not in out, out[-3000:]
    assert ("sfttrain: out of memory: rank 0 ran out of GPU memory in step 1 (CUDA out of memory. "
            "Tried to allocate") in out


def worker_job(train_file: Path, run_dir: Path) -> list[str]:
    """One rank whose steps (4 micro-batches of 2 rows, 20 tensors) a DataLoader worker builds."""
    return ["sfttrain.run", *BASE_OVERRIDES, f"data.train_files={train_file}",
            f"trainer.default_local_dir={run_dir}", "data.num_workers=1", "data.train_batch_size=8",
            "data.micro_batch_size_per_gpu=2", "data.max_length=128", "trainer.total_training_steps=2"]


def test_data_workers_within_the_open_files_limit(gsm8k_head, tmp_path):
    """A worker hands each tensor of a step to the rank as a file descriptor. Under a soft open files limit
    of 32 (`ulimit -n`; the hard one 4096) the run raises it and trains; under a hard limit of 32 it is
    refused at start-up (exit code 2), naming the limit and the fix, and listed by the preflight under that
    limit. Both hung before: the worker's handover failed on a thread of its own, which printed its error in a
    loop, and the rank waited."""
    import resource

    trained = run_alone(worker_job(gsm8k_head, tmp_path / "soft"), {resource.RLIMIT_NOFILE: (32, 4096)}, timeout=120)
    assert trained.returncode == 0 and "Traceback" not in trained.stdout, trained.stdout[-3000:]
    refused = run_alone(worker_job(gsm8k_head, tmp_path / "hard"), {resource.RLIMIT_NOFILE: (32, 32)}, timeout=120)
    assert refused.returncode == CONFIG and "Traceback" not in refused.stdout, refused.stdout[-3000:]
    message = re.search(r"^sfttrain: config error: (the open files limit of this job is 32 \(`ulimit -Hn`.*\), and a "
                        r"rank and each of its data workers need up to about \d+ here. Raise the open files limit.*)$",
                        refused.stdout, re.MULTILINE)
    assert message, refused.stdout[-3000:]
    # the preflight of the same job, started under the same limit, lists that refusal (it said no problem)
    plan = run_alone(["sfttrain.plan", *worker_job(gsm8k_head, tmp_path / "hard")[1:], "--nproc", "1"],
                     {resource.RLIMIT_NOFILE: (32, 32)}, timeout=120)
    assert plan.returncode == 2 and f"  - {message.group(1)}" in plan.stdout.split("problems:")[-1], plan.stdout[-3000:]


def test_data_workers_that_find_shared_memory_full(gsm8k_head, tmp_path):
    """A worker hands each step over in shared memory: a /dev/shm of 64 KiB (a real tmpfs, in a mount
    namespace of the run's own) holds no step. One message, exit code 9 (memory run out, as a worker
    killed by SIGBUS), naming /dev/shm and its fixes. It hung before: the copy into shared memory failed on
    the worker queue's feeder thread, which printed the error and dropped the step the rank waited for."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("a mount namespace of its own (unshare -m) needs root (CI runs as root)")
    small_shm = ("unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs /dev/shm && exec "$0" "$@"')
    out = run_alone(worker_job(gsm8k_head, tmp_path / "run"), prefix=small_shm, timeout=120).stdout
    printed = [line for line in out.splitlines() if line.startswith("sfttrain: ")]
    assert len(printed) == 1 and "Traceback" not in out, out[-3000:]
    assert printed[0].startswith("sfttrain: out of memory: rank 0's DataLoader worker could not hand a step over "
                                 "in step 1: the shared memory (/dev/shm) is full (RuntimeError: unable to allocate "
                                 "shared memory"), out[-3000:]
    assert "`docker run --shm-size=8g`" in printed[0] and "data.num_workers=0" in printed[0], out[-3000:]


# --------------------------------------------------------------------------- a full disk (tests/test_faults.py asks
# sfttrain.faults directly)

def test_a_full_data_cache_is_one_message_naming_its_file(tmp_path):
    """The conversion of JSON Lines rows into the run folder's data_cache/ finds its disk (a real 1 MiB tmpfs)
    full: one message at start-up (exit code 2) naming the conversion's file and the run folder's free space,
    and no partial file left."""
    import random
    import string

    from tests.test_checkpoint import one_message, tmpfs

    rows = tmp_path / "rows.jsonl"
    letters = random.Random(0)
    rows.write_text("".join(json.dumps({"prompt": "q", "response": "".join(letters.choices(string.ascii_letters,
                                                                                         k=8000))}) + "\n"
                            for _ in range(300)))  # 2.4 MB that Parquet cannot compress below 1 MiB
    run_dir = tmp_path / "disk" / "run"
    with tmpfs(tmp_path / "disk", 1 << 20):
        message = one_message(run_sfttrain(1, [*BASE_OVERRIDES, f"data.train_files={rows}", "data.prompt_key=prompt",
                                               "data.response_key=response", f"trainer.default_local_dir={run_dir}",
                                               "trainer.total_training_steps=1"], check=False), 2)
        assert re.search(rf"the disk is full \(.*No space left on device: {run_dir}/data_cache/rows\.\w+\.parquet\.\d+"
                         rf"\.tmp\) in start-up, before any step\. {run_dir} has [\d.]+ MB free\. Free space \(or set "
                         r"trainer.default_local_dir on a larger disk\), then run the same command$", message), message
        assert not list((run_dir / "data_cache").iterdir())


@pytest.mark.parametrize("exported", [True, False])
def test_a_finished_run_started_again_says_where_its_results_are(tmp_path, exported):
    """Its last checkpoint is the schedule's end: the start-up says that it finished, where its last checkpoint
    and its export are (or how to export it), and how to train longer or start afresh (it said only "nothing
    left to train", and the run ended saying its loss was not logged)."""
    from sfttrain.resume import check_schedule

    last = tmp_path / "run" / "global_step_3"
    (last / "huggingface" if exported else last).mkdir(parents=True)
    schedule = {"total steps": 3, "optim.lr": 1e-3}
    export = (f"its Hugging Face export is {last}/huggingface" if exported else "it has no Hugging Face export "
              f"(trainer.save_hf=true exports it now; `python -m sfttrain.export {last} OUT_DIR` does too)")
    assert check_schedule(str(last), {"step": 3, "schedule": schedule}, schedule) == [
        f"the checkpoint is this run's last step (3): nothing left to train. The run finished: its last checkpoint is "
        f"{last}, and {export}. To train longer, raise trainer.total_training_steps (or trainer.total_epochs); to "
        "start afresh, set trainer.default_local_dir to a new folder"]
