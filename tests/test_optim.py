"""clipped_step: clipping and the skip of a non-finite step inside fused AdamW, on each device here.

The clip factor and the skip flag reach the fused kernel through attributes torch does not document
(`grad_scale`, `found_inf`): these tests are what fails if a torch stops reading them. The reference is
torch's own clip_grad_norm_ followed by a plain AdamW step on the CPU."""

import math

import pytest
import torch

from sfttrain.optim import clipped_step

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def _params(seed: int, device: str = "cpu") -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g).to(device)) for shape in [(7, 5), (5,), (3, 4, 2)]]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 3).to(device)
    return params


# Adam's update is nearly blind to the gradient's scale (m / sqrt(v)); a large eps makes it see
# the clip factor
HYPER = dict(lr=0.1, weight_decay=0.01, eps=1.0)


def _reference(params, max_norm):
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    torch.optim.AdamW(params, **HYPER, foreach=False).step()
    return norm


@pytest.mark.parametrize("max_norm", [1.0, math.inf])  # clipping active (the norm is ~29) / no clipping
@pytest.mark.parametrize("device", DEVICES)
def test_clipped_step_matches_clip_grad_norm_then_step(max_norm, device):
    ref = _params(0)
    ref_norm = _reference(ref, max_norm)
    params = _params(0, device)
    opt = torch.optim.AdamW(params, **HYPER, fused=True)
    norm, stepped = clipped_step(opt, params, max_norm, torch.tensor(2.5, device=device))
    assert bool(stepped) and ref_norm > 10 * 1.0  # so that a max_norm of 1 clips
    torch.testing.assert_close(norm.cpu(), ref_norm)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach().cpu(), r.detach())


@pytest.mark.parametrize("bad", ["grad", "loss"])
@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_step_changes_nothing(bad, device):
    """Neither the weights nor AdamW's state, its step count included."""
    params = _params(1, device)
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    clipped_step(opt, params, 1.0, torch.tensor(2.5, device=device))  # a good step first: state exists
    before = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    for p in params:
        p.grad = torch.randn(p.shape, device=device)
    if bad == "grad":
        params[1].grad[2] = float("nan")
    loss = torch.tensor(float("inf") if bad == "loss" else 2.5, device=device)
    _, stepped = clipped_step(opt, params, 1.0, loss)
    assert not bool(stepped)
    for p, b, state in zip(params, before, states):
        assert torch.equal(p.detach(), b)
        assert state.keys() == opt.state[p].keys() and all(torch.equal(v, opt.state[p][k]) for k, v in state.items())


@pytest.fixture
def one_rank_mesh():
    """A 1-rank gloo process group in this process: enough for FSDP's DTensor parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _sharded(params: list[torch.nn.Parameter], mesh) -> list[torch.nn.Parameter]:
    from torch.distributed.tensor import Shard, distribute_tensor

    out = []
    for p in params:
        sharded = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
        sharded.grad = distribute_tensor(p.grad, mesh, [Shard(0)])
        out.append(sharded)
    return out


@pytest.mark.parametrize("max_norm", [1.0, math.inf])
def test_fused_step_on_dtensor_parameters_needs_no_host_sync(one_rank_mesh, max_norm):
    """FSDP's DTensor parameters take the fused path too (clip factor and skip flag as 0-dim
    tensors): the same update as clip_grad_norm_ + AdamW, and a non-finite step skipped."""
    ref = _params(2)
    ref_norm = _reference(ref, max_norm)
    params = _sharded(_params(2), one_rank_mesh)
    opt = torch.optim.AdamW(params, **HYPER, fused=True)
    norm, stepped = clipped_step(opt, params, max_norm, torch.tensor(2.5))
    assert bool(stepped)
    assert opt.found_inf.item() == 0.0  # the skip flag went to the kernel, not through the host
    torch.testing.assert_close(norm, ref_norm)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.full_tensor().detach(), r.detach())
    before = [p.full_tensor().detach().clone() for p in params]
    params[0].grad.to_local()[0, 0] = float("nan")
    _, stepped = clipped_step(opt, params, max_norm, torch.tensor(2.5))
    assert not bool(stepped)
    for p, b in zip(params, before):
        assert torch.equal(p.full_tensor().detach(), b)


def test_a_resume_follows_the_current_config_s_schedule_from_its_step():
    """set_step on a fresh optimizer and scheduler (a resume): the rate of the resumed step and of each later
    one is the current config's schedule at that step (another lr and warmup than the checkpoint's), and
    AdamW's settings are the current config's; the loop reads the rate from the optimizer's groups."""
    from sfttrain.config import OptimConfig
    from sfttrain.optim import build_optimizer, build_scheduler, lr_factor, set_step

    model = torch.nn.Linear(4, 3)
    cfg, total, step = OptimConfig(lr=2e-3, lr_warmup_steps=4, betas=[0.8, 0.9], weight_decay=0.1), 20, 7
    optimizer = build_optimizer(model, OptimConfig(lr=1e-5, lr_warmup_steps=10))  # as the checkpoint's was
    scheduler = build_scheduler(optimizer, cfg, total)
    set_step(optimizer, scheduler, cfg, total, step)
    for now in range(step, step + 3):
        assert [g["lr"] for g in optimizer.param_groups] == [cfg.lr * lr_factor(now, cfg, total)] * 2
        optimizer.step()
        scheduler.step()
    assert [(g["betas"], g["weight_decay"]) for g in optimizer.param_groups] == [((0.8, 0.9), 0.1), ((0.8, 0.9), 0.0)]
