"""The schema: every key with its default and its help (the field's metadata, which `--help` prints)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Optional

from omegaconf import ListConfig

DTYPES = ("fp32", "bf16", "fp16")
LOGGERS = ("console", "wandb")  # trainer.logger, one or a list (sfttrain.metrics)
AUTO_ON_OFF = ("auto", True, False)


def key(default: Any = None, text: str = "", factory: Optional[Callable[[], Any]] = None,
        choices: tuple = (), minimum: Optional[int] = None) -> Any:
    """A schema field with its help, its choices and its least value beside its default."""
    metadata = {"help": text, "choices": choices, "minimum": minimum}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class MultiturnConfig:
    enable: bool = key(False, "rows are conversations (messages_key), loss on the assistant turns")
    messages_key: Any = key("messages", "column of [{role, content}] messages (or their JSON), or a list of columns "
                                        "joined into one conversation, e.g. [prompt,completion] (TRL's form)")
    tools_key: Optional[str] = key("tools", "column of tool schemas passed as the template's tools=, if present")
    enable_thinking_key: Optional[str] = key("enable_thinking", "bool column passed as enable_thinking=, if present")
    system_key: Optional[str] = key("system", "column of a system prompt put first (ShareGPT), if present")


@dataclass
class DataConfig:
    train_files: Any = key(None, "Parquet, JSON Lines, JSON, CSV/TSV or Arrow files: a file, a directory, a "
                                 "pattern, a save_to_disk folder, or a list of these (README: Your own data)")
    val_files: Any = key(None, "optional; validation reads all of it")
    prompt_key: Any = key("question", "the prompt's column, or a list of columns whose non-empty texts are joined a "
                                      "line apart (Alpaca's [instruction,input]); null: none, the response column is "
                                      "the whole text and every token is trained (with apply_chat_template=false)")
    response_key: str = key("answer", "the response's column (the supervised tokens)")
    prompt_dict_keys: Optional[list[str]] = key(None, "verl's nested keys: row[prompt_key][k0][k1]...")
    response_dict_keys: Optional[list[str]] = key(None, "the same for the response column")
    train_batch_size: int = key(256, "GLOBAL batch in samples per optimizer step", minimum=1)
    micro_batch_size_per_gpu: int = key(4, "samples per forward/backward on one data-parallel rank", minimum=1)
    max_token_len_per_gpu: Optional[int] = key(None, "if set, micro-batches are token budgets instead")
    use_dynamic_bsz: Optional[bool] = key(None, "verl's switch: true packs micro-batches up to max_token_len_per_gpu "
                                                "(which must be set), false runs micro_batch_size_per_gpu samples; "
                                                "null: max_token_len_per_gpu decides")
    pad_to_multiple: int = key(128, "packed rows are padded to a multiple of this: whole GEMM tiles, and few "
                                    "distinct shapes", minimum=1)
    max_length: int = key(1024, "tokens per sample (prompt + response)")
    allow_beyond_max_position: bool = key(False, "allow max_length above the positions the model was trained on")
    truncation: str = key("error", "a sample over max_length: refused, or cut on that side",
                          choices=("error", "left", "right"))
    apply_chat_template: bool = key(True, "render the prompt as one user turn, generation prompt on")
    chat_template: Optional[str] = key(None, "replaces the tokenizer's chat template: a file, or the Jinja text")
    multiturn: MultiturnConfig = field(default_factory=MultiturnConfig)
    shuffle: bool = key(True, "per-epoch order from trainer.seed and the epoch")
    num_workers: int = key(0, "> 0: worker processes build the steps ahead of the loop (per rank)", minimum=0)
    balance_dp_token: bool = key(True, "verl key; sfttrain always balances tokens across ranks (false is refused)")
    no_loss_rows: str = key("error", "rows truncation leaves without a supervised token: refused (naming them) or "
                                     "dropped", choices=("error", "drop"))
    length_cache_dir: Optional[str] = key(None, "where the start-up scan keeps each row's token counts; null: the "
                                                "run folder's row_stats/. A folder shared by a sweep's runs (and "
                                                "the preflight) renders the data once")


@dataclass
class FSDPConfig:
    model_dtype: str = key("fp32", "dtype of the master weights and optimizer state", choices=DTYPES)
    mixed_precision: Any = key(True, "true: bf16 compute, fp32 reduce; false: compute in model_dtype; or verl's "
                                     "{param_dtype, reduce_dtype, buffer_dtype}")
    sharding_strategy: str = key("FULL_SHARD", "NO_SHARD is DDP: every rank holds the whole model, for one that "
                                               "fits a GPU with its gradients and AdamW state",
                                 choices=("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"))
    fsdp_size: int = key(-1, "shard group size; -1: all data-parallel ranks (HSDP below that; 1: DDP)")
    cpu_offload: bool = key(False, "offload parameters, gradients and optimizer state to CPU")
    offload_params: bool = key(False, "verl's spelling of cpu_offload")
    backward_prefetch: Optional[str] = key("BACKWARD_PRE", "FSDP2 always prefetches in backward")
    forward_prefetch: bool = key(False, "prefetch the next layer's all-gather in forward (sharded models)")
    wrap_policy: Any = key(None, "verl key; sfttrain shards every decoder layer")

    def offloaded(self) -> bool:
        return self.cpu_offload or self.offload_params


@dataclass
class ModelConfig:
    partial_pretrain: Optional[str] = key(None, "a local Hugging Face model folder, or a hub id (downloaded once)")
    random_init: bool = key(False, "build from the folder's config.json with random weights")
    trust_remote_code: bool = key(False, "run the model folder's own Python code (only folders you trust)")
    strategy: str = key("fsdp2", "verl key; sfttrain implements FSDP2 only")
    enable_gradient_checkpointing: bool = key(True, "recompute each layer in backward: less memory, more compute")
    gradient_checkpointing_ratio: float = key(1.0, "share of the layers recomputed, spread evenly (0.5: every other)")
    recompute_attention: Any = key("auto", "with checkpointing: true recomputes attention too; false keeps its "
                                           "output (one hidden state per token and layer); auto: false from "
                                           "max_length 8192, where attention is much of the step",
                                 choices=AUTO_ON_OFF)
    recompute_qkv: bool = key(True, "with checkpointing and fused projections: false keeps the fused q/k/v "
                                    "output, so backward does not rerun that GEMM (more memory)")
    attn_implementation: str = key("auto", "the attention kernel; auto: the first of the others that runs here",
                                   choices=("auto", "flash_attn", "torch_varlen", "sdpa_blockmask"))
    use_liger: bool = key(False, "Liger's fused RMSNorm/SwiGLU/RoPE and linear cross-entropy")
    compile: bool = key(False, "torch.compile each decoder layer (compiled once, shared by the layers)")
    compile_cpp_wrapper: Any = key("auto", "with compile on CUDA: launch kernels from inductor's C++ wrapper "
                                           "(true; cheaper launches, longer start-up) or its Python one; auto: C++ "
                                           "where it can build and launches matter (docs/benchmarks.md)",
                                 choices=AUTO_ON_OFF)
    fuse_projections: Any = key("auto", "with compile: projections reading one input (q/k/v; gate/up) run as one "
                                        "GEMM; auto: with LoRA, where it gains (docs/benchmarks.md)",
                                choices=AUTO_ON_OFF)
    fold_lora: Any = key("auto", "with LoRA and fused projections: each adapter's B runs inside its frozen "
                                 "projection's GEMM; auto: wherever it can (no lora_dropout)", choices=AUTO_ON_OFF)
    loss_chunk_tokens: int = key(1024, "tokens per chunk of the linear cross-entropy; larger: a little faster, "
                                       "more peak memory", minimum=1)
    loss_kernel: str = key("auto", "auto: liger where it runs (Triton, CUDA); torch: compiled on CUDA, a second "
                                   "logits buffer", choices=("auto", "liger", "torch"))
    lora_rank: int = key(0, "> 0: train LoRA adapters of this rank on a frozen base", minimum=0)
    lora_alpha: int = key(16, "LoRA scaling: the update is scaled by lora_alpha / lora_rank", minimum=1)
    target_modules: Any = key("all-linear", "all-linear (every linear layer but lm_head) or a list of layer names")
    lora_dropout: float = key(0.0, "dropout on the adapters' input (resumes exactly on the same world size only)")
    base_quant: str = key("none", "with LoRA: the frozen base's linear weights in 4-bit NF4 (QLoRA; torchao, pip "
                                  "install -e '.[fp8]') or float8 e4m3 (float8 GEMMs: H100/H200); embeddings, norms "
                                  "and head stay", choices=("none", "nf4", "fp8"))
    fp8: str = key("off", "torchao's FP8 GEMMs (pip install -e '.[fp8]') in the decoder layers on Hopper/Ada GPUs; "
                          "auto: tensorwise from hidden_size 4096, where it gains",
                   choices=("off", "auto", "tensorwise", "rowwise"))
    fp8_fast_accum_grads: bool = key(True, "with fp8: the gradient GEMMs accumulate in fast mode too; false: "
                                           "torchao's recipe as it is (slower)")
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)

    def fuses_projections(self) -> bool:
        """auto fuses with LoRA only: its skinny GEMMs gain, full fine-tuning loses (docs/benchmarks.md)."""
        if self.fuse_projections == "auto":
            return self.compile and self.lora_rank > 0
        return self.fuse_projections

    def folds_lora(self) -> bool:
        """auto folds wherever the projections are fused and there is no lora_dropout."""
        folds = self.lora_rank > 0 and self.fuses_projections() and self.lora_dropout == 0
        return folds if self.fold_lora == "auto" else self.fold_lora


@dataclass
class OptimConfig:
    optimizer: str = key("adamw", "adamw (fused on CUDA)")
    lr: float = key(1e-5, "peak learning rate, reached after the warmup", minimum=0)
    betas: list[float] = key(text="AdamW's (beta1, beta2)", factory=lambda: [0.9, 0.95])
    eps: float = key(1e-8, "AdamW's epsilon", minimum=0)
    weight_decay: float = key(0.01, "not applied to norms and biases (< 0 would grow the weights)", minimum=0)
    lr_warmup_steps_ratio: float = key(0.1, "linear warmup over this share of the total steps")
    lr_warmup_steps: int = key(-1, "if > 0, overrides the ratio")
    lr_scheduler: str = key("cosine", "the LR after the warmup", choices=("cosine", "constant"))
    min_lr_ratio: float = key(0.0, "the cosine decays to lr * min_lr_ratio")
    clip_grad: float = key(1.0, "max global gradient norm; <= 0: no clipping")


@dataclass
class TrainerConfig:
    default_local_dir: str = key("checkpoints/${trainer.project_name}/${trainer.experiment_name}", "the run folder")
    project_name: str = key("sfttrain", "wandb project; part of the default run folder")
    experiment_name: str = key("run", "wandb run name; part of the default run folder")
    total_epochs: int = key(1, "passes over the training data (unless total_training_steps is set)", minimum=1)
    total_training_steps: Optional[int] = key(None, "if set (>= 1), stops and schedules the LR here, before or past "
                                                    "the end of total_epochs", minimum=1)
    logger: Any = key("console", "console | wandb | a list of them (metrics.jsonl is always written)")
    seed: int = key(1, "data order and random init", minimum=0)
    test_freq: int = key(-1, "validate every N steps and at the end; -1 (or 0): at the end only")
    save_freq: int = key(-1, "checkpoint every N steps and at the end; -1 (or 0): at the end only")
    max_ckpt_to_keep: Optional[int] = key(None, "keep this run's newest N checkpoints; null (or 0, as in verl): all")
    save_on_sigterm: bool = key(True, "a SIGTERM (time limit, preemption) saves the step in flight and exits with "
                                      "code 8; false: the rank dies at once")
    async_save: bool = key(True, "periodic saves written in the background from a copy taken at the step boundary "
                                 "(one per save in flight, on the GPU or in host memory: async_save_in_flight, "
                                 "async_save_staging); the final save is waited for")
    async_save_pinned: bool = key(True, "CUDA: stage into pinned host buffers, allocated once and reused")
    async_save_in_flight: int = key(2, "saves staged or being written at once, each holding a copy of the shard; "
                                       "more wait for the oldest write", minimum=1)
    async_save_writer: str = key("auto", "process: a writer per rank, no GIL shared with the loop; auto: process on "
                                         "CUDA, thread on CPU", choices=("auto", "process", "thread"))
    async_save_staging: str = key("auto", "device: a GPU copy (milliseconds); host: the step waits for the copy; auto: "
                                          "device where GPU memory holds every save in flight",
                                  choices=("auto", "device", "host"))
    save_thread_count: int = key(4, "writer threads per rank for a checkpoint's DCP files", minimum=1)
    resume_mode: str = key("auto", "auto: the run folder's latest checkpoint, else resume_from_path, else a fresh "
                                   "start; disable: a fresh start; resume_path: resume_from_path",
                           choices=("auto", "disable", "resume_path"))
    resume_from_path: Optional[str] = key(None, "a checkpoint, or a run folder (its latest checkpoint)")
    save_hf: bool = key(False, "also export the final model to <final checkpoint>/huggingface")
    log_freq: int = key(1, "a console line every N steps (metrics.jsonl gets every step)", minimum=1)
    nnodes: Optional[int] = key(None, "verl key; if given, must match torchrun's world")
    n_gpus_per_node: Optional[int] = key(None, "verl key, see nnodes")
    device: str = key("auto", "auto: cuda where torch sees a GPU", choices=("auto", "cuda", "cpu"))
    nccl_timeout: int = key(1800, "seconds a collective waits for the other ranks before the run stops naming "
                                  "each rank's phase; also bounds a checkpoint's write", minimum=1)
    resume_allow_data_change: bool = key(False, "resume although the data's fingerprint changed")
    profile_steps: Optional[list[int]] = key(None, "consecutive steps to profile, e.g. [11, 12, 13]: traces and a "
                                                   "summary in <run folder>/profile/")
    profile_memory: bool = key(False, "with profile_steps on CUDA: also record the allocator's history (a snapshot "
                                      "for pytorch.org/memory_viz)")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ulysses_sequence_parallel_size: int = key(1, "ranks sharing each packed row, attention heads split over them")
    use_remove_padding: bool = key(True, "verl key; sfttrain is always padding-free")
    load_problems: ClassVar[tuple[str, ...]] = ()  # what the load found (unknown keys): not a key, listed by checks

    def micro_batch_tokens(self) -> int:
        """Tokens of the largest micro-batch on one rank (split over the sequence-parallel group)."""
        d = self.data
        tokens = d.max_token_len_per_gpu or d.micro_batch_size_per_gpu * d.max_length
        return tokens // self.ulysses_sequence_parallel_size


def schema_fields(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """Every key of the schema with its field, depth first in the order the schema declares them."""
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from schema_fields(type(default), f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f


def value_of(cfg: Config, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), cfg)


@functools.cache
def default_of(key: str) -> Any:
    """The schema's default of a dotted key."""
    return value_of(Config(), key)


def logger_names(t: TrainerConfig) -> list[str]:
    return [t.logger] if isinstance(t.logger, str) else list(t.logger)


def shard_group_size(f: FSDPConfig, dp_size: int) -> int:
    """Ranks that share one copy of the weights, each holding a shard (1 with NO_SHARD: all of it)."""
    if f.sharding_strategy == "NO_SHARD":
        return 1
    return dp_size if f.fsdp_size in (-1, 0) else f.fsdp_size


def as_list(value: Any) -> list[str]:
    """A path or a list of paths as a list of str."""
    if value is None:
        return []
    if isinstance(value, (list, tuple, ListConfig)):
        return [str(v) for v in value]
    return [str(value)]


def short(value: Any, limit: int = 60) -> str:
    """A value for a message, cut to one short line (a chat template's text may be kilobytes)."""
    text = repr(value).replace("\\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "...'"
