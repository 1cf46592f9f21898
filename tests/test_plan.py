"""Preflight (sfttrain/plan.py), its batch suggestions, and every recipe in recipes/ through it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from sfttrain.data.batching import batch_problem
from sfttrain.plan import DenseShape, main
from tests.conftest import BASE_OVERRIDES, REPO, STORIES, checkpoint_tensor_bytes, rank_env, run_sfttrain, two_rank_job

# Published sizes of two real models (their model cards: 494M and 8.03B parameters)
QWEN25_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=32768)
LLAMA31_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                  max_position_embeddings=131072)
OTHER_UID = 12345  # the owner of another user's files: a uid no user namespace of the tests maps


def config_only_folder(path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def loaded_stories(cfg):
    """stories260K as sfttrain loads it on one CPU device under `cfg` (its weights materialised)."""
    from sfttrain.model import load_model, materialise_model

    cpu = torch.device("cpu")
    model = load_model(cfg.model, cpu).model
    materialise_model(model, cfg.model, cpu, cpu, seed=0)
    return model


@pytest.mark.parametrize("lora", [[], ["model.lora_rank=8", "model.target_modules=all-linear"]], ids=["full", "lora"])
def test_memory_rows_of_the_weights_are_what_a_step_holds(lora):
    """The preflight's parameter, gradient and optimizer rows, of the model it builds on the meta device,
    against stories260K as sfttrain loads it on one device (fp32 master weights, bf16 compute; LoRA: the
    frozen base in bf16, fp32 adapters), after a step: the bytes of its parameters, their gradients and
    AdamW's state; and the head's [vocab, hidden] gradient that the loss computes in forward and saves for
    backward (none for LoRA's frozen head)."""
    from sfttrain.config import load_config
    from sfttrain.data.pack import pack
    from sfttrain.data.render import RenderedSample
    from sfttrain.loss import CausalLMLoss
    from sfttrain.optim import build_optimizer
    from sfttrain.plan import Startup, memory_per_rank, model_section

    cfg = load_config(None, [f"model.partial_pretrain={STORIES}", "data.train_files=x",
                             "model.fsdp_config.model_dtype=fp32", "model.fsdp_config.mixed_precision=true", *lora])
    model = loaded_stories(cfg)
    optimizer = build_optimizer(model, cfg.optim)
    lm = CausalLMLoss(model, fused=False)
    lm.autocast_dtype = torch.bfloat16  # as sfttrain.parallel.single_device sets it
    shape = DenseShape.from_config_json(str(STORIES))
    head_sized = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: head_sized.append(t) or t if tuple(t.shape) == (shape.vocab, shape.hidden) else t, lambda t: t):
        loss = lm(pack([RenderedSample(list(range(1, 65)), [1] * 64, 0)]))
    loss.backward()
    optimizer.step()

    def gib(tensors) -> float:
        return sum(t.numel() * t.element_size() for t in tensors) / 2**30

    rows = memory_per_rank(cfg, shape, model_section(Startup(cfg, 1, ("cpu",), planning=True, folder=str(STORIES))), 1)
    head = rows.get("loss: the head's gradient (fp32, and its copy saved for backward)", 0)
    assert head == pytest.approx(gib(head_sized), rel=1e-9) and (head > 0) == (not lora), rows
    params = list(model.parameters())
    assert rows["parameters"] == pytest.approx(gib(params), rel=1e-9)
    assert rows["gradients"] == pytest.approx(gib(p.grad for p in params if p.grad is not None), rel=1e-9)
    moments = [state[k] for state in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert rows["optimizer (AdamW m, v)"] == pytest.approx(gib(moments), rel=1e-9)


def test_activation_row_counts_the_layers_that_are_not_recomputed():
    """model.gradient_checkpointing_ratio leaves some layers whole: each keeps all its activations
    instead of its input alone. stories260K, 5 layers: ratio 0.4 recomputes 2 (sfttrain.recompute
    picks them), so the row lies 3 layers' difference above every layer recomputed."""
    from sfttrain.config import load_config
    from sfttrain.plan import Startup, memory_per_rank, model_section

    def activations(*overrides) -> float:
        cfg = load_config(None, [f"model.partial_pretrain={STORIES}", "data.train_files=x", "data.max_length=64",
                                 "data.micro_batch_size_per_gpu=2", *overrides])
        model = model_section(Startup(cfg, 1, ("cpu",), planning=True, folder=str(STORIES)))
        return next(gib for name, gib in memory_per_rank(cfg, DenseShape.from_config_json(str(STORIES)), model,
                                                         1).items() if name.startswith("activations"))

    whole = activations("model.enable_gradient_checkpointing=false") / 5  # one layer, everything kept
    every = activations("model.enable_gradient_checkpointing=true")  # 5 inputs + one layer's recompute
    layer_input = (every - whole) / 5
    some = activations("model.enable_gradient_checkpointing=true", "model.gradient_checkpointing_ratio=0.4")
    assert some == pytest.approx(every + 3 * (whole - layer_input), rel=1e-12)
    assert 0 < layer_input < whole


def test_checkpoint_size_estimates_are_the_tensors_a_checkpoint_holds(two_rank_run):
    """The preflight's checkpoint size (of the model it builds on the meta device) and the start-up's (of the loaded
    model) against the tensors the metadata of conftest's two-rank FSDP checkpoint lists (fp32 stories260K,
    its tied embedding saved under both names, AdamW's two moments)."""
    from sfttrain.checkpoint import estimated_bytes
    from sfttrain.config import load_config
    from sfttrain.plan import Startup, model_section

    cfg = load_config(None, [*BASE_OVERRIDES, "data.train_files=x"])
    planned = model_section(Startup(cfg, 1, ("cpu",), planning=True, folder=str(STORIES)))
    held = checkpoint_tensor_bytes(two_rank_run / "global_step_3")
    assert estimated_bytes(planned) == estimated_bytes(loaded_stories(cfg)) == held


def test_preflight_says_when_the_run_folder_cannot_take_a_checkpoint(tmp_path):
    """The checkpoint line, and a problem where the run folder is on a disk with less free space
    than a checkpoint (a real 1 MB tmpfs; stories260K's checkpoint: 3.25 MB)."""
    from tests.test_checkpoint import tmpfs

    code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={tmp_path}/absent.parquet", "--elsewhere",
                         f"trainer.default_local_dir={tmp_path}", "--nproc", "1")
    assert code == 0 and re.search(r"checkpoint +: about 3.25 MB each \(trained weights and AdamW moments\); "
                                   rf"[\d.]+ [GM]B free in {tmp_path}", out), out
    with tmpfs(tmp_path / "small", 10**6):
        code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={tmp_path}/absent.parquet", "--elsewhere",
                             f"trainer.default_local_dir={tmp_path}/small", "--nproc", "1")
    problems = out.split("problems:")[1]
    assert code == 2 and re.search(rf"trainer.default_local_dir='{tmp_path}/small' has [\d.]+ MB free and this "
                                   r"run's first checkpoint will take about 3.25 MB", problems), out


def test_preflight_says_when_the_run_folder_is_on_a_read_only_filesystem(tmp_path):
    """A run folder on a read-only filesystem (a real read-only bind mount: EROFS, which root meets too) is a
    problem, the start-up's own check; so is one not made yet in a read-only folder, unless the plan is for
    other machines (--elsewhere: they may mount it otherwise), where it is a note."""
    run_dir = tmp_path / "ro" / "run"
    run_dir.mkdir(parents=True)
    with read_only(tmp_path / "ro"):
        code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={tmp_path}/absent.parquet", "--elsewhere",
                             f"trainer.default_local_dir={run_dir}", "--nproc", "1")
        problems = out.split("problems:")[1]
        assert code == 2 and (f"trainer.default_local_dir='{run_dir}' cannot be written: the filesystem of the run "
                              f"folder {run_dir} is read-only (Read-only file system: {run_dir}). It was mounted "
                              "read-only, or the kernel made it read-only after a disk error") in problems, out
        code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={tmp_path}/absent.parquet", "--elsewhere",
                             f"trainer.default_local_dir={run_dir}/new", "--nproc", "1")
        notes = out.split("not checked here:")[1]
        assert code == 0 and f"the filesystem of {run_dir} is read-only" in notes, out
        code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={tmp_path}/absent.parquet",
                             f"trainer.default_local_dir={run_dir}/new", "--nproc", "1")
        assert code == 2 and f"the filesystem of {run_dir} is read-only" in out.split("problems:")[1], out


def test_preflight_names_what_this_user_may_not_read_or_write(gsm8k_dir, tmp_path):
    """Files of another user, by the kernel's own permission check: the preflight runs in a user namespace
    whose root owns nothing of an unmapped uid's, so their mode decides, as for any user. Weights this user
    may not read (the run read them after its data scan, in a traceback), a data file (said as 'not a
    readable Parquet file ... rewrite it') and a run folder holding another user's metrics.jsonl (a
    traceback where the run first writes it) are each a problem, by the run's own start-up checks."""
    if os.geteuid() != 0:
        pytest.skip("files of another user are made by root (CI runs as root)")
    if subprocess.run(["unshare", "-r", "true"], capture_output=True).returncode != 0:
        pytest.skip("this machine refuses user namespaces (unshare -r)")
    model, data, run_dir = tmp_path / "model", tmp_path / "train.parquet", tmp_path / "run"
    shutil.copytree(STORIES, model)
    shutil.copy(gsm8k_dir / "train.parquet", data)
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").touch()
    for path, mode in [(model / "model.safetensors", 0o600), (data, 0o600), (run_dir / "metrics.jsonl", 0o644)]:
        os.chown(path, OTHER_UID, OTHER_UID)
        path.chmod(mode)
    out = subprocess.run(["unshare", "-r", sys.executable, "-m", "sfttrain.plan", *BASE_OVERRIDES,
                          f"model.partial_pretrain={model}", f"data.train_files={data}",
                          f"trainer.default_local_dir={run_dir}", "--nproc", "1"],
                         cwd=REPO, env=rank_env(), capture_output=True, text=True).stdout
    problems = out.split("problems:")[1]
    denied = "this user (root, uid 0) is not allowed to use {} (Permission denied: {}). `ls -ld {}` shows its owner"
    for key, path in [(f"model.partial_pretrain='{model}' cannot be read", model / "model.safetensors"),
                      (f"data file '{data}' (data.train_files / data.val_files) cannot be read", data),
                      (f"trainer.default_local_dir='{run_dir}' cannot be written", run_dir / "metrics.jsonl")]:
        assert f"{key}: {denied.format(path, path, path)}" in problems, out


@contextlib.contextmanager
def read_only(path: Path):
    """`path` bind-mounted read-only onto itself (a real read-only filesystem there); needs root."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root (CI runs as root)")
    mounted = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.mark.parametrize("mb", [1, 3, 4])
@pytest.mark.parametrize("dp", [1, 2, 3, 8])
@pytest.mark.parametrize("budget", [None, 4096])
def test_suggested_batch_sizes_are_valid_and_nearest(mb, dp, budget):
    """Against a brute-force scan: every suggestion passes the check that refused the batch,
    and no valid size lies between the refused one and a suggestion."""
    for b in range(1, 70):
        if batch_problem(b, mb, dp, budget) is None:
            continue
        valid = [v for v in range(1, 200) if batch_problem(v, mb, dp, budget) is None]
        below, above = [v for v in valid if v < b], [v for v in valid if v > b]
        nearest = " or ".join(map(str, ([below[-1]] if below else []) + [above[0]]))
        assert re.search(rf"; use data.train_batch_size={nearest}(,|$)", batch_problem(b, mb, dp, budget)), b


def run_plan(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def test_plan_reports_steps_from_the_data(gsm8k_head, tiny_qwen_dir):
    """The batch arithmetic, and the data workers against this machine's CPUs (a warning, not a problem,
    where the 2 ranks' 2 x 4 workers and the ranks outnumber them)."""
    code, out = run_plan(f"data.train_files={gsm8k_head}", f"model.partial_pretrain={tiny_qwen_dir}",
                         "data.train_batch_size=32", "data.micro_batch_size_per_gpu=4", "data.num_workers=4",
                         "--nproc", "2")
    rows = pq.read_metadata(gsm8k_head).num_rows
    assert code == 0, out
    assert f"{rows} rows -> {rows // 32} steps per epoch" in out
    assert "4 samples/micro-batch x 4 accumulation steps" in out
    cpus = len(os.sched_getaffinity(0))
    assert f"  data workers        : 4 a rank, 8 on this machine (2 ranks, {cpus} CPUs)" in out, out
    assert ("WARNING: 8 data workers and 2 ranks share this machine's" in out) == (8 + 2 > cpus), out
    assert "no problems found" in out


def test_plan_lists_every_problem_with_a_valid_fix(tmp_path):
    code, out = run_plan(f"data.train_files={tmp_path}/absent.parquet", f"model.partial_pretrain={tmp_path}/none",
                         "data.train_batch_size=7", "--nproc", "2")
    assert code == 2
    assert (f"data file '{tmp_path}/absent.parquet' does not exist (check data.train_files)"
            in out.split("problems:")[1]), out
    assert "data.train_batch_size=7 is not divisible by the 2 data-parallel ranks; use data.train_batch_size=8" in out
    assert f"model.partial_pretrain='{tmp_path}/none' is not a local model folder with a config.json" in out
    code, out = run_plan(f"data.train_files={tmp_path}/absent.parquet", "--elsewhere",
                         f"model.partial_pretrain={STORIES}", "data.train_batch_size=8", "data.max_length=512",
                         "--nproc", "2")
    assert code == 0 and "steps per epoch unknown" in out  # --elsewhere: data only on the cluster, said, not an error
    code, out = run_plan(f"data.train_files={tmp_path}/absent.parquet", f"model.partial_pretrain={tmp_path}/none",
                         "data.train_batch_size=8", "--nproc", "2", "--elsewhere")
    assert code == 0 and f"model.partial_pretrain='{tmp_path}/none' not on this machine" in out, out


@pytest.mark.parametrize("refused", ["data.micro_batch_size_per_gpu=0", "model.fsdp_config.model_dtype=fp64"])
def test_plan_lists_a_refused_value_that_its_later_sections_cannot_take(refused, gsm8k_head):
    """A micro-batch of 0 divided by zero in the batch arithmetic, a dtype the run does not know was a
    KeyError building the model: the preflight ended in a traceback where the run names the key. Now it
    lists the config's problem and says that the rest of the plan needs it fixed."""
    code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={gsm8k_head}", "data.train_batch_size=8", refused,
                         "--nproc", "1")
    key, value = refused.split("=")
    assert code == 2 and f"  - {key}" in out.split("problems:")[-1] and value in out, out
    assert "the rest of the plan needs the config's problems fixed first" in out, out


# nproc per recipe, the model each one names (a config-only folder of its shape), and what the
# command line must add (W1's benchmark passes its data)
RECIPES = {
    "demo_cpu": (2, "stories", []), "chat_demo_cpu": (2, "stories", []), "verl_sft_fsdp2": (4, "qwen0.5b", []),
    "w1_qwen2.5-0.5b": (1, "qwen0.5b", ["data.train_files=~/data/gsm8k/train.parquet"]),
    "qwen2.5-0.5b_gsm8k": (4, "qwen0.5b", []), "llama3.1-8b_full_8gpu": (8, "llama8b", []),
    "llama3.1-8b_lora_1gpu": (1, "llama8b", []), "qwen2.5-0.5b_multiturn_chat": (8, "qwen0.5b", []),
    "qwen2.5-7b_long_context_ulysses": (8, "qwen7b", []), "llama3.1-70b_qlora_1gpu": (1, "llama70b", []),
}


def test_every_recipe_is_planned():
    assert sorted(RECIPES) == sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_header_names_the_keys_it_leaves_to_the_command_line(name):
    """A required key that a recipe leaves unset (W1's model and data, which its benchmark passes) is
    named in the recipe's header, with its value's form: planned as it is, it stops on that key."""
    from omegaconf import OmegaConf

    text = (REPO / "recipes" / f"{name}.yaml").read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    recipe = OmegaConf.create(text)
    for key in ("data.train_files", "model.partial_pretrain"):
        if OmegaConf.select(recipe, key) is None:
            assert f"{key}=" in header, f"recipes/{name}.yaml sets no {key} and its header does not say to pass it"


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_preflight(name, tmp_path, monkeypatch, gsm8k_dir):
    """Run from a folder of its own (not the checkout, whatever ran there before), where the demo's
    relative work/ paths find the GSM8K sample as after `make demo`: steps and memory both print."""
    nproc, model, extra = RECIPES[name]
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "gsm8k_sample").symlink_to(gsm8k_dir)
    (tmp_path / "recipes").symlink_to(REPO / "recipes")  # the chat demo's template, a path from the checkout
    monkeypatch.chdir(tmp_path)
    folders = {"stories": STORIES, "qwen0.5b": config_only_folder(tmp_path / "q", QWEN25_05B),
               "llama8b": config_only_folder(tmp_path / "l", LLAMA31_8B),
               "llama70b": config_only_folder(tmp_path / "l70", dict(LLAMA31_8B, hidden_size=8192, num_hidden_layers=80,
                                                                     intermediate_size=28672, num_attention_heads=64)),
               "qwen7b": config_only_folder(tmp_path / "q7", dict(QWEN25_05B, hidden_size=3584, intermediate_size=18944,
                                                                  num_hidden_layers=28, num_attention_heads=28,
                                                                  num_key_value_heads=4, vocab_size=152064,
                                                                  tie_word_embeddings=False))}
    monkeypatch.setenv("HOME", str(tmp_path))  # recipes that read ~/data find nothing there: planned for the cluster
    code, out = run_plan(str(REPO / "recipes" / f"{name}.yaml"), f"model.partial_pretrain={folders[model]}",
                         *extra, "--nproc", str(nproc), "--elsewhere")
    assert code == 0, out
    assert name != "demo_cpu" or "steps per epoch" in out and "total steps" in out, out
    totals = re.findall(r"^ +total +([0-9.]+) GiB$", out, re.MULTILINE)  # the memory table's last row
    assert len(totals) == 1, out
    total = float(totals[0])
    assert 0 < total < 75, out  # fits an 80 GB GPU with room for the CUDA context


def test_preflight_lists_what_the_run_would_stop_on(gsm8k_head, tmp_path):
    """The run's own checks, each problem listed and none stopping the others: a bad value, a null
    response cell (found by rendering every row, as the run's start-up does), for a CPU fp32 config
    whose memory table has no GPU or bf16 rows."""
    table = pq.read_table(gsm8k_head).slice(0, 40).select(["question", "answer"]).to_pylist()
    table[7]["answer"] = None
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "null.parquet", row_group_size=16)
    code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={tmp_path / 'null.parquet'}", "data.train_batch_size=8",
                         "optim.lr=-1", "--nproc", "2")
    problems = out.split("problems:")[1]
    assert code == 2 and "optim.lr=-1.0 is negative" in problems, out
    assert "null.parquet row 7: answer is null, expected a string" in problems, out
    assert "host memory per rank" in out and "GPU" not in out and "bf16" not in out, out

    code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={gsm8k_head}", "data.response_key=nope",
                         "--nproc", "1")
    assert code == 2 and "no column 'nope'" in out.split("problems:")[1] and "not on this machine" not in out, out

    # the training files are here and the validation file is not: a mistyped path, which the run stops on
    mistyped = gsm8k_head.parent / "tset.parquet"
    code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={gsm8k_head}", f"data.val_files={mistyped}",
                         "--nproc", "1")
    assert code == 2 and (f"data file '{mistyped}' does not exist (check data.val_files; did you mean {gsm8k_head}?)"
                          in out.split("problems:")[1]), out
    # so is a training file listed beside one that is here, with the existing name nearest to it
    code, out = run_plan(*BASE_OVERRIDES, f"data.train_files=[{gsm8k_head},{mistyped}]", "--nproc", "1")
    assert code == 2 and (f"data file '{mistyped}' does not exist (check data.train_files; did you mean {gsm8k_head}?)"
                          in out.split("problems:")[1]), out

    # a pattern: the files it matches, named in the data report
    code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={gsm8k_head.parent}/tr*.parquet", "--nproc", "1")
    rows = pq.read_metadata(gsm8k_head).num_rows
    assert code == 0 and f"  files               : 1: {gsm8k_head} ({rows} rows)" in out, out
    # a file listed twice is read twice (it was one file of twice its rows)
    code, out = run_plan(*BASE_OVERRIDES, f"data.train_files=[{gsm8k_head},{gsm8k_head}]", "--nproc", "1")
    assert code == 0 and f"  files               : 2: {gsm8k_head} ({rows} rows), {gsm8k_head} ({rows} rows)\n" \
        in out, out

    # a hub dataset's id (TRL's way) is not on this machine, nor on any other: the problem says what to do
    code, out = run_plan(*BASE_OVERRIDES, "data.train_files=openai/gsm8k", "--nproc", "1")
    problems = out.split("problems:")[1]
    assert (code == 2 and "'openai/gsm8k' does not exist" in problems
            and "looks like a Hugging Face hub dataset id" in problems), out

    code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={gsm8k_head}", "trainer.total_training_steps=3",
                         "trainer.profile_steps=[3,4]", "optim.lr_warmup_steps=10", "--nproc", "1")
    assert code == 2 and "trainer.profile_steps=[3, 4]: the run has 3 steps" in out.split("problems:")[1], out
    # warmup steps beyond the run (a verl command line cut to a few steps): the rate never reaches optim.lr
    assert ("  WARNING: optim.lr_warmup_steps=10 is more than the run's 3 steps: the learning rate is still warming "
            "up at the last step, at 30% of optim.lr.") in out, out
    code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={gsm8k_head}", "optim.lr=0", "--nproc", "1")
    assert code == 0 and "  WARNING: optim.lr=0: no weight changes" in out, out

    # fp32 compute on GPUs, where every backend but the per-sample one takes fp16/bf16 only: a problem
    # for trainer.device=cuda; for auto it depends on the machine the run lands on (here a note)
    fp32 = "computes in fp16/bf16 only, and this run computes in fp32: set model.fsdp_config.mixed_precision=true"
    for device, problem in (("cuda", True), ("auto", torch.cuda.is_available()), ("cpu", None)):
        code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={gsm8k_head}",
                             f"trainer.device={device}", "--nproc", "1")
        where = out.split("problems:")[1] if problem else out.split("not checked here:")[-1]
        assert (code == 2) == bool(problem) and (fp32 in where) == (problem is not None), (device, out)
    code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={gsm8k_head}", "trainer.device=cuda",
                         "model.fsdp_config.mixed_precision=true", "--nproc", "1")
    assert code == 0 and fp32 not in out, out


def stories_tokenizer_beside(folder: Path, config: dict | None = None) -> Path:
    """`folder` with stories260K's tokenizer files (and `config` as its config.json)."""
    folder.mkdir(exist_ok=True)
    for file in [*STORIES.glob("tokenizer*"), STORIES / "special_tokens_map.json"]:
        shutil.copy(file, folder)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def tiny_moe(tmp: Path) -> Path:
    """A 2-layer Qwen3-MoE with random weights and stories260K's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", vocab_size=512, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=512)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "moe")
    return stories_tokenizer_beside(tmp / "moe")


def resume_into_another_model(tmp: Path, job: list[str]) -> list[str]:
    """The job run once (its checkpoint of step 1), then resumed with a model of 4 layers instead of 5
    (the same tokenizer: the data is the checkpoint's)."""
    run_sfttrain(1, job)
    config = json.loads((STORIES / "config.json").read_text())
    other = stories_tokenizer_beside(tmp / "four_layers", {**config, "num_hidden_layers": 4})
    return [f"model.partial_pretrain={other}", "model.random_init=true"]


def a_checkpoint_as_the_model(tmp: Path, job: list[str]) -> list[str]:
    """The job run once; its run folder then given as the model to fine-tune (the export was meant)."""
    run_sfttrain(1, job)
    return [f"model.partial_pretrain="
            f"{next(a for a in job if a.startswith('trainer.default_local_dir=')).split('=', 1)[1]}",
            f"trainer.default_local_dir={tmp / 'next_run'}"]


def a_peft_adapter_as_the_model(tmp: Path, job: list[str]) -> list[str]:
    (tmp / "adapter").mkdir()
    (tmp / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8,
                                                                     "base_model_name_or_path": str(STORIES)}))
    return [f"model.partial_pretrain={tmp / 'adapter'}"]


def run_folder_under_a_file(tmp: Path, job: list[str]) -> list[str]:
    (tmp / "notes.txt").write_text("a file where the run folder's parent would be")
    return [f"trainer.default_local_dir={tmp / 'notes.txt' / 'run'}"]


def model_config_cut_short(tmp: Path, job: list[str]) -> list[str]:
    folder = stories_tokenizer_beside(tmp / "cut")
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size"')  # a copy that stopped there
    return [f"model.partial_pretrain={folder}", "model.random_init=true"]


def model_config_its_family_refuses(tmp: Path, job: list[str]) -> list[str]:
    config = json.loads((STORIES / "config.json").read_text())
    folder = stories_tokenizer_beside(tmp / "six_heads", {**config, "num_attention_heads": 6, "num_key_value_heads": 3})
    return [f"model.partial_pretrain={folder}", "model.random_init=true"]  # hidden size 64 is no multiple of 6


def tokenizer_cut_short(tmp: Path, job: list[str]) -> list[str]:
    folder = tmp / "cut"
    shutil.copytree(STORIES, folder)
    (folder / "tokenizer.json").write_text((STORIES / "tokenizer.json").read_text()[:3000])
    return [f"model.partial_pretrain={folder}"]


# Start-up refusals of a 1-rank CPU run of stories260K on 40 GSM8K rows that the preflight missed, stopped
# at the first of, or said in other words: for each, the key (or file) the refusal names and the
# overrides that make it, given the test's folder and the job (set up there where the mistake needs it)
REFUSALS = {
    "config: every mistake, not the first": ("trainer.log_freq",
                                             lambda tmp, job: ["optim.lr=-1", "trainer.log_freq=0"]),
    "config: every unknown key, not the first": ("optim.lrr", lambda tmp, job: ["data.max_lenght=3", "optim.lrr=2"]),
    # a traceback of the run (a ValueError), missed by the preflight
    "attention backend the device cannot run": ("model.attn_implementation",
                                                lambda tmp, job: ["model.attn_implementation=flash_attn"]),
    "loss kernel the device cannot run": ("model.loss_kernel", lambda tmp, job: ["model.loss_kernel=liger"]),
    # refusals of the model the run builds, which the preflight now builds on the meta device
    "LoRA dropout on a MoE's experts": ("model.lora_dropout", lambda tmp, job: [
        f"model.partial_pretrain={tiny_moe(tmp)}", "model.lora_rank=4", "model.lora_dropout=0.1"]),
    "recompute_qkv=false where LoRA runs a MoE's experts eagerly": ("model.recompute_qkv", lambda tmp, job: [
        f"model.partial_pretrain={tiny_moe(tmp)}", "model.lora_rank=4", "model.compile=true",
        "model.enable_gradient_checkpointing=true", "model.recompute_qkv=false"]),
    "resume into another model": ("model.partial_pretrain", resume_into_another_model),
    "run folder under a file": ("trainer.default_local_dir", run_folder_under_a_file),
    # said in other words by the preflight; a traceback of both
    "model folder missing": ("model.partial_pretrain", lambda tmp, job: [f"model.partial_pretrain={tmp}/no_model"]),
    # said as a folder without a config.json: the run folder meant as its export, an adapter meant as its base
    "a run folder as the model": ("is a sfttrain run folder", a_checkpoint_as_the_model),
    "a peft adapter as the model": ("is a peft adapter (adapter_config.json; its base:", a_peft_adapter_as_the_model),
    "model config.json cut short": ("model.partial_pretrain", model_config_cut_short),
    "model config.json its family's validation refuses": ("model.partial_pretrain", model_config_its_family_refuses),
    "tokenizer.json cut short": ("model.partial_pretrain", tokenizer_cut_short),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_preflight_lists_each_start_up_refusal_in_the_runs_words(case, gsm8k_dir, tmp_path):
    """The run refuses at start-up (exit code 2, one message naming the key); the preflight of the same
    command lists every line of that message among its problems."""
    key, mistakes = REFUSALS[case]
    rows = tmp_path / "rows.parquet"
    pq.write_table(pq.read_table(gsm8k_dir / "train.parquet").slice(0, 40), rows)
    job = [*BASE_OVERRIDES, f"data.train_files={rows}", "data.train_batch_size=8", "trainer.total_training_steps=1",
           f"trainer.default_local_dir={tmp_path / 'run'}"]
    job += mistakes(tmp_path, job)
    refused = run_sfttrain(1, job, check=False)
    message = re.search(r"^sfttrain: [a-z ]+: (.*)", refused.stdout, re.MULTILINE | re.DOTALL)
    assert refused.returncode == 2 and message and key in message.group(1), refused.stdout
    code, out = run_plan(*job, "--nproc", "1")
    problems = out.split("problems:")[-1]
    assert code == 2 and all(line.strip() in problems for line in message.group(1).strip().splitlines()), \
        (refused.stdout[-3000:], out)


def test_preflight_lists_a_bad_validation_row_beside_a_bad_training_row(gsm8k_dir, tmp_path):
    """The run stops on a bad training row; that row fixed, on a bad validation row. The preflight lists
    both at once, each in the run's words (it rendered no validation row once a training row failed)."""
    def parquet(name: str, rows: list[dict]) -> Path:
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / name)
        return tmp_path / name

    train = pq.read_table(gsm8k_dir / "train.parquet").slice(0, 40).select(["question", "answer"]).to_pylist()
    val = pq.read_table(gsm8k_dir / "test.parquet").slice(0, 8).select(["question", "answer"]).to_pylist()
    good = parquet("train.parquet", train)
    train[3]["answer"], val[5]["question"] = None, None
    bad = parquet("bad_train.parquet", train)
    job = [*BASE_OVERRIDES, "data.train_batch_size=8", "trainer.total_training_steps=1",
           f"data.val_files={parquet('val.parquet', val)}", f"trainer.default_local_dir={tmp_path / 'run'}"]
    refusals = [run_sfttrain(1, [*job, f"data.train_files={rows}"], check=False).stdout for rows in (bad, good)]
    messages = [re.search(r"^sfttrain: data error: (.*)$", out, re.MULTILINE).group(1) for out in refusals]
    assert "bad_train.parquet row 3: answer is null" in messages[0] and "val.parquet row 5: question is null" in \
        messages[1], refusals
    code, out = run_plan(*job, f"data.train_files={bad}", "--nproc", "1")
    assert code == 2 and all(message in out.split("problems:")[1] for message in messages), (messages, out)


def test_preflight_lists_the_cpp_wrapper_a_gpu_run_refuses(tmp_path):
    """model.compile_cpp_wrapper=true on compiled, checkpointed layers that rerun attention: a run on GPUs
    refuses it once the model is built (sfttrain.resolved.cpp_wrapper; a CPU run ignores the key, so no
    CPU run shows it), after the data scan. The preflight of a trainer.device=cuda run lists that refusal
    in the words of the run's function."""
    from transformers import AutoConfig

    from sfttrain.config import ConfigError, load_config
    from sfttrain.resolved import cpp_wrapper

    job = [*BASE_OVERRIDES, f"data.train_files={tmp_path}/absent.parquet", "model.compile=true",
           "model.enable_gradient_checkpointing=true", "model.compile_cpp_wrapper=true",
           "model.fsdp_config.mixed_precision=true", "trainer.device=cuda"]
    with pytest.raises(ConfigError, match="model.compile_cpp_wrapper=true") as refused:
        cpp_wrapper(load_config(None, job), "cuda", AutoConfig.from_pretrained(STORIES))
    code, out = run_plan(*job, "--nproc", "1", "--elsewhere")
    assert code == 2 and str(refused.value) in out.split("problems:")[1], out


@pytest.mark.parametrize("mode", [None, "offline"])
def test_preflight_says_that_the_wandb_login_is_checked_at_start_up(gsm8k_head, monkeypatch, mode):
    """A run with wandb and no login stops at once at start-up; the preflight cannot see the cluster's
    login, and says so (not with WANDB_MODE=offline, which needs none)."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    if mode:
        monkeypatch.setenv("WANDB_MODE", mode)
    code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={gsm8k_head}",
                         "trainer.logger=[console,wandb]", "--nproc", "1")
    assert code == 0 and ("its login (`wandb login`, or WANDB_API_KEY) is checked when the run starts" in
                          out.split("not checked here:")[-1]) == (mode is None), out


def test_preflight_names_the_resume_and_each_refusal_of_it(gsm8k_head, two_rank_run, tmp_path):
    """The run folder of a finished 3-step run (checkpoints of steps 2 and 3), planned with its own
    config: the preflight names the checkpoint the run resumes from, and, the folder left as it was,
    each refusal the run's start-up would stop on: other data (a batch size) and a schedule that ends
    before the checkpoint, both listed (and both in the one error of the run's own check); a file of
    the checkpoint cut short, with the intact checkpoint before it."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_rank_run, run_dir)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    job = two_rank_job(gsm8k_head, run_dir)
    code, out = run_plan(*job, "--nproc", "2")
    assert code == 0 and (f"resume              : from {run_dir / 'global_step_3'} (step 3, 0 of 3 steps left)\n"
                          in out), out
    assert "the checkpoint is this run's last step (3): nothing left to train" in out, out
    code, out = run_plan(*job, "trainer.profile_steps=[1,2]", "--nproc", "2")  # the window lies before the resume
    assert code == 0 and "trainer.profile_steps: steps 1-2 ran before this resume (after step 3): nothing is " \
        "profiled" in out, out

    changed = [*job, "data.train_batch_size=16", "trainer.total_training_steps=1"]
    code, out = run_plan(*changed, "--nproc", "2")
    refusals = ["was written with other data settings", "data.train_batch_size: 8 -> 16",
                "is at step 3, but this run's schedule ends at step 1"]
    problems = out.split("problems:")[1]
    assert code == 2 and problems.count("\n  - ") == 2 and all(r in problems for r in refusals), out
    # the run's start-up check (sfttrain.resume.check_resume) with that fingerprint and schedule: both, in one error
    from sfttrain.checkpoint import TrainState
    from sfttrain.checkpoint_folder import read_state
    from sfttrain.config import ConfigError, load_config
    from sfttrain.resume import check_resume

    saved = read_state(run_dir / "global_step_3")
    other = TrainState(data={**saved["data"], "data.train_batch_size": 16},
                       schedule={**saved["schedule"], "total steps": 1})
    with pytest.raises(ConfigError) as refused:
        check_resume(str(run_dir / "global_step_3"), load_config(None, changed), other)
    assert all(r in str(refused.value) for r in refusals), refused.value

    shard = run_dir / "global_step_3" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    code, out = run_plan(*job, "--nproc", "2")
    assert code == 2 and (f"the checkpoint {run_dir / 'global_step_3'} is damaged: __0_0.distcp has {size // 2} "
                          f"bytes, {size} when it was committed") in out, out
    assert f"The newest intact checkpoint before it is {run_dir / 'global_step_2'}" in out, out
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


def test_preflight_checks_the_model_folder_as_the_run_loads_it(gsm8k_head, tmp_path):
    """A folder with a config but no weights (a note: a model planned from its config files only),
    and LoRA target modules that name no linear layer of the model (built on the meta device from
    its config, as the run builds it: a problem)."""
    folder = tmp_path / "no_weights"
    folder.mkdir()
    for file in [*STORIES.glob("tokenizer*"), STORIES / "config.json", STORIES / "special_tokens_map.json"]:
        shutil.copy(file, folder)
    code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={gsm8k_head}",
                         f"model.partial_pretrain={folder}", "model.lora_rank=4",
                         "model.target_modules=[q_proj,qkv_proj]", "--nproc", "1")
    notes, problems = out.split("not checked here:")[1].split("problems:")
    assert code == 2 and f"model.partial_pretrain='{folder}' has a config but no weights" in notes, out
    assert re.search(r"\['qkv_proj'\] names no linear layer of LlamaForCausalLM; its linear layers are \['down_proj', "
                     r"'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]", problems), out
    code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={gsm8k_head}", "model.lora_rank=4",
                         "model.target_modules=[q_proj,v_proj]", "--nproc", "1")
    assert code == 0, out


def test_preflight_checks_what_the_run_checks_of_the_loaded_model(gsm8k_head, tiny_qwen_dir, tmp_path):
    """Checks the run makes only once the model is built (after the data scan): Ulysses' heads that
    split over the sp ranks (tiny Qwen's 4 over 3), a family whose head the loss reproduces (GPT-2:
    whose config.json the memory estimate cannot read either, which was a traceback). The run makes them
    from config.json, listed with the other start-up problems before the model is loaded."""
    data = [f"data.train_files={gsm8k_head}", "data.train_batch_size=8", "data.max_length=1024"]
    code, out = run_plan(*data, f"model.partial_pretrain={tiny_qwen_dir}", "ulysses_sequence_parallel_size=3",
                         "--nproc", "3")
    assert code == 2 and "ulysses_sequence_parallel_size=3: the model's 4 attention heads do not split over 3 ranks; " \
                         "use a size that divides 4" in out.split("problems:")[1], out
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(tiny_qwen_dir, gpt2)
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 4,
                                                  "vocab_size": 151665}))
    code, out = run_plan(*data, f"model.partial_pretrain={gpt2}", "--nproc", "1")
    assert code == 2 and "model type 'gpt2': sfttrain's loss is checked against the model's own loss only for llama" \
                         in out.split("problems:")[1], out
    refused = run_sfttrain(1, [*data, f"model.partial_pretrain={gpt2}",
                               f"trainer.default_local_dir={tmp_path / 'run'}"], check=False)
    assert refused.returncode == 2 and "model type 'gpt2': sfttrain's loss is checked" in refused.stdout, refused.stdout


def test_preflight_renders_with_the_template_the_run_would_use(gsm8k_head, tiny_qwen_dir, tmp_path):
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }}")  # no endfor
    code, out = run_plan(f"data.train_files={gsm8k_head}", f"model.partial_pretrain={tiny_qwen_dir}",
                         f"data.chat_template={tmp_path / 'broken.jinja'}", "data.train_batch_size=8", "--nproc", "1")
    assert code == 2 and "broken.jinja' does not parse or render: TemplateSyntaxError" in out, out
    # one that fails only in a branch some rows take (GSM8K's row 1, "Weng earns..."): named with the row,
    # as the run does
    template = (tiny_qwen_dir / "chat_template.jinja").read_text()
    (tmp_path / "weng.jinja").write_text("{% for m in messages %}{% if 'Weng' in m.content %}{{ raise_exception('no "
                                         "Weng') }}{% endif %}{% endfor %}" + template)
    code, out = run_plan(f"data.train_files={gsm8k_head}", f"model.partial_pretrain={tiny_qwen_dir}",
                         f"data.chat_template={tmp_path / 'weng.jinja'}", "data.train_batch_size=8", "--nproc", "1")
    assert code == 2 and "train.parquet row 1: the chat template failed on this row's prompt (as one user turn): " \
                         "TemplateError: no Weng; fix the template" in out, out


def test_readme_preflight_of_a_hub_model(tmp_path, monkeypatch):
    """The README's `python -m sfttrain.plan recipes/llama3.1-8b_full_8gpu.yaml --nproc 8 --elsewhere` on a
    machine without the model or the data: it says what it could not check and how to point it
    at them (exit 0; without --elsewhere the data files missing here are problems); with the model's
    config.json in the hub cache it estimates the memory."""
    from huggingface_hub import constants

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    recipe = str(REPO / "recipes" / "llama3.1-8b_full_8gpu.yaml")
    code, out = run_plan(recipe, "--nproc", "8")
    assert code == 2 and "data file '~/data/gsm8k/train.parquet' does not exist" in out.split("problems:")[1], out
    code, out = run_plan(recipe, "--nproc", "8", "--elsewhere")
    assert code == 0 and "is a hub id that is not in this machine's hub cache" in out, out
    assert "model.partial_pretrain=/path/to/a/local/copy" in out and "no problems found" in out
    repo = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct"  # the hub cache's layout
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    config_only_folder(repo / "snapshots" / ("0" * 40), LLAMA31_8B)
    code, out = run_plan(recipe, "--nproc", "8", "--elsewhere")
    assert code == 0 and "8,030.3M parameters" in out and "GPU memory per rank" in out, out


def test_preflight_usage_names_the_recipe_and_overrides(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "python -m sfttrain.plan [recipe.yaml] [key=value ...] --nproc N" in capsys.readouterr().out


def test_preflight_lists_a_missing_liger_kernel(tmp_path, monkeypatch):
    """model.use_liger=true without liger-kernel stops a GPU run at start-up (exit code 5), as verl's recipe
    (recipes/verl_sft_fsdp2.yaml, the README's first torchrun) would on a machine with `make install` alone:
    a problem for trainer.device=cuda and for auto on a GPU host, a note where the run may land on GPUs (auto,
    a host without one), nothing for a CPU run, which ignores the key."""
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)  # not importable
    data = [*BASE_OVERRIDES, f"data.train_files={tmp_path}/absent.parquet", "--elsewhere", "model.use_liger=true"]
    missing = "model.use_liger=true but liger-kernel is not installed: pip install -e '.[gpu]' --no-build-isolation"
    code, out = run_plan(*data, "trainer.device=cuda", "--nproc", "1")
    assert code == 2 and missing in out.split("problems:")[1], out
    code, out = run_plan(*data, "--nproc", "1")
    assert code == 0 and missing not in out, out
    for gpu_host in (False, True):  # what this machine has decides auto's device
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu_host=gpu_host: gpu_host)
        code, out = run_plan(*data, "trainer.device=auto", "--nproc", "1")
        if gpu_host:
            assert code == 2 and missing in out.split("problems:")[1], out
        else:
            assert code == 0 and f"if this runs on GPUs: {missing}" in out.split("not checked here:")[1], out


def test_preflight_refuses_the_layouts_the_device_cannot_run(tmp_path):
    """The run's refusals of its layout on its device (sfttrain.parallel.check_device, made before the
    model is built): CPU offload on the CPU, and DDP's bf16 gradient reduce (NO_SHARD over 2 ranks) off
    GPUs. One rank runs unwrapped and reduces nothing: no problem there. Offloading is refused also
    where the world's own shape is a problem (no layout is planned then)."""
    # not rendered: only the layout is planned
    data = [*BASE_OVERRIDES, f"data.train_files={tmp_path}/absent.parquet", "--elsewhere"]
    code, out = run_plan(*data, "model.fsdp_config.cpu_offload=true", "--nproc", "2")
    assert code == 2 and "model.fsdp_config.cpu_offload/offload_params need a CUDA device; set them to false" in \
        out.split("problems:")[1], out
    # also where the world does not make a mesh (its own problem): offloading needs no layout to be refused
    code, out = run_plan(*data, "model.fsdp_config.cpu_offload=true", "model.fsdp_config.fsdp_size=3", "--nproc", "2")
    problems = out.split("problems:")[1]
    assert code == 2 and "fsdp_size=3" in problems and "cpu_offload/offload_params need a CUDA device" in problems, out
    bf16_reduce = [*data, "model.fsdp_config.sharding_strategy=NO_SHARD",
                   "model.fsdp_config.mixed_precision={param_dtype: bf16, reduce_dtype: bf16}"]
    refusal = ("model.fsdp_config.mixed_precision.reduce_dtype=bf16 with DDP (NO_SHARD or fsdp_size=1) compresses "
               "gradients through NCCL, on GPUs only; set reduce_dtype=fp32")
    code, out = run_plan(*bf16_reduce, "--nproc", "2")
    assert code == 2 and refusal in out.split("problems:")[1], out
    code, out = run_plan(*bf16_reduce, "--nproc", "1")
    assert code == 0 and refusal not in out, out
    # trainer.device=auto: the device of the machine the run lands on; here a note where this one has no GPU
    code, out = run_plan(*bf16_reduce, "trainer.device=auto", "--nproc", "2")
    assert code == 0 and (refusal in out.split("not checked here:")[-1]) == (not torch.cuda.is_available()), out


def test_preflight_derives_nothing_from_ranks_that_do_not_split(gsm8k_dir, tmp_path):
    """6 ranks in Ulysses groups of 4 (the world's problem, as the run's start-up finds it): no count of
    data-parallel ranks, batch arithmetic or memory per rank made up from them (it said 1 data-parallel
    rank x 4), and the rows are still checked (a null cell). A size of 0, validate's problem, is listed
    once (the world's check finds it too; it was a ZeroDivisionError)."""
    table = pq.read_table(gsm8k_dir / "train.parquet").slice(0, 40).select(["question", "answer"]).to_pylist()
    table[7]["answer"] = None
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "null.parquet")
    job = [*BASE_OVERRIDES, f"data.train_files={tmp_path / 'null.parquet'}", "data.train_batch_size=8"]
    code, out = run_plan(*job, "ulysses_sequence_parallel_size=4", "--nproc", "6")
    report, problems = out.split("problems:")
    assert code == 2 and "ulysses_sequence_parallel_size=4 must divide the world size 6" in problems, out
    assert "null.parquet row 7: answer is null" in problems, out
    assert "data-parallel ranks : none: the ranks do not split into sequence-parallel groups" in report, out
    assert not re.search(r"data-parallel x|global batch|per rank|steps per epoch|memory per rank", report), out
    code, out = run_plan(*job, "ulysses_sequence_parallel_size=0", "--nproc", "2")
    assert code == 2 and out.count("ulysses_sequence_parallel_size must be >= 1 (1: off), got 0") == 1, out


def test_preflight_notes_that_this_machine_has_no_gpu_for_a_cuda_run(tmp_path, monkeypatch):
    """trainer.device=cuda, planned on a machine without a GPU (here made one): the run's start-up would
    refuse it there, but the nodes the run starts on may have GPUs: a note, not a problem (it said
    neither). trainer.device=auto picks whatever the nodes have: nothing to say."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    job = [*BASE_OVERRIDES, f"data.train_files={tmp_path}/absent.parquet", "--elsewhere",
           "model.fsdp_config.mixed_precision=true"]
    code, out = run_plan(*job, "trainer.device=cuda", "--nproc", "1")
    assert code == 0 and "trainer.device=cuda but no CUDA device is visible" in out.split("not checked here:")[1], out
    code, out = run_plan(*job, "trainer.device=auto", "--nproc", "1")
    assert code == 0 and "no CUDA device is visible" not in out, out


def test_preflight_lists_a_refused_rendering_setting_once(gsm8k_head, tmp_path):
    """data.max_length and data.truncation are checked with the config and again by the renderer the data
    scan builds, which the preflight runs past the config's problems: each mistake is one problem, not two
    in other words (and max_length=1, which the config took, is refused by both, as the run does)."""
    code, out = run_plan(*BASE_OVERRIDES, f"data.train_files={gsm8k_head}", "data.truncation=bogus",
                         "data.max_length=1", f"trainer.default_local_dir={tmp_path / 'run'}", "--nproc", "1")
    problems = out.split("problems:")[-1]
    assert code == 2 and problems.count("data.truncation") == 1 and problems.count("data.max_length") == 1, out
