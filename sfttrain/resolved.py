"""Every setting that may be `auto`, as this run resolved it: made once at start-up, when the machine and
the model are known, read from there on, and printed in one start-up line."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch.torch_version import TorchVersion

from sfttrain import fp8, recompute
from sfttrain.checkpoint_writer import writer_kind
from sfttrain.config import ConfigError
from sfttrain.config.schema import Config, value_of
from sfttrain.model import LoadedModel, decoder_layers
from sfttrain.moe import routing


def _of(key: str):
    return field(metadata={"key": key})


@dataclass(frozen=True)
class Resolved:
    device: str = _of("trainer.device")
    attention: str = _of("model.attn_implementation")
    liger: bool = _of("model.use_liger")
    loss_kernel: str = _of("model.loss_kernel")
    recompute_attention: bool = _of("model.recompute_attention")
    compile_cpp_wrapper: bool = _of("model.compile_cpp_wrapper")
    fuse_projections: bool = _of("model.fuse_projections")
    fold_lora: bool = _of("model.fold_lora")
    fp8: str = _of("model.fp8")
    async_save_writer: str = _of("trainer.async_save_writer")

    def describe(self, cfg: Config) -> str:
        """The one start-up line of what was chosen, `auto` marked where the config said it."""
        chosen = []
        for f in fields(self):
            value = getattr(self, f.name)
            given = value_of(cfg, f.metadata["key"])
            text = str(value).lower() if isinstance(value, bool) else value
            chosen.append(f"{f.metadata['key']}={text}" + (" (auto)" if given == "auto" else ""))
        return "  chosen              : " + ", ".join(chosen)


def resolve(cfg: Config, device: torch.device, loaded: LoadedModel, loss_kernel: str) -> Resolved:
    """The run's choices on `device` for the loaded model and the loss kernel sfttrain.loss chose."""
    m, model = cfg.model, loaded.model
    fused = m.compile and m.fuses_projections()
    return Resolved(
        device=device.type, attention=loaded.attn_backend, liger=loaded.liger, loss_kernel=loss_kernel,
        recompute_attention=m.enable_gradient_checkpointing and not recompute.attention_kept(
            m, decoder_layers(model), cfg.data.max_length),
        compile_cpp_wrapper=m.compile and cpp_wrapper(cfg, device.type, model.config),
        fuse_projections=fused, fold_lora=fused and m.lora_rank > 0 and m.folds_lora(),
        fp8=fp8.choose(m, fp8.hidden_size(model)),
        async_save_writer=writer_kind(cfg.trainer.async_save_writer, device))


# the longest micro-batch `auto` gives the C++ wrapper: the longest it was measured to run at
CPP_WRAPPER_MAX_TOKENS = 65536


def cpp_wrapper(cfg: Config, device_type: str, model_config) -> bool:
    """Whether inductor's C++ wrapper launches the compiled layers' kernels (model.compile_cpp_wrapper):
    on GPUs only, where the host can fall behind the kernels. An explicit true that cannot be built is refused."""
    if device_type != "cuda":
        return False
    setting = cfg.model.compile_cpp_wrapper
    cannot = setting and why_python_wrapper(cfg, model_config, auto=setting == "auto")
    if cannot and setting is True:
        raise ConfigError(f"model.compile_cpp_wrapper=true: {cannot}; set model.compile_cpp_wrapper=auto (the Python "
                          "wrapper here)" + (" or model.recompute_attention=false (attention outputs kept: more memory)"
                                            if cannot == RERUNS_ATTENTION else ""))
    return bool(setting) and not cannot


RERUNS_ATTENTION = ("the checkpointed layers rerun attention compiled, whose RNG-state call inductor's C++ wrapper "
                    "cannot emit (sfttrain/recompute.py)")


def why_python_wrapper(cfg: Config, model_config, auto: bool = True) -> str | None:
    """Why a CUDA run's compiled layers stay on the Python wrapper (None: they need not); auto: also
    model.compile_cpp_wrapper=auto's reasons, not only what the C++ wrapper cannot build."""
    if auto and cfg.model.fp8 != "off":
        return "FP8 runs were measured on it"
    if auto and cfg.micro_batch_tokens() > CPP_WRAPPER_MAX_TOKENS:
        return f"micro-batches over {CPP_WRAPPER_MAX_TOKENS} tokens: model.compile_cpp_wrapper=auto"
    if routing(model_config) is not None and TorchVersion(torch.__version__) < "2.12":
        return (f"inductor's C++ wrapper in torch {torch.__version__} has no call for the grouped GEMM of the "
                "experts (torch >= 2.12 has one)")
    # LoRA on a MoE may adapt the experts, which then run outside the compiled graph (sfttrain.lora) and
    # make the checkpointed layers recompute whole
    m, eager = cfg.model, cfg.model.lora_rank > 0 and routing(model_config) is not None
    kept = recompute.wants_attention_kept(m, cfg.data.max_length) and not eager
    return RERUNS_ATTENTION if m.compile and m.enable_gradient_checkpointing and not kept else None
