"""model.base_quant=nf4 (sfttrain/quant.py): LoRA on a frozen base held in torchao's 4-bit NF4.

Real jobs (gloo ranks) on the real stories260K model, fp32, as tests/test_lora.py: `ref` on 2 ranks
(FSDP2 shards and all-gathers the NF4 weights), `one` on 1 rank, and ref's step 2 resumed on 1 rank.
Bounds: 1 rank against 2 sums each gradient in another order: relative 1e-5, as tests/test_lora.py.
The reference base is built another way: each linear weight of the model file quantized and
dequantized by torchao directly, with the scale-block sizes written out here for stories260K's shapes
(hidden 64, 172 intermediate, 4 KV heads of 8): none of its weights takes QLoRA's 256, whose blocks its
small matrices do not fill; 172 = 4 x 43 gives the MLP's.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.conftest import STORIES, run_sfttrain
from tests.test_checkpoint import data, losses_by_step, max_rel_diff, state  # noqa: F401 (data: fixture)
from tests.test_fp8_base import check_exports, check_resume, quant_fixtures
from tests.test_lora import LORA, REL_TOL, STEPS, lora_job

NF4 = ["model.base_quant=nf4", *LORA]
# stories260K's linear layers -> the scales per int8 block of their double quantization
SCALER_BLOCKS = {"q_proj": 16, "k_proj": 8, "v_proj": 8, "o_proj": 16, "gate_proj": 43, "up_proj": 43,
                 "down_proj": 43}

torchao = pytest.importorskip("torchao")


def to_nf4(weight: torch.Tensor, scaler_block: int):
    from torchao.quantization import to_nf4

    return to_nf4(weight.contiguous(), 64, scaler_block)


ref, one = quant_fixtures("nf4")


def dequantized_base() -> dict[str, torch.Tensor]:
    """stories260K's weights, each linear one but the (tied) head through NF4 and back."""
    weights = load_file(STORIES / "model.safetensors")
    for name, w in weights.items():
        kind = name.split(".")[-2]
        if kind in SCALER_BLOCKS:
            weights[name] = to_nf4(w, SCALER_BLOCKS[kind]).get_original_weight()
    return weights


def test_one_rank_equals_two_ranks(ref, one):
    """FSDP2 over 2 ranks gathers the NF4 shards of the same quantization as the 1-rank model's."""
    run_dir, stdout = ref
    assert "frozen base in NF4" in stdout
    assert "stay in their dtype" not in stdout  # every linear weight of stories260K is quantized
    got, want = losses_by_step(one), losses_by_step(run_dir)
    assert got == pytest.approx(want, rel=REL_TOL)
    assert want[STEPS] < want[1] - 0.5  # the adapters learn
    assert max_rel_diff(state(one / f"global_step_{STEPS}")["model"],
                        state(run_dir / f"global_step_{STEPS}")["model"]) <= REL_TOL


def test_resume_reloads_the_base_and_continues_exactly(data, ref, tmp_path):
    """Checkpoints hold the adapters only; a resume (on 1 rank) quantizes the base again from the
    model folder: steps 3-4 and the final adapters as ref's."""
    check_resume(data, ref[0], tmp_path / "run", "nf4", nproc=1)


def test_resume_refuses_another_base_quant(data, ref, tmp_path):
    """Adapters trained on the NF4 base compute something else on the unquantized one."""
    run_dir, _ = ref
    proc = run_sfttrain(1, lora_job(data, tmp_path / "run", "trainer.resume_mode=resume_path",
                                    f"trainer.resume_from_path={run_dir / 'global_step_2'}"), check=False)
    assert proc.returncode == 2
    assert "model.base_quant: nf4 -> none" in proc.stdout, proc.stdout[-2000:]


def test_exports_equal_the_dequantized_base_plus_adapters(ref, tmp_path):
    """The merged export (transformers) and the adapter on the dequantized base (peft) give the
    logits of a reference built here: torchao's own round trip of each weight plus alpha/r * B @ A
    of the checkpoint's adapters (fp32: rounding of one weight add per layer)."""
    check_exports(ref[0], tmp_path / "hf", "nf4", dequantized_base(), quantization_moves=1e-2)


def test_the_trained_model_holds_the_dequantized_weights():
    """The model a run trains (built on the meta device, materialised on one rank) holds each linear
    weight as an NF4 tensor whose dequantized value is the reference's, and computes with it."""
    from sfttrain.config import load_config
    from sfttrain.model import load_model, materialise_model

    cfg = load_config(None, ["data.train_files=x.parquet", f"model.partial_pretrain={STORIES}", *NF4,
                             "model.fsdp_config.mixed_precision=false"])  # the runs' fp32 base
    model = load_model(cfg.model, torch.device("cpu")).model
    materialise_model(model, cfg.model, torch.device("cpu"), torch.device("cpu"), seed=1)
    want = dequantized_base()
    quantized = {name: m.weight for name, m in model.named_modules()
                 if name.endswith("base_layer") and type(m.weight).__name__ == "NF4Tensor"}
    assert len(quantized) == 5 * 7
    x = torch.randn(3, 172, generator=torch.Generator().manual_seed(0))
    for name, weight in quantized.items():
        ref = want[name.replace(".base_layer", "") + ".weight"]
        assert torch.equal(weight.get_original_weight(), ref), name
        assert torch.allclose(nn.functional.linear(x[:, :ref.shape[1]], weight), x[:, :ref.shape[1]] @ ref.T)


class Tiny(nn.Module):
    """Linear layers of the shapes the block rule decides on, and an output head it leaves alone."""

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(8192, 1024, bias=False)  # a 70B's k_proj: QLoRA's 256 scales per block
        self.odd = nn.Linear(64, 10, bias=False)  # 10 rows do not split into 4 row shards
        self.head = nn.Linear(64, 512, bias=False)
        for p in self.parameters():
            p.requires_grad_(False)

    def get_output_embeddings(self):
        return self.head


def test_weights_no_block_fits_stay_in_their_dtype_with_a_warning(caplog):
    from sfttrain.quant import quantize_on_meta

    with torch.device("meta"):
        model = Tiny()
    with caplog.at_level(logging.WARNING, logger="sfttrain"):
        quantize_on_meta(model, "nf4")
    assert type(model.big.weight).__name__ == "NF4Tensor" and model.big.weight.scaler_block_size == 256
    assert type(model.odd.weight) is nn.Parameter and type(model.head.weight) is nn.Parameter
    assert "1 linear weights stay in their dtype" in caplog.text and "odd" in caplog.text


def test_random_init_quantizes_the_seeded_draw():
    """A random base (the benches') is drawn per module from the seed, as without NF4, and quantized."""
    from sfttrain.config import load_config
    from sfttrain.model import load_model, materialise_model

    def build(quant: str) -> dict:
        cfg = load_config(None, ["data.train_files=x.parquet", f"model.partial_pretrain={STORIES}", *LORA,
                                 "model.random_init=true", f"model.base_quant={quant}",
                                 "model.fsdp_config.mixed_precision=false"])
        model = load_model(cfg.model, torch.device("cpu")).model
        materialise_model(model, cfg.model, torch.device("cpu"), torch.device("cpu"), seed=3)
        return {n: m.weight for n, m in model.named_modules() if n.endswith("base_layer")}

    plain, quantized = build("none"), build("nf4")
    for name, weight in quantized.items():
        want = to_nf4(plain[name], SCALER_BLOCKS[name.split(".")[-2]]).get_original_weight()
        assert torch.equal(weight.get_original_weight(), want), name


def test_base_quant_and_random_init_are_checked_at_start_up():
    from sfttrain.checks import lora_base_ready
    from sfttrain.config import ConfigError, load_config

    def check(*overrides: str) -> None:
        lora_base_ready(load_config(None, ["data.train_files=x.parquet", f"model.partial_pretrain={STORIES}",
                                           *overrides]))

    with pytest.raises(ConfigError, match="model.base_quant=nf4 quantizes the frozen base under LoRA adapters, "
                                          "but model.lora_rank=0"):
        check("model.base_quant=nf4")
    with pytest.raises(ConfigError, match="trainer.save_hf=true with LoRA on model.random_init=true"):
        check("model.lora_rank=8", "model.random_init=true", "trainer.save_hf=true")
    check("model.lora_rank=8", "model.random_init=true", "model.base_quant=nf4")  # a bench's: it resumes


def test_the_preflight_counts_the_weights_nf4_holds():
    """The preflight's parameter memory against the bytes the model a run builds holds (NF4's packed
    values, scales and factors; the rest in fp32). Within 2%: the preflight counts QLoRA's 256 scales
    per factor and no per-tensor mean and lookup table, which stories260K's small matrices make ~1%."""
    from sfttrain.config import load_config
    from sfttrain.hub import model_config
    from sfttrain.lora import apply_lora
    from sfttrain.model import build_on_meta, load_model, materialise_model
    from sfttrain.plan import GIB, DenseShape, memory_per_rank

    cfg = load_config(None, ["data.train_files=x.parquet", f"model.partial_pretrain={STORIES}", *NF4,
                             "model.fsdp_config.mixed_precision=false"])
    model = load_model(cfg.model, torch.device("cpu")).model
    materialise_model(model, cfg.model, torch.device("cpu"), torch.device("cpu"), seed=1)
    held = sum(sum(t.nbytes for t in (p.quantized_data, p.quantized_scalers, p.quantization_factor, p.scaler_mean,
                                      p.nf4)) if type(p).__name__ == "NF4Tensor" else p.nbytes
               for p in model.parameters())
    meta = apply_lora(build_on_meta(cfg.model, model_config(str(STORIES), False)), cfg.model)  # as the preflight
    planned = memory_per_rank(cfg, DenseShape.from_config_json(str(STORIES)), meta, dp_size=1)["parameters"] * GIB
    unquantized = sum(p.numel() * 4 for p in model.parameters())
    assert planned == pytest.approx(held, rel=0.02) and held < 0.7 * unquantized


def test_a_missing_torchao_is_one_clear_message(monkeypatch):
    from sfttrain.checks import lora_base_ready
    from sfttrain.config import load_config
    from sfttrain.errors import DependencyError

    for name in ("torchao", "torchao.quantization"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    cfg = load_config(None, ["data.train_files=x.parquet", f"model.partial_pretrain={STORIES}", *NF4])
    with pytest.raises(DependencyError, match=r"model.base_quant=nf4 needs torchao: pip install -e '.\[fp8\]'"):
        lora_base_ready(cfg)


def test_ddp_is_refused(data, tmp_path):
    """DDP's first forward broadcasts the frozen weights too, NF4's scales garbled on the way."""
    proc = run_sfttrain(2, lora_job(data, tmp_path / "run", "model.base_quant=nf4",
                                    "model.fsdp_config.sharding_strategy=NO_SHARD"), check=False)
    assert proc.returncode == 2 and "model.base_quant=nf4 with DDP (NO_SHARD or fsdp_size=1)" in proc.stdout
