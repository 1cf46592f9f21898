"""model.base_quant=fp8 (sfttrain/quant.py): LoRA on a frozen base held in float8 e4m3 with a scale per
output row, its GEMMs (forward, input gradient) float8 through torch._scaled_mm (on CPU here).

Real jobs (gloo ranks) on the real stories260K model, fp32, as tests/test_nf4.py: `ref` on 2 ranks
(FSDP2 shards the adapters and leaves the float8 weights whole on each rank), `one` on 1 rank, and
ref's step 2 resumed on 2 ranks. Of stories260K's linear layers, the attention projections (64 and 32
wide) are float8; the MLP's 172 is no multiple of 16, which float8 GEMMs need: they stay in fp32.

The bounds come from e4m3's 3 mantissa bits: a value v of a row scaled to e4m3's range (largest
magnitude 448) rounds to within 2^-4 |v| (normal numbers) or 2^-10 (half the subnormal spacing 2^-9).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.conftest import STORIES, needs_cpu_fp8, run_sfttrain
from tests.test_checkpoint import data, losses_by_step, max_rel_diff, state  # noqa: F401 (data: fixture)
from tests.test_lora import LORA, STEPS, lora_job

FP8 = ["model.base_quant=fp8", *LORA]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")  # stories260K's linear layers with dimensions of 16s
# 1 rank against 2: step 1 computes the same per token (the adapters' B is zero, the quantization is per
# row), to fp32's summation order: 1e-5, as tests/test_lora.py. From step 2 on, the adapters differ by the
# gradients' summation order (~1e-7), and quantizing activations and gradients as they come is
# discontinuous: such a difference moves some values across an e4m3 rounding boundary (a step of 2^-4 of the
# value), each such flip a difference of its own; stories260K's loss at step 4 moves by ~2e-4, its adapters
# by ~1% (they move 70% over the run). Within a world size nothing differs: a resume is exact.
REL_TOL, FLIPS_LOSS, FLIPS_ADAPTERS = 1e-5, 1e-3, 5e-2


def quant_run(tmp_path_factory, data: Path, nproc: int, base_quant: str, *extra: str) -> tuple[Path, str]:
    """A LoRA job over a `base_quant` base on `nproc` ranks: its folder and output."""
    run_dir = tmp_path_factory.mktemp(f"{base_quant}_{nproc}") / "run"
    return run_dir, run_sfttrain(nproc, lora_job(data, run_dir, f"model.base_quant={base_quant}", *extra)).stdout


def quant_fixtures(base_quant: str):
    """The module's `ref` (2 ranks, a checkpoint every step: folder and output) and `one` (1 rank: folder)."""

    @pytest.fixture(scope="module")
    def ref(data, tmp_path_factory) -> tuple[Path, str]:
        return quant_run(tmp_path_factory, data, 2, base_quant, "trainer.save_freq=1")

    @pytest.fixture(scope="module")
    def one(data, tmp_path_factory) -> Path:
        return quant_run(tmp_path_factory, data, 1, base_quant)[0]

    return ref, one


ref, one = quant_fixtures("fp8")


def e4m3_rows(w: torch.Tensor) -> torch.Tensor:
    """`w` through e4m3 and back, a scale per row written out here (fp32, as a GEMM takes it): the
    row's amax to 448."""
    scale = w.abs().amax(dim=1, keepdim=True).float() / 448
    return (w.float() / scale).to(torch.float8_e4m3fn).float() * scale


def rounding_bound(x: torch.Tensor) -> torch.Tensor:
    """Per element of `x`, what e4m3 with a scale per row may move it by."""
    return 2**-4 * x.abs() + 2**-10 * x.abs().amax(dim=-1, keepdim=True) / 448


def dequantized_base() -> dict[str, torch.Tensor]:
    """stories260K's weights, each float8 one through e4m3 and back."""
    weights = load_file(STORIES / "model.safetensors")
    return {n: e4m3_rows(w) if n.split(".")[-2] in PROJECTIONS else w for n, w in weights.items()}


@needs_cpu_fp8
def test_gemms_equal_the_dequantized_weight_within_e4m3s_rounding():
    """Forward and input gradient against F.linear with the dequantized weight (fp64): each differs
    by at most what rounding x (or the gradient) per row to e4m3 moves it by, plus bf16's rounding of
    the GEMM's output (2^-9). The weight takes no gradient and stays float8."""
    from sfttrain import quant

    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 48, bias=True), nn.Linear(48, 16)).requires_grad_(False)
    model.get_output_embeddings = lambda: model[1]
    quant.quantize_on_meta(model, "fp8")
    layer = model[0].to_empty(device="cpu")
    assert type(layer).__name__ == "Float8BaseLinear" and type(model[1]) is nn.Linear
    w, bias = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None], torch.randn(48)  # rows of other ranges
    quant.fill_shard(layer.weight, w, slice(0, 48), layer)
    layer.bias.copy_(bias)
    deq = (layer.weight.double() * layer.weight_scale.double())
    assert layer.weight.dtype == torch.float8_e4m3fn and torch.equal(deq.float(), e4m3_rows(w))
    assert ((deq - w.double()).abs() <= rounding_bound(w.double()) * (1 + 2**-20)).all()  # fp32's scale
    assert torch.equal(layer.weight.float().abs().amax(dim=1), torch.full((48,), 448.0))

    x = (torch.randn(2, 7, 64) * torch.logspace(-2, 2, 7)[:, None]).requires_grad_()
    y = layer(x)
    want = nn.functional.linear(x.detach().double(), deq, bias.double())
    # x's rounding, then the output's to bf16, and fp32 accumulation's (2^-20 for sums of 64 terms)
    err = rounding_bound(x.detach().double()) @ deq.abs().T + 2**-20 * x.detach().double().abs() @ deq.abs().T
    assert ((y.double() - want).abs() <= err * (1 + 2**-9) + 2**-9 * want.abs()).all()
    assert (y.double() - want).abs().max() > 1e-4 * want.abs().max()  # it is float8 (fp32 would be ~1e-7)
    grad = torch.randn_like(y) * torch.logspace(-3, 0, 48)
    y.backward(grad)
    want = grad.double() @ deq
    # the gradient's rows are quantized with W's row scales folded in
    err = rounding_bound(grad.double() * layer.weight_scale.double().T) @ layer.weight.double().abs()
    err += 2**-20 * grad.double().abs() @ deq.abs()
    assert ((x.grad.double() - want).abs() <= err * (1 + 2**-9) + 2**-9 * want.abs()).all()
    assert layer.weight.grad is None and layer.weight.dtype == torch.float8_e4m3fn


@needs_cpu_fp8
def test_one_rank_equals_two_ranks(ref, one):
    """The 2-rank run holds the same float8 base as the 1-rank run (whole on each rank, quantized the
    same), and its adapters learn."""
    run_dir, stdout = ref
    assert "frozen base in float8 e4m3" in stdout
    assert "model.base_quant=fp8: 15 linear weights stay in their dtype" in stdout  # the MLP's
    got, want = losses_by_step(one), losses_by_step(run_dir)
    assert got[1] == pytest.approx(want[1], rel=REL_TOL)
    assert got == pytest.approx(want, rel=FLIPS_LOSS)
    assert want[STEPS] < want[1] - 0.5
    assert max_rel_diff(state(one / f"global_step_{STEPS}")["model"],
                        state(run_dir / f"global_step_{STEPS}")["model"]) <= FLIPS_ADAPTERS


@needs_cpu_fp8
def test_resume_reloads_the_base_and_continues_exactly(data, ref, tmp_path):
    """Checkpoints hold the adapters only; a resume (on 2 ranks, as ref) quantizes the base again."""
    check_resume(data, ref[0], tmp_path / "run", "fp8", nproc=2)


@needs_cpu_fp8
def test_exports_equal_the_dequantized_base_plus_adapters(ref, tmp_path):
    """The merged export (transformers) and the adapter on the dequantized base (peft) give the
    logits of a reference built here from the e4m3 round trip of each float8 weight plus alpha/r * B @ A
    of the checkpoint's adapters (fp32: rounding of one weight add per layer). e4m3 moves the logits
    less than NF4 does."""
    check_exports(ref[0], tmp_path / "hf", "fp8", dequantized_base(), quantization_moves=1e-3)


def check_resume(data: Path, run_dir: Path, resumed: Path, base_quant: str, nproc: int) -> None:
    """`run_dir`'s step 2 (adapters only in its checkpoint) resumed in `resumed` on `nproc` ranks: steps 3-4
    and the final adapters as `run_dir`'s."""
    assert all(".lora_A." in n or ".lora_B." in n for n in state(run_dir / "global_step_2")["model"])
    run_sfttrain(nproc, lora_job(data, resumed, f"model.base_quant={base_quant}", "trainer.resume_mode=resume_path",
                                 f"trainer.resume_from_path={run_dir / 'global_step_2'}"))
    want = losses_by_step(run_dir)
    assert losses_by_step(resumed) == pytest.approx({s: want[s] for s in (3, 4)}, rel=REL_TOL)
    assert max_rel_diff(state(resumed / f"global_step_{STEPS}")["model"],
                        state(run_dir / f"global_step_{STEPS}")["model"]) <= REL_TOL


def check_exports(run_dir: Path, out: Path, base_quant: str, base: dict, quantization_moves: float) -> None:
    """`run_dir`'s last checkpoint exported to `out`: both exports give the logits of `base` (the
    dequantized weights) plus the adapters; without the quantization they move by `quantization_moves`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from sfttrain.export import export

    export(str(run_dir / f"global_step_{STEPS}"), str(out))
    recorded = json.loads((out / "adapter" / "sfttrain_base.json").read_text())
    assert recorded["base_quant"] == base_quant and recorded["folder"] == str(STORIES)
    reference = dict(base)
    adapters = state(run_dir / f"global_step_{STEPS}")["model"]
    for name in [n for n in adapters if ".lora_A." in n]:
        module = name.split(".lora_A.")[0]
        delta = adapters[name.replace(".lora_A.", ".lora_B.")] @ adapters[name]
        reference[module + ".weight"] = reference[module + ".weight"] + 16 / 8 * delta

    def logits(model) -> torch.Tensor:
        with torch.no_grad():
            return model.eval()(ids).logits.double()

    def model_with(weights: dict) -> nn.Module:
        model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
        model.load_state_dict(weights, strict=False)
        return model

    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    want = logits(model_with(reference))
    merged = logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32))
    with_adapter = logits(PeftModel.from_pretrained(model_with(base), out / "adapter"))
    scale = want.abs().max()
    assert (merged - want).abs().max() <= 1e-5 * scale
    assert (with_adapter - want).abs().max() <= 1e-5 * scale
    # what the comparisons tell apart: the adapters and the quantization each move the logits
    assert (logits(model_with(base)) - want).abs().max() > 1e-2 * scale
    unquantized = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
    assert (logits(PeftModel.from_pretrained(unquantized, out / "adapter")) - want).abs().max() > \
        quantization_moves * scale


def build(*overrides: str, seed: int = 1) -> nn.Module:
    """The model a run trains: built on the meta device, materialised on one rank (fp32 base)."""
    from sfttrain.config import load_config
    from sfttrain.model import load_model, materialise_model

    cfg = load_config(None, ["data.train_files=x.parquet", f"model.partial_pretrain={STORIES}", *LORA,
                             "model.fsdp_config.mixed_precision=false", *overrides])
    model = load_model(cfg.model, torch.device("cpu")).model
    materialise_model(model, cfg.model, torch.device("cpu"), torch.device("cpu"), seed=seed)
    return model


def test_the_trained_model_holds_the_quantized_weights():
    model = build("model.base_quant=fp8")
    want = dequantized_base()
    held = {n: m for n, m in model.named_modules() if type(m).__name__ == "Float8BaseLinear"}
    assert len(held) == 5 * len(PROJECTIONS)
    for name, m in held.items():
        assert torch.equal(m.weight.float() * m.weight_scale, want[name.replace(".base_layer", "") + ".weight"])


def test_random_init_quantizes_the_seeded_draw():
    """A random base (the benches') is drawn per module from the seed, as without fp8, and quantized."""
    plain = dict(build("model.random_init=true", seed=3).named_modules())
    quantized = build("model.random_init=true", "model.base_quant=fp8", seed=3)
    for name, m in quantized.named_modules():
        if type(m).__name__ == "Float8BaseLinear":
            assert torch.equal(m.weight.float() * m.weight_scale, e4m3_rows(plain[name].weight)), name


def test_the_preflight_counts_the_weights_fp8_holds():
    """The preflight's parameter memory equals the bytes the built model holds: a byte per float8
    weight and an fp32 scale per row, the rest in fp32."""
    from sfttrain.config import load_config
    from sfttrain.hub import model_config
    from sfttrain.lora import apply_lora
    from sfttrain.model import build_on_meta
    from sfttrain.plan import GIB, DenseShape, memory_per_rank

    model = build("model.base_quant=fp8")
    held = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for n, b in model.named_buffers()
                                                            if n.endswith("weight_scale"))
    cfg = load_config(None, ["data.train_files=x.parquet", f"model.partial_pretrain={STORIES}", *FP8,
                             "model.fsdp_config.mixed_precision=false"])
    meta = apply_lora(build_on_meta(cfg.model, model_config(str(STORIES), False)), cfg.model)  # as the preflight
    for ranks in (1, 2):  # FSDP2 shards the rest, not the float8 weights
        planned = memory_per_rank(cfg, DenseShape.from_config_json(str(STORIES)), meta, dp_size=ranks)["parameters"]
        fp8 = sum(p.nbytes + m.weight_scale.nbytes for m in model.modules() if hasattr(m, "weight_scale")
                  for p in [m.weight])
        assert planned * GIB == pytest.approx(fp8 + (held - fp8) / ranks, rel=1e-9)


def test_fp8_is_refused_where_it_cannot_run(monkeypatch):
    """Without LoRA, with CPU offload, under DDP, and where torch has no rowwise float8 GEMM (as on an A100)."""
    from sfttrain.checks import lora_base_ready
    from sfttrain.config import ConfigError, load_config
    from sfttrain.parallel import check_device
    from sfttrain.quant import check_fp8

    def config(*overrides: str):
        return load_config(None, ["data.train_files=x.parquet", f"model.partial_pretrain={STORIES}", *overrides])

    with pytest.raises(ConfigError, match="model.base_quant=fp8 quantizes the frozen base under LoRA adapters"):
        lora_base_ready(config("model.base_quant=fp8"))
    with pytest.raises(ConfigError, match="model.base_quant=fp8 with CPU offload"):
        check_device(config(*FP8, "model.fsdp_config.cpu_offload=true"), "sharded", "cuda")
    with pytest.raises(ConfigError, match=r"model.base_quant=fp8 with DDP \(NO_SHARD or fsdp_size=1\): DDP's first "
                                          r"forward broadcasts every weight, which sends the float8 weights"):
        check_device(config(*FP8), "replicated", "cpu")

    def no_rowwise(*args, **kwargs):
        raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or "
                           "8.9, or ROCm MI300+\nmore")

    monkeypatch.setattr(torch, "_scaled_mm", no_rowwise)
    with pytest.raises(ConfigError, match=r"model.base_quant=fp8 needs float8 GEMMs with a scale per row "
                                          r"\(torch._scaled_mm\), which torch .* does not run on cpu "
                                          r"\(torch._scaled_mm is only supported on CUDA devices with compute "
                                          r"capability >= 9.0 or 8.9, or ROCm MI300\+\); .*use model.base_quant=nf4"):
        check_fp8("fp8", "cpu")
    check_fp8("none", "cpu")


def test_a_weight_of_odd_shape_stays_with_a_warning(caplog):
    from sfttrain.quant import quantize_on_meta

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 48), nn.Linear(64, 10), nn.Linear(48, 512)).requires_grad_(False)
    model.get_output_embeddings = lambda: model[2]
    with caplog.at_level(logging.WARNING, logger="sfttrain"):
        quantize_on_meta(model, "fp8")
    assert [type(m).__name__ for m in model] == ["Float8BaseLinear", "Linear", "Linear"]
    assert "model.base_quant=fp8: 1 linear weights stay in their dtype, a dimension not a multiple of 16" in caplog.text


@needs_cpu_fp8
def test_a_compiled_checkpointed_layer_computes_as_eager():
    """Two float8 projections inside one activation-checkpointed, compiled region (a decoder layer under
    model.compile): the same outputs and input gradient as eager (an autograd.Function there broke dynamo)."""
    from torch.utils.checkpoint import checkpoint

    from sfttrain import quant

    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 48, bias=False), nn.Linear(64, 32), nn.Linear(48, 16)).requires_grad_(False)
    model.get_output_embeddings = lambda: model[2]
    quant.quantize_on_meta(model, "fp8")
    model.to_empty(device="cpu")
    for m in model[:2]:
        quant.fill_shard(m.weight, torch.randn(m.out_features, 64), slice(0, m.out_features), m)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return model[0](x)[..., :32] * model[1](x)

    x = torch.randn(2, 7, 64, requires_grad=True)
    eager = layer(x)
    (want,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(lambda x: checkpoint(layer, x, use_reentrant=False), dynamic=True)(x)
    (got,) = torch.autograd.grad(compiled.sum(), x)
    assert torch.equal(compiled, eager) and torch.equal(got, want)
