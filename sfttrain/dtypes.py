"""The dtype names of the config (model_dtype, mixed_precision). torch only: the exporter and LoRA read
them without importing the model code."""

from __future__ import annotations

import torch

DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CONFIG_NAMES = {dtype: name for name, dtype in DTYPE.items()}  # torch.bfloat16 -> "bf16"
