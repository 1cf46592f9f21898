"""model.fp8 (sfttrain/fp8.py): the refusals, which layers convert, and that a converted model's
weights, optimizer state, checkpoint and export are those of the unconverted one. FP8 GEMMs
themselves need a GPU with compute capability >= 8.9; on CPU torchao's emulation (FP8 rounding,
GEMMs in high precision) checks the arithmetic that conversion puts in place."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sfttrain import fp8
from sfttrain.config import ConfigError, ModelConfig, load_config
from sfttrain.errors import DependencyError
from tests.conftest import STORIES, run_sfttrain, train_losses

CUDA = torch.cuda.is_available()
FP8_GPU = CUDA and torch.cuda.get_device_capability() >= fp8.FP8_CAPABILITY
BASE = [f"model.partial_pretrain={STORIES}", "data.train_files=x.parquet"]


def llama(hidden=64, intermediate=128, layers=2, **changes):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=intermediate,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        **changes))


def test_config_values_and_lora_are_refused():
    for value in ("off", "auto", "tensorwise", "rowwise"):
        assert load_config(None, [*BASE, f"model.fp8={value}"]).model.fp8 == value
    with pytest.raises(ConfigError, match=r"model.fp8='fp8' is not one of \['off', 'auto', 'tensorwise', 'rowwise'\]"):
        load_config(None, [*BASE, "model.fp8=fp8"])
    with pytest.raises(ConfigError, match="model.fp8=auto with model.lora_rank=8: .*set model.fp8=off for LoRA"):
        load_config(None, [*BASE, "model.fp8=auto", "model.lora_rank=8"])
    # the weight gradient's GEMM runs over a rank's tokens, which must divide by 16
    with pytest.raises(ConfigError, match=r"model.fp8=tensorwise needs data.pad_to_multiple=8 to be a multiple of 16 "):
        load_config(None, [*BASE, "model.fp8=tensorwise", "data.pad_to_multiple=8"])
    with pytest.raises(ConfigError,
                       match=r"multiple of 64 \(16 tokens per rank x 4 Ulysses ranks.*pad_to_multiple=128"):
        load_config(None, [*BASE, "model.fp8=tensorwise", "data.pad_to_multiple=32",
                           "ulysses_sequence_parallel_size=4"])


def test_help_documents_the_key():
    from sfttrain.help import format_help

    text = " ".join(format_help("model").split())  # wrapped to the terminal's width
    assert "model.fp8='off'" in text and "tensorwise" in text and "pip install -e '.[fp8]'" in text


def test_cpu_and_pre_hopper_gpus_are_refused(monkeypatch):
    off = ModelConfig(fp8="off")
    fp8.check_available(off, torch.device("cpu"))  # off: nothing to check
    for mode in ("auto", "tensorwise"):
        with pytest.raises(ConfigError, match=f"model.fp8={mode} needs a CUDA GPU with FP8 tensor cores .* this run "
                                              "is on cpu: set model.fp8=off"):
            fp8.check_available(ModelConfig(fp8=mode), torch.device("cpu"))
    # an A100 (8.0): the device's answers stand in for a GPU this machine does not have
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"model.fp8=rowwise: NVIDIA A100-SXM4-80GB \(compute capability 8.0\) has "
                                          "no FP8 tensor cores"):
        fp8.check_available(ModelConfig(fp8="rowwise"), torch.device("cuda", 0))


def test_missing_torchao_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what an environment without torchao imports
    with pytest.raises(DependencyError, match=r"pip install -e '\.\[fp8\]'"):
        fp8.float8_api()


def test_a_cpu_run_stops_at_start_up_with_one_message(tmp_path):
    """The run's own exit: code 2 and the message naming the key, listed with the other start-up problem
    (the train file does not exist), before the data is read."""
    proc = run_sfttrain(1, [f"model.partial_pretrain={STORIES}", f"data.train_files={tmp_path}/none.parquet",
                            f"trainer.default_local_dir={tmp_path}/run", "data.max_length=512", "model.fp8=tensorwise"],
                        check=False)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert proc.stdout.count("model.fp8=tensorwise needs a CUDA GPU with FP8 tensor cores") == 1, proc.stdout[-3000:]
    assert "none.parquet' does not exist (check data.train_files" in proc.stdout, proc.stdout[-3000:]


def test_auto_turns_fp8_on_for_wide_layers_only():
    auto = ModelConfig(fp8="auto")
    assert fp8.choose(auto, 896) == "off"  # W1: Qwen2.5-0.5B
    assert "(model.fp8=auto: hidden_size 64 < 4096: " in fp8.describe(llama(), auto, "off")[0]
    assert fp8.choose(auto, 4096) == "tensorwise"  # W2b: Llama-3-8B's shape
    assert fp8.choose(ModelConfig(fp8="rowwise"), 896) == "rowwise"  # asked for: done
    assert fp8.choose(ModelConfig(fp8="off"), 8192) == "off"


@pytest.mark.parametrize("fast_grads", [True, False])
def test_fast_accumulation_reaches_the_gradient_gemms_unless_turned_off(fast_grads):
    """model.fp8_fast_accum_grads: the gradient GEMMs' accumulation is the forward's fast mode, or
    torchao's recipe as it is; the start-up line says which."""
    model, cfg = llama(), ModelConfig(fp8="tensorwise", fp8_fast_accum_grads=fast_grads)
    fp8.apply(model, cfg, "tensorwise", fsdp_all_gather=False)
    configs = [m.config for m in fp8.converted_layers(model)]
    assert len(configs) == 2 * 7  # every linear layer of the two decoder layers
    for config in configs:
        assert config.gemm_config_output.use_fast_accum  # torchao's recipe
        assert config.gemm_config_grad_input.use_fast_accum == fast_grads
        assert config.gemm_config_grad_weight.use_fast_accum == fast_grads
    expected = "every GEMM" if fast_grads else "the forward GEMM only (model.fp8_fast_accum_grads=false)"
    assert f"; fast accumulation in {expected};" in fp8.describe(model, cfg, "tensorwise")[0]


def test_which_layers_convert():
    """The decoder layers' linear layers whose dimensions divide by 16; never lm_head; a MoE's
    experts and router are no linear layers."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    def converted(model) -> list[str]:
        fp8.apply(model, ModelConfig(), "tensorwise", fsdp_all_gather=False, emulate=True)
        return sorted(name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear")

    model = llama(intermediate=100)  # the MLP's 100 does not divide by 16
    assert converted(model) == sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkvo")
    assert "; bf16: lm_head, 6 linear layers with a dimension not a multiple of 16;" in fp8.describe(
        model, ModelConfig(fp8="tensorwise"), "tensorwise")[0]
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                                             num_key_value_heads=2, num_experts=4, num_experts_per_tok=2))
    assert converted(moe) == sorted(f"model.layers.0.self_attn.{p}_proj" for p in "qkvo")


def state_dict_keys(model: nn.Module, optimizer) -> tuple[list, list]:
    from sfttrain.checkpoint_load import state_dicts

    model_sd, optim_sd = state_dicts(model, optimizer)
    return ([(k, tuple(v.shape), v.dtype) for k, v in model_sd.items()],
            sorted((k, tuple(v.shape) if torch.is_tensor(v) else v) for k, v in _flat(optim_sd)))


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        return [item for k, v in tree.items() for item in _flat(v, f"{prefix}{k}.")]
    if isinstance(tree, list):
        return [item for i, v in enumerate(tree) for item in _flat(v, f"{prefix}{i}.")]
    return [(prefix, tree)]


def test_emulated_fp8_trains_close_to_fp32_with_the_same_state():
    """Conversion swaps the GEMMs only: the same parameters (objects, names), a loss and gradients
    within FP8's rounding of the fp32 ones, and the same optimizer state keys after a step."""
    reference, model = llama(), llama()
    params = dict(model.named_parameters())
    fp8.apply(model, ModelConfig(), "tensorwise", fsdp_all_gather=False, emulate=True)
    assert len(fp8.converted_layers(model)) == 2 * 7
    assert dict(model.named_parameters()) == params  # the very tensors
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for m in (reference, model):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    # e4m3 keeps 3 mantissa bits (relative rounding up to 1/16 per element, averaging out over a
    # GEMM's sum): the loss within 1%, the gradient's direction within a few degrees; not equal,
    # or no FP8 rounding took place
    assert losses[0] != losses[1] and abs(losses[1] - losses[0]) < 0.01 * losses[0], losses
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.99
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (reference, model)]
    for opt in optimizers:
        opt.step()
    assert state_dict_keys(reference, optimizers[0]) == state_dict_keys(model, optimizers[1])


def test_sharded_fp8_checkpoint_and_export_are_unchanged(tmp_path):
    """As the run builds it: the meta model converted with FP8 all-gather, sharded by FSDP2 (one
    rank), materialised from the model folder; its checkpoint (model and optimizer) holds the same
    keys, shapes, dtypes and values as the plain model's, and `sfttrain.export` writes the same
    files byte for byte."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sfttrain import export
    from sfttrain.checkpoint_load import state_dicts
    from sfttrain.model import decoder_layers, load_model, materialise_model

    cfg = ModelConfig(partial_pretrain=str(STORIES), fp8="tensorwise", compile=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        saved = {}
        for name, mode in (("plain", "off"), ("fp8", "tensorwise")):
            model = load_model(dataclasses.replace(cfg, fp8=mode), torch.device("cpu")).model
            fp8.apply(model, dataclasses.replace(cfg, fp8=mode), mode, fsdp_all_gather=True)
            for layer in decoder_layers(model):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            materialise_model(model, cfg, torch.device("cpu"), torch.device("cpu"), seed=0)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            optimizer.step()
            if mode != "off":  # what the trainer's hook does after each step
                assert fp8.describe(model, cfg, mode) == [
                    "  fp8                 : tensorwise scaling (model.fp8=tensorwise), 20 linear layers "
                    "(self_attn.k_proj, self_attn.o_proj, self_attn.q_proj, self_attn.v_proj); weights all-gathered "
                    "in FP8; fast accumulation in every GEMM; bf16: lm_head, 15 linear layers with a dimension not "
                    "a multiple of 16; WARNING: hidden_size 64 < 4096: GEMMs this small usually run slower in FP8 "
                    "(model.fp8=auto keeps it off)"]
                fp8.scale_precompute_hook(model)(optimizer, (), {})
            saved[name] = state_dict_keys(model, optimizer)
            model_sd, optim_sd = state_dicts(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / name))
            model.config.save_pretrained(tmp_path / name / "hf")
        assert saved["plain"] == saved["fp8"]
        assert len(fp8.converted_layers(model)) == 5 * 4  # the MLP's 172 does not divide by 16
    finally:
        dist.destroy_process_group()
    files = {}
    for name in ("plain", "fp8"):
        export.export(str(tmp_path / name), str(tmp_path / f"{name}_hf"))
        files[name] = {f.name: f.read_bytes() for f in (tmp_path / f"{name}_hf").iterdir()}
    assert files["plain"] == files["fp8"] and "model.safetensors" in files["fp8"]


@pytest.mark.skipif(not FP8_GPU, reason="a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")
def test_fp8_run_on_a_gpu_trains_and_resumes_without_it(tmp_path, gsm8k_dir):
    """One GPU, layers compiled: 4 steps with FP8 GEMMs, close to the same 4 steps in bf16, then
    the FP8 run's checkpoint resumed with FP8 off."""
    common = [f"model.partial_pretrain={STORIES}", f"data.train_files={gsm8k_dir}/train.parquet",
              "data.apply_chat_template=false", "data.truncation=right", "data.train_batch_size=16",
              "data.max_length=512", "data.max_token_len_per_gpu=4096",
              "model.compile=true", "trainer.device=cuda", "trainer.total_training_steps=4"]
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    first = run_sfttrain(1, [*common, f"trainer.default_local_dir={tmp_path}/fp8", "model.fp8=tensorwise"], env=env)
    assert "fp8                 : tensorwise scaling" in first.stdout
    run_sfttrain(1, [*common, f"trainer.default_local_dir={tmp_path}/bf16"], env=env)
    fp8_losses, bf16_losses = train_losses(tmp_path / "fp8"), train_losses(tmp_path / "bf16")
    # e4m3 rounding of the GEMM operands (3 mantissa bits) moves a loss by well under 5%
    assert fp8_losses != bf16_losses and fp8_losses == pytest.approx(bf16_losses, rel=0.05)
    second = run_sfttrain(1, [*common[:-1], f"trainer.default_local_dir={tmp_path}/fp8", "model.fp8=off",
                              "trainer.total_training_steps=6"], env=env)
    assert "global_step_4" in second.stdout and len(train_losses(tmp_path / "fp8")) == 6


def test_preflight_lists_the_fp8_problems(tmp_path, monkeypatch):
    """sfttrain.plan: a CPU run with FP8 and a missing torchao are problems, as at start-up; the
    GPUs' FP8 support is a note (not checkable on the machine that plans)."""
    from tests.test_plan import run_plan

    common = [f"data.train_files={tmp_path}/absent.parquet", f"model.partial_pretrain={STORIES}",
              "data.train_batch_size=8", "data.max_length=512", "model.fp8=tensorwise", "--nproc", "2"]
    code, out = run_plan(*common, "trainer.device=cpu")
    assert code == 2 and "model.fp8=tensorwise needs a CUDA GPU" in out.split("problems:")[1], out
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    code, out = run_plan(*common)
    assert code == 2 and "pip install -e '.[fp8]'" in out.split("problems:")[1], out
    # planned on a host without a GPU, the GPUs' FP8 support is a note; with one, it is checked there
    note = "whether the GPUs have FP8 tensor cores (compute capability >= 8.9: H100/H200, L40S) is checked at start-up"
    assert (note in out) != torch.cuda.is_available(), out


def _tiny_fp8_llama(fsdp_all_gather: bool):
    model = llama()
    fp8.apply(model, ModelConfig(), "tensorwise", fsdp_all_gather=fsdp_all_gather, emulate=True)
    return model


def _fsdp_fp8_step(rank, world, init_file, ids, result):
    from torch.distributed.fsdp import fully_shard

    from sfttrain.model import decoder_layers

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = _tiny_fp8_llama(fsdp_all_gather=True)
        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        weight = model.model.layers[0].self_attn.q_proj.weight
        assert type(weight.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor"  # gathered in FP8
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        optimizer.register_step_post_hook(fp8.scale_precompute_hook(model))
        losses = []
        for _ in range(2):  # the second forward gathers with the scales the hook precomputed
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        result[rank] = losses
    finally:
        dist.destroy_process_group()


def test_fp8_all_gather_under_fsdp_matches_the_unsharded_fp8_model(tmp_path):
    """FSDP2 over 2 ranks with FP8 all-gather (each rank casts its shard with the scale of the whole
    weight, then gathers FP8) computes what the unsharded FP8 model computes: the same FP8 values
    enter the same GEMMs, so the losses of two steps agree to fp32 rounding (emulated GEMMs, CPU)."""
    import torch.multiprocessing as mp

    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(2))
    result = mp.Manager().dict()
    mp.spawn(_fsdp_fp8_step, args=(2, str(tmp_path / "pg"), ids, result), nprocs=2)
    reference = _tiny_fp8_llama(fsdp_all_gather=False)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = []
    for _ in range(2):
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    assert result[0] == result[1]
    assert result[0] == pytest.approx(expected, rel=1e-5), (result[0], expected)
