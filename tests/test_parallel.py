"""Selective activation checkpointing: which decoder layers are recomputed in backward."""

import random

import pytest
import torch

from sfttrain.config import ModelConfig
from sfttrain.data.pack import pack
from sfttrain.data.render import RenderedSample
from sfttrain.loss import CausalLMLoss
from sfttrain.model import decoder_layers, load_model, materialise_model
from sfttrain.parallel import checkpoint_layers
from tests.conftest import STORIES


@pytest.mark.parametrize("ratio, recomputed", [(1.0, [1, 1, 1, 1, 1]), (0.5, [0, 1, 0, 1, 0]), (0.2, [0, 0, 0, 0, 1])])
def test_checkpointing_ratio_recomputes_that_share_of_the_layers(ratio, recomputed):
    """A layer's MLP is entered twice per step (forward, and again in backward) exactly when its
    layer is checkpointed (a pre-hook: the recomputation stops early, inside the MLP); the loss and gradients are those of a run without checkpointing."""
    cfg, cpu = ModelConfig(partial_pretrain=str(STORIES)), torch.device("cpu")
    model = load_model(cfg, cpu).model
    materialise_model(model, cfg, cpu, cpu, seed=0)
    lm = CausalLMLoss(model, fused=False)
    gen = random.Random(0)
    batch = pack([RenderedSample([gen.randrange(512) for _ in range(n)], [1] * n, i) for i, n in enumerate([30, 50])])

    def loss_and_grads():
        lm.zero_grad()
        loss = lm(batch)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in lm.parameters()]

    lm.train()
    plain = loss_and_grads()
    checkpoint_layers(lm, ratio)
    calls = [0] * len(decoder_layers(model))
    for i, layer in enumerate(decoder_layers(model)):
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    checkpointed = loss_and_grads()
    assert [c - 1 for c in calls] == recomputed
    torch.testing.assert_close(checkpointed[0], plain[0], rtol=0, atol=0)
    for a, b in zip(checkpointed[1], plain[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
