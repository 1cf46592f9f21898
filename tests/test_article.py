"""The article's own configuration (article 003: verl's sft_fsdp2.yaml, its torchrun command line,
its LoRA keys) runs unchanged but for local paths and a shorter run. A file apart from
tests/test_cli.py: these jobs are among the suite's longest, and pytest-xdist's workers share
files, not tests."""

import os
import subprocess
from importlib.metadata import version


from tests.conftest import REPO, read_metrics, run_sfttrain


def test_article_yaml_runs_unchanged(verl_home, tiny_qwen_dir, tmp_path):
    """verl's sft_fsdp2.yaml (article 003, section 4.1): only the model path is local, and the run
    is cut to one step of 16 samples on 2 ranks to keep the suite fast (the article's 4 ranks run its
    command line, below)."""
    proc = run_sfttrain(2, [str(REPO / "recipes" / "verl_sft_fsdp2.yaml"), f"model.partial_pretrain={tiny_qwen_dir}",
                            "trainer.total_training_steps=1", "data.train_batch_size=16"],
                        cwd=tmp_path, env={"HOME": str(verl_home)}, timeout=600)
    metrics = read_metrics(tmp_path / "checkpoints")
    assert metrics[0]["step"] == 1 and [m["val/loss"] for m in metrics if "val/loss" in m][-1] > 0
    assert "WARNING: model_dtype=bf16" in proc.stdout + proc.stderr
    assert (tmp_path / "checkpoints" / "global_step_1" / "COMPLETE").exists()
    # the software line: the libraries, and the checkout that ran with its commit (git asked here on its own)
    # (a CUDA run names the runtime and the GPU after torch's version, whose local part, +cu130, pip's omits)
    line = next(line for line in proc.stdout.splitlines() if "software            : " in line)
    assert line.split(": ", 1)[1].startswith(f"torch {version('torch')}"), line
    assert f", transformers {version('transformers')}, peft {version('peft')}; sfttrain from {REPO}" in line, line
    if (REPO / ".git").exists():
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        assert f"sfttrain from {REPO} at {head}" in proc.stdout
    # num_workers: 4 a rank, said once for the node against its CPUs; torch's warning of each rank is not printed
    assert "This DataLoader will create" not in proc.stdout + proc.stderr
    cpus = len(os.sched_getaffinity(0))  # the ranks'
    assert f"data workers        : 4 a rank, 8 on this node (2 ranks, {cpus} CPUs)" in proc.stdout
    assert ("WARNING: 8 data workers and 2 ranks share" in proc.stdout) == (8 + 2 > cpus)


def test_article_command_line_runs_unchanged(verl_home, tiny_qwen_dir, tmp_path):
    """The torchrun command of article 003, section 5.1, with the module name and local paths."""
    home = verl_home
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


def test_article_lora_keys_run_and_export(verl_home, tiny_qwen_dir, tmp_path):
    """Article 003, section 6.1: the article's YAML with its LoRA keys (bf16 base, fp32 adapters,
    2 ranks); the checkpoint holds the adapters only and exports to a folder peft loads, also from
    another working directory than the run's, whose model.partial_pretrain was a relative path (the
    export stopped asking for --base)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.test_checkpoint import state

    relative = os.path.relpath(tiny_qwen_dir, tmp_path)
    proc = run_sfttrain(2, [str(REPO / "recipes" / "verl_sft_fsdp2.yaml"), f"model.partial_pretrain={relative}",
                            "model.enable_gradient_checkpointing=true", "model.lora_rank=64", "model.lora_alpha=32",
                            "model.target_modules=all-linear", "data.micro_batch_size_per_gpu=2",
                            "trainer.total_training_steps=1", "data.train_batch_size=4"],
                        cwd=tmp_path, env={"HOME": str(verl_home)}, timeout=600)
    assert "frozen base in bf16, adapters and AdamW state in fp32" in proc.stdout
    assert "WARNING: model_dtype=bf16" not in proc.stdout  # the adapters' master weights are fp32
    ckpt = tmp_path / "checkpoints" / "global_step_1"
    assert all(".lora_" in name for name in state(ckpt)["model"])
    out = tmp_path / "exported"
    assert not (REPO / relative).exists()
    run_sfttrain(1, [str(ckpt), str(out)], module="sfttrain.export", cwd=REPO)
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32)
    assert PeftModel.from_pretrained(base, out / "adapter").peft_config["default"].r == 64
    assert (out / "model.safetensors").exists()
