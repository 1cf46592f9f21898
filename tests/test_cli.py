"""The command lines users bring from verl (bad input: tests/test_errors.py; the article's own:
tests/test_article.py), and --help."""

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path


from tests.conftest import BASE_OVERRIDES, REPO, read_metrics, run_sfttrain


def test_one_process_job_takes_no_port(gsm8k_head, tmp_path):
    """`python -m sfttrain.run` (no torchrun) while torch's default rendezvous port is taken, as by
    another such job on the machine (one per GPU): it trains. It used to bind 29500 and fail."""
    with socket.socket() as held:
        try:
            held.bind(("127.0.0.1", 29500))
            held.listen()
        except OSError:
            pass  # 29500 is taken already: by another process, which is the case under test too
        run_sfttrain(1, [*BASE_OVERRIDES, f"data.train_files={gsm8k_head}", "data.train_batch_size=4",
                         "trainer.total_training_steps=1", f"trainer.default_local_dir={tmp_path / 'run'}"])
    assert read_metrics(tmp_path / "run")[0]["step"] == 1


def test_help_lists_every_key_with_its_default():
    """Generated from the schema: every key of sfttrain/config/schema.py, with its default, and its
    help; `--help SECTION` narrows the list."""
    from sfttrain.config import Config
    from omegaconf import OmegaConf

    def leaves(node, prefix=""):
        for key, value in node.items():
            yield from leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [(prefix + key, value)]

    schema = dict(leaves(OmegaConf.to_container(OmegaConf.structured(Config), resolve=False)))
    wide = {**os.environ, "COLUMNS": "400"}  # one line per key: the phrases below are not wrapped
    out = subprocess.run([sys.executable, "-m", "sfttrain.run", "--help"], cwd=REPO, capture_output=True, text=True,
                         check=True, env=wide).stdout
    for key, default in schema.items():
        assert f"  {key}={default!r}" in out, key
    assert "GLOBAL batch in samples per optimizer step" in out
    assert "error | left | right; a sample over max_length" in out  # the values a key takes, from the schema
    assert "verl keys accepted and ignored (each said at start-up): trainer.default_hdfs_dir" in out
    # verl's checkpoint contents, which the README says are taken, are named too (--help did not name them)
    assert "verl's trainer.checkpoint.save_contents and trainer.checkpoint.load_contents: accepted" in out
    assert "hf_model among the contents sets trainer.save_hf=true" in out
    optim = subprocess.run([sys.executable, "-m", "sfttrain.run", "--help", "optim"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout
    assert "optim.lr=1e-05" in optim and "data." not in optim
    bad = subprocess.run([sys.executable, "-m", "sfttrain.run", "--help", "nope"], cwd=REPO, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and ("sections: data, data.multiturn, model, model.fsdp_config, optim, trainer"
                                    in bad.stderr)


def test_help_finds_keys_by_a_word_or_another_trainers_name():
    """`--help lora` said "no such section": a word that is no section lists the keys named by it (or by
    another trainer's name holding it), else those whose help mentions it."""
    from sfttrain.help import format_help

    def keys(word):
        return re.findall(r"^  ([a-z_.]+)=", format_help(word), re.MULTILINE)

    assert keys("lora") == ["model.fold_lora", "model.lora_rank", "model.lora_alpha", "model.target_modules",
                            "model.lora_dropout", "model.fuse_projections", "model.base_quant"]  # the last two: help
    assert keys("learning_rate") == ["optim.lr"] and keys("gradient_checkpointing") == [
        "model.enable_gradient_checkpointing", "model.gradient_checkpointing_ratio"]
    assert keys("profile") == ["trainer.profile_steps", "trainer.profile_memory"]
    assert keys("wandb") == ["trainer.project_name", "trainer.experiment_name", "trainer.logger"]


# verl's own SFT example scripts (volcengine/verl examples/sft/gsm8k/*.sh, the FSDP trainer's; the
# NPU one, which also asks for FSDP1, is left out), their arguments after `-m verl.trainer.fsdp_sft_trainer`
# copied as they are; only the model (a local stand-in) and the paths change. `$@` is where each
# script puts the caller's extra arguments.
VERL_SCRIPTS = {
    "run_deepseek_6b7.sh": """
    data.train_files=$HOME/data/gsm8k/train.parquet \\
    data.val_files=$HOME/data/gsm8k/test.parquet \\
    data.prompt_key=extra_info \\
    data.response_key=extra_info \\
    data.prompt_dict_keys=['question'] \\
    +data.response_dict_keys=['answer'] \\
    data.micro_batch_size_per_gpu=4 \\
    model.partial_pretrain=$MODEL \\
    trainer.default_local_dir=$save_path \\
    trainer.project_name=gsm8k-sft \\
    trainer.experiment_name=gsm8k-sft-deepseek-coder-6.7b-instruct \\
    trainer.total_epochs=4 \\
    trainer.logger='["console","wandb"]' $@""",
    "run_gemma_2b.sh": """
    data.train_files=$HOME/data/gsm8k/train.parquet \\
    data.val_files=$HOME/data/gsm8k/test.parquet \\
    data.prompt_key=extra_info \\
    data.response_key=extra_info \\
    data.prompt_dict_keys=['question'] \\
    +data.response_dict_keys=['answer'] \\
    data.micro_batch_size_per_gpu=4 \\
    model.partial_pretrain=$MODEL \\
    trainer.default_local_dir=$save_path \\
    trainer.project_name=gsm8k-sft \\
    trainer.experiment_name=gsm8k-sft-gemma-2b-it \\
    trainer.total_epochs=2 \\
    trainer.logger='["console","wandb"]' $@""",
    "run_gemma_7b.sh": """
    data.train_files=$HOME/data/gsm8k/train.parquet \\
    data.val_files=$HOME/data/gsm8k/test.parquet \\
    data.prompt_key=extra_info \\
    data.response_key=extra_info \\
    data.prompt_dict_keys=['question'] \\
    data.response_dict_keys=['answer'] \\
    data.micro_batch_size_per_gpu=4 \\
    model.partial_pretrain=$MODEL \\
    trainer.default_local_dir=$save_path \\
    trainer.project_name=gsm8k-sft \\
    trainer.experiment_name=gsm8k-sft-gemma-1.1-7b-it \\
    trainer.total_epochs=4 \\
    trainer.logger='["console","wandb"]' $@""",
    "run_qwen_05_peft.sh": """
    data.train_files=$HOME/data/gsm8k/train.parquet \\
    data.val_files=$HOME/data/gsm8k/test.parquet \\
    data.prompt_key=extra_info \\
    data.response_key=extra_info \\
    optim.lr=1e-4 \\
    data.prompt_dict_keys=['question'] \\
    +data.response_dict_keys=['answer'] \\
    data.micro_batch_size_per_gpu=4 \\
    model.partial_pretrain=$MODEL \\
    trainer.default_local_dir=$save_path \\
    trainer.project_name=gsm8k-sft \\
    trainer.experiment_name=gsm8k-sft-qwen-2.5-0.5b-instruct \\
    trainer.logger=console \\
    trainer.total_epochs=1 $@ \\
    model.lora_rank=32\\
    model.lora_alpha=16 \\
    model.target_modules=all-linear""",
    "run_qwen_05_sp2.sh": """
    data.train_files=$HOME/data/gsm8k/train.parquet \\
    data.val_files=$HOME/data/gsm8k/test.parquet \\
    data.prompt_key=extra_info \\
    data.response_key=extra_info \\
    optim.lr=1e-4 \\
    data.prompt_dict_keys=['question'] \\
    +data.response_dict_keys=['answer'] \\
    data.micro_batch_size=4 \\
    model.partial_pretrain=$MODEL \\
    trainer.default_local_dir=$save_path \\
    trainer.project_name=gsm8k-sft \\
    trainer.experiment_name=gsm8k-sft-qwen-2.5-0.5b-instruct-sp2 \\
    trainer.logger=console \\
    trainer.total_training_steps=1 $@ \\
    ulysses_sequence_parallel_size=2 \\
    use_remove_padding=true""",
    "run_qwen_05_sp2_liger.sh": """
    data.train_files=$HOME/data/gsm8k/train.parquet \\
    data.val_files=$HOME/data/gsm8k/test.parquet \\
    data.prompt_key=extra_info \\
    data.response_key=extra_info \\
    optim.lr=1e-4 \\
    data.prompt_dict_keys=['question'] \\
    +data.response_dict_keys=['answer'] \\
    data.micro_batch_size=4 \\
    model.partial_pretrain=$MODEL \\
    model.use_liger=True \\
    trainer.default_local_dir=$save_path \\
    trainer.project_name=gsm8k-sft \\
    trainer.experiment_name=gsm8k-sft-qwen-2.5-0.5b-instruct-sp2-liger \\
    trainer.logger=console $@ \\
    ulysses_sequence_parallel_size=2 \\
    use_remove_padding=true""",
    "run_seed_oss_36b_sft.sh": """
    data.train_files=$HOME/data/gsm8k/train.parquet \\
    data.val_files=$HOME/data/gsm8k/test.parquet \\
    data.prompt_key=extra_info \\
    data.response_key=extra_info \\
    optim.lr=1e-4 \\
    data.prompt_dict_keys=['question'] \\
    +data.response_dict_keys=['answer'] \\
    data.micro_batch_size=4 \\
    model.partial_pretrain=$MODEL \\
    trainer.default_local_dir=$save_path \\
    trainer.project_name=gsm8k-sft \\
    trainer.experiment_name=gsm8k-sft-seed-oss-36b \\
    trainer.logger=console \\
    trainer.total_training_steps=1 \\
    ulysses_sequence_parallel_size=2 \\
    use_remove_padding=true $@""",
}


def verl_script_args(name: str, home: Path, model: Path, save_path: Path, *extra: str) -> list[str]:
    """The script's arguments as bash passes them (shlex splits and unquotes the same way)."""
    text = VERL_SCRIPTS[name].replace("\\\n", " ").replace("$HOME", str(home)).replace("$MODEL", str(model))
    return [a for arg in shlex.split(text.replace("$save_path", str(save_path)))
            for a in (extra if arg == "$@" else [arg])]


def test_verl_example_scripts_pass_the_preflight(verl_home, tiny_qwen_dir, tmp_path, capsys):
    """Every script's arguments load (Hydra's +key, verl keys without meaning here said once each)
    and pass the preflight, which renders every row as the run would (the nested keys found)."""
    from sfttrain.plan import main as preflight

    for name in VERL_SCRIPTS:
        args = verl_script_args(name, verl_home, tiny_qwen_dir, tmp_path / name, "data.train_batch_size=16")
        assert preflight([*args, "--nproc", "2"]) == 0, (name, capsys.readouterr().out)
        out = capsys.readouterr().out
        assert "64 rows -> 4 steps per epoch" in out and "no problems found" in out, (name, out)
        if "data.micro_batch_size=4" in args:
            assert out.count("sfttrain: ignoring data.micro_batch_size=4: verl's deprecated") == 1, out


def test_verl_example_script_trains(verl_home, tiny_qwen_dir, tmp_path):
    """run_qwen_05_sp2.sh as torchrun runs it with 2 ranks (Ulysses sp=2, its own one step): it
    trains, and says once that data.micro_batch_size is ignored; the start-up says nothing untrue
    or unactionable."""
    save_path = tmp_path / "sp2"
    proc = run_sfttrain(2, verl_script_args("run_qwen_05_sp2.sh", verl_home, tiny_qwen_dir, save_path,
                                            "data.train_batch_size=4"), timeout=600)
    assert read_metrics(save_path)[0]["step"] == 1
    assert proc.stdout.count("sfttrain: ignoring data.micro_batch_size=4") == 1, proc.stdout[-3000:]
    # what is true of a fresh start, and no warning the user can do nothing about (checkpointing is on)
    assert "row scan            : 64 rows rendered, lengths cached in" in proc.stdout, proc.stdout[-3000:]
    assert "gradient_checkpointing_enable" not in proc.stdout, proc.stdout[-3000:]


def test_the_sfttrain_command_says_a_mistake_once_and_trains_when_it_is_fixed(gsm8k_head, tmp_path):
    """`sfttrain train --nproc 2`: a mistake is the rank's one message and its exit code (2), without torchrun's
    ChildFailedError summary or a traceback around it; the same command, corrected, trains both ranks."""
    from tests.conftest import TWO_RANK_STEPS, rank_env, two_rank_job

    job = two_rank_job(gsm8k_head, tmp_path / "run")
    command = [sys.executable, "-m", "sfttrain.cli", "train", "--nproc", "2", *job]
    bad = subprocess.run([*command, "data.train_batch_size=7"], env=rank_env(), cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    said = bad.stdout + bad.stderr
    assert bad.returncode == 2, said[-3000:]
    assert said.count("sfttrain: config error: ") == 1 and "data.train_batch_size=7" in said, said[-3000:]
    assert "ChildFailedError" not in said and "Traceback" not in said, said[-3000:]
    good = subprocess.run(command, env=rank_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert good.returncode == 0, (good.stdout + good.stderr)[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == list(range(1, TWO_RANK_STEPS + 1))
