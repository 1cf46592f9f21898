"""The command lines users bring from verl, and clear errors for bad input."""

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import BASE_OVERRIDES, REPO, read_metrics, run_sfttrain


@pytest.fixture()
def home_with_gsm8k(gsm8k_dir, tmp_path):
    """A $HOME laid out as the article expects: ~/data/gsm8k/{train,test}.parquet (the test split
    cut to 32 rows: the article's config is bf16 with a 151k vocabulary, slow on a CPU)."""
    data = tmp_path / "home" / "data" / "gsm8k"
    data.mkdir(parents=True)
    shutil.copy(gsm8k_dir / "train.parquet", data)
    pq.write_table(pq.read_table(gsm8k_dir / "test.parquet").slice(0, 32), data / "test.parquet")
    return tmp_path / "home"


def test_article_yaml_runs_unchanged(home_with_gsm8k, tiny_qwen_dir, tmp_path):
    """verl's sft_fsdp2.yaml (article 003, section 4.1): only the model path is local, and the run
    is cut to one step of 16 samples to keep the suite fast."""
    proc = run_sfttrain(4, [str(REPO / "recipes" / "verl_sft_fsdp2.yaml"), f"model.partial_pretrain={tiny_qwen_dir}",
                            "trainer.total_training_steps=1", "data.train_batch_size=16"],
                        cwd=tmp_path, env={"HOME": str(home_with_gsm8k)}, timeout=600)
    metrics = read_metrics(tmp_path / "checkpoints")
    assert metrics[0]["step"] == 1 and [m["val/loss"] for m in metrics if "val/loss" in m][-1] > 0
    assert "WARNING: model_dtype=bf16" in proc.stdout + proc.stderr
    assert (tmp_path / "checkpoints" / "global_step_1" / "COMPLETE").exists()


def test_article_command_line_runs_unchanged(home_with_gsm8k, tiny_qwen_dir, tmp_path):
    """The torchrun command of article 003, section 5.1, with the module name and local paths."""
    home = home_with_gsm8k
    save_path = tmp_path / "fsdp2_qwen_05b"
    run_sfttrain(4, [f"data.train_files={home}/data/gsm8k/train.parquet",
                     f"data.val_files={home}/data/gsm8k/test.parquet",
                     "data.prompt_key=question", "data.response_key=answer", "data.micro_batch_size_per_gpu=4",
                     f"model.partial_pretrain={tiny_qwen_dir}", "model.strategy=fsdp2",
                     "model.enable_gradient_checkpointing=true", "model.use_liger=true", "optim.lr=1e-4",
                     "trainer.total_epochs=3", f"trainer.default_local_dir={save_path}",
                     "trainer.project_name=gsm8k-fsdp2", "trainer.experiment_name=qwen-05b-instruct-fsdp2",
                     "trainer.logger=console", "trainer.total_training_steps=1", "data.train_batch_size=16"],
                 timeout=600)
    assert read_metrics(save_path)[0]["loss"] > 0


def _fails_with(gsm8k_dir, tmp_path, overrides, *needles, nproc=1):
    proc = run_sfttrain(nproc, [*BASE_OVERRIDES, f"data.train_files={gsm8k_dir}/train.parquet",
                                f"trainer.default_local_dir={tmp_path}/run", "trainer.total_training_steps=3",
                                *overrides], check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for needle in needles:
        assert needle in out, out[-3000:]
    assert not list((tmp_path / "run").glob("global_step_*"))  # no compute spent, nothing saved
    return out


def test_misspelled_key_names_the_closest(gsm8k_dir, tmp_path):
    _fails_with(gsm8k_dir, tmp_path, ["data.micro_batch_sise_per_gpu=2"],
                "unknown config key 'data.micro_batch_sise_per_gpu'", "did you mean data.micro_batch_size_per_gpu")


def test_wrong_type_names_the_key(gsm8k_dir, tmp_path):
    _fails_with(gsm8k_dir, tmp_path, ["data.max_length=long"], "data.max_length")


def test_non_divisible_batch_says_what_to_use(gsm8k_dir, tmp_path):
    _fails_with(gsm8k_dir, tmp_path, ["data.train_batch_size=10", "data.micro_batch_size_per_gpu=4"],
                "data.train_batch_size=10", "not divisible by data.micro_batch_size_per_gpu=4", "multiple of 8",
                nproc=2)


def test_missing_column_names_file_and_columns(gsm8k_dir, tmp_path):
    _fails_with(gsm8k_dir, tmp_path, ["data.prompt_key=prompt"], "train.parquet", "no column 'prompt'",
                "'question'")


def test_missing_file_names_the_path(gsm8k_dir, tmp_path):
    _fails_with(gsm8k_dir, tmp_path, [f"data.val_files={tmp_path}/nope.parquet"], f"{tmp_path}/nope.parquet",
                "does not exist")


def test_empty_file_is_named(gsm8k_dir, tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), empty)
    _fails_with(gsm8k_dir, tmp_path, [f"data.val_files={empty}"], str(empty), "has no rows")


def test_sample_too_long_names_the_row(gsm8k_dir, tmp_path):
    _fails_with(gsm8k_dir, tmp_path, ["data.truncation=error"], "row", "more than data.max_length=256",
                "data.truncation=left|right")


def test_missing_model_folder(gsm8k_dir, tmp_path):
    _fails_with(gsm8k_dir, tmp_path, [f"model.partial_pretrain={tmp_path}/no_model"], "no_model",
                "not a local model folder")


def test_nan_loss_stops_before_the_update(gsm8k_dir, tmp_path):
    out = _fails_with(gsm8k_dir, tmp_path, ["optim.lr=1e30", "optim.clip_grad=0", "data.train_batch_size=4",
                                            "data.micro_batch_size_per_gpu=4"], "non-finite loss", "NOT applied")
    # step 1 is finite and moves every weight by ~lr; step 2 is the first to be named, though the
    # trainer reads a step's numbers only once the next step is queued
    assert "at step 2 " in out
    assert "sfttrain/trainer.py" not in out  # a message, not a traceback of ours


def test_missing_chat_template_says_what_to_set(gsm8k_dir, tmp_path):
    out = _fails_with(gsm8k_dir, tmp_path, ["data.apply_chat_template=true"],
                      "sfttrain: error: the tokenizer has no chat template", "data.apply_chat_template=false")
    assert "ValueError" not in out  # said once, by rank 0, not as a traceback from every rank
