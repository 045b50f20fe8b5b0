"""Parsing ``quantization_config`` and pairing FP8 weights with scales: every refusal names what it refuses.

Small synthetic tensors, no model: the parity of the supported formats is ``test_fp8_checkpoints.py``'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.engine.loading.quant.dequantize import dequantize
from services.engine.loading.quant.kv_scales import read_kv_scales
from services.engine.loading.quant.patterns import ModulePatterns
from services.engine.loading.quant.registry import parse_quantization
from services.engine.loading.quant.scheme import QuantScheme, ScaleGranularity, WeightFormat
from services.engine.loading.quant.stream import checkpoint_tensors
from services.engine.loading.source import resolve_model
from services.engine.model_config.hf import ModelConfig
from tests.checkpoints import ARCHITECTURES, GEMMA_ARCHITECTURES, hf_config

FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16],
       "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]}
_FP8_ARGS = {"num_bits": 8, "type": "float", "symmetric": True}
CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", r"re:.*\.o_proj$"],
      "config_groups": {"g": {"targets": ["Linear"], "weights": {**_FP8_ARGS, "strategy": "channel", "dynamic": False},
                              "input_activations": {**_FP8_ARGS, "strategy": "token", "dynamic": True}}}}
Q = "model.layers.0.self_attn.q_proj"


def _scheme(quant: dict) -> QuantScheme:
    scheme = parse_quantization({"quantization_config": quant})
    assert scheme is not None
    return scheme


def _ct_group(**changes) -> dict:
    group = json.loads(json.dumps(CT["config_groups"]["g"]))
    for path, value in changes.items():
        *parents, key = path.split("__")
        node = group
        for p in parents:
            node = node[p]
        node[key] = value
    return {**CT, "config_groups": {"g": group}}


def test_schemes_say_what_the_configs_say() -> None:
    fp8 = _scheme(FP8)
    assert fp8.weight_format(Q) == WeightFormat(ScaleGranularity.BLOCK, (16, 16)) and fp8.scale_suffix == (
        "weight_scale_inv")
    assert fp8.weight_format("model.layers.0.mlp.gate") is None and fp8.weight_format("lm_head") is None
    assert _scheme({**FP8, "weight_block_size": None}).weight_format(Q).granularity is ScaleGranularity.TENSOR
    unsaid = {k: v for k, v in FP8.items() if k != "weight_block_size"}  # transformers' default: 128 x 128
    assert _scheme(unsaid).weight_format(Q) == WeightFormat(ScaleGranularity.BLOCK, (128, 128))
    ct = _scheme(CT)
    assert ct.weight_format(Q).granularity is ScaleGranularity.CHANNEL and ct.activation_scheme == "dynamic"
    assert ct.weight_format("model.layers.3.self_attn.o_proj") is None  # the re: entry
    weight_only = _scheme(_ct_group(input_activations=None))
    assert weight_only.activation_scheme == "none"
    fbgemm = _scheme({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1000.0, "modules_to_not_convert": None})
    assert fbgemm.weight_format(Q).granularity is ScaleGranularity.CHANNEL and fbgemm.activation_scale_ub == 1000.0
    assert parse_quantization({"model_type": "llama"}) is None


def test_module_patterns_stop_at_module_boundaries() -> None:
    patterns = ModulePatterns(names=("model.layers.1", "mlp.gate", r"model\.layers\.\d+\.mlp\.down_proj"))
    assert patterns.matches("model.layers.1.self_attn.q_proj") and not patterns.matches("model.layers.11.mlp.up")
    assert patterns.matches("model.layers.4.mlp.gate") and not patterns.matches("model.layers.4.mlp.gate_proj")
    assert patterns.matches("model.layers.7.mlp.down_proj")


def test_a_compressed_tensors_module_takes_its_most_specific_group() -> None:
    """A name beats a ``re:`` entry, which beats ``Linear``, whatever the groups' order (compressed-tensors')."""
    weights = {**_FP8_ARGS, "dynamic": False}
    groups = {"any": {"targets": ["Linear"], "weights": {**weights, "strategy": "tensor"}},
              "attn": {"targets": [r"re:.*self_attn\..*"], "weights": {**weights, "strategy": "channel"}},
              "q": {"targets": [Q], "weights": {**weights, "strategy": "block", "block_structure": [8, 8]}}}
    scheme = _scheme({**CT, "ignore": [], "config_groups": groups})
    assert scheme.weight_format(Q) == WeightFormat(ScaleGranularity.BLOCK, (8, 8))
    assert scheme.weight_format("model.layers.0.self_attn.k_proj").granularity is ScaleGranularity.CHANNEL
    assert scheme.weight_format("model.layers.0.mlp.up_proj").granularity is ScaleGranularity.TENSOR


@pytest.mark.parametrize(("quant", "named"), [
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "'modelopt'"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme"),
    ({**FP8, "weight_block_size": [128]}, "weight_block_size"),
    ({**FP8, "scale_fmt": "ue8m0"}, "scale_fmt"),
    ({**FP8, "modules_to_convert": ["model.embed_tokens"]}, "modules_to_convert"),
    ({**CT, "format": "pack-quantized"}, "pack-quantized"),
    (_ct_group(input_activations__dynamic=False), r"input_activations\.dynamic"),
    (_ct_group(weights__num_bits=4, weights__type="int"), "4-bit int"),
    (_ct_group(weights__symmetric=False), "symmetric"),
    (_ct_group(weights__strategy="group"), "strategy"),
    (_ct_group(weights__strategy="block"), "block_structure"),
    (_ct_group(output_activations={**_FP8_ARGS}), "output_activations"),
])
def test_refusals_name_the_method_or_field(quant: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_quantization({"quantization_config": quant})


def test_an_unsupported_checkpoint_is_refused_at_resolve(tmp_path) -> None:
    config = hf_config("llama").to_dict()
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'gptq'"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("arch", [*ARCHITECTURES, *GEMMA_ARCHITECTURES, "deepseek_v3", "granite"])
def test_model_configs_read_past_a_quantization_config(arch: str) -> None:
    import transformers

    if arch == "granite":
        config = transformers.GraniteMoeHybridConfig(layer_types=["mamba", "attention"], num_hidden_layers=2)
    else:
        config = hf_config(arch)
    d = {**config.to_dict(), "quantization_config": FP8}
    assert ModelConfig.from_hf_dict(d) == ModelConfig.from_hf_dict(config.to_dict())


def _fp8(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(torch.float8_e4m3fn)


def _stream(tensors: list[tuple[str, torch.Tensor]], quant: dict = FP8) -> dict[str, torch.Tensor]:
    return dict(checkpoint_tensors(iter(tensors), _scheme(quant)))


def test_weight_and_scale_pair_in_either_order() -> None:
    w, s = _fp8(40, 20), torch.rand(3, 2) + 0.5
    expected = w.float() * s.repeat_interleave(16, 0)[:40].repeat_interleave(16, 1)[:, :20]
    for order in ([(f"{Q}.weight", w), ("x.bias", torch.ones(3)), (f"{Q}.weight_scale_inv", s)],
                  [(f"{Q}.weight_scale_inv", s), ("x.bias", torch.ones(3)), (f"{Q}.weight", w)]):
        out = _stream(order)
        assert list(out) == ["x.bias", f"{Q}.weight"] or list(out) == [f"{Q}.weight", "x.bias"]
        assert out[f"{Q}.weight"].dtype == torch.float32 and torch.equal(out[f"{Q}.weight"], expected)


def test_stacked_experts_dequantize_per_expert() -> None:
    w, s = torch.randn(3, 20, 8).to(torch.float8_e4m3fn), torch.rand(3, 2, 1) + 0.5
    out = dequantize(w, s, WeightFormat(ScaleGranularity.BLOCK, (16, 16)))
    assert torch.equal(out, w.float() * s.repeat_interleave(16, 1)[:, :20])


@pytest.mark.parametrize(("tensors", "named"), [
    ([(f"{Q}.weight", _fp8(40, 20))], rf"FP8 weight '{Q}\.weight' has no scale"),
    ([(f"{Q}.weight_scale_inv", torch.ones(3, 2))], rf"'{Q}\.weight_scale_inv' has no weight"),
    ([(f"{Q}.weight", _fp8(40, 20)), (f"{Q}.weight_scale_inv", torch.ones(2, 3))],
     rf"'{Q}\.weight_scale_inv' has shape \[2, 3\].*\[3, 2\]"),
    ([(f"{Q}.weight", torch.ones(40, 20)), (f"{Q}.weight_scale_inv", torch.ones(3, 2))],
     rf"'{Q}\.weight_scale_inv'.*not stored as FP8"),
    ([(f"{Q}.weight_scale_inv", torch.ones(3, 2)), (f"{Q}.weight", torch.ones(40, 20))],
     rf"'{Q}\.weight_scale_inv'.*not FP8"),
    ([("model.layers.0.mlp.gate.weight", _fp8(8, 16))], r"'model\.layers\.0\.mlp\.gate\.weight'.*unquantized"),
    ([("model.embed_tokens.weight_scale_inv", torch.ones(1))], r"'model\.embed_tokens\.weight_scale_inv'"),
    ([(f"{Q}.activation_scale", torch.ones(()))], rf"'{Q}\.activation_scale'"),
    ([(f"{Q}.weight", _fp8(4, 4).to(torch.float8_e5m2))], "e4m3"),
])
def test_stream_refusals_name_the_tensor(tensors: list, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        _stream(tensors)


def test_compressed_tensors_scales_by_channel_and_refuses_ignored_modules() -> None:
    w, s = _fp8(6, 4), torch.rand(6, 1) + 0.5
    out = _stream([(f"{Q}.weight", w), (f"{Q}.weight_scale", s)], CT)
    assert torch.equal(out[f"{Q}.weight"], w.float() * s)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight_scale'.*unquantized"):
        _stream([("model.layers.0.self_attn.o_proj.weight_scale", s)], CT)
    assert torch.equal(_stream([(f"{Q}.weight", w), (f"{Q}.weight_scale", s.flatten())], CT)[f"{Q}.weight"],
                       w.float() * s)  # per-row scales stored flat
    with pytest.raises(ValueError, match=rf"'{Q}\.weight_scale' has shape \[1, 6\]"):
        _stream([(f"{Q}.weight", w), (f"{Q}.weight_scale", s.T)], CT)


def _shard(path: Path, tensors: dict[str, torch.Tensor]) -> list[Path]:
    save_file(tensors, str(path))
    return [path]


def test_kv_scales_refusals_name_the_layer_or_tensor(tmp_path) -> None:
    prefix = "model.layers.3.self_attn"
    assert read_kv_scales(_shard(tmp_path / "a.safetensors", {f"{prefix}.k_scale": torch.tensor(0.5),
                                                               f"{prefix}.v_scale": torch.tensor([0.25])})) == {
        3: (0.5, 0.25)}
    with pytest.raises(ValueError, match="layer 3 .* none for v"):
        read_kv_scales(_shard(tmp_path / "b.safetensors", {f"{prefix}.k_scale": torch.tensor(0.5)}))
    with pytest.raises(ValueError, match=rf"'{prefix}\.v_scale' has shape \[2\]"):
        read_kv_scales(_shard(tmp_path / "c.safetensors", {f"{prefix}.k_scale": torch.tensor(0.5),
                                                           f"{prefix}.v_scale": torch.ones(2)}))
    assert dict(checkpoint_tensors(iter([(f"{prefix}.k_scale", torch.tensor(0.5))]), None)) == {}


def test_an_fp8_tensor_never_reaches_the_model_unscaled() -> None:
    """Review: without a quantization_config, or under a name that is not a module's weight, an e4m3 tensor would
    have been cast into the model as its raw values; both are refused by name."""
    from services.engine.loading.quant.stream import checkpoint_tensors

    fp8 = torch.ones(4, 4).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="no quantization_config"):
        list(checkpoint_tensors([("model.layers.0.mlp.up_proj.weight", fp8)], None))
    scheme = parse_quantization({"quant_method": "fp8", "weight_block_size": [16, 16], "activation_scheme": "dynamic"})
    with pytest.raises(ValueError, match="experts.gate_up_proj"):
        list(checkpoint_tensors([("model.layers.0.mlp.experts.gate_up_proj", fp8)], scheme))
