"""The one configuration schema: defaults, verl-compatible keys, validation, overrides.

Precedence: defaults <- YAML file <- command-line `key=value` overrides (Hydra's `+key=value`
too). Every key lives in a dataclass below with its default and a comment; an unknown key is an
error that names the closest known one, and omegaconf type-checks every value. verl keys that
mean nothing here are accepted with one line each saying why they are ignored (IGNORED_VERL_KEYS).
Batch arithmetic that needs the world size is checked in `sfttrain.data.batching`.
"""

from __future__ import annotations

import difflib
import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from omegaconf.nodes import StringNode
from yaml import YAMLError, safe_load

from sfttrain.errors import ConfigError  # raised by every module; imported from here by most


@dataclass
class MultiturnConfig:
    enable: bool = False  # rows are conversations (messages_key) instead of prompt/response; loss on assistant turns
    # column of [{role, content, ...}] (system/user/assistant/tool), or its JSON; or a list of columns
    # whose lists are joined into one conversation, e.g. [prompt,completion] (TRL's prompt-completion form)
    messages_key: Any = "messages"
    tools_key: Optional[str] = "tools"  # column of tool schemas for the template's tools=, used where the file has it
    enable_thinking_key: Optional[str] = "enable_thinking"  # bool column passed as enable_thinking= (Qwen3), if present
    # column of a system prompt put before the conversation (ShareGPT files as LLaMA-Factory reads them), if present
    system_key: Optional[str] = "system"


@dataclass
class DataConfig:
    # a Parquet, JSON Lines, JSON, CSV/TSV or Arrow file, a directory of them, a pattern of them
    # (data/train-*.parquet), a folder datasets' save_to_disk wrote, or a list of these (README: Your own data)
    train_files: Any = None
    val_files: Any = None  # optional; validation runs over all of it, nothing dropped
    # the column holding the prompt; null: none, the response column is the whole text and every token
    # is trained (raw text, with data.apply_chat_template=false)
    prompt_key: Optional[str] = "question"
    response_key: str = "answer"  # the column holding the response (the supervised tokens)
    prompt_dict_keys: Optional[list[str]] = None  # verl's nested keys: row[prompt_key][k0][k1]... (prompt_key=null: refused)
    response_dict_keys: Optional[list[str]] = None  # the same for the response column
    train_batch_size: int = 256  # GLOBAL batch in samples per optimizer step
    micro_batch_size_per_gpu: int = 4  # samples per forward/backward on one data-parallel rank
    max_token_len_per_gpu: Optional[int] = None  # if set, micro-batches are token budgets instead
    # verl's switch between the two (its new SFT trainer's key): true packs micro-batches up to
    # max_token_len_per_gpu tokens (which must be set), false runs micro_batch_size_per_gpu samples
    # (max_token_len_per_gpu must not be); null: max_token_len_per_gpu decides, as above
    use_dynamic_bsz: Optional[bool] = None
    # packed rows are padded to a multiple of this by a masked dummy segment (<= 127 wasted tokens
    # per micro-batch): whole GEMM tiles, and a small set of shapes instead of a new one every step
    pad_to_multiple: int = 128
    max_length: int = 1024  # tokens per sample (prompt + response)
    # max_length above the model's max_position_embeddings trains positions the model never saw
    # (its RoPE was not trained there): refused at start-up unless this is true
    allow_beyond_max_position: bool = False
    truncation: str = "error"  # error | left | right
    apply_chat_template: bool = True  # render the prompt as one user turn, generation prompt on
    # the tokenizer's chat template replaced: a file (.jinja or any existing path) or the Jinja text (refused
    # with apply_chat_template=false outside multiturn, where no template renders)
    chat_template: Optional[str] = None
    multiturn: MultiturnConfig = field(default_factory=MultiturnConfig)  # verl's multi-turn chat keys
    shuffle: bool = True  # per-epoch order from trainer.seed and the epoch number
    num_workers: int = 0  # >0: worker processes build the steps ahead of the training loop (per rank)
    balance_dp_token: bool = True  # verl key; sfttrain always balances tokens across ranks (false is refused)
    no_loss_rows: str = "error"  # rows truncation leaves with no supervised token: error (stop, naming them) | drop
    # where the start-up scan keeps every row's token counts, one file per data fingerprint (the files, their
    # modification times, the tokenizer, template and rendering keys): null, the run folder's row_stats/ (a
    # resume reads them); a folder the runs of a sweep share (e.g. ~/.cache/sfttrain/row_stats) renders the
    # data once for all of them, and the preflight (sfttrain.plan) reads and fills it too
    length_cache_dir: Optional[str] = None


@dataclass
class FSDPConfig:
    model_dtype: str = "fp32"  # dtype of the master weights and optimizer state
    mixed_precision: Any = True  # true: bf16 compute, fp32 reduce; false: compute in model_dtype
    # FULL_SHARD | SHARD_GRAD_OP | HYBRID_SHARD | NO_SHARD (DDP, as fsdp_size=1: every rank holds the
    # whole model, nothing gathered per layer, gradients all-reduced during backward; for a model whose
    # weights, gradients and AdamW state fit one GPU)
    sharding_strategy: str = "FULL_SHARD"
    fsdp_size: int = -1  # shard group size; -1 = all data-parallel ranks (HSDP below that; 1: DDP)
    cpu_offload: bool = False  # offload parameters, gradients and optimizer state to CPU
    offload_params: bool = False  # verl's spelling of the same switch
    backward_prefetch: Optional[str] = "BACKWARD_PRE"  # FSDP2 always prefetches in backward
    forward_prefetch: bool = False  # explicitly prefetch the next layer's all-gather in forward (sharded models only)
    wrap_policy: Any = None  # verl key; sfttrain shards every decoder layer, see parallel.py

    def offloaded(self) -> bool:
        return self.cpu_offload or self.offload_params


@dataclass
class ModelConfig:
    partial_pretrain: Optional[str] = None  # a local Hugging Face model folder, or a hub id (org/name: downloaded once)
    random_init: bool = False  # build from the folder's config.json with random weights
    trust_remote_code: bool = False  # run the model folder's own Python code (only for folders you trust)
    strategy: str = "fsdp2"  # verl key; sfttrain implements FSDP2 only (fsdp, FSDP1, is refused)
    enable_gradient_checkpointing: bool = True  # recompute each layer in backward: less memory, ~1/3 more compute
    # share of the decoder layers whose activations are recomputed (spread evenly; 0.5: every other layer), the
    # rest kept; with enable_gradient_checkpointing (another value without it is refused, as recompute_attention's)
    gradient_checkpointing_ratio: float = 1.0
    # with checkpointing: true recomputes attention in backward too; false keeps each checkpointed layer's
    # attention output (one more hidden state per token and layer) so that attention runs once; auto: false for
    # samples of data.max_length >= 8192 tokens, where attention is much of the step (sfttrain/recompute.py).
    # Compiled, true leaves the layers on inductor's Python wrapper (compile_cpp_wrapper): a small model's
    # host-bound step can run faster with false (W1 with checkpointing: +7.2% for +0.5 GiB, run BQ)
    recompute_attention: Any = "auto"
    # with checkpointing, compiled layers and fused projections (fuse_projections): false keeps each
    # checkpointed layer's fused q/k/v GEMM output (q, k and v widths a token: 1.5 hidden states on
    # Llama-3-8B, 3 GiB at 8192 tokens over its 32 layers) so that backward does not run that GEMM again;
    # true recomputes it with the rest of the layer (the least memory; sfttrain/recompute.py). Not with fp8,
    # whose linear layers are not fused
    recompute_qkv: bool = True
    attn_implementation: str = "auto"  # auto | flash_attn | torch_varlen | sdpa_blockmask
    use_liger: bool = False  # Liger's fused RMSNorm/SwiGLU/RoPE and fused linear cross-entropy
    compile: bool = False  # torch.compile each decoder layer (dynamic shapes; compiled once, shared by the layers)
    # with compile on CUDA, who launches the compiled layers' kernels: inductor's C++ wrapper (true) or its
    # Python one (false: tens of us per launch). auto: C++ for micro-batches up to 65536 tokens (W1: 11%
    # faster; its build adds ~1 min of start-up), Python for longer ones (steps of seconds: launches cost
    # nothing; at 131072 tokens the C++ one crashed), with FP8, and for checkpointed layers that rerun
    # attention (recompute_attention true or auto with short samples, or LoRA on a MoE: the C++ one cannot
    # build them); docs/benchmarks.md. true or false needs compile=true (refused without); true on CPU is
    # said and ignored (the Python wrapper there)
    compile_cpp_wrapper: Any = "auto"
    # with compile: the projections that read one input (q/k/v; gate/up; with LoRA their adapters' A too)
    # run as one GEMM each (sfttrain/fuse_projections.py). auto: with LoRA (W1: +3.4%), but groups of frozen
    # weights over 32 MiB a layer stay apart (their copy costs more than the launches saved); not for full
    # fine-tuning (W1: -2.6%). true: every group
    fuse_projections: Any = "auto"
    # with LoRA and fused projections: each adapter's B runs inside its frozen projection's GEMM, over the
    # input widened by the adapters' A outputs (sfttrain/lora_fold.py): the same sums, without a second
    # output of the projection's size written and read. auto: wherever projections are fused with LoRA,
    # without lora_dropout (W1 LoRA 158.7k real tokens/s folded against 120.1k unfolded in one call, run
    # CG; a layer's seven projections -14% GPU time in a microbenchmark, CD). true: the same, refused where
    # it folds nothing
    fold_lora: Any = "auto"
    # tokens per chunk of sfttrain's linear cross-entropy: a chunk's logits are held at once (chunk x
    # vocab in bf16; twice that with loss_kernel=torch); larger chunks pass fewer times over the fp32
    # lm_head gradient: a little faster for more peak memory (docs/benchmarks.md)
    loss_chunk_tokens: int = 1024
    # the chunk's softmax-and-gradient kernel: auto (liger where it can run) | liger (Liger's Triton
    # kernel, gradient written over the logits; CUDA) | torch (compiled by inductor on CUDA: a second
    # [chunk, vocab] buffer and slower per chunk, bench/loss_kernel.py)
    loss_kernel: str = "auto"
    lora_rank: int = 0  # > 0: train peft LoRA adapters of this rank on a frozen base (sfttrain/lora.py)
    # LoRA scaling numerator: the adapter's update is scaled by lora_alpha / lora_rank. This key, target_modules
    # and lora_dropout are read only with lora_rank > 0 (set with lora_rank=0: a NOTE line at start-up)
    lora_alpha: int = 16
    target_modules: Any = "all-linear"  # all-linear (every linear layer but lm_head) or a list of layer names
    lora_dropout: float = 0.0  # dropout on the adapters' input (random: resumes exactly on the same world size only)
    # FP8 GEMMs (CUDA, compute capability >= 8.9: Hopper, Ada) for the decoder layers' linear layers,
    # torchao's float8 training (pip install -e '.[fp8]'; sfttrain/fp8.py): off | tensorwise (one scale
    # per tensor; weights all-gathered in FP8 under FSDP) | rowwise (a scale per row) | auto (tensorwise
    # where the layers are large enough to gain, hidden_size >= 4096; off below). Master weights,
    # optimizer state and checkpoints are those of a run without it
    fp8: str = "off"
    # model.fp8: the two gradient GEMMs (input and weight gradients) accumulate in the FP8 tensor
    # cores' fast mode too, as torchao's recipes do for the forward GEMM only; false: torchao's recipe
    # as it is (slower; the loss at W2b's step 60 within 1% of bf16's either way: docs/benchmarks.md, AK and AU);
    # false with fp8=off is refused (no FP8 GEMM to set)
    fp8_fast_accum_grads: bool = True
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)

    def fuses_projections(self) -> bool:
        """fuse_projections resolved. auto: with LoRA adapters, whose skinny GEMMs gain from sharing one
        (W1: +3.4% a step); not for full fine-tuning (W1: -2.6%; the likely cause, not profiled: each
        step concatenates the fp32 master weights and splits their gradient back). docs/benchmarks.md,
        runs BJ and BK."""
        if self.fuse_projections == "auto":
            return self.compile and self.lora_rank > 0
        return self.fuse_projections

    def folds_lora(self) -> bool:
        """fold_lora resolved: auto folds wherever LoRA's projections are fused and the adapters read
        the frozen projection's input (no lora_dropout: A reads a dropped-out copy of it)."""
        folds = self.lora_rank > 0 and self.fuses_projections() and self.lora_dropout == 0
        return folds if self.fold_lora == "auto" else self.fold_lora


@dataclass
class OptimConfig:
    optimizer: str = "adamw"  # adamw (fused on CUDA)
    lr: float = 1e-5  # peak learning rate, reached after the warmup
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's (beta1, beta2)
    eps: float = 1e-8  # AdamW's epsilon
    weight_decay: float = 0.01  # not applied to norms and biases (1-D tensors; verl decays every parameter)
    # linear warmup over this share of the total steps: step k of W at lr * k / W (verl's: (k - 1) / W, the first at 0)
    lr_warmup_steps_ratio: float = 0.1
    lr_warmup_steps: int = -1  # if > 0, overrides the ratio
    lr_scheduler: str = "cosine"  # cosine | constant
    min_lr_ratio: float = 0.0  # the cosine decays to lr * min_lr_ratio (constant: unread, a NOTE line at start-up)
    clip_grad: float = 1.0  # max global grad norm; <= 0 disables clipping


@dataclass
class TrainerConfig:
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"  # the run folder
    # wandb project; part of the default run folder (with neither: a NOTE line at start-up)
    project_name: str = "sfttrain"
    experiment_name: str = "run"  # wandb run name; part of the default run folder
    total_epochs: int = 1  # passes over the training data (unless total_training_steps is set)
    # if set (>= 1), stops (and schedules the LR) here, before the end of trainer.total_epochs or past it (the start-up's
    # "total steps" line says which; verl's trainers stop at the end of total_epochs where this lies past it)
    total_training_steps: Optional[int] = None
    logger: Any = "console"  # console | wandb | a list of them
    seed: int = 1  # data order and random init
    # validate every N steps (and always at the end); -1 (or 0): only at the end; without data.val_files: unread
    # (a NOTE line at start-up)
    test_freq: int = -1
    save_freq: int = -1  # checkpoint every N steps (and always at the end); -1 (or 0): only at the end
    # keeps this run's newest N committed checkpoints (another run's in the folder are not counted); null keeps
    # every one, and so does 0, as in verl (said at start-up: 0 reads like "keep none")
    max_ckpt_to_keep: Optional[int] = None
    # a SIGTERM during training (a scheduler's time limit or preemption, kill, torchrun passing one on) saves the
    # step in flight and ends the run with exit code 8; false: the rank dies at once (sfttrain/stop_signal.py)
    save_on_sigterm: bool = True
    # periodic saves written in the background from a copy of this rank's model/optimizer shard taken at the step
    # boundary (one per save in flight, on the GPU or in host memory: async_save_in_flight, async_save_staging);
    # false: the step waits for each write, and the async_save_* keys below are unread (set: a NOTE line at
    # start-up). The final save is waited for either way
    async_save: bool = True
    # CUDA, async_save: stage into pinned host buffers allocated once per staging slot (after step 1: a one-time
    # pause, said in the line on where saves stage) and reused by the later saves in it (the device-to-host copy
    # at full speed)
    async_save_pinned: bool = True
    # async_save: saves staged or being written at once, each holding a copy of this rank's shard (on the GPU or
    # in host memory: async_save_staging; fewer where that memory holds fewer: said after the first step); saves
    # due faster than the disk writes them queue up to this many, then a save waits for the oldest write
    async_save_in_flight: int = 2
    # async_save: where the background writes run: process (one writer process per rank, sharing no GIL with
    # the training loop's kernel launches), thread (in the training process), auto (process on CUDA, thread on CPU)
    async_save_writer: str = "auto"
    # async_save: where a save's copy is taken before the step goes on: device (a copy on the GPU, milliseconds;
    # the writer copies it to host memory while training goes on; GPU memory per save in flight), host (straight
    # to host memory: the step waits for the copy, and for page locking the first time a slot is used), auto
    # (device on CUDA where its free memory after the first step holds every save in flight, else host)
    async_save_staging: str = "auto"
    save_thread_count: int = 4  # writer threads per rank for a checkpoint's DCP shards (one file each)
    # auto: the run folder's latest checkpoint, else resume_from_path (seeding a run folder without checkpoints), else
    # a fresh start | disable: a fresh start (resume_from_path refused) | resume_path: resume_from_path
    resume_mode: str = "auto"
    resume_from_path: Optional[str] = None  # a checkpoint, or a run folder (its latest checkpoint)
    save_hf: bool = False  # at the end of training, also export the model to <final checkpoint>/huggingface
    log_freq: int = 1  # console line every N >= 1 steps (metrics.jsonl always gets every step)
    nnodes: Optional[int] = None  # verl keys; if given they must match torchrun's world
    n_gpus_per_node: Optional[int] = None  # verl key, see nnodes
    device: str = "auto"  # auto | cuda | cpu
    # seconds a collective may wait for the other ranks before the job stops (verl's nccl_timeout);
    # each rank then says which phase it was in (start-up, step N, validation, save); also the longest a
    # checkpoint's write may run, unless its rank's share takes longer at 20 MB/s (one stuck longer, on a
    # filesystem that stopped answering, stops the run)
    nccl_timeout: int = 1800
    # resume although the checkpoint's data fingerprint differs (new rows/order); refused with resume_mode=disable
    resume_allow_data_change: bool = False
    # consecutive steps to profile with torch.profiler, e.g. [11, 12, 13]: a Chrome trace per rank and a summary
    # (kernel time by kind, idle gaps, top kernels) in <run folder>/profile/ (sfttrain.profiling)
    profile_steps: Optional[list[int]] = None
    # with profile_steps, on CUDA: also record the allocator's history over them, saved as a snapshot (for
    # https://pytorch.org/memory_viz), and the summary lists what the window's peak holds (slows the host)
    profile_memory: bool = False


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ulysses_sequence_parallel_size: int = 1  # ranks sharing each packed row, attention heads split over them (Ulysses)
    use_remove_padding: bool = True  # verl key; sfttrain is always padding-free

    def micro_batch_tokens(self) -> int:
        """Tokens of the largest micro-batch on one rank (split over the sequence-parallel group)."""
        d = self.data
        return (d.max_token_len_per_gpu or d.micro_batch_size_per_gpu * d.max_length) // self.ulysses_sequence_parallel_size


# verl spellings accepted as synonyms: old key -> schema key.
ALIASES = {
    "trainer.save_interval": "trainer.save_freq",
    "optim.warmup_steps_ratio": "optim.lr_warmup_steps_ratio",
    "optim.warmup_style": "optim.lr_scheduler",
    "model.ulysses_sequence_parallel_size": "ulysses_sequence_parallel_size",  # verl's actor/model block spelling
    "model.use_remove_padding": "use_remove_padding",
}

# verl keys that have no meaning here, accepted so that verl's own scripts run as they are; each
# one is dropped with a line that says so and why (a key that is neither here nor in the schema
# stays an error).
IGNORED_VERL_KEYS = {
    "trainer.default_hdfs_dir": "verl copies each checkpoint to HDFS; sfttrain writes checkpoints to "
                                "trainer.default_local_dir only (copy that folder with your own tool)",
    "data.micro_batch_size": "verl's deprecated global micro-batch, which its SFT trainer never reads either; "
                             "the micro-batch is data.micro_batch_size_per_gpu",
    "data.use_shm": "verl copies the data files through /dev/shm; sfttrain streams them where they are",
    "data.processor": "verl's processor settings for image data (data.image_key); images are not trained here",
    "model.use_shm": "verl copies the model to /dev/shm before loading it; sfttrain reads model.partial_pretrain "
                     "where it is",
}

# Keys of verl's own sft_trainer.yaml that name something sfttrain does not have: null (their value
# there) means none, and is dropped with a line as IGNORED_VERL_KEYS are; a value is refused with why,
# as it would be ignored (it was an unknown key, whose suggestion misled: model.external_lib "did you
# mean model.use_liger?").
NULL_ONLY_VERL_KEYS = {
    "data.custom_cls": "verl's custom Dataset class; sfttrain reads the forms of rows in the README (Your own data): "
                       "convert the data to one of them",
    "data.image_key": "images are not trained here (text-only causal LMs)",
    "model.external_lib": "verl imports that module to register a custom model; sfttrain loads Hugging Face model "
                          "folders (model.trust_remote_code=true runs a folder's own code)",
    "trainer.resume_path": "verl's former resume key: use trainer.resume_mode=resume_path "
                           "trainer.resume_from_path=<checkpoint or run folder>",
}

# Keys whose value may be a nested dict of their own (validated where they are used).
FREE_FORM = ("model.fsdp_config.mixed_precision", "model.fsdp_config.wrap_policy")

DTYPES = ("fp32", "bf16", "fp16")
TRUNCATION_MODES = ("error", "left", "right")  # data.truncation (sfttrain.data.render)
LOSS_KERNELS = ("auto", "liger", "torch")  # model.loss_kernel (sfttrain.loss.select_chunk_loss)
LOGGERS = ("console", "wandb")  # trainer.logger (sfttrain.metrics)
FP8_MODES = ("off", "auto", "tensorwise", "rowwise")  # model.fp8 (sfttrain.fp8)
WRITERS = ("auto", "process", "thread")  # trainer.async_save_writer (sfttrain.checkpoint_writer)
STAGINGS = ("auto", "device", "host")  # trainer.async_save_staging (sfttrain.checkpoint_writer.Staging)


def load_config(yaml_path: Optional[str] = None, overrides: tuple[str, ...] | list[str] = (),
                check: bool = True) -> Config:
    """Defaults <- YAML <- overrides, then validated (`check`; the preflight validates itself, to
    list a bad value beside the other problems). Returns a typed `Config` object."""
    layers = []
    if yaml_path is not None:
        try:
            layers.append(OmegaConf.load(yaml_path))
        except FileNotFoundError:
            raise ConfigError(f"config file {yaml_path!r} does not exist") from None
        except YAMLError as e:
            raise ConfigError(f"config file {yaml_path!r} is not valid YAML: {_yaml_problem(e)}") from None
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must look like key=value, got {bad}")
    merged = OmegaConf.structured(Config)
    layers.append(_dotlist(overrides, merged))

    for layer in layers:
        layer = _apply_aliases(layer)
        _checkpoint_contents(layer)
        _drop_ignored(layer)
        _drop_null_verl_keys(layer)
        _check_known_keys(layer, merged)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            raise ConfigError(_value_problem(e)) from None
    try:
        OmegaConf.resolve(merged)
        cfg: Config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_value_problem(e)) from None
    if check:
        validate(cfg)
    return cfg


def _dotlist(overrides: tuple[str, ...] | list[str], schema: DictConfig) -> DictConfig:
    """`key=value` arguments as one layer. Hydra's `+key` / `++key` (add / force-add) name the same
    key. A value is read as YAML (numbers, lists, null) where YAML reads it; a value that YAML
    cannot parse is the text itself, and so is any value of a string key unless it is quoted or
    null: a chat template on the command line stays the template, unfolded and unparsed. One word
    for a list key is that list of one (data.prompt_dict_keys=question)."""
    layer = OmegaConf.create()
    for item in overrides:
        key, _, text = item.partition("=")
        key = key.lstrip("+")
        try:
            value = safe_load(text)
        except YAMLError:
            value = text
        node = _schema_node(schema, ALIASES.get(key, key))
        if isinstance(node, StringNode) and value is not None and not (isinstance(value, str) and text[:1] in "'\""):
            value = text
        if isinstance(node, ListConfig) and isinstance(value, str):
            value = [value]
        OmegaConf.update(layer, key, value, force_add=True)
    return layer


def _schema_node(schema: DictConfig, key: str) -> Any:
    """The schema's node of a dotted key; None for a key it does not have."""
    node: Any = schema
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return None
        node = node._get_node(part)
    return node


def _drop_ignored(layer: DictConfig) -> None:
    """Removes IGNORED_VERL_KEYS from the layer, saying so once (rank 0) for each."""
    for key, why in IGNORED_VERL_KEYS.items():
        value = OmegaConf.select(layer, key, default="__absent__", throw_on_missing=False)
        if value == "__absent__":
            continue
        parent, _, leaf = key.rpartition(".")
        OmegaConf.select(layer, parent).pop(leaf)
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"sfttrain: ignoring {key}={value!r}: {why}", flush=True)


def _drop_null_verl_keys(layer: DictConfig) -> None:
    """Removes NULL_ONLY_VERL_KEYS that say none (null, or a section of nulls: verl's `custom_cls:
    {path: null, name: null}`), saying so once (rank 0) for each; refuses one with a value."""
    for key, why in NULL_ONLY_VERL_KEYS.items():
        value = OmegaConf.select(layer, key, default="__absent__", throw_on_missing=False)
        if value == "__absent__":
            continue
        plain = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
        if plain not in (None, "", {}, []) and not (isinstance(plain, dict) and all(v is None for v in plain.values())):
            raise ConfigError(f"{key}={plain!r}: {why}; remove the key (or set it to null)")
        parent, _, leaf = key.rpartition(".")
        OmegaConf.select(layer, parent).pop(leaf)
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"sfttrain: ignoring {key}={plain!r} (verl's key, none given): {why}", flush=True)


# verl's trainer.checkpoint.save_contents: what its checkpoints hold (model, optimizer, extra: data
# position and RNG), and hf_model, a Hugging Face copy of the model; load_contents what a resume reads
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")
CHECKPOINT_KEYS = ("trainer.checkpoint.save_contents", "trainer.checkpoint.load_contents")


def _checkpoint_contents(layer: DictConfig) -> None:
    """verl's `trainer.checkpoint` section (in its sft_trainer.yaml, and on command lines as
    `trainer.checkpoint.save_contents=[model,optimizer,extra,hf_model]` for a Hugging Face model):
    sfttrain's checkpoints always hold the model, optimizer and extra state, and hf_model is
    trainer.save_hf=true, so the section is dropped with a line saying that (rank 0); an unknown
    content is refused. It was an unknown key whose suggestion misled (trainer.save_on_sigterm)."""
    section = OmegaConf.select(layer, "trainer.checkpoint", default=None, throw_on_missing=False)
    if not isinstance(section, DictConfig):
        return
    unknown = sorted(set(section.keys()) - {key.rpartition(".")[2] for key in CHECKPOINT_KEYS})
    if unknown:
        raise ConfigError(f"trainer.checkpoint.{unknown[0]}: unknown key; verl's trainer.checkpoint section has "
                          "save_contents and load_contents only")
    raw = OmegaConf.to_container(section, resolve=False)  # load_contents is ${trainer.checkpoint.save_contents}
    saved = raw.get("save_contents")
    contents = [saved] if isinstance(saved, str) else list(saved or [])
    if bad := [c for c in contents if c not in CHECKPOINT_CONTENTS]:
        raise ConfigError(f"trainer.checkpoint.save_contents: {bad} unknown; verl's contents are "
                          f"{list(CHECKPOINT_CONTENTS)}")
    layer.trainer.pop("checkpoint")
    if "hf_model" in contents and OmegaConf.select(layer, "trainer.save_hf", default=None) is None:
        OmegaConf.update(layer, "trainer.save_hf", True, force_add=True)
    if int(os.environ.get("RANK", 0)) == 0:
        hf = ("; hf_model is trainer.save_hf=true (set here): the final checkpoint exported into its huggingface/, "
              "any other one by python -m sfttrain.export") if "hf_model" in contents else ""
        print(f"sfttrain: ignoring trainer.checkpoint ({', '.join(f'{k}={v}' for k, v in raw.items())}): sfttrain's "
              f"checkpoints always hold the model, optimizer and extra state (data position, RNG), and a resume reads "
              f"them all{hf}", flush=True)


def _value_problem(e: OmegaConfBaseException) -> str:
    """omegaconf's message in one line, led by the key (its own runs over several lines)."""
    first_line = str(getattr(e, "msg", None) or e).splitlines()[0]
    key = getattr(e, "full_key", None)
    if not key:
        return f"bad config value: {first_line}"
    return f"bad value for {key}: {first_line}; see python -m sfttrain.run --help"


def _yaml_problem(e: YAMLError) -> str:
    """The parser's problem and its line, without the parser's multi-line context dump."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{getattr(e, 'problem', None) or e}{where}"


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _flat_keys(node: Any, prefix: str = "") -> list[str]:
    if not isinstance(node, DictConfig):
        return [prefix]
    keys = []
    for k in node.keys():
        value = node._get_node(k)
        path = f"{prefix}.{k}" if prefix else str(k)
        keys.extend(_flat_keys(value, path) if isinstance(value, DictConfig) else [path])
    return keys


def _apply_aliases(layer: DictConfig) -> DictConfig:
    for old, new in ALIASES.items():
        value = OmegaConf.select(layer, old, default="__absent__", throw_on_missing=False)
        if value == "__absent__":
            continue
        if OmegaConf.select(layer, new, default="__absent__") != "__absent__":
            raise ConfigError(f"both {old} and {new} are set; {old} is verl's name for {new}: keep one")
        parent, _, leaf = old.rpartition(".")
        node = OmegaConf.select(layer, parent)
        node.pop(leaf)
        OmegaConf.update(layer, new, value, force_add=True)
    return layer


# top-level keys of a Hydra config file (verl's are Hydra's), which sfttrain's plain YAML does not have
HYDRA_ONLY = {"defaults": "Hydra's list of other config files to compose is not read here: put their keys into "
                          "this file itself",
              "hydra": "Hydra's own settings (its output folder, logging, sweeps) mean nothing here: remove the "
                       "hydra section (the run folder is trainer.default_local_dir)"}


def _check_known_keys(layer: DictConfig, schema: DictConfig) -> None:
    """Unknown keys are errors that suggest the closest known key (typos never pass silently), every
    one of the layer's at once."""
    known = set(_flat_keys(schema)) | set(ALIASES)
    unknown = [key for key in _flat_keys(layer)
               if key not in known and not any(key.startswith(k + ".") for k in FREE_FORM)]
    if unknown:  # a Hydra section's keys are one problem
        raise ConfigError("\n".join(dict.fromkeys(_unknown_key(key, known) for key in unknown)))


# keys of verl's PPO/GRPO trainer (its ppo_trainer.yaml), which a seed article's template mixes with
# SFT's: a suggestion of the closest SFT key misled (trainer.critic_warmup: "did you mean trainer.nccl_timeout?")
PPO_SECTIONS = ("actor_rollout_ref", "critic", "reward_model", "algorithm", "custom_reward_function", "ray_init",
                "ray_kwargs")
PPO_KEYS = ("trainer.critic_warmup", "trainer.val_before_train", "trainer.balance_batch", "data.max_prompt_length",
            "data.max_response_length", "data.return_raw_chat", "data.filter_overlong_prompts")


def _unknown_key(key: str, known: set[str]) -> str:
    if (top := key.split(".")[0]) in HYDRA_ONLY:
        return f"{top}: {HYDRA_ONLY[top]}"
    if top in PPO_SECTIONS or key in PPO_KEYS:
        name = top if top in PPO_SECTIONS else key
        return (f"{name}: a key of verl's PPO/GRPO trainer (ppo_trainer.yaml), not of its SFT trainer, which sfttrain "
                "replaces: remove it. A step here is data.train_batch_size samples over all data-parallel ranks, each rank's share "
                "run as micro-batches of data.micro_batch_size_per_gpu (the start-up prints the arithmetic)")
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"unknown config key {key!r}{hint}"


def _choice(key: str, value: Any, choices: tuple) -> Iterator[str]:
    if value not in choices:
        yield f"{key}={value!r} is not one of {list(choices)}"


def validate(cfg: Config) -> None:
    """Refuses the configuration with every problem `config_problems` finds, one a line."""
    problems = config_problems(cfg)
    if problems:
        raise ConfigError("\n".join(problems))


def config_problems(cfg: Config) -> list[str]:
    """Checks that need no world size and no data, each problem with the key to change: all of them, not
    the first only (the run refuses them in one error, the preflight lists each), so a user fixes a
    config in one go. The _validate_* and _check_* functions below yield every problem of their keys.
    One mistake two checks find (a mixed-precision dtype) is said once."""
    problems = [*_validate_data(cfg.data), *_validate_model(cfg.model), *_check_verl_switches(cfg),
                *_check_no_shard(cfg), *_validate_optim(cfg.optim), *_validate_trainer(cfg.trainer),
                *_validate_fp8(cfg), *_sequence_parallel_size_problems(cfg.ulysses_sequence_parallel_size)]
    if not cfg.use_remove_padding:
        problems.append("use_remove_padding=false: sfttrain always trains padding-free (packed rows give the same "
                        "loss as padded ones, without the pad compute); remove the key")
    return list(dict.fromkeys(problems))


def check_sequence_parallel_size(sp: int) -> None:
    for problem in _sequence_parallel_size_problems(sp):
        raise ConfigError(problem)


def _sequence_parallel_size_problems(sp: int) -> Iterator[str]:
    if sp < 1:
        yield f"ulysses_sequence_parallel_size must be >= 1 (1: off), got {sp}"


def _positive(*pairs: tuple[str, Any]) -> Iterator[str]:
    for key, value in pairs:
        if value <= 0:
            yield f"{key} must be positive, got {value}"


def rendering_problems(max_length: int, truncation: str) -> Iterator[str]:
    """data.max_length and data.truncation: checked with the config, and by the renderer that takes them
    (the same words, so the preflight, which goes on past the config's problems, lists each once)."""
    yield from _positive(("data.max_length", max_length))
    if max_length == 1:
        yield "data.max_length=1 leaves no token to train on (a prompt token, then its next); use at least 2"
    yield from _choice("data.truncation", truncation, TRUNCATION_MODES)


def _validate_data(d: DataConfig) -> Iterator[str]:
    if d.train_files in (None, "", []):
        yield ("data.train_files is required: a Parquet, JSON Lines, JSON or CSV file, a directory or a "
               "pattern of them, or a list of these")
    yield from _positive(("data.train_batch_size", d.train_batch_size),
                         ("data.micro_batch_size_per_gpu", d.micro_batch_size_per_gpu),
                         ("data.pad_to_multiple", d.pad_to_multiple))
    yield from rendering_problems(d.max_length, d.truncation)
    yield from _check_dynamic_bsz(d)
    if d.max_token_len_per_gpu is not None and d.max_token_len_per_gpu < d.max_length:
        yield (f"data.max_token_len_per_gpu={d.max_token_len_per_gpu} is below data.max_length="
               f"{d.max_length}: a longest sample would not fit; raise it or lower data.max_length")
    if d.num_workers < 0:
        yield (f"data.num_workers={d.num_workers}: the worker processes a rank builds its steps in are 0 "
               "(built in the rank itself, the default) or more; e.g. data.num_workers=0")
    yield from _choice("data.no_loss_rows", d.no_loss_rows, ("error", "drop"))
    if d.prompt_key is None and not d.multiturn.enable and d.apply_chat_template:
        yield ("data.prompt_key=null trains whole texts without a prompt, which a chat template would "
               "render as an empty user turn: set data.apply_chat_template=false")
    keys = d.multiturn.messages_key
    if not (isinstance(keys, str) and keys or isinstance(keys, (list, tuple, ListConfig)) and keys
            and all(isinstance(k, str) and k for k in keys)):
        yield (f"data.multiturn.messages_key={keys!r}: give a column name, or a list of columns whose "
               "message lists make one conversation, e.g. [prompt,completion]")
    if d.multiturn.enable and not d.apply_chat_template:
        yield ("data.multiturn.enable=true renders conversations with a chat template: remove "
               "data.apply_chat_template=false (data.chat_template=... sets a template of your own)")
    yield from _check_chat_template_used(d)
    yield from _check_dict_keys_have_a_column(d)
    yield from _check_prompt_is_not_the_response(d)


def _check_chat_template_used(d: DataConfig) -> Iterator[str]:
    """A template given for prompt/response rows that no template renders (the raw text is tokenized)
    was read by nothing: which of the two settings was meant?"""
    if d.chat_template is not None and not d.apply_chat_template and not d.multiturn.enable:
        yield (f"data.chat_template={_short(d.chat_template)} with data.apply_chat_template=false: the raw "
               "prompt text is tokenized, so the template would render nothing; remove data.chat_template "
               "for raw text, or remove data.apply_chat_template=false to render prompts with it")


def _check_dict_keys_have_a_column(d: DataConfig) -> Iterator[str]:
    """verl's nested keys follow data.prompt_key's column down; with no prompt column (whole texts)
    they were dropped without a word."""
    if d.prompt_key is None and d.prompt_dict_keys:
        yield (f"data.prompt_dict_keys={list(d.prompt_dict_keys)} with data.prompt_key=null: there is no "
               "prompt column to follow them into; set data.prompt_key to the column that holds them, or "
               "remove data.prompt_dict_keys")


def _check_prompt_is_not_the_response(d: DataConfig) -> Iterator[str]:
    """A prompt read from the response's own cell trained each answer after itself as its prompt, without a
    word. (One column with other nested keys, verl's extra_info with question and answer, is two cells.)"""
    prompt, response = [d.prompt_key, *(d.prompt_dict_keys or [])], [d.response_key, *(d.response_dict_keys or [])]
    if d.prompt_key is not None and not d.multiturn.enable and prompt == response:
        yield (f"data.prompt_key={d.prompt_key!r} and data.response_key={d.response_key!r} read the same cell: each "
               "sample would be its answer after itself as the prompt; set data.response_key to the answers' column "
               "(or data.prompt_dict_keys / data.response_dict_keys to a nested column's two fields)")


def _short(value: Any, limit: int = 60) -> str:
    """A value for a message, cut to one short line (a chat template's text may be kilobytes)."""
    text = repr(value).replace("\\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "...'"


def _check_dynamic_bsz(d: DataConfig) -> Iterator[str]:
    """verl's data.use_dynamic_bsz against data.max_token_len_per_gpu, which alone decides here: each
    value of the switch is refused where the budget says otherwise, rather than one of them ignored (verl
    packs by its default budget of 8192 tokens with the switch on, and ignores a budget with it off)."""
    budget = d.max_token_len_per_gpu
    if d.use_dynamic_bsz is True and budget is None:
        yield (f"data.use_dynamic_bsz=true packs each micro-batch up to data.max_token_len_per_gpu tokens, "
               f"which is not set (verl's default is 8192): set it, at least data.max_length={d.max_length},"
               f" e.g. data.max_token_len_per_gpu={max(8192, d.max_length)}")
    if d.use_dynamic_bsz is False and budget is not None:
        yield (f"data.use_dynamic_bsz=false runs micro-batches of data.micro_batch_size_per_gpu="
               f"{d.micro_batch_size_per_gpu} samples, but data.max_token_len_per_gpu={budget} packs them "
               "by tokens instead (verl ignores it there): remove data.max_token_len_per_gpu for micro-batches "
               "of samples, or set data.use_dynamic_bsz=true for token budgets")


def _validate_model(m: ModelConfig) -> Iterator[str]:
    if m.partial_pretrain in (None, ""):
        yield "model.partial_pretrain is required: a local Hugging Face model folder or a hub id"
    yield from _positive(("model.loss_chunk_tokens", m.loss_chunk_tokens))
    yield from _choice("model.loss_kernel", m.loss_kernel, LOSS_KERNELS)
    yield from _choice("model.compile_cpp_wrapper", m.compile_cpp_wrapper, ("auto", True, False))
    yield from _choice("model.recompute_attention", m.recompute_attention, ("auto", True, False))
    yield from _choice("model.attn_implementation", m.attn_implementation,
                       ("auto", "flash_attn", "torch_varlen", "sdpa_blockmask"))
    if not 0.0 < m.gradient_checkpointing_ratio <= 1.0:
        yield (f"model.gradient_checkpointing_ratio must lie in (0, 1], got {m.gradient_checkpointing_ratio}; "
               "set model.enable_gradient_checkpointing=false to recompute no layer")
    yield from _check_checkpointing_keys(m)
    yield from _validate_compiled_layers(m)
    yield from _validate_fsdp(m.fsdp_config)
    yield from _validate_lora(m)


def _check_checkpointing_keys(m: ModelConfig) -> Iterator[str]:
    """The keys that shape gradient checkpointing (sfttrain/recompute.py) are read only with it on: set
    with it off, they recomputed nothing and the run kept every activation without a word. Their
    defaults (ratio 1.0, auto) mean nothing of their own and pass."""
    if m.enable_gradient_checkpointing:
        return
    for key, value in (("gradient_checkpointing_ratio", m.gradient_checkpointing_ratio),
                       ("recompute_attention", m.recompute_attention)):
        if value != _default_of(f"model.{key}"):
            yield (f"model.{key}={str(value).lower()} shapes gradient checkpointing, which "
                   "model.enable_gradient_checkpointing=false turns off (every activation kept): set "
                   f"model.enable_gradient_checkpointing=true, or remove model.{key}")


def _validate_compiled_layers(m: ModelConfig) -> Iterator[str]:
    """The switches that rewrite the compiled layers' graphs, and what each needs."""
    if m.compile_cpp_wrapper in (True, False) and not m.compile:
        # the wrapper launches compiled kernels: eager layers have none, and the key was dropped unread
        yield (f"model.compile_cpp_wrapper={str(m.compile_cpp_wrapper).lower()} chooses who launches the "
               "compiled layers' kernels, but model.compile=false runs them eagerly: set "
               "model.compile=true, or remove model.compile_cpp_wrapper")
    yield from _choice("model.fuse_projections", m.fuse_projections, ("auto", True, False))
    if m.fuse_projections is True and not m.compile:
        yield ("model.fuse_projections=true rewrites the compiled layers' graphs: set model.compile=true, "
               "or remove model.fuse_projections")
    if m.recompute_qkv is False and not (m.enable_gradient_checkpointing and m.fuses_projections()):
        yield ("model.recompute_qkv=false keeps the fused q/k/v GEMM's output of checkpointed, compiled "
               "layers: it needs model.enable_gradient_checkpointing=true, model.compile=true and fused "
               "projections (model.fuse_projections=true; auto fuses them with LoRA only); set those "
               "or remove model.recompute_qkv")
    yield from _choice("model.fold_lora", m.fold_lora, ("auto", True, False))
    if m.fold_lora is True and not (m.lora_rank > 0 and m.fuses_projections()):
        yield ("model.fold_lora=true folds LoRA adapters into the fused projections of compiled layers: "
               "it needs model.lora_rank > 0, model.compile=true and fused projections "
               "(model.fuse_projections auto or true); set those or remove model.fold_lora")
    if m.fold_lora is True and m.lora_dropout > 0:
        yield (f"model.fold_lora=true with model.lora_dropout={m.lora_dropout}: an adapter folded into its "
               "frozen projection's GEMM reads that projection's input, but with dropout its A reads a "
               "dropped-out copy, so nothing would fold; set model.lora_dropout=0 or remove model.fold_lora")


def _validate_fsdp(f: FSDPConfig) -> Iterator[str]:
    yield from _choice("model.fsdp_config.model_dtype", f.model_dtype, DTYPES)
    yield from _choice("model.fsdp_config.sharding_strategy", f.sharding_strategy,
                       ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"))
    if f.backward_prefetch not in (None, "BACKWARD_PRE"):
        yield ("model.fsdp_config.backward_prefetch: FSDP2 always prefetches the next layer's "
               "all-gather in backward (BACKWARD_PRE); remove the key or set it to BACKWARD_PRE")
    if f.wrap_policy not in (None, {}, {"min_num_params": 0}):
        yield ("model.fsdp_config.wrap_policy: sfttrain shards every decoder layer and the root; "
               "a custom wrap policy is not supported, remove the key")
    try:
        dtypes = mixed_precision_dtypes(f) or ()
    except ConfigError as e:
        yield str(e)
        dtypes = ()
    if "fp16" in (f.model_dtype, *dtypes):
        yield ("fp16 (model.fsdp_config.model_dtype or mixed_precision) needs loss scaling, which sfttrain "
               "does not implement (small gradients would underflow to zero); use bf16")


def _validate_optim(o: OptimConfig) -> Iterator[str]:
    yield from _choice("optim.optimizer", o.optimizer.lower(), ("adamw",))
    yield from _choice("optim.lr_scheduler", o.lr_scheduler, ("cosine", "constant"))
    for key, value in (("optim.lr", o.lr), ("optim.eps", o.eps), ("optim.weight_decay", o.weight_decay),
                       ("optim.clip_grad", o.clip_grad)):
        if not math.isfinite(value):
            yield (f"{key}={value} is not a finite number; set a number such as its default "
                   f"{_default_of(key)}")
    if o.lr < 0:
        yield f"optim.lr={o.lr} is negative; use a positive rate such as 1e-5"
    if len(o.betas) != 2:
        yield f"optim.betas must have two values, got {o.betas}"
    # torch's AdamW checks these only in its defaults, not in the parameter groups sfttrain sets them
    # in (sfttrain.optim.group_settings): unchecked, a beta of 1 or more trained to a NaN loss and a
    # negative eps or weight decay trained on silently
    elif not all(0.0 <= beta < 1.0 for beta in o.betas):
        yield (f"optim.betas={list(o.betas)}: each must lie in [0, 1), such as its default "
               f"{_default_of('optim.betas')}")
    if o.eps < 0:
        yield (f"optim.eps={o.eps} is negative; use a small positive number such as its default "
               f"{_default_of('optim.eps')}")
    if o.weight_decay < 0:
        yield (f"optim.weight_decay={o.weight_decay} is negative (it would grow the weights); use 0 (none) or a "
               f"positive value such as its default {_default_of('optim.weight_decay')}")
    if not 0.0 <= o.lr_warmup_steps_ratio <= 1.0 or not 0.0 <= o.min_lr_ratio <= 1.0:
        yield "optim.lr_warmup_steps_ratio and optim.min_lr_ratio must lie in [0, 1]"


def _validate_trainer(t: TrainerConfig) -> Iterator[str]:
    yield from _positive(("trainer.total_epochs", t.total_epochs))
    if t.seed < 0:  # numpy's generator (the shuffled data order) takes none: a traceback once the rows were read
        yield f"trainer.seed={t.seed}: give a seed >= 0, e.g. trainer.seed={_default_of('trainer.seed')}"
    if t.total_training_steps is not None and t.total_training_steps < 1:  # 0 was read as unset: the epochs
        yield (f"trainer.total_training_steps={t.total_training_steps} would train nothing: give a number "
               "of steps >= 1, or null to train trainer.total_epochs passes over the data")
    if t.max_ckpt_to_keep is not None and t.max_ckpt_to_keep < 0:  # verl keeps every checkpoint: was that meant?
        yield (f"trainer.max_ckpt_to_keep={t.max_ckpt_to_keep}: set N > 0 to keep this run's newest N "
               "checkpoints, or null (the default; 0 is the same, as in verl) to keep every one")
    if t.log_freq < 1:  # a console line when step % log_freq == 0: 0 divides by zero after the first step
        yield (f"trainer.log_freq={t.log_freq}: a console line every N steps needs N >= 1 (metrics.jsonl "
               "gets every step whatever it is); e.g. trainer.log_freq=1, the default")
    yield from _choice("trainer.resume_mode", t.resume_mode, ("auto", "disable", "resume_path"))
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        yield "trainer.resume_mode=resume_path needs trainer.resume_from_path"
    if t.resume_mode == "disable" and t.resume_from_path:  # verl ignores the path; which one was meant?
        yield (f"trainer.resume_mode=disable starts afresh, so trainer.resume_from_path="
               f"{t.resume_from_path} would be ignored: drop trainer.resume_from_path to start afresh, or "
               "drop trainer.resume_mode=disable (trainer.resume_mode=resume_path) to resume from it")
    if t.resume_mode == "disable" and t.resume_allow_data_change:  # nothing is resumed: which one was meant?
        yield ("trainer.resume_allow_data_change=true lets a resume go on with changed data, but "
               "trainer.resume_mode=disable never resumes: remove trainer.resume_allow_data_change to "
               "start afresh, or remove trainer.resume_mode=disable to resume")
    if t.async_save_in_flight < 1:
        yield (f"trainer.async_save_in_flight must be >= 1 (saves in flight at once), got "
               f"{t.async_save_in_flight}")
    yield from _choice("trainer.async_save_writer", t.async_save_writer, WRITERS)
    yield from _choice("trainer.async_save_staging", t.async_save_staging, STAGINGS)
    if t.save_thread_count < 1:
        yield f"trainer.save_thread_count must be >= 1, got {t.save_thread_count}"
    yield from _choice("trainer.device", t.device, ("auto", "cuda", "cpu"))
    if t.nccl_timeout <= 0:
        yield (f"trainer.nccl_timeout must be a positive number of seconds, got {t.nccl_timeout}; "
               "the default is 1800")
    yield from _check_profile_steps(t.profile_steps)
    if t.profile_memory and not t.profile_steps:
        yield ("trainer.profile_memory=true records memory over trainer.profile_steps: name those steps "
               "too, e.g. trainer.profile_steps=[11]")
    for name in logger_names(t):
        if name not in LOGGERS:  # verl's list is longer (tensorboard, mlflow, swanlab, ...): say what there is instead
            yield (f"trainer.logger={name!r} is not one of {list(LOGGERS)}. Every run writes its metrics "
                   "to <run folder>/metrics.jsonl (`python -m sfttrain.plot <run folder>` draws them); for "
                   "a dashboard use wandb (WANDB_MODE=offline keeps it on this machine)")


def _check_profile_steps(steps: Optional[list[int]]) -> Iterator[str]:
    if not steps:
        return
    if min(steps) < 1 or sorted(steps) != list(range(min(steps), max(steps) + 1)):
        yield (f"trainer.profile_steps={list(steps)}: give consecutive step numbers from 1 on, once each, "
               "e.g. [11, 12, 13] (one window is profiled)")


@functools.cache
def _defaults() -> DictConfig:
    """The schema's defaults, built once and shared (read-only): a build walks every section, and the
    start-up's checks and notes ask for a default a dozen times on every rank."""
    defaults = OmegaConf.structured(Config)
    OmegaConf.set_readonly(defaults, True)
    return defaults


def _default_of(key: str) -> Any:
    return OmegaConf.select(_defaults(), key)


def _check_verl_switches(cfg: Config) -> Iterator[str]:
    """verl keys that sfttrain accepts only where they have their effect: a value that would be
    silently ignored is refused, with what to set instead."""
    m, fsdp = cfg.model, cfg.model.fsdp_config
    if not cfg.data.balance_dp_token:
        yield ("data.balance_dp_token=false: sfttrain always spreads each step's samples over ranks and "
               "micro-batches balanced by cost (the loss does not depend on the split); remove the key")
    if m.strategy != "fsdp2":
        yield (f"model.strategy={m.strategy!r}: sfttrain implements FSDP2 (fully_shard) only; set "
               "model.strategy=fsdp2 (sharding_strategy, fsdp_size, mixed precision and offload keep "
               "their meaning)")
    mp = fsdp.mixed_precision
    if isinstance(mp, dict) and mp.get("buffer_dtype", "fp32") != "fp32":
        yield (f"model.fsdp_config.mixed_precision.buffer_dtype={mp['buffer_dtype']!r}: sfttrain keeps "
               "buffers (rotary frequencies) in fp32, where rounding them would shift every position; "
               "remove the key or set it to fp32")


def _validate_lora(m: ModelConfig) -> Iterator[str]:
    """The names in target_modules are checked against the model at load (sfttrain.lora)."""
    if m.lora_rank < 0:
        yield f"model.lora_rank must be 0 (full fine-tuning) or positive, got {m.lora_rank}"
    if m.lora_rank <= 0:  # no adapters: the keys below are not read
        return
    if m.lora_alpha <= 0:
        yield f"model.lora_alpha must be positive, got {m.lora_alpha}"
    if not 0.0 <= m.lora_dropout < 1.0:
        yield f"model.lora_dropout must lie in [0, 1), got {m.lora_dropout}"
    if m.random_init:
        yield ("model.lora_rank > 0 with model.random_init=true: LoRA adapts pretrained weights, and a "
               "random base would be in no checkpoint (they hold the adapters only); save the random "
               "model to a folder first, or set model.lora_rank=0")
    targets = m.target_modules
    if not (isinstance(targets, str) or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        yield f"model.target_modules must be all-linear or a list of linear layer names, got {targets!r}"


def _validate_fp8(cfg: Config) -> Iterator[str]:
    """The device and torchao are checked at start-up (sfttrain.fp8.check_available)."""
    m, sp = cfg.model, cfg.ulysses_sequence_parallel_size
    yield from _choice("model.fp8", m.fp8, FP8_MODES)
    if m.fp8 == "off" and not m.fp8_fast_accum_grads:
        # the gradient GEMMs' accumulation mode of FP8 layers: without them it was dropped unread
        yield ("model.fp8_fast_accum_grads=false sets how FP8 gradient GEMMs accumulate, but model.fp8=off "
               "runs none: set model.fp8 (tensorwise, rowwise or auto), or remove "
               "model.fp8_fast_accum_grads")
    # the weight gradient's FP8 GEMM runs over the tokens: a rank's tokens per micro-batch (its
    # slice of the padded row) must be a multiple of 16, as every FP8 GEMM dimension (an sp below 1 is
    # its own problem)
    if m.fp8 != "off" and sp >= 1 and cfg.data.pad_to_multiple % (16 * sp) != 0:
        yield (f"model.fp8={m.fp8} needs data.pad_to_multiple={cfg.data.pad_to_multiple} to be a multiple "
               f"of {16 * sp} (16 tokens per rank{f' x {sp} Ulysses ranks' if sp > 1 else ''}: FP8 GEMMs "
               f"take dimensions that divide by 16); set data.pad_to_multiple={math.lcm(128, 16 * sp)}")
    if m.fp8 != "off" and m.lora_rank > 0:
        # torchao's float8 linear computes every weight's gradient, a frozen one's too: the base's
        # GEMMs would do a third more work in FP8 than they skip in bf16
        yield (f"model.fp8={m.fp8} with model.lora_rank={m.lora_rank}: FP8 linear layers compute the "
               "weight gradient of the frozen base too (work LoRA skips in bf16), so they would slow "
               "LoRA down; set model.fp8=off for LoRA")
    if m.fp8 != "off" and m.recompute_qkv is False:
        # torchao's float8 linear is not a linear call the fusion pass can group: there would be no
        # fused q/k/v GEMM to keep, and the setting would do nothing
        yield (f"model.fp8={m.fp8} with model.recompute_qkv=false: FP8 linear layers are not fused "
               "(sfttrain/fuse_projections.py), so there is no q/k/v GEMM output to keep; remove "
               "model.recompute_qkv or set model.fp8=off")
    if m.fp8 != "off" and m.fuse_projections is True:
        # the same: the pass would find no group among the FP8 layers, and the setting would do nothing
        yield (f"model.fp8={m.fp8} with model.fuse_projections=true: FP8 linear layers are not fused "
               "(sfttrain/fuse_projections.py), so the setting would fuse nothing; remove "
               "model.fuse_projections or set model.fp8=off")


def moot_settings(cfg: Config) -> list[str]:
    """Start-up lines (the run's and the preflight's, sfttrain.plan) for keys set away from their
    default that this configuration never reads: accepted, as verl's command lines carry them into
    modes where they mean nothing, but said, with what would make them count. Contradictions are
    refused in `validate` instead."""
    notes = [*_moot_lora(cfg.model), *_moot_data_keys(cfg.data), *_moot_schedule(cfg.optim),
             *_moot_validation(cfg), *_moot_async_save(cfg.trainer), *_moot_run_names(cfg.trainer)]
    return [f"  NOTE: {note}" for note in notes]


def _set_keys(section: Any, prefix: str, keys: tuple[str, ...]) -> list[str]:
    """`prefix.key=value` of those keys whose value differs from the schema's default."""
    values = {key: getattr(section, key) for key in keys}
    return [f"{prefix}.{key}={_short(value)}" for key, value in values.items()
            if value != _default_of(f"{prefix}.{key}")]


def _moot_lora(m: ModelConfig) -> list[str]:
    # verl's LoRA keys sit in its model section beside lora_rank; 0 trains every weight, no adapter
    if m.lora_rank > 0 or not (keys := _set_keys(m, "model", ("lora_alpha", "target_modules", "lora_dropout"))):
        return []
    return [f"{', '.join(keys)} ignored: model.lora_rank=0 trains every weight, no LoRA adapter; set model.lora_rank "
            "> 0 (e.g. 32) for LoRA"]


def _moot_data_keys(d: DataConfig) -> list[str]:
    # conversations are read from the messages column(s), prompt/response rows from the prompt and
    # response columns: the other mode's keys are read by nothing
    if d.multiturn.enable:
        keys = _set_keys(d, "data", ("prompt_key", "response_key", "prompt_dict_keys", "response_dict_keys"))
        return [f"{', '.join(keys)} ignored: data.multiturn.enable=true reads conversations from "
                f"data.multiturn.messages_key={_short(d.multiturn.messages_key)}"] if keys else []
    keys = _set_keys(d.multiturn, "data.multiturn", ("messages_key", "tools_key", "enable_thinking_key", "system_key"))
    return [f"{', '.join(keys)} ignored: rows are prompt/response pairs (data.prompt_key, data.response_key); set "
            "data.multiturn.enable=true for conversations"] if keys else []


def _moot_schedule(o: OptimConfig) -> list[str]:
    notes = []
    if o.lr_scheduler == "constant" and o.min_lr_ratio != _default_of("optim.min_lr_ratio"):
        notes.append(f"optim.min_lr_ratio={o.min_lr_ratio} ignored: optim.lr_scheduler=constant never decays the LR; "
                     "set optim.lr_scheduler=cosine to decay to lr * min_lr_ratio")
    if o.lr_warmup_steps > 0 and o.lr_warmup_steps_ratio not in (0, _default_of("optim.lr_warmup_steps_ratio")):
        notes.append(f"optim.lr_warmup_steps_ratio={o.lr_warmup_steps_ratio} ignored: optim.lr_warmup_steps="
                     f"{o.lr_warmup_steps} sets the warmup; set optim.lr_warmup_steps=-1 to warm up over the ratio")
    return notes


def _moot_validation(cfg: Config) -> list[str]:
    # verl's scripts pass test_freq with val_files; without them there is nothing to validate on
    t = cfg.trainer
    if t.test_freq > 0 and cfg.data.val_files in (None, "", []):
        return [f"trainer.test_freq={t.test_freq} ignored: no data.val_files to validate on; set data.val_files"]
    return []


def _moot_async_save(t: TrainerConfig) -> list[str]:
    keys = _set_keys(t, "trainer", ("async_save_pinned", "async_save_in_flight", "async_save_writer",
                                    "async_save_staging"))
    if t.async_save or not keys:
        return []
    return [f"{', '.join(keys)} ignored: trainer.async_save=false writes every checkpoint in the training loop; set "
            "trainer.async_save=true for background saves"]


def _moot_run_names(t: TrainerConfig) -> list[str]:
    # the names are wandb's run and project, and name the default run folder: with neither they label nothing
    if "wandb" in logger_names(t):
        return []
    folders = os.path.normpath(t.default_local_dir).split(os.sep)
    keys = [f"trainer.{key}={_short(value)}" for key, value in (("project_name", t.project_name),
                                                               ("experiment_name", t.experiment_name))
            if value != _default_of(f"trainer.{key}") and value not in folders]
    return [f"{', '.join(keys)} ignored: they name the wandb run and the default run folder, but trainer.logger="
            f"{_short(t.logger)} has no wandb and trainer.default_local_dir={t.default_local_dir} is set; add wandb "
            "to trainer.logger to use them"] if keys else []


def logger_names(t: TrainerConfig) -> list[str]:
    value = t.logger
    return [value] if isinstance(value, str) else list(value)


def _check_no_shard(cfg: Config) -> Iterator[str]:
    """NO_SHARD is DDP: every rank holds the whole model, so nothing that needs FSDP's shards."""
    f = cfg.model.fsdp_config
    if f.sharding_strategy != "NO_SHARD":
        return
    key = "model.fsdp_config.sharding_strategy=NO_SHARD (every rank holds the whole model)"
    if f.fsdp_size not in (-1, 0, 1):
        yield (f"{key} contradicts fsdp_size={f.fsdp_size}; remove fsdp_size, or use HYBRID_SHARD for "
               "shard groups of that size")
    if f.offloaded():
        yield f"{key}: CPU offload moves FSDP's shards to the host; use FULL_SHARD with cpu_offload=true"
    if cfg.ulysses_sequence_parallel_size > 1:
        yield (f"{key}: Ulysses ranks share one copy of the weights through FSDP; use FULL_SHARD with "
               "ulysses_sequence_parallel_size > 1")


def shard_group_size(f: FSDPConfig, dp_size: int) -> int:
    """Ranks that share one copy of the weights, each holding a shard: fsdp_size (-1 or 0: all
    dp_size data-parallel ranks); 1 with NO_SHARD (every rank holds all of it)."""
    if f.sharding_strategy == "NO_SHARD":
        return 1
    return dp_size if f.fsdp_size in (-1, 0) else f.fsdp_size


def mixed_precision_dtypes(f: FSDPConfig) -> Optional[tuple[str, str]]:
    """(param_dtype, reduce_dtype) for FSDP's MixedPrecisionPolicy, or None for no mixed precision.

    Accepts verl's two spellings: a bool, or a dict {param_dtype, reduce_dtype, buffer_dtype}."""
    mp = f.mixed_precision
    if mp is False or mp is None:
        return None
    if mp is True:
        return ("bf16", "fp32")
    if isinstance(mp, dict):
        unknown = set(mp) - {"param_dtype", "reduce_dtype", "buffer_dtype"}
        if unknown:
            raise ConfigError(f"model.fsdp_config.mixed_precision: unknown keys {sorted(unknown)}")
        param, reduce = mp.get("param_dtype", "bf16"), mp.get("reduce_dtype", "fp32")
        for key, value in (("param_dtype", param), ("reduce_dtype", reduce)):
            for problem in _choice(f"model.fsdp_config.mixed_precision.{key}", value, DTYPES):
                raise ConfigError(problem)
        return (param, reduce)
    raise ConfigError(f"model.fsdp_config.mixed_precision must be true, false or a dict, got {mp!r}")


def as_list(value: Any) -> list[str]:
    """A path or a list of paths (YAML list or omegaconf ListConfig) as a list of str."""
    if value is None:
        return []
    if isinstance(value, (list, tuple, ListConfig)):
        return [str(v) for v in value]
    return [str(value)]
