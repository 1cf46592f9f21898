"""Preflight: what a run will do and need, before any GPU is asked for.

    python -m sfttrain.plan [recipe.yaml] [key=value ...] --nproc N [--nnodes M] [--elsewhere]

Prints the batch arithmetic, the data report, memory per rank from config.json alone, and every problem
the run's own start-up checks would stop on. Exits 0 when nothing is wrong, else 2.
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
from transformers import AutoConfig

from sfttrain.checkpoint import TrainState, check_same_model, estimated_bytes, trained_state_dict
from sfttrain.checkpoint_folder import describe_retention, nearest_existing, room_problem, size_text, step_of
from sfttrain.checks import Findings, Startup, batch_split, on_devices, read_rows, run_checks
from sfttrain.config import (Config, ConfigError, ModelConfig, as_list, config_problems, load_config, logger_names,
                             mixed_precision_dtypes, moot_settings, shard_group_size)
from sfttrain.data.batching import make_plan
from sfttrain.data.files import missing_entries, open_source
from sfttrain.data.loader import cpus_of_this_process, describe_workers
from sfttrain.data.parquet import row_fields
from sfttrain.data.prepare import Rows, plan_and_report
from sfttrain.data.report import describe
from sfttrain.distributed import check_cuda_visible, one_rank_group, wants_cuda
from sfttrain.errors import UserError
from sfttrain.lora import apply_lora, base_dtype, trained_identity
from sfttrain.model import build_on_meta, decoder_layers
from sfttrain import quant
from sfttrain.moe import MoeShape
from sfttrain.optim import schedule_settings, schedule_warnings
from sfttrain.parallel import cpp_wrapper
from sfttrain.profiling import check_window, window_passed
from sfttrain.recompute import checkpointed, chosen_layers, wants_attention_kept
from sfttrain.checkpoint_folder import choose_resume
from sfttrain.resume import review_resume
from sfttrain.run import parse_args as parse_config_args
from sfttrain.run_lock import check_not_in_use

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class DenseShape:
    """A decoder as its config.json describes it; memory counts every expert."""
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    moe: MoeShape | None = None  # None: a dense decoder

    @classmethod
    def from_config_json(cls, folder: str) -> "DenseShape":
        with open(os.path.join(folder, "config.json")) as f:
            c = json.load(f)
        c = c.get("text_config", c)  # multimodal configs nest the language model's
        heads = c["num_attention_heads"]
        return cls(vocab=c["vocab_size"], hidden=c["hidden_size"], intermediate=c["intermediate_size"],
                   layers=c["num_hidden_layers"], heads=heads, kv_heads=c.get("num_key_value_heads") or heads,
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                   tied=c.get("tie_word_embeddings", False),
                   qkv_bias=c.get("attention_bias", c.get("model_type") in ("qwen2", "qwen2_moe")),
                   qk_norm=c.get("model_type") in ("qwen3", "qwen3_moe"), moe=MoeShape.from_config(c))

    @property
    def sparse_layers(self) -> int:
        return self.moe.sparse_layers if self.moe else 0

    def _layer_params(self, sparse: bool) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        mlp = self.moe.mlp_params(h) if sparse else 3 * h * self.intermediate  # dense: gate, up, down
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        return attention + mlp + norms

    @property
    def layer_params(self) -> int:
        """The largest layer: what one gathered FSDP unit holds."""
        return self._layer_params(sparse=self.sparse_layers > 0)

    @property
    def num_params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        layers = (self.layers - self.sparse_layers) * self._layer_params(sparse=False)
        if self.sparse_layers:
            layers += self.sparse_layers * self._layer_params(sparse=True)
        return embeddings + layers + self.hidden  # + the final norm

    @property
    def linear_params(self) -> int:
        """The decoder layers' projection weights (a MoE's experts, fused parameters, are none)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (2 * h * q + 2 * h * kv) + (self.layers - self.sparse_layers) * 3 * h * self.intermediate

    def lora_params(self, rank: int) -> int:
        """Adapter parameters for all-linear targets: rank x (in + out) per projection."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        dense = self.layers - self.sparse_layers
        total = self.layers * rank * ((h + q) * 2 + (h + kv) * 2) + dense * rank * (h + i) * 3
        if self.sparse_layers:
            total += self.sparse_layers * self.moe.lora_params(h, rank)
        return total

    def activation_elements_per_token(self) -> int:
        """Values one layer keeps for backward per token (flash attention keeps no scores)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 4 * self.hidden + 2 * q + 2 * kv + self.mlp_activations_per_token()

    def mlp_activations_per_token(self) -> int:
        """The MLP's values per token: the largest part of a layer and of its backward."""
        return self.moe.mlp_activations_per_token() if self.sparse_layers else 3 * self.intermediate


def compute_bytes(cfg: Config) -> int:
    """Bytes per value of what the forward computes in: bf16 with mixed precision, else model_dtype."""
    fsdp = cfg.model.fsdp_config
    mixed = mixed_precision_dtypes(fsdp)
    return DTYPE_BYTES[mixed[0] if mixed else fsdp.model_dtype]


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


def recomputed_layers(cfg: ModelConfig, layers: int) -> int:
    """How many layers recompute their activations (sfttrain.recompute)."""
    if not cfg.enable_gradient_checkpointing:
        return 0
    return len(checkpointed(list(range(layers)), cfg.gradient_checkpointing_ratio))


def backward_bytes(shape: DenseShape, tokens: int, value_bytes: int, lora: bool) -> int:
    """The MLP gradients a layer's backward holds; LoRA on a dense MLP adds 5 of its width a token."""
    adapters = 5 * shape.intermediate if lora and not shape.sparse_layers else 0
    return (shape.mlp_activations_per_token() + adapters) * tokens * value_bytes


def autocast_copy_params(cfg: ModelConfig, shape: DenseShape) -> int:
    """Weights whose compute-dtype copy lives from forward to backward; compiled recomputed layers
    free theirs inside the graph."""
    m = cfg.model
    if not (m.enable_gradient_checkpointing and m.compile):
        return shape.num_params
    return (shape.layers - recomputed_layers(m, shape.layers)) * shape.layer_params


def memory_per_rank(cfg: Config, shape: DenseShape, dp_size: int) -> dict[str, float]:
    """GiB per rank, by what holds it: FSDP shards weights, gradients and AdamW moments over the
    shard group; the loss holds one chunk of logits and the head's whole fp32 gradient."""
    m = cfg.model
    fsdp = m.fsdp_config
    shard = shard_group_size(fsdp, dp_size)
    compute = compute_bytes(cfg)
    compute_name = "bf16" if compute == 2 else "fp32"
    n = shape.num_params
    # what training updates: every weight, or LoRA's fp32 adapters (the frozen base has no gradient or moments)
    trained, trained_bytes = ((shape.lora_params(m.lora_rank), 4) if m.lora_rank > 0
                              else (shape.num_params, DTYPE_BYTES[fsdp.model_dtype]))
    activations = activation_bytes(shape, cfg.micro_batch_tokens(), recomputed_layers(m, shape.layers), compute,
                                   wants_attention_kept(m, cfg.data.max_length), not m.recompute_qkv)
    logits = m.loss_chunk_tokens * shape.vocab * compute * (2 if m.loss_kernel == "torch" else 1)
    autocast = mixed_precision_dtypes(fsdp) is not None and m.lora_rank == 0  # LoRA's base is bf16 already
    base = 0 if m.lora_rank == 0 else n * base_dtype(m).itemsize
    if m.base_quant == "nf4":
        base -= shape.linear_params * (base_dtype(m).itemsize - quant.BYTES_PER_WEIGHT)
    out = {"parameters": (base + trained * trained_bytes) / shard, "gradients": trained * trained_bytes / shard,
           "optimizer (AdamW m, v)": 2 * trained * trained_bytes / shard}
    if shard > 1 and m.base_quant == "nf4":
        linear = shape.linear_params // shape.layers
        rest = shape.layer_params - linear  # norms, biases
        out["NF4 weights (gathered layers)"] = 2 * (linear * quant.BYTES_PER_WEIGHT + rest * compute)
    elif shard > 1:
        out[f"{compute_name} weights (gathered layers)"] = 2 * shape.layer_params * compute
    elif autocast:
        out["bf16 weights (autocast copies)"] = autocast_copy_params(cfg, shape) * 2
    out[f"activations ({'with' if m.enable_gradient_checkpointing else 'without'} checkpointing)"] = activations
    out["backward: one layer's MLP gradients"] = backward_bytes(shape, cfg.micro_batch_tokens(), compute,
                                                                m.lora_rank > 0)
    if m.base_quant == "nf4":
        largest = shape.hidden * max(shape.intermediate, shape.heads * shape.head_dim)
        out["NF4: the largest weight dequantized (torchao's temporaries)"] = \
            largest * quant.dequantize_bytes_per_weight(base_dtype(m))
    out[f"logits / loss chunk ({m.loss_chunk_tokens} tokens x {shape.vocab} vocab)"] = logits
    if m.lora_rank == 0 and not m.use_liger:
        weight_bytes = compute if shard > 1 else DTYPE_BYTES[fsdp.model_dtype]  # the head's weight in the loss
        out["loss: the head's gradient (fp32, and its copy saved for backward)"] = \
            shape.vocab * shape.hidden * (4 + (weight_bytes if weight_bytes != 4 else 0))
    return {k: v / GIB for k, v in out.items()}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m sfttrain.plan", description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [recipe.yaml] [key=value ...] --nproc N [--nnodes M] "
                                           "[--elsewhere]")
    parser.add_argument("--nproc", type=int, required=True,
                        help="GPUs (ranks) per node, as torchrun's --nproc_per_node")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes, as torchrun's --nnodes")
    parser.add_argument("--elsewhere", action="store_true",
                        help="the run starts on other machines: data and run folders missing here are notes")
    return parser.parse_known_args(argv)


@dataclass
class Batches:
    lines: list[str]
    total_steps: Optional[int] = None  # None: the rows were not counted here
    fingerprint: Optional[dict] = None  # the data fingerprint; None: the rows were not rendered here


def training_rows(s: Startup) -> tuple[Optional[Rows], Optional[int]]:
    """(rows rendered as the run renders them, rows trained); only counted without a tokenizer;
    (None, None) where the data is not here."""
    files = as_list(s.cfg.data.train_files)
    if not files or missing_entries(files):
        return None, None
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if s.folder is not None and any(os.path.isfile(os.path.join(s.folder, f)) for f in tokenizer_files):
        rows = read_rows(s, (0, 1), (0, 1))
        return rows, None if rows is None else int(rows.stats.keep.sum())
    if s.folder is not None:
        s.found.notes.append(f"{s.folder} has no tokenizer: the rows are counted, not rendered")
    source = s.found.check(lambda: open_source(files, row_fields(s.cfg.data), s.cfg.trainer.default_local_dir))
    return None, None if source is None else source.num_rows


def batch_section(s: Startup) -> Batches:
    """The batch arithmetic over the data-parallel ranks, and the data report."""
    cfg, d, dp_size, found = s.cfg, s.cfg.data, s.dp_size, s.found
    rows, count = training_rows(s)
    if dp_size is None:
        return Batches(["  data-parallel ranks : none: the ranks do not split into sequence-parallel groups (see "
                        "the problems below)"])
    if batch_split(cfg, dp_size):  # listed by the checks
        return Batches([f"  data-parallel ranks : {dp_size}", f"  global batch        : {d.train_batch_size} "
                        "(does not split)"])
    plan = found.check(lambda: make_plan(cfg, dp_size, count if count is not None else d.train_batch_size))
    if plan is None:  # fewer rows than one batch
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


def memory_section(cfg: Config, dp_size: Optional[int], folder: Optional[str], found: Findings) -> list[str]:
    if folder is None or dp_size is None:  # no model here, or no shard groups to divide it over
        return []
    try:
        shape = DenseShape.from_config_json(folder)
    except (OSError, KeyError, json.JSONDecodeError) as e:
        found.add(f"model.partial_pretrain={folder!r}: no readable config.json with a dense decoder's sizes "
                  f"({type(e).__name__}: {e}); point it at a Hugging Face model folder")
        return []
    memory = memory_per_rank(cfg, shape, dp_size)
    device = "host" if cfg.trainer.device == "cpu" else "GPU"
    lines = [f"  model               : {shape.num_params / 1e6:,.1f}M parameters, {shape.layers} layers "
             f"(from {folder}/config.json)", f"  {device} memory per rank (estimate; "
             f"{'CUDA context and ' if device == 'GPU' else ''}allocator slack not included):"]
    lines += [f"    {name:<58} {gib:8.2f} GiB" for name, gib in memory.items()]
    lines.append(f"    {'total':<58} {sum(memory.values()):8.2f} GiB")
    checkpointing = cfg.model.enable_gradient_checkpointing
    other = activation_bytes(shape, cfg.micro_batch_tokens(), 0 if checkpointing else shape.layers, compute_bytes(cfg),
                             wants_attention_kept(cfg.model, cfg.data.max_length), not cfg.model.recompute_qkv) / GIB
    lines.append(f"  activations of {cfg.micro_batch_tokens()} tokens per micro-batch; with "
                 f"model.enable_gradient_checkpointing={str(not checkpointing).lower()} "
                 f"they would take {other:.2f} GiB")
    return lines


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
    if there == run_dir and (problem := room_problem(run_dir, free, need, estimated=True)):
        found.add(problem)
    elif there != run_dir:
        found.notes.append(f"trainer.default_local_dir={cfg.trainer.default_local_dir!r} does not exist yet: the "
                           f"free space of {there} ({size_text(free)}) is what a run started on this machine gets")
    return [f"  checkpoint          : about {size_text(need)} each (trained weights and AdamW moments); "
            f"{size_text(free)} free in {there}"]


def run_devices(cfg: Config) -> tuple[str, ...]:
    """The device types the run may take: both on a machine without a GPU under device=auto."""
    if cfg.trainer.device != "auto" or torch.cuda.is_available():
        return ("cuda" if wants_cuda(cfg) else "cpu",)
    return ("cuda", "cpu")


def model_section(s: Startup):
    """The model built as the run builds it, on the meta device; None where it cannot be built here."""
    m = s.cfg.model
    if s.folder is None:
        return None
    model = s.found.check(lambda: build_on_meta(m, AutoConfig.from_pretrained(s.folder,
                                                                            trust_remote_code=m.trust_remote_code)))
    if model is not None and m.lora_rank > 0:  # its targets checked against the linear layers, as the run does
        model = s.found.check(lambda: apply_lora(model, m))
    if model is not None and m.enable_gradient_checkpointing:
        s.found.check(lambda: chosen_layers(decoder_layers(model), m))
    if model is not None and m.compile:  # a GPU run refuses it as it compiles the layers
        on_devices(s, s.devices, lambda device: cpp_wrapper(s.cfg, device, model.config))
    return model


def preflight(cfg: Config, nproc: int, nnodes: int, elsewhere: bool = False) -> tuple[list[str], Findings]:
    """(report lines, what was found): the run's own checks, none stopping the rest."""
    s = Startup(cfg, nproc * nnodes, run_devices(cfg), planning=True, elsewhere=elsewhere)
    lines = [f"sfttrain plan: {nnodes} node(s) x {nproc} rank(s)"]
    try:
        with one_rank_group():  # the row scan's collectives
            run_checks(s)
            plan_sections(s, nproc, lines)
    except Exception as e:  # noqa: BLE001 -- a value the config refuses (a micro-batch of 0) that a later
        if not config_problems(cfg):  # section cannot take, the run stops before; else a bug, raised
            raise
        s.found.notes.append(f"the rest of the plan needs the config's problems fixed first ({type(e).__name__}: "
                             f"{e}): fix them and run the preflight again")
    return lines, s.found


def plan_sections(s: Startup, nproc: int, lines: list[str]) -> None:
    """The report beyond the registry's checks, appended to `lines` and `s.found`."""
    cfg, found = s.cfg, s.found
    try:
        check_cuda_visible(cfg)
    except ConfigError as e:
        found.notes.append(f"{e} (on this machine: a problem only if the nodes the run starts on have none either)")
    if "wandb" in logger_names(cfg.trainer) and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        found.notes.append("trainer.logger includes wandb: its login (`wandb login`, or WANDB_API_KEY) is checked when "
                           "the run starts, where a missing one stops it at once (WANDB_MODE=offline needs none)")
    model = model_section(s)
    batches = batch_section(s)
    lines += batches.lines
    lines += describe_workers(cfg.data.num_workers, nproc, cpus_of_this_process(), where="this machine")
    lines += resume_section(cfg, batches, s.folder, model, found)
    lines += memory_section(cfg, s.dp_size, s.folder, found)
    lines += checkpoint_section(cfg, model, found)
    lines += describe_retention(cfg.trainer.max_ckpt_to_keep)
    lines += moot_settings(cfg)


def main(argv: list[str] | None = None) -> int:
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(*parse_config_args(rest), check=False)
    except UserError as e:  # an unknown key, a value of the wrong type, a YAML error: nothing to plan with
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
