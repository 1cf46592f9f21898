"""Preflight: what a run will do and need, before any GPU is asked for.

    python -m sfttrain.plan [recipe.yaml] [key=value ...] --nproc N [--nnodes M]

Prints the batch arithmetic (sfttrain.data.batching, the trainer's own), steps per epoch, an
estimate of memory per rank from the model folder's config.json alone (no weights, no GPU), and
every problem the run would stop on, found by the run's own checks: the config's validation,
the world's shape, the chat template, the start-up pass over every row (rendered with the
model's tokenizer as the run renders them: a bad cell, column or over-long row is named here),
the model as the run builds it (on the meta device: no weights, no memory), and the resume rules
(the checkpoint the run folder would resume from, and what they refuse).
What it cannot check on this machine (data or model only on the cluster, GPUs where it has none) is
said, not counted.
Exits 0 when nothing is wrong, else 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sfttrain.checkpoint_folder import describe_retention, nearest_existing, room_problem, size_text, step_of
from sfttrain.config import (Config, ConfigError, ModelConfig, as_list, config_problems, load_config, logger_names,
                             mixed_precision_dtypes, moot_settings, shard_group_size)
from sfttrain.data.batching import batch_problem, make_plan
from sfttrain.data.parquet import hub_id_hint
from sfttrain.errors import UserError
from sfttrain.hub import cached_folder, is_repo_id
from sfttrain.lora import base_dtype
from sfttrain.moe import MoeShape
from sfttrain.optim import schedule_warnings
from sfttrain.profiling import check_window
from sfttrain.recompute import checkpointed, wants_attention_kept
from sfttrain.rope import check_rope

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class DenseShape:
    """A decoder (Llama, Qwen2/2.5/3, Mistral; Qwen2/3-MoE and Mixtral with `moe`) as its config.json
    describes it. Memory counts every expert: each is held, gathered, updated."""
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
        """The largest layer (what one gathered FSDP unit holds)."""
        return self._layer_params(sparse=self.sparse_layers > 0)

    @property
    def num_params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        layers = (self.layers - self.sparse_layers) * self._layer_params(sparse=False)
        if self.sparse_layers:
            layers += self.sparse_layers * self._layer_params(sparse=True)
        return embeddings + layers + self.hidden  # + the final norm

    def lora_params(self, rank: int) -> int:
        """Adapter parameters with target_modules=all-linear: rank x (in + out) per projection."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        dense = self.layers - self.sparse_layers
        total = self.layers * rank * ((h + q) * 2 + (h + kv) * 2) + dense * rank * (h + i) * 3
        if self.sparse_layers:
            total += self.sparse_layers * self.moe.lora_params(h, rank)
        return total

    def activation_elements_per_token(self) -> int:
        """bf16 values one layer keeps for backward, per token: the two norms' inputs, the
        q/k/v projections' input and outputs, attention's output (o_proj's input), the MLP's
        input, gate and up outputs and their product (a common approximation; flash attention
        keeps no score matrix)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 4 * self.hidden + 2 * q + 2 * kv + self.mlp_activations_per_token()

    def mlp_activations_per_token(self) -> int:
        """The MLP's values per token (gate, up, their product; a MoE's routed share): the largest
        part of a layer, and of its backward's gradients."""
        return self.moe.mlp_activations_per_token() if self.sparse_layers else 3 * self.intermediate


def compute_bytes(cfg: Config) -> int:
    """Bytes per value of what the forward computes in: bf16 with mixed precision, else model_dtype."""
    fsdp = cfg.model.fsdp_config
    mixed = mixed_precision_dtypes(fsdp)
    return DTYPE_BYTES[mixed[0] if mixed else fsdp.model_dtype]


def activation_bytes(shape: DenseShape, tokens: int, recomputed: int, value_bytes: int, keep_attention: bool,
                     keep_qkv: bool) -> int:
    """What backward needs kept: a recomputed layer keeps its input (and, unless
    model.recompute_attention: sfttrain.recompute, what its attention's backward reads: the kernel's
    output with fp32 softmax statistics, and the keys and values; with model.recompute_qkv=false the
    queries, keys and values), and while it is recomputed one layer's activations exist; every other
    layer keeps all its activations."""
    per_layer = shape.activation_elements_per_token() * tokens * value_bytes
    kept = shape.hidden * value_bytes
    if keep_attention:
        kept += attention_output_bytes(shape, value_bytes) + key_value_bytes(shape, value_bytes)
    if keep_qkv:
        kept += shape.heads * shape.head_dim * value_bytes + (0 if keep_attention else key_value_bytes(shape, value_bytes))
    return (shape.layers - recomputed) * per_layer + recomputed * tokens * kept + (per_layer if recomputed else 0)


def attention_output_bytes(shape: DenseShape, value_bytes: int) -> int:
    """Per token and layer: the attention kernel's output and its fp32 softmax statistics."""
    return shape.heads * (shape.head_dim * value_bytes + 4)


def key_value_bytes(shape: DenseShape, value_bytes: int) -> int:
    """Per token and layer: the keys and values a layer that keeps its attention output also keeps
    (the compiled partitioner saves them rather than recompute their projections). Measured, not
    derived: W2b with LoRA at 16k, 32k and 64k tokens peaked 1.18, 3.20 and 7.13 GiB over the
    estimate without them, 3.9 KB a token and layer over the last two (W2b's keys and values: 4.0 KB);
    with them the estimate lies 0.80-0.87 GiB above all three (docs/benchmarks.md, runs BA, BC)."""
    return 2 * shape.kv_heads * shape.head_dim * value_bytes


def recomputed_layers(cfg: ModelConfig, layers: int) -> int:
    """How many of the decoder's layers recompute their activations (sfttrain.recompute)."""
    if not cfg.enable_gradient_checkpointing:
        return 0
    return len(checkpointed(list(range(layers)), cfg.gradient_checkpointing_ratio))


def backward_bytes(shape: DenseShape, tokens: int, value_bytes: int, lora: bool) -> int:
    """The gradients a layer's backward holds beside its activations: those of its MLP's values. With
    LoRA on a dense MLP (all-linear, as `lora_params` counts), 5 more of its width a token: the
    adapters' B outputs of gate and up, the sums that make gate and up, and the adapter's term of
    down's input gradient. W2b's peak (docs/benchmarks.md, run BT) held 7 [tokens, intermediate] and
    2 [tokens, 2 x intermediate] buffers in that backward: 11 widths, where this and the one layer's
    activations count 6 without LoRA."""
    adapters = 5 * shape.intermediate if lora and not shape.sparse_layers else 0
    return (shape.mlp_activations_per_token() + adapters) * tokens * value_bytes


def autocast_copy_params(cfg: ModelConfig, shape: DenseShape) -> int:
    """Weights whose compute-dtype copy (one device, autocast) lives from forward to backward: every
    weight, saved for backward; but a recomputed layer's copies when compiled are made and freed
    inside its graph, in forward and again in its recomputation (eager, autocast's cache holds
    every copy until the forward ends)."""
    m = cfg.model
    if not (m.enable_gradient_checkpointing and m.compile):
        return shape.num_params
    return (shape.layers - recomputed_layers(m, shape.layers)) * shape.layer_params


def memory_per_rank(cfg: Config, shape: DenseShape, dp_size: int) -> dict[str, float]:
    """GiB per rank, by what holds it. FSDP shards parameters, gradients and AdamW's two moments
    over the shard group; compute runs on compute-dtype copies of one layer at a time (plus the
    prefetched next one). Unsharded (one GPU, NO_SHARD), autocast's bf16 copy of every weight is
    kept from forward to backward. The loss holds one chunk of logits, never the whole [tokens, vocab]."""
    m = cfg.model
    fsdp = m.fsdp_config
    shard = shard_group_size(fsdp, dp_size)
    compute = compute_bytes(cfg)
    compute_name = "bf16" if compute == 2 else "fp32"
    n = shape.num_params
    trained, trained_bytes = trained_params(cfg, shape)
    activations = activation_bytes(shape, cfg.micro_batch_tokens(), recomputed_layers(m, shape.layers), compute,
                                   wants_attention_kept(m, cfg.data.max_length), not m.recompute_qkv)
    logits = m.loss_chunk_tokens * shape.vocab * compute * (2 if m.loss_kernel == "torch" else 1)
    autocast = mixed_precision_dtypes(fsdp) is not None and m.lora_rank == 0  # LoRA's base is bf16 already
    base = 0 if m.lora_rank == 0 else n * base_dtype(m).itemsize
    out = {"parameters": (base + trained * trained_bytes) / shard, "gradients": trained * trained_bytes / shard,
           "optimizer (AdamW m, v)": 2 * trained * trained_bytes / shard}
    if shard > 1:
        out[f"{compute_name} weights (gathered layers)"] = 2 * shape.layer_params * compute
    elif autocast:
        out["bf16 weights (autocast copies)"] = autocast_copy_params(cfg, shape) * 2
    out[f"activations ({'with' if m.enable_gradient_checkpointing else 'without'} checkpointing)"] = activations
    out["backward: one layer's MLP gradients"] = backward_bytes(shape, cfg.micro_batch_tokens(), compute, m.lora_rank > 0)
    out[f"logits / loss chunk ({m.loss_chunk_tokens} tokens x {shape.vocab} vocab)"] = logits
    return {k: v / GIB for k, v in out.items()}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m sfttrain.plan", description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [recipe.yaml] [key=value ...] --nproc N [--nnodes M]")
    parser.add_argument("--nproc", type=int, required=True, help="GPUs (ranks) per node, as torchrun's --nproc_per_node")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes, as torchrun's --nnodes")
    return parser.parse_known_args(argv)


@dataclass
class Findings:
    problems: list[str] = dataclasses.field(default_factory=list)  # what the run would stop on
    notes: list[str] = dataclasses.field(default_factory=list)  # what could not be checked on this machine

    def check(self, run: Callable):
        """run(), its problem (a UserError) recorded; its result or None."""
        try:
            return run()
        except UserError as e:
            self.add(str(e))
            return None

    def add(self, problem: str) -> None:
        if problem not in self.problems:  # one mistake two of the run's checks find (validate's, the world's)
            self.problems.append(problem)


def model_folder(m: ModelConfig, found: Findings) -> Optional[str]:
    """model.partial_pretrain as a folder on this machine, checked as the run checks it: as given, or a hub
    id's snapshot in the local hub cache (never downloaded here; None with a note on how to point the
    preflight at one). None where the folder is not a model's (a problem)."""
    from sfttrain.model import check_model_folder

    if not m.partial_pretrain:  # the validation's problem already
        return None
    folder = cached_folder(m.partial_pretrain) if is_repo_id(m.partial_pretrain) else m.partial_pretrain
    if folder is None:
        found.notes.append(f"model.partial_pretrain={m.partial_pretrain!r} is a hub id that is not in this machine's "
                           "hub cache: memory and the rendering of the rows are not checked; fill the cache with "
                           f"`hf download {m.partial_pretrain} --include '*.json' '*.model' '*.jinja'` or add "
                           "model.partial_pretrain=/path/to/a/local/copy to this command")
        return None
    try:
        check_model_folder(m, folder)
    except ConfigError as e:
        found.add(str(e))
        return None
    return folder


def has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                 "tokenizer.model"))


@dataclass
class RenderedRows:
    stats: Any  # sfttrain.data.loader.RowStats, the rows without a supervised token selected
    fingerprint: dict  # the data fingerprint the run's checkpoints record
    source: Any  # the training rows' ParquetSource
    validation: Optional[dict]  # the data report's validation part; None: no data.val_files here


def render_rows(cfg: Config, folder: str, found: Findings) -> Optional[RenderedRows]:
    """The rows the run trains, found as its start-up finds them (sfttrain.data.prepare): the
    tokenizer, the chat template, every row rendered (a bad cell or an over-long row is the DataError
    the run would stop on), the rows without a supervised token selected; the validation rows rendered
    too, and those that are training rows counted. The two are rendered apart, their problems recorded
    in `found`: a bad training row, which the run stops on first, hides no bad validation row (None
    where the training rows fail)."""
    from sfttrain.data.chat import build_renderer
    from sfttrain.data.fingerprint import data_fingerprint, with_rows
    from sfttrain.data.loader import row_stats
    from sfttrain.data.files import open_source
    from sfttrain.data.parquet import row_fields
    from sfttrain.data.prepare import length_cache_file, validation_report
    from sfttrain.data.report import select_rows
    from sfttrain.distributed import one_rank_group
    from sfttrain.model import embedding_rows, load_tokenizer

    d, run_dir = cfg.data, cfg.trainer.default_local_dir
    tokenizer = load_tokenizer(dataclasses.replace(cfg.model, partial_pretrain=folder))
    renderer, fields = build_renderer(d, tokenizer, embedding_rows(cfg.model, folder)), row_fields(d)
    source = open_source(as_list(d.train_files), fields, run_dir)
    fingerprint = data_fingerprint(cfg, source, tokenizer)
    # a folder of the user's own is read and filled; the run folder's cache is read, never made here
    cache = length_cache_file(d, fingerprint, run_dir)
    cached = cache if d.length_cache_dir or os.path.isfile(cache) else None
    with one_rank_group():
        stats = found.check(lambda: select_rows(row_stats(source, renderer, 0, 1, cached), d))
        val = found.check(lambda: validation_rows(d, fields, run_dir, renderer))
        if stats is None:
            return None
        validation = validation_report(val[1], stats, val[0].num_rows) if val else None
    return RenderedRows(stats, with_rows(fingerprint, stats.keep, stats.digests), source, validation)


def validation_rows(d, fields, run_dir: str, renderer) -> Optional[tuple[Any, list]]:
    """(the validation rows' ParquetSource, their samples rendered), or None without data.val_files here."""
    from sfttrain.data.files import open_source
    from sfttrain.data.loader import render_share

    if not d.val_files or missing_files(d.val_files):
        return None
    source = open_source(as_list(d.val_files), fields, run_dir)
    return source, render_share(source, renderer, 0, 1)


def row_count(cfg: Config) -> int:
    """Rows of the training data, unrendered (raises DataError when a file is unreadable or lacks
    the columns)."""
    from sfttrain.data.files import open_source
    from sfttrain.data.parquet import row_fields

    return open_source(as_list(cfg.data.train_files), row_fields(cfg.data), cfg.trainer.default_local_dir).num_rows


def missing_files(files) -> list[str]:
    """The entries (files, directories of files, patterns matching none) not on this machine."""
    from sfttrain.data.files import is_pattern

    paths = {f: os.path.expanduser(f) for f in as_list(files)}
    return [f for f, p in paths.items() if not (glob.glob(p, recursive=True) if is_pattern(p) else os.path.exists(p))]


def check_val_files(d, train_files_here: bool, found: Findings) -> None:
    """Validation files not on this machine: a mistyped path where the training files are here (the run
    would stop on it), else only not checked."""
    missing = missing_files(d.val_files)
    if missing and train_files_here:
        found.problems.append(f"data.val_files: {', '.join(missing)} not found, while data.train_files are: check "
                              "the path (the run would stop on it at start-up)")
    elif missing:
        found.notes.append(f"data.val_files: {', '.join(missing)} not on this machine: the validation rows are not "
                           "checked")


@dataclass
class Batches:
    lines: list[str]
    total_steps: Optional[int] = None  # None: the rows were not counted here
    fingerprint: Optional[dict] = None  # the data fingerprint; None: the rows were not rendered here


@dataclass
class TrainingRows:
    count: Optional[int]  # rows trained; None: not counted here
    rendered: Optional[RenderedRows]  # None: not rendered here
    missing: list[str]  # data.train_files entries not on this machine (none where others are: a mistyped path)


def training_rows(cfg: Config, folder: Optional[str], found: Findings) -> TrainingRows:
    """The training rows as the start-up finds them: rendered with the model's tokenizer, else counted
    (the validation files checked too). Needs no ranks, so a world or batch that does not split hides
    none of their problems."""
    d = cfg.data
    missing = missing_files(d.train_files)
    rows, rendered = None, None
    here = [f for f in as_list(d.train_files) if f not in missing]
    if missing and here:  # the others are here: a mistyped path, which the run stops on
        found.problems.append(f"data.train_files: {', '.join(missing)} not found, while {', '.join(here)} "
                              f"{'is' if len(here) == 1 else 'are'}: check the path (the run would stop on it at "
                              "start-up)" + "".join(map(hub_id_hint, missing)))
    elif missing:  # a missing file is often only missing here (the cluster's path): not a problem
        found.notes.append(f"data.train_files: {', '.join(missing)} not on this machine: steps per epoch and the rows "
                           "are not checked" + "".join(map(hub_id_hint, missing)))
    elif d.train_files and folder is not None and has_tokenizer(folder):
        rendered = found.check(lambda: render_rows(cfg, folder, found))
        rows = int(rendered.stats.keep.sum()) if rendered else None
    elif d.train_files:  # (none given: the validation's problem)
        if folder is not None and os.path.isdir(folder):
            found.notes.append(f"{folder} has no tokenizer: the rows are counted, not rendered")
        rows = found.check(lambda: row_count(cfg))
    check_val_files(d, bool(d.train_files) and not missing, found)
    return TrainingRows(rows, rendered, [] if here else missing)  # (a mistyped one: the problems say so)


def batch_section(cfg: Config, dp_size: Optional[int], folder: Optional[str], found: Findings) -> Batches:
    """The rows checked, and the batch arithmetic over dp_size data-parallel ranks (None: the ranks do
    not split into sequence-parallel groups, the world's problem: nothing is derived from them)."""
    d = cfg.data
    data = training_rows(cfg, folder, found)
    if dp_size is None:
        return Batches(["  data-parallel ranks : none: the ranks do not split into sequence-parallel groups (see "
                        "the problems below)"])
    problem = batch_problem(d.train_batch_size, d.micro_batch_size_per_gpu, dp_size, d.max_token_len_per_gpu)
    if problem:
        found.problems.append(problem)
        return Batches([f"  data-parallel ranks : {dp_size}", f"  global batch        : {d.train_batch_size} "
                        "(does not split)"])
    rows, rendered = data.count, data.rendered
    plan = found.check(lambda: make_plan(cfg, dp_size, rows if rows is not None else d.train_batch_size))
    if plan is None:  # fewer rows than one batch
        return Batches([])
    lines = plan.describe().splitlines()
    if rows is None:  # the dataset and total-steps lines would be made up
        reason = "not on this machine" if data.missing else "see the problems below"
        return Batches(lines[:3] + [f"  dataset             : {reason}: steps per epoch unknown"])
    found.check(lambda: check_window(cfg.trainer.profile_steps, plan.total_steps))
    lines += schedule_warnings(cfg.optim, plan.total_steps)
    if rendered is None:  # counted, not rendered
        return Batches(lines, plan.total_steps)
    return Batches(lines + data_lines(cfg, rendered, plan), plan.total_steps, rendered.fingerprint)


def data_lines(cfg: Config, rendered: RenderedRows, plan) -> list[str]:
    """The start-up's data report: tokens per row, truncation, duplicates, validation rows in training."""
    from sfttrain.data.prepare import first_epoch_report
    from sfttrain.data.report import describe

    report = first_epoch_report(cfg, rendered.source, rendered.stats, plan)
    if rendered.validation is not None:
        report["validation"] = rendered.validation
    return describe(report).splitlines()


def resume_section(cfg: Config, batches: Batches, folder: Optional[str], model, found: Findings) -> list[str]:
    """The checkpoint the run would resume from (sfttrain.resume's rules, the run folder left as it
    is), and what its start-up would refuse of that resume: a damaged checkpoint, other data, a
    schedule that ends before it, another LoRA base, another model or LoRA setup (against `model`, the
    planned model; None: not built here); and another run in the folder now."""
    from sfttrain.checkpoint import TrainState, check_same_model, trained_state_dict
    from sfttrain.lora import trained_identity
    from sfttrain.optim import schedule_settings
    from sfttrain.profiling import window_passed
    from sfttrain.resume import choose_resume, review_resume
    from sfttrain.run_lock import check_not_in_use

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
    found.problems += refused
    return [line, *(f"    {note}" for note in said + notes)]


def memory_section(cfg: Config, dp_size: Optional[int], folder: Optional[str], found: Findings) -> list[str]:
    if folder is None or dp_size is None:  # no model here, or no shard groups to divide it over
        return []
    try:
        shape = DenseShape.from_config_json(folder)
    except (OSError, KeyError, json.JSONDecodeError) as e:
        found.problems.append(f"model.partial_pretrain={folder!r}: no readable config.json with a dense decoder's "
                              f"sizes ({type(e).__name__}: {e}); point it at a Hugging Face model folder")
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
                 f"model.enable_gradient_checkpointing={str(not checkpointing).lower()} they would take {other:.2f} GiB")
    return lines


def trained_params(cfg: Config, shape: DenseShape) -> tuple[int, int]:
    """(count, bytes per value) of the parameters training updates: every one in model_dtype, or
    with LoRA only the fp32 adapters (the frozen base has no gradient or optimizer state)."""
    m = cfg.model
    if m.lora_rank > 0:
        return shape.lora_params(m.lora_rank), 4
    return shape.num_params, DTYPE_BYTES[m.fsdp_config.model_dtype]


def checkpoint_bytes(cfg: Config, shape: DenseShape) -> int:
    """A checkpoint's tensors, as the start-up estimates them (sfttrain.checkpoint.estimated_bytes):
    the trained weights (a tied embedding under both its names) and AdamW's two moments."""
    count, value_bytes = trained_params(cfg, shape)
    tied_copy = shape.vocab * shape.hidden if shape.tied and cfg.model.lora_rank == 0 else 0
    return (3 * count + tied_copy) * value_bytes


def run_folder_check(cfg: Config, found: Findings) -> None:
    """Whether this user can write the run folder, by the start-up's own check: a problem where the folder
    exists here, a note where only the folder it would be made in does (the run's machine may differ)."""
    from sfttrain.fs_faults import check_writable

    try:
        check_writable(cfg.trainer.default_local_dir)
    except ConfigError as e:
        run_dir = os.path.abspath(os.path.expanduser(cfg.trainer.default_local_dir))
        there = nearest_existing(run_dir)
        here = there == run_dir or not os.path.isdir(there)  # the folder itself, or a file in its path
        (found.problems if here else found.notes).append(str(e))


def checkpoint_section(cfg: Config, folder: Optional[str], found: Findings) -> list[str]:
    """A checkpoint's size, and whether the run folder's disk takes one (a problem where the run
    folder exists here; else the free space of its nearest existing parent is a note)."""
    if folder is None:
        return []
    try:
        shape = DenseShape.from_config_json(folder)
    except (OSError, KeyError, json.JSONDecodeError):  # said by memory_section
        return []
    need = checkpoint_bytes(cfg, shape)
    run_dir = os.path.abspath(os.path.expanduser(cfg.trainer.default_local_dir))
    there = nearest_existing(run_dir)
    if not os.path.isdir(there):  # a file in the way: run_folder_check's problem
        return []
    free = shutil.disk_usage(there).free
    if there == run_dir and (problem := room_problem(run_dir, free, need, estimated=True)):
        found.problems.append(problem)
    elif there != run_dir:
        found.notes.append(f"trainer.default_local_dir={cfg.trainer.default_local_dir!r} does not exist yet: the "
                           f"free space of {there} ({size_text(free)}) is what a run started on this machine gets")
    return [f"  checkpoint          : about {size_text(need)} each (trained weights and AdamW moments); "
            f"{size_text(free)} free in {there}"]


def fp8_section(cfg: Config, found: Findings) -> None:
    """model.fp8: torchao missing, or a CPU run, is a problem here as at start-up; the GPUs' FP8
    tensor cores can only be checked on them."""
    if cfg.model.fp8 == "off":
        return
    import torch

    from sfttrain import fp8

    if cfg.trainer.device == "cpu":
        found.check(lambda: fp8.check_available(cfg.model, torch.device("cpu")))
        return
    found.check(fp8.float8_api)
    found.notes.append(f"model.fp8={cfg.model.fp8}: whether the GPUs have FP8 tensor cores (compute capability >= "
                       "8.9: H100/H200, L40S) is checked at start-up")


def on_run_device(cfg: Config, found: Findings, check: Callable[[str], Any]) -> None:
    """check(device type) on the device the run takes, its refusal a problem: trainer.device's, or for auto
    the GPU this machine has. trainer.device=auto on a machine without one: the nodes the run lands on may
    have GPUs or not, so each device's refusal is a note."""
    import torch

    from sfttrain.distributed import wants_cuda

    if cfg.trainer.device != "auto" or torch.cuda.is_available():
        found.check(lambda: check("cuda" if wants_cuda(cfg) else "cpu"))
        return
    for device, where in (("cuda", "on GPUs"), ("cpu", "without GPUs (trainer.device=auto; this machine has none)")):
        try:
            check(device)
        except UserError as e:
            found.notes.append(f"if this runs {where}: {e}")


def liger_section(cfg: Config, found: Findings) -> None:
    """model.use_liger: liger-kernel missing stops a run on GPUs at start-up (a CPU run ignores the key,
    saying so)."""
    from sfttrain.model import liger_patching

    if cfg.model.use_liger:
        on_run_device(cfg, found, lambda device: device == "cuda" and liger_patching())


def attention_section(cfg: Config, folder: str, found: Findings) -> None:
    """The attention backend's start-up check (sfttrain.model.attention_backend): a backend the device
    cannot run, fp16/bf16 compute, Gemma 2's soft-cap; `auto` picks with this machine's packages."""
    from transformers import AutoConfig

    from sfttrain.model import attention_backend

    config = AutoConfig.from_pretrained(folder, trust_remote_code=cfg.model.trust_remote_code)
    on_run_device(cfg, found, lambda device: attention_backend(cfg.model, config, device))


def device_section(cfg: Config, world: int, mesh_shape: Optional[tuple[int, int]], found: Findings) -> None:
    """What the run needs of its device: a GPU for trainer.device=cuda (distributed.check_cuda_visible; a
    note where this machine has none, the run's nodes may have them), what its layout needs of the
    device (sfttrain.parallel.check_device: CPU offload, DDP's bf16 reduce), and a loss kernel that runs
    there (sfttrain.loss.chunk_loss_kernel)."""
    from sfttrain.distributed import check_cuda_visible
    from sfttrain.loss import chunk_loss_kernel
    from sfttrain.parallel import check_device, choose_layout

    try:
        check_cuda_visible(cfg)
    except ConfigError as e:
        found.notes.append(f"{e} (on this machine: a problem only if the nodes the run starts on have none either)")
    offload = cfg.model.fsdp_config.offloaded()
    # no mesh (the world's problem is listed): what needs no layout is still checked, offloading (always
    # sharded); DDP's reduce, which needs the layout, is not
    layout = choose_layout(world, mesh_shape[1], cfg.ulysses_sequence_parallel_size, offload) if mesh_shape \
        else "sharded"
    on_run_device(cfg, found, lambda device: check_device(cfg, layout, device))
    on_run_device(cfg, found, lambda device: chunk_loss_kernel(cfg.model.loss_kernel, device))


def model_section(cfg: Config, folder: str, found: Findings):
    """The start-up's checks of the model folder (its config.json here) and of the model the run builds,
    built here on the meta device (`planned_model`): the model, or None where it cannot be built."""
    from sfttrain.model import check_max_length, check_model_config, check_weights, decoder_layers
    from sfttrain.parallel import cpp_wrapper
    from sfttrain.recompute import chosen_layers

    found.check(lambda: check_rope(cfg, folder))
    found.check(lambda: check_max_length(cfg, folder))
    try:  # a folder of config files only is how a model elsewhere is planned here (the hub cache's too)
        check_weights(cfg.model, folder)
    except ConfigError as e:
        found.notes.append(f"{e} (a problem only if the folder has none where the run starts)")
    found.check(lambda: check_model_config(cfg, folder))
    attention_section(cfg, folder, found)
    model = found.check(lambda: planned_model(cfg.model, folder))
    if model is not None and cfg.model.enable_gradient_checkpointing:
        found.check(lambda: chosen_layers(decoder_layers(model), cfg.model))
    if model is not None and cfg.model.compile:  # a GPU run refuses it as it compiles the layers
        on_run_device(cfg, found, lambda device: cpp_wrapper(cfg, device, model.config))
    return model


def planned_model(m: ModelConfig, folder: str):
    """The model as the run builds it (sfttrain.model.load_model), on the meta device, LoRA's adapters
    applied: their targets checked against its linear layers (and a MoE's experts), as the run does."""
    from transformers import AutoConfig

    from sfttrain.lora import apply_lora
    from sfttrain.model import build_on_meta

    model = build_on_meta(m, AutoConfig.from_pretrained(folder, trust_remote_code=m.trust_remote_code))
    return apply_lora(model, m) if m.lora_rank > 0 else model


def workers_section(cfg: Config, nproc: int) -> list[str]:
    """The start-up lines of data.num_workers against this machine's CPUs, said to be this machine's:
    the nodes the run lands on may have others (there, the run's own start-up lines count theirs)."""
    from sfttrain.data.loader import cpus_of_this_process, describe_workers

    return describe_workers(cfg.data.num_workers, nproc, cpus_of_this_process(), where="this machine")


def open_files_check(cfg: Config, dp_size: Optional[int], found: Findings) -> None:
    """The start-up's refusal of a hard open files limit below what the data workers need
    (sfttrain.fs_faults.check_open_files), by this process's limit: a run started from the same shell has it."""
    from sfttrain.data.loader import open_files_needed
    from sfttrain.fs_faults import open_files_problem

    if dp_size is not None and (problem := open_files_problem(open_files_needed(cfg.data, dp_size))):
        found.add(problem)


def preflight(cfg: Config, nproc: int, nnodes: int) -> tuple[list[str], Findings]:
    """(report lines, what was found): the run's own checks, each problem listed, none stopping the rest."""
    found = Findings()
    refused = config_problems(cfg)
    for problem in refused:  # each on its own line, as the run's refusal lists them
        found.add(problem)
    lines = [f"sfttrain plan: {nnodes} node(s) x {nproc} rank(s)"]
    try:
        plan_sections(cfg, nproc, nnodes, found, lines)
    except Exception as e:  # noqa: BLE001 -- only where the config is refused; else a bug, raised
        # the sections compute with the config's values, some of which (a micro-batch of 0, a dtype or a
        # seed the run refuses) they cannot take: the run stops on the config's problems before them
        if not refused:
            raise
        found.notes.append(f"the rest of the plan needs the config's problems fixed first ({type(e).__name__}: "
                           f"{e}): fix them and run the preflight again")
    return lines, found


def plan_sections(cfg: Config, nproc: int, nnodes: int, found: Findings, lines: list[str]) -> None:
    """The checks and the report beyond the config's validation, appended to `lines` and `found`."""
    from sfttrain.distributed import check_world, data_parallel_size
    from sfttrain.metrics import require_loggers
    from sfttrain.model import check_weights_readable

    world = nproc * nnodes
    try:
        dp_size = data_parallel_size(world, cfg.ulysses_sequence_parallel_size)
    except ConfigError:  # listed by check_world below; nothing is derived from a split that does not exist
        dp_size = None
    mesh_shape = found.check(lambda: check_world(cfg, world))
    found.check(lambda: require_loggers(cfg))
    device_section(cfg, world, mesh_shape, found)
    if "wandb" in logger_names(cfg.trainer) and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        found.notes.append("trainer.logger includes wandb: its login (`wandb login`, or WANDB_API_KEY) is checked when "
                           "the run starts, where a missing one stops it at once (WANDB_MODE=offline needs none)")
    folder = model_folder(cfg.model, found)
    if folder is not None:
        found.check(lambda: check_weights_readable(cfg.model, folder))
    model = model_section(cfg, folder, found) if folder is not None else None
    fp8_section(cfg, found)
    liger_section(cfg, found)
    batches = batch_section(cfg, dp_size, folder, found)
    lines += batches.lines
    lines += workers_section(cfg, nproc)
    open_files_check(cfg, dp_size, found)
    run_folder_check(cfg, found)
    lines += resume_section(cfg, batches, folder, model, found)
    lines += memory_section(cfg, dp_size, folder, found)
    lines += checkpoint_section(cfg, folder, found)
    lines += describe_retention(cfg.trainer.max_ckpt_to_keep)
    lines += moot_settings(cfg)


def main(argv: list[str] | None = None) -> int:
    from sfttrain.run import parse_args as parse_config_args

    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(*parse_config_args(rest), check=False)
    except UserError as e:  # an unknown key, a value of the wrong type, a YAML error: nothing to plan with
        print(f"sfttrain plan: {e.kind}: {e}")
        return 2
    lines, found = preflight(cfg, args.nproc, args.nnodes)
    print("\n".join(lines))
    if found.notes:
        print("\n".join(["not checked here:"] + [f"  - {n}" for n in found.notes]))
    problems = found.problems
    listed = [f"  - {p}".replace("\n", "\n    ") for p in problems]  # a problem's own lines under its dash
    print("\n".join(["problems:", *listed]) if problems else "no problems found")
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
