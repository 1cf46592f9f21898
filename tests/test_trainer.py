"""End-to-end runs with real ranks (torchrun, gloo) on the real stories260K model."""

import statistics

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import (BASE_OVERRIDES, STORIES, load_checkpoint_model, read_metrics, run_sfttrain,
                            train_losses)


def _job(gsm8k_dir, run_dir, *extra):
    return [*BASE_OVERRIDES, f"data.train_files={gsm8k_dir}/train.parquet",
            f"trainer.default_local_dir={run_dir}", *extra]


def _max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-12)).item() for k in a)


def test_update_invariant_to_ranks_and_micro_batches(gsm8k_dir, tmp_path):
    """Same global batch of 16, split as 1 rank x 1 micro-batch, 2 ranks x 1, 2 ranks x 4 micro-batches,
    and 4 ranks as HSDP (2 replicas x 2 shards): loss normalised by the step's global token count
    makes the updates equal."""
    hsdp = ["model.fsdp_config.sharding_strategy=HYBRID_SHARD", "model.fsdp_config.fsdp_size=2"]
    runs = {"1x16": (1, 16, []), "2x8": (2, 8, []), "2x2": (2, 2, []), "hsdp_2x2": (4, 4, hsdp)}
    losses, weights = {}, {}
    for name, (nproc, micro, extra) in runs.items():
        run_dir = tmp_path / name
        proc = run_sfttrain(nproc, _job(gsm8k_dir, run_dir, "data.train_batch_size=16", *extra,
                                        f"data.micro_batch_size_per_gpu={micro}", "trainer.total_training_steps=2"))
        losses[name] = train_losses(run_dir)
        weights[name] = load_checkpoint_model(run_dir / "global_step_2")
    assert "mesh (2, 2) ('dp_replicate', 'dp_shard')" in proc.stdout + proc.stderr
    assert len(losses["1x16"]) == 2
    for name in ("2x8", "2x2", "hsdp_2x2"):
        assert losses[name] == pytest.approx(losses["1x16"], rel=1e-5)
        assert _max_rel_diff(weights[name], weights["1x16"]) < 1e-5
    # and the weights did move: a test that cannot fail is no test
    start = AutoModelForCausalLM.from_pretrained(STORIES).state_dict()
    assert _max_rel_diff({k: start[k] for k in weights["1x16"]}, weights["1x16"]) > 1e-3


def test_token_budget_micro_batches_give_the_same_update(gsm8k_dir, tmp_path):
    ref, budget = tmp_path / "ref", tmp_path / "budget"
    run_sfttrain(1, _job(gsm8k_dir, ref, "data.train_batch_size=8", "data.micro_batch_size_per_gpu=8",
                         "trainer.total_training_steps=2"))
    run_sfttrain(2, _job(gsm8k_dir, budget, "data.train_batch_size=8", "data.max_token_len_per_gpu=400",
                         "trainer.total_training_steps=2"))
    assert train_losses(budget) == pytest.approx(train_losses(ref), rel=1e-5)
    assert _max_rel_diff(load_checkpoint_model(budget / "global_step_2"),
                         load_checkpoint_model(ref / "global_step_2")) < 1e-5


def test_mixed_precision_one_device_and_fsdp_agree(gsm8k_dir, tmp_path):
    """bf16 compute two ways: one rank runs unsharded under autocast, two ranks under FSDP2's
    MixedPrecisionPolicy; both keep fp32 master weights and must train alike (bf16 tolerance)."""
    mp = ["model.fsdp_config.mixed_precision=true", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4",
          "trainer.total_training_steps=3"]
    for nproc in (1, 2):
        run_sfttrain(nproc, _job(gsm8k_dir, tmp_path / f"mp{nproc}", *mp))
    one, two = train_losses(tmp_path / "mp1"), train_losses(tmp_path / "mp2")
    assert one == pytest.approx(two, rel=5e-3)
    assert _max_rel_diff(load_checkpoint_model(tmp_path / "mp1" / "global_step_3"),
                         load_checkpoint_model(tmp_path / "mp2" / "global_step_3")) < 5e-3


def test_compiled_decoder_matches_eager(gsm8k_dir, tmp_path):
    """model.compile on one rank compiles the decoder with dynamic shapes (and the loss kernel):
    the same losses and weights as eager, and no recompilation per new packed length. (On CPU the
    attention fallback reads the sample boundaries on the host, so the graph breaks there; the one
    recompile left comes from transformers calling a wrapped forward with another argument count.
    Compiling per length would recompile for each of the 6 micro-batches, all of other lengths.)"""
    common = ["data.train_batch_size=8", "data.micro_batch_size_per_gpu=4", "trainer.total_training_steps=3",
              "data.pad_to_multiple=1"]
    run_sfttrain(1, _job(gsm8k_dir, tmp_path / "eager", *common))
    proc = run_sfttrain(1, _job(gsm8k_dir, tmp_path / "compiled", *common, "model.compile=true"),
                        env={"TORCH_LOGS": "recompiles"})
    assert proc.stdout.count("Recompiling function") <= 1
    assert train_losses(tmp_path / "compiled") == pytest.approx(train_losses(tmp_path / "eager"), rel=1e-5)
    assert _max_rel_diff(load_checkpoint_model(tmp_path / "compiled" / "global_step_3"),
                         load_checkpoint_model(tmp_path / "eager" / "global_step_3")) < 1e-5


def test_worker_processes_build_the_same_steps(gsm8k_dir, tmp_path):
    """data.num_workers=3: three DataLoader worker processes build steps 0,3,6.. / 1,4,7.. /
    2,5,8..; the trainer must still see them in order, as the in-process stream makes them."""
    common = ["data.train_batch_size=4", "data.micro_batch_size_per_gpu=4", "trainer.total_training_steps=7",
              "data.shuffle=true"]
    run_sfttrain(1, _job(gsm8k_dir, tmp_path / "inline", *common))
    run_sfttrain(1, _job(gsm8k_dir, tmp_path / "workers", *common, "data.num_workers=3"))
    inline, workers = read_metrics(tmp_path / "inline"), read_metrics(tmp_path / "workers")
    assert [m["tokens"] for m in workers if "loss" in m] == [m["tokens"] for m in inline if "loss" in m]
    assert train_losses(tmp_path / "workers") == train_losses(tmp_path / "inline")


def test_parity_with_a_plain_transformers_loop(gsm8k_dir, tmp_path):
    """Reference: HF's own loss (labels shifted by the model, mean over the step's response tokens)
    on unpacked samples, torch AdamW, clipping; same rows (unshuffled), same hyper-parameters."""
    import pyarrow.parquet as pq

    run_dir = tmp_path / "run"
    batch, steps = 4, 2
    run_sfttrain(2, _job(gsm8k_dir, run_dir, f"data.train_batch_size={batch}", "data.micro_batch_size_per_gpu=1",
                         "data.max_length=2048", "data.truncation=error", f"trainer.total_training_steps={steps}"))
    tok = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES, attn_implementation="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    rows = pq.read_table(gsm8k_dir / "train.parquet").to_pylist()
    ref_losses = []
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
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ref_losses.append(total)
    assert train_losses(run_dir) == pytest.approx(ref_losses, rel=1e-5)
    trained = load_checkpoint_model(run_dir / f"global_step_{steps}")
    ref = {k: v for k, v in model.state_dict().items() if k in trained}
    assert _max_rel_diff(trained, ref) < 1e-5


def test_demo_model_learns_gsm8k(gsm8k_dir, tmp_path):
    """The tiny real model's loss falls on GSM8K, and validation loss falls with it."""
    run_dir = tmp_path / "run"
    run_sfttrain(2, _job(gsm8k_dir, run_dir, "data.train_batch_size=16", "data.micro_batch_size_per_gpu=8",
                         f"data.val_files={gsm8k_dir}/test.parquet", "data.shuffle=true",
                         "optim.lr=3e-3", "trainer.total_training_steps=24", "trainer.test_freq=12"))
    metrics = read_metrics(run_dir)
    losses = [m["loss"] for m in metrics if "loss" in m]
    val = [m["val/loss"] for m in metrics if "val/loss" in m]
    assert len(losses) == 24 and len(val) == 2
    assert sum(losses[-4:]) / 4 < 0.75 * sum(losses[:4]) / 4
    assert val[-1] < losses[0]
    for key in ("step", "epoch", "loss", "lr", "grad_norm", "tokens", "loss_tokens", "tokens_per_s", "mfu"):
        assert key in metrics[0]
    # a step's time is its own work, also where the trainer reads its numbers late: at a validation
    # step and the last one (read before validating), and the steps just after them
    times = {m["step"]: m["step_time_s"] for m in metrics if "step_time_s" in m}
    typical = statistics.median(times.values())
    assert min(times[12], times[24]) > 0.4 * typical and times[13] < 1.6 * typical, times
    assert (run_dir / "config.yaml").read_text().count("train_batch_size: 16") == 1
