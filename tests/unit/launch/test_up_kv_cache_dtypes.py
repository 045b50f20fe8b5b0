"""``pdserve up --prefill-kv-cache-dtype/--decode-kv-cache-dtype``: each role's workers get their own KV dtype, and a
staging area when the dtypes differ (a converting pair moves KV staged only), unless one is given."""

from __future__ import annotations

import pytest

from services.cli import build_parser, engine_argv
from services.launch import up


def _role_argv(*argv: str) -> dict[str, list[str]]:
    args = build_parser().parse_args(["up", "--model", "m", *argv])
    specs = up.up_worker_specs(args, engine_argv(args), up.up_placement(args, 0))
    return {role: list(a) for role, _, a in specs}


def _value(argv: list[str], flag: str) -> str | None:
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1] if flag in argv else None


def test_each_role_gets_its_kv_cache_dtype_and_a_staging_area_when_they_differ() -> None:
    argv = _role_argv("--prefill-kv-cache-dtype", "bfloat16", "--decode-kv-cache-dtype", "fp8_e4m3")
    assert _value(argv["prefill"], "--kv-cache-dtype") == "bfloat16"
    assert _value(argv["decode"], "--kv-cache-dtype") == "fp8_e4m3"
    assert _value(argv["prefill"], "--kv-staging-mib") == _value(argv["decode"], "--kv-staging-mib") == \
        str(up.CONVERTING_STAGING_MIB)
    given = _role_argv("--decode-kv-cache-dtype", "fp8_e4m3", "--kv-staging-mib", "32")
    assert _value(given["prefill"], "--kv-cache-dtype") == "auto" and given["prefill"].count("--kv-staging-mib") == 1
    assert _value(given["decode"], "--kv-staging-mib") == "32"
    same = _role_argv("--kv-cache-dtype", "fp8_e4m3")
    assert all(_value(a, "--kv-cache-dtype") == "fp8_e4m3" and "--kv-staging-mib" not in a for a in same.values())


def test_the_role_planner_refuses_kv_dtypes_that_differ() -> None:
    with pytest.raises(ValueError, match="--prefill-kv-cache-dtype and --decode-kv-cache-dtype must not differ"):
        _role_argv("--role-planner", "--decode-kv-cache-dtype", "fp8_e4m3")
