"""model.fuse_projections (sfttrain/fuse_projections.py): which projections are fused, and that the
fused layers compute what the unfused ones do, eagerly and compiled by inductor."""

import copy
import random

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from sfttrain.config import ConfigError, FSDPConfig, ModelConfig, load_config
from sfttrain.data.pack import pack
from sfttrain.data.render import RenderedSample
from sfttrain import fuse_projections
from sfttrain.fuse_projections import FuseSharedInputProjections
from sfttrain.loss import CausalLMLoss
from sfttrain.model import decoder_layers, load_model, materialise_model
from sfttrain.parallel import compile_layers
from tests.conftest import STORIES


def stories(lora: bool, device: str = "cpu") -> tuple[CausalLMLoss, object]:
    """stories260K (5 Llama layers) with LoRA's B drawn non-zero (else A would get no gradient), and a
    packed row of three samples. On the CPU in fp32 (LoRA's frozen base too); on a GPU as sfttrain
    runs it there (bf16 frozen base, fp32 adapters, bf16 autocast, varlen attention)."""
    gpu = device == "cuda"
    cfg = ModelConfig(partial_pretrain=str(STORIES), lora_rank=8 if lora else 0, compile=gpu,
                      fsdp_config=FSDPConfig(mixed_precision=gpu))
    model = load_model(cfg, torch.device(device)).model
    materialise_model(model, cfg, torch.device(device), torch.device(device), seed=0)
    for name, p in model.named_parameters():
        if ".lora_B." in name:
            torch.nn.init.normal_(p, std=0.02)
    lm = CausalLMLoss(model, fused=False, **({"compiled_max_seqlen": 256} if gpu else {})).train()
    if gpu:
        lm.autocast_dtype = torch.bfloat16
    gen = random.Random(0)
    batch = pack([RenderedSample([gen.randrange(512) for _ in range(n)], [1] * n, i)
                  for i, n in enumerate([30, 50, 17])])
    return lm, batch.to(torch.device(device))


def loss_and_grads(lm: CausalLMLoss, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    lm.zero_grad()
    loss = lm(batch)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}


def assert_same(fused, plain):
    """fp32 on the CPU: the same products, summed in another order where the wider GEMMs block their
    reductions otherwise and the weight gradients' sums are split otherwise. A sum of n fp32 terms
    reordered moves by up to n x 6e-8 of its magnitude (n here: up to a few hundred tokens or
    features), so each gradient within 1e-4 of its norm (measured here: 3e-6 at most) and the loss
    within 1e-5; a projection's output handed to another (a mis-split) is off by O(1)."""
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=0)
    assert fused[1].keys() == plain[1].keys()
    for name, grad in plain[1].items():
        assert ((fused[1][name] - grad).norm() / grad.norm()).item() < 1e-4, name


def weight_role(node: torch.fx.Node) -> str:
    """'q_proj', 'gate_proj.lora_A', ... from dynamo's placeholder name of a layer's weight."""
    name = node.name.replace("_modules_", ".").replace("_parameters_", ".")
    proj = next(p for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj") if p in name)
    return proj + (".lora_A" if "lora_a" in name else ".lora_B" if "lora_b" in name else "")


QKV, GATE_UP = ["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]
ADAPTERS_A = [["q_proj.lora_A", "k_proj.lora_A", "v_proj.lora_A"], ["gate_proj.lora_A", "up_proj.lora_A"]]


@pytest.mark.parametrize("lora, frozen_max_bytes, recompute_qkv, groups", [
    (False, None, True, [QKV, GATE_UP]),
    # the frozen base weights and the trained adapters of one input in groups of their own
    (True, None, True, [QKV, GATE_UP, *ADAPTERS_A]),
    # model.fuse_projections=auto (`graph_pass`) with a bound between stories260K's fp32 frozen q/k/v
    # (32 KiB a layer) and gate/up (86 KiB): the gate/up stay apart, the trained adapters' A do not
    (True, 64 << 10, True, [QKV, *ADAPTERS_A]),
    # no frozen group within the bound, but the q/k/v whose output model.recompute_qkv=false keeps
    (True, 0, False, [QKV, *ADAPTERS_A]),
])
def test_the_projections_of_one_input_are_fused_and_compute_what_they_did(lora, frozen_max_bytes, recompute_qkv,
                                                                         groups, captured, monkeypatch):
    """Each layer's graph as dynamo captures it for inductor, rewritten by the pass and then run
    eagerly: the groups are the projections of one input with weights trained alike (frozen ones
    within auto's bound), and the model's loss and every gradient are those of the unrewritten layers."""
    layers = captured(lora)
    graph_pass = FuseSharedInputProjections()
    if frozen_max_bytes is not None:
        monkeypatch.setattr(fuse_projections, "FROZEN_GROUP_MAX_BYTES", frozen_max_bytes)
        cfg = ModelConfig(compile=True, lora_rank=8, enable_gradient_checkpointing=True, recompute_qkv=recompute_qkv)
        graph_pass = fuse_projections.graph_pass(cfg, layers.lm.model.config, True, cfg.folds_lora())
    fused, seen, _ = layers.run(graph_pass)
    # on the CPU the attention's host syncs break a layer into several graphs, and a graph may be
    # captured again (a guard on the first call's shapes): the distinct groups of all of them
    assert {tuple(group) for graph in seen for group in graph} == {tuple(group) for group in groups}
    assert_same(fused, layers.plain)


class CapturedLayers:
    """stories(lora) with each decoder layer compiled by dynamo (as for inductor) once, for all of this
    module's tests of it: each test rewrites the same captured graphs with its own pass. Tracing the
    layers (9 graphs: host syncs break them) took ~10 s of each test's ~11; a copy's rewrite takes
    milliseconds. dynamo's cache keeps the backend's callables, which run the copies the current test's
    pass rewrote (`run`); the graphs as captured stay unrewritten. `plain`: the eager loss and gradients."""

    def __init__(self, lora: bool):
        self.lm, self.batch = stories(lora)
        self.plain = loss_and_grads(self.lm, self.batch)
        self.graphs: list[list] = []  # per captured graph: [the GraphModule dynamo made, its rewrite's forward]
        self.graph_pass, self.seen, self.folded = None, [], set()
        torch._dynamo.reset()
        backend = self.backend  # one callable for every layer: dynamo compiles their shared code once
        for layer in decoder_layers(self.lm.model):
            layer.compile(backend=backend, dynamic=True)

    def backend(self, gm, example_inputs):
        entry = [gm, None]
        self.graphs.append(entry)
        self.rewrite(entry)
        return lambda *args: entry[1](*args)

    def rewrite(self, entry: list) -> None:
        """A copy of the captured graph (its nodes' meta, fake values included, shared), rewritten by the pass."""
        def roles(node):
            return tuple(weight_role(w) for w in node.args[0]) if node.target is torch.cat else (weight_role(node),)

        gm = torch.fx.GraphModule(entry[0], copy.deepcopy(entry[0].graph))
        self.graph_pass(gm.graph)
        gm.recompile()
        self.seen.append([[weight_role(w) for w in node.args[0]] for node in gm.graph.nodes if node.target is torch.cat
                          and all(w.op == "placeholder" for w in node.args[0]) and "bias" not in node.args[0][0].name])
        self.folded.update(roles(node.args[2]) for node in gm.graph.nodes
                           if node.target is torch.ops.sfttrain.lora_linear.default)
        entry[1] = gm.forward

    def run(self, graph_pass):
        """Loss and gradients with each layer's graph, as dynamo captured it for inductor, rewritten by
        `graph_pass` and run eagerly; and per graph, the groups of weights concatenated (by their roles) and
        the frozen projections folded with their adapters (sfttrain.fuse_projections), one tuple a fold. Graphs
        dynamo captures during the step (the first, or after a torch._dynamo.reset) are rewritten as captured."""
        self.graph_pass, self.seen, self.folded = graph_pass, [], set()
        for entry in self.graphs:
            self.rewrite(entry)
        return loss_and_grads(self.lm, self.batch), self.seen, self.folded


@pytest.fixture(scope="module")
def captured():
    """CapturedLayers by `lora`, made at first use. One model's graphs in dynamo's cache at a time (each
    made anew resets dynamo): the tests of one model are consecutive here."""
    made: dict[bool, CapturedLayers] = {}

    def get(lora: bool) -> CapturedLayers:
        if lora not in made:
            made.clear()
            made[lora] = CapturedLayers(lora)
        return made[lora]

    yield get
    torch._dynamo.reset()  # the layers' compiled code holds the module's models: dropped with them


@pytest.mark.parametrize("settings, folded, groups", [
    # auto's bound (here between stories260K's frozen q/k/v, o, down, 32-44 KiB a layer, and gate/up, 86
    # KiB): gate/up keep peft's form, their A fused (sfttrain.fuse_projections)
    ({}, [QKV, ["o_proj"], ["down_proj"]], [QKV, *ADAPTERS_A]),
    # every group, but the q/k/v whose fused GEMM output model.recompute_qkv=false keeps (found by its shape)
    ({"fuse_projections": True, "recompute_qkv": False, "enable_gradient_checkpointing": True},
     [["o_proj"], GATE_UP, ["down_proj"]], [QKV, GATE_UP, *ADAPTERS_A]),
])
def test_lora_folded_into_the_frozen_gemms_computes_what_peft_does(settings, folded, groups, captured, monkeypatch):
    """model.fold_lora: the groups named run with their adapters' B inside one GEMM each; loss and every
    gradient are those of peft's layers (assert_same: one GEMM's fp32 sum in place of two added)."""
    layers = captured(lora=True)
    monkeypatch.setattr(fuse_projections, "FROZEN_GROUP_MAX_BYTES", 64 << 10)
    cfg = ModelConfig(compile=True, lora_rank=8, fold_lora=True, **settings)
    fused, seen, found = layers.run(fuse_projections.graph_pass(cfg, layers.lm.model.config, True, cfg.folds_lora()))
    assert found == {tuple(group) for group in folded}
    assert {tuple(group) for graph in seen for group in graph} == {tuple(group) for group in groups}
    assert_same(fused, layers.plain)


@pytest.mark.parametrize("fold_lora", [False, True])
def test_inductor_compiles_the_fused_layer_to_what_the_unfused_computes(fold_lora):
    """One of stories260K's decoder layers with LoRA adapters (as peft injects them), on SDPA so that
    the layer is one graph, compiled as sfttrain compiles it (dynamic shapes) with the pass, against the
    same layer run eagerly and unfused: inductor takes the rewritten graph (its fake values, the
    split's views), and output and gradients agree within assert_same's bounds (inductor's fp32 CPU
    kernels also reorder the norms' and the softmax's sums: the same kind of difference). Folded
    (sfttrain.fuse_projections), inductor generates the op's code itself: no call of the op, whose Python
    would cost host time."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = AutoConfig.from_pretrained(STORIES, attn_implementation="sdpa")
    config.attention_bias = fold_lora  # folded with the attention's biases (Qwen2 has q/k/v ones)
    torch.manual_seed(0)
    layer = inject_adapter_in_model(LoraConfig(r=8, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]), LlamaDecoderLayer(config, 0))
    x = torch.randn(1, 40, config.hidden_size)
    position_ids = torch.arange(40)[None]
    rope = LlamaRotaryEmbedding(config)(x, position_ids)

    def output_and_grads():
        layer.zero_grad()
        h = x.clone().requires_grad_()
        out = layer(h, position_embeddings=rope, position_ids=position_ids)
        out = out[0] if isinstance(out, tuple) else out
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
        return out.detach().norm(), {"input": h.grad, **grads}

    plain = output_and_grads()
    assert any("lora_A" in name for name in plain[1])
    saved = []
    torch._dynamo.reset()
    counters.clear()
    compile_layers([layer], cpp_wrapper=False, fuse=FuseSharedInputProjections(fold_lora=fold_lora))
    # compiled anew, not taken from inductor's caches (where the pass, a part of their key, does not run)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        fused, code = run_and_get_code(output_and_grads)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        output_and_grads()  # compiled already: what the compiled code saves for backward, recorded
    # q/k/v and gate/up, base and adapters apart: 4 groups, counted twice where dynamo restarts its
    # analysis of the layer (it does here, to specialise a float: torch's _tensorify_python_scalars)
    # folded: q/k/v, o, gate/up and down, none left to fuse
    assert counters["inductor"]["folded_lora" if fold_lora else "fused_projections"] in (4, 8)
    assert not any("torch.ops.sfttrain.lora_linear" in c for c in code)
    assert_same(fused, plain)
    # what the compiled layer holds for backward: its activations, and no concatenated weight (those
    # are recomputed; the parameters themselves are saved at no cost)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    held = {tuple(t.shape) for t in saved if t.untyped_storage().data_ptr() not in params}
    groups = {sum(getattr(layer.self_attn, p).base_layer.out_features for p in ("q_proj", "k_proj", "v_proj")),
              2 * layer.mlp.gate_proj.base_layer.out_features, 3 * 8, 2 * 8}  # base and adapter (r=8) groups
    weight_shaped = {(g, config.hidden_size) for g in groups} | {(config.hidden_size, g) for g in groups}
    if fold_lora:  # the adapters' B blocks [out, 8 n] and the widened weights [out, in + 8 n], folded
        hidden, inter = config.hidden_size, layer.mlp.gate_proj.base_layer.out_features
        qkv = sum(getattr(layer.self_attn, p).base_layer.out_features for p in ("q_proj", "k_proj", "v_proj"))
        blocks = {(qkv, 24), (2 * inter, 16), (hidden, 8), (qkv, hidden + 24), (2 * inter, hidden + 16),
                  (hidden, hidden + 8), (hidden, inter + 8)}
        weight_shaped |= blocks | {(b, a) for a, b in blocks}
    assert held, "nothing saved for backward was recorded"
    assert not held & weight_shaped, held & weight_shaped  # 40 tokens: no activation has such a shape


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the GPU's path: varlen attention, Triton kernels, bf16 autocast")
@pytest.mark.parametrize("fold_lora", [False, True])
def test_on_the_gpu_the_fused_layers_train_what_the_unfused_do(fold_lora):
    """stories260K with LoRA as sfttrain runs it on one GPU (bf16 frozen base, fp32 adapters, bf16
    autocast, each layer one graph), compiled without and then with the pass (adapters folded into the
    frozen GEMMs or not, sfttrain.fuse_projections): the same loss (relative 1e-3: a sum of fp32 losses) and
    adapter gradients (2e-2 in norm: they pass through bf16 activations, unit roundoff 3.9e-3, which
    round otherwise where a GEMM is blocked otherwise, and folded, where base and adapter are summed in
    one fp32 accumulator before rounding; the bounds and reasons of tests/test_parallel.py's wrapper
    comparison), where a mis-split is O(1)."""
    lm, batch = stories(lora=True, device="cuda")
    runs = []
    counters.clear()
    for fuse in (None, FuseSharedInputProjections(fold_lora=fold_lora)):
        torch._dynamo.reset()
        compile_layers(decoder_layers(lm.model), cpp_wrapper=False, fuse=fuse)
        loss, grads = loss_and_grads(lm, batch)
        runs.append((loss.float(), torch.cat([g.float().flatten() for g in grads.values()])))
    (plain_loss, plain_grads), (fused_loss, fused_grads) = runs
    assert (counters["inductor"]["folded_lora"] > 0) == fold_lora
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-3, atol=0)
    assert ((fused_grads - plain_grads).norm() / plain_grads.norm()).item() < 2e-2


def test_auto_fuses_and_folds_for_lora_and_what_needs_fused_layers_says_so():
    def model(*overrides):
        return load_config(None, ["data.train_files=x.parquet", "model.partial_pretrain=m", *overrides]).model

    def fused(*overrides):
        return model(*overrides).fuses_projections()

    def folds(*overrides):
        return model(*overrides).folds_lora()

    # model.recompute_qkv=false keeps the fused q/k/v GEMM's output: it needs that GEMM, checkpointed
    assert fused("model.compile=true", "model.lora_rank=8", "model.recompute_qkv=false")
    assert fused("model.compile=true", "model.fuse_projections=true", "model.recompute_qkv=false")
    for overrides in (["model.compile=true"], ["model.lora_rank=8"],
                      ["model.compile=true", "model.lora_rank=8", "model.enable_gradient_checkpointing=false"]):
        with pytest.raises(ConfigError, match="model.recompute_qkv=false .* needs model.enable_gradient_checkpointing"
                                              "=true, model.compile=true and fused projections"):
            fused(*overrides, "model.recompute_qkv=false")
    with pytest.raises(ConfigError, match="model.fp8=auto with model.recompute_qkv=false: FP8 linear layers are not"):
        fused("model.compile=true", "model.fuse_projections=true", "model.recompute_qkv=false", "model.fp8=auto")
    with pytest.raises(ConfigError, match="model.fp8=tensorwise with model.fuse_projections=true: FP8 linear layers "
                                          "are not fused .* so the setting would fuse nothing"):
        fused("model.compile=true", "model.fuse_projections=true", "model.fp8=tensorwise")

    assert fused("model.compile=true", "model.lora_rank=8")
    for overrides in (["model.compile=true"], ["model.lora_rank=8"],
                      ["model.compile=true", "model.lora_rank=8", "model.fuse_projections=false"]):
        with pytest.raises(ConfigError, match="model.fold_lora=true folds LoRA adapters .* needs model.lora_rank > 0"):
            fused(*overrides, "model.fold_lora=true")
    assert fused("model.compile=true", "model.lora_rank=8", "model.fold_lora=true")
    assert folds("model.compile=true", "model.lora_rank=8")  # auto: wherever LoRA's projections are fused
    assert not folds("model.compile=true", "model.lora_rank=8", "model.fold_lora=false")
    assert not folds("model.compile=true", "model.lora_rank=8", "model.fuse_projections=false")
    assert not folds("model.compile=true") and not folds("model.lora_rank=8")
    # with dropout, A reads a dropped-out copy of the input: nothing can fold
    assert not folds("model.compile=true", "model.lora_rank=8", "model.lora_dropout=0.1")
    with pytest.raises(ConfigError, match="model.fold_lora=true with model.lora_dropout=0.1: .* nothing would fold"):
        folds("model.compile=true", "model.lora_rank=8", "model.lora_dropout=0.1", "model.fold_lora=true")
    assert not fused("model.compile=true")  # full fine-tuning: measured slower fused
    assert not fused("model.lora_rank=8")  # eager: there is no compiled graph to rewrite
    assert fused("model.compile=true", "model.fuse_projections=true")
    assert not fused("model.compile=true", "model.lora_rank=8", "model.fuse_projections=false")
    with pytest.raises(ConfigError, match="model.fuse_projections=true .*set model.compile=true"):
        fused("model.fuse_projections=true")
    with pytest.raises(ConfigError, match="model.fuse_projections='always' is not one of"):
        fused("model.fuse_projections=always")
