"""LoRA (sfttrain/lora.py): adapters learn on a frozen base, checkpoints hold the adapters only and
resume on another number of ranks, export writes a peft adapter folder and a merged model.

Real jobs (gloo ranks, conftest.launch) on the real stories260K model, fp32, activation checkpointing on
(the frozen base's inputs need no grad). Three runs: `ref` on 2 ranks (4 steps, a checkpoint
after each), `one` on 1 rank (the same job), and ref's step 2 resumed on 1 rank. Bounds: 1 rank
against 2 sums each gradient in another order, so agreement is to float32 rounding compounded
over a few Adam steps: relative 1e-5 (per-tensor norm of the difference), as tests/test_checkpoint.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sfttrain.config import ConfigError, load_config
from tests.conftest import STORIES, checkpoint_tensor_bytes, read_metrics, run_sfttrain
from tests.test_checkpoint import data, job, losses_by_step, max_rel_diff, state  # noqa: F401 (data: fixture)

STEPS = 4
REL_TOL = 1e-5
# optim.eps=1e-3: lora_B starts at zero, so lora_A's first gradients (step 2) are near zero, and
# Adam's g / sqrt(v) would turn their float32 rounding into whole +-lr updates; an eps above
# that noise keeps those updates proportional to the gradient (SGD-like), so rounding stays rounding
LORA = ["model.lora_rank=8", "model.lora_alpha=16", "model.enable_gradient_checkpointing=true",
        "optim.lr=1e-2", "optim.eps=1e-3", f"trainer.total_training_steps={STEPS}"]


def lora_job(data: Path, run_dir: Path, *extra: str) -> list[str]:
    return job(data, run_dir, *LORA, *extra)


@pytest.fixture(scope="module")
def ref(data, tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("lora_ref") / "run"
    proc = run_sfttrain(2, lora_job(data, run_dir, "trainer.save_freq=1", "trainer.save_hf=true"))
    return run_dir, proc.stdout


@pytest.fixture(scope="module")
def one(data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("lora_one") / "run"
    run_sfttrain(1, lora_job(data, run_dir, "trainer.save_freq=1"))
    return run_dir


def test_the_preflights_checkpoint_size_is_what_a_lora_checkpoint_holds(ref, data):
    """The fp32 adapters and their AdamW moments, as the checkpoint's metadata lists them."""
    from sfttrain.checkpoint import estimated_bytes
    from sfttrain.plan import Startup, model_section

    run_dir, _ = ref
    held = checkpoint_tensor_bytes(run_dir / f"global_step_{STEPS}")
    cfg = load_config(None, lora_job(data, run_dir))
    assert estimated_bytes(model_section(Startup(cfg, 1, ("cpu",), planning=True, folder=str(STORIES)))) == held


def test_lora_learns_and_checkpoints_hold_adapters_only(ref):
    run_dir, stdout = ref
    losses = losses_by_step(run_dir)
    assert losses[STEPS] < losses[1] - 0.5  # only the adapters train: they are in the forward
    assert "lora                : rank 8, alpha 16" in stdout and "M trainable" in stdout
    ckpt = state(run_dir / f"global_step_{STEPS}")
    names = list(ckpt["model"])
    # every injected adapter of the 5 layers x 7 linear layers, and nothing of the base
    assert len(names) == 5 * 7 * 2 and all(".lora_A." in n or ".lora_B." in n for n in names), names
    assert set(ckpt["optim"]["state"]) == set(names)
    assert all(t.dtype == torch.float32 for t in ckpt["model"].values())  # fp32 master weights
    # trainer.save_hf on 2 ranks: the merged model and the adapter folder, written by rank 0
    exported = run_dir / f"global_step_{STEPS}" / "huggingface"
    assert (exported / "model.safetensors").exists() and (exported / "adapter" / "adapter_config.json").exists()


def test_one_rank_equals_two_ranks(ref, one):
    run_dir, _ = ref
    got, want = losses_by_step(one), losses_by_step(run_dir)
    assert got == pytest.approx(want, rel=REL_TOL)
    moved = max_rel_diff(state(run_dir / "global_step_1")["model"], state(run_dir / f"global_step_{STEPS}")["model"])
    assert moved > 1e-3
    assert max_rel_diff(state(one / f"global_step_{STEPS}")["model"],
                        state(run_dir / f"global_step_{STEPS}")["model"]) <= REL_TOL


def test_resume_on_another_world_size(data, ref, tmp_path):
    """Ref's step-2 checkpoint (2 ranks) resumed on 1 rank: steps 3-4 and the final adapters and
    optimizer state as ref's."""
    run_dir, _ = ref
    resumed = tmp_path / "run"
    run_sfttrain(1, lora_job(data, resumed, "trainer.resume_mode=resume_path",
                             f"trainer.resume_from_path={run_dir / 'global_step_2'}"))
    assert [m["step"] for m in read_metrics(resumed) if "loss" in m] == [3, 4]
    want = losses_by_step(run_dir)
    for step, loss in losses_by_step(resumed).items():
        assert loss == pytest.approx(want[step], rel=REL_TOL), step
    final, expected = state(resumed / f"global_step_{STEPS}"), state(run_dir / f"global_step_{STEPS}")
    assert max_rel_diff(final["model"], expected["model"]) <= REL_TOL
    assert max_rel_diff(final["optim"]["state"], expected["optim"]["state"]) <= REL_TOL


def test_ddp_resumes_fsdp_adapters(data, ref, tmp_path):
    """Ref's step-2 checkpoint (FSDP2, 2 ranks) resumed by 2 DDP ranks (NO_SHARD: each holds the
    frozen base and all adapters; only the adapters' gradients are all-reduced): steps 3-4 and the
    final adapters as ref's."""
    run_dir, _ = ref
    resumed = tmp_path / "run"
    proc = run_sfttrain(2, lora_job(data, resumed, "model.fsdp_config.sharding_strategy=NO_SHARD",
                                    "trainer.resume_mode=resume_path",
                                    f"trainer.resume_from_path={run_dir / 'global_step_2'}"))
    assert "DDP: the whole model on each of 2 ranks" in proc.stdout
    want = losses_by_step(run_dir)
    assert losses_by_step(resumed) == pytest.approx({s: want[s] for s in (3, 4)}, rel=REL_TOL)
    final, expected = state(resumed / f"global_step_{STEPS}"), state(run_dir / f"global_step_{STEPS}")
    assert max_rel_diff(final["model"], expected["model"]) <= REL_TOL


def _export(ckpt: Path, out: Path) -> Path:
    from sfttrain.export import export

    export(str(ckpt), str(out))
    return out


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.double()


def test_export_adapter_and_merged_model(ref, one, tmp_path):
    """The adapter from 2 ranks equals the one from 1 rank (step 2); peft loads it on the base; the
    merged model's logits equal base + adapter's (fp32: rounding of one weight add per layer)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    two_out = _export(ref[0] / "global_step_2", tmp_path / "two")
    one_out = _export(one / "global_step_2", tmp_path / "one")
    adapter = load_file(two_out / "adapter" / "adapter_model.safetensors")
    assert max_rel_diff(load_file(one_out / "adapter" / "adapter_model.safetensors"), adapter) <= REL_TOL
    config = json.loads((two_out / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16)

    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    base_logits = _logits(base, ids)
    with_adapter = _logits(PeftModel.from_pretrained(base, two_out / "adapter").eval(), ids)
    merged = _logits(AutoModelForCausalLM.from_pretrained(two_out, dtype=torch.float32).eval(), ids)
    assert (with_adapter - base_logits).abs().max() > 1e-2  # the adapter changes the model
    assert (merged - with_adapter).abs().max() <= 1e-4 * with_adapter.abs().max()


def test_resume_refuses_another_lora_setup(ref):
    """An adapter-only checkpoint resumes only into the same adapters: full fine-tuning, another
    rank or other target modules are refused with names and shapes before DCP is asked."""
    from transformers import AutoModelForCausalLM

    from sfttrain import checkpoint
    from sfttrain.lora import apply_lora

    ckpt = str(ref[0] / "global_step_1")

    def adapters(*overrides: str) -> dict:
        cfg = load_config(overrides=["data.train_files=x.parquet", f"model.partial_pretrain={STORIES}", *overrides])
        model = apply_lora(AutoModelForCausalLM.from_pretrained(STORIES), cfg.model)
        return {k: v for k, v in model.state_dict().items() if ".lora_" in k}

    checkpoint.check_same_model(ckpt, adapters("model.lora_rank=8"))  # the same adapters: fine
    with pytest.raises(ConfigError, match="of other shapes"):
        checkpoint.check_same_model(ckpt, adapters("model.lora_rank=4"))
    with pytest.raises(ConfigError, match="not in this model"):
        checkpoint.check_same_model(ckpt, adapters("model.lora_rank=8", "model.target_modules=[q_proj]"))
    with pytest.raises(ConfigError, match="weights missing"):
        checkpoint.check_same_model(ckpt, AutoModelForCausalLM.from_pretrained(STORIES).state_dict())


def test_target_modules_are_checked_against_the_model():
    from transformers import AutoModelForCausalLM

    from sfttrain.lora import apply_lora

    common = ["data.train_files=x.parquet", f"model.partial_pretrain={STORIES}", "model.lora_rank=4"]
    model = AutoModelForCausalLM.from_pretrained(STORIES)
    cfg = load_config(overrides=[*common, "model.target_modules=[q_proj,qkv_proj]"])
    with pytest.raises(ConfigError, match=r"\['qkv_proj'\] names no linear layer.*'down_proj'.*'v_proj'"):
        apply_lora(model, cfg.model)
    cfg = load_config(overrides=[*common, "model.target_modules=[q_proj,v_proj]"])
    apply_lora(model, cfg.model)
    trainable = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"q_proj", "v_proj"}
    for bad, needle in (("model.lora_dropout=1.0", "lora_dropout"), ("model.lora_rank=-1", "lora_rank")):
        with pytest.raises(ConfigError, match=needle):
            load_config(overrides=[*common, bad])


def test_adapters_read_their_input_without_a_copy():
    """Mixed precision: a bf16 frozen base, fp32 adapters, bf16 GEMMs by autocast. peft would cast
    an adapter's bf16 input up to the adapters' fp32 (and autocast straight back down), so every
    adapted layer would save a second copy of its input for backward; sfttrain turns that cast off.
    What an adapted layer saves of the input's size must be the input itself."""
    from transformers import AutoModelForCausalLM

    from sfttrain.lora import apply_lora

    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.bfloat16)
    cfg = load_config(overrides=["data.train_files=x.parquet", f"model.partial_pretrain={STORIES}",
                                 "model.lora_rank=4", "model.fsdp_config.mixed_precision=true"])
    apply_lora(model, cfg.model)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.lora_A["default"].weight.dtype == torch.float32
    x = torch.randn(5, layer.in_features, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
    out.float().sum().backward()  # and the layer still trains
    assert layer.lora_B["default"].weight.grad is not None
    inputs = [t for t in saved if t.shape == x.shape]
    assert inputs and all(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in inputs), \
        [t.dtype for t in inputs]


def test_other_adapter_settings_are_refused_at_resume(ref, data, tmp_path):
    """A resume of ref's step 2 with another model.lora_alpha (it scales the adapters' output: the
    checkpoint's adapters would compute another function) is refused at start-up, naming the key's
    old and new value, by the run (exit code 2) and by the preflight (the same settings resume:
    test_resume_on_another_world_size)."""
    from sfttrain.plan import main as plan
    from tests.test_checkpoint import one_message

    changed = lora_job(data, tmp_path / "run", "model.lora_alpha=128", "trainer.resume_mode=resume_path",
                       f"trainer.resume_from_path={ref[0] / 'global_step_2'}")
    message = one_message(run_sfttrain(2, changed, check=False), 2)
    assert "the LoRA adapters were trained with other settings (model.lora_alpha: 16 -> 128)" in message, message
    assert plan([*changed, "--nproc", "2"]) == 2


def test_another_base_is_refused(ref, tmp_path):
    """The checkpoint records the base it adapts (name, fingerprint of the weight files): resuming
    or exporting it onto another base of the same shapes is refused naming both; the same
    weights in another folder (a moved copy) are accepted."""
    from transformers import AutoModelForCausalLM

    from sfttrain import lora, resume
    from sfttrain.checkpoint import TrainState
    from sfttrain.export import export_lora
    from sfttrain.export import main as export_main

    ckpt = ref[0] / f"global_step_{STEPS}"
    saved = json.loads((ckpt / "trainer_state.json").read_text())
    assert saved["base"]["name"] == str(STORIES) and saved["base"]["files"]
    moved, other = tmp_path / "moved", tmp_path / "other"
    shutil.copytree(STORIES, moved)
    model = AutoModelForCausalLM.from_pretrained(STORIES)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)
    model.save_pretrained(other)  # same shapes, same file sizes, other weights
    assert lora.base_identity(str(moved), str(moved))["files"] == saved["base"]["files"]
    export_lora(str(ckpt), str(tmp_path / "ok"), base_dir=str(moved))
    with pytest.raises(SystemExit, match=f"their base model '{tmp_path / 'gone'}' .* pass --base DIR"):
        export_main([str(ckpt), str(tmp_path / "not"), "--base", str(tmp_path / "gone")])  # one line, no traceback
    assert not (tmp_path / "not").exists() and not (tmp_path / "not.tmp").exists()
    with pytest.raises(ConfigError, match=f"trained on {STORIES}, but the base here is {other}"):
        export_lora(str(ckpt), str(tmp_path / "no"), base_dir=str(other))
    cfg = load_config(overrides=[f"model.partial_pretrain={other}", "data.train_files=x.parquet", "model.lora_rank=8"])
    current = TrainState(data=saved["data"], schedule=saved["schedule"],
                         base=lora.base_identity(str(other), str(other)))
    with pytest.raises(ConfigError, match=f"resuming from {ckpt}: the LoRA adapters were trained on {STORIES}"):
        resume.check_resume(str(ckpt), cfg, current)


def test_steps_train_in_training_mode_and_validation_leaves_it_so(data, tmp_path):
    """The training mode is set once before the first step and again after each validation (which runs in eval
    mode), not at every step. LoRA's dropout shows the mode: with it the losses
    from step 2 on (lora_B is zero before the first update) are not those without it, and a validation after
    every step leaves them as they were (it neither trains without dropout afterwards nor draws dropout's
    random numbers itself). One rank, the same computation in the same order: equal to float32 rounding."""
    def losses(name: str, *extra: str) -> list[float]:
        run_sfttrain(1, lora_job(data, tmp_path / name, *extra))
        return [m["loss"] for m in read_metrics(tmp_path / name) if "loss" in m]

    dropout = losses("dropout", "model.lora_dropout=0.5")
    validated = losses("validated", "model.lora_dropout=0.5", f"data.val_files={data}", "trainer.test_freq=1")
    plain = losses("plain")
    assert validated == pytest.approx(dropout, rel=REL_TOL), (validated, dropout)
    assert dropout[0] == pytest.approx(plain[0], rel=REL_TOL) and dropout[1:] != pytest.approx(plain[1:], rel=1e-3), \
        (dropout, plain)
