"""MXFP4 versions of the small random gpt-oss checkpoints (``tests/checkpoints.py``), as gpt-oss is released: the
experts' projections as ``*_blocks`` / ``*_scales``, everything else as stored. The reference is transformers'
model loaded from the MXFP4 checkpoint itself, which dequantizes it with transformers' own code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.engine.loading.quant.mxfp4 import quantized_checkpoint
from tests.fp8_checkpoints import read_tensors

MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def mxfp4_checkpoint(plain: Path, directory: Path):
    """The plain checkpoint at ``plain`` with MXFP4 experts, in ``directory``; (directory, transformers' model on
    it, float32, eager attention)."""
    import transformers

    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    stored = dict(quantized_checkpoint(read_tensors(plain).items()))
    save_file({name: t.contiguous() for name, t in stored.items()}, str(directory / "model.safetensors"))
    config = json.loads((plain / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_CONFIG}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                           attn_implementation="eager")
    return directory, hf.eval()
