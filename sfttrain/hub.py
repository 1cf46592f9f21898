"""Model folders, local or named by a Hugging Face hub id (`model.partial_pretrain=Qwen/Qwen2.5-0.5B-Instruct`):
rank 0 downloads the snapshot while the others wait, then each rank reads the commit rank 0 got."""

from __future__ import annotations

import functools
import os
import re

import torch.distributed as dist

from sfttrain.config import ConfigError
from sfttrain.distributed import decided_by_rank0

# "org/name": one slash, hub-legal characters; anything else is only ever a local path
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# formats a causal LM's training never reads: flax/tf/onnx/gguf weights, the original checkpoints
NOT_NEEDED = ["*.h5", "*.msgpack", "*.onnx", "*.gguf", "*.ot", "*.tflite", "*.pth", "*.pt", "original/*",
              "onnx/*", "coreml/*"]


def is_repo_id(name: str) -> bool:
    return not os.path.exists(name) and REPO_ID.match(name) is not None


@functools.lru_cache(maxsize=None)
def local_model_path(name: str) -> str:
    """A local folder as given; a hub id -> its snapshot folder. Collective for a hub id (once a process)."""
    if not is_repo_id(name):
        return name
    path = decided_by_rank0(lambda: _download(name))
    if dist.is_initialized() and dist.get_rank() != 0:  # the commit rank 0 got (snapshots/<commit>), from this
        path = _download(name, os.path.basename(path))  # node's cache where it is there, else fetched
    return path


def model_config(folder: str, trust_remote_code: bool):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)


def cached_folder(name: str) -> str | None:
    """The cached snapshot folder holding `name`'s config.json, or None; never downloads."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "config.json")
    return os.path.dirname(found) if isinstance(found, str) else None


def _download(name: str, revision: str | None = None) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    key = f"model.partial_pretrain={name!r}"
    try:
        return snapshot_download(name, revision=revision, ignore_patterns=NOT_NEEDED)
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        raise ConfigError(f"{key} is not a local folder, and as a Hugging Face hub id it is not in the local "
                          f"cache {constants.HF_HUB_CACHE} ({why}). Download it where the hub is reachable, into the "
                          f"cache this job uses (`hf download {name}` with the same HF_HUB_CACHE or HF_HOME), or give "
                          "a local model folder") from None
    except (RepositoryNotFoundError, GatedRepoError):
        raise ConfigError(f"{key} is not a local folder, and the hub has no model of that id that this account "
                          "may read (misspelt, private or gated: log in with `hf auth login` or set "
                          "HF_TOKEN)") from None
    except HfHubHTTPError as e:
        raise ConfigError(f"{key}: downloading from the hub failed: {e}") from None
