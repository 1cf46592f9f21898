"""model.cuda_graphs: the compiled decoder layers replay CUDA graphs (inductor's CUDA graph trees)
instead of launching their kernels one at a time from the host.

Why: on one GPU a small model's step is bound by the host. W1's profile (docs/benchmarks.md, run BF)
has the GPU idle 8.2 ms of a 98 ms step, most gaps inside the compiled layers' calls; LoRA's step,
with 2.6x the GEMM launches, is slower than full fine-tuning's although it does less work. A replay
is one launch per layer and pass, whatever the kernel count.

What it takes:
- Every distinct packed length (and sample count) records its own graphs: the first calls at a new
  shape run once to warm up, then capture. Rows are padded to `data.pad_to_multiple`, so a
  micro-batch's token budget allows at most `CUDA_GRAPH_LENGTHS` lengths (sfttrain.config checks).
- A replay overwrites the outputs of the graph's previous one. A new generation is marked before
  each micro-batch's forward, and the gradients are summed into buffers made once, outside every
  graph, and zeroed in place between steps (`keeps_gradients`); a gradient left as a graph's output
  would be overwritten by the next micro-batch's backward.
- A layer whose graph cannot be captured stops the run with inductor's reason (`cudagraph_or_error`)
  instead of running without graphs unseen.
- One GPU, unsharded: FSDP's and DDP's hooks and collectives run between and inside the layers.
"""

from __future__ import annotations

import torch

from sfttrain.config import Config, ConfigError

# inductor's options for a compiled layer: CUDA graph trees, and an error where one cannot be captured
COMPILE_OPTIONS = {"triton.cudagraphs": True, "triton.cudagraph_or_error": True}


def check_layout(cfg: Config, device: torch.device, layout: str) -> None:
    """model.cuda_graphs needs a CUDA device and the one-device layout (sfttrain.parallel)."""
    if not cfg.model.cuda_graphs:
        return
    if device.type != "cuda":
        raise ConfigError(f"model.cuda_graphs=true replays CUDA graphs: it needs a CUDA device, not {device.type!r}; "
                          "set model.cuda_graphs=false")
    if layout != "single":
        raise ConfigError(f"model.cuda_graphs=true runs on one unsharded GPU; this run's layout is {layout!r} "
                          "(several ranks or CPU offload); set model.cuda_graphs=false")


def apply(lm: torch.nn.Module) -> None:
    """What the graphs need around the (already compiled) layers: a new generation before each
    forward of the loss module `lm`, and gradient buffers of its trainable parameters made outside any graph."""
    torch._inductor.config.triton.cudagraph_or_error = True  # also where a skip is decided at run time
    lm.register_forward_pre_hook(lambda _module, _args: torch.compiler.cudagraph_mark_step_begin())
    for p in lm.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def keeps_gradients(cfg: Config) -> bool:
    """Whether the gradient buffers stay between steps (zeroed in place, not freed): they must with
    CUDA graphs, see the module's docstring."""
    return cfg.model.cuda_graphs


def describe(cfg: Config) -> str:
    """The compile line's ending."""
    if not cfg.model.cuda_graphs:
        return ""
    return (f"; CUDA graphs replayed (model.cuda_graphs), recorded for each of up to {cfg.padded_row_lengths()} padded row lengths "
            f"(data.pad_to_multiple={cfg.data.pad_to_multiple})")
