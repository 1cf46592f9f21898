"""Export a sfttrain checkpoint as a Hugging Face model folder.

    python -m sfttrain.export CHECKPOINT_DIR OUT_DIR [--dtype auto|bf16|fp32|fp16] [--max_shard_size 5GB] [--base DIR]

CHECKPOINT_DIR is a `global_step_N` folder or a run folder (its latest checkpoint). Streams on the CPU
without a process group, a few tensors at a time; a LoRA checkpoint is merged into its base.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import shutil
import sys
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from sfttrain import lora, quant
from sfttrain.checkpoint import read_back
from sfttrain.checkpoint_folder import check_intact, fsync_path, fsync_tree, read_state, resolve, runs, size_text
from sfttrain.config import ModelConfig
from sfttrain.distributed import agree_on_errors
from sfttrain.dtypes import DTYPE, HF_NAMES
from sfttrain.errors import ConfigError, ExportError
from sfttrain.faults import SIZE_LIMIT_FIX, Fault, disk_full, fault, over_size_limit
from sfttrain.hub import local_model_path
from transformers.utils.hub import convert_file_size_to_int  # "5GB" -> bytes, as save_pretrained reads it

MODEL_PREFIX = "model."  # the DCP state dict is {"model": hf_state_dict, "optim": ...}
LOAD_BUDGET_BYTES = 1 << 30  # checkpoint bytes read per dcp.load call
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ADAPTER_DIR = "adapter"  # a LoRA export's peft adapter folder, inside the merged model's folder
HF_EXPORT_DIR = "huggingface"  # trainer.save_hf's export, inside the final checkpoint
# the others wait this long for a LoRA merge, which rank 0 runs alone (minutes for a large base)
EXPORT_TIMEOUT = datetime.timedelta(hours=6)


def model_tensors(checkpoint_dir: str) -> list[tuple[str, TensorStorageMetadata]]:
    """(HF name, DCP metadata) of the model's tensors, in the order they were saved."""
    meta = dcp.FileSystemReader(checkpoint_dir).read_metadata()
    return [(key[len(MODEL_PREFIX):], md) for key, md in meta.state_dict_metadata.items()
            if key.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)]


def tied_names(hf_dir: str, names: list[str], trust_remote_code: bool = False) -> set[str]:
    """Names that alias another parameter (lm_head.weight when tied), from the model built on the meta device."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    if not config.get("tie_word_embeddings", False) and not config.get("tie_encoder_decoder", False):
        return set()
    embeds = [n for n in names if n.endswith("embed_tokens.weight")]
    if "lm_head.weight" in names and len(embeds) == 1:  # the usual decoder-only layout: no need to build it
        return {"lm_head.weight"}
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
        every = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        unique = {n for n, _ in model.named_parameters()}
        return {n for n in every if n not in unique} & set(names)
    except Exception as e:  # an architecture transformers cannot build here: the usual convention
        print(f"sfttrain.export: could not build the model to find tied weights ({e}); "
              "assuming lm_head.weight is tied to the input embedding", file=sys.stderr)
        return {"lm_head.weight"} & set(names)


def read_tensors(reader: dcp.FileSystemReader, group: list[tuple[str, TensorStorageMetadata]]) -> dict:
    """HF name -> full tensor of the model tensors in `group`, read without a process group."""
    loaded = {MODEL_PREFIX + name: torch.empty(md.size, dtype=md.properties.dtype) for name, md in group}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(loaded, storage_reader=reader, no_dist=True)
    return {name[len(MODEL_PREFIX):]: t for name, t in loaded.items()}


def plan_shards(tensors: list[tuple[str, TensorStorageMetadata]], dtype: Optional[torch.dtype],
                max_shard_bytes: int) -> list[list[tuple[str, TensorStorageMetadata]]]:
    """Consecutive tensors in groups of at most max_shard_bytes; deterministic, so ranks can split them."""
    shards: list[list] = [[]]
    size = 0
    for name, md in tensors:
        n = math.prod(md.size) * (dtype or md.properties.dtype).itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, md))
        size += n
    return shards


def shard_file(i: int, n: int) -> str:
    return SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def export(checkpoint_dir: str, out_dir: str, dtype: str = "auto", max_shard_size: str | int = "5GB",
           rank: int = 0, world_size: int = 1, trust_remote_code: bool = False,
           base_dir: Optional[str] = None) -> None:
    """Writes the HF folder: rank r shards r, r + world_size, ...; rank 0 the index, config and tokenizer."""
    from safetensors.torch import save_file

    if dtype != "auto" and dtype not in DTYPE:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPE)}, got {dtype!r}")
    hf_dir = os.path.join(checkpoint_dir, "hf")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise FileNotFoundError(f"{checkpoint_dir} has no hf/config.json: not a sfttrain checkpoint")
    out_dtype = DTYPE.get(dtype)
    tensors = model_tensors(checkpoint_dir)
    if not tensors:
        raise ValueError(f"{checkpoint_dir}: no model tensors in the DCP metadata")
    if any(lora.is_adapter_weight(name) for name, _ in tensors):
        if rank == 0:  # the merge needs the whole base model: one process does it
            export_lora(checkpoint_dir, out_dir, dtype, max_shard_size, trust_remote_code, base_dir)
        return
    tied = tied_names(hf_dir, [n for n, _ in tensors], trust_remote_code)
    tensors = [(n, md) for n, md in tensors if n not in tied]
    shards = plan_shards(tensors, out_dtype, convert_file_size_to_int(max_shard_size))
    os.makedirs(out_dir, exist_ok=True)
    reader = dcp.FileSystemReader(checkpoint_dir)

    for i, shard in enumerate(shards):
        if i % world_size != rank:
            continue
        out: dict[str, torch.Tensor] = {}
        for group in plan_shards(shard, None, LOAD_BUDGET_BYTES):
            loaded = read_tensors(reader, group)
            for name, _ in group:
                t = loaded.pop(name)
                out[name] = (t.to(out_dtype) if out_dtype is not None and t.is_floating_point() else t).contiguous()
            del loaded
        path = os.path.join(out_dir, shard_file(i, len(shards)))
        save_file(out, path + ".tmp", metadata={"format": "pt"})
        os.chmod(path + ".tmp", 0o666 & ~_umask())  # safetensors creates it 0600
        os.replace(path + ".tmp", path)
        del out

    if rank == 0:
        stored = {md.properties.dtype for _, md in tensors if md.properties.dtype.is_floating_point}
        final_dtype = out_dtype or (stored.pop() if len(stored) == 1 else torch.float32)
        if len(shards) > 1:
            weight_map = {name: shard_file(i, len(shards)) for i, shard in enumerate(shards) for name, _ in shard}
            total = sum(math.prod(md.size) * (out_dtype or md.properties.dtype).itemsize for _, md in tensors)
            with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        _write_metadata_files(hf_dir, out_dir, final_dtype)


def into_checkpoint(checkpoint_dir: str, rank: int, world_size: int, trust_remote_code: bool,
                    base_dir: Optional[str]) -> str:
    """Collective: exports a committed checkpoint into its `huggingface/`; ExportError on every rank."""
    out = os.path.join(checkpoint_dir, HF_EXPORT_DIR)
    tmp = os.path.join(checkpoint_dir, f".{HF_EXPORT_DIR}.tmp")
    group = dist.new_group(backend="gloo", timeout=EXPORT_TIMEOUT)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed export's debris
    dist.barrier(group=group)
    error = None
    try:
        export(checkpoint_dir, tmp, rank=rank, world_size=world_size, trust_remote_code=trust_remote_code,
               base_dir=base_dir)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank learns of it below
        error = f"rank {rank}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1]}"[:400]
    failed = agree_on_errors(error, group)
    if not failed and rank == 0:
        fsync_tree(tmp)  # its files on disk before the rename names them: a crash leaves no empty weights there
        os.replace(tmp, out)
        fsync_path(checkpoint_dir)
    elif rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier(group=group)  # the export is in place (or gone) for every rank
    dist.destroy_process_group(group)
    if failed:
        base = f" --base {base_dir}" if base_dir else ""
        raise ExportError(f"the Hugging Face export of {checkpoint_dir} failed ({'; '.join(failed)}). The checkpoint "
                          "itself is committed: run the same command again (it resumes there and exports it), or "
                          f"export it with `python -m sfttrain.export {checkpoint_dir} OUT_DIR{base}`")
    return out


def export_lora(checkpoint_dir: str, out_dir: str, dtype: str = "auto", max_shard_size: str | int = "5GB",
                trust_remote_code: bool = False, base_dir: Optional[str] = None) -> None:
    """A LoRA checkpoint merged into its base in fp32; out_dir/adapter gets the peft adapter."""
    cfg = checkpoint_model_config(checkpoint_dir)
    trained_on = read_state(checkpoint_dir).get("base")
    name = base_dir or cfg.partial_pretrain
    base_dir = base_dir or base_folder(cfg.partial_pretrain, trained_on)
    if not os.path.isfile(os.path.join(base_dir, "config.json")):
        raise ConfigError(f"{checkpoint_dir} holds LoRA adapters only; their base model {base_dir!r} "
                                "(model.partial_pretrain) is not a model folder here: pass --base DIR")
    lora.check_base(trained_on, lora.base_identity(name, base_dir), f"exporting {checkpoint_dir}")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, trust_remote_code=trust_remote_code)
    peft_model = lora.wrap(base, cfg)
    if cfg.base_quant == "nf4":  # the base the adapters were trained on
        quant.round_trip(peft_model.get_base_model(), lora.base_dtype(cfg))
    reader = dcp.FileSystemReader(checkpoint_dir)
    adapters = read_tensors(reader, model_tensors(checkpoint_dir))
    result = peft_model.get_base_model().load_state_dict(adapters, strict=False)
    not_loaded = [k for k in result.missing_keys if lora.is_adapter_weight(k)]
    if result.unexpected_keys or not_loaded:
        raise ValueError(f"{checkpoint_dir}: its adapters do not match model.target_modules / lora_rank on "
                         f"{base_dir}: unexpected {result.unexpected_keys[:5]}, not in the checkpoint {not_loaded[:5]}")
    peft_model.save_pretrained(os.path.join(out_dir, ADAPTER_DIR))
    with open(os.path.join(out_dir, ADAPTER_DIR, "sfttrain_base.json"), "w") as f:  # which base, quantized how
        json.dump({**(trained_on or {}), "base_quant": cfg.base_quant}, f, indent=1)
    final_dtype = DTYPE.get(dtype) or _stored_dtype(base_dir)
    merged = peft_model.merge_and_unload().to(final_dtype)
    merged.save_pretrained(out_dir, max_shard_size=max_shard_size)
    _write_metadata_files(os.path.join(checkpoint_dir, "hf"), out_dir, final_dtype)


def base_folder(given: str, trained_on: dict | None) -> str:
    """A LoRA checkpoint's base: model.partial_pretrain, else the folder the run read."""
    found = (trained_on or {}).get("folder")
    if not os.path.isdir(given) and found and os.path.isdir(found):
        return found
    return local_model_path(given)


def refused_message(error: BaseException, refused: Fault, out: str, tmp: str) -> str:
    """What a filesystem refused the export into `out` (written as `tmp`), what is left and what to do."""
    left = f"its partial folder {tmp} is left: delete it" if os.path.lexists(tmp) else "the partial folder was removed"
    if over_size_limit(error):
        return (f"a file of {out} reached the file size limit (ulimit -f): nothing was exported ({left}). "
                f"{SIZE_LIMIT_FIX}, or export smaller files (--max_shard_size)")
    if disk_full(error):
        parent = os.path.dirname(out)
        return (f"the disk of {out} is full: nothing was exported ({left}); {parent} has "
                f"{size_text(shutil.disk_usage(parent).free)} free. Free space, or export to another folder; "
                "--dtype bf16 halves an fp32 checkpoint's export")
    return (f"writing {out} failed: {refused.cause}. Nothing was exported ({left}). {refused.fix}, or export to "
            "another folder")


def checkpoint_model_config(checkpoint_dir: str) -> ModelConfig:
    """The model section of the checkpoint's config.yaml (LoRA settings, base model path)."""
    from omegaconf import OmegaConf

    stored = OmegaConf.load(os.path.join(checkpoint_dir, "config.yaml")).model
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), stored))


def _stored_dtype(model_dir: str) -> torch.dtype:
    """The dtype a model folder's config.json declares (fp32 if none)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return {v: k for k, v in HF_NAMES.items()}.get(name, torch.float32)


def _write_metadata_files(hf_dir: str, out_dir: str, dtype: torch.dtype) -> None:
    """hf/ into out_dir, the config's dtype the exported one and use_cache back on (training turns it off)."""
    for name in os.listdir(hf_dir):
        src = os.path.join(hf_dir, name)
        if name == "config.json" or not os.path.isfile(src):
            continue
        shutil.copyfile(src, os.path.join(out_dir, name))
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    config["dtype"] = HF_NAMES[dtype]
    if "torch_dtype" in config:  # transformers 4.x spelling
        config["torch_dtype"] = HF_NAMES[dtype]
    config["use_cache"] = True
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_export_folder(tmp: str, out: str) -> None:
    """Made first, so that a place the user cannot write fails at once, not after minutes of export."""
    shutil.rmtree(tmp, ignore_errors=True)  # a failed export's debris
    try:
        os.makedirs(tmp)
    except OSError as e:
        sys.exit(f"sfttrain.export: cannot create {tmp} ({e.strerror}), the folder the export is written into "
                 f"before it is renamed to {out}: export into a folder whose parent you can write")


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sfttrain.export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir", help="a global_step_N folder, or a run folder (its latest complete checkpoint)")
    p.add_argument("out_dir", help="the Hugging Face folder to create (must not exist or be empty)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPE],
                   help="dtype of the exported floating-point weights (auto: as stored in the checkpoint)")
    p.add_argument("--max_shard_size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB")
    # never from the checkpoint's config.yaml: a checkpoint must not run code here without the user's say-so
    p.add_argument("--trust_remote_code", action="store_true",
                   help="run the model's custom code (only for checkpoints you trust)")
    p.add_argument("--base", help="LoRA checkpoints: the base model folder (default: the checkpoint's "
                   "model.partial_pretrain)")
    args = p.parse_args(argv)
    try:
        ckpt = resolve(args.checkpoint_dir)
        check_intact(ckpt)
    except ConfigError as e:
        sys.exit(f"sfttrain.export: {e}")
    by_run = runs(os.path.abspath(args.checkpoint_dir))
    if len(by_run) > 1:
        print(f"sfttrain.export: {args.checkpoint_dir} holds the checkpoints of {len(by_run)} runs "
              f"({', '.join(f'{run}: steps {steps}' for run, steps in by_run.items())}); exporting the latest of the "
              f"run that saved last (id {list(by_run)[-1]}), {os.path.basename(ckpt)}. Give a global_step_N folder "
              "to export another", flush=True)
    out = os.path.abspath(args.out_dir)
    if os.path.isdir(out) and os.listdir(out):
        sys.exit(f"sfttrain.export: {out} exists and is not empty; choose a new folder")
    if os.path.lexists(out) and not os.path.isdir(out):
        sys.exit(f"sfttrain.export: {out} is a file, not a folder; name a new (or empty) folder to export into")
    tmp = out.rstrip("/") + ".tmp"
    make_export_folder(tmp, out)
    try:
        with read_back(ckpt):
            export(ckpt, tmp, dtype=args.dtype, max_shard_size=args.max_shard_size,
                   trust_remote_code=args.trust_remote_code, base_dir=args.base)
        fsync_tree(tmp)  # on disk before the rename names it: a crash after it must not leave empty weights
    except ConfigError as e:  # e.g. a LoRA checkpoint onto another base, a damaged checkpoint
        shutil.rmtree(tmp, ignore_errors=True)
        sys.exit(f"sfttrain.export: {e}")
    except Exception as e:  # an OSError, or safetensors' own error with the OS's words
        refused = fault(e, None)
        if refused is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        sys.exit(f"sfttrain.export: {refused_message(e, refused, out, tmp)}")
    if os.path.isdir(out):
        os.rmdir(out)
    os.replace(tmp, out)  # the folder appears complete or not at all
    fsync_path(os.path.dirname(os.path.abspath(out)))
    print(f"sfttrain.export: {ckpt} -> {out}", flush=True)
    gc.freeze()  # skip the interpreter's final collection of torch's object graph (seconds of CPU)


if __name__ == "__main__":
    main()
