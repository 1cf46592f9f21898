"""RoPE scalings whose frequencies depend on the batch, refused where packing would mix them.

transformers picks dynamic-NTK and LongRoPE frequencies per forward from max(position_ids) + 1: above
original_max_position_embeddings the long-context ones for every token. A short sample packed beside
a longer one would train with frequencies it never sees alone (and Ulysses ranks of one sample could
pick different ones). Only possible where data.max_length exceeds that limit and a forward holds
several samples. Read from config.json (transformers 4.x `rope_scaling`, 5.x `rope_parameters`, per
attention type too), so the preflight runs it without building the model.
"""

from __future__ import annotations

import json
import os
from typing import Iterator, Optional

from sfttrain.config import Config, ConfigError

BATCH_DEPENDENT = ("dynamic", "longrope")


def rope_settings(config: dict) -> Iterator[tuple[str, dict]]:
    """(config.json key, its RoPE parameters) of every attention type the config describes."""
    config = config.get("text_config", config)  # multimodal configs nest the language model's
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key)
        if not isinstance(params, dict):
            continue
        if params and all(isinstance(v, dict) for v in params.values()):  # 5.x: one per attention type
            yield from ((f"{key}.{kind}", p) for kind, p in params.items())
        else:
            yield key, params


def batch_dependent_rope(config: dict, cfg: Config) -> Optional[str]:
    """Why this model's RoPE would depend on what is packed beside a sample, or None."""
    d = cfg.data
    one_sample_per_forward = (d.micro_batch_size_per_gpu == 1 and not d.max_token_len_per_gpu
                              and cfg.ulysses_sequence_parallel_size == 1)
    text = config.get("text_config", config)
    for key, params in rope_settings(config):
        rope_type = params.get("rope_type") or params.get("type")
        if rope_type not in BATCH_DEPENDENT:
            continue
        limit = (params.get("original_max_position_embeddings") or text.get("original_max_position_embeddings")
                 or text.get("max_position_embeddings"))
        if one_sample_per_forward or (limit is not None and d.max_length <= limit):
            continue
        return (f"model.partial_pretrain's config.json sets {key} rope_type={rope_type!r}, whose frequencies "
                f"transformers picks from the longest position in the whole forward: with data.max_length="
                f"{d.max_length} above original_max_position_embeddings={limit}, a sample packed beside a longer one "
                "would train with the long-context frequencies (and the Ulysses ranks of one sample could pick "
                f"different ones). Set data.max_length<={limit}, or train one sample per forward "
                "(data.micro_batch_size_per_gpu=1, no data.max_token_len_per_gpu, ulysses_sequence_parallel_size=1)")
    return None


def check_rope(cfg: Config, folder: str) -> None:
    """Start-up check (before the model loads) of the model folder's config.json."""
    with open(os.path.join(folder, "config.json")) as f:
        problem = batch_dependent_rope(json.load(f), cfg)
    if problem:
        raise ConfigError(problem)
