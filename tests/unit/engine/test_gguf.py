"""load_gguf: HF-named float32 tensors and config, against transformers 4.57.6 loading the same file."""

from __future__ import annotations

import inspect
import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from services.engine.loading.gguf import _unpermute_rope_rows, load_gguf
from services.text.gguf_metadata import open_gguf_reader
from tests.gguf_files import decoder_shapes, finish
from tests.unit._smollm2 import smollm2_checkpoint, smollm2_path, smollm2_tokenizer, transformers_model

CONFIG_FIELDS = [
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
    "max_position_embeddings", "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "attention_bias", "hidden_act",
]


def _load_reference(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32
    )


def _assert_tensors_match(checkpoint, reference_model) -> None:
    expected = reference_model.state_dict()
    ours = dict(checkpoint.tensors())
    tied = {"lm_head.weight"} if checkpoint.config["tie_word_embeddings"] else set()
    assert set(ours) == set(expected) - tied
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name]), name


def _assert_config_matches(config: dict, reference_config) -> None:
    for key in CONFIG_FIELDS:
        if not hasattr(reference_config, key):
            continue  # e.g. Qwen2Config has no head_dim or attention_bias attribute
        expected = getattr(reference_config, key)
        if isinstance(expected, float):
            # GGUF holds float32: transformers keeps 9.9999997e-06 where we recover 1e-05.
            assert config[key] == pytest.approx(expected, rel=1e-6), key
        else:
            assert config[key] == expected, key
    assert config["torch_dtype"] == "float32"


# ------------------------------------------------------------------------------------------------
# The real SmolLM2 file


@pytest.fixture(scope="module")
def checkpoint():
    return smollm2_checkpoint()


@pytest.fixture(scope="module")
def reference_model():
    return transformers_model()


def test_tensors_equal_transformers(checkpoint, reference_model):
    _assert_tensors_match(checkpoint, reference_model)


def test_config_matches_transformers(checkpoint, reference_model):
    _assert_config_matches(checkpoint.config, reference_model.config)


def test_smollm2_config(checkpoint):
    config = checkpoint.config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (30, 576, 64)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True and config["rope_parameters"]["rope_type"] == "default"
    assert checkpoint.path == smollm2_path()


def test_tensors_are_produced_lazily(checkpoint):
    stream = checkpoint.tensors()
    assert inspect.isgenerator(stream)
    name, tensor = next(stream)
    assert (name, tuple(tensor.shape)) == ("model.embed_tokens.weight", (49152, 576))


def test_tokenizer_comes_from_the_same_file(checkpoint):
    assert checkpoint.tokenizer().encode("Hello world") == smollm2_tokenizer().encode("Hello world")


def test_unpermute_inverts_llama_cpp_order():
    num_heads, head_dim, in_features = 3, 8, 5
    hf = np.arange(num_heads * head_dim * in_features, dtype=np.float32).reshape(-1, in_features)
    # llama.cpp's order: within each head, row i of the first half then row i of the second half.
    halves = hf.reshape(num_heads, 2, head_dim // 2, in_features)
    gguf_order = np.stack([halves[:, 0], halves[:, 1]], axis=2).reshape(hf.shape)
    assert np.array_equal(_unpermute_rope_rows(gguf_order, num_heads), hf)
    bias = np.arange(num_heads * head_dim, dtype=np.float32)
    bias_halves = bias.reshape(num_heads, 2, head_dim // 2)
    bias_gguf = np.stack([bias_halves[:, 0], bias_halves[:, 1]], axis=2).reshape(bias.shape)
    assert np.array_equal(_unpermute_rope_rows(bias_gguf, num_heads), bias)


# ------------------------------------------------------------------------------------------------
# Small synthetic Qwen models, written here


def _write_tiny_model(path: Path, architecture: str, *, head_dim: int, tied: bool,
                      qkv_bias: bool = False, qk_norm: bool = False, drop: str | None = None) -> Path:
    vocab_size, hidden, intermediate, num_layers, num_heads, num_kv_heads = 32, 32, 24, 2, 4, 2
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_block_count(num_layers)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab_size)
    if qk_norm:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)

    shapes = decoder_shapes(vocab=vocab_size, hidden=hidden, heads=num_heads, kv_heads=num_kv_heads,
                            head_dim=head_dim, intermediate=intermediate, layers=num_layers, tied=tied,
                            qk_norm=qk_norm)
    if qkv_bias:
        for layer in range(num_layers):
            block = f"blk.{layer}."
            shapes |= {block + "attn_q.bias": (num_heads * head_dim,),
                       block + "attn_k.bias": (num_kv_heads * head_dim,),
                       block + "attn_v.bias": (num_kv_heads * head_dim,)}
    for name, shape in shapes.items():
        if name != drop:
            values = rng.standard_normal(shape).astype(np.float32)
            # Store the big matrices as F16 to cover a second storage type.
            writer.add_tensor(name, values.astype(np.float16) if len(shape) == 2 else values)
    finish(writer)
    return path


@pytest.mark.parametrize(
    "architecture, options",
    [
        ("qwen2", {"head_dim": 8, "tied": False, "qkv_bias": True}),
        # transformers 4.57 ignores qwen3.attention.key_length and assumes head_dim 128, so use that.
        ("qwen3", {"head_dim": 128, "tied": True, "qk_norm": True}),
    ],
)
def test_qwen_models_match_transformers(tmp_path, architecture, options):
    path = _write_tiny_model(tmp_path / f"{architecture}.gguf", architecture, **options)
    checkpoint = load_gguf(path)
    reference = _load_reference(path)
    assert checkpoint.config["model_type"] == architecture
    assert checkpoint.config["head_dim"] == options["head_dim"]
    _assert_config_matches(checkpoint.config, reference.config)
    _assert_tensors_match(checkpoint, reference)


# ------------------------------------------------------------------------------------------------
# Errors


def test_missing_file(tmp_path):
    path = tmp_path / "absent.gguf"
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        load_gguf(path)
    # A directory, and a path under a file, are not GGUF files either: the same error, naming the path.
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        open_gguf_reader(tmp_path)
    (tmp_path / "plain").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match="plain/x.gguf"):
        open_gguf_reader(tmp_path / "plain" / "x.gguf")


@pytest.mark.parametrize("kept_fraction", [0.0000002, 0.01, 0.9999999])
def test_truncated_copy_of_real_file(tmp_path, kept_fraction):
    source = smollm2_path()
    size_bytes = source.stat().st_size
    truncated = tmp_path / "truncated.gguf"
    with source.open("rb") as src, truncated.open("wb") as dst:
        dst.write(src.read(int(size_bytes * kept_fraction)))
    with pytest.raises(ValueError, match=r"truncated\.gguf.*(corrupt|truncated)"):
        load_gguf(truncated)


@pytest.mark.parametrize("prefix", [b"", b"GGUF", b"GGUF\x03\x00\x00\x00"])
def test_garbage_bytes(tmp_path, prefix):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(prefix + random.Random(len(prefix)).randbytes(64 * 1024))
    with pytest.raises(ValueError, match=r"garbage\.gguf.*(GGUF|corrupt)"):
        load_gguf(path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf: not a GGUF file"):
        load_gguf(path)


def test_unknown_architecture(tmp_path):
    path = _write_tiny_model(tmp_path / "mamba.gguf", "mamba", head_dim=8, tied=True)
    with pytest.raises(ValueError, match=r"mamba\.gguf: architecture 'mamba' is not supported"):
        load_gguf(path)


def test_missing_tensor(tmp_path):
    path = _write_tiny_model(tmp_path / "holey.gguf", "qwen2", head_dim=8, tied=True, qkv_bias=True,
                             drop="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match=r"holey\.gguf: missing tensors \['blk\.1\.ffn_up\.weight'\]"):
        load_gguf(path)


def test_an_unchanged_file_reopened_reuses_its_reader_and_a_changed_one_is_read_again(tmp_path):
    """``open_gguf_reader`` keeps the last few readers: the same unchanged file gets its reader back (no second
    header parse); a file rewritten since is parsed again, and a damaged rewrite still fails."""
    # A small GGUF file of our own: the cache keys on the file, not its size (a copy of the 270 MB SmolLM2
    # file cost two writes of it and a header parse of its 49k-token vocabulary, ~8 s, for the same check).
    copy = _write_tiny_model(tmp_path / "copy.gguf", "qwen2", head_dim=8, tied=False)
    whole = copy.read_bytes()
    first = open_gguf_reader(copy)
    assert open_gguf_reader(copy) is first and open_gguf_reader(str(copy)) is first
    copy.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"copy\.gguf.*(corrupt|truncated)"):
        open_gguf_reader(copy)
