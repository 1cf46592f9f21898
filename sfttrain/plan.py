"""Preflight: what a run will do and need, before any GPU is asked for.

    python -m sfttrain.plan [recipe.yaml] key=value ... --nproc N [--nnodes M]

Prints the batch arithmetic (sfttrain.data.plan, the trainer's own), steps per epoch from the
training data's row count when the Parquet files are reachable, an estimate of GPU memory per
rank from the model folder's config.json alone (no weights, no GPU), and every misconfiguration
found, each with a fix that is itself valid. Exits 0 when nothing is wrong, else 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

from sfttrain.config import Config, ConfigError, as_list, load_config, mixed_precision_dtypes, shard_group_size
from sfttrain.data.plan import batch_problem, make_plan
from sfttrain.errors import UserError

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class DenseShape:
    """A dense decoder (Llama, Qwen2/2.5/3, Mistral) as its config.json describes it."""
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
                   qkv_bias=c.get("attention_bias", c.get("model_type") == "qwen2"),
                   qk_norm=c.get("model_type") == "qwen3")

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate  # gate, up, down
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        return attention + mlp + norms

    @property
    def num_params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * self.layer_params + self.hidden  # + the final norm

    def lora_params(self, rank: int) -> int:
        """Adapter parameters with target_modules=all-linear: rank x (in + out) per projection."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return self.layers * rank * ((h + q) * 2 + (h + kv) * 2 + (h + i) * 3)

    def activation_elements_per_token(self) -> int:
        """bf16 values one layer keeps for backward, per token: the two norms' inputs, the
        q/k/v projections' input and outputs, attention's output (o_proj's input), the MLP's
        input, gate and up outputs and their product (a common approximation; flash attention
        keeps no score matrix)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 4 * self.hidden + 2 * q + 2 * kv + 3 * self.intermediate


def micro_batch_tokens(cfg: Config) -> int:
    """Tokens of the largest micro-batch on one rank (split over the sequence-parallel group)."""
    d = cfg.data
    return (d.max_token_len_per_gpu or d.micro_batch_size_per_gpu * d.max_length) // cfg.ulysses_sequence_parallel_size


def activation_bytes(shape: DenseShape, tokens: int, checkpointing: bool) -> int:
    """What backward needs kept: with checkpointing every layer's bf16 input plus one layer's
    activations (recomputed one layer at a time), else every layer's activations."""
    per_layer = shape.activation_elements_per_token() * tokens * 2
    return shape.layers * tokens * shape.hidden * 2 + per_layer if checkpointing else shape.layers * per_layer


def memory_per_rank(cfg: Config, shape: DenseShape, dp_size: int) -> dict[str, float]:
    """GiB per rank, by what holds it. FSDP shards parameters, gradients and AdamW's two moments
    over the shard group; compute runs on bf16 copies of one layer at a time (plus the prefetched
    next one). Unsharded (one GPU, NO_SHARD), autocast's bf16 copy of every weight is kept from
    forward to backward. The loss holds one chunk of logits, never the whole [tokens, vocab]."""
    m = cfg.model
    fsdp = m.fsdp_config
    shard = shard_group_size(fsdp, dp_size)
    master = DTYPE_BYTES[fsdp.model_dtype]
    n = shape.num_params
    # with LoRA only the fp32 adapters are trained: the frozen base has no gradient or optimizer state
    trained = shape.lora_params(m.lora_rank) if m.lora_rank > 0 else n
    trained_bytes = 4 if m.lora_rank > 0 else master
    activations = activation_bytes(shape, micro_batch_tokens(cfg), m.enable_gradient_checkpointing)
    logits = m.loss_chunk_tokens * shape.vocab * 2 * (2 if m.loss_kernel == "torch" else 1)
    autocast = mixed_precision_dtypes(fsdp) is not None and m.lora_rank == 0  # LoRA's base is bf16 already
    copies = 2 * shape.layer_params * 2 if shard > 1 else (n * 2 if autocast else 0)
    base = 0 if m.lora_rank == 0 else n * master
    out = {"parameters": (base + trained * trained_bytes) / shard, "gradients": trained * trained_bytes / shard,
           "optimizer (AdamW m, v)": 2 * trained * trained_bytes / shard,
           "bf16 weights " + ("(gathered layers)" if shard > 1 else "(autocast copies)"): copies,
           f"activations ({'with' if m.enable_gradient_checkpointing else 'without'} checkpointing)": activations,
           f"logits / loss chunk ({m.loss_chunk_tokens} tokens x {shape.vocab} vocab)": logits}
    return {k: v / GIB for k, v in out.items()}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m sfttrain.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, required=True, help="GPUs (ranks) per node, as torchrun's --nproc_per_node")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes, as torchrun's --nnodes")
    return parser.parse_known_args(argv)


def train_rows(cfg: Config) -> int:
    """Rows of the training data (raises DataError when a file is missing or unreadable)."""
    from sfttrain.data.files import open_source
    from sfttrain.data.parquet import row_fields

    return open_source(as_list(cfg.data.train_files), row_fields(cfg.data), cfg.trainer.default_local_dir).num_rows


def batch_section(cfg: Config, dp_size: int, problems: list[str]) -> list[str]:
    d = cfg.data
    problem = batch_problem(d.train_batch_size, d.micro_batch_size_per_gpu, dp_size, d.max_token_len_per_gpu)
    if problem:
        problems.append(problem)
        return [f"  data-parallel ranks : {dp_size}", f"  global batch        : {d.train_batch_size} (does not split)"]
    missing = [f for f in as_list(d.train_files) if not os.path.exists(os.path.expanduser(f))]
    rows = None
    if not missing:  # a missing file is often only missing here (the cluster's path): not a problem
        try:
            rows = train_rows(cfg)
        except UserError as e:  # a file that is there but unreadable, empty or without the columns
            problems.append(str(e))
    try:
        plan = make_plan(cfg, dp_size, rows if rows is not None else d.train_batch_size)
    except ConfigError as e:  # fewer rows than one batch
        problems.append(str(e))
        return []
    lines = plan.describe().splitlines()
    if rows is None:  # the dataset and total-steps lines would be made up: say so instead
        lines = lines[:3] + [f"  dataset             : not readable here ({', '.join(missing) or d.train_files}): "
                              "steps per epoch unknown"]
    return lines


def memory_section(cfg: Config, dp_size: int, problems: list[str]) -> list[str]:
    folder = cfg.model.partial_pretrain
    try:
        shape = DenseShape.from_config_json(folder)
    except (OSError, KeyError, json.JSONDecodeError) as e:
        problems.append(f"model.partial_pretrain={folder!r}: no readable config.json with a dense decoder's "
                        f"sizes ({type(e).__name__}: {e}); point it at a Hugging Face model folder")
        return []
    memory = memory_per_rank(cfg, shape, dp_size)
    lines = [f"  model               : {shape.num_params / 1e6:,.1f}M parameters, {shape.layers} layers "
             f"(from {folder}/config.json)", "  GPU memory per rank (estimate; CUDA context and allocator slack "
             "not included):"]
    lines += [f"    {name:<58} {gib:8.2f} GiB" for name, gib in memory.items()]
    lines.append(f"    {'total':<58} {sum(memory.values()):8.2f} GiB")
    checkpointing = cfg.model.enable_gradient_checkpointing
    other = activation_bytes(shape, micro_batch_tokens(cfg), not checkpointing) / GIB
    lines.append(f"  activations of {micro_batch_tokens(cfg)} tokens per micro-batch; with "
                 f"model.enable_gradient_checkpointing={str(not checkpointing).lower()} they would take {other:.2f} GiB")
    return lines


def preflight(cfg: Config, nproc: int, nnodes: int) -> tuple[list[str], list[str]]:
    """(report lines, problems)."""
    from sfttrain.distributed import check_world

    world = nproc * nnodes
    dp_size = world // cfg.ulysses_sequence_parallel_size
    problems: list[str] = []
    try:
        check_world(cfg, world)
    except ConfigError as e:
        problems.append(str(e))
    lines = [f"sfttrain plan: {nnodes} node(s) x {nproc} rank(s)"]
    lines += batch_section(cfg, dp_size, problems)
    lines += memory_section(cfg, dp_size, problems)
    return lines, problems


def main(argv: list[str] | None = None) -> int:
    from sfttrain.run import parse_args as parse_config_args

    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    yaml_path, overrides = parse_config_args(rest)
    try:
        cfg = load_config(yaml_path, overrides)
    except UserError as e:
        print(f"sfttrain plan: {e.kind}: {e}")
        return 2
    lines, problems = preflight(cfg, args.nproc, args.nnodes)
    print("\n".join(lines))
    print("\n".join(["problems:"] + [f"  - {p}" for p in problems]) if problems else "no problems found")
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
