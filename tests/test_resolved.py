"""The start-up's chosen line and what the run does agree: the engine reads each `auto` from the one
`Resolved` the trainer prints, and the model parallelize builds from it does what the line says."""

import contextlib
import random

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from sfttrain.attention import kernel_ops
from sfttrain.config import load_config
from sfttrain.data.pack import pack
from sfttrain.data.render import RenderedSample
from sfttrain.distributed import init_world
from sfttrain.loss import CausalLMLoss
from sfttrain.model import load_model
from sfttrain.parallel import parallelize
from sfttrain.resolved import resolve
from tests.conftest import STORIES


class CountAttention(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in kernel_ops()
        return func(*args, **(kwargs or {}))


def one_rank_step(*overrides: str, count: TorchDispatchMode | None = None) -> tuple[str, CausalLMLoss]:
    """stories260K on one CPU rank as the trainer builds it (resolve, then parallelize from it), one
    forward and backward on a packed row; the chosen line."""
    cfg = load_config(None, ["data.train_files=x.parquet", f"model.partial_pretrain={STORIES}", "trainer.device=cpu",
                             "model.fsdp_config.mixed_precision=false", *overrides])
    world = init_world(cfg)
    try:
        loaded = load_model(cfg.model, world.device)
        resolved = resolve(cfg, world.device, loaded, "torch")
        lm = CausalLMLoss(loaded.model, fused=False, compiled_max_seqlen=256 if cfg.model.compile else None)
        assert parallelize(lm, world, cfg, resolved) == "single"
        gen = random.Random(0)
        batch = pack([RenderedSample([gen.randrange(512) for _ in range(n)], [1] * n, i)
                      for i, n in enumerate([30, 50])])
        with count or contextlib.nullcontext():
            lm.train()(batch).backward()
        return resolved.describe(cfg), lm
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("max_length, recomputed", [(256, True), (8192, False)])
def test_recompute_attention_auto_runs_what_the_chosen_line_says(max_length, recomputed):
    """auto recomputes attention below 8192 tokens, keeps its output from there: the chosen line says so,
    and each of the 5 checkpointed layers runs its attention kernel (on the CPU once per sample: 2) twice
    per step (forward, and again in backward) or once."""
    count = CountAttention()
    line, _ = one_rank_step(f"data.max_length={max_length}", "model.enable_gradient_checkpointing=true",
                            "model.gradient_checkpointing_ratio=1.0", count=count)
    assert f"model.recompute_attention={str(recomputed).lower()} (auto)" in line, line
    assert count.calls == 2 * 5 * (2 if recomputed else 1)


@pytest.mark.parametrize("dropout, folded", [(0.0, True), (0.1, False)])
def test_fused_and_folded_projections_auto_run_what_the_chosen_line_says(dropout, folded):
    """With LoRA and compile, auto fuses the projections of one input and folds the adapters into the
    frozen GEMMs unless lora_dropout: the chosen line says so, and inductor's pass counts what it did."""
    counters.clear()
    torch._dynamo.reset()
    # compiled anew, not taken from inductor's caches (where the pass does not run, nor count)
    no_cache = (torch._inductor.config.patch(fx_graph_cache=False),
                torch._functorch.config.patch(enable_autograd_cache=False))
    try:
        with no_cache[0], no_cache[1]:
            line, _ = one_rank_step("data.max_length=256", "model.compile=true", "model.lora_rank=8",
                                    f"model.lora_dropout={dropout}", "model.enable_gradient_checkpointing=false")
    finally:
        torch._dynamo.reset()
    assert f"model.fuse_projections=true (auto), model.fold_lora={str(folded).lower()} (auto)" in line, line
    assert (counters["inductor"]["folded_lora"] > 0) == folded
    assert folded or counters["inductor"]["fused_projections"] > 0  # folded, no group is left to fuse
