"""Model architectures, one module per family over the shared layers in ``layers.py``.

Every model implements :class:`services.engine.models.base.DecoderModel`. Adding an architecture
is a new module, its config parsing in ``services/engine/model_config/hf.py``, and one line here.
"""

from __future__ import annotations

import torch

from services.engine.model_config.hf import ModelConfig
from services.engine.models.base import DecoderModel
from services.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from services.engine.models.gemma import GemmaForCausalLM
from services.engine.models.gemma4 import Gemma4ForCausalLM
from services.engine.models.gpt_oss import GptOssForCausalLM
from services.engine.models.granite_hybrid import GraniteHybridForCausalLM
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.qwen3_moe import Qwen3MoeForCausalLM
from services.engine.parallel import ParallelConfig

MODEL_CLASSES: dict[str, type[DecoderModel]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,
    "gemma4": Gemma4ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "granitemoehybrid": GraniteHybridForCausalLM,
    "gpt_oss": GptOssForCausalLM,
}


def build_model(config: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype, device: torch.device,
                mxfp4_experts: bool = False) -> DecoderModel:
    """The architecture's module with uninitialised weights (a loader fills them); ``mxfp4_experts``: its experts
    kept as an MXFP4 checkpoint stores them (gpt-oss only)."""
    try:
        cls = MODEL_CLASSES[config.architecture]
    except KeyError:
        raise ValueError(f"no model class for architecture {config.architecture!r}") from None
    if mxfp4_experts:
        if cls is not GptOssForCausalLM:
            raise ValueError(f"MXFP4 experts are computed for gpt-oss only, not {config.architecture!r}")
        return cls(config, parallel, dtype, device, mxfp4_experts=True)
    return cls(config, parallel, dtype, device)


__all__ = ["MODEL_CLASSES", "DecoderModel", "build_model"]
