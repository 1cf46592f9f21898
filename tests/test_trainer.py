"""End-to-end runs with real ranks (gloo; started as conftest.launch says) on the real
stories260K model."""

import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import (BASE_OVERRIDES, LINEAR_ADAM, REPO, STORIES, load_checkpoint_model, rank_env, read_metrics,
                            run_sfttrain, train_losses, update_error)

# Runs compared here differ only in the order of fp32 sums (rank split, micro-batching, compiled vs
# eager kernels): relative differences of ~1e-6 in each gradient (sqrt(terms) x 2^-24), which the
# linear AdamW (LINEAR_ADAM) passes on unamplified. Losses agree to 1e-5 and updates to 1e-4 relative
# (>= 10x that noise), while a wrong normalisation or a dropped micro-batch is off by > 1e-2.
LOSS_TOL, UPDATE_TOL = 1e-5, 1e-4


def _job(train_file, run_dir, *extra):
    """On conftest's gsm8k_head: these runs train its first 32 rows at most."""
    return [*BASE_OVERRIDES, *LINEAR_ADAM, f"data.train_files={train_file}",
            f"trainer.default_local_dir={run_dir}", *extra]


# the steps several tests split in other ways: 2 steps of 16 samples; one_rank_16 runs them unsplit
BATCH_16 = ["data.train_batch_size=16", "trainer.total_training_steps=2"]


@pytest.fixture(scope="module")
def one_rank_16(gsm8k_head, tmp_path_factory):
    """BATCH_16 on one rank as one micro-batch: the reference of the tests that split the same steps
    over ranks, micro-batches, token budgets or compiled kernels (one job for all of them)."""
    run_dir = tmp_path_factory.mktemp("one_rank_16")
    run_sfttrain(1, _job(gsm8k_head, run_dir, *BATCH_16, "data.micro_batch_size_per_gpu=16"))
    return run_dir


def _start() -> dict:
    return AutoModelForCausalLM.from_pretrained(STORIES).state_dict()


def _update_error(run_dir, ref_dir, step: int) -> float:
    """The update of run_dir's step-N checkpoint against ref_dir's, relative to the update."""
    trained, ref = (load_checkpoint_model(d / f"global_step_{step}") for d in (run_dir, ref_dir))
    start = _start()
    return update_error(trained, ref, {k: start[k] for k in ref})


def test_update_invariant_to_ranks_and_micro_batches(gsm8k_head, tmp_path, one_rank_16):
    """Same global batch of 16, split as 1 rank x 1 micro-batch, 2 ranks x 1, 2 ranks x 4 micro-batches,
    4 ranks as HSDP (2 replicas x 2 shards, 2 micro-batches each, all-reduced across the replicas
    once per step), and 2 DDP ranks x 4 micro-batches (gradients accumulated locally, all-reduced in
    the last one's backward): loss normalised by the step's global token count makes the updates
    equal. A rank that skipped the all-reduce would step on its own half of the gradient."""
    hsdp = ["model.fsdp_config.sharding_strategy=HYBRID_SHARD", "model.fsdp_config.fsdp_size=2"]
    runs = {"2x8": (2, 8, []), "2x2": (2, 2, []), "hsdp_2x2": (4, 2, hsdp),
            "ddp_2x2": (2, 2, ["model.fsdp_config.fsdp_size=1"])}
    losses = {"1x16": train_losses(one_rank_16)}
    weights = {"1x16": load_checkpoint_model(one_rank_16 / "global_step_2")}
    logs = {}
    for name, (nproc, micro, extra) in runs.items():
        run_dir = tmp_path / name
        logs[name] = run_sfttrain(nproc, _job(gsm8k_head, run_dir, *BATCH_16, *extra,
                                              f"data.micro_batch_size_per_gpu={micro}")).stdout
        losses[name] = train_losses(run_dir)
        weights[name] = load_checkpoint_model(run_dir / "global_step_2")
    assert "mesh (2, 2) ('dp_replicate', 'dp_shard')" in logs["hsdp_2x2"]
    assert "HSDP: 2 replicas x 2 shards (model.fsdp_config.fsdp_size=2 < 4 data-parallel ranks" in logs["hsdp_2x2"]
    assert "DDP: the whole model on each of 2 ranks" in logs["ddp_2x2"]
    assert len(losses["1x16"]) == 2
    start = _start()
    start = {k: start[k] for k in weights["1x16"]}
    for name in ("2x8", "2x2", "hsdp_2x2", "ddp_2x2"):
        assert losses[name] == pytest.approx(losses["1x16"], rel=LOSS_TOL)
        assert update_error(weights[name], weights["1x16"], start) < UPDATE_TOL, name


def test_token_budget_micro_batches_give_the_same_update(gsm8k_head, tmp_path, one_rank_16):
    budget = tmp_path / "budget"
    run_sfttrain(2, _job(gsm8k_head, budget, *BATCH_16, "data.max_token_len_per_gpu=400"))
    assert train_losses(budget) == pytest.approx(train_losses(one_rank_16), rel=LOSS_TOL)
    assert _update_error(budget, one_rank_16, 2) < UPDATE_TOL


def test_mixed_precision_one_device_fsdp_and_ddp_agree(gsm8k_head, tmp_path):
    """bf16 compute three ways: one rank runs unsharded under autocast, two ranks under FSDP2's
    MixedPrecisionPolicy, two DDP ranks under autocast (gradients all-reduced in fp32); all keep
    fp32 master weights and must train alike. bf16 rounds each product and activation to
    2^-8 ~ 4e-3 relative, in other places on each path: losses within 5e-3, updates within 5e-2
    relative (a wrong cast or a dropped reduction is off by O(1))."""
    mp = ["model.fsdp_config.mixed_precision=true", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4",
          "trainer.total_training_steps=3"]
    runs = {"one": (1, []), "fsdp": (2, []), "ddp": (2, ["model.fsdp_config.sharding_strategy=NO_SHARD"])}
    logs = {name: run_sfttrain(nproc, _job(gsm8k_head, tmp_path / name, *mp, *extra)).stdout
            for name, (nproc, extra) in runs.items()}
    assert "gradients all-reduced in fp32 buckets" in logs["ddp"]
    for name in ("fsdp", "ddp"):
        assert train_losses(tmp_path / name) == pytest.approx(train_losses(tmp_path / "one"), rel=5e-3), name
        assert _update_error(tmp_path / name, tmp_path / "one", 3) < 5e-2, name


def test_compiled_decoder_matches_eager(gsm8k_head, tmp_path, one_rank_16):
    """model.compile on two DDP ranks compiles each decoder layer with dynamic shapes (and the loss
    kernel): the same losses and updates as eager on one rank (one_rank_16: the same steps, unsplit;
    DDP's all-reduce runs beside the compiled layers' backward, dynamo's DDP optimizer off), no
    recompilation caused by a new packed length (each rank's 4 micro-batches of 4 samples, unpadded,
    all have other lengths), and one compilation shared by the layers: a graph
    specialised on its layer (a per-layer constant it must bake in, as a float handed to SDPA's
    scale did in a probe) would be recompiled for each further layer, 4 times for stories260K's 5
    (and past dynamo's cache limit, 8, the remaining layers of a larger model would silently run
    eager). Recompiles for other reasons (how a torch or transformers version wraps a forward) stay
    under that count."""
    proc = run_sfttrain(2, _job(gsm8k_head, tmp_path / "compiled", *BATCH_16, "data.micro_batch_size_per_gpu=4",
                                "data.pad_to_multiple=1", "model.compile=true",
                                "model.fsdp_config.sharding_strategy=NO_SHARD"), env={"TORCH_LOGS": "recompiles"})
    assert "DDP: the whole model on each of 2 ranks" in proc.stdout
    reasons = [line for line in proc.stdout.splitlines() if "size mismatch" in line or "size()" in line]
    assert reasons == [], reasons
    # torch's log lines carry their rank ("[rank0]:V1203 ..."): the count is per rank
    recompiled = Counter(re.findall(r"(\[rank\d+\])?[^\n]*Recompiling function (\S+ in \S+)", proc.stdout))
    assert all(count < 4 for count in recompiled.values()), recompiled
    assert train_losses(tmp_path / "compiled") == pytest.approx(train_losses(one_rank_16), rel=LOSS_TOL)
    assert _update_error(tmp_path / "compiled", one_rank_16, 2) < UPDATE_TOL


def test_worker_processes_build_the_same_steps(gsm8k_head, tmp_path):
    """data.num_workers=3: three DataLoader worker processes build steps 0,3,6.. / 1,4,7.. /
    2,5,8..; the trainer must still see them in order, as the in-process stream makes them."""
    common = ["data.train_batch_size=4", "data.micro_batch_size_per_gpu=4", "trainer.total_training_steps=7",
              "data.shuffle=true"]
    run_sfttrain(1, _job(gsm8k_head, tmp_path / "inline", *common))
    run_sfttrain(1, _job(gsm8k_head, tmp_path / "workers", *common, "data.num_workers=3"))
    inline, workers = read_metrics(tmp_path / "inline"), read_metrics(tmp_path / "workers")
    assert [m["tokens"] for m in workers if "loss" in m] == [m["tokens"] for m in inline if "loss" in m]
    assert train_losses(tmp_path / "workers") == train_losses(tmp_path / "inline")


def test_parity_with_a_plain_transformers_loop(gsm8k_head, tmp_path):
    """Reference: HF's own loss (labels shifted by the model, mean over the step's response tokens)
    on unpacked samples, torch AdamW, clipping; same rows (unshuffled), same hyper-parameters
    (LINEAR_ADAM). Two ranks against one process: the sums run in another order (LOSS_TOL, UPDATE_TOL).
    The grad_norm logged is clip_grad_norm_'s over the whole unsharded model (the norm the clip applies,
    before clipping): under FSDP each rank holds a shard's partial norm, and one not all-reduced, or a
    rank's own, is off by ~sqrt(2) (LOSS_TOL: a norm of fp32 sums in another order)."""
    import pyarrow.parquet as pq

    run_dir = tmp_path / "run"
    batch, steps = 4, 2
    run_sfttrain(2, _job(gsm8k_head, run_dir, f"data.train_batch_size={batch}", "data.micro_batch_size_per_gpu=1",
                         "data.max_length=2048", "data.truncation=error", f"trainer.total_training_steps={steps}",
                         "data.allow_beyond_max_position=true"))  # no row cut: the reference trains them whole
    tok = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES, attn_implementation="eager")
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.95), eps=1.0, weight_decay=0.0)
    rows = pq.read_table(gsm8k_head).to_pylist()
    ref_losses, ref_norms = [], []
    for step in range(steps):
        examples = []
        for r in rows[step * batch:(step + 1) * batch]:
            prompt = tok(r["question"])["input_ids"]
            response = tok(r["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            examples.append((torch.tensor([prompt + response]), torch.tensor([[-100] * len(prompt) + response])))
        n_tokens = sum((labels[:, 1:] != -100).sum().item() for _, labels in examples)
        total = 0.0
        for ids, labels in examples:
            loss = model(input_ids=ids, labels=labels, num_items_in_batch=n_tokens).loss
            loss.backward()
            total += loss.item()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
        ref_losses.append(total)
    assert train_losses(run_dir) == pytest.approx(ref_losses, rel=LOSS_TOL)
    assert min(ref_norms) > 1.0  # the clip applies: the update checked below is the clipped one
    assert [m["grad_norm"] for m in read_metrics(run_dir) if "loss" in m] == pytest.approx(ref_norms, rel=LOSS_TOL)
    trained = load_checkpoint_model(run_dir / f"global_step_{steps}")
    ref = {k: v for k, v in model.state_dict().items() if k in trained}
    assert update_error(trained, ref, {k: start[k] for k in trained}) < UPDATE_TOL


def test_total_training_steps_past_the_epochs_are_said(gsm8k_dir, tmp_path, capsys):
    """trainer.total_training_steps=3 with trainer.total_epochs=1 of 2 steps (20 rows, 8 a step): the steps decide
    (the third one trains the second epoch's first batch), and the batch plan's last line says so at start-up
    and in the preflight alike."""
    import pyarrow.parquet as pq

    from sfttrain import plan

    pq.write_table(pq.read_table(gsm8k_dir / "train.parquet").slice(0, 20), tmp_path / "train.parquet")
    command = [*BASE_OVERRIDES, f"data.train_files={tmp_path / 'train.parquet'}", "data.max_length=128",
               f"trainer.default_local_dir={tmp_path / 'run'}", "data.train_batch_size=8", "trainer.total_epochs=1",
               "trainer.total_training_steps=3"]
    line = ("  total steps         : 3 = 1 epoch and 1 of the next one's 2 steps (trainer.total_training_steps=3 wins "
            "over trainer.total_epochs=1, 2 steps: training runs on past them)\n")
    out = run_sfttrain(1, command).stdout
    assert line in out, out
    assert [(m["step"], m["epoch"]) for m in read_metrics(tmp_path / "run") if "loss" in m] == [(1, 0), (2, 0), (3, 1)]
    assert plan.main([*command, "--nproc", "1"]) == 0
    assert line in capsys.readouterr().out


def test_demo_model_learns_gsm8k(demo_run):
    """The tiny real model's loss falls on GSM8K, and validation loss falls with it (plain AdamW:
    this test is about learning)."""
    run_dir, _ = demo_run
    metrics = read_metrics(run_dir)
    losses = [m["loss"] for m in metrics if "loss" in m]
    val = [m["val/loss"] for m in metrics if "val/loss" in m]
    assert len(losses) == 24 and len(val) == 2
    assert sum(losses[-4:]) / 4 < 0.75 * sum(losses[:4]) / 4
    assert val[-1] < losses[0]
    for key in ("step", "epoch", "loss", "lr", "grad_norm", "tokens", "loss_tokens", "tokens_per_s"):
        assert key in metrics[0]
    assert "mfu" not in metrics[0]  # no GPU peak to measure a CPU against
    assert all(m["step_time_s"] > 0 for m in metrics if "loss" in m)
    assert (run_dir / "config.yaml").read_text().count("train_batch_size: 16") == 1


def test_one_rank_without_torchrun_takes_one_thread_as_torchrun_gives(gsm8k_head, tmp_path):
    """`python -m sfttrain.run` without OMP_NUM_THREADS: torch would take every core, many times slower
    where other work shares them; the rank takes one thread, as torchrun's ranks get, and says so once."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: torch takes one thread either way")
    env = {k: v for k, v in rank_env().items() if k != "OMP_NUM_THREADS"}
    command = _job(gsm8k_head, tmp_path / "run", "trainer.total_training_steps=1", "data.train_batch_size=4")
    done = subprocess.run([sys.executable, "-m", "sfttrain.run", *command], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert out.count("NOTE: OMP_NUM_THREADS is unset: one CPU thread per rank") == 1, out[-3000:]
    assert "  world size          : 1 (cpu, 1 CPU thread per rank)" in out, out[-3000:]
    # the start-up's one line of what each auto became: on a CPU, the per-sample attention (the varlen
    # kernels need a GPU), torch's softmax (Liger's needs Triton) and a writer thread
    chosen = [line for line in out.splitlines() if line.startswith("  chosen              : ")]
    assert len(chosen) == 1, out[-3000:]
    for choice in ("model.attn_implementation=sdpa_blockmask (auto)", "model.loss_kernel=torch (auto)",
                   "trainer.async_save_writer=thread (auto)", "model.fp8=off,"):
        assert choice in chosen[0], chosen[0]
