"""The FP8 format every FP8 path shares (the torch reference, the Triton kernels, the KV cache's scales)."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
#: e4m3's largest finite value: a scale maps a row's (or a group's) absolute maximum onto it.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
#: A zero row gets this scale rather than 0, so dequantizing it is 0 and not NaN.
MIN_SCALE = 1e-12
