"""The data fingerprint: everything that decides which rows a run reads next and what they train on.

Checkpoints record it and a resume refuses a difference (it would silently change the rows or their
tokens) unless overridden. Keyed by the config key the user would change, so a difference names its
fix; its part that is not the order also names the per-row length cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from typing import Optional

from sfttrain.config import Config
from sfttrain.data.chat import resolve_chat_template
from sfttrain.data.parquet import ParquetSource
from sfttrain.data.render import RENDERING_VERSION

ORDER_KEYS = ("trainer.seed", "data.shuffle", "data.train_batch_size")
ROWS_KEY = "the rows' tokens (sha256; data files rewritten with other rows)"
RENDERING_KEY = "sfttrain's rendering of rows (version)"


def data_fingerprint(cfg: Config, source: ParquetSource, tokenizer) -> dict:
    d = cfg.data
    template = ((resolve_chat_template(d) or getattr(tokenizer, "chat_template", None))
                if d.apply_chat_template else None)
    return {
        "data.train_files": _files(source),
        "trainer.seed": cfg.trainer.seed,
        "data.shuffle": d.shuffle,
        "data.train_batch_size": d.train_batch_size,
        "data.max_length": d.max_length,
        "data.truncation": d.truncation,
        "data.apply_chat_template": d.apply_chat_template,
        "chat template (sha256)": _sha256(template) if template else None,
        "data.prompt_key": [d.prompt_key, *(d.prompt_dict_keys or [])],
        "data.response_key": [d.response_key, *(d.response_dict_keys or [])],
        "data.multiturn": asdict(d.multiturn),
        "tokenizer (sha256)": tokenizer_sha256(tokenizer),
        RENDERING_KEY: RENDERING_VERSION,
    }


def with_rows(fingerprint: dict, keep, digests) -> dict:
    """With the rows data.no_loss_rows=drop leaves out (`keep`: a mask) and a hash of every row's tokens:
    a file rewritten with other rows of the same size keeps its path, size and row count."""
    return {**fingerprint, "rows dropped (data.no_loss_rows=drop)": int((~keep).sum()),
            ROWS_KEY: hashlib.sha256(digests.tobytes()).hexdigest()}


def rendering_key(fingerprint: dict) -> str:
    """Names what a row's token counts depend on: the files (with their modification times) and the rendering."""
    parts = {k: v for k, v in fingerprint.items() if k not in ORDER_KEYS}
    parts["mtimes"] = [os.stat(f["path"]).st_mtime_ns for f in fingerprint["data.train_files"]]
    return _sha256(json.dumps(parts, sort_keys=True))[:16]


def differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """'key: saved -> current' for each key both hold (another version may record others), sections key by key."""
    return [line for key in saved if key in current and saved[key] != current[key]
            for line in (differences(saved[key], current[key], f"{prefix}{key}.")
                         if isinstance(saved[key], dict) and isinstance(current[key], dict)
                         else [f"{prefix}{key}: {saved[key]} -> {current[key]}"])]


def tokenizer_sha256(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return _sha256(text + json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str))


def _files(source: ParquetSource) -> list[dict]:
    return [{"path": os.path.abspath(f), "bytes": os.path.getsize(f), "rows": n} for f, n in source.file_rows()]


def _sha256(text: Optional[str]) -> str:
    return hashlib.sha256(str(text).encode()).hexdigest()
