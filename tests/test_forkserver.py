"""The suite's forked ranks (tests/forkserver.py) behave where the tests rely on their launcher:
a failing rank stops the others and gives the job its status; the launcher's death ends its
ranks; a job whose environment differs from the server's is not forked. That a forked job trains
what a spawned one does is test_multinode's comparison (torchrun agents vs two_rank_run, forked)."""

from __future__ import annotations

import os
import time

from tests.conftest import BASE_OVERRIDES, ForkServer, alive, forks, rank_env, run_sfttrain

# a start-up error of every rank (no file needed): exit code 2, the config kind (sfttrain/errors.py)
CONFIG_ERROR = [*BASE_OVERRIDES, "data.train_files=unused.parquet", "trainer.no_such_key=1"]


def test_a_failing_rank_stops_the_others_and_gives_its_status(tmp_path):
    """Rank 0 reports the config error and exits 2; rank 1, which waits 60 s for rank 0 to end the
    job before it reports the error itself (sfttrain.run's stop), is stopped first: the message is
    printed once, as under torchrun."""
    log = tmp_path / "log"
    proc = ForkServer.get().launch(2, CONFIG_ERROR, log)
    assert proc.wait(timeout=300) == 2, log.read_text()[-3000:]
    printed = [line for line in log.read_text().splitlines() if line.startswith("sfttrain: ")]
    assert len(printed) == 1 and "trainer.no_such_key" in printed[0], log.read_text()[-3000:]


def test_the_launchers_death_ends_its_ranks(gsm8k_dir, tmp_path):
    """SIGKILL of the launcher alone (not kill_job) of a job that would run for minutes: the server
    kills the job's ranks."""
    log = tmp_path / "log"
    proc = ForkServer.get().launch(2, [*BASE_OVERRIDES, f"data.train_files={gsm8k_dir}/train.parquet",
                                       f"trainer.default_local_dir={tmp_path / 'run'}", "data.train_batch_size=8",
                                       "data.micro_batch_size_per_gpu=2", "trainer.total_training_steps=1000"], log)
    ranks = proc.ranks()
    assert len(ranks) == 2 and all(map(alive, ranks)), log.read_text()[-3000:]
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60  # the server reacts at once; the bound only ends a failing test
    while any(map(alive, ranks)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(alive, ranks)), log.read_text()[-3000:]


def test_only_the_servers_environment_is_forked():
    server, now = ForkServer.get(), rank_env()
    assert ForkServer.accepts(now), {k for k in server.env.keys() | now.keys() if server.env.get(k) != now.get(k)}
    assert not ForkServer.accepts(rank_env({"HF_HUB_OFFLINE": "1"}))
    assert not ForkServer.accepts(rank_env({"OMP_NUM_THREADS": "2"}))
    # inductor exports its default cache folder into this process once a test compiles in it, and
    # an address in this process for its C++ kernels
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    cache_dir()
    assert ForkServer.accepts(rank_env())
    assert ForkServer.accepts(rank_env({"TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}))
    assert not ForkServer.accepts(rank_env({"TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}))
    assert ForkServer.accepts(rank_env({"_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR": "140265057340448"}))


def torch_logs_are(setting: str) -> None:
    """On a rank: torch logs what TORCH_LOGS asks for."""
    from torch._logging._internal import log_state

    assert os.environ["TORCH_LOGS"] == setting and log_state.is_artifact_enabled(setting)


def test_a_forked_rank_reads_torch_logs_again():
    """TORCH_LOGS (tests/test_trainer.py counts recompilations with it), which torch reads at import, is read
    again by a forked rank: the job's setting is torch's there."""
    env = {"TORCH_LOGS": "recompiles"}
    assert forks(env=env)
    run_sfttrain(2, [__name__, torch_logs_are.__name__, "recompiles"], module="tests.rank_function", env=env)
