"""The engine's speed switches: each is an ``EngineConfig`` field with a flag that reaches the config from
``pdserve prefill|decode|up``, every rank's runtime applies them to its process (a TP follower builds the same
``RankRuntime``), and a ``PDSERVE_*`` variable that is set still wins (the benches flip them per run). CPU only."""

from __future__ import annotations

import pytest
import torch

from services.cli import build_parser, engine_argv, engine_config_from_args
from services.engine import ops, triton_support
from services.engine.attention import triton_paged
from services.engine.engine_config import EngineConfig
from services.engine.loading.source import resolve_model
from services.engine.runner.rank_runtime import RankRuntime
from services.launch import up

# Every switch away from its default, as a command line.
OFF = ("--no-pdl", "--no-decode-gemv", "--no-fused-kv-write", "--dense-min-query", "0", "--prefill-graph-tokens",
       "0", "--fused-ops", "torch")
_OVERRIDES = (ops.ENV_VAR, ops.KV_WRITE_ENV_VAR, ops.GEMV_ENV_VAR, triton_support.PDL_ENV_VAR,
              triton_paged.DENSE_MIN_QUERY_ENV)
_STATE = ((ops, "_backend"), (ops, "_fused_kv_write"), (ops, "_decode_gemv"), (triton_support, "_pdl"),
          (triton_paged, "_dense_min_query"))


def _switches(config: EngineConfig) -> tuple:
    return (config.pdl, config.decode_gemv, config.fused_kv_write, config.dense_min_query,
            config.prefill_graph_tokens, config.fused_ops)


def _process() -> tuple:
    """What the process runs with: (backend, fused K/V write, GEMV, PDL, dense threshold on CUDA)."""
    return (ops.get_backend(), ops._fused_kv_write, ops._decode_gemv, triton_support._pdl,
            triton_paged.TritonPagedBackend().dense_threshold(torch.device("cuda")))


@pytest.fixture
def process_state(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No override variable set; every process-wide switch restored after the test."""
    for name in _OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    for module, name in _STATE:
        monkeypatch.setattr(module, name, getattr(module, name))
    return monkeypatch


def _runtime(**switches) -> RankRuntime:
    return RankRuntime(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=16, **switches),
                       resolve_model("dummy:tiny"))


def test_the_flags_reach_the_engine_config() -> None:
    """Absent, every switch keeps today's default; given to a worker or to ``up`` (which hands the engine's flags
    to every worker), each reaches the worker's config."""
    parser = build_parser()
    default = engine_config_from_args(parser.parse_args(["prefill"]))
    assert default == EngineConfig()
    assert _switches(default) == (True, True, True, triton_paged.DENSE_MIN_QUERY, 1024, None)
    for role in ("prefill", "decode"):
        assert _switches(engine_config_from_args(parser.parse_args([role, *OFF]))) == (False, False, False, 0, 0,
                                                                                        "torch")
    args = parser.parse_args(["up", "--device", "cpu", *OFF])
    for role, _, argv in up.up_worker_specs(args, engine_argv(args), up.up_placement(args, 0)):
        assert _switches(engine_config_from_args(parser.parse_args([role, *argv]))) == (False, False, False, 0, 0,
                                                                                         "torch")
    with pytest.raises(SystemExit):
        parser.parse_args(["prefill", "--dense-min-query", "-1"])
    with pytest.raises(ValueError, match="dense_min_query"):
        EngineConfig(dense_min_query=-1)


def test_each_rank_applies_its_config(process_state: pytest.MonkeyPatch) -> None:
    """The runtime sets the process's switches from its config; the defaults are today's (a backend of None
    leaves the fused ops' backend as it was)."""
    with ops.use_backend("auto"):
        _runtime(fused_ops="torch", decode_gemv=False, fused_kv_write=False, pdl=False, dense_min_query=0)
        assert _process() == ("torch", False, False, False, 0)
        _runtime()
        assert _process() == ("torch", True, True, True, triton_paged.DENSE_MIN_QUERY)


def test_a_set_variable_wins_over_the_config(process_state: pytest.MonkeyPatch) -> None:
    """Each variable, set (the process read its value at import), keeps its switch whatever the config says."""
    values = {ops.ENV_VAR: "0", ops.KV_WRITE_ENV_VAR: "0", ops.GEMV_ENV_VAR: "0", triton_support.PDL_ENV_VAR: "0",
              triton_paged.DENSE_MIN_QUERY_ENV: "0"}
    for name, value in values.items():
        process_state.setenv(name, value)
    imported = (("torch", ops, "_backend"), (False, ops, "_fused_kv_write"), (False, ops, "_decode_gemv"),
                (False, triton_support, "_pdl"), (0, triton_paged, "_dense_min_query"))
    for value, module, name in imported:  # as the import read them
        process_state.setattr(module, name, value)
    _runtime(fused_ops="triton", decode_gemv=True, fused_kv_write=True, pdl=True, dense_min_query=512)
    assert _process() == ("torch", False, False, False, 0)
