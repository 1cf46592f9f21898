"""bench/'s scripts of scale (tests/bench_run.py says what the bench tests check): background
checkpoints, long context with sequence parallelism, and a run of bench.scale."""

from __future__ import annotations

from tests.bench_run import SAMPLE, records, run_bench_here


def test_async_ckpt(tmp_path):
    """A background and a synchronous setting, each a run with periodic saves, beside the disk's speed."""
    out = tmp_path / "ckpt.jsonl"
    run_bench_here("bench.async_ckpt", "--tiny", "--setting", "async_pinned", "sync", "--data", SAMPLE,
                   "--work", str(tmp_path), "--out", str(out))
    background, synchronous = records(out)
    assert (background["setting"], synchronous["setting"]) == ("async_pinned", "sync")
    assert [s["async"] for s in background["saves"]] == [True, True] and not synchronous["saves"][0]["async"]
    assert all(r["disk_gb_per_s"] > 0 and r["write_gb_per_s_median"] > 0 for r in (background, synchronous))
    # each step's time and tokens/s from step 3 on, the steps after the saves among them
    timed = {int(step) for step in background["step_s_tokens_per_s"]}
    assert min(timed) == 3 and {s["step"] + 1 for s in background["saves"]} <= timed, background


def test_long_context(tmp_path):
    """One sp=2 job (2 gloo ranks) on 256-token samples."""
    out = tmp_path / "w3.jsonl"
    run_bench_here("bench.long_context", "--tiny", "--sp", "2", "--lengths", "256", "--work", str(tmp_path),
                   "--out", str(out))
    (record,) = records(out)
    assert record["status"] == "trained" and record["sp"] == 2 and record["timed_steps"] == [2, 3]


def test_scale(tmp_path):
    """One run of the part (its W2b run: both model folders prepared, 2 ranks, FULL_SHARD)."""
    out = tmp_path / "scale.jsonl"
    run_bench_here("bench.scale", "--tiny", "--part", "w2b", "--run", "w2b_full_shard_ckpt", "--data", SAMPLE,
                   "--work", str(tmp_path), "--out", str(out))
    (record,) = records(out)
    assert record["steps_logged"] == 4 and record["real_tokens_per_s"] > 0, record
