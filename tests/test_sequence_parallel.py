"""Ulysses sequence parallelism: the same numbers as without it, computed another way.

The attention exchange is checked against whole-row attention on 2 gloo processes (outputs and
gradients, grouped-query heads split and repeated); whole runs with sp=2 (2 ranks, and 4 ranks as
2 data-parallel x 2 sequence-parallel with FSDP sharding over them, gradient checkpointing on)
against sp=1 on the real stories260K model, fp32: losses, the first step's grad norm, validation
loss and weights; checkpoints resume across sp sizes."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sfttrain import attention
from sfttrain.config import ConfigError, load_config
from sfttrain.data.batching import make_plan
from sfttrain.distributed import check_world
from sfttrain.attention import attention_forward, check_ulysses
from tests.conftest import BASE_OVERRIDES, STORIES, load_checkpoint_model, read_metrics, run_on_ranks, run_sfttrain

SP = 2
STEPS = 3
# fp32 with the same reductions in another order (the attention of a head on another rank,
# FSDP's reduce-scatter over 2 or 4 ranks): agreement to ~1e-6 relative; 1e-5 leaves room.
TOL = 1e-5


# ------------------------------------------------------------------ the attention exchange alone
def _attention_worker() -> None:
    """On each of the SP ranks (run_on_ranks)."""
    for kv_heads in (4, 2, 1):  # split over the ranks (4, 2), repeated to them (1)
        _check_attention(dist.get_rank(), kv_heads)


def _check_attention(rank: int, kv_heads: int) -> None:
    torch.manual_seed(kv_heads)  # the same row on both ranks
    heads, length, dim = 4, 24, 8
    q, k, v = (torch.randn(1, h, length, dim, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    weight = torch.randn(1, length, heads, dim, dtype=torch.float64)  # a loss that weighs every output
    cu = torch.tensor([0, 5, 17, 24], dtype=torch.int32)  # a sample crosses the slice boundary at 12
    kwargs = dict(cu_seq_lens_q=cu, max_length_q=12, scaling=dim ** -0.5)

    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = attention.varlen_attention_forward(nn.Module(), *whole, None, **kwargs)
    (out * weight).sum().backward()

    part = slice(rank * length // SP, (rank + 1) * length // SP)
    local = [t[:, :, part].clone().requires_grad_() for t in (q, k, v)]
    local_out, _ = attention_forward(nn.Module(), *local, None, sfttrain_sp_group=dist.group.WORLD, **kwargs)
    (local_out * weight[:, part]).sum().backward()

    torch.testing.assert_close(local_out, out[:, part], rtol=1e-12, atol=1e-12)
    for mine, ref in zip(local, whole):
        torch.testing.assert_close(mine.grad, ref.grad[:, :, part], rtol=1e-12, atol=1e-12)


def test_ulysses_attention_equals_whole_row_attention():
    """Each rank's slice of the output and of the q/k/v gradients equals the whole row's (fp64),
    for 4 query heads with 4 and 2 KV heads (split over the ranks) and 1 (repeated to them)."""
    # ranks forked from the rank server (which has run no torch op), not from this process: a child
    # forked from a process whose OpenMP thread pool has run (any earlier test) can deadlock in its
    # first parallel region
    run_on_ranks(SP, _attention_worker)


def test_head_counts_that_do_not_split_are_refused():
    class Shape:
        num_attention_heads, num_key_value_heads = 6, 3

    check_ulysses(Shape, 3)
    with pytest.raises(ConfigError, match="6 attention heads do not split over 4"):
        check_ulysses(Shape, 4)
    with pytest.raises(ConfigError, match="3 key/value heads neither split over 2"):
        check_ulysses(Shape, 2)


# ------------------------------------------------------------------ whole runs
def _job(gsm8k_head, gsm8k_val, run_dir, *extra):
    return [*BASE_OVERRIDES, f"data.train_files={gsm8k_head}", f"data.val_files={gsm8k_val}",
            f"trainer.default_local_dir={run_dir}", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=2",
            f"trainer.total_training_steps={STEPS}", "trainer.save_freq=2", *extra]


@pytest.fixture(scope="module")
def runs(gsm8k_head, gsm8k_val, tmp_path_factory):
    """sp=1 on 2 ranks (the reference); sp=2 on 2 ranks with gradient checkpointing; 2 x 2 on 4
    ranks with token-budget packing (FSDP shards over all 4)."""
    root = tmp_path_factory.mktemp("sp")
    jobs = {"ref": (2, []),
            "sp2": (2, [f"ulysses_sequence_parallel_size={SP}", "model.enable_gradient_checkpointing=true"]),
            "dp2_sp2": (4, [f"model.ulysses_sequence_parallel_size={SP}", "model.use_remove_padding=true",
                            "model.enable_gradient_checkpointing=true", "data.max_token_len_per_gpu=600"])}
    out = {}
    for name, (nproc, extra) in jobs.items():
        out[name] = root / name
        out[name + ".stdout"] = run_sfttrain(nproc, _job(gsm8k_head, gsm8k_val, out[name], *extra)).stdout
    return out


def _by_step(run_dir, key):
    return {m["step"]: m[key] for m in read_metrics(run_dir) if key in m}


def _max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-12)).item() for k in a)


@pytest.mark.parametrize("name", ["sp2", "dp2_sp2"])
def test_sequence_parallel_trains_like_data_parallel(runs, name):
    ref, run = runs["ref"], runs[name]
    for key in ("loss", "val/loss"):
        assert _by_step(run, key) == pytest.approx(_by_step(ref, key), rel=TOL), key
    assert _by_step(run, "grad_norm")[1] == pytest.approx(_by_step(ref, "grad_norm")[1], rel=TOL)
    final, expected = (load_checkpoint_model(r / f"global_step_{STEPS}") for r in (run, ref))
    assert _max_rel_diff(final, expected) < TOL
    # the weights moved: a comparison that cannot fail is no test
    assert _max_rel_diff(load_checkpoint_model(ref / "global_step_2"), expected) > 1e-3


def test_start_up_plan_names_the_sequence_parallel_ranks(runs):
    assert "data-parallel ranks : 1 (2 ranks = 1 data-parallel x 2 sequence-parallel)" in runs["sp2.stdout"]
    assert "data-parallel ranks : 2 (4 ranks = 2 data-parallel x 2 sequence-parallel)" in runs["dp2_sp2.stdout"]
    assert "mesh (1, 2, 2) ('dp_replicate', 'dp_shard', 'sp')" in runs["dp2_sp2.stdout"]


def test_checkpoint_resumes_with_another_sp_size(runs, gsm8k_head, gsm8k_val, tmp_path):
    """sp=2's step-2 checkpoint (2 ranks) resumed without sequence parallelism on 1 rank (DCP
    reshards; the data position is global): the reference's last step and weights."""
    run_dir = tmp_path / "resumed"
    run_sfttrain(1, _job(gsm8k_head, gsm8k_val, run_dir, "trainer.resume_mode=resume_path",
                         f"trainer.resume_from_path={runs['sp2'] / 'global_step_2'}"))
    assert _by_step(run_dir, "loss") == pytest.approx({s: v for s, v in _by_step(runs["ref"], "loss").items() if s > 2},
                                                      rel=TOL)
    assert _max_rel_diff(load_checkpoint_model(run_dir / f"global_step_{STEPS}"),
                         load_checkpoint_model(runs["ref"] / f"global_step_{STEPS}")) < TOL


def test_world_and_batch_not_divisible_are_refused_in_data_parallel_ranks(tmp_path):
    cfg = load_config(overrides=[f"model.partial_pretrain={STORIES}", f"data.train_files={tmp_path}/x.parquet",
                                 f"model.ulysses_sequence_parallel_size={SP}", "data.train_batch_size=6"])
    with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size=2 must divide the world size 3"):
        check_world(cfg, 3)
    assert check_world(cfg, 8) == (1, 4)
    with pytest.raises(ConfigError, match=r"not divisible by the 4 data-parallel ranks \(8 ranks = 4 data-parallel x "
                                          r"2 sequence-parallel\); use data.train_batch_size=16"):
        make_plan(cfg, 4, 100)


def test_validation_loss_under_sequence_parallelism_counts_every_row_once(gsm8k_head, gsm8k_val, tmp_path):
    """4 ranks = 2 data-parallel x 2 sequence-parallel, 13 validation rows of very unequal weight (6 and
    7 a data-parallel rank, micro-batches of 2: one rank's last micro-batch is the empty one, itself cut
    in two slices): val/loss after one step is the token-weighted loss of every row once, each sp rank
    adding its slice's loss and loss tokens. Reference: a plain transformers loop over the 13 rows,
    unpacked, on the run's step-1 weights (tests/test_reference_loops.py's rows and loop). fp32, sums in
    another order (packed rows, slices, 4 ranks): ~1e-6 relative on any machine, TOL = 1e-5; a row
    counted twice or an sp rank counting the whole row's tokens moves it by >= 1e-3."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    from tests.test_reference_loops import _val_rows, reference_val_loss

    val = _val_rows(gsm8k_val)
    pq.write_table(pa.Table.from_pylist(val), tmp_path / "val.parquet")
    run_dir = tmp_path / "run"
    run_sfttrain(4, [*BASE_OVERRIDES, f"data.train_files={gsm8k_head}", f"data.val_files={tmp_path / 'val.parquet'}",
                     f"trainer.default_local_dir={run_dir}", "data.train_batch_size=4",
                     "data.micro_batch_size_per_gpu=2", "data.max_length=2048", "data.truncation=error",
                     "data.allow_beyond_max_position=true", "trainer.total_training_steps=1",
                     f"ulysses_sequence_parallel_size={SP}"])
    model = AutoModelForCausalLM.from_pretrained(STORIES, attn_implementation="eager", torch_dtype=torch.float32)
    model.load_state_dict(load_checkpoint_model(run_dir / "global_step_1"))
    assert _by_step(run_dir, "val/loss") == {1: pytest.approx(reference_val_loss(model, val), rel=TOL)}
