"""Two "nodes" on localhost: two torchrun agents (`--nnodes=2`, one rank each) meeting through the
c10d rendezvous, as slurm/sft_multinode.sbatch starts them on a cluster.

2 nodes x 1 rank must train exactly as 1 node x 2 ranks: the ranks, their data and their
collectives are the same, only the launch differs (which agent's rank is rank 0 is decided by
the rendezvous; the step's gradient is the sum over the two ranks either way, and a sum of two
float32 terms does not depend on their order). fp32 on CPU, so losses and weights agree to
1e-6 (in practice bit for bit).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import (REPO, TWO_RANK_STEPS, free_port, kill_job, load_checkpoint_model, rank_env, train_losses,
                            two_rank_job)

TOL = 1e-6
STEPS = TWO_RANK_STEPS


def run_two_nodes(overrides: list[str], logs: Path, node_env: list[dict],
                  timeout: int = 300) -> tuple[list[str], list[int]]:
    """Starts one torchrun agent per "node" (its own environment), waits for both; returns their logs
    and exit codes. Once one agent has failed, the other is killed 5 s later, as srun's
    --kill-on-bad-exit does on a cluster (left alone, its rank would wait sfttrain.run's
    WAIT_FOR_RANK0_S for rank 0 to end the job, which torchrun cannot do across nodes)."""
    port = free_port()
    procs = []
    for node, extra in enumerate(node_env):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=test", "--max_restarts=0",
               "-m", "sfttrain.run", *overrides]
        env = rank_env(extra)
        with open(logs / f"node{node}.log", "w") as f:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    try:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + 5)
            time.sleep(0.2)
    finally:
        for proc in procs:
            kill_job(proc)
    return [(logs / f"node{node}.log").read_text() for node in range(len(node_env))], [p.returncode for p in procs]


def test_two_nodes_train_as_one_node_with_two_ranks(gsm8k_head, tmp_path, two_rank_run):
    outs, codes = run_two_nodes(two_rank_job(gsm8k_head, str(tmp_path / "two_nodes")), tmp_path, [{}, {}])
    assert codes == [0, 0], "\n".join(out[-3000:] for out in outs)
    one_node = two_rank_run  # the same job, one torchrun agent with 2 ranks
    two, one = train_losses(tmp_path / "two_nodes"), train_losses(one_node)
    assert len(two) == STEPS and max(abs(a - b) for a, b in zip(two, one)) <= TOL, (two, one)
    for step in (2, STEPS):
        got = load_checkpoint_model(tmp_path / "two_nodes" / f"global_step_{step}")
        want = load_checkpoint_model(one_node / f"global_step_{step}")
        assert max((got[k] - want[k]).abs().max().item() for k in want) <= TOL
    start = load_checkpoint_model(one_node / "global_step_2")
    assert max((want[k] - start[k]).abs().max().item() for k in want) > 1e-4  # the weights did move


def test_run_folder_not_shared_between_nodes_is_refused(gsm8k_head, tmp_path):
    """The run folder named through each node's own $TMPDIR (node-local scratch on a cluster), as
    a user would write it: every node resolves it to a folder of its own. The run stops at
    start-up with one message naming trainer.default_local_dir and the ranks that are blind."""
    nodes = [{"TMPDIR": str(tmp_path / f"scratch{node}")} for node in range(2)]
    for env in nodes:
        Path(env["TMPDIR"]).mkdir()
    outs, _ = run_two_nodes(two_rank_job(gsm8k_head, "${oc.env:TMPDIR}/run"), tmp_path, nodes)
    both = "".join(outs)
    # rank 0's agent reports its exit code 2, a configuration error (sfttrain.errors); the other rank
    # waits for rank 0 to end the job (sfttrain.run.stop) and is killed with its node
    assert "exitcode  : 2 " in both, both[-3000:]
    # once per node log at most (each node's launcher writes its own; the rank that knows says it),
    # as its own line
    per_node = [[line for line in out.splitlines() if line.startswith("sfttrain: ")] for out in outs]
    assert all(len(lines) <= 1 for lines in per_node), both[-3000:]
    printed = [line for lines in per_node for line in lines]
    assert printed and printed[0].startswith("sfttrain: config error: trainer.default_local_dir=")
    assert "is not one folder shared by every node" in printed[0]
    assert "cannot see" in both and "rank 1 on" in both
    assert "model               :" not in both  # stopped before the model was loaded
    for node in range(2):  # nothing was saved on either node
        assert not list((tmp_path / f"scratch{node}" / "run").glob("global_step_*"))


def test_one_torchrun_per_node_is_what_passes(monkeypatch):
    """srun's tasks per node (SLURM_STEP_TASKS_PER_NODE, as srun writes it) against torchrun's ranks
    per launcher (LOCAL_WORLD_SIZE): several torchruns of several ranks on a node are refused; one
    torchrun per node, one rank per srun task (torchrun --nproc_per_node=1), or no srun, pass."""
    import pytest

    from sfttrain.config import ConfigError
    from sfttrain.distributed import check_one_launcher_per_node

    for tasks, ranks, refused in (("8(x2)", "8", True), ("2,1", "4", True), ("1(x4)", "8", False),
                                  ("8(x2)", "1", False), (None, "8", False)):
        if tasks is None:
            monkeypatch.delenv("SLURM_STEP_TASKS_PER_NODE", raising=False)
        else:
            monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", tasks)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        if refused:
            with pytest.raises(ConfigError, match="Start one torchrun per node"):
                check_one_launcher_per_node()
        else:
            check_one_launcher_per_node()
