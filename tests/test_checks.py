"""The start-up checks (sfttrain/checks.py): the run and the preflight list the same problems, every one
of them, before any compute. Each case runs a real one-rank job of sfttrain.run (conftest's launch) and
sfttrain.plan's main on the same command line."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import BASE_OVERRIDES, run_sfttrain
from tests.test_plan import run_plan

KEY = re.compile(r"\b(?:data|model|optim|trainer)\.[a-z_0-9]+(?:\.[a-z_0-9]+)*")


def misspelled_file(tmp: Path) -> list[str]:
    return [f"data.train_files={tmp / 'trian.parquet'}"]


# each case: the overrides that make the mistake (given the test's folder), and the keys its problem names
CASES = {
    "a data file misspelled": (misspelled_file, {"data.train_files"}),
    "a validation file missing": (lambda tmp: [f"data.val_files={tmp / 'nowhere' / 'val.parquet'}"],
                                  {"data.val_files"}),
    # the data is read from this machine's files (a URL ran on to a TypeError after the checks)
    "a remote URL": (lambda tmp: ["data.train_files=s3://bucket/train.parquet"], {"data.train_files"}),
    "max_length above the model's positions": (lambda tmp: ["data.max_length=1024"],
                                               {"data.max_length", "data.truncation",
                                                "data.allow_beyond_max_position"}),
    "a batch that does not divide": (lambda tmp: ["data.train_batch_size=7", "data.micro_batch_size_per_gpu=2"],
                                     {"data.train_batch_size", "data.micro_batch_size_per_gpu"}),
    "a row too long": (lambda tmp: ["data.truncation=error", "data.max_length=64"],
                       {"data.max_length", "data.truncation"}),
    "a model folder missing": (lambda tmp: [f"model.partial_pretrain={tmp / 'no_model'}"], {"model.partial_pretrain"}),
    "a loss kernel the device cannot run": (lambda tmp: ["model.loss_kernel=liger"], {"model.loss_kernel"}),
    "fp8 on the CPU": (lambda tmp: ["model.fp8=tensorwise"], {"model.fp8"}),
}


def job(tmp: Path, gsm8k_dir: Path, mistakes: list[str]) -> list[str]:
    """A 1-rank CPU job of stories260K on 40 GSM8K rows, with `mistakes`."""
    rows = tmp / "train.parquet"
    pq.write_table(pq.read_table(gsm8k_dir / "train.parquet").slice(0, 40), rows)
    return [*BASE_OVERRIDES, f"data.train_files={rows}", "data.train_batch_size=8", "trainer.total_training_steps=1",
            f"trainer.default_local_dir={tmp / 'run'}", *mistakes]


def refused(overrides: list[str]) -> tuple[int, str]:
    """The run's exit code and its message (the problems, one or more a line, the job's last words: nothing
    is printed after them)."""
    done = run_sfttrain(1, overrides, check=False, timeout=600)
    message = re.search(r"^sfttrain: [a-z ]+: (.*)", done.stdout, re.MULTILINE | re.DOTALL)
    assert message, done.stdout[-5000:]
    return done.returncode, message.group(1)


def planned(overrides: list[str]) -> tuple[int, str]:
    """The preflight's exit code and its problems."""
    code, out = run_plan(*overrides, "--nproc", "1")
    return code, out.split("problems:")[-1] if "problems:" in out else ""


@pytest.mark.parametrize("case", CASES)
def test_the_run_and_the_preflight_name_the_same_keys(case, gsm8k_dir, tmp_path):
    mistakes, keys = CASES[case]
    overrides = job(tmp_path, gsm8k_dir, mistakes(tmp_path))
    run_code, message = refused(overrides)
    plan_code, problems = planned(overrides)
    assert run_code in (2, 3, 5) and plan_code == 2, (message, problems)
    assert set(KEY.findall(message)) == set(KEY.findall(problems)) == keys, (message, problems)


def test_five_mistakes_are_listed_at_once_by_both(gsm8k_dir, tmp_path):
    """A misspelled data file (named with the file it most likely meant), max_length above the model's
    positions, a batch that does not divide, a value the config refuses (a negative learning rate) and a
    key it does not know (Hugging Face's name, with the key meant): all five from one start of the run and
    from the preflight; the run exits with the code of the first one's kind (the config's, 2: the config's
    keys and values and the model's checks come before the data's)."""
    overrides = job(tmp_path, gsm8k_dir, [*misspelled_file(tmp_path), "data.max_length=1024",
                                          "data.train_batch_size=7", "data.micro_batch_size_per_gpu=2",
                                          "optim.lr=-1", "trainer.save_steps=5"])
    run_code, message = refused(overrides)
    plan_code, problems = planned(overrides)
    expected = [f"data file '{tmp_path / 'trian.parquet'}' does not exist (check data.train_files; did you mean "
                f"{tmp_path / 'train.parquet'}?)",
                "data.max_length=1024 is above the model's max_position_embeddings=512",
                "data.train_batch_size=7 gives 7 samples per data-parallel rank",
                "optim.lr=-1.0 is negative",
                "unknown config key 'trainer.save_steps'; did you mean trainer.save_freq?"]
    assert run_code == 2 and plan_code == 2, (message, problems)
    assert all(e in message and e in problems for e in expected), (message, problems)


def test_a_good_job_passes_every_check_of_the_registry(gsm8k_dir, tmp_path):
    """Each check of the registry on a job that trains (the cases above, without a mistake): no problem and no
    note, on the device the run takes and as the preflight plans it. A check that returned a value it meant
    as an answer (a backend's name) would be a problem here, and every run would stop on it."""
    from sfttrain.checks import Startup, run_checks
    from sfttrain.config import load_config

    cfg = load_config(None, job(tmp_path, gsm8k_dir, []))
    for planning in (False, True):
        found = run_checks(Startup(cfg, 1, ("cpu",), planning=planning))
        assert found.problems == [] and found.notes == [], (planning, found)
