"""Hub ids in model.partial_pretrain: read from a local Hugging Face cache (offline), or a clear
message when the model is not there.

The cache is laid out as huggingface_hub lays it out (blobs named by their hash, a snapshot folder
of symlinks named by the commit, refs/main naming the commit), holding the real stories260K files
under the id `org/name`; HF_HUB_OFFLINE=1 keeps the test off the network, as on a cluster's nodes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from sfttrain.hub import is_repo_id
from tests.conftest import STORIES, run_sfttrain, train_losses, two_rank_job

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo = cache / "models--org--name"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in STORIES.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


def job(train_file: Path, run_dir: Path, model: str) -> list[str]:
    return two_rank_job(train_file, run_dir, f"model.partial_pretrain={model}")


def test_hub_id_trains_from_the_local_cache(gsm8k_head, hub_cache, tmp_path, two_rank_run):
    """`org/name` resolves to the cached snapshot on both ranks: the run equals the same run
    from the local folder (conftest's two_rank_run: same model, same data, fp32), and its
    checkpoint holds the tokenizer."""
    offline = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    proc = run_sfttrain(2, job(gsm8k_head, tmp_path / "hub", "org/name"), env=offline)
    assert "model               : org/name" in proc.stdout
    assert train_losses(tmp_path / "hub") == train_losses(two_rank_run)
    assert (tmp_path / "hub" / "global_step_3" / "hf" / "tokenizer_config.json").is_file()


def test_offline_model_not_in_cache_is_one_clear_message(gsm8k_head, hub_cache, tmp_path):
    proc = run_sfttrain(2, job(gsm8k_head, tmp_path / "run", "org/missing"), check=False,
                        env={"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode != 0
    message = "model.partial_pretrain='org/missing' is not a local folder, and as a Hugging Face hub id it is " \
              f"not in the local cache {hub_cache} (HF_HUB_OFFLINE=1 is set)"
    printed = [line for line in proc.stdout.splitlines() if line.startswith("sfttrain: ")]
    assert len(printed) == 1 and message in printed[0], proc.stdout[-3000:]  # once, as its own line
    assert "hf download org/missing" in proc.stdout
    assert "LocalEntryNotFoundError" not in proc.stdout  # a message, not a traceback from every rank
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("global_step_*"))


def test_what_counts_as_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert is_repo_id("Qwen/Qwen2.5-0.5B-Instruct") and is_repo_id("org/name")
    assert not is_repo_id("models/qwen")  # an existing relative folder is a folder
    assert not is_repo_id("/abs/model") and not is_repo_id("a/b/c") and not is_repo_id("./x") \
        and not is_repo_id("~/x") and not is_repo_id("name")
