"""Weights that scale: the model is built on the meta device, sharded while empty, and each rank
then materialises only its own shards: read from the weight files (no full copy, no broadcast), or
drawn per module from a seed of its name, so any number of ranks builds the same model. Buffers
(rotary `inv_freq`) are computed at construction and kept across `to_empty`."""

from __future__ import annotations

import contextlib
import glob
import os
import zlib
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_parameter_registration_hook

from sfttrain import moe, quant
from sfttrain.lora import base_name, init_adapter, is_adapter_weight


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device; buffers are computed for real.
    (accelerate's init_empty_weights re-wraps a meta parameter at each registration: it unties weights.)"""
    def on_meta(_module: nn.Module, _name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is not None and not param.is_meta:
            return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    handle = register_module_parameter_registration_hook(on_meta)
    try:
        yield
    finally:
        handle.remove()


def materialise(model: nn.Module, device: torch.device, buffer_device: torch.device, seed: int,
                path: str | None) -> None:
    """Allocates the (possibly sharded) meta parameters on `device` and fills each rank's part from
    the weight files in `path`, or (None) by a random init independent of the number of ranks.
    Buffers go to `buffer_device` (the compute device, also when parameters are offloaded)."""
    buffers = [(module, name, buf) for module in model.modules() for name, buf in module._buffers.items()
               if buf is not None]
    tied = _shared_parameters(model)
    model.to_empty(device=device)
    for module, name, buf in buffers:
        module._buffers[name] = buf.to(buffer_device)
    for (first, first_name), *others in tied:  # to_empty gave each owner a parameter of its own
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    modules = list(model.named_modules())
    base = [(n, m) for n, m in modules if not is_adapter_weight(n)]
    with torch.no_grad():
        if path is None:
            _random_init(base, seed, buffer_device, lambda _name, module: model._init_weights(module))
        else:
            _read_checkpoint(model, path)
        # LoRA adapters are in no model folder
        _random_init([(n, m) for n, m in modules if is_adapter_weight(n)], seed, buffer_device, init_adapter)


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def _local_index(param: torch.Tensor) -> tuple[slice, ...]:
    """Where this rank's part of `param` lies in the full tensor (all of it when not sharded)."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    chunk = param.__create_chunk_list__()[0]  # DCP's protocol: this rank's offset and size
    return tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))


def _local(param: torch.Tensor) -> torch.Tensor:
    """The tensor a rank holds itself: to_local returns a parameter's as a new view (torch >= 2.13), on which
    the NF4 shard's scales (fill_shard) would not reach FSDP's."""
    return param._local_tensor if isinstance(param, DTensor) else param


def _read_checkpoint(model: nn.Module, path: str) -> None:
    files = _tensor_files(path)
    for name, param in model.named_parameters():  # a tied weight once
        if is_adapter_weight(name):
            continue
        module, name = model.get_submodule(name.rpartition(".")[0]), base_name(name)
        if name not in files:
            per_expert = moe.read_per_expert(files, name, _local_index(param), _read_slice)
            if per_expert is not None:
                _local(param).copy_(per_expert)
                continue
            raise ValueError(f"{path}: no tensor {name!r} in its weight files (sfttrain reads the model's own "
                             "parameter names; checkpoints with renamed keys need converting first)")
        if quant.is_quantized(_local(param)):  # quantized whole (its blocks' scales are the whole weight's)
            quant.fill_shard(_local(param), _read_slice(files[name], name, ()), _local_index(param)[0], module)
        else:
            _local(param).copy_(_read_slice(files[name], name, _local_index(param)))


def _tensor_files(path: str) -> dict[str, str]:
    names: dict[str, str] = {}
    safetensors = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    for file in safetensors or sorted(glob.glob(os.path.join(path, "*.bin"))):
        if file.endswith(".safetensors"):
            with safe_open(file, framework="pt") as f:
                names.update(dict.fromkeys(f.keys(), file))
        else:
            names.update(dict.fromkeys(torch.load(file, mmap=True, weights_only=True), file))
    return names


def _read_slice(file: str, name: str, index: tuple[slice, ...]) -> torch.Tensor:
    """Only the bytes of `index` are read; the file is opened per tensor, as a map kept open would
    keep every page it touched in this process's memory."""
    if file.endswith(".safetensors"):
        with safe_open(file, framework="pt") as f:
            return f.get_slice(name)[index] if index else f.get_tensor(name)
    return torch.load(file, mmap=True, weights_only=True)[name][index].clone()


def _random_init(modules: list[tuple[str, nn.Module]], seed: int, device: torch.device,
                 init: Callable[[str, nn.Module], None]) -> None:
    """Each module's parameters by `init`, on full-size temporaries on `device` seeded from (seed,
    module name), of which each rank keeps its slice: one module's full tensors at a time."""
    done: set[int] = set()
    for module_name, module in modules:
        owned = {n: p for n, p in module._parameters.items() if p is not None and id(p) not in done}
        if not owned:
            continue
        done.update(id(p) for p in owned.values())
        full = {n: nn.Parameter(torch.empty(p.shape, dtype=quant.full_dtype(p), device=device), p.requires_grad)
                for n, p in owned.items()}
        torch.manual_seed(zlib.crc32(f"{seed}:{module_name}".encode()))
        module._parameters.update(full)
        try:
            init(module_name, module)
        finally:
            module._parameters.update(owned)
        for n, p in owned.items():
            if quant.is_quantized(_local(p)):
                quant.fill_shard(_local(p), full[n], _local_index(p)[0], module)
            else:
                _local(p).copy_(full[n][_local_index(p)])
