"""The dtype names of the config (model_dtype, mixed_precision) and of Hugging Face's config.json.
torch only: the exporter and LoRA read them without importing the model code."""

from __future__ import annotations

import torch

DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
CONFIG_NAMES = {dtype: name for name, dtype in DTYPE.items()}  # torch.bfloat16 -> "bf16"
