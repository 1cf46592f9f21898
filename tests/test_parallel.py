"""Activation checkpointing (which decoder layers are recomputed in backward, what they keep) and compiled layers."""

import random
import types

import pytest
import torch

from sfttrain.config import ConfigError, ModelConfig
from sfttrain.data.pack import pack
from sfttrain.data.render import RenderedSample
from sfttrain.loss import CausalLMLoss
from sfttrain.model import decoder_layers, load_model, materialise_model
from sfttrain import recompute
from sfttrain.parallel import allow_side_effects_in_checkpoints, compile_layers
from tests.conftest import STORIES


def checkpoint_layers(lm: CausalLMLoss, ratio: float, recompute_attention: bool = False,
                      recompute_qkv: bool = True) -> None:
    cfg = ModelConfig(gradient_checkpointing_ratio=ratio, recompute_attention=recompute_attention, compile=True,
                      recompute_qkv=recompute_qkv)
    recompute.apply(lm.model, decoder_layers(lm.model), cfg, keep_attention=not recompute_attention)


def stories_loss(samples: list[int]) -> tuple[CausalLMLoss, object]:
    """stories260K (5 layers) on the CPU in fp32, and a packed row of samples of those lengths."""
    cfg, cpu = ModelConfig(partial_pretrain=str(STORIES)), torch.device("cpu")
    model = load_model(cfg, cpu).model
    materialise_model(model, cfg, cpu, cpu, seed=0)
    gen = random.Random(0)
    batch = pack([RenderedSample([gen.randrange(512) for _ in range(n)], [1] * n, i) for i, n in enumerate(samples)])
    return CausalLMLoss(model, fused=False).train(), batch


def loss_and_grads(lm: CausalLMLoss, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    lm.zero_grad()
    loss = lm(batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in lm.parameters()]


@pytest.mark.parametrize("ratio, recomputed", [(1.0, [1, 1, 1, 1, 1]), (0.5, [0, 1, 0, 1, 0]), (0.2, [0, 0, 0, 0, 1])])
def test_checkpointing_ratio_recomputes_that_share_of_the_layers(ratio, recomputed):
    """A layer's MLP is entered twice per step (forward, and again in backward) exactly when its
    layer is checkpointed (a pre-hook: the recomputation stops early, inside the MLP); the loss and
    gradients are those of a run without checkpointing."""
    lm, batch = stories_loss([30, 50])
    plain = loss_and_grads(lm, batch)
    checkpoint_layers(lm, ratio)
    calls = [0] * len(decoder_layers(lm.model))
    for i, layer in enumerate(decoder_layers(lm.model)):
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    checkpointed = loss_and_grads(lm, batch)
    assert [c - 1 for c in calls] == recomputed
    torch.testing.assert_close(checkpointed[0], plain[0], rtol=0, atol=0)
    for a, b in zip(checkpointed[1], plain[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("recompute_attention", [False, True])
def test_checkpointed_layers_run_attention_once_unless_told_to_recompute_it(recompute_attention):
    """Every layer checkpointed, a row of two samples (the CPU's attention: one SDPA flash kernel
    call per sample and layer). The attention kernels run in forward only (10 calls), their outputs
    kept for backward; with model.recompute_attention=true backward runs them again (20). Counted
    at the dispatcher, below autograd and checkpointing. Either way the loss and gradients are those
    of a run without checkpointing: the kept outputs are the very tensors the recomputation gives.
    What they hold is what the preflight's memory estimate adds for them (sfttrain.plan), beside the
    keys and values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sfttrain.attention import kernel_ops
    from sfttrain.plan import DenseShape, activation_bytes, attention_output_bytes, key_value_bytes

    class CountAttention(TorchDispatchMode):
        calls = outputs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in kernel_ops():
                CountAttention.calls += 1
                CountAttention.outputs += sum(t.numel() * t.element_size() for t in out if isinstance(t, torch.Tensor))
            return out

    lm, batch = stories_loss([30, 50])
    plain = loss_and_grads(lm, batch)
    checkpoint_layers(lm, 1.0, recompute_attention)
    with CountAttention():
        checkpointed = loss_and_grads(lm, batch)
    assert CountAttention.calls == 2 * 5 * (2 if recompute_attention else 1)
    torch.testing.assert_close(checkpointed[0], plain[0], rtol=0, atol=0)
    for a, b in zip(checkpointed[1], plain[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    if not recompute_attention:  # fp32 on the CPU: 4-byte values
        shape = DenseShape.from_config_json(str(STORIES))
        kept = (activation_bytes(shape, 80, shape.layers, 4, True, False)
                - activation_bytes(shape, 80, shape.layers, 4, False, False))
        assert CountAttention.outputs == 80 * shape.layers * attention_output_bytes(shape, 4)
        assert kept == 80 * shape.layers * (attention_output_bytes(shape, 4) + key_value_bytes(shape, 4))


def test_the_recompute_line_says_what_a_layer_keeps_and_eager_parts_keep_the_old_way():
    """The start-up line for each setting: auto keeps the attention output for samples of 8192
    tokens or more. A compiled layer with a part outside its graph (torch.compiler.disable, as
    sfttrain.lora runs peft's expert adapters) recomputes everything through transformers'
    per-layer switch, its forward untouched (and refuses model.recompute_qkv=false, which it cannot
    hold); eager, the same layer keeps its attention output (there is no graph to break)."""
    lm, _ = stories_loss([8])
    layers = decoder_layers(lm.model)

    def describe(cfg: ModelConfig, max_length: int) -> str:  # as the trainer resolves it
        return recompute.describe(layers, cfg, recompute.attention_kept(cfg, layers, max_length))

    line = describe(ModelConfig(gradient_checkpointing_ratio=0.5), 8192)
    assert ("2 of 5 layers in backward, each keeping its input and its attention output "
            "(model.recompute_attention=auto, data.max_length >= 8192)") in line, line
    assert "its input only (model.recompute_attention=auto, data.max_length < 8192)" in describe(ModelConfig(), 8191)
    assert "its attention output (model.recompute_attention=false)" in describe(
        ModelConfig(recompute_attention=False), 256)
    assert "its input only (model.recompute_attention=true)" in describe(ModelConfig(recompute_attention=True), 8192)
    assert "none" in describe(ModelConfig(enable_gradient_checkpointing=False), 8192)
    assert ("its input (model.recompute_attention=auto, data.max_length < 8192), and its fused q/k/v GEMM "
            "output (model.recompute_qkv=false)") in describe(ModelConfig(recompute_qkv=False), 256)
    layers[0].mlp.forward = torch.compiler.disable(layers[0].mlp.forward)
    assert "its attention output" in describe(ModelConfig(compile=False), 8192)  # no graph
    assert "parts outside it" in describe(ModelConfig(compile=True), 8192)
    assert not recompute.attention_kept(ModelConfig(compile=True), layers, 8192)  # the chosen line's value
    with pytest.raises(ConfigError, match="model.recompute_qkv=false: this model's layers run parts outside"):
        recompute.apply(lm.model, layers, ModelConfig(compile=True, recompute_qkv=False), False)
    recompute.apply(lm.model, layers, ModelConfig(compile=True), False)
    assert all(layer.gradient_checkpointing and "forward" not in vars(layer) for layer in layers)


def one_sample(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """An attention forward for a row of one sample: one causal SDPA, which compiles without a graph break
    (the CPU's packed-row attention, sdpa_blockmask, reads the boundaries on the host: a break per layer).
    At SDPA's own scale, 1/sqrt(head_dim), what `use_one_sample` checks the model's is: the module's
    float handed to SDPA made dynamo trace each layer twice (under dynamic=True the float is a graph
    input, which torch's _tensorify_python_scalars then specialises, restarting the analysis), a
    quarter of these tests' time."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2), None


def use_one_sample(lm: CausalLMLoss) -> None:
    """Registers `one_sample` as the attention forward of lm's model, whose layers must scale as it does."""
    from transformers import AttentionInterface

    from sfttrain import attention

    for layer in decoder_layers(lm.model):
        assert layer.self_attn.scaling == layer.self_attn.head_dim ** -0.5, layer.self_attn.scaling
    AttentionInterface.register(attention.ATTN_IMPLEMENTATION, one_sample)


def partitioned(fused: bool):
    """A torch.compile backend that splits a layer's graph into forward and backward as inductor does,
    without its code generation: AOTAutograd with inductor's decompositions and min-cut partitioner
    (compiler="inductor"), the two graphs run eagerly. fused: sfttrain's pre-grad pass first, as inductor
    runs it: on the graph and on the graphs it holds (a checkpoint's body is one)."""
    from torch._dynamo.backends.debugging import aot_eager_decomp_partition

    from sfttrain.fuse_projections import FuseSharedInputProjections

    def fuse(gm: torch.fx.GraphModule) -> None:
        FuseSharedInputProjections()(gm.graph)
        gm.recompile()
        for child in gm.children():
            if isinstance(child, torch.fx.GraphModule):
                fuse(child)

    def backend(gm: torch.fx.GraphModule, example_inputs):
        if fused:
            fuse(gm)
        return aot_eager_decomp_partition(gm, example_inputs)
    return backend


UNCHECKPOINTED: dict[bool, tuple] = {}  # the next test's reference step, by whether projections are fused


@pytest.mark.parametrize("recompute_attention, recompute_qkv", [(False, True), (True, True), (True, False)])
def test_compiled_checkpointed_layers_recompute_only_what_backward_reads(recompute_attention, recompute_qkv):
    """stories260K with LoRA adapters (fp32, CPU), each layer checkpointed as sfttrain does and compiled
    through inductor's decompositions and partitioner (`partitioned`, which decides what backward
    recomputes; inductor's code generation, minutes of C++ compiling on a fresh machine, has no say in
    it): the checkpoint is inside the compiled graph with no graph break, keeping the attention
    output (model.recompute_attention=false, long samples) or the layer's input alone (true, short
    samples), though transformers 5.25's attention modules set a context variable in forward
    (without sfttrain.parallel's dynamo setting the layers ran eagerly, their parts recomputed
    several times: 586 GEMMs a step instead of 371). Backward recomputes what it reads and no
    more: of a layer's 21 GEMMs (7 projections: base, adapter A, adapter B) it reruns 19, not the
    down projection's base or B, whose output only leaves the layer (its gradients need down's
    input and A's output, both recomputed; with transformers' checkpoint around the compiled
    layers this step reran 101 GEMMs, not 95); the attention kernel runs again only when told to.
    With model.recompute_qkv=false (projections fused, as it needs: a layer's 15 GEMMs, q/k/v and
    gate/up one each for the base and one each for the A matrices) it reruns 12 of them, not 13:
    the fused q/k/v GEMM's output, [tokens, q + k + v widths], is what the layer holds instead.
    Counted by the profiler, against the same step without checkpointing; the loss and gradients
    are its own, to fp32 reordering (1e-5). The row is one sample (`one_sample`)."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig

    from sfttrain import attention
    from sfttrain.plan import DenseShape, activation_bytes
    from tests.test_fuse_projections import loss_and_grads as adapter_grads, stories

    def step(checkpointed: bool, fused: bool) -> tuple[dict, torch.Tensor, dict[str, torch.Tensor]]:
        lm, _ = stories(lora=True)
        use_one_sample(lm)
        gen = random.Random(0)
        batch = pack([RenderedSample([gen.randrange(512) for _ in range(100)], [1] * 100, 0)])
        if checkpointed:
            checkpoint_layers(lm, 1.0, recompute_attention, recompute_qkv)
        torch._dynamo.reset()
        allow_side_effects_in_checkpoints()
        backend = partitioned(fused)  # one callable: with one each, dynamo would compile every layer apart
        for layer in decoder_layers(lm.model):
            layer.compile(backend=backend, dynamic=True)
        adapter_grads(lm, batch)  # compiles
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss, grads = adapter_grads(lm, batch)
        if checkpointed:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(tuple(t.shape)) or t, lambda t: t):
                adapter_grads(lm, batch)
        calls = {e.key: e.count for e in prof.key_averages()}
        return calls, loss, grads

    counters.clear()
    held = []
    fused = not recompute_qkv  # model.recompute_qkv=false needs the fused q/k/v GEMM
    try:
        # the uncheckpointed reference of an earlier parametrisation when it is the same (fused alike)
        plain = UNCHECKPOINTED.get(fused) or UNCHECKPOINTED.setdefault(fused, step(False, fused))
        checkpointed = step(True, fused)
    finally:
        attention.register()
    assert not counters["graph_break"], dict(counters["graph_break"])
    gemms, sdpa = "aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert checkpointed[0][gemms] == plain[0][gemms] + 5 * (19 if recompute_qkv else 12)
    assert plain[0][sdpa] == 5 and checkpointed[0][sdpa] == 5 * (2 if recompute_attention else 1)
    width = recompute.qkv_weight_shape(AutoConfig.from_pretrained(STORIES))[1]
    assert held.count((100, width)) == (0 if recompute_qkv else 5), held
    if not recompute_qkv:  # the preflight's estimate adds what the layers held (fp32: 4-byte values)
        shape = DenseShape.from_config_json(str(STORIES))
        added = activation_bytes(shape, 100, 5, 4, False, True) - activation_bytes(shape, 100, 5, 4, False, False)
        assert added == 5 * 100 * width * 4
    torch.testing.assert_close(checkpointed[1], plain[1], rtol=1e-5, atol=0)
    for name, grad in plain[2].items():
        assert ((checkpointed[2][name] - grad).norm() / grad.norm()).item() < 1e-5, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled layers' varlen attention runs on CUDA")
@pytest.mark.parametrize("recompute_attention", [False, True])
def test_compiled_checkpointed_layers_keep_attention_unless_told(recompute_attention):
    """stories260K on the GPU (bf16 autocast, varlen flash attention), every layer checkpointed and
    compiled as sfttrain does: the checkpoint's policy is inside each compiled layer, so the
    partitioner keeps the attention output and one step runs the attention kernel once per layer
    (5), or twice with model.recompute_attention=true (10), counted by the profiler; no graph
    break. The loss is the eager, uncheckpointed model's within bf16 rounding (1e-2, as below)."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    cfg, cuda = ModelConfig(partial_pretrain=str(STORIES)), torch.device("cuda")
    model = load_model(cfg, cuda).model
    materialise_model(model, cfg, cuda, cuda, seed=0)
    lm = CausalLMLoss(model, fused=False, compiled_max_seqlen=256, attention="torch_varlen").train()
    lm.autocast_dtype = torch.bfloat16
    gen = random.Random(0)
    batch = pack([RenderedSample([gen.randrange(512) for _ in range(n)], [1] * n, i)
                  for i, n in enumerate([30, 50, 17])]).to(cuda)
    eager = lm(batch).detach()
    checkpoint_layers(lm, 1.0, recompute_attention)
    torch._dynamo.reset()
    counters.clear()
    compile_layers(decoder_layers(model), cpp_wrapper=False)
    lm(batch).backward()  # compiles
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss = lm(batch)
        loss.backward()
    calls = sum(e.count for e in prof.key_averages() if e.key == "aten::_flash_attention_forward")
    assert calls == 5 * (2 if recompute_attention else 1)
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(loss.detach(), eager, rtol=1e-2, atol=0)


# A gradient of a layer's adapter passes through the later layers' activations forward and their gradients
# backward, each held in bf16 and rounded where the two compilations may round differently (their reductions
# split another way, flash attention's backward adding dq with atomics): at most one bf16 step (2^-8 relative)
# each, so to first order at most 2 x 5 layers of them; a mis-passed argument (a lost causal flag or scale)
# is off by O(1). An H200 measured 3.7e-3. The loss, a sum of fp32 cross-entropies, moves far less (5.5e-5).
CPP_WRAPPER_GRAD_BOUND = 2 * 5 * 2**-8


# on the CPU one case, every layer checkpointed (the default, and the graph with the recomputation), compiled
# whole (its row one sample: `one_sample`): one layer graph built with each wrapper. Plain and checkpointed
# layers mixed (the GPU's second case) would double the C++ builds on a fresh machine, to test no other wrapper code
@pytest.mark.parametrize("device, ratio", [("cpu", 1.0), *(
    pytest.param("cuda", ratio, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))
    for ratio in (0.0, 0.5))])
def test_cpp_wrapper_computes_what_the_python_wrapper_does(device, ratio):
    """stories260K with LoRA adapters (bf16 autocast), `ratio` of the layers checkpointed, each layer
    compiled with inductor's Python wrapper, then recompiled with its C++ wrapper (model.compile_cpp_wrapper,
    auto's choice with LoRA on a GPU). On the CPU the two run the same kernels: the same loss and gradients
    bit for bit. There the packed row's attention (sdpa_blockmask) reads the boundaries on the host, a graph
    break that would leave the checkpointed layers eager and split the others: the row is one sample and
    its attention `one_sample`, so that every layer is one graph. On a GPU each compilation picks its
    kernels' launch configurations anew (also with TORCHINDUCTOR_DETERMINISTIC=1), so bf16 may round at
    other points: CPP_WRAPPER_GRAD_BOUND. Against eager, where bf16 rounds elsewhere still, the loss within
    1e-2."""
    from torch._dynamo.utils import counters

    from sfttrain import attention

    cfg, dev = ModelConfig(partial_pretrain=str(STORIES), lora_rank=8, compile=True), torch.device(device)
    model = load_model(cfg, dev).model
    materialise_model(model, cfg, dev, dev, seed=0)
    for name, p in model.named_parameters():
        if ".lora_B." in name:  # B starts at zero, which would leave A without a gradient
            torch.nn.init.normal_(p, std=0.02)
    lm = CausalLMLoss(model, fused=False, compiled_max_seqlen=256)
    lm.autocast_dtype = torch.bfloat16
    if device == "cpu":
        use_one_sample(lm)
    if ratio:
        checkpoint_layers(lm, ratio)
    gen = random.Random(0)
    batch = pack([RenderedSample([gen.randrange(512) for _ in range(n)], [1] * n, i)
                  for i, n in enumerate([97] if device == "cpu" else [30, 50, 17])]).to(dev)

    def loss_and_grads():
        lm.zero_grad()
        loss = lm(batch)
        loss.backward()
        grads = [p.grad.float().flatten() for p in lm.parameters() if p.requires_grad]
        assert len(grads) == 5 * 7 * 2  # A and B of 7 linear layers in each of 5 layers
        return loss.detach().float(), torch.cat(grads)

    try:
        eager = loss_and_grads()
        torch._dynamo.reset()
        counters.clear()
        compile_layers(decoder_layers(model), cpp_wrapper=False)
        python = loss_and_grads()
        torch._dynamo.reset()  # compiled again, now with the C++ wrapper
        compile_layers(decoder_layers(model), cpp_wrapper=True)
        cpp = loss_and_grads()
    finally:
        attention.register()
    if device == "cpu":
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert torch.equal(cpp[0], python[0]) and torch.equal(cpp[1], python[1])
    else:
        torch.testing.assert_close(cpp[0], python[0], rtol=1e-3, atol=0)
        assert ((cpp[1] - python[1]).norm() / python[1].norm()).item() < CPP_WRAPPER_GRAD_BOUND
    torch.testing.assert_close(python[0], eager[0], rtol=1e-2, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mixed-order norm reductions are Triton (GPU) code")
def test_compiled_layers_serve_every_packed_length_with_one_compilation(tmp_path):
    """W4's shape of attention (Qwen3: 4 key/value heads of 128, so k_norm is 512 wide), one layer,
    checkpointed and compiled as sfttrain compiles it, run on a packed micro-batch of 12288 tokens and
    then of 8192. Without inductor's non-strict mixed-order reductions, the first compilation guards
    on `tokens x 512 >= 5 MiB` (a size check inductor makes for fusing k_norm's backward reductions)
    and the second micro-batch recompiles every layer, mid-run (docs/benchmarks.md, runs AL and AN)."""
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=1024, hidden_size=2048, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=16,
                num_key_value_heads=4, head_dim=128).save_pretrained(tmp_path)
    cfg, cuda = ModelConfig(partial_pretrain=str(tmp_path), random_init=True, compile=True), torch.device("cuda")
    model = load_model(cfg, cuda).model
    materialise_model(model, cfg, cuda, cuda, seed=0)
    lm = CausalLMLoss(model, fused=False, compiled_max_seqlen=4096)
    lm.autocast_dtype = torch.bfloat16
    checkpoint_layers(lm, 1.0)
    torch._dynamo.reset()  # sfttrain.recompute's wrapper is one frame for every model: others' compilations
    compile_layers(decoder_layers(model), cpp_wrapper=False)
    gen = random.Random(0)
    for samples in (3, 2):  # 12288 tokens, then 8192
        batch = pack([RenderedSample([gen.randrange(1024) for _ in range(4096)], [1] * 4096, i)
                      for i in range(samples)]).to(cuda)
        with torch._dynamo.config.patch(error_on_recompile=True):
            lm(batch).backward()


def test_checkpointed_layers_that_rerun_attention_take_the_python_wrapper(monkeypatch):
    """A compiled layer checkpointed whole (model.recompute_attention true, or auto with short
    samples: the checkpoint inside its graph; or with parts outside the graph, LoRA on a MoE's
    experts: transformers' checkpoint around it) reruns its attention kernel in backward; torch's
    partitioner wraps that kernel, tagged as drawing random numbers (dropout), in a call that
    replays the RNG state, and inductor's C++ wrapper cannot build that call: W2b with LoRA failed
    so in its first step on an H200 (torch 2.11, GraphSafeRunWithRngState), and stories260K does
    here both ways (RunAndSaveRngState, the CPU's form), fully fine-tuned: LoRA has no part in the
    failure, and peft's wrappers tripled the graph's projections (21 GEMMs a layer, not 7), a third of
    the test's time. The second way only where transformers
    checkpoints a layer's `forward`, inside the compiled graph (5.25); 5.17 checkpoints `__call__`,
    around the compiled code, which the partitioner never sees (on the CPU it trains; W2b on an H200
    failed otherwise, run BO's CheckpointError). So auto takes the Python wrapper for such runs,
    saying why at start-up, and an explicit true is refused before compute; layers keeping their
    attention output keep the C++ one. When a torch lifts the limit, the first assertions fail and
    the rule can go."""
    from transformers import Qwen3Config, Qwen3MoeConfig
    from transformers.modeling_layers import GradientCheckpointingLayer

    from sfttrain import attention
    from sfttrain.config import Config, ConfigError
    from sfttrain.parallel import describe_compile
    from sfttrain.resolved import cpp_wrapper
    from tests.test_fuse_projections import loss_and_grads as adapter_grads, stories

    def around(lm):
        layers = decoder_layers(lm.model)
        recompute.transformers_checkpointing(lm.model, layers, layers)

    ways = [lambda lm: checkpoint_layers(lm, 1.0, recompute_attention=True)]
    if "__call__" not in vars(GradientCheckpointingLayer):  # it wraps `forward`: inside the compiled layer
        ways.append(around)
    try:
        for checkpoint_layers_way in ways:
            lm, _ = stories(lora=False)
            use_one_sample(lm)
            checkpoint_layers_way(lm)
            torch._dynamo.reset()
            compile_layers(decoder_layers(lm.model), cpp_wrapper=True)
            with pytest.raises(torch._inductor.exc.InductorError, match="RngState"):
                adapter_grads(lm, pack([RenderedSample(list(range(1, 101)), [1] * 100, 0)]))
    finally:
        attention.register()
        torch._dynamo.reset()

    cuda = types.SimpleNamespace(device=torch.device("cuda"))
    cfg = Config()
    cfg.model.compile, cfg.data.max_length = True, 1024  # checkpointing is on by default
    assert cpp_wrapper(cfg, "cuda", Qwen3Config()) is False
    chosen = types.SimpleNamespace(compile_cpp_wrapper=False, fuse_projections=False, fold_lora=False)  # what it reads
    assert "rerun attention" in describe_compile(cfg, cuda, Qwen3Config(), chosen)
    cfg.model.compile_cpp_wrapper = True
    with pytest.raises(ConfigError, match="model.recompute_attention=false"):
        cpp_wrapper(cfg, "cuda", Qwen3Config())
    cfg.model.compile_cpp_wrapper, cfg.model.recompute_attention = "auto", False  # attention outputs kept
    assert cpp_wrapper(cfg, "cuda", Qwen3Config()) is True
    monkeypatch.setattr(torch, "__version__", "2.12.0")  # a C++ wrapper that calls the experts' grouped GEMM
    assert cpp_wrapper(cfg, "cuda", Qwen3MoeConfig()) is True
    cfg.model.lora_rank = 8  # the experts' adapters run outside the graph: transformers' checkpoint, all rerun
    assert cpp_wrapper(cfg, "cuda", Qwen3MoeConfig()) is False
    assert cpp_wrapper(cfg, "cuda", Qwen3Config()) is True
    cfg.model.recompute_attention, cfg.data.max_length = "auto", 8192  # auto keeps them for long samples
    assert cpp_wrapper(cfg, "cuda", Qwen3Config()) is True
    cfg.data.max_length, cfg.model.enable_gradient_checkpointing = 1024, False  # nothing recomputed
    assert cpp_wrapper(cfg, "cuda", Qwen3Config()) is True
    assert cpp_wrapper(cfg, "cuda", Qwen3MoeConfig()) is True


@pytest.mark.parametrize("torch_version, moe_cpp", [("2.11.0+cu130", False), ("2.12.0", True)])
def test_cpp_wrapper_is_chosen_only_where_it_can_call_the_experts_grouped_gemm(monkeypatch, torch_version, moe_cpp):
    """model.compile_cpp_wrapper on CUDA: auto takes the C++ wrapper, except for a mixture of experts
    under a torch whose C++ wrapper has no call for torch._grouped_mm (before 2.12, per torchgen's
    fallback table): W4 with LoRA failed to build its layers on an H200 with torch 2.11
    (`aoti_torch_cuda__grouped_mm was not declared`). An explicit true there is refused, naming
    the key; a dense model keeps the C++ wrapper. Micro-batches over 65536 tokens a rank take the
    Python one (W2b with LoRA crashed in the C++ one at 131072), and so do FP8 runs (measured on it)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    from sfttrain.config import Config, ConfigError
    from sfttrain.resolved import cpp_wrapper

    monkeypatch.setattr(torch, "__version__", torch_version)
    cfg = Config()
    cfg.model.lora_rank = 8
    assert cpp_wrapper(cfg, "cuda", Qwen3Config()) is True
    assert cpp_wrapper(cfg, "cuda", Qwen3MoeConfig()) is moe_cpp
    cfg.model.compile_cpp_wrapper = True
    if moe_cpp:
        assert cpp_wrapper(cfg, "cuda", Qwen3MoeConfig()) is True
    else:
        with pytest.raises(ConfigError, match="model.compile_cpp_wrapper=true"):
            cpp_wrapper(cfg, "cuda", Qwen3MoeConfig())
    cfg.model.lora_rank = 0
    cfg.model.compile_cpp_wrapper = "auto"
    assert cpp_wrapper(cfg, "cuda", Qwen3Config()) is True  # full fine-tuning too: W1 is host-bound
    assert cpp_wrapper(cfg, "cuda", Qwen3MoeConfig()) is moe_cpp
    cfg.data.max_token_len_per_gpu = 131072
    assert cpp_wrapper(cfg, "cuda", Qwen3Config()) is False
    cfg.ulysses_sequence_parallel_size = 2  # 65536 tokens a rank
    assert cpp_wrapper(cfg, "cuda", Qwen3Config()) is True
    cfg.model.fp8 = "tensorwise"  # FP8 runs were measured on the Python wrapper
    assert cpp_wrapper(cfg, "cuda", Qwen3Config()) is False
