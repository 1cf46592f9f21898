"""model.cuda_graphs (sfttrain/cuda_graphs.py): refused where it cannot hold, and on a GPU the same
training as without it."""

import types

import pytest
import torch

from sfttrain.config import Config, ConfigError, load_config
from sfttrain.parallel import check_settings
from tests.conftest import BASE_OVERRIDES, LINEAR_ADAM, read_metrics, run_sfttrain

COMMON = ["data.train_files=x.parquet", "model.partial_pretrain=m", "model.cuda_graphs=true"]


@pytest.mark.parametrize("overrides, message", [
    (["model.compile=false"], "model.cuda_graphs=true .*set model.compile=true"),
    (["model.compile=true", "model.compile_cpp_wrapper=true"], "captures none from the C\\+\\+ one"),
    # 16384 tokens in rows padded to 128: 128 lengths, each recording its graphs
    (["model.compile=true", "data.max_token_len_per_gpu=16384"],
     "16384 tokens padded to data.pad_to_multiple=128 have 128 lengths, over 32.*set data.pad_to_multiple to 512"),
])
def test_settings_that_would_record_without_end_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[*COMMON, *overrides])


def test_it_needs_one_unsharded_gpu_known_before_the_data_is_read():
    """Checked at the trainer's start from the world alone: a CPU device, or several ranks."""
    cfg = load_config(overrides=[*COMMON, "model.compile=true", "data.max_token_len_per_gpu=16384",
                                 "data.pad_to_multiple=512"])
    mesh = {"dp_shard": types.SimpleNamespace(size=lambda: 1)}
    one_gpu = types.SimpleNamespace(device=torch.device("cuda"), world_size=1, mesh=mesh, sp_size=1)
    check_settings(cfg, one_gpu)
    with pytest.raises(ConfigError, match="needs a CUDA device, not 'cpu'"):
        check_settings(cfg, types.SimpleNamespace(device=torch.device("cpu"), world_size=1))
    cfg.model.fsdp_config.cpu_offload = True
    with pytest.raises(ConfigError, match="one unsharded GPU; this run's layout is 'sharded'"):
        check_settings(cfg, one_gpu)
    check_settings(Config(), types.SimpleNamespace(device=torch.device("cpu"), world_size=1))  # off: nothing to check


def test_the_preflight_sees_a_world_the_graphs_cannot_run_on():
    """`python -m sfttrain.plan ... --nproc 2`: the problem the start-up would stop on, listed."""
    from sfttrain.plan import preflight

    cfg = load_config(overrides=[*COMMON, "model.compile=true", "data.max_token_len_per_gpu=16384",
                                 "data.pad_to_multiple=512", "trainer.device=cuda"])
    assert not [p for p in preflight(cfg, 1, 1)[1].problems if "cuda_graphs" in p]
    problems = [p for p in preflight(cfg, 2, 1)[1].problems if "cuda_graphs" in p]
    assert len(problems) == 1 and "layout is 'sharded or replicated'" in problems[0], problems


def test_graphs_take_the_python_wrapper():
    """Replays launch nothing from a wrapper: auto takes the Python one (the C++ one would cost
    its build for nothing, and inductor captures no graph from it with graph partitions)."""
    from transformers import Qwen2Config

    from sfttrain.parallel import cpp_wrapper, describe_compile

    cfg = load_config(overrides=[*COMMON, "model.compile=true", "data.max_token_len_per_gpu=16384",
                                 "data.pad_to_multiple=512"])
    cuda = types.SimpleNamespace(device=torch.device("cuda"))
    assert cpp_wrapper(cfg, cuda, Qwen2Config()) is False
    line = describe_compile(cfg, cuda, Qwen2Config())
    assert "Python wrapper (CUDA graphs replay the kernels); CUDA graphs replayed" in line
    assert "up to 32 padded row lengths (data.pad_to_multiple=512)" in line, line


def test_apply_makes_gradient_buffers_and_a_generation_per_forward(monkeypatch):
    """What the graphs need around the layers, on stories260K with LoRA (frozen base): a zeroed
    gradient buffer for each trainable parameter and none for a frozen one, a new CUDA-graph
    generation at each forward of the loss module, and gradients summed into those same buffers."""
    from torch._inductor.cudagraph_trees import MarkStepBox

    from sfttrain import cuda_graphs
    from sfttrain.config import ModelConfig
    from sfttrain.data.pack import pack
    from sfttrain.data.render import RenderedSample
    from sfttrain.loss import CausalLMLoss
    from sfttrain.model import load_model, materialise_model
    from tests.conftest import STORIES

    cfg, cpu = ModelConfig(partial_pretrain=str(STORIES), lora_rank=4, target_modules="all-linear"), torch.device("cpu")
    model = load_model(cfg, cpu).model
    materialise_model(model, cfg, cpu, cpu, seed=0)
    lm = CausalLMLoss(model, fused=False)
    lm.autocast_dtype = torch.bfloat16  # as sfttrain.parallel.single_device sets it: a bf16 base, fp32 adapters
    monkeypatch.setattr(torch._inductor.config.triton, "cudagraph_or_error", False)  # restored after the test
    cuda_graphs.apply(lm)
    assert torch._inductor.config.triton.cudagraph_or_error
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None and not p.grad.any() for p in trainable)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    buffers = [p.grad for p in trainable]
    before = MarkStepBox.mark_step_counter
    batch = pack([RenderedSample(list(range(1, 40)), [0] * 10 + [1] * 29, 0)])
    lm(batch).backward()
    lm(batch).backward()
    assert MarkStepBox.mark_step_counter == before - 2
    assert all(p.grad is buffer for p, buffer in zip(trainable, buffers)) and any(b.any() for b in buffers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_graphs_train_what_the_launched_kernels_train(gsm8k_dir, tmp_path):
    """stories260K on one GPU, compiled, bf16 compute, 4 steps of 8 samples in micro-batches of 2
    (gradients summed over 4 replays a step, rows of several padded lengths, so graphs are recorded,
    replayed and recorded again): the losses and the final weights of a run with CUDA graphs against
    one launching the same compiled kernels. Adam made linear in the gradient (LINEAR_ADAM), so that
    rounding differences stay rounding-sized; the bound, 1e-2 relative, is bf16's rounding (~4e-3)
    with room, and a gradient overwritten by a later replay would miss a quarter of a step's sum."""
    from safetensors.torch import load_file

    def run(name: str, *extra: str):
        run_dir = tmp_path / name
        run_sfttrain(1, [*BASE_OVERRIDES, *LINEAR_ADAM, f"data.train_files={gsm8k_dir}/train.parquet",
                         f"trainer.default_local_dir={run_dir}", "trainer.device=cuda", "model.compile=true",
                         "model.fsdp_config.mixed_precision=true", "data.max_length=128", "data.train_batch_size=8",
                         "data.micro_batch_size_per_gpu=2", "data.pad_to_multiple=64", "trainer.total_training_steps=4",
                         # the Python wrapper in both: the graphs take it, so both runs have the same kernels
                         "model.compile_cpp_wrapper=false", "trainer.save_hf=true", *extra],
                     env={"CUDA_VISIBLE_DEVICES": "0"})
        losses = [m["loss"] for m in read_metrics(run_dir) if "loss" in m]
        weights = load_file(str(next((run_dir / "global_step_4" / "huggingface").glob("*.safetensors"))))
        return losses, weights

    launched_losses, launched = run("launched")
    graphed_losses, graphed = run("graphed", "model.cuda_graphs=true")
    assert len(graphed_losses) == 4
    torch.testing.assert_close(torch.tensor(graphed_losses), torch.tensor(launched_losses), rtol=1e-2, atol=0)
    for name, weight in launched.items():
        diff = (graphed[name].float() - weight.float()).norm() / weight.float().norm()
        assert diff <= 1e-2, (name, diff.item())
