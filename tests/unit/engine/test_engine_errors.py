"""Bad input gets a clear error naming the problem, and changes nothing.

Loading: a damaged checkpoint (config, weight files, tensors) or a model argument the engine
cannot use raises ValueError / FileNotFoundError naming the file, field or tensor. Requests: a
bad prompt, request id or sampling parameter raises ValueError, after which the same engine still
serves a valid request with the right tokens and every KV block is free again. The CLI turns such
an error into exit code 2 and one ``pdserve: error:`` line on stderr.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.contract.sampling_params import SamplingParams
from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[3]
WEIGHTS = "model.safetensors"
NUM_BLOCKS = 32
BLOCK_SIZE = 4  # 128-token KV pool, so max_model_len is 128
VALID_PROMPT = [11, 42, 7, 99, 250, 3, 64]
NUM_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
# Whitespace-split words; "hello"/"world" are valid ids of the 320-token checkpoint.
TOKENIZER_VOCAB = {"[UNK]": 0, "hello": 5, "world": 6}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, list[int]]:
    """A llama checkpoint with a tiny word-level tokenizer, and HF's greedy tokens for VALID_PROMPT."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory, hf = make_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    hf.generation_config.eos_token_id = None  # like ignore_eos
    tokenizer = Tokenizer(models.WordLevel(TOKENIZER_VOCAB, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([VALID_PROMPT]), attention_mask=torch.ones(1, len(VALID_PROMPT), dtype=torch.long),
            max_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0,
        )
    return directory, out[0, len(VALID_PROMPT):].tolist()


@pytest.fixture(scope="module")
def engine(checkpoint) -> LLMEngine:
    return _load(checkpoint[0])


@pytest.fixture
def expected_tokens(checkpoint) -> list[int]:
    return checkpoint[1]


def _load(model: str | Path) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model), device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS,
    ))


def _assert_still_serves(engine: LLMEngine, expected_tokens: list[int]) -> None:
    """Nothing is queued or held, a valid request gets HF's tokens, and every block is free again."""
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.pool(0).num_free_blocks == NUM_BLOCKS
    [out] = engine.generate([VALID_PROMPT], GREEDY)
    assert out.token_ids == expected_tokens
    assert engine.kv_manager.pool(0).num_free_blocks == NUM_BLOCKS


# ---- loading ---------------------------------------------------------------------------------------


def _damaged(checkpoint, tmp_path: Path, damage: Callable[[Path], None]) -> Path:
    directory = tmp_path / "damaged"
    shutil.copytree(checkpoint[0], directory)
    damage(directory)
    return directory


def _edit_config(**changes) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        config.update(changes)
        for key in [k for k, v in changes.items() if v is None]:
            del config[key]
        (directory / "config.json").write_text(json.dumps(config))
    return damage


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda directory: (directory / name).write_bytes(data)


def _truncate(directory: Path) -> None:
    data = (directory / WEIGHTS).read_bytes()
    (directory / WEIGHTS).write_bytes(data[: len(data) // 2])


def _edit_tensors(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        tensors = load_file(directory / WEIGHTS)
        edit(tensors)
        save_file(tensors, directory / WEIGHTS, metadata={"format": "pt"})
    return damage


def _remove_weights(directory: Path) -> None:
    (directory / WEIGHTS).unlink()


def _index_absent_shard(directory: Path) -> None:
    (directory / WEIGHTS).rename(directory / "model-00001-of-00002.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                  "model.norm.weight": "model-00002-of-00002.safetensors"}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


_K_PROJ = "model.layers.1.self_attn.k_proj.weight"
_UP_PROJ = "model.layers.0.mlp.up_proj.weight"

LOAD_ERRORS = {
    # name: (damage, exception type, text the message must contain)
    "unknown_architecture": (
        _edit_config(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"]), ValueError, "gpt_neox"),
    "missing_config_field": (_edit_config(hidden_size=None), ValueError, "hidden_size"),
    "invalid_json": (_write("config.json", b'{"model_type": "llama",'), ValueError, "not valid JSON"),
    "config_not_an_object": (_write("config.json", b"[]"), ValueError, "JSON object"),
    "no_weight_files": (_remove_weights, FileNotFoundError, "safetensors"),
    "index_names_absent_shard": (_index_absent_shard, FileNotFoundError, "model-00002-of-00002.safetensors"),
    "garbage_weights": (_write(WEIGHTS, os.urandom(4096)), ValueError, WEIGHTS),
    "truncated_weights": (_truncate, ValueError, WEIGHTS),
    "empty_weights": (_write(WEIGHTS, b""), ValueError, WEIGHTS),
    "missing_tensor": (_edit_tensors(lambda t: t.pop(_UP_PROJ)), ValueError, _UP_PROJ),
    "wrong_shape": (_edit_tensors(lambda t: t.update({_UP_PROJ: torch.zeros(128, 63)})), ValueError, _UP_PROJ),
    # More K rows than the config's heads: slicing them would silently load the first rows.
    "oversized_sharded_tensor": (
        _edit_tensors(lambda t: t.update({_K_PROJ: torch.zeros(48, 64)})), ValueError, _K_PROJ),
    "unexpected_tensor": (
        _edit_tensors(lambda t: t.update({"model.layers.7.mlp.up_proj.weight": torch.zeros(1)})),
        ValueError, "model.layers.7.mlp.up_proj.weight"),
}


@pytest.mark.parametrize("case", LOAD_ERRORS)
def test_damaged_checkpoint_is_rejected_by_name(checkpoint, tmp_path: Path, case: str) -> None:
    damage, error, text = LOAD_ERRORS[case]
    directory = _damaged(checkpoint, tmp_path, damage)
    with pytest.raises(error) as info:
        _load(directory)
    assert text in str(info.value)


def test_bad_model_arguments(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="/nonexistent/model"):
        _load("/nonexistent/model")
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        _load(tmp_path / "absent.gguf")
    text_file = tmp_path / "weights.bin"
    text_file.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="weights.bin.*expected a Hugging Face model directory"):
        _load(text_file)
    with pytest.raises(ValueError, match="unknown dummy preset 'no-such-model'"):
        _load("dummy:no-such-model")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        _load(tmp_path)  # a directory, but not a model


# ---- requests --------------------------------------------------------------------------------------


def test_prompt_longer_than_the_context(engine: LLMEngine, expected_tokens: list[int]) -> None:
    assert engine.max_model_len == NUM_BLOCKS * BLOCK_SIZE
    for n in (engine.max_model_len, engine.max_model_len + 50):
        with pytest.raises(ValueError, match=f"prompt has {n} tokens but the context length is 128"):
            engine.add_request("long", [5] * n, GREEDY)
    _assert_still_serves(engine, expected_tokens)
    # The longest accepted prompt leaves room for exactly one token.
    [out] = engine.generate([[5] * (engine.max_model_len - 1)], GREEDY)
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    _assert_still_serves(engine, expected_tokens)


@pytest.mark.parametrize("prompt", ["", "   ", []], ids=["text", "whitespace", "ids"])
def test_empty_prompt(engine: LLMEngine, expected_tokens: list[int], prompt) -> None:
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.add_request("empty", prompt, GREEDY)
    _assert_still_serves(engine, expected_tokens)


def test_text_prompt_through_the_tokenizer(engine: LLMEngine) -> None:
    """The tokenizer used above is live: a non-empty text prompt is served."""
    [out] = engine.generate(["hello world"], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert out.prompt_token_ids == [5, 6] and len(out.token_ids) == 2


@pytest.mark.parametrize("bad", [-1, 320, 10**12, 2.0, True, None], ids=repr)
def test_token_ids_out_of_vocab(engine: LLMEngine, expected_tokens: list[int], bad) -> None:
    with pytest.raises(ValueError, match=r"prompt token ids out of range \[0, 320\)"):
        engine.add_request("oov", [1, 2, bad, 3], GREEDY)
    _assert_still_serves(engine, expected_tokens)


def test_duplicate_request_id(engine: LLMEngine, expected_tokens: list[int]) -> None:
    engine.add_request("dup", VALID_PROMPT, GREEDY)
    with pytest.raises(ValueError, match="'dup'"):
        engine.add_request("dup", [9, 9, 9], SamplingParams(max_tokens=1))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finals["dup"].token_ids == expected_tokens  # the first request, untouched
    _assert_still_serves(engine, expected_tokens)


def test_duplicate_of_a_held_request_id(engine: LLMEngine, expected_tokens: list[int]) -> None:
    """A finished request whose KV is held (for a pull) still owns its id."""
    engine.add_request("held", VALID_PROMPT, SamplingParams(max_tokens=1), hold_kv_on_finish=True)
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="'held'"):
        engine.add_request("held", VALID_PROMPT, GREEDY)
    assert engine.scheduler.release_held("held")
    _assert_still_serves(engine, expected_tokens)


SAMPLING_ERRORS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 4.0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"stop": "END"}, "stop"),
    ({"stop": ["END"]}, "stop"),
    ({"stop": ("",)}, "stop"),
]


@pytest.mark.parametrize(("fields", "name"), SAMPLING_ERRORS, ids=lambda x: repr(x) if isinstance(x, dict) else x)
def test_invalid_sampling_params(engine: LLMEngine, expected_tokens: list[int], fields: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name} must"):
        SamplingParams(**fields)
    with pytest.raises(ValueError, match=f"^{name} must"):
        dataclasses.replace(GREEDY, **fields)
    # A params object that skipped construction checks is still refused at the engine's door.
    forged = dataclasses.replace(GREEDY)
    for key, value in fields.items():
        object.__setattr__(forged, key, value)
    with pytest.raises(ValueError, match=f"^{name} must"):
        engine.add_request("bad-params", VALID_PROMPT, forged)
    _assert_still_serves(engine, expected_tokens)


# ---- CLI -------------------------------------------------------------------------------------------


def test_cli_reports_a_bad_model_in_one_line() -> None:
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "--model", "/nonexistent", "--prompt", "hi"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("pdserve: error: ") and "/nonexistent" in lines[0]
