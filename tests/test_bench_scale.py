"""bench/'s scripts of scale (tests/bench_run.py says what the bench tests check): background
checkpoints, long context with sequence parallelism, and a run of bench.scale."""

from __future__ import annotations

import signal

from tests.bench_run import SAMPLE, records, run_bench_here
from tests.conftest import BASE_OVERRIDES, kill_job, launch, logged_steps


def test_async_ckpt(tmp_path):
    """A background setting's run with periodic saves, beside the disk's speed (each setting is a run of the
    same loop: the synchronous save's record is sfttrain's, tests/test_checkpoint.py checks it)."""
    out = tmp_path / "ckpt.jsonl"
    run_bench_here("bench.async_ckpt", "--tiny", "--setting", "async_pinned", "--data", SAMPLE,
                   "--work", str(tmp_path), "--out", str(out))
    (background,) = records(out)
    assert background["setting"] == "async_pinned" and [s["async"] for s in background["saves"]] == [True, True]
    assert background["disk_gb_per_s"] > 0 and background["write_gb_per_s_median"] > 0
    # each step's time and tokens/s from step 3 on, the steps after the saves among them
    timed = {int(step) for step in background["step_s_tokens_per_s"]}
    assert min(timed) == 3 and {s["step"] + 1 for s in background["saves"]} <= timed, background


def test_long_context(tmp_path):
    """One sp=2 job (2 gloo ranks) on 256-token samples, its record appended to a results file that
    already holds another bench's."""
    out = tmp_path / "w3.jsonl"
    out.write_text('{"system": "sfttrain", "variant": "compile", "real_tokens_per_s": 1.0}\n')
    run_bench_here("bench.long_context", "--tiny", "--sp", "2", "--lengths", "256", "--work", str(tmp_path),
                   "--out", str(out))
    (_, record) = records(out)
    assert record["status"] == "trained" and record["sp"] == 2 and record["timed_steps"] == [2, 3]


def test_scale(tmp_path):
    """One run of the part (its W2b run: both model folders prepared, 2 ranks, FULL_SHARD)."""
    out = tmp_path / "scale.jsonl"
    run_bench_here("bench.scale", "--tiny", "--part", "w2b", "--run", "w2b_full_shard_ckpt", "--data", SAMPLE,
                   "--work", str(tmp_path), "--out", str(out))
    (record,) = records(out)
    assert record["steps_logged"] == 4 and record["real_tokens_per_s"] > 0, record


def test_a_failed_job_keeps_why(tmp_path):
    """A failed bench job's record (bench/jobs.py: long_context's and scale's) keeps the part of its log
    that says why: a crash's Python stack (above torchrun's summary, which says only the signal), else
    sfttrain's message, else the first traceback, a rank's, not torchrun's own after it."""
    from bench.jobs import why_it_failed

    log = tmp_path / "log.txt"
    start = "sfttrain\n  world size : 1\n" + "step 1/4 | loss 12.9\n" * 200
    crash = ("Fatal Python error: Segmentation fault\n\nThread 0x1 (most recent call first):\n"
             "  File \"sfttrain/trainer.py\", line 198 in forward_backward\n")
    rank = "[rank0]: Traceback (most recent call last):\n[rank0]: torch.OutOfMemoryError: CUDA out of memory.\n"
    summary = 20 * ("Traceback (most recent call last):\n  File \"torch/distributed/run.py\"\n"
                    "ChildFailedError:\n  exitcode  : -11\n")
    for text, cause in ((start + crash + summary, crash), (start + rank + summary, rank),
                        (start + "sfttrain: config error: data.max_length\n" + summary, "sfttrain: config error")):
        log.write_text(text)
        assert why_it_failed(str(log)).startswith(cause)
    log.write_text(start)
    assert why_it_failed(str(log), chars=3000) == start[-3000:]


def test_a_job_stopped_at_its_timeout_leaves_its_stacks(gsm8k_head, tmp_path):
    """What a bench does with a job still running at its timeout (bench/jobs.py): torchrun's 2 ranks,
    each with a DataLoader worker, print their threads' Python stacks into the job's log (SIGUSR1),
    torchrun's agent is spared that signal (it would end it), and the job is then stopped. The
    record's excerpt of the log starts at the stacks."""
    from bench.jobs import NO_SAVE_ON_STOP, stop, why_it_failed
    from sfttrain.runtime import STACKS_HEADER
    from tests.test_checkpoint import wait_until

    run_dir, log = tmp_path / "run", tmp_path / "log"
    proc = launch(2, [*BASE_OVERRIDES, f"data.train_files={gsm8k_head}", f"trainer.default_local_dir={run_dir}",
                      "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2",
                      "trainer.total_training_steps=100000", "data.num_workers=1", NO_SAVE_ON_STOP],
                  log, torchrun=True)
    try:
        assert wait_until(lambda: logged_steps(run_dir) >= 1, proc), log.read_text()[-3000:]
        stop(proc, stacks=True)
    finally:
        kill_job(proc)
    assert proc.returncode != -signal.SIGUSR1, log.read_text()[-3000:]
    stacks = why_it_failed(str(log), chars=len(log.read_text()))
    assert STACKS_HEADER in stacks.split("\n", 1)[0], stacks[:3000]
    # the main thread's stack of each rank and each worker
    # (forked from the rank's main thread, so its stack goes on from there) has one <module> frame
    # (sfttrain.run's); a worker's also has torch's worker loop.
    assert stacks.count("<module>") >= 4 and stacks.count("torch/utils/data/_utils/worker.py") >= 2, stacks
