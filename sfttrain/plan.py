"""Preflight: what a run will do and need, before any GPU is asked for.

    python -m sfttrain.plan [recipe.yaml] [key=value ...] --nproc N [--nnodes M] [--elsewhere]

Prints the batch arithmetic, the data report, memory per rank from the model's config alone, and every
problem the run's own start-up checks would stop on. Exits 0 when nothing is wrong, else 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from sfttrain import quant
from sfttrain.checkpoint import TrainState, check_same_model, estimated_bytes, trained_state_dict
from sfttrain.checkpoint_folder import (choose_resume, describe_retention, nearest_existing, room_problem, size_text,
                                        step_of)
from sfttrain.checks import Findings, Startup, config_first, on_devices, read_rows, run_checks
from sfttrain.config import (Config, ConfigError, as_list, load_config, logger_names,
                             mixed_precision_dtypes, moot_settings, shard_group_size)
from sfttrain.data.batching import make_plan
from sfttrain.data.files import missing_entries, open_source
from sfttrain.data.loader import describe_workers
from sfttrain.data.parquet import row_fields
from sfttrain.data.prepare import describe, plan_and_report
from sfttrain.distributed import check_cuda_visible, one_rank_group, wants_cuda
from sfttrain.errors import UserError
from sfttrain.hub import model_config
from sfttrain.lora import apply_lora, base_dtype, trained_identity
from sfttrain.model import build_on_meta, decoder_layers
from sfttrain.moe import MoeShape
from sfttrain.optim import schedule_settings, schedule_warnings
from sfttrain.resolved import cpp_wrapper
from sfttrain.profiling import check_window, window_passed
from sfttrain.recompute import checkpointed, chosen_layers, wants_attention_kept
from sfttrain.resume import check_not_in_use, review_resume
from sfttrain.run import parse_args as parse_config_args

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class DenseShape:
    """A decoder's sizes from its config.json, for its activations (parameters are counted on the model)."""
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    moe: MoeShape | None = None  # None: a dense decoder

    @classmethod
    def from_config_json(cls, folder: str) -> "DenseShape":
        with open(os.path.join(folder, "config.json")) as f:
            c = json.load(f)
        c = c.get("text_config", c)  # multimodal configs nest the language model's
        heads = c["num_attention_heads"]
        return cls(c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], heads,
                   c.get("num_key_value_heads") or heads, c.get("head_dim") or c["hidden_size"] // heads,
                   MoeShape.from_config(c))

    @property
    def sparse(self) -> bool:
        return bool(self.moe and self.moe.sparse_layers)

    def activation_elements_per_token(self) -> int:
        """Values one layer keeps for backward per token (flash attention keeps no scores)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 4 * self.hidden + 2 * q + 2 * kv + self.mlp_activations_per_token()

    def mlp_activations_per_token(self) -> int:
        """The MLP's values per token: the largest part of a layer and of its backward."""
        return self.moe.mlp_activations_per_token() if self.sparse else 3 * self.intermediate


def activation_bytes(shape: DenseShape, tokens: int, recomputed: int, value_bytes: int, keep_attention: bool,
                     keep_qkv: bool) -> int:
    """What backward keeps: a recomputed layer its input (plus what model.recompute_attention and
    recompute_qkv keep), the others everything, and one layer while it is recomputed."""
    per_layer = shape.activation_elements_per_token() * tokens * value_bytes
    kept = shape.hidden * value_bytes
    if keep_attention:
        kept += attention_output_bytes(shape, value_bytes) + key_value_bytes(shape, value_bytes)
    if keep_qkv:
        kept += (shape.heads * shape.head_dim * value_bytes
                 + (0 if keep_attention else key_value_bytes(shape, value_bytes)))
    return (shape.layers - recomputed) * per_layer + recomputed * tokens * kept + (per_layer if recomputed else 0)


def attention_output_bytes(shape: DenseShape, value_bytes: int) -> int:
    """Per token and layer: the kernel's output and its fp32 softmax statistics."""
    return shape.heads * (shape.head_dim * value_bytes + 4)


def key_value_bytes(shape: DenseShape, value_bytes: int) -> int:
    """Per token and layer: keys and values, which the compiled partitioner keeps with the attention output."""
    return 2 * shape.kv_heads * shape.head_dim * value_bytes


def memory_per_rank(cfg: Config, shape: DenseShape, model: torch.nn.Module, dp_size: int) -> dict[str, float]:
    """GiB per rank, by what holds it: FSDP shards weights, gradients and AdamW moments over the shard
    group; the loss holds one chunk of logits and the head's whole fp32 gradient. `model`: as the run
    builds it (on the meta device), for its parameter counts."""
    m, fsdp, tokens = cfg.model, cfg.model.fsdp_config, cfg.micro_batch_tokens()
    mixed = mixed_precision_dtypes(fsdp)
    shard, compute = shard_group_size(fsdp, dp_size), DTYPE_BYTES[mixed[0] if mixed else fsdp.model_dtype]
    total = sum(p.numel() for p in model.parameters() if p.dtype != quant.FP8)  # fp8's: whole on each rank
    layer, layer_nf4 = max((sum(p.numel() for p in b.parameters() if p.dtype != quant.FP8),
                            sum(p.numel() for p in b.parameters() if quant.is_nf4(p))) for b in decoder_layers(model))
    # what training updates: every weight, or LoRA's fp32 adapters (the frozen base has no gradient or moments)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    nf4 = [p.numel() for p in model.parameters() if quant.is_nf4(p)]  # model.base_quant=nf4's weights
    base = (total - trained - sum(nf4)) * base_dtype(m).itemsize + sum(nf4) * quant.BYTES_PER_WEIGHT
    trained *= 4 if m.lora_rank > 0 else DTYPE_BYTES[fsdp.model_dtype]
    recomputed = len(checkpointed(list(range(shape.layers)), m.gradient_checkpointing_ratio)) \
        if m.enable_gradient_checkpointing else 0
    out = {"parameters": (base + trained) / shard + quant.fp8_bytes(model), "gradients": trained / shard,
           "optimizer (AdamW m, v)": 2 * trained / shard}
    if shard > 1 and nf4:
        out["NF4 weights (gathered layers)"] = 2 * (layer_nf4 * quant.BYTES_PER_WEIGHT + (layer - layer_nf4) * compute)
    elif shard > 1:
        out[f"{'bf16' if compute == 2 else 'fp32'} weights (gathered layers)"] = 2 * layer * compute
    elif mixed_precision_dtypes(fsdp) is not None and m.lora_rank == 0:  # LoRA's base is bf16 already
        # compiled recomputed layers free their copies inside the graph
        copied = (shape.layers - recomputed) * layer if m.enable_gradient_checkpointing and m.compile else total
        out["bf16 weights (autocast copies)"] = copied * 2
    out[f"activations ({'with' if m.enable_gradient_checkpointing else 'without'} checkpointing)"] = activation_bytes(
        shape, tokens, recomputed, compute, wants_attention_kept(m, cfg.data.max_length), not m.recompute_qkv)
    adapters = 5 * shape.intermediate if m.lora_rank > 0 and not shape.sparse else 0  # LoRA on a dense MLP
    out["backward: one layer's MLP gradients"] = (shape.mlp_activations_per_token() + adapters) * tokens * compute
    if nf4:
        out["NF4: the largest weight dequantized (torchao's temporaries)"] = \
            max(nf4) * quant.dequantize_bytes_per_weight(base_dtype(m))
    if fp8 := [p for p in model.parameters() if p.dtype == quant.FP8]:  # eager: fp32 temporaries, a transposed weight
        out["FP8: a GEMM's quantization"] = max(tokens * max(p.shape) * 9 + p.numel() for p in fp8)
    out[f"logits / loss chunk ({m.loss_chunk_tokens} tokens x {shape.vocab} vocab)"] = \
        m.loss_chunk_tokens * shape.vocab * compute * (2 if m.loss_kernel == "torch" else 1)
    if m.lora_rank == 0 and not m.use_liger:
        weight_bytes = compute if shard > 1 else DTYPE_BYTES[fsdp.model_dtype]  # the head's weight in the loss
        out["loss: the head's gradient (fp32, and its copy saved for backward)"] = \
            shape.vocab * shape.hidden * (4 + (weight_bytes if weight_bytes != 4 else 0))
    return {k: v / GIB for k, v in out.items()}


@dataclass
class Batches:
    lines: list[str]
    total_steps: Optional[int] = None  # None: the rows were not counted here
    fingerprint: Optional[dict] = None  # the data fingerprint; None: the rows were not rendered here


def batch_section(s: Startup) -> Batches:
    """The batch arithmetic over the data-parallel ranks, and the data report of the rows rendered as the run
    renders them (only counted where the model folder has no tokenizer)."""
    cfg, d, dp_size, found = s.cfg, s.cfg.data, s.dp_size, s.found
    files, rows, count = as_list(d.train_files), None, None
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    here = files and not missing_entries(files)
    if here and s.folder is not None and any(os.path.isfile(os.path.join(s.folder, f)) for f in tokenizer_files):
        rows = read_rows(s, (0, 1), (0, 1))
        count = None if rows is None else int(rows.stats.keep.sum())
    elif here:
        if s.folder is not None:
            found.notes.append(f"{s.folder} has no tokenizer: the rows are counted, not rendered")
        source = found.check(lambda: open_source(files, row_fields(d), cfg.trainer.default_local_dir))
        count = None if source is None else source.num_rows
    if dp_size is None:
        return Batches(["  data-parallel ranks : none: the ranks do not split into sequence-parallel groups (see "
                        "the problems below)"])
    plan = found.check(lambda: make_plan(cfg, dp_size, count if count is not None else d.train_batch_size))
    if plan is None:  # a batch that does not split, or fewer rows than one batch
        return Batches([])
    lines = plan.describe().splitlines()
    if count is None:  # the dataset and total-steps lines would be made up
        reason = "not on this machine" if missing_entries(as_list(d.train_files)) else "see the problems below"
        return Batches(lines[:3] + [f"  dataset             : {reason}: steps per epoch unknown"])
    found.check(lambda: check_window(cfg.trainer.profile_steps, plan.total_steps))
    lines += schedule_warnings(cfg.optim, plan.total_steps)
    if rows is None:  # counted, not rendered
        return Batches(lines, plan.total_steps)
    report = plan_and_report(cfg, rows, dp_size, None)[1]
    return Batches(lines + describe(report).splitlines(), plan.total_steps, rows.fingerprint)


def resume_section(cfg: Config, batches: Batches, folder: Optional[str], model, found: Findings) -> list[str]:
    """The checkpoint the run would resume from, and what its start-up would refuse of it."""
    found.check(lambda: check_not_in_use(cfg.trainer.default_local_dir))  # another run in it now
    chosen = found.check(lambda: choose_resume(cfg.trainer, cfg.trainer.default_local_dir))
    if chosen is None or chosen.path is None:
        return [f"  resume              : {'fresh start' if chosen else 'see the problems below'}",
                *(f"    {note}" for note in (chosen.notes if chosen else []))]
    step = step_of(chosen.path)
    total = batches.total_steps
    left = f", {total - step} of {total} steps left" if total and total >= step else ""
    line = chosen.line(f"from {chosen.path} (step {step}{left})")
    passed = window_passed(cfg.trainer.profile_steps, step)
    said = chosen.notes + ([f"trainer.profile_steps: {passed}"] if passed else [])
    if model is not None:
        found.check(lambda: check_same_model(chosen.path, trained_state_dict(model)))
    if batches.fingerprint is None:
        found.notes.append(f"the resume from {chosen.path}: whether it reads the same data and schedule needs the "
                           "training data rendered here")
        return [line, *(f"    {note}" for note in said)]
    lora_base = cfg.model.lora_rank > 0 and folder is not None
    current = TrainState(data=batches.fingerprint, schedule=schedule_settings(cfg.optim, batches.total_steps),
                         base=trained_identity(cfg.model, folder) if lora_base else None)
    notes, refused = review_resume(chosen.path, cfg, current)
    for problem in refused:
        found.add(problem)
    return [line, *(f"    {note}" for note in said + notes)]


def memory_section(cfg: Config, dp_size: Optional[int], folder: Optional[str], model, found: Findings) -> list[str]:
    if model is None or dp_size is None:  # no model here, or no shard groups to divide it over
        return []
    try:
        shape = DenseShape.from_config_json(folder)
    except (OSError, KeyError, json.JSONDecodeError) as e:
        found.add(f"model.partial_pretrain={folder!r}: no readable config.json with a dense decoder's sizes "
                  f"({type(e).__name__}: {e}); point it at a Hugging Face model folder")
        return []
    memory = memory_per_rank(cfg, shape, model, dp_size)
    device = "host" if cfg.trainer.device == "cpu" else "GPU"
    lines = [f"  model               : {sum(p.numel() for p in model.parameters()) / 1e6:,.1f}M parameters, "
             f"{shape.layers} layers (from {folder}/config.json)", f"  {device} memory per rank (estimate; "
             f"{'CUDA context and ' if device == 'GPU' else ''}allocator slack not included):"]
    lines += [f"    {name:<58} {gib:8.2f} GiB" for name, gib in memory.items()]
    return lines + [f"    {'total':<58} {sum(memory.values()):8.2f} GiB"]


def checkpoint_section(cfg: Config, model, found: Findings) -> list[str]:
    """A checkpoint's size, and whether the run folder's disk holds one."""
    if model is None:
        return []
    need = estimated_bytes(model)
    run_dir = os.path.abspath(os.path.expanduser(cfg.trainer.default_local_dir))
    there = nearest_existing(run_dir)
    if not os.path.isdir(there):  # a file in the way: the run folder check's problem
        return []
    free = shutil.disk_usage(there).free
    # a run folder not made yet: the line names the free space of the folder it will be made in
    if there == run_dir and (problem := room_problem(run_dir, free, need, estimated=True)):
        found.add(problem)
    return [f"  checkpoint          : about {size_text(need)} each (trained weights and AdamW moments); "
            f"{size_text(free)} free in {there}"]


def model_section(s: Startup):
    """The model built as the run builds it, on the meta device; None where it cannot be built here."""
    m = s.cfg.model
    if s.folder is None:
        return None
    model = s.found.check(lambda: build_on_meta(m, model_config(s.folder, m.trust_remote_code)))
    if model is not None and m.lora_rank > 0:  # its targets checked against the linear layers, as the run does
        model = s.found.check(lambda: apply_lora(model, m))
    if model is not None and m.enable_gradient_checkpointing:
        s.found.check(lambda: chosen_layers(decoder_layers(model), m))
    if model is not None and m.compile:  # a GPU run refuses it as it compiles the layers
        on_devices(s, s.devices, lambda device: cpp_wrapper(s.cfg, device, model.config))
    return model


def preflight(cfg: Config, nproc: int, nnodes: int, elsewhere: bool = False) -> tuple[list[str], Findings]:
    """(report lines, what was found): the run's own checks, none stopping the rest, and what it would do."""
    # the device types the run may take: both on a machine without a GPU under device=auto
    devices = (("cuda" if wants_cuda(cfg) else "cpu",) if cfg.trainer.device != "auto" or torch.cuda.is_available()
               else ("cuda", "cpu"))
    s = Startup(cfg, nproc * nnodes, devices, planning=True, elsewhere=elsewhere)
    lines, found = [f"sfttrain plan: {nnodes} node(s) x {nproc} rank(s)"], s.found
    with one_rank_group(), config_first(s):  # the row scan's collectives
        run_checks(s)
        try:
            check_cuda_visible(cfg)
        except ConfigError as e:
            found.notes.append(f"{e} (on this machine: a problem only if the nodes the run starts on have none "
                               "either)")
        if "wandb" in logger_names(cfg.trainer) and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
            found.notes.append("trainer.logger includes wandb: its login (`wandb login`, or WANDB_API_KEY) is checked "
                               "when the run starts, where a missing one stops it at once (WANDB_MODE=offline needs "
                               "none)")
        model = model_section(s)
        batches = batch_section(s)
        lines += batches.lines
        lines += describe_workers(cfg.data.num_workers, nproc, where="this machine")
        lines += resume_section(cfg, batches, s.folder, model, found)
        lines += memory_section(cfg, s.dp_size, s.folder, model, found)
        lines += checkpoint_section(cfg, model, found)
        lines += describe_retention(cfg.trainer.max_ckpt_to_keep)
        lines += moot_settings(cfg)
    return lines, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sfttrain.plan", description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [recipe.yaml] [key=value ...] --nproc N [--nnodes M] "
                                           "[--elsewhere]")
    parser.add_argument("--nproc", type=int, required=True,
                        help="GPUs (ranks) per node, as torchrun's --nproc_per_node")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes, as torchrun's --nnodes")
    parser.add_argument("--elsewhere", action="store_true",
                        help="the run starts on other machines: data and run folders missing here are notes")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(*parse_config_args(rest), check=False)
    except UserError as e:  # a value of the wrong type, a YAML error: nothing to plan with
        print(f"sfttrain plan: {e.kind}: {e}")
        return 2
    lines, found = preflight(cfg, args.nproc, args.nnodes, args.elsewhere)
    print("\n".join(lines))
    if found.notes:
        print("\n".join(["not checked here:"] + [f"  - {n}" for n in found.notes]))
    listed = [f"  - {p}".replace("\n", "\n    ") for p in found.problems]  # a problem's own lines under its dash
    print("\n".join(["problems:", *listed]) if listed else "no problems found")
    return 2 if listed else 0


if __name__ == "__main__":
    sys.exit(main())
