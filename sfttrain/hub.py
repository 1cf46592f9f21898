"""Models named by a Hugging Face hub id (`model.partial_pretrain=Qwen/Qwen2.5-0.5B-Instruct`).

Rank 0 downloads the snapshot into the hub cache while the others wait; then every rank reads the
commit rank 0 got from its own cache (fetching it where the cache is not shared). Offline, a model
not in the cache is a ConfigError that says how to get it there.
"""

from __future__ import annotations

import functools
import os
import re

import torch.distributed as dist

from sfttrain.config import ConfigError

# "org/name": one slash, hub-legal characters; anything else is only ever a local path
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# formats a causal LM's training never reads: flax/tf/onnx/gguf weights, the original checkpoints
NOT_NEEDED = ["*.h5", "*.msgpack", "*.onnx", "*.gguf", "*.ot", "*.tflite", "*.pth", "*.pt", "original/*",
              "onnx/*", "coreml/*"]


def is_repo_id(name: str) -> bool:
    return not os.path.exists(name) and REPO_ID.match(name) is not None


@functools.lru_cache(maxsize=None)
def local_model_path(name: str) -> str:
    """A local folder as given; a hub id -> its snapshot folder. Collective for a hub id (cached: the
    tokenizer and the model share one call)."""
    if not is_repo_id(name):
        return name
    outcome = [_download(name) if _rank() == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    path, error = outcome[0]
    if error is None and _rank() != 0:
        commit = os.path.basename(path)  # snapshots/<commit>
        path, error = _download(name, commit, local_files_only=True)
        if error is not None:  # this node's cache is not rank 0's
            path, error = _download(name, commit)
    if error is not None:
        raise ConfigError(error)
    return path


def cached_folder(name: str) -> str | None:
    """The cached snapshot folder holding `name`'s config.json, or None; never downloads."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "config.json")
    return os.path.dirname(found) if isinstance(found, str) else None


def _download(name: str, revision: str | None = None, local_files_only: bool = False) -> tuple:
    """(snapshot folder, None) or (None, the message for the user)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    key = f"model.partial_pretrain={name!r}"
    try:
        return snapshot_download(name, revision=revision, ignore_patterns=NOT_NEEDED,
                                 local_files_only=local_files_only), None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        return None, (f"{key} is not a local folder, and as a Hugging Face hub id it is not in the local cache "
                      f"{constants.HF_HUB_CACHE} ({why}). Download it where the hub is reachable, into the cache this "
                      f"job uses (`hf download {name}` with the same HF_HUB_CACHE or HF_HOME), or give a local model "
                      "folder")
    except (RepositoryNotFoundError, GatedRepoError):
        return None, (f"{key} is not a local folder, and the hub has no model of that id that this account may "
                      "read (misspelt, private or gated: log in with `hf auth login` or set HF_TOKEN)")
    except HfHubHTTPError as e:
        return None, f"{key}: downloading from the hub failed: {e}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
