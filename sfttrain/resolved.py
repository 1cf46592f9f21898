"""Every setting that may be `auto`, as this run resolved it: made once at start-up, when the machine and
the model are known, read from there on, and printed in one start-up line."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from sfttrain import fp8, recompute
from sfttrain.checkpoint_writer import writer_kind
from sfttrain.config.schema import Config, value_of
from sfttrain.model import LoadedModel, decoder_layers
from sfttrain.parallel import cpp_wrapper


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
