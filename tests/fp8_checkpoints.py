"""FP8 versions of the small random checkpoints (``tests/checkpoints.py``), in each format pdserve reads.

Each linear weight is quantized to e4m3 with scales of its format's layout and random, non-uniform values
(amax / 448 times a factor drawn from [1, 3] per block, row or tensor), so that a scale read in the wrong
place or not at all changes the model. The tensors go into 3 safetensors shards, round-robin in name order:
a weight and its scale land in different shards. The reference is transformers' model loaded with weights
dequantized by this module's own code (the scale grid expanded with ``repeat_interleave``), independent of
pdserve's.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMATS = ("fp8", "compressed-tensors", "fbgemm_fp8")
FP8_MAX = 448.0
NUM_SHARDS = 3
_NEVER_QUANTIZED = ("embed_tokens", "lm_head", "gate", "conv1d")


@dataclass(frozen=True)
class Fp8Options:
    """``block_size``: the ``fp8`` format's weight_block_size (None: one scale per tensor). ``strategy``:
    compressed-tensors' weight strategy (tensor, channel or block; block uses ``block_size``). ``keep``:
    modules left as they are, named in the config's skip list. ``kv_scales``: store per-layer KV scales
    (layer 0 as ``self_attn.k_scale``, the others as ``k_proj.output_scale``)."""

    fmt: str
    block_size: tuple[int, int] | None = (16, 16)
    strategy: str = "channel"
    keep: tuple[str, ...] = ()
    kv_scales: bool = False
    seed: int = 0


def fp8_checkpoint(plain: Path, directory: Path, options: Fp8Options):
    """Quantize the plain checkpoint at ``plain`` (from ``make_checkpoint``) into ``directory``;
    return (directory, transformers' model (fp32, eval) with the dequantized weights)."""
    tensors = read_tensors(plain)
    gen = torch.Generator().manual_seed(options.seed)
    stored, dequantized = {}, {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and tensor.dim() >= 2 and is_linear(module)) or module in options.keep:
            stored[name] = dequantized[name] = tensor
            continue
        scale = _random_scale(tensor, options, gen)
        expanded = expand_scale(scale, tensor.shape, options)
        stored[name] = (tensor / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        stored[f"{module}.{scale_suffix(options.fmt)}"] = scale
        dequantized[name] = stored[name].float() * expanded
    config = json.loads((plain / "config.json").read_text())
    if options.kv_scales:
        stored.update(kv_scale_tensors(config["num_hidden_layers"], options.seed))
    write_shards(stored, directory)
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quant_config(options)}))
    return directory, reference_model(config, dequantized, directory / "reference")


def is_linear(module: str) -> bool:
    """A linear layer's weight (experts stacked or not), as these checkpoints quantize them."""
    parts = module.split(".")
    return not ("norm" in parts[-1] or parts[-1] in _NEVER_QUANTIZED or "router" in parts)


def scale_suffix(fmt: str) -> str:
    return "weight_scale_inv" if fmt == "fp8" else "weight_scale"


def _granularity(options: Fp8Options) -> str:
    if options.fmt == "fp8":
        return "tensor" if options.block_size is None else "block"
    return "channel" if options.fmt == "fbgemm_fp8" else options.strategy


def _random_scale(weight: torch.Tensor, options: Fp8Options, gen: torch.Generator) -> torch.Tensor:
    """Scales of ``weight``'s layout: its amax per block / row / tensor over 448, times U(1, 3)."""
    granularity = _granularity(options)
    *lead, rows, cols = weight.shape
    if granularity == "tensor":
        shape = (1,) if options.fmt == "compressed-tensors" else ()
        amax = weight.abs().max().reshape(shape)
    elif granularity == "channel":
        amax = weight.abs().amax(dim=-1, keepdim=True)
    else:
        b0, b1 = options.block_size
        g0, g1 = -(-rows // b0), -(-cols // b1)
        padded = torch.zeros(*lead, g0 * b0, g1 * b1)
        padded[..., :rows, :cols] = weight.abs()
        amax = padded.reshape(*lead, g0, b0, g1, b1).amax(dim=(-3, -1))
    factor = 1.0 + 2.0 * torch.rand(amax.shape, generator=gen)
    return (amax.clamp(min=1e-6) / FP8_MAX * factor).float()


def expand_scale(scale: torch.Tensor, shape: torch.Size, options: Fp8Options) -> torch.Tensor:
    """``scale`` repeated over the elements it scales (a block grid cut back at a ragged edge)."""
    if _granularity(options) != "block":
        return scale
    b0, b1 = options.block_size
    rows, cols = shape[-2:]
    return scale.repeat_interleave(b0, dim=-2)[..., :rows, :].repeat_interleave(b1, dim=-1)[..., :cols]


def quant_config(options: Fp8Options) -> dict:
    """The ``quantization_config`` of ``options``' format, as the format's own tools write it."""
    if options.fmt == "fp8":
        config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "weight_block_size": None if options.block_size is None else list(options.block_size)}
        return {**config, "modules_to_not_convert": ["lm_head", *options.keep]} if options.keep else config
    if options.fmt == "fbgemm_fp8":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                "modules_to_not_convert": ["lm_head", *options.keep]}
    weights = {"num_bits": 8, "type": "float", "strategy": options.strategy, "symmetric": True, "dynamic": False,
               "group_size": None, "block_structure": list(options.block_size) if options.strategy == "block"
               else None}
    inputs = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                      "output_activations": None}},
        # Kept modules as anchored regexes: the ``re:`` form real configs use for whole families of layers.
        "ignore": ["lm_head", *(f"re:{re.escape(m)}$" for m in options.keep)],
        "kv_cache_scheme": kv if options.kv_scales else None,
    }


def kv_scale_tensors(num_layers: int, seed: int) -> dict[str, torch.Tensor]:
    """Positive per-layer KV scales: layer 0 in vLLM's form, the others in older compressed-tensors' form."""
    gen = torch.Generator().manual_seed(seed + 1)
    out = {}
    for layer in range(num_layers):
        k, v = (0.01 + torch.rand((), generator=gen) for _ in range(2))
        prefix = f"model.layers.{layer}.self_attn"
        names = ("k_scale", "v_scale") if layer == 0 else ("k_proj.output_scale", "v_proj.output_scale")
        out[f"{prefix}.{names[0]}"], out[f"{prefix}.{names[1]}"] = k, v
    return out


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                out[name] = f.get_tensor(name)
    return out


def write_shards(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """NUM_SHARDS shards, round-robin in name order, and their index."""
    directory.mkdir(parents=True, exist_ok=True)
    files = [f"model-{i + 1:05d}-of-{NUM_SHARDS:05d}.safetensors" for i in range(NUM_SHARDS)]
    weight_map = {name: files[i % NUM_SHARDS] for i, name in enumerate(sorted(tensors))}
    for file in files:
        save_file({n: t.contiguous() for n, t in tensors.items() if weight_map[n] == file}, str(directory / file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def reference_model(config: dict, tensors: dict[str, torch.Tensor], directory: Path):
    """transformers' model (fp32, eval) on ``tensors``: saved as a plain checkpoint and loaded back, so that
    transformers maps the checkpoint names onto its modules (fused experts included) itself."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(directory / "model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    shutil.rmtree(directory)
    return model.float().eval()
