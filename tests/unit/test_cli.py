"""``python -m services.cli generate`` end to end, as a user runs it; ``pdserve up``'s flags and worker argv.

stdout carries the completion and nothing else (one line), so the command composes in a shell
pipeline; the bundled SmolLM2 answers greedily and deterministically. Each call parses and
dequantizes the GGUF (~10 s), so there are only three. The ``up`` tests build the workers' command
lines from a pretended GPU count and start no process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import build_parser, engine_argv, main
from services.kv.spec.layout import BlockOrder, LayoutKind
from services.launch import up
from services.text.default_model import default_model_path

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # generous: a loaded 2-core CI machine is several times slower than idle
STORY_START = ", the city of Nova Haven was a thriving metropolis, with towering skyscrapers and bustling streets."


@pytest.fixture(scope="module")
def model_path() -> Path:
    """The bundled GGUF; not installed is a failure (``make install`` installs it), never a skip."""
    return default_model_path()


def _generate(*args: str) -> str:
    """Run the CLI; assert it succeeded and printed exactly one line; return that line."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n") and proc.stdout.count("\n") == 1, f"stdout: {proc.stdout!r}"
    return proc.stdout.removesuffix("\n")


def test_chat_answers_the_capital_of_france(model_path: Path) -> None:
    # No --model: the default resolves to the bundled file.
    line = _generate("--chat", "--prompt", "What is the capital of France?")
    assert "Paris" in line


def test_greedy_story_continuation(model_path: Path) -> None:
    line = _generate("--model", str(model_path), "--prompt", "Once upon a time", "--max-tokens", "24")
    assert line.startswith(STORY_START), line


def test_dummy_model() -> None:
    line = _generate("--model", "dummy:tiny", "--prompt", "hi", "--max-tokens", "4")
    assert line.strip()


def _flag(argv: tuple[str, ...], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _up_specs(cmdline: str, num_gpus: int) -> tuple[list[tuple[str, None, tuple[str, ...]]], str]:
    """Parse ``pdserve up <cmdline>`` and build its worker specs as if ``num_gpus`` GPUs were visible."""
    args = build_parser().parse_args(["up", *cmdline.split()])
    placement = up.up_placement(args, num_gpus)
    return up.up_worker_specs(args, engine_argv(args), placement), placement.explanation


def test_tp_flag_on_every_engine_command() -> None:
    parser = build_parser()
    assert parser.parse_args(["generate", "--prompt", "x"]).tp == 1
    args = parser.parse_args(["decode", "--tp", "2", "--device", "cuda:0,cuda:1"])
    assert args.tp == 2 and _flag(tuple(engine_argv(args)), "--tp") == "2"
    with pytest.raises(SystemExit):
        parser.parse_args(["prefill", "--tp", "0"])


def test_up_defaults_on_cpu() -> None:
    specs, explanation = _up_specs("", num_gpus=0)
    assert [role for role, _, _ in specs] == ["prefill", "decode"]
    for _, model, argv in specs:
        assert model is None
        assert (_flag(argv, "--device"), _flag(argv, "--tp"), _flag(argv, "--block-size")) == ("cpu", "1", "16")
    assert "no GPU visible" in explanation


def test_up_per_role_flags() -> None:
    specs, explanation = _up_specs("--num-decode 2 --tp 2 --decode-tp 1 --block-size 8 --prefill-block-size 4 "
                                   "--kv-layout per_layer --decode-gpus 3,2", num_gpus=4)
    by_role = [(role, _flag(a, "--device"), _flag(a, "--tp"), _flag(a, "--block-size")) for role, _, a in specs]
    assert by_role == [("prefill", "cuda:0,cuda:1", "2", "4"), ("decode", "cuda:3", "1", "8"),
                       ("decode", "cuda:2", "1", "8")]
    assert all(_flag(a, "--kv-layout") == "per_layer" for _, _, a in specs)  # shared flags reach every worker
    assert all(a.count("--device") == a.count("--tp") == a.count("--block-size") == 1 for _, _, a in specs)
    assert "--decode-gpus 3,2" in explanation


def test_up_role_planner_starts_switchable_workers_with_one_engine_shape() -> None:
    from services.launch.up import up_router_argv

    specs, _ = _up_specs("--role-planner --num-prefill 1 --num-decode 2", num_gpus=0)
    assert [role for role, _, _ in specs] == ["prefill", "decode", "decode"]
    assert all("--role-switching" in a for _, _, a in specs)
    assert len({tuple(a) for _, _, a in specs}) == 1  # the same flags for every worker
    assert "--role-planner" in up_router_argv(build_parser().parse_args(["up", "--role-planner"]))
    argv = up_router_argv(build_parser().parse_args(["up", "--role-planner", "--planner-interval-s", "2.5"]))
    assert argv[argv.index("--planner-interval-s") + 1] == "2.5"
    assert "--planner-interval-s" not in up_router_argv(build_parser().parse_args(["up"]))  # the router's default
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["up", "--planner-interval-s", bad])
    with pytest.raises(ValueError, match="--prefill-tp and --decode-tp"):
        _up_specs("--role-planner --prefill-tp 2", num_gpus=4)


def test_up_explicit_device_cpu_wins_over_gpus() -> None:
    specs, explanation = _up_specs("--device cpu --tp 2", num_gpus=8)
    assert [_flag(a, "--device") for _, _, a in specs] == ["cpu", "cpu"]
    assert "--device cpu" in explanation


def test_up_device_list_is_the_gpu_pool() -> None:
    specs, _ = _up_specs("--device cuda:4,cuda:5", num_gpus=8)
    assert [_flag(a, "--device") for _, _, a in specs] == ["cuda:4", "cuda:5"]


def test_up_rejects_bad_flags_before_starting(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--prefill-gpus", "0,x"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--decode-tp", "0"])
    monkeypatch.setattr(up, "detect_gpus", lambda: 2)
    assert main(["up", "--prefill-tp", "4"]) == 2
    assert "tp 4 worker needs 4 distinct GPUs" in capsys.readouterr().err
    assert main(["up", "--tp", "2", "--prefill-gpus", "0"]) == 2
    assert "--prefill-gpus 0: lists 1 GPU(s)" in capsys.readouterr().err


def test_up_picks_the_heads_outer_layout_for_mixed_tp_unless_told() -> None:
    """Each worker learns the other role's TP size (--peer-tp-size); with --kv-layout auto, different sizes
    give heads-outer HND blocks (a decode rank's head slice of a block is one run), equal ones cross-layer."""
    from services.cli import engine_config_from_args

    def layouts(cmdline: str) -> dict[str, tuple[str, LayoutKind, BlockOrder]]:
        specs, _ = _up_specs(cmdline, num_gpus=0)
        out = {}
        for role, _, argv in specs:
            config = engine_config_from_args(build_parser().parse_args([role, *argv]))
            out[role] = (_flag(argv, "--peer-tp-size"), *config.kv_layout_choice())
        return out

    heads_outer, cross = (LayoutKind.HEADS_OUTER, BlockOrder.HND), (LayoutKind.CROSS_LAYER, BlockOrder.NHD)
    assert layouts("--prefill-tp 1 --decode-tp 2 --device cpu") == {"prefill": ("2", *heads_outer),
                                                                    "decode": ("1", *heads_outer)}
    assert layouts("--tp 2 --device cpu") == {"prefill": ("2", *cross), "decode": ("2", *cross)}
    told = layouts("--prefill-tp 1 --decode-tp 2 --kv-block-order NHD --device cpu")
    assert {v[1:] for v in told.values()} == {(LayoutKind.CROSS_LAYER, BlockOrder.NHD)}
    told = layouts("--prefill-tp 2 --decode-tp 1 --kv-layout cross_layer --device cpu")
    assert {v[1:] for v in told.values()} == {(LayoutKind.CROSS_LAYER, BlockOrder.HND)}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--peer-tp-size", "0"])
    with pytest.raises(ValueError, match="--kv-block-order NHD cannot go with it"):
        engine_config_from_args(build_parser().parse_args(["decode", "--kv-layout", "heads_outer",
                                                           "--kv-block-order", "NHD"]))


def test_host_kv_tier_flags_reach_every_worker_and_the_engine_config() -> None:
    from services.cli import engine_config_from_args

    specs, _ = _up_specs("--kv-offload-gib 2.5 --kv-offload-block-factor 4", num_gpus=0)
    assert all((_flag(a, "--kv-offload-gib"), _flag(a, "--kv-offload-block-factor")) == ("2.5", "4")
               for _, _, a in specs)
    config = engine_config_from_args(build_parser().parse_args(["prefill", "--kv-offload-gib", "0.5",
                                                                "--kv-offload-block-factor", "2"]))
    assert (config.kv_offload_bytes, config.kv_offload_block_factor) == (2**29, 2)
    assert engine_config_from_args(build_parser().parse_args(["decode"])).kv_offload_bytes is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--kv-offload-block-factor", "0"])


def test_engine_flags_are_the_config_fields_and_reach_a_child_whole() -> None:
    """The engine's flags are declared once, on EngineConfig: a command line setting every one of them
    builds that config, and the argv a launcher hands a child builds the same config there."""
    import dataclasses

    from services.cli import engine_config_from_args
    from services.engine.engine_config import EngineConfig

    cmd = ["prefill", "--model", "dummy:tiny", "--dtype", "float32", "--device", "cpu", "--seed", "3",
           "--block-size", "32", "--tp", "2", "--kv-layout", "per_layer", "--kv-block-order", "HND",
           "--peer-tp-size", "1", "--num-kv-blocks", "64", "--max-model-len", "512", "--max-num-seqs", "8",
           "--max-num-batched-tokens", "256", "--no-prefix-caching", "--enforce-eager", "--no-async-scheduling",
           "--no-kv-shared-prefill-skip",
           "--fused-ops", "torch", "--attention-backend", "torch_sdpa", "--kv-offload-block-factor", "2",
           "--prefill-graph-tokens", "512", "--no-decode-gemv", "--no-fused-kv-write", "--no-pdl",
           "--dense-min-query", "2048", "--quantization", "none", "--kv-cache-dtype", "fp8_e4m3"]
    parser = build_parser()
    config = engine_config_from_args(parser.parse_args(cmd))
    child = engine_config_from_args(parser.parse_args(["decode", *engine_argv(parser.parse_args(cmd))]))
    assert child == config
    flagged = {f.name for f in dataclasses.fields(EngineConfig) if f.metadata}
    changed = {name for name in flagged if getattr(config, name) != getattr(EngineConfig(), name)}
    # Every flag was set (the host tier's size needs prefix caching and TP 1: its own test sets it).
    assert flagged - changed == {"kv_offload_bytes"}


def test_worker_flags_are_the_role_config_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each role's flags come from its config type (both roles' with --role-switching); the cluster token
    defaults to $PDSERVE_KV_AUTH_TOKEN."""
    from services.common.config_flags import config_from_args
    from services.worker.config import DecodeConfig, PrefillConfig, SwitchableConfig

    monkeypatch.setenv("PDSERVE_KV_AUTH_TOKEN", "s3cret")
    args = build_parser().parse_args(["prefill", "--port", "7001", "--kv-lease-s", "5", "--engine-id", "p0"])
    assert config_from_args(PrefillConfig, args) == PrefillConfig(port=7001, kv_lease_s=5.0, engine_id="p0",
                                                                  kv_auth_token="s3cret")
    args = build_parser().parse_args(["decode", "--kv-transfer-timeout-s", "2", "--kv-auth-token", "other"])
    assert config_from_args(DecodeConfig, args) == DecodeConfig(kv_transfer_timeout_s=2.0, kv_auth_token="other")
    # A worker that may switch roles (--role-switching) takes the other role's settings too.
    args = build_parser().parse_args(["decode", "--kv-lease-s", "5", "--role-switching"])
    assert args.role_switching and config_from_args(SwitchableConfig, args) == SwitchableConfig(
        kv_lease_s=5.0, role_switching=True, kv_auth_token="s3cret")
    assert not build_parser().parse_args(["prefill"]).role_switching
    args = build_parser().parse_args(["decode", "--kv-transfer-timeout-s", "2", "--kv-auth-token", "other"])
    # The KV digest is on unless a worker is told otherwise (both roles take the switch).
    assert config_from_args(DecodeConfig, args).kv_digest
    for role, config in (("prefill", PrefillConfig), ("decode", DecodeConfig)):
        assert not config_from_args(config, build_parser().parse_args([role, "--no-kv-digest"])).kv_digest



def test_kv_staging_area_defaults_to_gpu_only_and_takes_the_flag() -> None:
    from services.common.config_flags import config_from_args
    from services.worker.config import DecodeConfig, PrefillConfig
    from services.worker.kv_ranks import staging_mib

    for role, config in (("prefill", PrefillConfig), ("decode", DecodeConfig)):
        default = config_from_args(config, build_parser().parse_args([role]))
        assert (staging_mib(default, "cuda"), staging_mib(default, "cpu")) == (512, 0)
        sized = config_from_args(config, build_parser().parse_args([role, "--kv-staging-mib", "64"]))
        assert (staging_mib(sized, "cuda"), staging_mib(sized, "cpu")) == (64, 64)
    with pytest.raises(ValueError, match="kv-staging-mib"):
        staging_mib(DecodeConfig(kv_staging_mib=-1), "cpu")
