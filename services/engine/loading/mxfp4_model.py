"""Whether an MXFP4 checkpoint's experts stay MXFP4 (``--quantization``): ``auto`` keeps them on CUDA, where the
grouped GEMMs read them through the Triton kernel of ``ops.mxfp4_moe`` (a quarter of bf16's bytes), and
dequantizes them at load elsewhere; ``mxfp4`` keeps them on every device (on CPU through the torch reference:
slow, for tests); ``none`` always dequantizes."""

from __future__ import annotations

import logging

import torch

from services.engine.loading.quant.scheme import QuantScheme

log = logging.getLogger(__name__)


def mxfp4_experts_chosen(choice: str, scheme: QuantScheme | None, device: torch.device, model_name: str) -> bool:
    """Whether ``choice`` keeps this checkpoint's MXFP4 experts as stored (logged when it is MXFP4). ValueError
    for ``mxfp4`` on a checkpoint that is not."""
    is_mxfp4 = scheme is not None and scheme.method == "mxfp4"
    if not is_mxfp4:
        if choice == "mxfp4":
            raise ValueError(f"--quantization mxfp4: {model_name} has no MXFP4 quantization_config (an MXFP4 "
                             "checkpoint or a dummy:gpt-oss-* preset is needed)")
        return False
    kept = choice == "mxfp4" or (choice == "auto" and device.type == "cuda")
    log.info("quantization: MXFP4 experts %s on %s (--quantization %s)",
             "computed as stored" if kept else "dequantized at load", device, choice)
    return kept
