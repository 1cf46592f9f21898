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
import os
import shutil
import sys
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers.utils.hub import convert_file_size_to_int  # "5GB" -> bytes, as save_pretrained reads it

from sfttrain import lora, quant
from sfttrain.checkpoint_load import MODEL_PREFIX, model_tensors, one_line, read_back
from sfttrain.checkpoint_folder import check_intact, fsync_tree, publish, read_state, resolve, runs, size_text
from sfttrain.config import ModelConfig
from sfttrain.distributed import agree_on_errors
from sfttrain.dtypes import DTYPE
from sfttrain.errors import ConfigError, ExportError
from sfttrain.faults import SIZE_LIMIT_FIX, Fault, disk_full, fault, over_size_limit
from sfttrain.hub import local_model_path, model_config

LOAD_BUDGET_BYTES = 1 << 30  # checkpoint bytes read per dcp.load call
INDEX_FILE = "model.safetensors.index.json"
ADAPTER_DIR = "adapter"  # a LoRA export's peft adapter folder, inside the merged model's folder
HF_EXPORT_DIR = "huggingface"  # trainer.save_hf's export, inside the final checkpoint
# the others wait this long for a LoRA merge, which rank 0 runs alone (minutes for a large base)
EXPORT_TIMEOUT = datetime.timedelta(hours=6)


def read_tensors(reader: dcp.FileSystemReader, stored: dict[str, TensorStorageMetadata]) -> dict:
    loaded = {MODEL_PREFIX + name: torch.empty(md.size, dtype=md.properties.dtype) for name, md in stored.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(loaded, storage_reader=reader, no_dist=True)
    return {name[len(MODEL_PREFIX):]: t for name, t in loaded.items()}


def export(checkpoint_dir: str, out_dir: str, dtype: str = "auto", max_shard_size: str | int = "5GB",
           rank: int = 0, world_size: int = 1, trust_remote_code: bool = False,
           base_dir: Optional[str] = None) -> None:
    """Writes the HF folder: rank r the safetensors files r, r + world_size, ... (planned from the tensors'
    sizes alone), rank 0 the index, config and tokenizer."""
    hf_dir = os.path.join(checkpoint_dir, "hf")  # a checkpoint's check_intact, or its commit, vouched for it
    stored = model_tensors(checkpoint_dir)
    if any(lora.is_adapter_weight(name) for name in stored):
        if rank != 0:  # the merge needs the whole base model: one process does it
            return
        tensors, world_size = export_lora(checkpoint_dir, out_dir, dtype, trust_remote_code, base_dir), 1
        out_dtype = next(iter(tensors.values())).dtype

        def read(names: list[str]) -> dict[str, torch.Tensor]:
            return {n: tensors[n].contiguous() for n in names}
    else:
        floats = {md.properties.dtype for md in stored.values() if md.properties.dtype.is_floating_point}
        cast, reader = DTYPE.get(dtype), dcp.FileSystemReader(checkpoint_dir)
        tensors = {n: meta_tensor(md, cast) for n, md in stored.items()}
        out_dtype = cast or (floats.pop() if len(floats) == 1 else torch.float32)

        def read(names: list[str]) -> dict[str, torch.Tensor]:  # LOAD_BUDGET_BYTES of the checkpoint at a time
            split = split_torch_state_dict_into_shards({n: meta_tensor(stored[n]) for n in names},
                                                       max_shard_size=LOAD_BUDGET_BYTES)
            tensors = (t for group in split.filename_to_tensors.values()
                       for t in read_tensors(reader, {n: stored[n] for n in group}).items())
            return {name: (t.to(cast) if cast and t.is_floating_point() else t).contiguous() for name, t in tensors}
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    if config.get("tie_word_embeddings", False):  # transformers ties lm_head.weight back on load
        tensors.pop("lm_head.weight", None)
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=convert_file_size_to_int(max_shard_size))
    os.makedirs(out_dir, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    for i, (file, names) in enumerate(split.filename_to_tensors.items()):
        if i % world_size == rank:
            save_file(read(names), os.path.join(out_dir, file), metadata={"format": "pt"})
            os.chmod(os.path.join(out_dir, file), 0o666 & ~umask)  # safetensors creates it 0600
    if rank != 0:
        return
    if split.is_sharded:
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f, indent=2)
    # hf/ into out_dir, the config's dtype the exported one and use_cache back on (training turns it off)
    shutil.copytree(hf_dir, out_dir, dirs_exist_ok=True, copy_function=shutil.copyfile)
    name = str(out_dtype).removeprefix("torch.")
    config.update(dtype=name, use_cache=True, **({"torch_dtype": name} if "torch_dtype" in config else {}))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def meta_tensor(md: TensorStorageMetadata, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    cast = dtype is not None and md.properties.dtype.is_floating_point
    return torch.empty(md.size, dtype=dtype if cast else md.properties.dtype, device="meta")


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
        error = f"rank {rank}: {one_line(e)}"
    failed = agree_on_errors(error, group)
    if not failed and rank == 0:
        fsync_tree(tmp)  # its files on disk before the rename names them
        publish(tmp, out)
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


def export_lora(checkpoint_dir: str, out_dir: str, dtype: str = "auto", trust_remote_code: bool = False,
                base_dir: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The state of a LoRA checkpoint merged into its base by peft (in fp32, then the export's dtype);
    out_dir/adapter gets the peft adapter."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    # the model section only: keys of other sections that a later version dropped must not stop an export
    stored = OmegaConf.load(os.path.join(checkpoint_dir, "config.yaml")).model
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), stored))
    trained_on = read_state(checkpoint_dir).get("base") or {}
    name, found = base_dir or cfg.partial_pretrain, trained_on.get("folder")
    if base_dir is None:  # model.partial_pretrain, else the folder the run read
        moved = not os.path.isdir(cfg.partial_pretrain) and found and os.path.isdir(found)
        base_dir = found if moved else local_model_path(cfg.partial_pretrain)
    if not os.path.isfile(os.path.join(base_dir, "config.json")):
        raise ConfigError(f"{checkpoint_dir} holds LoRA adapters only; their base model {base_dir!r} "
                          "(model.partial_pretrain) is not a model folder here: pass --base DIR")
    lora.check_base(trained_on or None, lora.base_identity(name, base_dir), f"exporting {checkpoint_dir}")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, trust_remote_code=trust_remote_code)
    peft_model = lora.wrap(base, cfg)
    if cfg.base_quant != "none":  # the base the adapters were trained on
        quant.round_trip(peft_model.get_base_model(), lora.base_dtype(cfg), cfg.base_quant)
    adapters = read_tensors(dcp.FileSystemReader(checkpoint_dir), model_tensors(checkpoint_dir))
    result = peft_model.get_base_model().load_state_dict(adapters, strict=False)
    not_loaded = [k for k in result.missing_keys if lora.is_adapter_weight(k)]
    if result.unexpected_keys or not_loaded:
        raise ValueError(f"the adapters do not match model.target_modules / lora_rank on {base.name_or_path}: "
                         f"unexpected {result.unexpected_keys[:5]}, not in the checkpoint {not_loaded[:5]}")
    peft_model.save_pretrained(os.path.join(out_dir, ADAPTER_DIR))
    with open(os.path.join(out_dir, ADAPTER_DIR, "sfttrain_base.json"), "w") as f:  # which base, quantized how
        json.dump({**trained_on, "base_quant": cfg.base_quant}, f, indent=1)
    out_dtype = DTYPE.get(dtype) or model_config(base_dir, trust_remote_code).dtype or torch.float32
    return peft_model.merge_and_unload().to(out_dtype).state_dict()


def refused_message(error: BaseException, refused: Fault, out: str, tmp: str) -> str:
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
    shutil.rmtree(tmp, ignore_errors=True)  # a failed export's debris
    try:  # made first: a place the user cannot write fails at once, not after minutes of export
        os.makedirs(tmp)
    except OSError as e:
        sys.exit(f"sfttrain.export: cannot create {tmp} ({e.strerror}), the folder the export is written into "
                 f"before it is renamed to {out}: export into a folder whose parent you can write")
    try:
        with read_back(ckpt):
            export(ckpt, tmp, dtype=args.dtype, max_shard_size=args.max_shard_size,
                   trust_remote_code=args.trust_remote_code, base_dir=args.base)
        fsync_tree(tmp)  # its files on disk before the rename names them
        publish(tmp, out)
    except Exception as e:  # a ConfigError (a LoRA checkpoint onto another base), an OSError or safetensors' own
        refused = None if isinstance(e, ConfigError) else fault(e, None)
        if refused is None and not isinstance(e, ConfigError):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        sys.exit(f"sfttrain.export: {e if refused is None else refused_message(e, refused, out, tmp)}")
    print(f"sfttrain.export: {ckpt} -> {out}", flush=True)
    gc.freeze()  # skip the interpreter's final collection of torch's object graph (seconds of CPU)


if __name__ == "__main__":
    main()
