"""``pdserve up``'s flag table: every flag of the router and the workers is handed to its processes or left out
with a reason, each process parses what it is handed back to the config ``up`` was told, and no secret is on a
child's command line. Pure: no process starts."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from services.cli import build_parser, engine_argv, main
from services.common.config_flags import config_from_args, flag
from services.common.tls import tls_from_args
from services.launch import up, up_flags
from services.launch.up_flags import (
    DECODE,
    EVERY,
    EXCLUDED,
    PREFILL,
    ROUTER,
    UP_OWN,
    WORKERS,
    child_environment,
    process_argv,
    up_flag_table,
    up_router_argv,
    up_router_config,
)
from services.router.config import RouterConfig
from services.worker.config import CONFIG_OF_ROLE


def _subcommand(name: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}


def _up(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def _worker_argv(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """Each role's command line as ``up`` builds it (the first worker of each role)."""
    specs = up.up_worker_specs(args, engine_argv(args), up.up_placement(args, 0))
    return {role: argv for role, _, argv in reversed(specs)}


def _worker_config(role: str, argv: tuple[str, ...]):
    args = build_parser().parse_args([role, *argv])
    return config_from_args(CONFIG_OF_ROLE[role], args, tls=tls_from_args(args))


def test_every_flag_of_the_router_and_the_workers_is_handed_on_or_left_out_with_a_reason() -> None:
    """The subcommands' own parsers are the list of what exists: a flag added to any of them later is in the
    table (generated from the same declarations) or the test fails until it is excluded with a reason."""
    table = {f.name: f for f in up_flag_table()}
    accepted = {ROUTER: _options(_subcommand("router")), PREFILL: _options(_subcommand("prefill")),
                DECODE: _options(_subcommand("decode"))}
    for process, options in accepted.items():
        for name in options:
            left_out = EXCLUDED.get(name) or UP_OWN.get(name)
            assert name in table or left_out, f"{process}'s {name} is neither handed on by up nor left out"
            assert not (name in table and left_out), f"{name} is both handed on and left out"
    for name, reason in {**EXCLUDED, **UP_OWN}.items():
        assert reason.strip() and any(name in options for options in accepted.values()), \
            f"{name}: left out without a reason, or no process has such a flag"
    for f in table.values():
        assert f.processes and f.processes <= EVERY
        for process in f.processes:  # handing a flag on never breaks a child's command line
            assert f.name in accepted[process], f"{f.name} handed to the {process}, which does not take it"
    up_options = _options(_subcommand("up"))
    assert set(table) <= up_options and set(UP_OWN) <= up_options
    assert not set(EXCLUDED) & up_options


def test_the_table_follows_the_declarations() -> None:
    table = {f.name: f for f in up_flag_table()}
    assert table["--kv-auth-token"].processes == EVERY  # the cluster token: the router and every worker
    assert table["--kv-auth-token"].env == "PDSERVE_KV_AUTH_TOKEN"
    assert (table["--api-key"].processes, table["--api-key"].env) == ({ROUTER}, "PDSERVE_API_KEY")
    assert {f"--tls-{n}" for n in ("cert", "key", "ca", "server-name")} <= {n for n, f in table.items()
                                                                           if f.processes == EVERY}
    assert table["--no-kv-digest"].processes == WORKERS
    assert table["--kv-lease-s"].processes == {PREFILL}
    assert table["--kv-transfer-timeout-s"].processes == {DECODE}
    for name in ("--routing", "--request-timeout-s", "--planner-slo-ttft-ms", "--planner-slo-itl-ms"):
        assert ROUTER in table[name].processes
    assert {f.name for f in table.values() if f.env} == {"--kv-auth-token", "--api-key"}  # the secrets


def test_a_flag_declared_later_reaches_up_by_itself(monkeypatch: pytest.MonkeyPatch,
                                                    request: pytest.FixtureRequest) -> None:
    @dataclasses.dataclass(frozen=True)
    class Later(RouterConfig):
        brand_new_s: float = flag(1.0, "a router flag nobody listed for up", parse=float)

    monkeypatch.setattr(up_flags, "RouterConfig", Later)
    up_flag_table.cache_clear()  # built once per process: again for the new declaration, and after the test
    request.addfinalizer(up_flag_table.cache_clear)
    (new,) = [f for f in up_flag_table() if f.name == "--brand-new-s"]
    assert new.processes == {ROUTER}
    parser = argparse.ArgumentParser()
    up_flags.add_up_parser(parser.add_subparsers())
    args = parser.parse_args(["up", "--brand-new-s", "2.5"])
    assert process_argv(args, ROUTER) == ["--brand-new-s", "2.5"]


def test_the_flags_reach_their_processes_and_the_secrets_stay_off_every_command_line(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    pem = {}
    for name in ("cert", "key", "ca"):
        pem[name] = tmp_path / f"{name}.pem"
        pem[name].write_text(f"-----BEGIN {name}-----\n")
    args = _up("--api-key", "K-secret", "--kv-auth-token", "T-secret", "--tls-cert", str(pem["cert"]), "--tls-key",
               str(pem["key"]), "--tls-ca", str(pem["ca"]), "--tls-server-name", "pdserve-local", "--no-kv-digest",
               "--kv-lease-s", "12", "--kv-transfer-timeout-s", "7", "--max-request-bytes", "100000",
               "--request-timeout-s", "9", "--routing", "least-outstanding", "--planner-slo-ttft-ms", "500",
               "--planner-slo-itl-ms", "20", "--direct-decode-threshold", "0", "--max-model-len", "4096",
               "--served-model-name", "m", "--enforce-disagg")
    workers, router_argv = _worker_argv(args), up_router_argv(args)
    for argv in (*workers.values(), router_argv):
        assert not {"K-secret", "T-secret", "--api-key", "--kv-auth-token"} & set(argv), argv
    environment = child_environment(args)
    assert environment == {"PDSERVE_API_KEY": "K-secret", "PDSERVE_KV_AUTH_TOKEN": "T-secret"}
    for name, value in environment.items():  # what run_up does: the children inherit its environment
        monkeypatch.setenv(name, value)

    router = up_router_config(args)
    assert (router.api_key, router.kv_auth_token) == ("K-secret", "T-secret")
    assert (router.max_request_bytes, router.request_timeout_s, router.routing) == (100000, 9.0, "least-outstanding")
    assert (router.planner_slo_ttft_ms, router.planner_slo_itl_ms) == (500.0, 20.0)
    assert (router.direct_decode_threshold, router.max_model_len, router.served_model_name) == (0, 4096, "m")
    assert router.enforce_disagg and router.tls is not None and router.tls.server_name == "pdserve-local"
    prefill, decode = (_worker_config(role, workers[role]) for role in (PREFILL, DECODE))
    for config in (prefill, decode):
        assert (config.kv_auth_token, config.kv_digest, config.tls.server_name) == ("T-secret", False,
                                                                                    "pdserve-local")
        assert config.max_request_bytes == 100000  # the router's limit is the workers' too
    assert prefill.kv_lease_s == 12.0 and "--kv-transfer-timeout-s" not in workers[PREFILL]
    assert decode.kv_transfer_timeout_s == 7.0 and "--kv-lease-s" not in workers[DECODE]
    assert "--routing" not in workers[PREFILL] + workers[DECODE]  # a router flag stays with the router


def test_unset_flags_hand_on_nothing_and_the_environment_works_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without flags the children get none of the table's (their own defaults hold), and a ``PDSERVE_*``
    variable set for ``up`` reaches each process that reads it by inheritance, as if given as a flag."""
    args = _up()
    assert up_router_argv(args) == [] and child_environment(args) == {}
    assert process_argv(args, PREFILL) == process_argv(args, DECODE) == []
    workers = _worker_argv(args)
    assert up_router_config(args) == RouterConfig(decode=("127.0.0.1:1",), prefill=("127.0.0.1:2",))
    for role in (PREFILL, DECODE):
        assert _worker_config(role, workers[role]) == CONFIG_OF_ROLE[role]()
    monkeypatch.setenv("PDSERVE_KV_AUTH_TOKEN", "from-env")
    monkeypatch.setenv("PDSERVE_API_KEY", "key-from-env")
    monkeypatch.setenv("PDSERVE_ENFORCE_DISAGG", "1")
    args = _up()
    assert child_environment(args) == {} and up_router_argv(args) == []
    router = up_router_config(args)
    assert (router.api_key, router.kv_auth_token, router.enforce_disagg) == ("key-from-env", "from-env", True)
    assert all(_worker_config(role, workers[role]).kv_auth_token == "from-env" for role in (PREFILL, DECODE))


def test_role_switching_workers_get_both_roles_flags() -> None:
    workers = _worker_argv(_up("--role-planner", "--kv-lease-s", "5", "--kv-transfer-timeout-s", "6"))
    assert workers[PREFILL] == workers[DECODE]
    assert {"--kv-lease-s", "--kv-transfer-timeout-s", "--role-switching"} <= set(workers[DECODE])


def test_bad_values_stop_up_before_anything_starts(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _up("--kv-lease-s", "soon")  # the child's own parser, at up's parse
    with pytest.raises(SystemExit):
        _up("--routing", "random")
    with pytest.raises(ValueError, match="request_timeout_s must be > 0"):
        up_router_config(_up("--request-timeout-s", "0"))  # the router's config rules
    with pytest.raises(ValueError, match="direct_decode_threshold must be >= 0"):
        up_router_config(_up("--direct-decode-threshold", "-1"))
    assert main(["up", "--device", "cpu", "--tls-cert", str(tmp_path / "missing.pem")]) == 2
    assert "mTLS needs --tls-cert, --tls-key and --tls-ca together" in capsys.readouterr().err


def test_up_waits_for_the_workers_drain_before_it_kills_them() -> None:
    assert up.stop_timeout_s(_up()) == 45.0
    assert up.stop_timeout_s(_up("--drain-timeout-s", "120")) == 135.0
